"""Turns LMCache's configuration into kvfabric settings, once, at the edge.

LMCache hands a remote storage plugin two things: a URL and its engine config.
With ``remote_storage_plugins: ["kvfabric"]`` the URL is the virtual
``plugin://kvfabric`` (``plugin://kvfabric.<instance>`` for a named instance)
and the real address lives in ``extra_config``::

    remote_storage_plugin.kvfabric.url: kvfabric://127.0.0.1:7070,127.0.0.1:7071?timeout_s=1

The kvfabric URL is ``kvfabric://host:port[,host:port...][?option=value&...]``,
or ``kvfabric://?etcd=http://H:P&cluster=NAME`` to follow a cluster's members
in etcd instead of a fixed list (the servers registered with ``kvfabric serve
--etcd URL --cluster NAME``; docs/notes/membership.md).
Options (each may also be given as ``remote_storage_plugin.<name>.<option>``
in ``extra_config``; the URL wins):

========================  ==================================================
``etcd``                  etcd URL(s) (``http://host:port[,...]``) holding the members; not with a server list
``cluster``               cluster name the servers registered under (default ``default``)
``timeout_s``             deadline of one pool call (default: ClientConfig's)
``connect_timeout_s``     per-server connect timeout
``replicas``              owners per key
``transport``             auto | tcp | native | shm
``key_algorithm``         xxh3_128 | blake3 | sha256
``max_batch_keys``        keys per request (1..4096)
``verify_checksums``      true | false
(any other)               every other ``ClientConfig`` setting (``connections_per_server``, ...)
``lease_ms``              lease a pinned lookup takes on the blocks (default 10000)
``io_threads``            threads that run pool calls for LMCache's event loop (default 4)
``scratch_mb``            staging buffers kept for reuse, MiB (default 256; see scratch.py)
========================  ==================================================

Secrets (``auth_token``, ``key_secret``) are deliberately not URL options; they
come from ``KVFABRIC_AUTH_TOKEN`` / ``KVFABRIC_KEY_SECRET`` or from
``extra_config`` (``remote_storage_plugin.<name>.auth_token``). Everything not
set falls back to the ``KVFABRIC_*`` environment (``ClientConfig.from_env``),
so ``KVFABRIC_SERVERS`` alone can name the pool.

Every problem raises :class:`kvfabric.ConfigError` naming the setting.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl

from kvfabric import ClientConfig, ConfigError, parse_servers
from kvfabric.config import client_settings
from kvfabric.protocol import MAX_LEASE_MS

SCHEME = "kvfabric://"
PLUGIN_SCHEME = "plugin://"
PLUGIN_TYPE = "kvfabric"

_SECRET_OPTIONS = ("auth_token", "key_secret")
# option name -> converter from its text form: every ClientConfig setting (etcd and cluster included)
# but the servers (the URL's) and the secrets (kept out of URLs), so a client setting is an LMCache
# option too
_CLIENT_OPTIONS: dict[str, Any] = client_settings(exclude=("servers", *_SECRET_OPTIONS))
_PLUGIN_OPTIONS: dict[str, Any] = {"lease_ms": int, "io_threads": int, "scratch_mb": int}

#: Lease a pinned lookup takes, ms. LMCache looks up (contains / batched_contains) right before it
#: retrieves the same keys in the same call path, so the lease has to outlive one retrieve, not
#: a scheduler queue: 10 s, far above a retrieve's deadline, and short because LMCache may look up
#: many keys it never retrieves (a lease pins their space). Capped by the server's --max-lease-ms.
DEFAULT_LEASE_MS = 10_000
DEFAULT_IO_THREADS = 4
DEFAULT_SCRATCH_MB = 256


def _parse_bool(text: str) -> bool:
    t = str(text).strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean, got {text!r}")


def _convert(conv: type, raw: Any) -> Any:
    """Text (URL, env) or YAML-typed value -> the option's type; ValueError otherwise."""
    if conv is str:
        return str(raw)
    if conv is bool:
        return raw if isinstance(raw, bool) else _parse_bool(str(raw))
    if isinstance(raw, bool):
        raise ValueError("expected a number, got a boolean")
    return conv(raw)


