"""``kvfabric route``: an OpenAI-compatible router in front of vLLM instances that share a kvfabric pool.

Two modes, one HTTP front (grown out of the PD example proxy, ``examples/pd/proxy.py``, which is now
``kvfabric route --mode pd``)::

    kvfabric route --port 8000 --instance http://10.0.0.1:8100 --instance http://10.0.0.2:8100 \\
        [--pool-config '{"servers": ["10.0.0.5:7070"]}' --model /models/llama] [--policy kv|least-loaded|rr]
    kvfabric route --mode pd --prefill http://P:8100 [--prefill ...] --decode http://D:8200 [--decode ...]

**kv mode** (``--instance``, each a ``kv_both`` instance or one without a connector): each
``POST /v1/completions`` or ``/v1/chat/completions`` goes, unchanged, to the instance with the
lowest predicted time to first token (:mod:`.fleet`, :mod:`.cost`): the prompt's tokens already in
that instance's prefix cache (its vLLM KV events, :mod:`.events`) cost nothing, those in the pool
(a LOOKUP of the connector's chunk keys, :mod:`.pool`; only with ``--pool-config``; with
``--pool-events``, the pool servers' KV events instead, no round trip) cost their load, the rest their prefill, plus the instance's queue. The prompt's token ids are the request's
own when it sends ids; a text prompt or chat messages are tokenized by an instance's ``/tokenize``
(deadline ``--tokenize-timeout-s``) when any instance has KV events or a pool is configured; no
token ids means the choice is by queue alone (least loaded). An instance that refuses the
connection (down) is marked down and the request goes to the next best one (at most once per
instance); one that answers with an error status has its answer relayed as is.

**pd mode** (``--prefill`` kv_producer instances, ``--decode`` kv_consumer instances): the prefill
instance is chosen the same way (its own prefix cache and queue; a producer never loads from the
pool), then the decode instance (its prefix cache, the pool holding the whole prompt once the
producer saved it, its queue). Then, as the PD proxy always did:

1. the request goes to the prefill instance with ``max_tokens=1``, no ``min_tokens`` and no
   streaming: it prefills the prompt, saves the KV to the pool, and answers with
   ``kv_transfer_params`` naming the chunks it saved (``{"kvfabric": {"chunks": N, ...}}``);
2. then, unchanged except for those ``kv_transfer_params``, to the decode instance, which loads the
   prompt's KV from the pool (waiting up to its ``pd_wait_ms`` for chunks whose puts are still
   landing) and generates; its answer (streamed or not) is relayed to the client as is.

A completion whose ``prompt`` is a batch (a list of strings or of token-id lists) is prefilled one
prompt per request (vLLM answers a batch with the first prompt's ``kv_transfer_params`` only), in
parallel, and the decode instance gets them merged: ``{"kvfabric": {"batch": [one entry per
prompt]}}``; each of its prompts takes the entry whose key is its own. If the prefill instance
fails (down, error status), the request still goes to a decode instance without
``kv_transfer_params``: it computes the prompt itself.

``GET /health`` answers 200 when every instance does; ``GET /v1/models`` is the first (decode)
instance's; ``GET /stats`` gives the router's counts (pd mode: requests, prefill_failures,
with_params: decode requests sent with the producer's ``kv_transfer_params``, as the PD proxy
always did; kv mode: requests, retries, tokenized, tokenize_failures); ``GET /route`` the choice's
state: per instance what it was chosen for and knows (index, event stream, rates, queue), and the
pool view's counts; ``GET /metrics`` the HTTP server's refusals in Prometheus's format.

Every limit is an option with a default (``--help``; docs/notes/security.md says what a hostile
client can do within them): at most ``--max-connections`` connections are served at once, each by
one thread, and the one after is answered 503 and closed without a thread; the request line and
headers must arrive within ``--header-timeout-s`` (an idle keep-alive connection is closed after
that long too) and be at most ``--max-header-bytes`` (431); a body needs one decimal
``Content-Length`` (else 400; 411 without one) of at most ``--max-body-bytes`` (413), checked
before a byte of it is read, and must arrive within ``--body-timeout-s``; chunked request bodies
(``Transfer-Encoding``) are refused with 501; the bodies held at once are at most
``--max-body-total`` bytes (then 503). An answer read from an instance whole (the prefill's, a
non-streamed answer, ``/v1/models``) is at most ``--max-response-bytes`` (else the prefill counts
as failed, and a client's answer is 502); streamed answers are relayed 64 KiB at a time. The
routing state is bounded too: ``--index-entries`` blocks per instance, every ``/metrics``,
``/kv_event_sources`` and pool LOOKUP with its deadline. The HTTP server is
:mod:`kvfabric.server.httpd`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from ..errors import KVFabricError
from ..server.httpd import BoundedHandler, BoundedHTTPServer, Limits
from ..sizes import parse_size
from .cost import Prediction
from .fleet import POLICIES, Costs, Fleet, Instance
from .pool import EngineShape, PoolEventsView, PoolView

log = logging.getLogger("kvfabric.route")
_RELAY_BYTES = 64 << 10
_PREFILL_THREADS = 8        # a batch's prompts prefilled at once
MAX_TOKENIZE_BYTES = 16 << 20
#: Defaults of the limits (``--help`` shows them): 64 connections, far more requests at once than the
#: instances behind one router batch, with one thread each; 10 s for a head a client sends at once;
#: 60 s for a body of up to 64 MiB (a 128K-token prompt as JSON is ~1 MiB); bodies held at once:
#: four full ones; an answer read whole: a non-streamed completion is kilobytes.
DEFAULT_LIMITS = Limits(max_connections=64, header_timeout_s=10.0, body_timeout_s=60.0,
                        max_header_bytes=64 << 10, max_body_bytes=64 << 20)
DEFAULT_MAX_BODY_TOTAL = 256 << 20
DEFAULT_MAX_RESPONSE_BYTES = 64 << 20


class UpstreamTooLarge(ValueError):
    """An instance's answer is over ``--max-response-bytes``."""


