"""Membership pieces that need no sockets: key layout, member encoding, etcd range ends, endpoints, static list."""

from __future__ import annotations

import hashlib
import hmac
import json

import pytest

from kvfabric.membership import Member, StaticMembership
from kvfabric.membership.etcd import EtcdClient, EtcdError, prefix_end, redact_url
from kvfabric.membership.registry import (
    check_cluster_name,
    decode_member,
    encode_member,
    member_key,
    member_prefix,
    member_proof,
    read_member,
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
    assert c.endpoints == [("http", "a", 1), ("http", "b", 2), ("http", "c", 2379)]
    assert EtcdClient("https://a:2379").endpoints == [("https", "a", 2379)]
    for bad in ("ftp://a:2379", "", " , ", "http://a:99999"):
        with pytest.raises(EtcdError):
            EtcdClient(bad)
    with pytest.raises(EtcdError, match="not https"):  # a CA with plain http would protect nothing
        EtcdClient("http://a:1", ca_file="/nonexistent.pem")
    with pytest.raises(EtcdError, match="CA file"):
        EtcdClient("https://a:1", ca_file="/nonexistent.pem")
    with pytest.raises(EtcdError, match="max_response_bytes"):
        EtcdClient("http://a:1", max_response_bytes=2 << 30)


TOKEN = "pool-token-\u00e9"  # UTF-8 bytes are the key


def _record(sid: str = "pool-a", lease: int = 0x1234, token: str | None = TOKEN, **info) -> bytes:
    return encode_member(Member(sid, "10.0.0.5:7070", {"tcp": "10.0.0.5:7070"}, 1 << 30,
                                dict({"pid": 7, "lease": lease}, **info)), token)


def test_member_proof_is_the_documented_hmac():
    value = _record()
    doc = json.loads(value)
    proof = doc.pop("proof")
    canonical = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    want = hmac.new(TOKEN.encode("utf-8"), b"kvfabric-member-v1\0" + canonical, hashlib.sha256).hexdigest()
    assert proof == want == member_proof(doc, TOKEN)
    assert value == json.dumps(dict(doc, proof=proof), sort_keys=True, separators=(",", ":")).encode()
    assert "proof" not in json.loads(_record(token=None))


def test_read_member_accepts_only_signed_records_under_their_own_key_and_lease():
    key = member_key("prod", "pool-a")
    m, why = read_member(key, _record(), TOKEN, 0x1234)
    assert m is not None and why == "" and m.server_id == "pool-a" and "proof" not in m.info
    cases = {
        "unsigned": (key, _record(token=None), 0x1234),
        "wrong proof": (key, _record(token="another-token"), 0x1234),
        "another id's key": (member_key("prod", "pool-b"), _record(), 0x1234),
        "lease": (key, _record(), 0),  # re-put without its lease (a replay or a forged copy)
        "tampered": (key, _record().replace(b"10.0.0.5:7070", b"10.6.6.6:7070"), 0x1234),
        "malformed": (key, b"\xff not json", 0x1234),
        "huge": (key, b" " * (65 << 10), 0x1234),
    }
    for name, (k, value, lease) in cases.items():
        m, why = read_member(k, value, TOKEN, lease)
        assert m is None and why, (name, why)
    assert "another id" not in read_member(key, _record(token=None), TOKEN, 0x1234)[1]
    # without a token: unsigned records are trusted, but never under another id's key
    assert read_member(key, _record(token=None), None)[0] is not None
    assert read_member(member_key("prod", "pool-b"), _record(token=None), None)[0] is None


def test_redact_url_masks_every_password():
    for url in ("http://root:s3cr%3At%40x@h:1", "https://u:s3cr@h:1,http://h2:2", "http://h:2,http://u:s3cr@h2:2",
                "ftp://u:s3cr@h", "u:s3cr@h:2379", "http://u:s3/cr@h:1", "http://u:s3,cr@h:1"):
        shown = redact_url(url)
        assert "s3" not in shown and "***" in shown, (url, shown)
    assert redact_url("http://h:2379,https://h2:2379") == "http://h:2379,https://h2:2379"
    for bad in ("ftp://root:s3cr@h:1", "http://root:s3cr/x@h:1", "http://root:s3cr@h:99999", "gopher://root:s3cr@h"):
        with pytest.raises(EtcdError) as e:
            EtcdClient(bad)
        assert "s3cr" not in str(e.value) and "\n" not in str(e.value), str(e.value)
