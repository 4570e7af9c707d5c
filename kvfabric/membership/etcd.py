"""A small etcd v3 client over etcd's own JSON gateway (HTTP + JSON on the client port), standard library only.

etcd serves its v3 API as gRPC and, on the same client URL, as HTTP+JSON
(the "gRPC gateway": ``POST /v3/kv/range`` etc.; keys and values are base64,
64-bit integers are JSON strings). kvfabric needs six calls of it, so it
speaks that gateway with ``http.client`` instead of depending on a gRPC
client library (see docs/notes/membership.md for why):

* :meth:`EtcdClient.range_prefix` (``/v3/kv/range`` with ``range_end``),
* :meth:`EtcdClient.put` (``/v3/kv/put``, optionally under a lease),
* :meth:`EtcdClient.delete` (``/v3/kv/deleterange``),
* :meth:`EtcdClient.lease_grant`, :meth:`~EtcdClient.lease_keepalive`,
  :meth:`~EtcdClient.lease_revoke`, :meth:`~EtcdClient.lease_ttl`,
* :meth:`EtcdClient.watch_prefix`: ``/v3/watch``, a streamed response of
  newline-separated JSON objects, read line by line.

``endpoints`` is one URL or a comma-separated list (``http://h1:2379,
http://h2:2379``); a request that cannot reach one endpoint (connection
refused, timeout) tries the next, and the client sticks to the last one that
answered. Failures raise :class:`EtcdError` (a :class:`KVFabricError`): the
caller decides whether that is fatal (the CLI) or retried (registration and
watch loops).

TLS: ``https://`` endpoints are verified with Python's :mod:`ssl` against
``ca_file`` (a PEM bundle; without one, the system's trust store), host name
included; ``cert_file`` (+ ``key_file`` when the key is not in the same PEM)
is presented to an etcd that requires client certificates
(``--client-cert-auth``). A CA or certificate given with only ``http://``
endpoints is refused: it would protect nothing.

etcd's answers are not trusted to be well formed: a response body is read
only up to ``max_response_bytes`` (16 MiB by default, checked against
``Content-Length`` before anything is read, and by the bytes read when there
is none), a watch line up to the same cap, and an answer that is not JSON,
has the wrong types, a bad number or base64, or is cut short raises
:class:`EtcdBadAnswer` (an :class:`EtcdError`), never ``ValueError`` or
``TypeError``: callers that retry on ``EtcdError`` leave membership as it was.

etcd auth (user and password): give them in the URL, ``http://USER:PASSWORD@
host:2379`` (percent-encode special characters; with several endpoints, on
any of them: one user for all). The client then gets a token from
``/v3/auth/authenticate`` before its first call and sends it in the
``Authorization`` header of every call; a call etcd refuses for a bad or
expired token (simple tokens expire after ``--auth-token-ttl``, 300 s by
default) authenticates again and is retried once. :attr:`EtcdClient.url`
(what logs and errors show) has the password replaced by ``***``, and so has
every error about a URL (:func:`redact_url`). Over plain ``http://`` the
password and every member record cross the network in clear: production
setups use ``https://`` (docs/cluster.md, "etcd in production").
"""

from __future__ import annotations

import base64
import http.client
import json
import re
import socket
import ssl
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import KVFabricError

__all__ = ["DEFAULT_MAX_RESPONSE_BYTES", "EtcdBadAnswer", "EtcdClient", "EtcdError", "KeyValue", "WatchEvent",
           "prefix_end", "redact_url", "shutdown_connection", "tls_context"]

#: The largest etcd answer (one response body, one watch line) read, in bytes. A member record is
#: ~300 bytes, so 16 MiB is a cluster of ~50,000 members; an etcd (or something posing as one) that
#: sends more is refused before its bytes are read, so it cannot grow the engine's memory.
DEFAULT_MAX_RESPONSE_BYTES = 16 << 20
#: The cap may be lowered (tests) but not raised past this.
MAX_RESPONSE_BYTES = 1 << 30


class EtcdError(KVFabricError):
    """etcd could not be reached, or answered with an error."""


