"""Which pool servers own a block key: rendezvous (highest-random-weight) hashing.

Every server gets a score for every key,

    score(server_id, key) = xxh3_64(key, seed=xxh3_64(server_id))

and a key's owners are the ``replicas`` servers with the highest scores, best
first. ``server_id`` is the ``"host:port"`` string exactly as configured, so all
clients configured with the same member list agree on owners without talking to
each other. Adding or removing one of N servers moves only the keys whose top
score belonged to that server (about 1/N of them), and the blocks of one prompt
spread evenly over all servers, so a long prefix is fetched in parallel.

Placement keys: a caller may route a key by another key, its *placement key*
(``kvfabric.Client``'s ``placement=``): the owners of ``keys[i]`` are then
``owners(placement[i])``, the same formula over the placement key's bytes. All
objects that share a placement key (the layer objects of one chunk, or every
chunk of a segment) therefore have the same owners and the same replicas, in
the same order. ``route_keys`` picks, per key, what is hashed; nothing else
changes, so the C batch routing below serves both (it routes a run of equal
placement keys once).

Ties between two servers' scores (probability 2**-64 per pair) are broken by
the lower server index, so the result is still deterministic.

Everything here is pure: no I/O, no global state apart from small caches of
server seeds (per server id and per server list). Bad input (an empty server
list, a replica count out of range, a key that is not bytes) raises
``ValueError`` or ``TypeError``.

Speed: ``owner_table`` and ``group_by_owner`` route a whole batch in C
(``kvfabric._native.route_owners``/``route_groups``, csrc/kvf_route.c, the
GIL released) when the extension is built and every key is a non-empty
``bytes``; otherwise, and always for a client-only install, the pure-Python
reference below (``reference_owner_table``/``reference_group_by_owner``)
answers, which is the spec: tests/native/test_route.py checks that both agree
on random keys, server lists and replica counts. 2,000 keys over 4 servers:
~10 ms in Python, well under 0.5 ms in C.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from functools import lru_cache

import xxhash

try:  # the batch routing in C; a client-only install (no extension) keeps the reference
    from ._native import route_groups as _c_groups, route_owners as _c_owners
except ImportError:  # pragma: no cover - depends on the build
    _c_groups = _c_owners = None

__all__ = [
    "server_seed", "score", "owners", "owner_table", "group_by_owner",
    "reference_owner_table", "reference_group_by_owner", "route_keys",
]


@lru_cache(maxsize=1024)
def server_seed(server_id: str) -> int:
    """The 64-bit seed of a server: ``xxh3_64`` of its UTF-8 id."""
    if not isinstance(server_id, str) or not server_id:
        raise ValueError(f"server id must be a non-empty str, got {server_id!r}")
    return xxhash.xxh3_64_intdigest(server_id.encode("utf-8"))


def score(server_id: str, key: bytes) -> int:
    """Rendezvous weight of ``key`` on ``server_id`` (an unsigned 64-bit int)."""
    return xxhash.xxh3_64_intdigest(key, seed=server_seed(server_id))


def route_keys(keys: Sequence[bytes], placement: Sequence[bytes] | None) -> Sequence[bytes]:
    """What is hashed to route each of ``keys``: ``keys`` itself, or ``placement`` (one placement key
    per key, the same length; ``ValueError`` otherwise). Placement keys are checked like keys when
    routed (non-empty ``bytes``)."""
    if placement is None:
        return keys
    if isinstance(placement, (bytes, bytearray, str)):
        raise TypeError("placement must be a sequence of keys (one per key), not a single key")
    placement = _as_list(placement)
    if len(placement) != len(keys):
        raise ValueError(f"{len(keys)} keys but {len(placement)} placement keys")
    return placement


def _check_servers(servers: Sequence[str]) -> list[int]:
    if isinstance(servers, str):
        raise TypeError("servers must be a sequence of 'host:port' strings, not one str")
    if len(servers) == 0:
        raise ValueError("servers must not be empty")
    if len(set(servers)) != len(servers):
        raise ValueError(f"duplicate server ids in {list(servers)!r}")
    return [server_seed(s) for s in servers]


@lru_cache(maxsize=64)
def _seeds_of(servers: tuple[str, ...]) -> bytes:
    """The checked seeds of a server list as native uint64s (what the C routing takes), cached:
    a client routes every call over the same list. Errors are raised, never cached."""
    return array("Q", _check_servers(servers)).tobytes()


def _packed_seeds(servers: Sequence[str]) -> bytes:
    if isinstance(servers, str):
        raise TypeError("servers must be a sequence of 'host:port' strings, not one str")
    return _seeds_of(servers if type(servers) is tuple else tuple(servers))


def _as_list(keys: Sequence[bytes]) -> Sequence[bytes]:
    # A one-shot iterable must survive the C attempt for the reference to see it too.
    return keys if isinstance(keys, (list, tuple)) else list(keys)


def _check_key(key: bytes) -> None:
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise TypeError(f"a key must be bytes, got {type(key).__name__}")
    if len(key) == 0:
        raise ValueError("a key must not be empty")


def _ranked(key: bytes, seeds: list[int], replicas: int) -> list[int]:
    h = xxhash.xxh3_64_intdigest
    # Sort by (-score, index): highest score first, lower index wins a tie.
    scored = sorted(((-h(key, seed=s), i) for i, s in enumerate(seeds)))
    return [i for _, i in scored[:replicas]]


def owners(key: bytes, servers: Sequence[str], replicas: int = 1) -> list[int]:
    """Indices into ``servers`` of the ``replicas`` owners of ``key``, best first.

    Raises ``ValueError`` when ``servers`` is empty or has duplicates, or when
    ``replicas`` is not in ``1..len(servers)``; ``TypeError`` for a non-bytes key.
    """
    seeds = _check_servers(servers)
    _check_replicas(replicas, len(seeds))
    _check_key(key)
    return _ranked(key, seeds, replicas)


def _check_replicas(replicas: int, n: int) -> None:
    if not isinstance(replicas, int) or isinstance(replicas, bool):
        raise TypeError(f"replicas must be an int, got {type(replicas).__name__}")
    if not 1 <= replicas <= n:
        raise ValueError(f"replicas must be in 1..{n} (the server count), got {replicas}")


def owner_table(keys: Sequence[bytes], servers: Sequence[str], replicas: int = 1) -> list[list[int]]:
    """``owners()`` for every key at once: one list of server indices per key.

    Errors as :func:`owners`. Runs in C when it can (module docstring);
    the result is the one :func:`reference_owner_table` gives.
    """
    if _c_owners is None:
        return reference_owner_table(keys, servers, replicas)
    packed = _packed_seeds(servers)
    _check_replicas(replicas, len(packed) // 8)
    keys = _as_list(keys)
    out = _c_owners(keys, packed, replicas)
    return reference_owner_table(keys, servers, replicas) if out is None else out


def group_by_owner(keys: Sequence[bytes], servers: Sequence[str]) -> dict[int, list[int]]:
    """Group key positions by their primary owner.

    Returns ``{server_index: [key_index, ...]}`` with key indices in ascending
    order (so each shard sees its keys in prompt order), servers in the order
    of their first key; servers that own none of the keys are absent. Errors
    as :func:`owners`. Runs in C when it can (module docstring); the result is
    the one :func:`reference_group_by_owner` gives.
    """
    if _c_groups is None:
        return reference_group_by_owner(keys, servers)
    packed = _packed_seeds(servers)
    keys = _as_list(keys)
    out = _c_groups(keys, packed)
    return reference_group_by_owner(keys, servers) if out is None else out


def reference_owner_table(keys: Sequence[bytes], servers: Sequence[str], replicas: int = 1) -> list[list[int]]:
    """:func:`owner_table` in pure Python: the spec, and the path without the extension."""
    seeds = _check_servers(servers)
    _check_replicas(replicas, len(seeds))
    out = []
    for k in keys:
        _check_key(k)
        out.append(_ranked(k, seeds, replicas))
    return out


def reference_group_by_owner(keys: Sequence[bytes], servers: Sequence[str]) -> dict[int, list[int]]:
    """:func:`group_by_owner` in pure Python: the spec, and the path without the extension."""
    seeds = _check_servers(servers)
    groups: dict[int, list[int]] = {}
    for i, k in enumerate(keys):
        _check_key(k)
        groups.setdefault(_ranked(k, seeds, 1)[0], []).append(i)
    return groups