class Router(BoundedHTTPServer):
    """The HTTP server over a :class:`Fleet`: kv mode (``prefill`` empty, ``decode`` = the instances) or
    pd mode (both given)."""

    def __init__(self, addr: tuple[str, int], fleet: Fleet, prefill: list[Instance], decode: list[Instance],
                 timeout_s: float, limits: Limits = DEFAULT_LIMITS, max_body_total: int = DEFAULT_MAX_BODY_TOTAL,
                 max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES, tokenize_timeout_s: float = 1.0) -> None:
        if not decode:
            raise ValueError("at least one (decode) instance is needed")
        if max_body_total < limits.max_body_bytes or max_response_bytes < 1:
            raise ValueError("max_body_total must be >= max_body_bytes and max_response_bytes >= 1")
        super().__init__(addr, _Handler, limits)
        self.fleet, self.prefill, self.decode = fleet, prefill, decode
        self.timeout_s, self.tokenize_timeout_s = timeout_s, tokenize_timeout_s
        self.max_body_total, self.max_response_bytes = max_body_total, max_response_bytes
        self.body_bytes = 0                     # bodies being read or held now, bytes
        self._lock = threading.Lock()
        self.counts = {"requests": 0, "prefill_failures": 0, "with_params": 0, "retries": 0,
                       "tokenized": 0, "tokenize_failures": 0}

    @property
    def pd(self) -> bool:
        return bool(self.prefill)

    def stats(self) -> dict[str, int]:
        """``GET /stats``: the counts of the mode (pd: those the PD proxy always gave)."""
        names = (("requests", "prefill_failures", "with_params") if self.pd else
                 ("requests", "retries", "tokenized", "tokenize_failures"))
        with self._lock:
            return {k: self.counts[k] for k in names}

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

    def server_close(self) -> None:
        super().server_close()
        self.fleet.close()

    def wants_tokens(self) -> bool:
        """Whether token ids change the choice: the kv policy with a pool or any instance's KV events."""
        f = self.fleet
        return f.policy == "kv" and (f.pool is not None or any(i.index.block_size for i in f.instances))

    def tokens_of(self, path: str, body: dict) -> list[int] | None:
        """The prompt's token ids: the request's own, else an instance's ``/tokenize`` of its text or
        messages (when :meth:`wants_tokens`); None when unknown (a batch counts as its first prompt)."""
        p = body.get("prompt")
        if path == "/v1/completions":
            if isinstance(p, list) and p and isinstance(p[0], (list, str)):   # a batch: its first prompt
                p = p[0]
            if isinstance(p, list) and all(type(t) is int for t in p):
                return p
        if not self.wants_tokens():
            return None
        if path == "/v1/completions" and isinstance(p, str):
            req = {"model": body.get("model"), "prompt": p}
        elif path == "/v1/chat/completions" and isinstance(body.get("messages"), list):
            req = {k: body[k] for k in ("model", "messages", "chat_template", "add_generation_prompt",
                                        "continue_final_message", "tools") if k in body}
        else:
            return None
        base = (self.prefill or self.decode)[0].url
        try:
            with _post(base + "/tokenize", req, {}, self.tokenize_timeout_s) as r:
                tokens = json.loads(_read_capped(r, MAX_TOKENIZE_BYTES)).get("tokens")
            if isinstance(tokens, list) and all(type(t) is int for t in tokens):
                self.count("tokenized")
                return tokens
        except (OSError, ValueError) as exc:
            log.debug("tokenize at %s failed: %s", base, exc)
        self.count("tokenize_failures")
        return None


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
    server: Router

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        if self.path == "/health":
            bad = []
            for inst in self.server.prefill + self.server.decode:
                try:
                    with urllib.request.urlopen(inst.url + "/health", timeout=5):
                        pass
                except OSError as exc:
                    bad.append(f"{inst.url}: {exc}")
            self.reply(503 if bad else 200, json.dumps({"unhealthy": bad}).encode())
        elif self.path == "/stats":
            self.reply(200, json.dumps(self.server.stats()).encode())
        elif self.path == "/route":
            self.reply(200, json.dumps(self.server.fleet.snapshot()).encode())
        elif self.path == "/metrics":
            self._metrics()
        elif self.path == "/v1/models":
            base = self.server.decode[0].url
            try:
                upstream = urllib.request.urlopen(base + "/v1/models", timeout=self.server.timeout_s)
            except urllib.error.HTTPError as exc:
                upstream = exc
            except OSError as exc:              # down: an answer, not a dropped connection
                self.reply(502, json.dumps({"error": f"instance {base}: {exc}"}).encode())
                return
            with upstream:
                try:
                    self.reply(upstream.status, _read_capped(upstream, self.server.max_response_bytes))
                except UpstreamTooLarge as exc:
                    self.reply(502, json.dumps({"error": f"instance {base}: {exc}"}).encode())
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
        from ..server.metrics import HttpCollector

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
        srv = self.server
        srv.count("requests")
        headers = {k: v for k, v in self.headers.items() if k.lower() in ("authorization", "x-request-id")}
        tokens = srv.tokens_of(self.path, body)
        n_tokens = len(tokens) if tokens is not None else 0
        dbody = body
        if srv.pd:
            prefill, ppred = srv.fleet.choose(srv.prefill, tokens, loads_from_pool=False)
            dbody = dict(body)
            params = self._prefill_all(prefill, ppred, body, headers, n_tokens)
            if params:
                dbody["kv_transfer_params"] = params
                srv.count("with_params")
        tried: list[Instance] = []
        while True:
            # PD: the producer saved the whole prompt, so a consumer loads all of it from the pool
            inst, pred = srv.fleet.choose(srv.decode, tokens, exclude=tried,
                                          pool_tokens=n_tokens if srv.pd else None)
            tried.append(inst)
            work = srv.fleet.begin(inst, n_tokens, pred)
            try:
                upstream = _post(inst.url + self.path, dbody, headers, srv.timeout_s)
            except urllib.error.HTTPError as exc:
                upstream = exc                  # relay the instance's error as is
            except OSError as exc:
                srv.fleet.first_token(inst, work)
                srv.fleet.end(inst, failed=True)
                if len(tried) < len(srv.decode):
                    srv.count("retries")
                    log.warning("instance %s failed (%s); trying another", inst.url, exc)
                    continue
                self.reply(502, json.dumps({"error": f"instance {inst.url}: {exc}"}).encode())
                return
            break
        try:
            with upstream:
                self._relay(upstream, inst.url, lambda: srv.fleet.first_token(inst, work), pred)
        finally:
            srv.fleet.end(inst)

    def _prefill_all(self, inst: Instance, pred: Prediction | None, body: dict, headers: dict[str, str],
                     n_tokens: int) -> dict | None:
        """PD: every prompt of the request on the prefill instance ``inst``; the merged params (None if none)."""
        srv = self.server
        prompts = _batch(body) if self.path == "/v1/completions" else None
        work = srv.fleet.begin(inst, n_tokens, pred)
        failed = False
        try:
            if prompts is None:
                params = self._prefill(inst.url, body, headers)
                failed = params is None
                return params

            def one(i: int):   # a client's X-Request-Id gets the prompt's index: ids stay unique in vLLM
                hdrs = {k: f"{v}-{i}" if k.lower() == "x-request-id" else v for k, v in headers.items()}
                return self._prefill(inst.url, dict(body, prompt=prompts[i]), hdrs)

            with ThreadPoolExecutor(min(len(prompts), _PREFILL_THREADS)) as ex:
                got = list(ex.map(one, range(len(prompts))))
            entries = [g["kvfabric"] for g in got if isinstance(g, dict) and isinstance(g.get("kvfabric"), dict)]
            return {"kvfabric": {"batch": entries}} if entries else None
        finally:
            srv.fleet.first_token(inst, work)
            srv.fleet.end(inst, failed=failed)

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

    def _relay(self, upstream, base: str, on_first, pred: Prediction | None = None) -> None:
        """Send the instance's answer (status, type, body; streamed answers chunk by chunk); ``on_first()``
        once its first bytes arrived (a streamed answer's first event: the first token). Headers
        ``X-KVFabric-Instance`` (the instance's URL) and ``X-KVFabric-Prediction`` (its prediction as
        JSON, when there is one) say where the request went and why."""
        try:
            length = _length(upstream, self.server.max_response_bytes)
        except UpstreamTooLarge as exc:
            on_first()
            self.reply(502, json.dumps({"error": f"instance {base}: {exc}"}).encode())
            return
        self.server.count_answer(upstream.status)
        self.send_response(upstream.status)
        self.send_header("Content-Type", upstream.headers.get("Content-Type", "application/json"))
        self.send_header("X-KVFabric-Instance", base)
        if pred is not None:
            self.send_header("X-KVFabric-Prediction", json.dumps(pred.to_json(), separators=(",", ":")))
        first = True
        if length is not None:
            on_first()
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
        try:
            while True:
                data = upstream.read1(_RELAY_BYTES) if hasattr(upstream, "read1") else upstream.read(_RELAY_BYTES)
                if first:
                    on_first()
                    first = False
                if not data:
                    break
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        finally:
            if first:
                on_first()


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _events(spec: list[str]) -> dict[str, str]:
    out = {}
    for s in spec:
        url, sep, endpoint = s.partition("=")
        if not sep or not endpoint.startswith(("tcp://", "ipc://")):
            raise ValueError(f"--kv-events wants URL=tcp://HOST:PORT, got {s!r}")
        out[url.rstrip("/")] = endpoint
    return out


