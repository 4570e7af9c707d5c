"""The ``Client``'s membership and routing (a mixin of ``kvfabric.Client``): the first contact with every
server, following membership changes (shards kept, added, retired), the routing view keys are hashed
over (server ids, ``_View``), and key -> owner tables over it. The rules are in ``kvfabric/client.py``'s
module docstring ("Membership and ownership"); hand-off between views is ``membership/handoff.py``. With a
membership whose ids are verified (signed etcd records, ``Membership.verifies``), a shard whose HELLO reports
another id than its record is left out of every view (``_impostor``; counted in ``member_id_mismatches``).

Uses the client's ``config``, ``_membership``, ``_members_lock``, ``_shards``, ``_by_index``, ``_view``,
``_previous``, ``_pool``, ``_counters``, ``_reconnector``, ``_registration``, ``_started`` and ``_closed``,
all set by ``Client.__init__``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from . import sharding
from ._shard import _Busy, _Down, _Shard
from .errors import AuthError, ConfigError, ErrorCode, KVFabricError, RemoteError, TransportUnavailable
from .membership import Member

log = logging.getLogger("kvfabric.client")


@dataclass(frozen=True)
class _View:
    """What keys are routed over: ``ids[p]`` is the routing id of ``shards[p]``; ``index[p]`` its ``shard.index``.

    ``identity``: ``index[p] == p`` for every ``p`` (a static list whose ids are
    all distinct), so sharding's positions need no translation.
    """

    ids: tuple[str, ...]
    shards: tuple[_Shard, ...]
    index: tuple[int, ...]
    identity: bool

    @classmethod
    def of(cls, ids: Sequence[str], shards: Sequence[_Shard]) -> _View:
        index = tuple(s.index for s in shards)
        return cls(tuple(ids), tuple(shards), index, index == tuple(range(len(index))))


class _Routing:
    """Membership and routing of a ``Client`` (see the module docstring)."""

    def _initial_connect(self, allow_rejects: bool) -> None:
        """Connect every shard once; see the class docstring for what raises (``allow_rejects``)."""
        # reaching a server has connect_timeout_s; a server that accepted then has the call deadline
        # (timeout_s) for its HELLO: first contact never marks a loaded server down after 0.5 s
        deadline = time.monotonic() + self.config.connect_timeout_s + self.config.timeout_s
        shards = list(self._shards)
        rejects: dict[int, RemoteError] = {}  # position in shards -> the server's refusal, named

        def first(pos: int, shard: _Shard) -> None:
            try:
                shard.release(shard.acquire(deadline))
            except (TransportUnavailable, ConfigError):
                raise
            except RemoteError as e:
                if isinstance(e, AuthError):  # this side refused the server: its message names it
                    rejects[pos] = e
                elif e.code in (ErrorCode.AUTH_FAILED, ErrorCode.BAD_VERSION):
                    named = RemoteError(e.code, f"server {shard.address} rejected this client: {e.message}")
                    named.__cause__ = e
                    rejects[pos] = named
                shard.mark_down(e)
            except _Busy as e:  # connect_timeout_s passed before this shard got a thread: no news of the server
                if not self._membership.dynamic:  # (a dynamic membership would route around it for nothing)
                    shard.mark_down(e)
            except KVFabricError as e:
                shard.mark_down(e)

        for f in [self._pool.submit(first, i, s) for i, s in enumerate(shards)]:
            f.result()
        if not rejects:
            return
        if not allow_rejects or len(rejects) == len(shards):
            raise rejects[min(rejects)]
        for pos in sorted(rejects):
            log.error("kvfabric: %s; it stays down (misses) and is retried in the background", rejects[pos])

    def _apply_members(self, members: tuple[Member, ...]) -> None:
        """Make the shards match ``members`` (the membership's thread, or the constructor) and re-route.

        A member whose address already has a shard keeps it (and its
        connections) unless membership now names another server id for that
        address; shards of members that left are retired; new ones are
        connected in the background so their HELLO id is known early.
        """
        if self._closed:
            return
        cfg = self.config
        added: list[_Shard] = []
        with self._members_lock:
            old = {s.address: s for s in self._shards}
            gone: list[_Shard] = []
            current: list[_Shard] = []
            for m in members:
                shard = old.pop(m.address, None)
                if shard is not None and m.server_id and shard.hint != m.server_id:
                    gone.append(shard)  # another server took this address over
                    shard = None
                if shard is None:
                    shard = _Shard(self._next_index, m.address, cfg, self._counters, self._reconnector,
                                   lambda: self._closed, self._registration, hint=m.route_id,
                                   on_identity=self._on_identity,
                                   on_state=self._on_state if self._membership.dynamic else None)
                    self._next_index += 1
                    self._by_index[shard.index] = shard
                    added.append(shard)
                current.append(shard)
            gone.extend(old.values())
            self._shards = current
            self.servers = tuple(s.address for s in current)
            self._rebuild_view()
        for s in gone:
            s.retire()
        if self._started:
            self._counters.add(membership_changes=1)
            log.info("kvfabric: members now %s (+%d -%d)", list(self._view.ids), len(added), len(gone))
            for s in added:
                try:
                    self._pool.submit(self._warm, s)
                except RuntimeError:  # the client closed meanwhile
                    return

    def _on_identity(self, shard: _Shard) -> None:
        """A shard's HELLO reported a server id (its first, or a new one): route over it from now on.

        With a membership that verifies ids (signed etcd records), a HELLO id that is not the one the
        shard's record proved is an impostor or a misconfigured server: it takes no keys at all (left
        out of the view by ``_rebuild_view``), logged as an error and counted (``member_id_mismatches``)."""
        if self._impostor(shard):
            self._counters.add(member_id_mismatches=1)
            log.error("kvfabric: %s answered HELLO as server %r but its verified member record is %r; not routed "
                      "to", shard.address, shard.server_id[:64], shard.hint)
        elif shard.hint != shard.server_id:
            log.info("kvfabric: %s is server %r (routed as %r until its HELLO)", shard.address, shard.server_id, shard.hint)
        with self._members_lock:
            self._rebuild_view()

    def _impostor(self, shard: _Shard) -> bool:
        """True when ``shard``'s HELLO id differs from the id its verified member record names."""
        return self._membership.verifies and bool(shard.server_id) and shard.server_id != shard.hint

    def _on_state(self, shard: _Shard) -> None:
        """A shard of a dynamic membership was marked down or came back up: route around it meanwhile."""
        with self._members_lock:
            self._rebuild_view()

    def _rebuild_view(self) -> None:
        """New routing view from ``_shards`` (caller holds ``_members_lock``); a duplicate id keeps the first.

        A dynamic membership's shards that are down are left out (routed around), so their keys go to
        the next server in rendezvous order until they are back; hand-off (``membership/handoff.py``)
        then finds what was put meanwhile. A static list keeps every entry: a down shard's keys miss."""
        ids: list[str] = []
        shards: list[_Shard] = []
        # (when every shard is down, routing over them all is as good and spares views)
        skip_down = self._membership.dynamic and not all(s.down_until for s in self._shards)
        for s in self._shards:
            if skip_down and s.down_until or self._impostor(s):
                continue
            rid = s.route_id
            if rid in ids:
                log.debug("kvfabric: %s reports server id %r like another entry; one shard for routing", s.address, rid)
                continue
            ids.append(rid)
            shards.append(s)
        old = self._view
        changed = (tuple(ids), tuple(s.index for s in shards)) != (old.ids, old.index)
        if old.ids and changed and self.config.handoff_s > 0:
            self._previous.push(old, time.monotonic() + self.config.handoff_s)  # for hand-off, see HandOff
        self._view = _View.of(ids, shards)

    def _warm(self, shard: _Shard) -> None:
        """Connect a shard that just joined (pool thread), so its HELLO id and a connection are ready."""
        try:
            shard.release(shard.acquire(time.monotonic() + self.config.connect_timeout_s + self.config.timeout_s))
        except _Down:
            pass
        except _Busy:
            pass  # the pool was slow, not the server: the first call connects it
        except KVFabricError as e:
            shard.mark_down(e)

    @property
    def members(self) -> tuple[str, ...]:
        """The server ids keys are routed over now (see the module docstring)."""
        return self._view.ids

    def route(self, keys: Sequence[bytes], *, placement: Sequence[bytes] | None = None) -> list[list[str]]:
        """The server ids that own each key now, best first (``replicas`` of them, fewer when the
        cluster is smaller; none when it is empty), routed by ``placement`` when given (as ``put``).
        Pure routing: no request is sent."""
        keys, _ = self._placement(self._keys(keys), placement)
        view = self._view
        return [[view.ids[p] for p in row] for row in self._positions(keys, view)]

    def unreachable(self, keys: Sequence[bytes], *, placement: Sequence[bytes] | None = None) -> list[bool]:
        """Per key: True when every server that owns it now is marked down (a request or connect to
        it failed; it is tried again after its backoff), so a lookup or get of it is a miss without
        asking anyone until one of them is back. True for every key of an empty cluster. ``placement``:
        as for ``route``. Pure bookkeeping: no request is sent (a caller deciding whether waiting for a
        key can pay off)."""
        keys, _ = self._placement(self._keys(keys), placement)
        view = self._view
        down = [bool(s.down_until) for s in view.shards]
        return [all(down[p] for p in row) for row in self._positions(keys, view)]  # no owners: True

    def _positions(self, keys: Sequence[bytes], view: _View) -> list[list[int]]:
        """Owners of each key as positions in ``view`` (``view.ids[p]``), best first; none in an empty view."""
        if not view.ids:
            return [[] for _ in keys]
        return sharding.owner_table(keys, view.ids, min(self.config.replicas, len(view.ids)))

    def _owners(self, keys: list[bytes], view: _View | None = None) -> list[list[int]]:
        """Owners of each key as ``shard.index`` values, routed over ``view``'s server ids (default: the current)."""
        view = self._view if view is None else view
        table = self._positions(keys, view)
        if view.identity:
            return table
        index = view.index
        return [[index[p] for p in row] for row in table]

    def _primary_groups(self, keys: list[bytes]) -> dict[int, list[int]]:
        """``sharding.group_by_owner`` over the current view, keyed by ``shard.index``."""
        view = self._view
        if not view.ids:
            return {}
        groups = sharding.group_by_owner(keys, view.ids)
        if view.identity:
            return groups
        index = view.index
        return {index[p]: g for p, g in groups.items()}
