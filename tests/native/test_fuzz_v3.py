"""Protocol 3 under a seeded frame fuzzer (kvfabric/testing/fuzz.py): a real ``kvfabric serve`` with a pool
token, tcp+native+shm, an SSD tier and a shared tier.

Authenticated sessions (HELLO + AUTH first) send structured and mutated frames of every opcode, the shm
ops on the unix socket (with one real shm PUT per session) and trickled frames; unauthenticated ones must
get nothing but HELLO (within the pre-auth limits) and errors. Afterwards a fresh authenticated client
still gets PING answered, nothing is left pinned or reserved, the RSS never went over the bound
docs/operations.md states, and no GET or LEASE returned bytes that verify but are not what was PUT.
The long campaign is ``python -m kvfabric.testing.fuzz`` (docs/notes/protocol-v3.md has its last figures).
"""

from __future__ import annotations

import pytest

from kvfabric.testing.fuzz import Fuzzer, asan_preloaded, start_fuzz_server
from kvfabric.testing.poll import wait_for

pytest.importorskip("kvfabric._native")

FRAMES = 2500


@pytest.mark.parametrize("seed", [22, 23])
def test_protocol3_frames_never_hurt_the_server(tmp_path, seed):
    # stall timeout 10 s: at load 20 our own HELLO + AUTH must not be taken for a stalled peer
    with start_fuzz_server(str(tmp_path), stall_timeout_s=10.0) as srv:
        # under ASan (scripts/ci-native.sh) the server's RSS holds ASan's shadow memory: not held to the bound
        fz = Fuzzer(srv, seed, session_timeout_s=120.0, probe_every=100, check_rss=not asan_preloaded())
        rep = fz.run(FRAMES)
        detail = f"{rep.summary()}\n" + "\n".join(rep.failures) + f"\nlog tail:\n{srv.proc.stderr_text()[-3000:]}"
        assert rep.frames >= FRAMES, detail
        assert srv.proc.alive and rep.crashes == 0, detail
        assert rep.hangs == 0 and rep.unresponsive == 0, detail
        assert rep.violations == 0, detail
        assert rep.over_bound == 0 and (not fz.check_rss or rep.rss_peak <= rep.rss_bound_at_peak), detail
        # every kind of session ran, and the oracles had something to check
        assert set(rep.by_kind) == {"auth", "preauth", "unix", "unix-preauth", "trickle", "hold"}, rep.by_kind
        assert rep.objects_checked > 0 and rep.shm_puts > 0, detail
        assert {"PUT", "GET", "SHM_RESERVE", "SHM_LEASE"} <= set(rep.answered), rep.answered
        assert rep.errors.get("AUTH_FAILED", 0) > 0, rep.errors
        # the 4 MiB arena overflowed into the SSD tier, and committed PUTs were written through
        assert rep.tiers["ssd_writes"] > 0 and rep.tiers["shared_writes"] > 0, rep.tiers
        assert not any(rep.tiers[k] for k in ("ssd_corrupt", "ssd_errors", "shared_corrupt", "shared_errors")), rep.tiers
        # nothing left held once the fuzzer's connections are gone (our probe is the one connection)
        last: dict = {}

        def settled() -> bool:
            last.update(srv.probe())
            return last["connections"] == 1 and last["pinned"] == 0 and last["reserved_bytes"] == 0

        assert wait_for(settled, timeout_s=120), {k: last.get(k) for k in ("connections", "pinned", "reserved_bytes")}
        assert last["errors"].get("AUTH_FAILED", 0) > 0, last["errors"]


def test_the_pre_auth_oracle_fires_on_a_server_that_serves_before_auth(tmp_path):
    """The same pre-auth sessions against a server without a token (which serves every frame at once):
    the fuzzer reports ops answered before AUTH, so a server that did so with a token would be caught."""
    with start_fuzz_server(str(tmp_path), token=None, stall_timeout_s=10.0) as srv:
        rep = Fuzzer(srv, 5, session_timeout_s=120.0, kinds=("preauth",)).run(200)
    assert rep.violations > 0 and any("answered before AUTH" in f for f in rep.failures), rep.summary()
    assert rep.crashes == 0 and rep.hangs == 0, rep.summary()


def test_the_bytes_oracle_fires_on_wrong_bytes_that_verify(tmp_path):
    """A fuzzer-owned key stored beforehand with other bytes (and their valid checksum, as a writer
    that has the token could): the fuzzer's GETs of it report wrong bytes, so a server that returned
    another key's object, or a forged tier file, with a matching checksum would be caught."""
    import random

    from kvfabric import protocol as p
    from kvfabric.testing.fuzz import canonical, good_key
    from kvfabric.transport import tcp

    with start_fuzz_server(str(tmp_path), stall_timeout_s=10.0) as srv:
        key = good_key(random.Random(1))
        forged = bytes(len(canonical(key)))                   # zeros, not the canonical bytes
        with tcp.connect(srv.proc.address, timeout_s=30, auth_token=srv.token) as c:
            st = c.request(p.PutRequest([key], [len(forged)], [p.checksum(key, forged)]), [forged]).msg.status
        assert st == [p.PutStatus.STORED], st
        fz = Fuzzer(srv, 6, session_timeout_s=120.0, kinds=("auth",))
        fz.gen.good[:] = [key] * 50                           # every GET of a known key asks for this one
        rep = fz.run(300)
    assert any("returned wrong bytes that verify" in f for f in rep.failures), rep.summary() + str(rep.failures)
