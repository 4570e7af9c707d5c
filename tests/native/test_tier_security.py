"""Tier directories trusted no more than the shm directory (issue 22, part 3), on real server processes.

Each test is one finding of the issue's red-team run against ``kvfabric serve --shared-path`` (the SSD
tier's are in tests/integration/test_ssd_tier.py): files another uid could read; a forged file planted
before the victim's PUT; a symlinked fan-out directory; a FIFO at a key's file name; a tier directory
that others can write, or that another uid owns. What is checked is what the attacker gets (a miss,
never bytes), what the server counts (STATS) and that it keeps working. The different-uid cases fork
a child that drops to uid 65534 and need root (they skip elsewhere). Nothing waits a fixed time:
asynchronous writes are awaited through STATS with generous deadlines.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import shutil
import struct
import tempfile

import pytest
import xxhash

from kvfabric import protocol as p
from kvfabric.testing.poll import wait_for
from kvfabric.testing.servers import start_server
from test_shm_security import NOBODY, ROOT_ONLY, as_nobody
from test_tier_shared import WAIT_S, _get, _put, _serve, _serve_fails, _stats, _value
from test_tier_shared import servers, shared  # noqa: F401  (the fixtures)

TOKEN = "pool-secret-for-the-tier-tests"
MAC_LABEL = b"kvfabric shared-tier object v2\0"  # csrc/kvf_shared.h KVF_SHARED_MAC_LABEL, its NUL included


def _leaf(shared: str, key: bytes) -> str:
    """DIR/xx/yy of key: the low two bytes of xxh3_64(key) (docs/notes/tier-shared.md)."""
    h = xxhash.xxh3_64_intdigest(key)
    return os.path.join(shared, f"{h & 0xff:02x}", f"{(h >> 8) & 0xff:02x}")


def _path(shared: str, key: bytes) -> str:
    return os.path.join(_leaf(shared, key), key.hex() + ".kvf")


def _file_bytes(key: bytes, value: bytes, mac_key: bytes | None = None) -> bytes:
    """A shared-tier file as docs/notes/tier-shared.md lays it out: format 1, or 2 with a MAC under mac_key."""
    k = len(key)
    version, hlen = (2, 72 + k) if mac_key is not None else (1, 40 + k)
    h = b"KVFS" + struct.pack("<HHB7s", version, hlen, k, bytes(7)) + struct.pack(
        "<QQ", len(value), p.checksum(key, value)) + key
    h += struct.pack("<Q", xxhash.xxh3_64_intdigest(h))
    if mac_key is not None:
        h += hmac.new(mac_key, MAC_LABEL + h[:32 + k] + value, hashlib.sha256).digest()
    return h + value


def _plant(path: str, data: bytes, owner: int | None = None) -> None:
    """Write data at path as an attacker would (fan-out directories made 0700 by us where missing)."""
    os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    if owner is not None:
        os.chown(path, owner, owner)


def _key_by_first_level(key: bytes, prefix: bytes, same: bool) -> bytes:
    """A key (prefix + n) whose first fan-out directory (xx) is key's (same) or not."""
    want = xxhash.xxh3_64_intdigest(key) & 0xff
    for n in range(100_000):
        k = prefix + b"%d" % n
        if (xxhash.xxh3_64_intdigest(k) & 0xff == want) == same and k != key:
            return k
    raise AssertionError("no key found")


# ---------------------------------------------------------------- who can read the files


@ROOT_ONLY
def test_another_uid_cannot_read_the_tiers_files(servers):
    # a root directory others may traverse (0755, ours, not writable by them): only the server's own
    # modes keep uid 65534 out (on main: directories 0755 and files 0644, so it read them all)
    root = tempfile.mkdtemp(prefix="kvf-shared-perm-", dir="/tmp")
    try:
        os.chmod(root, 0o755)
        a = _serve(root)
        servers.append(a)
        objs = {b"private-%d" % i: _value(b"private-%d" % i, 70_000) for i in range(8)}
        assert _put(a.address, objs) == [p.PutStatus.STORED] * len(objs)
        assert wait_for(lambda: _stats(a.address)["shared_writes"] == len(objs), WAIT_S), _stats(a.address)
        for key in objs:
            path = _path(root, key)
            leaf = os.path.dirname(path)
            modes = [os.stat(x).st_mode & 0o777 for x in (os.path.dirname(leaf), leaf, path)]
            assert modes == [0o700, 0o700, 0o600], f"{path}: modes {[oct(m) for m in modes]}"

            def read(path=path):
                try:
                    with open(path, "rb") as f:
                        return b"read %d bytes" % len(f.read())
                except PermissionError:
                    return b"denied"

            assert as_nobody(read) == b"denied", f"uid {NOBODY} read {path}"
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------- forged files (the MAC)


@pytest.mark.parametrize("forgery", ["format 1, no MAC", "format 2, MAC under another token",
                                     "format 1, owned by uid 65534"])
