"""Where ``transport: auto`` may pick nixl: UCX, asked in the process, offers an RDMA transport
(kvfabric/transport/ucx_info.py). The parser is fed ``ucp_context_print_info`` texts: the two this
machine prints (UCX 1.23, nixl's bundled build) and the form of a host whose UCX has verbs and an
active port. There is no RDMA device here, so that last text is written after UCX's own format, not
captured on a device; tests/integration/test_transport_nixl.py asks the real UCX here."""

from __future__ import annotations

from kvfabric.transport import ucx_info

TCP_HERE = """#
# UCP context
#
#     component 0  :  self
#     component 1  :  tcp
#     component 5  :  ib
#
#            md 0  :  component 1  tcp 
#
#      resource 0  :  md 0  dev 0  flags -- tcp/eth0
#      resource 1  :  md 0  dev 1  flags -- tcp/lo
#
"""

SM_HERE = """#
#      resource 0  :  md 0  dev 0  flags -- self/memory
#      resource 1  :  md 1  dev 0  flags -- sysv/memory
#      resource 2  :  md 2  dev 0  flags -- posix/memory
#      resource 3  :  md 3  dev 0  flags -- cma/memory
#
"""

RDMA_HOST = """#
#            md 0  :  component 1  mlx5_0
#      resource 0  :  md 0  dev 0  flags -- rc_verbs/mlx5_0:1
#      resource 1  :  md 0  dev 0  flags -- rc_mlx5/mlx5_0:1
#      resource 2  :  md 0  dev 0  flags -- dc_mlx5/mlx5_0:1
#      resource 3  :  md 0  dev 0  flags -- ud_mlx5/mlx5_0:1
#      resource 4  :  md 1  dev 1  flags -- tcp/ib0
#      resource 5  :  md 2  dev 2  flags -- cuda_copy/cuda
#
"""


def test_the_resources_this_machine_prints_are_not_rdma():
    assert ucx_info.parse_resources(TCP_HERE) == ["tcp/eth0", "tcp/lo"]
    assert ucx_info.parse_resources(SM_HERE) == ["self/memory", "sysv/memory", "posix/memory", "cma/memory"]
    assert ucx_info.rdma(ucx_info.parse_resources(TCP_HERE)) == []
    assert ucx_info.rdma(ucx_info.parse_resources(SM_HERE)) == []


def test_verbs_transports_are_rdma_and_nothing_else_is():
    names = ucx_info.parse_resources(RDMA_HOST)
    assert names[-2:] == ["tcp/ib0", "cuda_copy/cuda"]          # IPoIB's tcp and the GPU copy are not RDMA
    assert ucx_info.rdma(names) == ["rc_verbs/mlx5_0:1", "rc_mlx5/mlx5_0:1", "dc_mlx5/mlx5_0:1", "ud_mlx5/mlx5_0:1"]
    assert ucx_info.rdma(["srd/efa0:1", "sm/memory", "rcx/x"]) == ["srd/efa0:1"]


def test_lines_that_are_not_resources_are_ignored():
    assert ucx_info.parse_resources("") == []
    assert ucx_info.parse_resources("# resource 0 : md 0 dev 0\n#  component 1 : tcp\nresource garbage") == []


def test_bridges_are_named_until_ucx_is_told_to_use_them(tmp_path, monkeypatch):
    for dev, bridge in (("eth0", False), ("br0", True), ("docker0", True)):
        (tmp_path / dev).mkdir()
        if bridge:
            (tmp_path / dev / "bridge").mkdir()
    monkeypatch.delenv("UCX_TCP_BRIDGE_ENABLE", raising=False)
    hint = ucx_info.bridge_hint(str(tmp_path))
    assert "br0, docker0" in hint and "eth0" not in hint and "UCX_TCP_BRIDGE_ENABLE=y" in hint, hint
    monkeypatch.setenv("UCX_TCP_BRIDGE_ENABLE", "y")
    assert ucx_info.bridge_hint(str(tmp_path)) == ""
    monkeypatch.delenv("UCX_TCP_BRIDGE_ENABLE")
    assert ucx_info.bridge_hint(str(tmp_path / "missing")) == ""


def test_the_ucx_environment_is_what_keys_agents_and_answers(monkeypatch):
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.delenv("UCX_TCP_BRIDGE_ENABLE", raising=False)
    before = ucx_info.ucx_env()
    assert ("UCX_TLS", "tcp") in before and all(k.startswith("UCX_") for k, _ in before)
    monkeypatch.setenv("UCX_TCP_BRIDGE_ENABLE", "y")
    assert ucx_info.ucx_env() != before


def test_peer_error_handling_needs_tcp_or_rdma():
    """nixl.error_mode() asks for UCX's ``peer`` mode only where one of these exists: over shared memory alone
    UCX refuses it ("no peer failure handler"), and over tcp ``none`` left a killed server's requests pending."""
    assert ucx_info.peer_failure(ucx_info.parse_resources(TCP_HERE)) == ["tcp/eth0", "tcp/lo"]
    assert ucx_info.peer_failure(ucx_info.parse_resources(SM_HERE)) == []
    assert ucx_info.peer_failure(ucx_info.parse_resources(RDMA_HOST)) == [
        "rc_verbs/mlx5_0:1", "rc_mlx5/mlx5_0:1", "dc_mlx5/mlx5_0:1", "ud_mlx5/mlx5_0:1", "tcp/ib0"]
