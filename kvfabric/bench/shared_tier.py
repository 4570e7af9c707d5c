"""``kvfabric bench shared_tier``: the shared-filesystem tier (``serve --shared-path``); two servers share a directory.

For each object size: PUT N objects to server A (batches of 10, one TCP connection) with and without
``--shared-path`` (what the write-through costs a PUT: a copy on the loop thread), the tier thread's mean
write per object (``shared_write_us_total / shared_writes``, fsync never and always), then GET them all from
server B, which never saw them (read from DIR, verified, promoted into B's arena) and again (from B's DRAM).
Each with and without ``--auth-token`` (``--token off,on``): with a token every shared file carries an
HMAC-SHA256 of its header and value, computed by the writer and checked by the reader on the tier thread, so
the write and read columns of the two rows differ by that MAC; ``hmac us`` is the C HMAC alone
(``kvfabric._native.hmac_sha256`` over one object, the best of 20), the floor of that difference, and
``(OpenSSL)`` the same HMAC by Python's ``hmac`` (SHA extensions where the CPU has them).
Prints a table and writes the rows as JSON (``--json``, default bench-results/shared_tier.json). A
benchmark, not a test: figures depend on the filesystem and on the machine's load.

    python benchmarks/shared_tier.py --dir /mnt/juicefs/kvf-bench --sizes 256KiB,1MiB --count 200
    python benchmarks/shared_tier.py --fsync never --token off,on --sizes 64KiB,1MiB,4MiB   # the MAC's cost
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
import time

from .. import protocol as p
from ..config import parse_size
from ..testing.poll import wait_for
from ..testing.servers import start_server
from ..transport import tcp
from . import write_json


TOKEN = "bench-shared-tier-token"


def _stats(address: str, token: str | None = None) -> dict:
    with tcp.connect(address, timeout_s=60, auth_token=token) as c:
        return c.request(p.StatsRequest()).msg.stats


def hmac_us(size: int, rounds: int = 20) -> tuple[float, float]:
    """Microseconds of one HMAC-SHA256 over ``size`` bytes (the best of ``rounds``): in the C data plane
    (``kvfabric._native.hmac_sha256``, csrc/kvf_mac.c, what the tier runs) and in Python's ``hmac`` (OpenSSL,
    which uses the CPU's SHA extensions where it has them: what a faster C SHA-256 could reach)."""
    import hashlib
    import hmac

    from .. import _native

    buf = random.randbytes(size)
    key = TOKEN.encode()

    def best(fn) -> float:
        out = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            fn()
            out = min(out, time.perf_counter() - t0)
        return out * 1e6

    return best(lambda: _native.hmac_sha256(key, b"label", buf)), best(lambda: hmac.new(key, buf, hashlib.sha256).digest())


def _put_all(address: str, keys: list[bytes], vals: list[bytes], token: str | None = None) -> float:
    t0 = time.perf_counter()
    with tcp.connect(address, timeout_s=60, auth_token=token) as c:
        for i in range(0, len(keys), 10):
            ks, vs = keys[i:i + 10], vals[i:i + 10]
            st = c.request(p.PutRequest(ks, [len(v) for v in vs], [p.checksum(k, v) for k, v in zip(ks, vs)]), vs)
            assert all(s == p.PutStatus.STORED for s in st.msg.status)
    return time.perf_counter() - t0


def _get_all(address: str, keys: list[bytes], size: int, token: str | None = None) -> float:
    t0 = time.perf_counter()
    with tcp.connect(address, timeout_s=60, auth_token=token) as c:
        for i in range(0, len(keys), 10):
            r = c.request(p.GetRequest(keys[i:i + 10]))
            assert all(s == size for s in r.msg.sizes), r.msg.sizes
    return time.perf_counter() - t0