def test_a_file_planted_before_the_put_is_never_served_and_the_write_through_replaces_it(shared, servers, forgery):
    if "65534" in forgery and os.geteuid() != 0:
        pytest.skip("needs root to plant a file owned by another uid")
    key, real = b"victim-key", _value(b"victim-key", 100_000)
    forged = b"forged KV " * 10_000
    mac = b"not-the-pool-token" if "MAC" in forgery else None
    _plant(_path(shared, key), _file_bytes(key, forged, mac), owner=NOBODY if "65534" in forgery else None)
    b = _serve(shared, "--auth-token", TOKEN)
    servers.append(b)
    assert _get(b.address, [key], TOKEN) == [None], "the forged file was served"
    st = _stats(b.address, TOKEN)
    counter = "shared_refused" if "65534" in forgery else "shared_mac_refused"
    assert st[counter] == 1 and st["shared_hits"] == 0, {k: v for k, v in st.items() if k.startswith("shared_")}

    a = _serve(shared, "--auth-token", TOKEN)  # the victim: its write-through must not be blocked
    servers.append(a)
    assert _put(a.address, {key: real}, TOKEN) == [p.PutStatus.STORED]
    assert wait_for(lambda: _stats(a.address, TOKEN)["shared_writes"] == 1, WAIT_S), _stats(a.address, TOKEN)
    sa = _stats(a.address, TOKEN)
    assert sa["shared_replaced"] == 1 and sa["shared_exists"] == 0, sa
    with open(_path(shared, key), "rb") as f:
        assert f.read() == _file_bytes(key, real, TOKEN.encode()), "the file is not the victim's object"
    assert _get(b.address, [key], TOKEN) == [real]
    assert _stats(b.address, TOKEN)["shared_hits"] == 1


def test_with_a_token_files_carry_the_documented_mac_and_a_server_without_it_refuses_them(shared, servers):
    a = _serve(shared, "--auth-token", TOKEN)
    servers.append(a)
    objs = {b"mac-%d" % i: _value(b"mac-%d" % i, n) for i, n in enumerate((0, 1, 65_536 + 3))}
    assert _put(a.address, objs, TOKEN) == [p.PutStatus.STORED] * len(objs)
    assert wait_for(lambda: _stats(a.address, TOKEN)["shared_writes"] == len(objs), WAIT_S)
    for key, value in objs.items():
        with open(_path(shared, key), "rb") as f:
            assert f.read() == _file_bytes(key, value, TOKEN.encode()), key
    other = _serve(shared, "--auth-token", "another-pool's-token")
    plain = _serve(shared)  # no token: format 1 only
    servers += [other, plain]
    assert _get(other.address, list(objs), "another-pool's-token") == [None] * len(objs)
    assert _get(plain.address, list(objs)) == [None] * len(objs)
    for srv, token in ((other, "another-pool's-token"), (plain, None)):
        st = _stats(srv.address, token)
        assert st["shared_mac_refused"] == len(objs) and st["shared_hits"] == 0, st
    assert "no --auth-token, so its files carry no MAC" in plain.stderr_text()
    assert "carry no MAC" not in a.stderr_text()


# ---------------------------------------------------------------- symlinks and FIFOs below the root


def test_a_symlinked_fan_out_directory_is_neither_written_through_nor_read(tmp_path, shared, servers):
    # another deployment's directory, which this server must never read for, nor write into
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    key, theirs = b"linked-key", _value(b"their-object", 72_000)
    xx, yy = _leaf(shared, key).split(os.sep)[-2:]
    _plant(os.path.join(elsewhere, yy, key.hex() + ".kvf"), _file_bytes(key, theirs))
    before = sorted(str(x.relative_to(elsewhere)) for x in elsewhere.rglob("*"))
    os.symlink(elsewhere, os.path.join(shared, xx))

    a = _serve(shared)
    servers.append(a)
    assert _get(a.address, [key]) == [None], "read through the symlinked fan-out directory"
    assert _stats(a.address)["shared_refused"] == 1
    sibling = _key_by_first_level(key, b"sibling-", same=True)  # its xx is the symlink too
    free = _key_by_first_level(key, b"unlinked-", same=False)
    objs = {key: _value(key, 4096), sibling: _value(sibling, 4096), free: _value(free, 4096)}
    assert _put(a.address, objs) == [p.PutStatus.STORED] * 3
    # the two writes under the symlink are refused (counted), the third is written
    assert wait_for(lambda: _stats(a.address)["shared_writes"] == 1 and _stats(a.address)["shared_refused"] == 3,
                    WAIT_S), _stats(a.address)
    assert os.path.isfile(_path(shared, free))
    after = sorted(str(x.relative_to(elsewhere)) for x in elsewhere.rglob("*"))
    assert after == before, f"written through the symlink: {sorted(set(after) - set(before))}"
    assert os.path.islink(os.path.join(shared, xx))