def parser(prog: str = "kvfabric route") -> argparse.ArgumentParser:
    d = DEFAULT_LIMITS
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--mode", choices=["kv", "pd"], default="kv",
                    help="kv: --instance ...; pd: --prefill ... --decode ... (default kv)")
    ap.add_argument("--instance", action="append", default=[], help="kv mode: base URL of a vLLM instance")
    ap.add_argument("--prefill", action="append", default=[], help="pd mode: base URL of a kv_producer instance")
    ap.add_argument("--decode", action="append", default=[], help="pd mode: base URL of a kv_consumer instance")
    ap.add_argument("--policy", choices=POLICIES, default="kv",
                    help="kv: lowest predicted TTFT; least-loaded: queue only; rr: round robin (default kv)")
    ap.add_argument("--kv-events", action="append", default=[], metavar="URL=ENDPOINT",
                    help="an instance's KV-event endpoint (default: asked from its /kv_event_sources)")
    ap.add_argument("--pool-config", default=None,
                    help="the engines' kv_connector_extra_config as JSON (servers, chunk_tokens, key settings): "
                         "the router asks the pool what it holds of each prompt with the connector's keys")
    ap.add_argument("--model", default=None, help="with --pool-config: the engines' --model (a directory)")
    ap.add_argument("--kv-dtype", default=EngineShape.dtype, help=f"with --pool-config (default {EngineShape.dtype})")
    ap.add_argument("--kv-layout", default=EngineShape.kv_layout,
                    help=f"with --pool-config: vLLM's KV cache layout name (default {EngineShape.kv_layout})")
    ap.add_argument("--block-size", type=int, default=EngineShape.block_size,
                    help=f"with --pool-config: vLLM's block size (default {EngineShape.block_size})")
    ap.add_argument("--pool-timeout-s", type=float, default=0.05, help="deadline of a pool LOOKUP (default 0.05)")
    ap.add_argument("--pool-events", default=None, metavar="ENDPOINT[,ENDPOINT...]",
                    help="with --pool-config: read what the pool holds from its servers' KV events (kvfabric serve "
                         "--kv-events) instead of a LOOKUP per request")
    ap.add_argument("--prefill-s-per-token", type=float, default=Costs.prefill_s_per_token,
                    help="prior until measured from an instance's /metrics")
    ap.add_argument("--load-s-per-token", type=float, default=Costs.load_s_per_token,
                    help="prior until measured from the connector's metrics")
    ap.add_argument("--decode-s-per-running", type=float, default=Costs.decode_s_per_running,
                    help="added per request running on the instance")
    ap.add_argument("--index-entries", type=int, default=1 << 18, help="blocks indexed per instance")
    ap.add_argument("--poll-s", type=float, default=2.0,
                    help="/metrics poll period (each poll costs the instance ~12 ms of CPU: docs/route.md)")
    ap.add_argument("--poll-timeout-s", type=float, default=1.0)
    ap.add_argument("--tokenize-timeout-s", type=float, default=1.0)
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
                    help="an instance's answer read whole (prefill, non-streamed answer, /v1/models), "
                         "bytes; over it the prefill fails or the client gets 502 (default 64MiB)")
    return ap


