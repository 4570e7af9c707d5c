"""The golden conversation shared by the Python protocol module and the C data plane.

``CASES`` is a fixed sequence of requests to a fresh server and the exact
reply each must produce. ``golden_frames.json`` (checked in) holds their bytes;
``test_golden.py`` checks that :mod:`kvfabric.protocol` still encodes exactly
those bytes and that the C server (csrc/) answers with exactly those bytes.
Regenerate the file only for a deliberate wire change:
``python tests/native/native_golden.py > tests/native/golden_frames.json``.
"""

from __future__ import annotations

import json
import sys

import xxhash

from kvfabric import protocol as p

K1 = bytes(range(16))
K2 = bytes(range(16, 48))
K3 = b"\x5a" * 16
MISSING = b"\xff" * 16
ABC = b"abc"
K4 = b"\x33" * 16
TAG = bytes(range(100, 116))

# (name, request message, request payload, reply message, reply payload)
CASES = [
    ("ping", p.PingRequest(), b"", p.PingReply(), b""),
    ("put", p.PutRequest(keys=[K1, K2], sizes=[3, 0], checksums=[p.checksum(K1, ABC), p.checksum(K2, b"")],
                         parents=[None, K1]), ABC, p.PutReply(status=[0, 0]), b""),
    ("put_again", p.PutRequest(keys=[K1], sizes=[3], checksums=[p.checksum(K1, ABC)]), ABC,
     p.PutReply(status=[1]), b""),
    ("put_bad_checksum", p.PutRequest(keys=[MISSING], sizes=[3], checksums=[1]), ABC, p.PutReply(status=[4]), b""),
    # protocol 2: K1's bytes under K3 with K1's (valid) checksum are refused; K3 stays unheld
    ("put_other_keys_checksum", p.PutRequest(keys=[K3], sizes=[3], checksums=[p.checksum(K1, ABC)]), ABC,
     p.PutReply(status=[4]), b""),
    ("get", p.GetRequest(keys=[K1, MISSING, K2]), b"",
     p.GetReply(sizes=[3, -1, 0], checksums=[p.checksum(K1, ABC), 0, p.checksum(K2, b"")]), ABC),
    ("exists", p.ExistsRequest(keys=[K1, MISSING, K3]), b"", p.ExistsReply(present=[True, False, False]), b""),
    ("lookup", p.LookupRequest(keys=[K1, K2, MISSING, K1]), b"", p.LookupReply(count=2), b""),
    ("delete", p.DeleteRequest(keys=[K2, MISSING]), b"", p.DeleteReply(deleted=1), b""),
    # issue 23: a group of two parts (then one of one) in one frame, stored whole
    ("put_group", p.PutRequest(keys=[K3, MISSING, K2], sizes=[3, 0, 0],
                               checksums=[p.checksum(K3, ABC), p.checksum(MISSING, b""), p.checksum(K2, b"")],
                               groups=[K1, K1, K2], group_parts=[2, 2, 1]), ABC, p.PutReply(status=[0, 0, 0]), b""),
    # issue 27: an object tagged with namespace TAG, the tag retired (generation 1), then it misses
    # while K3 (untagged) stays
    ("put_ns", p.PutRequest(keys=[K4], sizes=[3], checksums=[p.checksum(K4, ABC)], ns=TAG), ABC,
     p.PutReply(status=[0]), b""),
    ("exists_ns", p.ExistsRequest(keys=[K4, K3]), b"", p.ExistsReply(present=[True, True]), b""),
    ("retire", p.RetireRequest(ns=TAG), b"", p.RetireReply(generation=1), b""),
    ("exists_retired", p.ExistsRequest(keys=[K4, K3]), b"", p.ExistsReply(present=[False, True]), b""),
    ("retire_again", p.RetireRequest(ns=TAG), b"", p.RetireReply(generation=2), b""),
]

