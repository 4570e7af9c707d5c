"""A small prefill/decode (PD) proxy for vLLM instances sharing a kvfabric pool.

Like vLLM's disaggregated-serving example proxies (``disagg_proxy_demo.py``,
``toy_proxy_server.py``), with the standard library only::

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
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["PDProxy", "main"]

log = logging.getLogger("kvfabric.pd_proxy")
_RELAY_BYTES = 64 << 10
MAX_BODY_BYTES = 64 << 20   # a request body larger than this is refused (413)
_PREFILL_THREADS = 8        # a batch's prompts prefilled at once


class PDProxy(ThreadingHTTPServer):
    """The HTTP server; ``prefill`` / ``decode`` are base URLs, used round robin."""

    daemon_threads = True

    def __init__(self, addr: tuple[str, int], prefill: list[str], decode: list[str], timeout_s: float) -> None:
        if not prefill or not decode:
            raise ValueError("at least one prefill and one decode instance are needed")
        super().__init__(addr, _Handler)
        self.prefill, self.decode = prefill, decode
        self.timeout_s = timeout_s
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


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: PDProxy

    def log_message(self, fmt: str, *args) -> None:   # access log at debug level only
        log.debug("%s " + fmt, self.address_string(), *args)

    def _reply(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path == "/health":
            bad = []
            for base in self.server.prefill + self.server.decode:
                try:
                    with urllib.request.urlopen(base + "/health", timeout=5):
                        pass
                except OSError as exc:
                    bad.append(f"{base}: {exc}")
            self._reply(503 if bad else 200, json.dumps({"unhealthy": bad}).encode())
        elif self.path == "/stats":
            with self.server._lock:
                counts = dict(self.server.counts)
            self._reply(200, json.dumps(counts).encode())
        elif self.path == "/v1/models":
            base = self.server.decode[0]
            try:
                upstream = urllib.request.urlopen(base + "/v1/models", timeout=self.server.timeout_s)
            except urllib.error.HTTPError as exc:
                upstream = exc
            except OSError as exc:              # down: an answer, not a dropped connection
                self._reply(502, json.dumps({"error": f"decode instance {base}: {exc}"}).encode())
                return
            with upstream:
                self._reply(upstream.status, upstream.read())
        else:
            self._reply(404, b'{"error": "not found"}')

    def do_POST(self) -> None:  # noqa: N802
        if self.path not in ("/v1/completions", "/v1/chat/completions"):
            self._reply(404, b'{"error": "not found"}')
            return
        n = int(self.headers.get("Content-Length") or 0)
        if n > MAX_BODY_BYTES:
            self.close_connection = True        # the unread body must not be parsed as the next request
            self._reply(413, b'{"error": "request body too large"}')
            return
        try:
            body = json.loads(self.rfile.read(n))
            if not isinstance(body, dict):
                raise ValueError("not a JSON object")
        except ValueError as exc:
            self._reply(400, json.dumps({"error": f"bad JSON body: {exc}"}).encode())
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
            self._reply(502, json.dumps({"error": f"decode instance {decode}: {exc}"}).encode())
            return
        with upstream:
            self._relay(upstream)

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
                return json.loads(r.read()).get("kv_transfer_params")
        except (OSError, ValueError) as exc:    # HTTPError is an OSError
            self.server.count("prefill_failures")
            log.warning("prefill instance %s failed (%s); the decode instance computes the prompt", base, exc)
            return None

    def _relay(self, upstream) -> None:
        """Send the decode instance's answer (status, type, body; streamed answers chunk by chunk)."""
        self.send_response(upstream.status)
        self.send_header("Content-Type", upstream.headers.get("Content-Type", "application/json"))
        length = upstream.headers.get("Content-Length")
        if length is not None:
            self.send_header("Content-Length", length)
            self.end_headers()
            self.wfile.write(upstream.read())
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefill", action="append", required=True, help="base URL of a kv_producer instance")
    ap.add_argument("--decode", action="append", required=True, help="base URL of a kv_consumer instance")
    ap.add_argument("--timeout-s", type=float, default=600.0, help="per upstream request")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    strip = [u.rstrip("/") for u in args.prefill], [u.rstrip("/") for u in args.decode]
    server = PDProxy((args.host, args.port), *strip, timeout_s=args.timeout_s)
    log.info("PD proxy on http://%s:%d: prefill %s, decode %s", args.host, server.server_address[1], *strip)
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
