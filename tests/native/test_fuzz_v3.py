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

from kvfabric.testing.fuzz import Fuzzer, start_fuzz_server
from kvfabric.testing.poll import wait_for

pytest.importorskip("kvfabric._native")

FRAMES = 2500


@pytest.mark.parametrize("seed", [22, 23])
def test_protocol3_frames_never_hurt_the_server(tmp_path, seed):
    # stall timeout 10 s: at load 20 our own HELLO + AUTH must not be taken for a stalled peer
    with start_fuzz_server(str(tmp_path), stall_timeout_s=10.0) as srv:
        fz = Fuzzer(srv, seed, session_timeout_s=120.0, probe_every=100)
        rep = fz.run(FRAMES)
        detail = f"{rep.summary()}\n" + "\n".join(rep.failures) + f"\nlog tail:\n{srv.proc.stderr_text()[-3000:]}"
        assert rep.frames >= FRAMES, detail
        assert srv.proc.alive and rep.crashes == 0, detail
        assert rep.hangs == 0 and rep.unresponsive == 0, detail
        assert rep.violations == 0, detail
        assert rep.over_bound == 0 and rep.rss_peak <= rep.rss_bound_at_peak, detail
        # every kind of session ran, and the oracles had something to check
        assert set(rep.by_kind) == {"auth", "preauth", "unix", "unix-preauth", "trickle", "hold"}, rep.by_kind
        assert rep.objects_checked > 0 and rep.shm_puts > 0, detail
        assert {"PUT", "GET", "SHM_RESERVE", "SHM_LEASE"} <= set(rep.answered), rep.answered
        assert rep.errors.get("AUTH_FAILED", 0) > 0, rep.errors
        # nothing left held once the fuzzer's connections are gone (our probe is the one connection)
        last: dict = {}

        def settled() -> bool:
            last.update(srv.probe())
            return last["connections"] == 1 and last["pinned"] == 0 and last["reserved_bytes"] == 0

        assert wait_for(settled, timeout_s=120), {k: last.get(k) for k in ("connections", "pinned", "reserved_bytes")}
        assert last["errors"].get("AUTH_FAILED", 0) > 0, last["errors"]
