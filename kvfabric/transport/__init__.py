"""Transport registry: which ways of talking to a pool server exist here, and connecting with one.

Each transport lives in its own module exposing

* ``probe() -> str | None``: ``None`` when the transport can be used in this
  process, else a short reason (extension not built, kernel too old, ...);
* ``connect(address, *, timeout_s, auth_token, client_name) -> Connection``:
  connect and run HELLO; raise :class:`~kvfabric.errors.TransportUnavailable`
  when this server cannot be reached this way (e.g. ``shm`` to another host),
  ``TransportError`` when it cannot be reached at all.

Modules are imported lazily, so a transport whose module fails to import is
simply unavailable (the import error is its reason). To add one, add a line to
``_TRANSPORTS`` below with its rank: lower ranks are faster and are tried
first by ``auto``.

Choosing: a named transport that is unavailable raises ``TransportUnavailable``;
there is never a silent fallback to a slower one. ``nixl`` is tried by ``auto``
only where its ``auto_reason()`` is None (UCX offers an RDMA transport). ``auto`` tries the
available transports fastest first, moves on only on ``TransportUnavailable``,
and logs, once per server, the one it chose and why it skipped the faster ones.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from types import ModuleType

from ..config import ClientConfig
from ..errors import ConfigError, TransportUnavailable
from .base import Connection, Reply

__all__ = ["Connection", "Reply", "available", "unavailable", "connect", "names"]

log = logging.getLogger("kvfabric.transport")


@dataclass(frozen=True)
class _Entry:
    name: str
    module: str
    rank: int  # lower = faster; auto tries ascending
    auto: bool = True  # False: auto tries it only when its module's auto_reason() is None


# The one place transports are registered.
_TRANSPORTS: tuple[_Entry, ...] = (
    _Entry("tcp", "kvfabric.transport.tcp", rank=100),
    _Entry("native", "kvfabric.transport.native", rank=50),
    _Entry("shm", "kvfabric.transport.shm", rank=10),
    # one-sided READ/WRITE into the server's arena through NIXL (UCX); auto only where UCX offers RDMA:
    # over UCX tcp it is slower than native (docs/notes/nixl.md)
    _Entry("nixl", "kvfabric.transport.nixl", rank=40, auto=False),
)

_modules: dict[str, ModuleType | str] = {}  # name -> module, or the reason it is unusable
_logged: set[tuple[str, str]] = set()  # (address, transport) choices already logged by auto


def names() -> list[str]:
    """Every registered transport, fastest first, usable here or not."""
    return [e.name for e in sorted(_TRANSPORTS, key=lambda e: e.rank)]


def _load(entry: _Entry) -> ModuleType | str:
    got = _modules.get(entry.name)
    if got is None:
        try:
            mod = importlib.import_module(entry.module)
            reason = mod.probe()
            got = mod if reason is None else reason
        except ImportError as e:
            got = f"cannot import {entry.module}: {e}"
        _modules[entry.name] = got
    return got


def available() -> list[str]:
    """Transports usable in this process, fastest first (``tcp`` always is)."""
    return [e.name for e in sorted(_TRANSPORTS, key=lambda e: e.rank) if not isinstance(_load(e), str)]


def unavailable() -> dict[str, str]:
    """Registered transports that are not usable here, with the reason."""
    out = {}
    for e in _TRANSPORTS:
        got = _load(e)
        if isinstance(got, str):
            out[e.name] = got
    return out


def _entry(name: str) -> _Entry:
    for e in _TRANSPORTS:
        if e.name == name:
            return e
    raise ConfigError(f"unknown transport {name!r}; registered: {names()} (or 'auto')")


def connect(name: str, address: str, config: ClientConfig, *, client_name: str = "kvfabric",
            hello_timeout_s: float | None = None) -> Connection:
    """Open a HELLO-negotiated connection to ``address`` with transport ``name`` (or ``"auto"``).

    ``config.connect_timeout_s`` bounds reaching the server; its HELLO reply then has
    ``hello_timeout_s`` (default ``config.timeout_s``, the deadline of any call): a loaded server
    that answers late is slow, not down (docs/notes/client.md, "Connect timeout").

    Raises ``TransportUnavailable`` when the named transport (or, for
    ``auto``, every available one) cannot serve this address, ``ConfigError``
    for an unknown name, and whatever the transport's ``connect`` raises
    (``TransportError``, ``RemoteError``, ``ProtocolError``) otherwise.
    """
    kwargs = dict(timeout_s=config.connect_timeout_s, auth_token=config.auth_token, client_name=client_name,
                  hello_timeout_s=config.timeout_s if hello_timeout_s is None else hello_timeout_s)
    if name != "auto":
        got = _load(_entry(name))
        if isinstance(got, str):
            raise TransportUnavailable(f"transport {name!r} was asked for but is unavailable: {got}")
        return got.connect(address, **kwargs)
    reasons = []
    for tname in available():
        mod = _load(_entry(tname))
        assert not isinstance(mod, str)
        if not _entry(tname).auto:
            why = mod.auto_reason()
            if why is not None:
                reasons.append(f"{tname}: {why}")
                continue
        try:
            conn = mod.connect(address, **kwargs)
        except TransportUnavailable as e:
            reasons.append(f"{tname}: {e}")
            continue
        if (address, tname) not in _logged:  # once per server, not per pooled connection
            _logged.add((address, tname))
            log.info("kvfabric: transport %s chosen for %s%s", tname, address,
                     f" (skipped {'; '.join(reasons)})" if reasons else "")
        return conn
    raise TransportUnavailable(f"no transport can reach {address}: {'; '.join(reasons)}")