@dataclass(frozen=True)
class PluginSettings:
    """What the connector needs: the client config plus the plugin's own knobs."""

    client: ClientConfig
    lease_ms: int = DEFAULT_LEASE_MS
    io_threads: int = DEFAULT_IO_THREADS
    scratch_mb: int = DEFAULT_SCRATCH_MB

    def __post_init__(self) -> None:
        if type(self.lease_ms) is not int or not 0 <= self.lease_ms <= MAX_LEASE_MS:
            raise ConfigError(f"lease_ms must be an int in 0..{MAX_LEASE_MS}, got {self.lease_ms!r}")
        if type(self.io_threads) is not int or not 1 <= self.io_threads <= 64:
            raise ConfigError(f"io_threads must be an int in 1..64, got {self.io_threads!r}")
        if type(self.scratch_mb) is not int or not 0 <= self.scratch_mb <= 1 << 20:
            raise ConfigError(f"scratch_mb must be an int in 0..{1 << 20}, got {self.scratch_mb!r}")


def is_plugin_url(url: str) -> bool:
    """True for ``plugin://kvfabric`` and ``plugin://kvfabric.<instance>``."""
    if not url.startswith(PLUGIN_SCHEME):
        return False
    name = url[len(PLUGIN_SCHEME):]
    return name.split(".", 1)[0] == PLUGIN_TYPE


def parse_url(url: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """``kvfabric://h:p,h:p?k=v`` or ``kvfabric://?etcd=...`` -> (servers, raw options). Raises ConfigError."""
    if not isinstance(url, str) or not url.startswith(SCHEME):
        raise ConfigError(f"a kvfabric URL starts with {SCHEME!r}, got {url!r}")
    rest = url[len(SCHEME):]
    hosts, _, query = rest.partition("?")
    hosts = hosts.rstrip("/")
    options: dict[str, str] = {}
    for k, v in parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)):
        if k in _SECRET_OPTIONS:
            raise ConfigError(f"{k} must not be put in the URL (it ends up in logs); use KVFABRIC_{k.upper()} or extra_config")
        if k not in _CLIENT_OPTIONS and k not in _PLUGIN_OPTIONS:
            raise ConfigError(f"unknown kvfabric URL option {k!r}; known: {sorted({**_CLIENT_OPTIONS, **_PLUGIN_OPTIONS})}")
        if k in options:
            raise ConfigError(f"kvfabric URL option {k!r} given twice")
        options[k] = v
    if hosts and "etcd" in options:
        raise ConfigError(f"kvfabric URL {url!r} names servers and etcd: give one of them")
    if not hosts and "etcd" not in options:
        raise ConfigError(
            f"kvfabric URL {url!r} names no server (expected {SCHEME}host:port[,host:port...] or {SCHEME}?etcd=http://H:P&cluster=NAME)"
        )
    return (parse_servers(hosts) if hosts else ()), options


def _plugin_prefixes(plugin_name: str | None) -> list[str]:
    # "kvfabric.primary" reads "remote_storage_plugin.kvfabric.primary.*" and
    # then falls back to "remote_storage_plugin.kvfabric.*".
    names = []
    if plugin_name:
        names.append(plugin_name)
    if PLUGIN_TYPE not in names:
        names.append(PLUGIN_TYPE)
    return [f"remote_storage_plugin.{n}." for n in names]


def _lookup(extra: Mapping[str, Any], prefixes: list[str], option: str) -> Any:
    for p in prefixes:
        if p + option in extra:
            return extra[p + option]
    return None


