"""kvfabric: a distributed KV-cache pool for LLM inference engines.

The public API is re-exported here; every other module is an implementation
detail unless docs/ARCHITECTURE.md names it.
"""

from __future__ import annotations

from .client import Client, LookupRun, PutResult
from .config import ClientConfig, parse_servers, parse_size
from .errors import (
    AuthError,
    ChecksumError,
    ConfigError,
    ConnectionClosed,
    DeadlineExceeded,
    ErrorCode,
    KVFabricError,
    ProtocolError,
    RemoteError,
    RetireError,
    TransportError,
    TransportUnavailable,
)
from .keys import BlockKey, KeyAlgorithm, KeyHasher, Namespace, namespace_tag, prefix_keys

__version__ = "0.1.0"

__all__ = [
    "AuthError",
    "BlockKey",
    "ChecksumError",
    "Client",
    "ClientConfig",
    "ConfigError",
    "ConnectionClosed",
    "DeadlineExceeded",
    "ErrorCode",
    "KVFabricError",
    "KeyAlgorithm",
    "KeyHasher",
    "LookupRun",
    "Namespace",
    "ProtocolError",
    "PutResult",
    "RemoteError",
    "RetireError",
    "TransportError",
    "TransportUnavailable",
    "__version__",
    "namespace_tag",
    "parse_servers",
    "parse_size",
    "prefix_keys",
]
