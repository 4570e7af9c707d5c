"""A small prefill/decode (PD) proxy for vLLM instances sharing a kvfabric pool.

Like vLLM's disaggregated-serving example proxies (``disagg_proxy_demo.py``,
``toy_proxy_server.py``), with the standard library and kvfabric's bounded HTTP server only::

    python examples/pd/proxy.py --port 8000 \\
        --prefill http://10.0.0.1:8100 [--prefill ...] --decode http://10.0.0.2:8200 [--decode ...]

Each ``POST /v1/completions`` or ``/v1/chat/completions``:

1. goes to a prefill instance (``kv_role: kv_producer``, round robin) with
   ``max_tokens=1``, no ``min_tokens`` and no streaming: it prefills the
   prompt, saves the KV to the pool, and answers with ``kv_transfer_params``
   naming the chunks it saved (``{"kvfabric": {"chunks": N, ...}}``);
2. then goes, unchanged except for those ``kv_transfer_params``, to a decode
   instance (``kv_role: kv_consumer``, round robin), which loads the prompt's
   KV from the pool (waiting up to its ``pd_wait_ms`` for chunks whose puts
   are still landing) and generates; its answer (streamed or not) is relayed
   to the client as is.

A completion whose ``prompt`` is a batch (a list of strings or of token-id
lists) is prefilled one prompt per request (vLLM answers a batch with the
first prompt's ``kv_transfer_params`` only), in parallel, and the decode
instance gets them merged: ``{"kvfabric": {"batch": [one entry per
prompt]}}``; each of its prompts takes the entry whose key is its own.

If the prefill instance fails (down, error status), the request still goes to
a decode instance without ``kv_transfer_params``: it computes the prompt
itself. The decode instance's errors are relayed with their status. ``GET
/health`` answers 200 when every instance does; ``GET /v1/models`` is the
first decode instance's; ``GET /stats`` gives the proxy's counts (requests,
prefill_failures, with_params: decode requests sent with the producer's
``kv_transfer_params``).

Every limit is an option with a default (``--help``; docs/notes/security.md
says what a hostile client can do within them): at most ``--max-connections``
connections are served at once, each by one thread, and the one after is
answered 503 and closed without a thread; the request line and headers must
arrive within ``--header-timeout-s`` (an idle keep-alive connection is closed
after that long too) and be at most ``--max-header-bytes`` (431); a body needs
one decimal ``Content-Length`` (else 400; 411 without one) of at most
``--max-body-bytes`` (413), checked before a byte of it is read, and must
arrive within ``--body-timeout-s``; chunked request bodies
(``Transfer-Encoding``) are refused with 501; the bodies held at once are at
most ``--max-body-total`` bytes (then 503). An answer read from an instance
whole (the prefill's, a non-streamed decode answer, ``/v1/models``) is at most
``--max-response-bytes`` (else the prefill counts as failed, and a decode
answer is 502); streamed answers are relayed 64 KiB at a time. The HTTP server
is :mod:`kvfabric.server.httpd`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import sys
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from kvfabric.server.httpd import BoundedHandler, BoundedHTTPServer, Limits
from kvfabric.sizes import parse_size

__all__ = ["PDProxy", "main"]

log = logging.getLogger("kvfabric.pd_proxy")
_RELAY_BYTES = 64 << 10
_PREFILL_THREADS = 8        # a batch's prompts prefilled at once
#: Defaults of the limits (``--help`` shows them): 64 connections, far more requests at once than the
#: instances behind one proxy batch, with one thread each; 10 s for a head a client sends at once;
#: 60 s for a body of up to 64 MiB (a 128K-token prompt as JSON is ~1 MiB); bodies held at once:
#: four full ones; an answer read whole: a non-streamed completion is kilobytes.
DEFAULT_LIMITS = Limits(max_connections=64, header_timeout_s=10.0, body_timeout_s=60.0,
                        max_header_bytes=64 << 10, max_body_bytes=64 << 20)
DEFAULT_MAX_BODY_TOTAL = 256 << 20
DEFAULT_MAX_RESPONSE_BYTES = 64 << 20


class UpstreamTooLarge(ValueError):
    """An instance's answer is over ``--max-response-bytes``."""


