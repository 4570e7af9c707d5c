"""The hard memory bound, measured on a real server process.

Stated bound (docs/notes/server.md): resident memory of ``kvfabric serve``
stays within ``capacity + 48 MiB + 1 KiB x stored objects`` however much is
written: the arena is preallocated and never grows, the 48 MiB covers the
interpreter, libraries and connection threads, and each stored object costs
an index entry (~0.6 KiB measured). Objects occupy at least one 4 KiB page,
so the per-object term is at most ``capacity / 4``, reached only with
objects of 4 KiB or less.
"""

from __future__ import annotations

import os

import pytest

from kvfabric import protocol as P
from kvfabric.server.native import THP_GRANTED, shmem_thp
from kvfabric.testing import start_server
from kvfabric.transport.tcp import connect

MiB = 1 << 20
FIXED_OVERHEAD = 48 * MiB
PER_OBJECT = 1024


@pytest.mark.parametrize("module", ["kvfabric", "kvfabric.testing.reference"])
@pytest.mark.parametrize("object_size", [256 * 1024, 4096])
def test_rss_bounded_after_writing_three_times_capacity(object_size, module):
    capacity = 64 * MiB
    with start_server(capacity=str(capacity), module=module) as srv:
        c = connect(srv.address, timeout_s=60)
        batch = max(1, (4 * MiB) // object_size)
        data = os.urandom(object_size)
        written, n = 0, 0
        while written < 3 * capacity:
            keys = [b"%012d" % (n + j) for j in range(batch)]
            n += batch
            sums = [P.checksum(k, data) for k in keys]
            status = c.request(P.PutRequest(keys, [object_size] * batch, sums), [data] * batch).msg.status
            assert set(status) == {P.PutStatus.STORED}
            written += object_size * batch
        # read some back too (GET pins and sends from the arena, no copies)
        got = c.request(P.GetRequest([b"%012d" % (n - 1 - j) for j in range(batch)])).msg
        assert got.sizes == [object_size] * batch
        st = c.request(P.StatsRequest()).msg.stats
        rss = srv.rss_bytes()
        # full, up to the headroom the product server keeps free ahead of demand (at most 10%)
        assert st["evictions"] > 0 and st["bytes_used"] >= capacity * 0.85
        bound = capacity + FIXED_OVERHEAD + PER_OBJECT * st["objects"]
        assert rss <= bound, f"VmRSS {rss / MiB:.1f} MiB over the bound {bound / MiB:.1f} MiB"
        assert rss >= capacity * 0.9  # the arena really was filled (the check is not vacuous)
        c.close()


def arena_vm_flags(pid: int) -> list[str]:
    """The VmFlags of the arena mapping (``/memfd:kvfabric-arena``) in process ``pid``'s smaps."""
    lines = open(f"/proc/{pid}/smaps").read().splitlines()
    for i, line in enumerate(lines):
        if "/memfd:kvfabric-arena" in line:
            for field in lines[i + 1:]:
                if field.startswith("VmFlags:"):
                    return field.split()[1:]
    raise AssertionError(f"no arena mapping in /proc/{pid}/smaps:\n" + "\n".join(
        line for line in lines if "/" in line and "-" in line.split()[0]))


@pytest.mark.parametrize("flag", ["on", "off"])
def test_the_arena_asks_for_huge_pages_only_with_the_flag(flag):
    """``--huge-pages on`` advises huge pages on the arena (MADV_HUGEPAGE: VmFlags ``hg``), which the kernel honours
    where shared-memory THP is enabled (``shmem_enabled`` advise); off (the default) it does not. Only the advice is
    checked: whether pages are huge is the host's setting, which the start-up line names."""
    args = ["--huge-pages", "on"] if flag == "on" else []
    with start_server(capacity=str(64 * MiB), extra_args=args) as srv:
        flags = arena_vm_flags(srv.pid)
        assert ("hg" in flags) == (flag == "on") and "sh" in flags, flags
        mode = shmem_thp()
        assert mode in {"always", "within_size", "advise", "never", "deny", "force", "unknown"}, mode
        said = f"arena huge pages advised (host shmem THP {mode})" if flag == "on" else "arena huge pages off"
        assert said in srv.stderr_text(), srv.stderr_text()[-2000:]
        if flag == "on" and mode in THP_GRANTED:
            # granted: the arena was faulted in, as huge pages, before the port opened (not in the data plane)
            rollup = open(f"/proc/{srv.pid}/smaps_rollup").read()
            pmd_kb = int(rollup.split("ShmemPmdMapped:")[1].split()[0])
            assert srv.rss_bytes() >= 64 * MiB and pmd_kb * 1024 >= 32 * MiB, (srv.rss_bytes(), rollup)
