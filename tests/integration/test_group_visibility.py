"""Whether a server group's parts become visible together: real ``kvfabric serve`` processes (native
and reference), a PUT of a group whose last part is held back by a trickling sender, while another
connection LOOKUPs, EXISTSes and GETs the parts already received.

This is what a lookup of one representative per group would rely on (docs/notes/vllm.md, "The
lookup's cost"); it holds in DRAM (this test, and test_server_groups.py for eviction and DELETE),
not on a server's SSD or shared tier (see that note).
"""

from __future__ import annotations

from kvfabric import protocol as P
from kvfabric.protocol import PutStatus
from kvfabric.testing.poll import wait_for

from test_server_groups import PART, Conn, small  # noqa: F401 - small: the fixture (both servers)


def test_no_part_of_a_group_is_visible_before_its_last_part_arrives(small):  # noqa: F811
    sender, probe = Conn(small.address), Conn(small.address)
    keys = [b"slow/%d" % i for i in range(3)]
    vals = [bytes([i + 7]) * PART for i in range(3)]
    msg = P.PutRequest(keys=keys, sizes=[PART] * 3, checksums=[P.checksum(k, v) for k, v in zip(keys, vals)],
                       groups=[b"slow"] * 3, group_parts=[3] * 3)
    sender.rid = 1
    sender.sock.sendall(P.encode_request(msg, 1) + vals[0] + vals[1] + vals[2][:100])  # the last part held back
    # parts 0 and 1 are in their slots: the native server reserves a part's slot when its bytes come
    # and counts the bytes in; the reference reserves the group's slots at once (its bytes_in counts
    # no payload), so for it the probes below come while its PUT waits for the rest
    def received(s: dict) -> bool:
        return s["bytes_allocated"] >= 2 * PART and ("leased" in s or s["bytes_in"] >= 2 * PART)

    assert wait_for(lambda: received(probe.stats())), probe.stats()
    assert probe.call(P.LookupRequest(keys=keys[:1], lease_ms=0)) == {"count": 0}
    assert probe.call(P.LookupRequest(keys=keys, lease_ms=1000)) == {"count": 0}
    assert probe.present(b"slow", 3) == [False] * 3
    assert probe.call(P.GetRequest(keys=keys[:2]))["sizes"] == [-1, -1]
    assert probe.stats()["objects"] == 0
    # the rest arrives: the whole group at once
    sender.sock.sendall(vals[2][100:])
    h = P.unpack_header(sender._recv(P.HEADER_SIZE))
    meta = P.decode_meta(sender._recv(h.meta_len))
    assert h.request_id == 1 and not h.is_error and meta["status"] == [PutStatus.STORED] * 3, meta
    assert probe.call(P.LookupRequest(keys=keys, lease_ms=0)) == {"count": 3}
    # and it leaves whole: DELETE of one part removes every part
    assert probe.call(P.DeleteRequest(keys=[keys[2]])) == {"deleted": 3}
    assert probe.call(P.LookupRequest(keys=keys[:1], lease_ms=0)) == {"count": 0}
    sender.close()
    probe.close()