def test_a_fifo_at_a_keys_name_is_a_miss_and_the_tier_thread_keeps_going(shared, servers):
    key = b"fifo-key"
    os.makedirs(_leaf(shared, key), mode=0o700)
    os.mkfifo(_path(shared, key), 0o600)
    a = _serve(shared)
    b = _serve(shared)
    servers += [a, b]
    others = {b"beside-fifo-%d" % i: _value(b"beside-fifo-%d" % i, 50_000) for i in range(6)}
    assert _put(a.address, others) == [p.PutStatus.STORED] * len(others)
    assert wait_for(lambda: _stats(a.address)["shared_writes"] == len(others), WAIT_S), _stats(a.address)
    # on main the tier thread blocked in open() on the FIFO: no GET of B's was answered from a tier again
    assert _get(b.address, [key, *others]) == [None, *others.values()]
    st = _stats(b.address)
    assert st["shared_refused"] == 1 and st["shared_hits"] == len(others), st
    # write-through goes on, and the key's own PUT replaces the FIFO
    value = _value(key, 30_000)
    more = {key: value, b"after-fifo": _value(b"after-fifo", 30_000)}
    assert _put(b.address, more) == [p.PutStatus.STORED] * 2
    assert wait_for(lambda: _stats(b.address)["shared_writes"] == 2, WAIT_S), _stats(b.address)
    assert _stats(b.address)["shared_replaced"] == 1
    assert os.path.isfile(_path(shared, key)) and not os.path.islink(_path(shared, key))
    assert _get(a.address, [key]) == [value]
    assert b.stop(timeout_s=60) == 0, b.stderr_text()[-2000:]


# ---------------------------------------------------------------- the tier directory itself


def _tier_args(kind: str, d: str) -> list[str]:
    return ["--ssd-path", d, "--ssd-capacity", "16MiB"] if kind == "ssd" else ["--shared-path", d]


@pytest.mark.parametrize("kind", ["ssd", "shared"])
@pytest.mark.parametrize("how", ["mode 0777", "mode 0770, group not --tier-group", "owned by uid 65534"])
def test_a_tier_directory_others_can_write_is_refused_unless_overridden(kind, how):
    if "65534" in how and os.geteuid() != 0:
        pytest.skip("needs root to give a directory to another uid")
    d = tempfile.mkdtemp(prefix="kvf-tier-dir-", dir=os.environ.get("KVFABRIC_TIER_TEST_DIR") or None)
    try:
        if "65534" in how:
            os.chown(d, NOBODY, NOBODY)
            os.chmod(d, 0o755)
        else:
            os.chmod(d, 0o777 if "0777" in how else 0o770)
        r = _serve_fails(*_tier_args(kind, d))
        flag = "--ssd-path" if kind == "ssd" else "--shared-path"
        why = "belongs to uid 65534" if "65534" in how else "writable by its group" if "0770" in how else \
            "writable by others"
        assert r.returncode == 2, (r.returncode, r.stderr)
        assert flag in r.stderr and why in r.stderr and "--tier-dir-insecure-ok" in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert os.listdir(d) == [], "the refused server wrote into the directory"
        with start_server(capacity="16MiB", extra_args=[*_tier_args(kind, d), "--tier-dir-insecure-ok"]) as srv:
            assert why in srv.stderr_text() and "started anyway" in srv.stderr_text()
        if "0770" in how:  # the directory's group named as the tier group: accepted as it is
            with start_server(capacity="16MiB",
                              extra_args=[*_tier_args(kind, d), "--tier-group", str(os.stat(d).st_gid)]) as srv:
                assert "started anyway" not in srv.stderr_text()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_with_a_tier_group_files_are_0640_and_directories_0770_of_that_group(tmp_path, servers):
    gid = os.getgroups()[0] if os.getgroups() else os.getegid()
    shared, ssd = tmp_path / "shared", tmp_path / "ssd"
    for d in (shared, ssd):
        d.mkdir(mode=0o700)
    a = start_server(capacity="16MiB", extra_args=["--shared-path", str(shared), "--ssd-path", str(ssd),
                                                   "--ssd-capacity", "16MiB", "--tier-group", str(gid)])
    servers.append(a)
    key = b"group-key"
    assert _put(a.address, {key: _value(key, 5000)}) == [p.PutStatus.STORED]
    assert wait_for(lambda: _stats(a.address)["shared_writes"] == 1, WAIT_S), _stats(a.address)
    path = _path(str(shared), key)
    got = [(oct(st.st_mode & 0o777), st.st_gid) for st in map(os.stat, (os.path.dirname(os.path.dirname(path)),
                                                                        os.path.dirname(path), path,
                                                                        ssd / "kvfabric-tier.v1"))]
    assert got == [("0o770", gid), ("0o770", gid), ("0o640", gid), ("0o640", gid)], got


def test_tier_flags_need_a_tier():
    r = _serve_fails("--tier-dir-insecure-ok")
    assert r.returncode == 2 and "need --ssd-path or --shared-path" in r.stderr, r.stderr
