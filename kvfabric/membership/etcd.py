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
watch loops). Only ``http://`` URLs: TLS is not done (see the notes).

etcd auth (user and password): give them in the URL, ``http://USER:PASSWORD@
host:2379`` (percent-encode special characters; with several endpoints, on
any of them: one user for all). The client then gets a token from
``/v3/auth/authenticate`` before its first call and sends it in the
``Authorization`` header of every call; a call etcd refuses for a bad or
expired token (simple tokens expire after ``--auth-token-ttl``, 300 s by
default) authenticates again and is retried once. :attr:`EtcdClient.url`
(what logs and errors show) has the password replaced by ``***``.
"""

from __future__ import annotations

import base64
import http.client
import json
import re
import socket
import threading
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import KVFabricError

__all__ = ["EtcdClient", "EtcdError", "KeyValue", "WatchEvent", "prefix_end"]


class EtcdError(KVFabricError):
    """etcd could not be reached, or answered with an error."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


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
    """One change: ``kind`` is ``"PUT"`` or ``"DELETE"`` (a DELETE's ``value`` is empty)."""

    kind: str
    key: bytes
    value: bytes
    mod_revision: int


def _parse_endpoints(endpoints: str) -> list[tuple[str, int]]:
    return _parse(endpoints)[0]


def _parse(endpoints: str) -> tuple[list[tuple[str, int]], tuple[str, str] | None]:
    """Endpoints as (host, port) and the (user, password) given in one of them, if any."""
    out = []
    creds: set[tuple[str, str]] = set()
    for url in (u.strip() for u in endpoints.split(",")):
        if not url:
            continue
        if "://" not in url:
            url = "http://" + url
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise EtcdError(f"etcd endpoint must be http://HOST:PORT, got {url!r} (TLS is not supported)")
        out.append((parts.hostname, parts.port or 2379))
        if parts.username is not None:
            creds.add((urllib.parse.unquote(parts.username), urllib.parse.unquote(parts.password or "")))
    if not out:
        raise EtcdError("no etcd endpoint given")
    if len(creds) > 1:
        raise EtcdError("etcd endpoints name different users; give one user for all")
    return out, next(iter(creds), None)


def _redact(endpoints: str) -> str:
    """``endpoints`` with every password replaced by ``***``."""
    return ",".join(re.sub(r"^(\s*(?:\w+://)?[^/@:]*):[^/@]*@", r"\1:***@", u) for u in endpoints.split(","))