class PDProxy(BoundedHTTPServer):
    """The HTTP server; ``prefill`` / ``decode`` are base URLs, used round robin."""

    def __init__(self, addr: tuple[str, int], prefill: list[str], decode: list[str], timeout_s: float,
                 limits: Limits = DEFAULT_LIMITS, max_body_total: int = DEFAULT_MAX_BODY_TOTAL,
                 max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES) -> None:
        if not prefill or not decode:
            raise ValueError("at least one prefill and one decode instance are needed")
        if max_body_total < limits.max_body_bytes or max_response_bytes < 1:
            raise ValueError("max_body_total must be >= max_body_bytes and max_response_bytes >= 1")
        super().__init__(addr, _Handler, limits)
        self.prefill, self.decode = prefill, decode
        self.timeout_s = timeout_s
        self.max_body_total, self.max_response_bytes = max_body_total, max_response_bytes
        self.body_bytes = 0                     # bodies being read or held now, bytes
        self._lock = threading.Lock()
        self._rr_p, self._rr_d = itertools.cycle(prefill), itertools.cycle(decode)
        self.counts = {"requests": 0, "prefill_failures": 0, "with_params": 0}

    def next_instances(self) -> tuple[str, str]:
        with self._lock:
            self.counts["requests"] += 1
            return next(self._rr_p), next(self._rr_d)

    def count(self, name: str) -> None:
        with self._lock:
            self.counts[name] += 1

    def take_body(self, n: int) -> bool:
        with self._lock:
            if self.body_bytes + n > self.max_body_total:
                return False
            self.body_bytes += n
            return True

    def give_body(self, n: int) -> None:
        with self._lock:
            self.body_bytes -= n


def _batch(body: dict) -> list | None:
    """The prompts of a batch completion (2 or more strings or token-id lists), else None."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) > 1 and (all(isinstance(x, str) for x in p) or
                                               all(isinstance(x, list) for x in p)):
        return p
    return None


def _post(url: str, body: dict, headers: dict[str, str], timeout_s: float):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json", **headers})
    return urllib.request.urlopen(req, timeout=timeout_s)


def _read_capped(upstream, cap: int) -> bytes:
    """An instance's whole answer, at most ``cap`` bytes (UpstreamTooLarge otherwise)."""
    length = _length(upstream, cap)
    data = upstream.read(cap + 1 if length is None else length)
    if len(data) > cap:
        raise UpstreamTooLarge(f"answer over {cap} bytes")
    return data


def _length(upstream, cap: int) -> int | None:
    """The answer's Content-Length (None without one); UpstreamTooLarge when bad or over ``cap``."""
    length = upstream.headers.get("Content-Length")
    if length is None:
        return None
    if not length.strip().isdecimal() or int(length) > cap:
        raise UpstreamTooLarge(f"answer of Content-Length {length!r}: not a number of at most {cap} bytes")
    return int(length)


