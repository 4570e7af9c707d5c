"""Membership pieces that need no sockets: key layout, member encoding, etcd range ends, endpoints, static list."""

from __future__ import annotations

import pytest

from kvfabric.membership import Member, StaticMembership
from kvfabric.membership.etcd import EtcdClient, EtcdError, prefix_end
from kvfabric.membership.registry import (
    check_cluster_name,
    decode_member,
    encode_member,
    member_key,
    member_prefix,
)


def test_prefix_end_follows_etcd_rule():
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"
    assert prefix_end(b"/kvfabric/clusters/c/members/") == b"/kvfabric/clusters/c/members0"


def test_key_layout_and_names():
    assert member_prefix("prod") == b"/kvfabric/clusters/prod/members/"
    assert member_key("prod", "pool-a") == b"/kvfabric/clusters/prod/members/pool-a"
    for bad in ("", "a/b", "x" * 65, "sp ace", "é"):
        with pytest.raises(ValueError):
            check_cluster_name(bad)
    with pytest.raises(ValueError):
        member_key("prod", "a/b")
    with pytest.raises(ValueError):
        member_key("prod", "")


def test_member_round_trip_and_malformed_entries():
    m = Member("s1", "10.0.0.5:7070", {"tcp": "10.0.0.5:7070", "native": "10.0.0.5:7070"}, 1 << 30,
               {"pid": 7, "version": "0.1.0"})
    back = decode_member(encode_member(m))
    assert back == m
    assert (back.addresses, back.capacity, back.info) == (m.addresses, m.capacity, m.info)
    for bad in (b"not json", b"{}", b'{"server_id": "s", "addresses": {}}', b'{"server_id": "", "addresses": {"tcp": "h:1"}}',
                b'{"server_id": "s", "addresses": {"tcp": 5}}', b"[1, 2]"):
        assert decode_member(bad) is None


def test_route_id_and_static_membership():
    assert Member("", "localhost:7070").route_id == "localhost:7070"
    assert Member("pool-a", "localhost:7070").route_id == "pool-a"
    static = StaticMembership(["h1:1", "h2:2"])
    seen = []
    static.start(seen.append)
    assert seen == [static.members()]
    assert [m.address for m in static.members()] == ["h1:1", "h2:2"]
    assert all(m.server_id == "" for m in static.members())
    assert not static.dynamic


def test_endpoints():
    c = EtcdClient("http://a:1, b:2,http://c")
    assert c.endpoints == [("a", 1), ("b", 2), ("c", 2379)]
    for bad in ("https://a:2379", "", " , "):
        with pytest.raises(EtcdError):
            EtcdClient(bad)