# The same-host conversation on the shm (unix) socket of a fresh server with a 16 MiB arena and no
# token: (name, request, reply or None for RELEASE, which has none). Before shm_commit the client
# writes ABC at offset 0 of the mapped arena (the slot shm_reserve handed out).
SHM_CAPACITY = 16 << 20
SHM_CASES = [
    ("shm_attach", p.ShmAttachRequest(), p.ShmAttachReply(capacity=SHM_CAPACITY)),
    ("shm_reserve", p.ShmReserveRequest(keys=[K1, K2], sizes=[3, 0], parents=[None, K1]),
     p.ShmReserveReply(res=1, offsets=[0, 4096], status=[0, 0])),
    ("shm_commit", p.ShmCommitRequest(res=1, checksums=[p.checksum(K1, ABC), p.checksum(K2, b"")]),
     p.ShmCommitReply(status=[0, 0])),
    ("shm_lease", p.ShmLeaseRequest(keys=[K1, MISSING]),
     p.ShmLeaseReply(lease=1, offsets=[0, -1], sizes=[3, -1], checksums=[p.checksum(K1, ABC), 0])),
    ("shm_release", p.ShmReleaseRequest(lease=1), None),
    ("shm_ping", p.PingRequest(), p.PingReply()),
]

CHECKSUM_INPUTS = [b"", b"a", b"abc", bytes(range(256)) * 17, b"\x00" * 4096]
# (key, value) pairs of the object checksum (protocol 2); values of both xxh3 paths (<= 240 bytes, longer)
KEYED_INPUTS = [(K1, b""), (K1, ABC), (K2, ABC), (b"k", bytes(range(256)) * 17), (MISSING, b"\x00" * 4096)]

# (token, client nonce, server nonce, server id) of the HELLO proof vectors
PROOF_INPUTS = [
    ("s3cret", bytes(range(32)), bytes(range(32, 64)), "127.0.0.1:7070"),
    ("pool token \u00e9", b"\x00" * 32, b"\xff" * 32, "pool-a"),
    ("k" * 100, bytes(range(100, 132)), bytes(range(200, 232)), ""),  # a token over HMAC's 64-byte block
]


def frames() -> dict:
    """Every golden frame as hex, as kvfabric.protocol encodes it today."""
    out = {"cases": [], "checksums": []}
    for i, (name, req, req_payload, rep, rep_payload) in enumerate(CASES, start=1):
        out["cases"].append({
            "name": name,
            "request": (p.encode_request(req, i) + req_payload).hex(),
            "reply": (p.encode_reply(rep, i) + rep_payload).hex(),
        })
    out["shm_cases"] = []
    for i, (name, req, rep) in enumerate(SHM_CASES, start=1):
        out["shm_cases"].append({
            "name": name,
            "request": p.encode_request(req, i).hex(),
            "reply": p.encode_reply(rep, i).hex() if rep is not None else None,
        })
    for data in CHECKSUM_INPUTS:  # plain xxh3_64: the seed each key gives its checksum
        out["checksums"].append({"data": data.hex(), "xxh3_64": xxhash.xxh3_64_intdigest(data)})
    out["object_checksums"] = [{"key": k.hex(), "data": v.hex(), "checksum": p.checksum(k, v)} for k, v in KEYED_INPUTS]
    # protocol 3: HELLO's proofs (kvfabric.protocol.auth) over fixed inputs, which C's HMAC must reproduce
    out["hello_proofs"] = [{
        "token": token, "client_nonce": nc.hex(), "server_nonce": ns.hex(), "server_id": sid,
        "server_proof": p.server_proof(token, nc, ns, sid).hex(), "client_proof": p.client_proof(token, ns, nc).hex(),
    } for token, nc, ns, sid in PROOF_INPUTS]
    out["error_unknown_opcode"] = p.encode_error(99, 7, p.ErrorCode.UNKNOWN_OPCODE, "unknown opcode").hex()
    return out


if __name__ == "__main__":
    json.dump(frames(), sys.stdout, indent=1)
    sys.stdout.write("\n")