def build(args: argparse.Namespace) -> Router:
    """The router the parsed options describe (not serving yet); ValueError on inconsistent options."""
    limits = Limits(max_connections=args.max_connections, header_timeout_s=args.header_timeout_s,
                    body_timeout_s=args.body_timeout_s, max_header_bytes=args.max_header_bytes,
                    max_body_bytes=args.max_body_bytes)
    if args.max_body_total < args.max_body_bytes:
        raise ValueError("--max-body-total must be at least --max-body-bytes")
    if args.max_response_bytes < 1:
        raise ValueError("--max-response-bytes must be > 0")
    if args.mode == "pd" and (not args.prefill or not args.decode or args.instance):
        raise ValueError("--mode pd needs --prefill and --decode (and no --instance)")
    if args.mode == "kv" and (not args.instance or args.prefill or args.decode):
        raise ValueError("--mode kv needs --instance (and no --prefill / --decode)")
    for name in ("prefill_s_per_token", "load_s_per_token", "decode_s_per_running", "poll_s", "poll_timeout_s",
                 "tokenize_timeout_s", "pool_timeout_s", "timeout_s"):
        if not getattr(args, name) > 0 and not (name == "decode_s_per_running" and getattr(args, name) == 0):
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    events = _events(args.kv_events)
    urls = {"both": args.instance, "prefill": args.prefill, "decode": args.decode}
    insts = {role: [Instance(u.rstrip("/"), role, events.get(u.rstrip("/"))) for u in us] for role, us in urls.items()}
    pool = None
    if args.pool_config:
        if not args.model:
            raise ValueError("--pool-config needs --model (the engines' model directory)")
        shape = EngineShape(args.model, args.kv_dtype, args.kv_layout, args.block_size)
        if args.pool_events:
            pool = PoolEventsView(json.loads(args.pool_config), shape, [e for e in args.pool_events.split(",") if e])
        else:
            pool = PoolView(json.loads(args.pool_config), shape, timeout_s=args.pool_timeout_s)
    elif args.pool_events:
        raise ValueError("--pool-events needs --pool-config and --model (the keys are the connector's)")
    fleet = Fleet([*insts["both"], *insts["prefill"], *insts["decode"]], policy=args.policy, pool=pool,
                  costs=Costs(args.prefill_s_per_token, args.load_s_per_token, args.decode_s_per_running),
                  poll_s=args.poll_s, poll_timeout_s=args.poll_timeout_s, index_entries=args.index_entries)
    try:
        return Router((args.host, args.port), fleet, insts["prefill"], insts["both"] or insts["decode"],
                      timeout_s=args.timeout_s, limits=limits, max_body_total=args.max_body_total,
                      max_response_bytes=args.max_response_bytes, tokenize_timeout_s=args.tokenize_timeout_s)
    except BaseException:
        fleet.close()
        raise


def main(argv: list[str] | None = None, banner: str = "kvfabric route listening on", prog: str = "kvfabric route"
         ) -> int:
    ap = parser(prog)
    args = ap.parse_args(argv)
    try:
        server = build(args)
    except (ValueError, OSError, KVFabricError) as e:   # ConfigError is both
        ap.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log.info("kvfabric route (%s mode, policy %s) on http://%s:%d: %s; %s", args.mode, args.policy, args.host,
             server.server_address[1], [i.url for i in server.fleet.instances], server.limits)
    print(f"{banner} {args.host}:{server.server_address[1]}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


__all__ = ["Router", "build", "main", "parser"]