class EtcdBadAnswer(EtcdError):
    """etcd answered something that is not a valid answer (not JSON, wrong types, too large, cut short)."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: object) -> bytes:
    if text is None or text == "":
        return b""
    if not isinstance(text, str):
        raise TypeError(f"expected base64 text, got {type(text).__name__}")
    return base64.b64decode(text, validate=True)


def _int(value: object) -> int:
    """A 64-bit integer as etcd's gateway writes it (a JSON string, or a number); ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TypeError(f"expected an integer, got {type(value).__name__}")
    n = int(value)
    if not -(1 << 63) <= n < 1 << 64:
        raise ValueError(f"integer out of range: {n}")
    return n


def _obj(value: object, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"{what} is {type(value).__name__}, not an object")
    return value


def _list(value: object, what: str) -> list[Any]:
    if not isinstance(value, list):
        raise TypeError(f"{what} is {type(value).__name__}, not a list")
    return value


def _key_value(kv: object) -> tuple[bytes, bytes, int, int]:
    kv = _obj(kv, "kv")
    return (_unb64(kv.get("key")), _unb64(kv.get("value")), _int(kv.get("mod_revision", 0)),
            _int(kv.get("lease", 0)))


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that selects every key starting with ``prefix`` (etcd's own rule)."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"  # every key


@dataclass(frozen=True)
class KeyValue:
    key: bytes
    value: bytes
    mod_revision: int
    lease: int


@dataclass(frozen=True)
class WatchEvent:
    """One change: ``kind`` is ``"PUT"`` or ``"DELETE"`` (a DELETE's ``value`` is empty); ``lease``: the
    lease the key is attached to after a PUT (0: none)."""

    kind: str
    key: bytes
    value: bytes
    mod_revision: int
    lease: int = 0


def _revision(out: dict[str, Any]) -> int:
    return _int(_obj(out.get("header", {}), "header").get("revision", 0))


def _watch_events(line: bytes) -> list[WatchEvent]:
    """The events of one watch message; EtcdError for an error or a cancelled watch, EtcdBadAnswer for a
    message that is not well formed."""
    try:
        msg = json.loads(line)
    except ValueError:
        raise EtcdBadAnswer(f"etcd watch: not JSON: {line[:200]!r}") from None
    try:
        msg = _obj(msg, "watch message")
        if "error" in msg:
            raise EtcdError(f"etcd watch: {str(msg['error'])[:200]}")
        res = _obj(msg.get("result", {}), "result")
        if res.get("canceled") or res.get("compact_revision"):
            raise EtcdError(f"etcd cancelled the watch ({str(res.get('cancel_reason', 'compacted'))[:200]})")
        events = []
        for ev in _list(res.get("events", []), "events"):
            kind = _obj(ev, "event").get("type", "PUT")
            if kind not in ("PUT", "DELETE"):
                raise ValueError(f"event type {str(kind)[:40]!r}")
            key, value, mod_revision, lease = _key_value(ev.get("kv"))
            events.append(WatchEvent(kind, key, value, mod_revision, lease))
        return events
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise EtcdBadAnswer(f"etcd watch: malformed message ({type(e).__name__}: {e}): {line[:200]!r}") from None


def shutdown_connection(conn: http.client.HTTPConnection | None) -> None:
    """End a read blocked on ``conn`` (a watch) from another thread: the reader then raises or returns."""
    sock = conn.sock if conn is not None else None
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _one_line(e: BaseException) -> str:
    """An exception's text on one line (SSL and socket errors can carry newlines)."""
    return " ".join(str(e).split())


def _parse(endpoints: str) -> tuple[list[tuple[str, str, int]], tuple[str, str] | None]:
    """Endpoints as (scheme, host, port) and the (user, password) given in one of them, if any.
    Errors show the URL with its password masked (:func:`redact_url`)."""
    out = []
    creds: set[tuple[str, str]] = set()
    for url in (u.strip() for u in endpoints.split(",")):
        if not url:
            continue
        if "://" not in url:
            url = "http://" + url
        try:
            parts = urllib.parse.urlsplit(url)
            port = parts.port
        except ValueError:  # (not its text: urllib quotes the "port", which may be part of a password)
            raise EtcdError(f"etcd endpoint {redact_url(url)!r} is not a valid URL (its port?)") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise EtcdError(f"etcd endpoint must be http://HOST:PORT or https://HOST:PORT, got {redact_url(url)!r}")
        out.append((parts.scheme, parts.hostname, port or 2379))
        if parts.username is not None:
            creds.add((urllib.parse.unquote(parts.username), urllib.parse.unquote(parts.password or "")))
    if not out:
        raise EtcdError("no etcd endpoint given")
    if len(creds) > 1:
        raise EtcdError("etcd endpoints name different users; give one user for all")
    return out, next(iter(creds), None)


def redact_url(endpoints: str) -> str:
    """``endpoints`` (one URL or a comma-separated list) with every password replaced by ``***``:
    what logs, errors, ``--print-config`` and ``kvfabric cluster ls`` show."""
    return _USERINFO.sub(r"\1\2:***@", str(endpoints))


# ``[scheme://]user:password@`` at the start of the text, after a comma or after a scheme; the password
# may hold anything but "@" and "://" (even "/" or "," a user forgot to percent-encode): masking too much
# of a malformed URL is better than showing a password
_USERINFO = re.compile(r"((?:^|,)\s*(?:[A-Za-z][\w+.-]*://)?|[A-Za-z][\w+.-]*://)([^/@:,\s]*):(?:(?!://)[^@])*?@")


def tls_context(ca_file: str | None, cert_file: str | None, key_file: str | None) -> ssl.SSLContext:
    """The client TLS context for ``https://`` endpoints: certificates and host names verified against
    ``ca_file`` (the system's trust store without one), ``cert_file``/``key_file`` presented when given.
    EtcdError naming the file when one cannot be loaded."""
    try:
        ctx = ssl.create_default_context(cafile=ca_file or None)
    except (OSError, ssl.SSLError) as e:
        raise EtcdError(f"etcd CA file {ca_file!r}: {e}") from None
    if key_file and not cert_file:
        raise EtcdError("an etcd client key needs its certificate (etcd cert file)")
    if cert_file:
        try:
            ctx.load_cert_chain(cert_file, key_file or None)
        except (OSError, ssl.SSLError) as e:
            raise EtcdError(f"etcd client certificate {cert_file!r} / key {key_file or cert_file!r}: {e}") from None
    return ctx


class EtcdClient:
    """etcd v3 over its JSON gateway (see the module docstring). Thread-safe: one HTTP connection per call."""

    def __init__(self, endpoints: str, timeout_s: float = 5.0, *, ca_file: str | None = None,
                 cert_file: str | None = None, key_file: str | None = None,
                 max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES) -> None:
        self.url = redact_url(endpoints)
        self.endpoints, self._credentials = _parse(endpoints)
        if type(max_response_bytes) is not int or not 1024 <= max_response_bytes <= MAX_RESPONSE_BYTES:
            raise EtcdError(f"etcd max_response_bytes must be in 1KiB..1GiB, got {max_response_bytes!r}")
        self.max_response_bytes = max_response_bytes
        self._tls: ssl.SSLContext | None = None
        if any(scheme == "https" for scheme, _, _ in self.endpoints):
            self._tls = tls_context(ca_file, cert_file, key_file)
        elif ca_file or cert_file or key_file:
            raise EtcdError(f"an etcd CA file or client certificate was given but {self.url} is not https://")
        self.timeout_s = timeout_s
        self._token = ""  # etcd auth token, when credentials were given (module docstring)
        self._lock = threading.Lock()
        self._current = 0  # index of the endpoint that answered last

    # -- transport -------------------------------------------------------

    def _open(self, path: str, body: dict[str, Any], timeout_s: float | None) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        """POST ``body`` to the first endpoint that answers; returns the connection and its response."""
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self._credentials is not None and path != "/v3/auth/authenticate":
            headers["Authorization"] = self._token or self._authenticate()
        with self._lock:
            start = self._current
        errors = []
        n = len(self.endpoints)
        for k in range(n):
            i = (start + k) % n
            scheme, host, port = self.endpoints[i]
            if scheme == "https":
                conn: http.client.HTTPConnection = http.client.HTTPSConnection(
                    host, port, timeout=timeout_s or self.timeout_s, context=self._tls)
            else:
                conn = http.client.HTTPConnection(host, port, timeout=timeout_s or self.timeout_s)
            try:
                conn.request("POST", path, body=data, headers=headers)
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as e:  # ssl.SSLError is an OSError
                conn.close()
                errors.append(f"{scheme}://{host}:{port}: {_one_line(e)}")
                continue
            with self._lock:
                self._current = i
            return conn, resp
        raise EtcdError(f"etcd unreachable ({'; '.join(errors)})")

    def _authenticate(self) -> str:
        """A fresh auth token for the configured user (EtcdError when etcd refuses)."""
        user, password = self._credentials
        self._token = str(self._call_once("/v3/auth/authenticate", {"name": user, "password": password}, None)
                          .get("token", ""))
        if not self._token:
            raise EtcdError(f"etcd {self.url}: authentication gave no token (is auth enabled?)")
        return self._token

    def _call(self, path: str, body: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        try:
            return self._call_once(path, body, timeout_s)
        except EtcdError as e:
            if self._credentials is None or "auth token" not in str(e):
                raise
        self._authenticate()  # expired or invalidated token: once more with a new one
        return self._call_once(path, body, timeout_s)

    def _call_once(self, path: str, body: dict[str, Any], timeout_s: float | None) -> dict[str, Any]:
        conn, resp = self._open(path, body, timeout_s)
        try:
            raw = self._read_body(path, resp)
        except http.client.IncompleteRead as e:
            raise EtcdBadAnswer(f"etcd {path}: answer cut short ({len(e.partial)} bytes)") from None
        except (OSError, http.client.HTTPException) as e:
            raise EtcdError(f"etcd {path}: {_one_line(e)}") from None
        finally:
            conn.close()
        try:
            out = json.loads(raw or b"{}")
        except ValueError:
            raise EtcdBadAnswer(f"etcd {path}: HTTP {resp.status}, not JSON: {raw[:200]!r}") from None
        if not isinstance(out, dict):
            raise EtcdBadAnswer(f"etcd {path}: HTTP {resp.status}, not a JSON object: {raw[:200]!r}")
        if resp.status != 200 or "error" in out:
            raise EtcdError(f"etcd {path}: HTTP {resp.status}: {out.get('message') or out.get('error') or raw[:200]!r}")
        return out

    def _read_body(self, path: str, resp: http.client.HTTPResponse) -> bytes:
        """The response body, at most ``max_response_bytes``: a larger ``Content-Length`` is refused before
        anything is read; without one, reading stops one byte past the cap."""
        cap = self.max_response_bytes
        length = resp.getheader("Content-Length")
        if length is not None:
            if not length.strip().isdigit():
                raise EtcdBadAnswer(f"etcd {path}: bad Content-Length {length[:40]!r}")
            if int(length) > cap:
                raise EtcdBadAnswer(f"etcd {path}: answer of {int(length)} bytes is over the {cap}-byte cap")
        raw = resp.read(cap + 1)
        if len(raw) > cap:
            raise EtcdBadAnswer(f"etcd {path}: answer over the {cap}-byte cap")
        return raw

    def _answer(self, path: str, body: dict[str, Any], parse: Callable[[dict[str, Any]], Any]) -> Any:
        """``parse`` of the answer to ``path``; an answer it cannot parse raises EtcdBadAnswer naming it."""
        out = self._call(path, body)
        try:
            return parse(out)
        except (ValueError, TypeError, KeyError, AttributeError) as e:  # binascii.Error is a ValueError
            raise EtcdBadAnswer(f"etcd {path}: malformed answer ({type(e).__name__}: {e})") from None

    # -- kv --------------------------------------------------------------

    def range_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` and the store revision the answer is from."""
        return self.range(prefix, prefix_end(prefix))

    def range(self, key: bytes, range_end: bytes | None = None) -> tuple[list[KeyValue], int]:
        """The keys in ``[key, range_end)`` (just ``key`` without ``range_end``) and the store revision."""
        body = {"key": _b64(key)}
        if range_end is not None:
            body["range_end"] = _b64(range_end)

        def parse(out: dict[str, Any]) -> tuple[list[KeyValue], int]:
            kvs = [KeyValue(*_key_value(kv)) for kv in _list(out.get("kvs", []), "kvs")]
            return kvs, _revision(out)

        return self._answer("/v3/kv/range", body, parse)

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Store ``value`` under ``key`` (attached to ``lease`` when non-zero); returns the new revision."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return self._answer("/v3/kv/put", body, _revision)

    def delete(self, key: bytes) -> int:
        """Delete ``key``; returns how many keys were deleted (0 or 1)."""
        return self._answer("/v3/kv/deleterange", {"key": _b64(key)}, lambda out: _int(out.get("deleted", 0)))

    # -- leases ----------------------------------------------------------

    def lease_grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; returns its id."""
        return self._answer("/v3/lease/grant", {"TTL": str(int(ttl_s))}, lambda out: _int(out["ID"]))

    def lease_keepalive(self, lease: int) -> int:
        """Refresh ``lease``; returns its new TTL in seconds, 0 when it no longer exists (expired or revoked)."""
        return self._answer("/v3/lease/keepalive", {"ID": str(lease)},
                            lambda out: _int(_obj(out.get("result", {}), "result").get("TTL", 0)))

    def lease_revoke(self, lease: int, timeout_s: float | None = None) -> None:
        """Revoke ``lease``: the keys attached to it are deleted now. A lease already gone is not an error."""
        try:
            self._call("/v3/lease/revoke", {"ID": str(lease)}, timeout_s)
        except EtcdError as e:
            if "lease not found" not in str(e):
                raise

    def lease_ttl(self, lease: int) -> int:
        """Seconds left on ``lease``; -1 when it does not exist."""
        return self._answer("/v3/lease/timetolive", {"ID": str(lease)}, lambda out: _int(out.get("TTL", -1)))

    # -- watch -----------------------------------------------------------

    def watch_prefix(self, prefix: bytes, start_revision: int, stop: threading.Event,
                     idle_timeout_s: float = 30.0,
                     on_open: Callable[[http.client.HTTPConnection], None] | None = None) -> Iterator[list[WatchEvent]]:
        """:meth:`watch` of every key under ``prefix``."""
        return self.watch(prefix, prefix_end(prefix), start_revision, stop, idle_timeout_s, on_open)

    def watch(self, key: bytes, range_end: bytes | None, start_revision: int, stop: threading.Event,
              idle_timeout_s: float = 30.0,
              on_open: Callable[[http.client.HTTPConnection], None] | None = None) -> Iterator[list[WatchEvent]]:
        """Yield batches of changes to the keys in ``[key, range_end)`` (just ``key`` when ``range_end`` is
        None) from ``start_revision`` on, until ``stop`` is set.

        Raises :class:`EtcdError` when the stream breaks, etcd cancels the
        watch (e.g. the revision was compacted) or nothing arrives for
        ``idle_timeout_s`` (the caller re-reads and watches again, so no
        change is lost), and :class:`EtcdBadAnswer` for a line that is not a
        well-formed watch message or is over ``max_response_bytes``.
        ``on_open`` gets the HTTP connection once it is open, so another
        thread can shut its socket down to end a blocked read at once (the
        iteration then raises, or ends when ``stop`` is set). The connection
        is closed when the generator ends.
        """
        req: dict[str, Any] = {"key": _b64(key), "start_revision": str(start_revision)}
        if range_end is not None:
            req["range_end"] = _b64(range_end)
        conn, resp = self._open("/v3/watch", {"create_request": req}, idle_timeout_s)
        if on_open is not None:
            on_open(conn)
        cap = self.max_response_bytes
        try:
            if resp.status != 200:
                raise EtcdError(f"etcd /v3/watch: HTTP {resp.status}")
            while not stop.is_set():
                try:
                    line = resp.readline(cap + 1)
                except (OSError, http.client.HTTPException, socket.timeout) as e:
                    raise EtcdError(f"etcd watch stream: {_one_line(e) or type(e).__name__}") from None
                if not line:
                    raise EtcdError("etcd closed the watch stream")
                if len(line) > cap:
                    raise EtcdBadAnswer(f"etcd watch: a message over the {cap}-byte cap")
                if not line.strip():
                    continue
                if not line.endswith(b"\n"):
                    raise EtcdBadAnswer(f"etcd watch: message cut short: {line[:200]!r}")
                events = _watch_events(line)
                if events:
                    yield events
        finally:
            conn.close()

    def __repr__(self) -> str:
        return f"<EtcdClient {self.url}>"
