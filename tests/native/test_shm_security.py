"""shm on a shared host: who may attach, what a client cannot break, and how long it may hold things.

Real servers in this process (NativeServer) and real clients (the shm transport or raw
frames on the unix socket). The different-uid cases fork a child that drops to
``nobody`` (65534), so they need root; elsewhere they skip with that reason.
"""

import fcntl
import mmap
import os
import socket
import stat
import tempfile

import pytest

from kvfabric import protocol as p
from kvfabric.errors import ConfigError, ErrorCode, RemoteError
from kvfabric.server import main as serve_main
from kvfabric.server.native import NativeServer
from kvfabric.testing import wait_for
from kvfabric.transport import shm, tcp

NOBODY = 65534
ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a child as another uid (setuid)")


def put(c, key, val, parents=None):
    return c.request(p.PutRequest([key], [len(val)], [p.checksum(key, val)], parents=parents), [val]).msg.status[0]


def recv_frame(sock):
    """(header, metadata dict) of one frame; None if the peer closed first."""
    buf = b""
    while len(buf) < p.HEADER_SIZE:
        more = sock.recv(p.HEADER_SIZE - len(buf))
        if not more:
            return None
        buf += more
    h = p.unpack_header(buf)
    meta = b""
    while len(meta) < h.meta_len:
        more = sock.recv(h.meta_len - len(meta))
        if not more:
            return None
        meta += more
    return h, p.decode_meta(meta)


