"""Turn vLLM's ``kv_connector_extra_config`` into kvfabric configuration, once.

Keys accepted in ``kv_connector_extra_config`` (anything else is a
``ConfigError`` naming the key, raised when vLLM builds the connector, never
later in a step):

================== ========= ====================================================
key                default   meaning
================== ========= ====================================================
servers            required  ``["host:port", ...]`` or ``"h1:p1,h2:p2"``; or instead:
etcd               -         ``"http://host:2379"`` (comma list for several): follow the
                             members of a cluster in etcd (``kvfabric serve --etcd``)
cluster            default   with ``etcd``: the cluster name the servers registered under
chunk_tokens       block     tokens per chunk (the unit of lookup and of keys); a
                             multiple of vLLM's block size. Default: vLLM's block size
                             (from its cache config at start; 128 on the CPU backend),
                             so a hit recomputes at most one partial block, as vLLM's
                             own prefix cache does, and every pool object is one KV page
                             that loads receive in place
model_id           (model)   id bound into keys; set it when engines load the same
                             weights from different paths (the weights' fingerprint,
                             see ``weights_fingerprint``, is bound as well; after weights
                             are updated in memory, their live fingerprint: ``weights``)
tenant             ""        bound into keys: caches of different tenants never mix
lookup_timeout_ms  1000      after this the lookup answers "no hit" (scheduler
                             never waits longer; it is asked again meanwhile)
lookup_wait_ms     20        how long the scheduler waits inline for a lookup
                             before answering "ask me later"
lease_ms           30000     the pool pins what a lookup found for this long
lookup_probe       true      look a prompt up in two stages (scheduler.py): an EXISTS of
                             one object per KV-head column of each chunk bounds the hit,
                             then a LOOKUP of every object of only the chunks below it.
                             EXISTS does not read a server's shared tier (``--shared-path``):
                             set false where chunks may be held only there
load_timeout_s     2.0       deadline of one request's pool reads (then recompute)
load_async         true      load between steps (vLLM's ``load_kv_async``): a slow pool
                             delays only the requests loading from it, never the batch;
                             false: load inside the step, which then waits up to
                             ``load_timeout_s`` on a stalled pool
load_layerwise     false     with ``load_async: false`` and one block per chunk: receive
                             layer by layer, each layer's attention waiting only for its
                             own objects (vLLM's ``wait_for_layer_load``), so later layers
                             arrive while earlier ones compute
load_poll_ms       2         with ``load_async``: how long one step's ``get_finished``
                             waits for a load that is still in flight (the bound a
                             slow pool adds to a step)
load_guard         true      load only when it beats recompute (guard.py, issue 26): the
                             connector measures its async loads' seconds per token and the
                             engine's prefill seconds per computed prompt token, and loads
                             a hit's leading tokens only while loading them is predicted
                             faster than recomputing them (cut loads: ``loads_skipped_slower``).
                             Until both rates have a measured window it loads as before;
                             false: always load
load_guard_min_tokens 4096   tokens (loaded, and prefilled) of one measured window of each
                             rate; the guard decides only once both have one
load_guard_probe_s 30.0      while the guard skips loads, let one through when the last
                             load measurement is older than this (a pool that got fast again
                             is seen)
shutdown_drain_s   3.0       at shutdown, wait at most this long for queued saves (vLLM
                             kills the engine core 5 s after SIGTERM); the rest is
                             abandoned and counted
save_timeout_s     10.0      deadline of one save job's pool writes
max_pending_save_mb 512      bound on gathered-but-unsent save bytes; beyond it
                             chunks are skipped (counted), never queued
load / save        by role   ``kv_both``: both; ``kv_producer``: save only;
                             ``kv_consumer``: load only
pd_wait_ms         1000      disaggregated prefill (PD): when a request carries the producer's
                             ``kv_transfer_params`` (``{"kvfabric": {"chunks": N, ...}}``) and the
                             pool holds fewer of its chunks, look up again (every 10 ms, the
                             request waits, the batch does not) for at most this long before
                             recomputing the rest (not at all when every server owning the next
                             missing chunk is down)
weights_retire     false     live weight versions (weights.py, issue 27): tag every save with its
                             namespace (``Client.put(ns_tag=)``) and, when the keys move to new
                             weights, retire the previous namespace pool-wide (``Client.retire``:
                             every server drops it in O(1); ``weights_retires``, failures
                             ``weights_retire_errors``). Tagged puts travel as frames even on
                             shm/nixl connections. Only for pools whose engines all follow the
                             same updates: an engine still on the old weights loses its hits
hold_until_saved   by role   keep a finished request's KV blocks (vLLM ``delay_free_blocks``)
                             until its saves are acknowledged by the pool (reported through
                             ``get_finished``'s ``finished_sending``); default true for
                             ``kv_producer``, false otherwise
 segment_tokens    8192      placement (layout.py, issue 23): a chunk's objects (every layer
                             and KV head, every rank's) always live on one owner set, each
                             rank's part one server group; runs of this many
                             prompt tokens (from the start; a multiple of chunk_tokens) are
                             placed by their first chunk's key, so a dead server of N cuts a
                             prompt's hit only at a segment boundary. = chunk_tokens: each
                             chunk placed by its own key; 0: every object routed by its own
                             key (the layout before issue 23, no server groups)
 kv_heads_per_object 1        KV heads per pool object (layout.py, layout 3): 1, one object per
                              (chunk, layer, KV head), works for every TP size; g > 1 (dividing
                              the heads a rank holds at every TP size that shares the pool)
                              stores 1/g of the objects; bound into the keys (engines with
                              different values never share)
 register_load_buffer true    register what loads receive into with the client
                              (``Client.register_buffers``): the KV layer tensors (one
                              block per chunk), the staging buffer or the transfer buffer;
                              on ``native`` connections loads are then received with
                              io_uring READ_FIXED
 transfer_buffer_mb 1024      KV cache on a GPU (or pages of several runs, ``pages``): the
                              host memory saves and loads go through, allocated once at
                              start (pinned on a GPU; counted in ``transfer_buffer_bytes``).
                              A step's saves that find no room are skipped
                              (``save_no_buffer_chunks``), a load recomputes
                              (``load_no_buffer_chunks``); nothing waits for it. Not used
                              for a CPU KV cache whose pages are one run (received in place)
 every other ``kvfabric.ClientConfig`` setting (transport, timeout_s,
 connect_timeout_s, replicas (default 2 with a list of 3 or more servers,
 else 1; see docs/notes/vllm.md, issue 23), auth_token, key_algorithm, key_secret,
 verify_checksums, connections_per_server, ...; ``kvfabric.config.client_settings``):
 passed to ``ClientConfig`` (env ``KVFABRIC_*`` variables apply first, these keys win).
================== ========= ====================================================

Per request, vLLM's ``cache_salt`` is bound into the namespace
(``request_namespace``), so a salted request never reads KV saved without
that salt, the same isolation vLLM's own prefix cache gives.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvfabric import ClientConfig, ConfigError, Namespace
from kvfabric.config import client_settings
from kvfabric.protocol import MAX_LEASE_MS

from .layout import DEFAULT_SEGMENT_TOKENS

__all__ = ["ConnectorConfig", "parse_extra_config", "make_namespace", "request_namespace", "kv_layout_name",
           "weights_fingerprint", "KV_LAYOUT_VERSION"]

# Bumped whenever the byte layout of the pool objects changes (see layout.py).
# 3: one object per (chunk, layer, KV head), keys without the TP rank and size (MLA: per (chunk, layer));
# 2: one object per (chunk, layer) of one TP rank; 1: one object per chunk, layer-major.
KV_LAYOUT_VERSION = 3

# every ClientConfig setting is a connector setting too (kvfabric.config.client_settings); the
# membership ones (servers, etcd, cluster) are parsed on their own below
_CLIENT_KEYS = tuple(client_settings(exclude=("servers", "etcd", "cluster")))
#: Lease the scheduler's lookup takes on what it found, ms. vLLM loads in the step that scheduled the
#: request or, with async loads, within a few steps; 30 s covers a request that is looked up and
#: then preempted or queued behind a long prefill, and a lease left by an aborted request pins its
#: chunks for at most that long. At most the server's --max-lease-ms (60 s by default) is granted.
DEFAULT_LEASE_MS = 30_000
_ROLES = {"kv_both": (True, True), "kv_producer": (False, True), "kv_consumer": (True, False)}


@dataclass(frozen=True)
class ConnectorConfig:
    """Everything the connector needs, validated (see the module table)."""

    client: ClientConfig
    chunk_tokens: int = 128
    model_id: str | None = None
    tenant: str = ""
    lookup_timeout_ms: int = 1000
    lookup_wait_ms: int = 20
    lease_ms: int = DEFAULT_LEASE_MS
    lookup_probe: bool = True
    load_timeout_s: float = 2.0
    load_async: bool = True
    load_poll_ms: int = 2
    load_layerwise: bool = False
    load_guard: bool = True
    load_guard_min_tokens: int = 4096
    load_guard_probe_s: float = 30.0
    shutdown_drain_s: float = 3.0
    save_timeout_s: float = 10.0
    max_pending_save_bytes: int = 512 << 20
    load: bool = True
    save: bool = True
    register_load_buffer: bool = True
    transfer_buffer_bytes: int = 1024 << 20
    pd_wait_ms: int = 1000
    weights_retire: bool = False
    hold_until_saved: bool = False
    segment_chunks: int = DEFAULT_SEGMENT_TOKENS // 128   # segment_tokens // chunk_tokens (0: per object)
    kv_heads_per_object: int = 1


def _int(extra: Mapping[str, Any], key: str, default: int, lo: int, hi: int) -> int:
    v = extra.get(key, default)
    if type(v) is not int or not lo <= v <= hi:
        raise ConfigError(f"kv_connector_extra_config.{key} must be an int in {lo}..{hi}, got {v!r}")
    return v


def _float(extra: Mapping[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = extra.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo < v <= hi:
        raise ConfigError(f"kv_connector_extra_config.{key} must be a number in ({lo}, {hi}], got {v!r}")
    return float(v)


def _bool(extra: Mapping[str, Any], key: str, default: bool) -> bool:
    v = extra.get(key, default)
    if not isinstance(v, bool):
        raise ConfigError(f"kv_connector_extra_config.{key} must be true or false, got {v!r}")
    return v


def parse_extra_config(extra: Mapping[str, Any] | None, kv_role: str | None, block_size: int) -> ConnectorConfig:
    """Validate vLLM's extra config; raise ``ConfigError`` naming the first bad key."""
    extra = dict(extra or {})
    known = {"servers", "etcd", "cluster", "chunk_tokens", "model_id", "tenant", "lookup_timeout_ms", "lookup_wait_ms",
             "lease_ms", "lookup_probe", "load_timeout_s", "load_async", "load_layerwise", "load_poll_ms",
             "load_guard", "load_guard_min_tokens", "load_guard_probe_s",
             "shutdown_drain_s", "save_timeout_s", "max_pending_save_mb", "load", "save", "register_load_buffer",
             "transfer_buffer_mb",
             "pd_wait_ms", "weights_retire", "hold_until_saved", "segment_tokens", "kv_heads_per_object", *_CLIENT_KEYS}
    unknown = sorted(set(extra) - known)
    if unknown:
        raise ConfigError(f"unknown kv_connector_extra_config key(s) {unknown}; known: {sorted(known)}")
    if kv_role not in _ROLES:
        raise ConfigError(f"kv_role must be one of {sorted(_ROLES)}, got {kv_role!r}")
    client_over = {k: extra[k] for k in _CLIENT_KEYS if k in extra}
    if "etcd" in extra:
        if "servers" in extra:
            raise ConfigError("kv_connector_extra_config: give servers or etcd, not both")
        etcd, cluster = extra["etcd"], extra.get("cluster")
        if not isinstance(etcd, str) or not etcd:
            raise ConfigError(f"kv_connector_extra_config.etcd must be an etcd URL string, got {etcd!r}")
        if cluster is not None and not isinstance(cluster, str):
            raise ConfigError(f"kv_connector_extra_config.cluster must be a string, got {cluster!r}")
        client = ClientConfig.from_env(servers=(), etcd=etcd, cluster=cluster, **client_over)  # these keys win
    else:
        if "cluster" in extra:
            raise ConfigError("kv_connector_extra_config.cluster needs etcd")
        if "servers" not in extra:
            raise ConfigError('kv_connector_extra_config.servers is required (or etcd), e.g. ["127.0.0.1:7070"]')
        servers = extra["servers"]
        if not isinstance(servers, (str, list, tuple)):
            raise ConfigError(f"kv_connector_extra_config.servers must be a list of 'host:port', got {servers!r}")
        client = ClientConfig.from_env(servers=servers, etcd="", **client_over)  # servers win over KVFABRIC_ETCD
        if not client.servers:
            raise ConfigError("kv_connector_extra_config.servers is empty")
        if "replicas" not in extra and "KVFABRIC_REPLICAS" not in os.environ and len(client.servers) >= 3:
            # issue 23: with 3+ servers every chunk gets a second copy unless told otherwise, so one dead
            # server costs (almost) no hits; 2 servers keep 1 (a second copy would be every byte twice)
            client = client.with_(replicas=2)

    if type(block_size) is not int or block_size < 1:
        raise ConfigError(f"vLLM block size must be a positive int, got {block_size!r}")
    # One block per chunk by default: at most one partial block is recomputed on a
    # hit, and each object is one page's share of its KV heads, received in place (layout.py).
    chunk = _int(extra, "chunk_tokens", block_size, 1, 1 << 16)
    if chunk % block_size:
        raise ConfigError(f"kv_connector_extra_config.chunk_tokens={chunk} must be a multiple of "
                          f"vLLM's block size {block_size}")
    model_id = extra.get("model_id")
    if model_id is not None and (not isinstance(model_id, str) or not model_id):
        raise ConfigError(f"kv_connector_extra_config.model_id must be a non-empty string, got {model_id!r}")
    tenant = extra.get("tenant", "")
    if not isinstance(tenant, str):
        raise ConfigError(f"kv_connector_extra_config.tenant must be a string, got {tenant!r}")
    segment = _int(extra, "segment_tokens", max(chunk, DEFAULT_SEGMENT_TOKENS // chunk * chunk), 0, 1 << 24)
    if segment % chunk:
        raise ConfigError(f"kv_connector_extra_config.segment_tokens={segment} must be 0 or a multiple of "
                          f"chunk_tokens {chunk}")
    load_default, save_default = _ROLES[kv_role]
    lookup_timeout_ms = _int(extra, "lookup_timeout_ms", 1000, 1, 60_000)
    return ConnectorConfig(
        client=client,
        chunk_tokens=chunk,
        model_id=model_id,
        tenant=tenant,
        lookup_timeout_ms=lookup_timeout_ms,
        lookup_wait_ms=_int(extra, "lookup_wait_ms", min(20, lookup_timeout_ms), 0, lookup_timeout_ms),
        lease_ms=_int(extra, "lease_ms", DEFAULT_LEASE_MS, 0, MAX_LEASE_MS),
        lookup_probe=_bool(extra, "lookup_probe", True),
        load_timeout_s=_float(extra, "load_timeout_s", 2.0, 0, 600),
        load_async=_bool(extra, "load_async", True),
        load_poll_ms=_int(extra, "load_poll_ms", 2, 0, 1000),
        load_layerwise=_bool(extra, "load_layerwise", False),
        load_guard=_bool(extra, "load_guard", True),
        load_guard_min_tokens=_int(extra, "load_guard_min_tokens", 4096, 1, 1 << 30),
        load_guard_probe_s=_float(extra, "load_guard_probe_s", 30.0, 0, 86_400),
        shutdown_drain_s=_float(extra, "shutdown_drain_s", 3.0, 0, 600),
        save_timeout_s=_float(extra, "save_timeout_s", 10.0, 0, 600),
        max_pending_save_bytes=_int(extra, "max_pending_save_mb", 512, 1, 1 << 20) << 20,
        load=_bool(extra, "load", load_default),
        save=_bool(extra, "save", save_default),
        register_load_buffer=_bool(extra, "register_load_buffer", True),
        transfer_buffer_bytes=_int(extra, "transfer_buffer_mb", 1024, 1, 1 << 16) << 20,
        pd_wait_ms=_int(extra, "pd_wait_ms", 1000, 0, 60_000),
        weights_retire=_bool(extra, "weights_retire", False),
        hold_until_saved=_bool(extra, "hold_until_saved", kv_role == "kv_producer"),
        segment_chunks=segment // chunk,
        kv_heads_per_object=_int(extra, "kv_heads_per_object", 1, 1, 1 << 16),
    )


def make_namespace(cfg: ConnectorConfig, *, model: str, revision: str | None, dtype: str, kv_layout: str,
                   weights: str = "") -> Namespace:
    """The namespace of an engine: binds model, dtype, KV layout and chunk size, not the TP rank or size.

    ``kv_layout`` describes the bytes of the pool objects (``kv_layout_name``:
    vLLM layout name, the model's KV heads, head size, block size, layer
    count, object split, connector layout version), so engines whose KV bytes
    differ can never exchange chunks, while engines of different TP sizes,
    whose objects are the same (``layout``, layout version 3), do. ``weights``
    is ``weights_fingerprint`` of a local model directory (empty for a hub id,
    whose ``revision`` is bound instead): weights replaced under the same path
    get other keys.
    """
    return Namespace(
        model=cfg.model_id or model,
        revision=revision or "",
        dtype=dtype,
        kv_layout=kv_layout,
        block_tokens=cfg.chunk_tokens,
        tenant=cfg.tenant,
        extras={"weights": weights} if weights else {},
    )


def request_namespace(base: Namespace, cache_salt: str | None) -> Namespace:
    """``base`` for one request: vLLM's per-request ``cache_salt`` is bound into the keys."""
    if not cache_salt:
        return base
    return dataclasses.replace(base, extras={**base.extras, "cache_salt": cache_salt})


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
_CONFIG_FILES = ("config.json", "generation_config.json", "model.safetensors.index.json",
                 "pytorch_model.bin.index.json", "params.json")
_SAMPLES, _SAMPLE_BYTES = 8, 64 << 10


def weights_fingerprint(model: str) -> str:
    """A digest of what the weights under a local model directory are, "" if ``model`` is no directory.

    Hashes the config and index files whole, and of every weight file its
    name, size and eight 64 KiB samples at evenly spaced offsets (first and
    last included): a few MiB read at start-up even for large models, the
    same on every node that holds the same files (no mtimes, no paths), and
    different when weights are replaced under the same path (fine-tuned
    weights differ everywhere, so a sample sees it). Not a full content hash:
    two weight files equal in size and in every sampled range are taken for
    equal.
    """
    if not os.path.isdir(model):
        return ""
    h = hashlib.sha256(b"kvfabric-weights-v1")
    names = sorted(os.listdir(model))
    for name in names:
        path = os.path.join(model, name)
        if not os.path.isfile(path):
            continue
        if name in _CONFIG_FILES:
            with open(path, "rb") as f:
                data = f.read()
            h.update(b"C%s\0%d\0" % (name.encode(), len(data)))
            h.update(data)
        elif name.endswith(_WEIGHT_SUFFIXES):
            size = os.path.getsize(path)
            h.update(b"W%s\0%d\0" % (name.encode(), size))
            with open(path, "rb") as f:
                for i in range(_SAMPLES):
                    f.seek(max(0, (size - _SAMPLE_BYTES) * i // (_SAMPLES - 1)))
                    h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()[:32]


def kv_layout_name(layout: str, *, num_kv_heads: int, head_size: int, head_size_v: int, block_size: int,
                   num_layers: int, split_heads: bool = True, heads_per_object: int = 1) -> str:
    """The namespace's ``kv_layout``: everything that shapes the bytes of the pool objects.

    ``num_kv_heads`` is the model's total (all TP ranks; 1 for MLA), never a rank's
    share, so it is the same for every TP size; ``split_heads`` False: objects are whole
    pages (MLA, ``layout.HeadSplit``); ``heads_per_object``: KV heads per object."""
    split = ("per-head" if heads_per_object == 1 else f"heads-per-object={heads_per_object}") if split_heads \
        else "per-layer"
    return (f"vllm/{layout}/heads={num_kv_heads}/head={head_size}/head_v={head_size_v}/block={block_size}"
            f"/layers={num_layers}/{split}/v{KV_LAYOUT_VERSION}")
