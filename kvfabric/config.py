"""One typed client configuration; every ``KVFABRIC_*`` variable is declared here, once.

Config is parsed at the edge: a connector or CLI turns its own settings into a
:class:`ClientConfig` (``ClientConfig.from_env()`` reads the environment, and
keyword overrides win), and nothing deeper reads ``os.environ``. Invalid
values raise :class:`~kvfabric.errors.ConfigError` naming the setting.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from .errors import ConfigError
from .keys import KeyAlgorithm
from .membership.registry import check_cluster_name
from .sizes import parse_size

TRANSPORTS = ("auto", "tcp", "native", "shm", "nixl")

# name of the environment variable -> ClientConfig field it sets
ENV_VARS: dict[str, str] = {
    "KVFABRIC_SERVERS": "servers",
    "KVFABRIC_TRANSPORT": "transport",
    "KVFABRIC_TIMEOUT_S": "timeout_s",
    "KVFABRIC_CONNECT_TIMEOUT_S": "connect_timeout_s",
    "KVFABRIC_REPLICAS": "replicas",
    "KVFABRIC_AUTH_TOKEN": "auth_token",
    "KVFABRIC_KEY_ALGORITHM": "key_algorithm",
    "KVFABRIC_KEY_SECRET": "key_secret",
    "KVFABRIC_MAX_BATCH_KEYS": "max_batch_keys",
    "KVFABRIC_VERIFY_CHECKSUMS": "verify_checksums",
    "KVFABRIC_ETCD": "etcd",
    "KVFABRIC_ETCD_CA": "etcd_ca",
    "KVFABRIC_ETCD_CERT": "etcd_cert",
    "KVFABRIC_ETCD_KEY": "etcd_key",
    "KVFABRIC_CLUSTER": "cluster",
    "KVFABRIC_HANDOFF_S": "handoff_s",
}

def parse_servers(value: str | Sequence[str]) -> tuple[str, ...]:
    """``"h1:7070,h2:7071"`` or a list of ``host:port`` -> validated tuple (order kept)."""
    items = value.split(",") if isinstance(value, str) else list(value)
    out = []
    for item in items:
        item = str(item).strip()
        if not item:
            continue
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"server address must be host:port, got {item!r}")
        out.append(f"{host}:{int(port)}")
    if len(set(out)) != len(out):
        raise ConfigError(f"duplicate server in {out}")
    return tuple(out)


def _parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in ("1", "true", "yes", "on"):
        return True
    if t in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"expected a boolean, got {text!r}")


@dataclass(frozen=True)
class ClientConfig:
    """Settings of a :class:`kvfabric.Client`.

    ``timeout_s`` is the deadline of one client call (all shards together);
    a shard that has not answered by then counts as a miss for that call.
    ``connect_timeout_s`` bounds reaching a server (the TCP connect); a server
    that accepted then has the call deadline for its HELLO, so a loaded one is
    not marked down on first contact (docs/notes/client.md, "Connect timeout").

    Membership: either ``servers`` (a static list) or ``etcd`` (one
    ``http://host:port`` URL or a comma-separated list) with ``cluster``, the
    name the servers registered under (``kvfabric serve --etcd URL --cluster
    NAME``); the client then follows that cluster's members as they join and
    leave. Not both. ``https://`` etcd URLs are verified against ``etcd_ca``
    (a PEM CA file; the system's trust store when empty), and ``etcd_cert``
    (+ ``etcd_key`` when the key is a separate file) is the client certificate
    for an etcd that requires one: the production setting (docs/cluster.md).
    With ``auth_token`` set, only member records signed with it are routed to
    (``kvfabric/membership/registry.py``). ``handoff_s``: after a membership change, how long a key
    that misses on its new owner is still asked of its previous owner (and
    re-put to the new one on a hit); 0 turns hand-off off
    (``kvfabric/membership/handoff.py``).
    """

    servers: tuple[str, ...] = ()
    transport: str = "auto"
    timeout_s: float = 2.0
    connect_timeout_s: float = 0.5
    replicas: int = 1
    auth_token: str | None = None
    key_algorithm: str = KeyAlgorithm.XXH3_128.value
    key_secret: str = ""
    max_batch_keys: int = 4096
    verify_checksums: bool = True
    connections_per_server: int = 4
    reconnect_backoff_s: float = 0.2
    reconnect_backoff_max_s: float = 5.0
    etcd: str = ""
    etcd_ca: str = ""
    etcd_cert: str = ""
    etcd_key: str = ""
    cluster: str = "default"
    handoff_s: float = 30.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "servers", parse_servers(self.servers) if self.servers else ())
        if self.transport not in TRANSPORTS:
            raise ConfigError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        for name in ("timeout_s", "connect_timeout_s", "reconnect_backoff_s", "reconnect_backoff_max_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not 0 < v <= 3600:
                raise ConfigError(f"{name} must be in (0, 3600] seconds, got {v!r}")
        if type(self.replicas) is not int or self.replicas < 1:
            raise ConfigError(f"replicas must be an int >= 1, got {self.replicas!r}")
        if type(self.max_batch_keys) is not int or not 1 <= self.max_batch_keys <= 4096:
            raise ConfigError(f"max_batch_keys must be in 1..4096, got {self.max_batch_keys!r}")
        if type(self.connections_per_server) is not int or not 1 <= self.connections_per_server <= 64:
            raise ConfigError("connections_per_server must be in 1..64")
        if isinstance(self.handoff_s, bool) or not isinstance(self.handoff_s, (int, float)) \
                or not 0 <= self.handoff_s <= 3600:
            raise ConfigError(f"handoff_s must be in [0, 3600] seconds (0: no hand-off), got {self.handoff_s!r}")
        for name in ("etcd", "etcd_ca", "etcd_cert", "etcd_key"):
            if not isinstance(getattr(self, name), str):
                raise ConfigError(f"{name} must be a string, got {type(getattr(self, name)).__name__}")
        if self.etcd_key and not self.etcd_cert:
            raise ConfigError("etcd_key needs etcd_cert (the client certificate it belongs to)")
        try:
            check_cluster_name(self.cluster)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        try:
            KeyAlgorithm(self.key_algorithm)
        except ValueError:
            raise ConfigError(f"unknown key_algorithm {self.key_algorithm!r}") from None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> ClientConfig:
        """Defaults, then ``KVFABRIC_*`` variables, then ``overrides`` (None values ignored)."""
        env = os.environ if environ is None else environ
        types = {f.name: f.type for f in fields(cls)}
        values: dict[str, Any] = {}
        for var, name in ENV_VARS.items():
            if var not in env:
                continue
            raw = env[var]
            kind = types[name]
            try:
                if name == "servers":
                    values[name] = parse_servers(raw)
                elif kind in ("float", float):
                    values[name] = float(raw)
                elif kind in ("int", int):
                    values[name] = int(raw)
                elif kind in ("bool", bool):
                    values[name] = _parse_bool(raw)
                else:
                    values[name] = raw
            except (ValueError, ConfigError) as exc:
                raise ConfigError(f"{var}={raw!r}: {exc}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(values) - set(types)
        if unknown:
            raise ConfigError(f"unknown client setting(s): {sorted(unknown)}")
        return cls(**values)

    def with_(self, **changes: Any) -> ClientConfig:
        return replace(self, **changes)

    def __repr__(self) -> str:
        """Every setting, with the secrets masked: the token, the key secret and an etcd password."""
        from .membership.etcd import redact_url

        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in ("auth_token", "key_secret"):
            if shown[name]:
                shown[name] = "***"
        shown["etcd"] = redact_url(self.etcd)
        return f"ClientConfig({', '.join(f'{k}={v!r}' for k, v in shown.items())})"


_SCALAR_TYPES = {"str": str, "int": int, "float": float, "bool": bool, "str | None": str}


def client_settings(exclude: Sequence[str] = ()) -> dict[str, type]:
    """ClientConfig's settings and their value types (str, int, float or bool), ``exclude`` left out.

    Connectors take client settings from their engine's configuration; they accept these names
    (and pass them to :meth:`ClientConfig.from_env`) instead of re-declaring a subset of them,
    so a client setting added here is a connector setting too."""
    out = {}
    for f in fields(ClientConfig):
        if f.name in exclude:
            continue
        t = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        if t in _SCALAR_TYPES:
            out[f.name] = _SCALAR_TYPES[t]
    return out


__all__ = ["ClientConfig", "ENV_VARS", "TRANSPORTS", "client_settings", "parse_size", "parse_servers"]