def run(base: str, size: int, count: int, fsync: str, token: str | None = None) -> dict:
    capacity = str(max(64 << 20, 4 * size * count))
    keys = [b"bench-%d-%d" % (size, i) for i in range(count)]
    vals = [random.randbytes(size) for _ in keys]
    auth = ["--auth-token", token] if token else []
    plain = start_server(capacity=capacity, extra_args=auth)
    try:
        put_plain = _put_all(plain.address, keys, vals, token)
    finally:
        plain.kill()
    d = tempfile.mkdtemp(prefix="kvf-shared-bench-", dir=base)
    # a write queue that holds every object: on a loaded machine the tier thread falls behind the PUTs,
    # and a dropped write would be a GET miss from B (what is measured here is the write, not the queue)
    queue = str(size * count + (1 << 20))
    a = start_server(capacity=capacity, extra_args=["--shared-path", d, "--shared-fsync", fsync,
                                                    "--ssd-write-queue", queue, *auth])
    b = start_server(capacity=capacity, extra_args=["--shared-path", d, *auth])
    try:
        put_shared = _put_all(a.address, keys, vals, token)

        def written() -> bool:
            st = _stats(a.address, token)
            return st["shared_writes"] + st["shared_write_drops"] >= count

        if not wait_for(written, 600):
            raise RuntimeError(f"writes did not finish: {_stats(a.address, token)}")
        sa = _stats(a.address, token)
        get_shared = _get_all(b.address, keys, size, token)
        get_dram = _get_all(b.address, keys, size, token)
        sb = _stats(b.address, token)
    finally:
        a.kill()
        b.kill()
        shutil.rmtree(d, ignore_errors=True)
    mb = count * size / 1e6
    return {
        "size": size, "count": count, "fsync": fsync, "token": bool(token),
        "put_mb_s_no_shared": mb / put_plain, "put_mb_s_shared": mb / put_shared,
        "shared_write_us": sa["shared_write_us_total"] / max(1, sa["shared_writes"]),
        "shared_write_drops": sa["shared_write_drops"],
        "shared_read_us": sb["shared_read_us_total"] / max(1, sb["shared_reads"]),
        "get_mb_s_from_shared": mb / get_shared, "get_mb_s_from_dram": mb / get_dram,
        "shared_hits": sb["shared_hits"], "shared_mac_refused": sb["shared_mac_refused"],
        **dict(zip(("hmac_us", "hmac_us_openssl"), hmac_us(size))),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvfabric bench shared_tier", description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the shared directory is made (default: the temp dir)")
    ap.add_argument("--sizes", default="256KiB,1MiB", help="object sizes, comma-separated (default 256KiB,1MiB)")
    ap.add_argument("--count", type=int, default=100, help="objects per size (default 100)")
    ap.add_argument("--fsync", default="never,always", help="--shared-fsync modes to run (default never,always)")
    ap.add_argument("--token", default="off",
                    help="off, on or off,on: servers without / with --auth-token (shared files MACed); default off")
    ap.add_argument("--json", default="bench-results/shared_tier.json", help="write the rows here")
    args = ap.parse_args(argv)
    modes = args.token.split(",")
    if not set(modes) <= {"off", "on"}:
        ap.error(f"--token takes off, on or off,on, not {args.token!r}")
    rows = [run(args.dir, parse_size(s), args.count, f, TOKEN if t == "on" else None)
            for s in args.sizes.split(",") for f in args.fsync.split(",") for t in modes]
    print(f"{'size':>8} {'fsync':>6} {'token':>5} {'PUT MB/s':>9} {'(no tier)':>9} {'write us':>9} {'drops':>5} "
          f"{'read us':>8} {'GET MB/s shared':>15} {'(DRAM)':>7} {'hmac us':>8} {'(OpenSSL)':>9}")
    for r in rows:
        print(f"{r['size'] >> 10:>6}Ki {r['fsync']:>6} {'on' if r['token'] else 'off':>5} "
              f"{r['put_mb_s_shared']:9.0f} {r['put_mb_s_no_shared']:9.0f} "
              f"{r['shared_write_us']:9.0f} {r['shared_write_drops']:5d} {r['shared_read_us']:8.0f} "
              f"{r['get_mb_s_from_shared']:15.0f} {r['get_mb_s_from_dram']:7.0f} {r['hmac_us']:8.0f} "
              f"{r['hmac_us_openssl']:9.0f}")
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; directory under {args.dir}")
    write_json(args.json, rows, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