def unix(path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(path)
    return s


@pytest.fixture
def open_dir():
    """A fresh directory under /tmp that other uids may traverse (0711); removed afterwards."""
    made = []

    def make():
        d = tempfile.mkdtemp(prefix="kvf-shm-test-", dir="/tmp")
        os.chmod(d, 0o711)
        made.append(d)
        return d

    yield make
    for d in made:
        for f in os.listdir(d):
            os.unlink(os.path.join(d, f))
        os.rmdir(d)


# ---------------------------------------------------------------- the socket


def test_the_shm_socket_is_a_private_filesystem_socket_named_in_hello(make_server):
    srv = make_server()
    path = srv.shm_socket
    st = os.lstat(path)
    assert not path.startswith("\0") and stat.S_ISSOCK(st.st_mode)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    d = os.lstat(os.path.dirname(path))
    assert stat.S_IMODE(d.st_mode) == 0o700 and d.st_uid == os.geteuid()
    t = tcp.connect(srv.address, timeout_s=5)
    assert isinstance(t.hello, p.HelloReply) and t.hello.shm_socket == path
    t.close()
    srv.stop()
    assert not os.path.exists(path)  # removed on shutdown


def test_a_loose_or_foreign_socket_directory_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    d = tmp_path / "kvfabric"
    d.mkdir()
    os.chmod(d, 0o777)
    with pytest.raises(ConfigError, match="writable by others"):
        NativeServer(capacity=1 << 20)
    os.chmod(d, 0o700)
    if os.geteuid() == 0:
        os.chown(d, NOBODY, -1)
        with pytest.raises(ConfigError, match="not to us"):
            NativeServer(capacity=1 << 20)
        os.chown(d, 0, -1)
    srv = NativeServer(capacity=1 << 20)  # ours and private: used
    try:
        assert os.path.dirname(srv.shm_socket) == str(d)
    finally:
        srv.stop()


def test_something_else_at_the_socket_path_is_not_replaced(open_dir):
    path = os.path.join(open_dir(), "taken")
    with open(path, "w") as f:
        f.write("not a socket")
    with pytest.raises(ConfigError, match="not a socket of ours"):
        NativeServer(capacity=1 << 20, shm_socket=path)


def test_a_live_socket_is_not_taken_over_but_a_stale_one_is(make_server, open_dir):
    path = os.path.join(open_dir(), "s.sock")
    first = make_server(shm_socket=path)
    with pytest.raises(ConfigError, match="another server is listening"):
        NativeServer(capacity=1 << 20, shm_socket=path)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    first.stop()
    stale.bind(path)  # a socket file nobody listens on, as a killed server leaves it
    stale.close()
    second = make_server(shm_socket=path)
    c = shm.connect(second.address, timeout_s=5)
    assert put(c, b"k", b"v") == 0
    c.close()


def test_shm_group_makes_the_socket_0660_for_that_group(make_server, open_dir):
    gid = NOBODY if os.geteuid() == 0 else os.getegid()
    srv = make_server(shm_socket=os.path.join(open_dir(), "g.sock"), shm_group=gid)
    st = os.lstat(srv.shm_socket)
    assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == gid


def test_cli_refuses_shm_options_without_shm():
    assert serve_main.main(["--port", "0", "--shm-allow-uid", "5"]) == 2
    assert serve_main.main(["--port", "0", "--transports", "tcp,native,shm", "--shm-allow-uid", "x"]) == 2


# ---------------------------------------------------------------- peers (SO_PEERCRED)


def as_nobody(fn):
    """Run fn() in a forked child as uid/gid 65534; returns what it wrote (bytes) or raises."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: plain syscalls only, then _exit
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            out = fn()
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            out = f"error {type(e).__name__}: {e}".encode()
        os.write(w, out)
        os._exit(0)
    os.close(w)
    chunks = []
    while True:
        b = os.read(r, 4096)
        if not b:
            break
        chunks.append(b)
    os.close(r)
    os.waitpid(pid, 0)
    return b"".join(chunks)


def attach_and_report(path):
    """Child side: connect, ask for the arena, say what came back."""

    def run():
        s = unix(path)
        try:
            s.sendall(p.encode_request(p.ShmAttachRequest(), 1))
        except BrokenPipeError:  # refused and closed already: the error frame is still queued for us
            pass
        try:
            head, fds, _, _ = socket.recv_fds(s, p.HEADER_SIZE, 1)
        except ConnectionResetError:
            return b"reset"
        for fd in fds:
            os.close(fd)
        if not head:
            return b"closed"
        while len(head) < p.HEADER_SIZE:
            head += s.recv(p.HEADER_SIZE - len(head))
        h = p.unpack_header(head)
        meta = p.decode_meta(s.recv(h.meta_len, socket.MSG_WAITALL))
        if h.is_error:
            return f"error-frame {meta['code']} fds={len(fds)}".encode()
        return f"attached fds={len(fds)} capacity={meta['capacity']}".encode()

    return run


@ROOT_ONLY
def test_another_uid_cannot_reach_the_default_socket(make_server):
    srv = make_server()
    got = as_nobody(attach_and_report(srv.shm_socket))
    assert got.startswith(b"error PermissionError"), got  # the 0700 directory stops it first


@ROOT_ONLY
def test_another_uid_is_refused_by_peer_credentials_even_through_open_permissions(make_server, open_dir):
    srv = make_server(shm_socket=os.path.join(open_dir(), "open.sock"))
    os.chmod(srv.shm_socket, 0o666)  # a careless operator: only SO_PEERCRED stands in the way
    got = as_nobody(attach_and_report(srv.shm_socket))
    assert got == f"error-frame {int(ErrorCode.AUTH_FAILED)} fds=0".encode(), got
    assert srv.stats()["shm_refused"] == 1
    t = tcp.connect(srv.address, timeout_s=5)
    assert t.request(p.StatsRequest()).msg.stats["shm_refused"] == 1
    t.close()
    # the owner's clients are unaffected
    c = shm.connect(srv.address, timeout_s=5)
    assert put(c, b"mine", b"x" * 100) == 0
    c.close()


@ROOT_ONLY
def test_a_refused_process_falls_back_from_shm_to_another_transport(make_server, open_dir):
    srv = make_server(shm_socket=os.path.join(open_dir(), "fb.sock"))
    os.chmod(srv.shm_socket, 0o666)

    def run():
        from kvfabric import transport as tr
        from kvfabric.config import ClientConfig
        from kvfabric.errors import TransportUnavailable

        try:
            shm.connect(srv.address, timeout_s=5)
            return b"shm attached?!"
        except TransportUnavailable as e:
            first = b"unavailable" if "refused" in str(e) or "closed" in str(e) else str(e).encode()
        conn = tr.connect("auto", srv.address, ClientConfig(connect_timeout_s=5))
        try:
            return first + b" then " + conn.name.encode()
        finally:
            conn.close()

    assert as_nobody(run) == b"unavailable then native"
    assert srv.stats()["shm_refused"] == 2


@ROOT_ONLY
def test_an_allowed_uid_may_attach(make_server, open_dir):
    srv = make_server(shm_socket=os.path.join(open_dir(), "allowed.sock"), shm_allow_uids=[NOBODY])
    os.chmod(srv.shm_socket, 0o666)
    got = as_nobody(attach_and_report(srv.shm_socket))
    assert got == f"attached fds=1 capacity={srv.capacity}".encode(), got
    assert srv.stats()["shm_refused"] == 0


@ROOT_ONLY
def test_an_allowed_gid_may_attach(make_server, open_dir):
    srv = make_server(shm_socket=os.path.join(open_dir(), "gid.sock"), shm_allow_gids=[NOBODY])
    os.chmod(srv.shm_socket, 0o666)
    assert as_nobody(attach_and_report(srv.shm_socket)).startswith(b"attached fds=1")


# ---------------------------------------------------------------- token


def test_attach_needs_the_token_when_one_is_set(make_server):
    srv = make_server(auth_token="s3cret")
    s = unix(srv.shm_socket)
    s.sendall(p.encode_request(p.ShmAttachRequest(), 1))
    head, fds, _, _ = socket.recv_fds(s, p.HEADER_SIZE, 1)
    assert fds == []
    h = p.unpack_header(head)
    meta = p.decode_meta(s.recv(h.meta_len, socket.MSG_WAITALL))
    assert h.is_error and meta["code"] == ErrorCode.AUTH_FAILED
    assert s.recv(1) == b""  # and closed
    s.close()
    with pytest.raises(RemoteError) as e:
        shm.connect(srv.address, timeout_s=5, auth_token="wrong")
    assert e.value.code == ErrorCode.AUTH_FAILED
    c = shm.connect(srv.address, timeout_s=5, auth_token="s3cret")
    assert put(c, b"k", b"v" * 10) == 0
    c.close()


# ---------------------------------------------------------------- the arena fd


def test_a_client_cannot_truncate_or_grow_the_arena(server):
    s = unix(server.shm_socket)
    s.sendall(p.encode_request(p.ShmAttachRequest(), 1))
    head, fds, _, _ = socket.recv_fds(s, p.HEADER_SIZE, 1)
    assert len(fds) == 1
    fd = fds[0]
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
        for size in (0, server.capacity // 2, server.capacity * 2):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
        with pytest.raises(PermissionError):
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, 0)  # F_SEAL_SEAL: the seals cannot be changed
        m = mmap.mmap(fd, server.capacity, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        m.close()
    finally:
        os.close(fd)
        s.close()
    # the server keeps serving, over the arena and over the wire
    c = shm.connect(server.address, timeout_s=5)
    val = os.urandom(1 << 20)
    assert put(c, b"after", val) == 0
    buf = bytearray(len(val))
    assert c.request(p.GetRequest([b"after"]), recv_buffers=[buf]).msg.sizes == [len(val)] and buf == val
    t = tcp.connect(server.address, timeout_s=5)
    assert t.request(p.GetRequest([b"after"])).payload == val
    c.close()
    t.close()


# ---------------------------------------------------------------- time bounds


def test_a_lease_ends_at_max_lease_ms(make_server):
    srv = make_server(max_lease_ms=500)
    t = tcp.connect(srv.address, timeout_s=5)
    assert put(t, b"held", b"h" * 8192) == 0
    c = shm.connect(srv.address, timeout_s=5)
    lease = c._control(p.ShmLeaseRequest(keys=[b"held"]), None)
    assert lease.sizes == [8192] and srv.stats()["pinned"] == 1
    assert srv._srv.evict(b"held") == 0  # pinned by the lease
    assert wait_for(lambda: srv.stats()["shm_leases_expired"] == 1)
    assert srv.stats()["pinned"] == 0
    c._control(p.ShmReleaseRequest(lease=lease.lease), None)  # late release: harmless
    assert c.request(p.PingRequest()).msg == p.PingReply()
    assert srv._srv.evict(b"held") > 0
    c.close()
    t.close()


def test_an_uncommitted_reservation_expires_and_its_commit_says_so(make_server):
    srv = make_server(stall_timeout_s=1.0)
    free = srv.stats()["free_bytes"]
    c = shm.connect(srv.address, timeout_s=5)
    res = c._control(p.ShmReserveRequest(keys=[b"slow"], sizes=[65536]), None)
    assert res.status == [0] and srv.stats()["free_bytes"] == free - 65536
    assert wait_for(lambda: srv.stats()["shm_reservations_expired"] == 1)
    assert srv.stats()["free_bytes"] == free
    with pytest.raises(RemoteError, match="expired") as e:
        c._control(p.ShmCommitRequest(res=res.res, checksums=[p.checksum(b"slow", b"\0" * 65536)]), None)
    assert e.value.code == ErrorCode.MALFORMED
    assert put(c, b"slow", b"s" * 65536) == 0  # the connection goes on
    assert c.request(p.ExistsRequest([b"slow"])).msg.present == [True]
    c.close()


# ---------------------------------------------------------------- parents


def test_parents_sent_over_shm_reach_the_eviction_policy(make_server):
    srv = make_server(policy="tail-lru")
    c = shm.connect(srv.address, timeout_s=5)
    assert put(c, b"head", b"a" * 4096) == 0
    assert put(c, b"tail", b"b" * 4096, parents=[b"head"]) == 0
    assert wait_for(lambda: srv.policy._parent.get(b"tail") == b"head")
    # and a malformed parents list is refused like on the wire
    with pytest.raises(RemoteError) as e:
        c._control(p.ShmReserveRequest(keys=[b"x"], sizes=[1], parents=[b""]), None)
    assert e.value.code == ErrorCode.BAD_KEY
    c.close()