class _Handler(BoundedHandler):
    server: PDProxy

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path == "/health":
            bad = []
            for base in self.server.prefill + self.server.decode:
                try:
                    with urllib.request.urlopen(base + "/health", timeout=5):
                        pass
                except OSError as exc:
                    bad.append(f"{base}: {exc}")
            self.reply(503 if bad else 200, json.dumps({"unhealthy": bad}).encode())
        elif self.path == "/stats":
            with self.server._lock:
                counts = dict(self.server.counts)
            self.reply(200, json.dumps(counts).encode())
        elif self.path == "/metrics":
            self._metrics()
        elif self.path == "/v1/models":
            base = self.server.decode[0]
            try:
                upstream = urllib.request.urlopen(base + "/v1/models", timeout=self.server.timeout_s)
            except urllib.error.HTTPError as exc:
                upstream = exc
            except OSError as exc:              # down: an answer, not a dropped connection
                self.reply(502, json.dumps({"error": f"decode instance {base}: {exc}"}).encode())
                return
            with upstream:
                try:
                    self.reply(upstream.status, _read_capped(upstream, self.server.max_response_bytes))
                except UpstreamTooLarge as exc:
                    self.reply(502, json.dumps({"error": f"decode instance {base}: {exc}"}).encode())
        else:
            self.reply(404, b'{"error": "not found"}')

    def _metrics(self) -> None:
        """The HTTP server's refusals and drops in Prometheus's text format (501 without prometheus-client)."""
        try:
            from prometheus_client import CollectorRegistry
            from prometheus_client.exposition import choose_encoder
        except ImportError as exc:
            self.reply(501, json.dumps({"error": f"/metrics needs prometheus-client: {exc}"}).encode())
            return
        from kvfabric.server.metrics import HttpCollector

        registry = CollectorRegistry(auto_describe=False)
        registry.register(HttpCollector(self.server))
        encode, ctype = choose_encoder(self.headers.get("Accept", ""))
        self.reply(200, encode(registry), ctype)

    def admit_body(self, n: int) -> bool:
        if not self.server.take_body(n):
            return False
        self._body_taken = n
        return True

    def do_POST(self) -> None:  # noqa: N802
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            self.refuse(404, "not found")       # closes: the unread body must not be the next request
            return
        self._body_taken = 0
        try:
            raw = self.read_body()
            if raw is not None:
                self._complete(raw)
        finally:
            self.server.give_body(self._body_taken)

    def _complete(self, raw: bytearray) -> None:
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            self.reply(400, json.dumps({"error": f"bad JSON body: {exc}"}).encode())
            return
        headers = {k: v for k, v in self.headers.items() if k.lower() in ("authorization", "x-request-id")}
        prefill, decode = self.server.next_instances()
        prompts = _batch(body) if self.path == "/v1/completions" else None
        if prompts is None:
            params = self._prefill(prefill, body, headers)
        else:
            def one(i: int):   # a client's X-Request-Id gets the prompt's index: ids stay unique in vLLM
                hdrs = {k: f"{v}-{i}" if k.lower() == "x-request-id" else v for k, v in headers.items()}
                return self._prefill(prefill, dict(body, prompt=prompts[i]), hdrs)

            with ThreadPoolExecutor(min(len(prompts), _PREFILL_THREADS)) as ex:
                got = list(ex.map(one, range(len(prompts))))
            entries = [g["kvfabric"] for g in got if isinstance(g, dict) and isinstance(g.get("kvfabric"), dict)]
            params = {"kvfabric": {"batch": entries}} if entries else None
        dbody = dict(body)
        if params:
            dbody["kv_transfer_params"] = params
            self.server.count("with_params")
        try:
            upstream = _post(decode + self.path, dbody, headers, self.server.timeout_s)
        except urllib.error.HTTPError as exc:
            upstream = exc                      # relay the decode instance's error as is
        except OSError as exc:
            self.reply(502, json.dumps({"error": f"decode instance {decode}: {exc}"}).encode())
            return
        with upstream:
            self._relay(upstream, decode)

    def _prefill(self, base: str, body: dict, headers: dict[str, str]) -> dict | None:
        """Run the prompt on a prefill instance; its ``kv_transfer_params`` (None if it failed)."""
        pbody = dict(body, max_tokens=1, stream=False)
        pbody.pop("stream_options", None)
        if "max_completion_tokens" in pbody:
            pbody["max_completion_tokens"] = 1
        # vLLM refuses min_tokens > max_tokens (400): the client's min_tokens would turn
        # every such request into a prefill failure and a full recompute on the decode side
        pbody.pop("min_tokens", None)
        try:
            with _post(base + self.path, pbody, headers, self.server.timeout_s) as r:
                return json.loads(_read_capped(r, self.server.max_response_bytes)).get("kv_transfer_params")
        except (OSError, ValueError) as exc:    # HTTPError is an OSError, UpstreamTooLarge a ValueError
            self.server.count("prefill_failures")
            log.warning("prefill instance %s failed (%s); the decode instance computes the prompt", base, exc)
            return None

    def _relay(self, upstream, base: str) -> None:
        """Send the decode instance's answer (status, type, body; streamed answers chunk by chunk)."""
        try:
            length = _length(upstream, self.server.max_response_bytes)
        except UpstreamTooLarge as exc:
            self.reply(502, json.dumps({"error": f"decode instance {base}: {exc}"}).encode())
            return
        self.server.count_answer(upstream.status)
        self.send_response(upstream.status)
        self.send_header("Content-Type", upstream.headers.get("Content-Type", "application/json"))
        if length is not None:
            self.send_header("Content-Length", str(length))
            self.end_headers()
            while length > 0:               # copied as it comes, never held whole
                data = upstream.read(min(_RELAY_BYTES, length))
                if not data:                # the instance closed early: so must the client's answer
                    self.close_connection = True
                    return
                self.wfile.write(data)
                length -= len(data)
            return
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        while True:
            data = upstream.read1(_RELAY_BYTES) if hasattr(upstream, "read1") else upstream.read(_RELAY_BYTES)
            if not data:
                break
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    d = DEFAULT_LIMITS
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", action="append", required=True, help="base URL of a kv_producer instance")
    ap.add_argument("--decode", action="append", required=True, help="base URL of a kv_consumer instance")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per upstream request (default 600)")
    ap.add_argument("--max-connections", type=int, default=d.max_connections,
                    help=f"client connections served at once; the next is answered 503 (default {d.max_connections})")
    ap.add_argument("--header-timeout-s", type=float, default=d.header_timeout_s,
                    help=f"request line and headers must arrive within this; also the keep-alive idle "
                         f"timeout (default {d.header_timeout_s:g})")
    ap.add_argument("--body-timeout-s", type=float, default=d.body_timeout_s,
                    help=f"a request body must arrive within this (default {d.body_timeout_s:g})")
    ap.add_argument("--max-header-bytes", type=_size, default=d.max_header_bytes,
                    help="request line and headers, bytes; over it 431 (default 64KiB)")
    ap.add_argument("--max-body-bytes", type=_size, default=d.max_body_bytes,
                    help="one request body, bytes; over it 413 (default 64MiB)")
    ap.add_argument("--max-body-total", type=_size, default=DEFAULT_MAX_BODY_TOTAL,
                    help="request bodies held at once, bytes; over it 503 (default 256MiB)")
    ap.add_argument("--max-response-bytes", type=_size, default=DEFAULT_MAX_RESPONSE_BYTES,
                    help="an instance's answer read whole (prefill, non-streamed decode, /v1/models), "
                         "bytes; over it the prefill fails or the client gets 502 (default 64MiB)")
    args = ap.parse_args(argv)
    try:
        limits = Limits(max_connections=args.max_connections, header_timeout_s=args.header_timeout_s,
                        body_timeout_s=args.body_timeout_s, max_header_bytes=args.max_header_bytes,
                        max_body_bytes=args.max_body_bytes)
        if args.max_body_total < args.max_body_bytes:
            raise ValueError("--max-body-total must be at least --max-body-bytes")
        if args.max_response_bytes < 1:
            raise ValueError("--max-response-bytes must be > 0")
    except ValueError as e:
        ap.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    strip = [u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode]
    server = PDProxy((args.host, args.port), *strip, timeout_s=args.timeout_s, limits=limits,
                     max_body_total=args.max_body_total, max_response_bytes=args.max_response_bytes)
    log.info("PD proxy on http://%s:%d: prefill %s, decode %s; %s", args.host, server.server_address[1], *strip,
             limits)
    print(f"PD proxy listening on {args.host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