class EtcdClient:
    """etcd v3 over its JSON gateway (see the module docstring). Thread-safe: one HTTP connection per call."""

    def __init__(self, endpoints: str, timeout_s: float = 5.0) -> None:
        self.endpoints, self._credentials = _parse(endpoints)
        self.url = _redact(endpoints)
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
            host, port = self.endpoints[i]
            conn = http.client.HTTPConnection(host, port, timeout=timeout_s or self.timeout_s)
            try:
                conn.request("POST", path, body=data, headers=headers)
                resp = conn.getresponse()
            except (OSError, http.client.HTTPException) as e:
                conn.close()
                errors.append(f"{host}:{port}: {e}")
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
            raw = resp.read()
        except (OSError, http.client.HTTPException) as e:
            raise EtcdError(f"etcd {path}: {e}") from None
        finally:
            conn.close()
        try:
            out = json.loads(raw or b"{}")
        except ValueError:
            raise EtcdError(f"etcd {path}: HTTP {resp.status}, not JSON: {raw[:200]!r}") from None
        if resp.status != 200 or "error" in out:
            raise EtcdError(f"etcd {path}: HTTP {resp.status}: {out.get('message') or out.get('error') or raw[:200]!r}")
        return out

    # -- kv --------------------------------------------------------------

    def range_prefix(self, prefix: bytes) -> tuple[list[KeyValue], int]:
        """Every key under ``prefix`` and the store revision the answer is from."""
        out = self._call("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix))})
        kvs = [KeyValue(_unb64(kv.get("key")), _unb64(kv.get("value")), int(kv.get("mod_revision", 0)),
                        int(kv.get("lease", 0))) for kv in out.get("kvs", [])]
        return kvs, int(out.get("header", {}).get("revision", 0))

    def put(self, key: bytes, value: bytes, lease: int = 0) -> int:
        """Store ``value`` under ``key`` (attached to ``lease`` when non-zero); returns the new revision."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        return int(self._call("/v3/kv/put", body).get("header", {}).get("revision", 0))

    def delete(self, key: bytes) -> int:
        """Delete ``key``; returns how many keys were deleted (0 or 1)."""
        return int(self._call("/v3/kv/deleterange", {"key": _b64(key)}).get("deleted", 0))

    # -- leases ----------------------------------------------------------

    def lease_grant(self, ttl_s: int) -> int:
        """A new lease of ``ttl_s`` seconds; returns its id."""
        out = self._call("/v3/lease/grant", {"TTL": str(int(ttl_s))})
        return int(out["ID"])

    def lease_keepalive(self, lease: int) -> int:
        """Refresh ``lease``; returns its new TTL in seconds, 0 when it no longer exists (expired or revoked)."""
        out = self._call("/v3/lease/keepalive", {"ID": str(lease)})
        return int(out.get("result", {}).get("TTL", 0))

    def lease_revoke(self, lease: int, timeout_s: float | None = None) -> None:
        """Revoke ``lease``: the keys attached to it are deleted now. A lease already gone is not an error."""
        try:
            self._call("/v3/lease/revoke", {"ID": str(lease)}, timeout_s)
        except EtcdError as e:
            if "lease not found" not in str(e):
                raise

    def lease_ttl(self, lease: int) -> int:
        """Seconds left on ``lease``; -1 when it does not exist."""
        return int(self._call("/v3/lease/timetolive", {"ID": str(lease)}).get("TTL", -1))

    # -- watch -----------------------------------------------------------

    def watch_prefix(self, prefix: bytes, start_revision: int, stop: threading.Event,
                     idle_timeout_s: float = 30.0,
                     on_open: Callable[[http.client.HTTPConnection], None] | None = None) -> Iterator[list[WatchEvent]]:
        """Yield batches of changes under ``prefix`` from ``start_revision`` on, until ``stop`` is set.

        Raises :class:`EtcdError` when the stream breaks, etcd cancels the
        watch (e.g. the revision was compacted) or nothing arrives for
        ``idle_timeout_s`` (the caller re-reads the whole prefix and watches
        again, so no change is lost). ``on_open`` gets the HTTP connection
        once it is open, so another thread can shut its socket down to end a
        blocked read at once (the iteration then raises, or ends when
        ``stop`` is set). The connection is closed when the generator ends.
        """
        body = {"create_request": {"key": _b64(prefix), "range_end": _b64(prefix_end(prefix)),
                                   "start_revision": str(start_revision)}}
        conn, resp = self._open("/v3/watch", body, idle_timeout_s)
        if on_open is not None:
            on_open(conn)
        try:
            if resp.status != 200:
                raise EtcdError(f"etcd /v3/watch: HTTP {resp.status}")
            while not stop.is_set():
                try:
                    line = resp.readline()
                except (OSError, http.client.HTTPException, socket.timeout) as e:
                    raise EtcdError(f"etcd watch stream: {e or type(e).__name__}") from None
                if not line:
                    raise EtcdError("etcd closed the watch stream")
                if not line.strip():
                    continue
                try:
                    msg = json.loads(line)
                except ValueError:
                    raise EtcdError(f"etcd watch: not JSON: {line[:200]!r}") from None
                if "error" in msg:
                    raise EtcdError(f"etcd watch: {msg['error']}")
                res = msg.get("result", {})
                if res.get("canceled") or res.get("compact_revision"):
                    raise EtcdError(f"etcd cancelled the watch ({res.get('cancel_reason', 'compacted')})")
                events = [
                    WatchEvent(ev.get("type", "PUT"), _unb64(ev["kv"].get("key")), _unb64(ev["kv"].get("value")),
                               int(ev["kv"].get("mod_revision", 0)))
                    for ev in res.get("events", [])
                ]
                if events:
                    yield events
        finally:
            conn.close()

    def __repr__(self) -> str:
        return f"<EtcdClient {self.url}>"
