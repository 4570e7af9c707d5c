"""Cluster membership: which pool servers a client shards over, and how it learns when that changes.

One interface, two implementations:

* :class:`StaticMembership`: the fixed ``host:port`` list a client is given
  (``Client(servers)``, ``KVFABRIC_SERVERS``); the embedded default, no
  etcd anywhere. Its members carry no server id: a client routes each one
  under its configured address until the server answers HELLO, then under
  the id the server reports.
* :class:`~kvfabric.membership.watcher.EtcdMembership`: members read from etcd
  (``Client(etcd=URL, cluster=NAME)``), where each ``kvfabric serve --etcd
  URL --cluster NAME`` registers itself under a lease it keeps alive
  (:class:`~kvfabric.membership.registry.Registration`); a watch delivers
  joins and leaves, and a server that dies disappears when its lease expires.

A :class:`Membership` calls ``on_change(members)`` with the whole current
member tuple every time it changes (never with a partial update), from its
own thread; the client rebuilds its routing view from it. Members are
identified for routing by ``server_id`` (see ``kvfabric/client.py``), for
connecting by ``address``.

Modules: ``etcd.py`` (a small etcd v3 client over the JSON gateway),
``registry.py`` (key layout, member encoding, the server's registration),
``watcher.py`` (the client's watch).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Member", "Membership", "StaticMembership", "ManualMembership", "OnChange"]


@dataclass(frozen=True, eq=True)
class Member:
    """One pool server as membership knows it.

    ``server_id``: the stable id the server reports in HELLO ("" when not
    known yet: a static list entry). ``address``: the ``host:port`` a client
    connects to (tcp; the native transport negotiates on the same port).
    ``addresses``: every transport's address as the server published it.
    ``capacity``: arena bytes (0 unknown). ``info``: the rest of what the
    server published (pid, hostname, version, lease); not compared.
    """

    server_id: str
    address: str
    addresses: Mapping[str, str] = field(default_factory=dict, compare=False)
    capacity: int = field(default=0, compare=False)
    info: Mapping[str, Any] = field(default_factory=dict, compare=False)

    __hash__ = None  # type: ignore[assignment]  # mappings inside: not hashable

    @property
    def route_id(self) -> str:
        """The id a client routes this member under before its HELLO: the server id, else the address."""
        return self.server_id or self.address


OnChange = Callable[[tuple[Member, ...]], None]


class Membership(ABC):
    """Where a client's member list comes from (see the module docstring)."""

    @abstractmethod
    def start(self, on_change: OnChange) -> None:
        """Deliver the current members to ``on_change`` before returning, then every change until :meth:`close`."""

    @abstractmethod
    def members(self) -> tuple[Member, ...]:
        """The current members (a snapshot)."""

    def close(self) -> None:
        """Stop delivering changes; idempotent."""

    @property
    def dynamic(self) -> bool:
        """True when members can change while a client runs."""
        return False

    @property
    def verifies(self) -> bool:
        """True when every member's ``server_id`` was verified (a signed etcd record): a server whose
        HELLO then reports another id is not routed to (``kvfabric/_routing.py``)."""
        return False


class StaticMembership(Membership):
    """A fixed list of ``host:port`` addresses (validated by the caller); never changes."""

    def __init__(self, addresses: Sequence[str]) -> None:
        self._members = tuple(Member(server_id="", address=a) for a in addresses)

    def start(self, on_change: OnChange) -> None:
        on_change(self._members)

    def members(self) -> tuple[Member, ...]:
        return self._members

    def __repr__(self) -> str:
        return f"<StaticMembership {[m.address for m in self._members]}>"


class ManualMembership(Membership):
    """Members the embedding program sets itself (:meth:`set`): a cluster manager of its own, tests, benchmarks.

    Each :meth:`set` delivers the new tuple to the client at once, in the calling thread.
    """

    def __init__(self, members: Sequence[Member] = ()) -> None:
        self._members = tuple(members)
        self._on_change: OnChange | None = None

    def start(self, on_change: OnChange) -> None:
        self._on_change = on_change
        on_change(self._members)

    def set(self, members: Sequence[Member]) -> None:
        self._members = tuple(members)
        if self._on_change is not None:
            self._on_change(self._members)

    def members(self) -> tuple[Member, ...]:
        return self._members

    def close(self) -> None:
        self._on_change = None

    @property
    def dynamic(self) -> bool:
        return True