def _build(real_url: str | None, lookup: Any, where_prefix: str, environ: Mapping[str, str] | None) -> PluginSettings:
    """Shared by both entry points: URL options win over ``lookup(option)`` values, then ``KVFABRIC_*``."""
    servers: tuple[str, ...] = ()
    options: dict[str, str] = {}
    if real_url:
        servers, options = parse_url(real_url)
    client_kw: dict[str, Any] = {}
    plugin_kw: dict[str, Any] = {}
    for name, conv in {**_CLIENT_OPTIONS, **_PLUGIN_OPTIONS}.items():
        raw = options.get(name)
        where = f"kvfabric URL option {name}"
        if raw is None:
            raw = lookup(name)
            where = f"{where_prefix}{name}"
        if raw is None:
            continue
        try:
            value = _convert(conv, raw)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}={raw!r}: {exc}") from None
        (client_kw if name in _CLIENT_OPTIONS else plugin_kw)[name] = value
    for name in _SECRET_OPTIONS:
        raw = lookup(name)
        if raw is not None:
            client_kw[name] = str(raw)
    if servers and client_kw.get("etcd"):
        raise ConfigError(f"kvfabric servers {list(servers)} and {where_prefix}etcd are both set: give one of them")
    if servers:
        client_kw["servers"] = servers
        client_kw["etcd"] = ""  # an explicit list wins over KVFABRIC_ETCD
    elif client_kw.get("etcd"):
        client_kw["servers"] = ()  # explicit etcd wins over KVFABRIC_SERVERS
    client = ClientConfig.from_env(environ, **client_kw)
    if not client.servers and not client.etcd:
        raise ConfigError(
            f"no kvfabric servers configured: set {where_prefix}url (kvfabric://host:port,... or "
            f"kvfabric://?etcd=URL&cluster=NAME), {where_prefix}etcd, KVFABRIC_SERVERS or KVFABRIC_ETCD"
        )
    if client.servers and client.etcd:
        raise ConfigError("KVFABRIC_SERVERS and KVFABRIC_ETCD are both set: give one of them")
    return PluginSettings(client=client, **plugin_kw)


def settings_from_lmcache(
    url: str,
    plugin_name: str | None,
    extra_config: Mapping[str, Any] | None,
    environ: Mapping[str, str] | None = None,
) -> PluginSettings:
    """Build the plugin settings from what LMCache passes to the remote-storage adapter.

    ``url`` is either a ``kvfabric://`` URL or LMCache's ``plugin://kvfabric``;
    for the latter the real URL is ``extra_config['remote_storage_plugin.<name>.url']``
    or, failing that, ``KVFABRIC_SERVERS``. Raises ConfigError when no server
    is named or a value is malformed.
    """
    extra = dict(extra_config or {})
    prefixes = _plugin_prefixes(plugin_name)
    if url.startswith(SCHEME):
        real_url: str | None = url
    elif is_plugin_url(url):
        found = _lookup(extra, prefixes, "url")
        if found is not None and not isinstance(found, str):
            raise ConfigError(f"{prefixes[0]}url must be a string, got {type(found).__name__}")
        real_url = found
    else:
        raise ConfigError(f"kvfabric plugin cannot handle URL {url!r} (expected {SCHEME}... or {PLUGIN_SCHEME}{PLUGIN_TYPE})")
    return _build(real_url, lambda name: _lookup(extra, prefixes, name), f"extra_config {prefixes[-1]}", environ)


def settings_from_params(params: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> PluginSettings:
    """Settings from a flat option map (the L2 adapter's ``adapter_params``): ``url`` plus the options above.

    Unknown keys raise ConfigError (a typo must not silently fall back to a default).
    """
    known = {"url", *_CLIENT_OPTIONS, *_PLUGIN_OPTIONS, *_SECRET_OPTIONS}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ConfigError(f"unknown kvfabric adapter_params {unknown}; known: {sorted(known)}")
    url = params.get("url")
    if url is not None and not isinstance(url, str):
        raise ConfigError(f"adapter_params url must be a string, got {type(url).__name__}")
    return _build(url, params.get, "adapter_params ", environ)


__all__ = ["PLUGIN_TYPE", "SCHEME", "PluginSettings", "is_plugin_url", "parse_url", "settings_from_lmcache", "settings_from_params"]
