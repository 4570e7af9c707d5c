"""What UCX offers this process: the transports (``tl/device``) a UCX context would choose from.

nixl carries its transfers over UCX, and UCX picks its transports itself: from
``UCX_TLS`` and from what the host has. An RDMA port with a UCX built without
verbs, or a ``UCX_TLS`` that leaves verbs out, runs over tcp without a word.
So kvfabric asks UCX rather than guessing from the host: :func:`resources`
opens a UCP context the way nixl's UCX backend does (same library, the one
nixl bundles; same environment) and reads its resource list
(``ucp_context_print_info``, what ``ucx_info -c`` prints), e.g. ``["tcp/lo",
"tcp/eth0"]`` with ``UCX_TLS=tcp``, ``["self/memory", "sysv/memory",
"posix/memory", "cma/memory"]`` with ``sm,self``, and ``rc_mlx5/mlx5_0:1``
and the like on a host whose UCX has verbs and an active port.

:func:`rdma` is the subset that is RDMA (RC, DC, UD verbs; EFA's SRD): what
``transport: auto`` needs before it picks nixl (:func:`kvfabric.transport.nixl.auto_reason`).
The list is what the context may use; which of them one connection's lanes
take is UCX's choice per peer (``UCX_PROTO_INFO=y`` prints it), not read here.

Read once per UCX environment (the ``UCX_*`` variables, :func:`ucx_env`) and
cached, as kvfabric keeps one nixl agent per environment (UCX reads it when a
context is created).

UCX's tcp transport leaves out bridge devices unless ``UCX_TCP_BRIDGE_ENABLE=y``
(a host whose address sits on a bridge, common with VMs and containers, then
has only ``tcp/lo`` and its other NICs for UCX, and a peer reached only
through the bridge is unreachable: NIXL_ERR_BACKEND when its agent is
loaded). :func:`bridge_hint` says so in the errors that this causes.
Verified here: tcp and shared memory (no RDMA device on these machines: the
RDMA names are UCX's own, from its sources, not seen on a device here).
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import re
import sys
import threading
from typing import Any

__all__ = ["NIXL_BACKENDS", "PEER_FAILURE_TLS", "RDMA_TLS", "UcxUnavailable", "bridge_hint", "describe",
           "parse_resources", "peer_failure", "rdma", "resources", "ucx_env"]

#: UCX transport names that move data over an RDMA NIC (UCX's uct/ib and uct/ib/efa transports)
RDMA_TLS = ("rc_verbs", "rc_mlx5", "dc_mlx5", "ud_verbs", "ud_mlx5", "srd")

#: nixl's backend wheels (each bundles its UCX in ``<name>.libs/``), in the order nixl's own package tries them
#: when no CUDA version is known
NIXL_BACKENDS = ("nixl_cu13", "nixl_cu12", "nixl_rocm")

#: UCX transports whose endpoints report a dead peer (UCX's "peer failure handler"): tcp and the RDMA ones.
#: UCX's shared-memory transports (self, sysv, posix, cma, knem, xpmem) have none: an endpoint over them alone
#: cannot be created in UCX's ``peer`` error-handling mode ("no peer failure handler", checked here).
PEER_FAILURE_TLS = ("tcp",) + RDMA_TLS

# ucp.h: ucp_params_t.field_mask bit and ucp_feature bits (the ones nixl's UCX backend asks for)
_UCP_PARAM_FIELD_FEATURES = 1 << 0
_UCP_FEATURE_RMA = 1 << 1
_UCP_FEATURE_AM = 1 << 6
_PARAMS_BYTES = 512   # ucp_params_t is under 200 bytes; the library reads only the fields the mask names

_RESOURCE = re.compile(r"^#\s*resource\s+\d+\s*:\s*md\s+\d+\s+dev\s+\d+\s+flags\s+\S+\s+(\S+)\s*$")

_lock = threading.Lock()
_cache: dict[tuple, list[str] | str] = {}   # ucx_env() -> resources, or why UCX could not say


class UcxUnavailable(RuntimeError):
    """UCX's library could not be found or could not open a context (the message says which)."""


def ucx_env() -> tuple[tuple[str, str], ...]:
    """The ``UCX_*`` environment variables, sorted: what a UCX context created now would read."""
    return tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("UCX_")))


def bridge_hint(net: str = "/sys/class/net") -> str:
    """``"; bridge devices X, Y are left out by UCX's tcp unless UCX_TCP_BRIDGE_ENABLE=y"`` when this host has
    bridges and the variable is not set to yes; "" otherwise."""
    if os.environ.get("UCX_TCP_BRIDGE_ENABLE", "n").lower() in ("y", "yes", "1", "on", "true"):
        return ""
    try:
        names = sorted(d for d in os.listdir(net) if os.path.isdir(os.path.join(net, d, "bridge")))
    except OSError:
        return ""
    if not names:
        return ""
    return f"; bridge devices {', '.join(names)} are left out by UCX's tcp unless UCX_TCP_BRIDGE_ENABLE=y"


def parse_resources(text: str) -> list[str]:
    """The ``tl/device`` names of a ``ucp_context_print_info`` text, in UCX's order."""
    return [m.group(1) for line in text.splitlines() if (m := _RESOURCE.match(line.strip()))]


def _of(names: list[str], tls: tuple[str, ...]) -> list[str]:
    """The ``tl/device`` names whose transport ``tl`` is one of ``tls``."""
    return [n for n in names if n.split("/", 1)[0] in tls]


def rdma(names: list[str]) -> list[str]:
    """The names whose transport is RDMA (:data:`RDMA_TLS`)."""
    return _of(names, RDMA_TLS)


def peer_failure(names: list[str]) -> list[str]:
    """The names whose transport reports a dead peer (:data:`PEER_FAILURE_TLS`)."""
    return _of(names, PEER_FAILURE_TLS)


def _library() -> str:
    """libucp's path: the one mapped in this process already (nixl's UCX plugin loaded it), else the one nixl
    bundles beside its bindings, else the system's."""
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
        for line in f:
            path = line.rsplit(None, 1)[-1]
            if re.search(r"/libucp(-[0-9a-f]+)?\.so", path):
                return path
    # nixl's backend wheels bundle UCX in <package>.libs/; found without importing them (nixl's package
    # imports torch on a CPU-only host: kvfabric.transport.nixl._import_api)
    loaded = [n for n in NIXL_BACKENDS if n in sys.modules]
    for name in loaded or NIXL_BACKENDS:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        if spec is None or not spec.origin:
            continue
        found = sorted(glob.glob(os.path.dirname(os.path.abspath(spec.origin)) + ".libs/libucp*.so*"))
        if found:
            return found[0]
    import ctypes.util  # noqa: PLC0415

    name = ctypes.util.find_library("ucp")
    if name is None:
        raise UcxUnavailable("no libucp: neither nixl's bundled UCX nor a system one was found")
    return name


def _query() -> list[str]:
    path = _library()
    try:
        ucp = ctypes.CDLL(path)
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError as e:
        raise UcxUnavailable(f"cannot load {path}: {e}") from e
    vp, u = ctypes.c_void_p, ctypes.c_uint
    ucp.ucp_get_version.argtypes = [ctypes.POINTER(u)] * 3
    ucp.ucp_config_read.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.POINTER(vp)]
    ucp.ucp_config_release.argtypes = [vp]
    ucp.ucp_init_version.argtypes = [u, u, vp, vp, ctypes.POINTER(vp)]
    ucp.ucp_context_print_info.argtypes = [vp, vp]
    ucp.ucp_cleanup.argtypes = [vp]
    libc.open_memstream.restype = vp
    libc.open_memstream.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_size_t)]
    libc.fclose.argtypes = [vp]
    libc.free.argtypes = [ctypes.c_char_p]

    major, minor, release = u(), u(), u()
    ucp.ucp_get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
    config = vp()
    status = ucp.ucp_config_read(None, None, ctypes.byref(config))
    if status != 0:
        raise UcxUnavailable(f"ucp_config_read failed (status {status}; UCX_TLS={os.environ.get('UCX_TLS')!r})")
    params = (ctypes.c_uint64 * (_PARAMS_BYTES // 8))()
    params[0], params[1] = _UCP_PARAM_FIELD_FEATURES, _UCP_FEATURE_RMA | _UCP_FEATURE_AM
    context = vp()
    try:
        status = ucp.ucp_init_version(major.value, minor.value, params, config, ctypes.byref(context))
    finally:
        ucp.ucp_config_release(config)
    if status != 0:
        raise UcxUnavailable(f"UCX {major.value}.{minor.value}.{release.value} opened no context (status {status}; "
                             f"UCX_TLS={os.environ.get('UCX_TLS')!r})")
    buf, size = ctypes.c_char_p(), ctypes.c_size_t()
    try:
        stream = libc.open_memstream(ctypes.byref(buf), ctypes.byref(size))
        if not stream:
            raise UcxUnavailable(f"open_memstream failed: {os.strerror(ctypes.get_errno())}")
        ucp.ucp_context_print_info(context, stream)
        libc.fclose(stream)
        text = ctypes.string_at(buf, size.value).decode("utf-8", "replace")
        libc.free(buf)
    finally:
        ucp.ucp_cleanup(context)
    return parse_resources(text)


def resources() -> list[str]:
    """This process's UCX resources (``tl/device``, UCX's order) under the current UCX environment, asked once
    per environment and cached. Raises :class:`UcxUnavailable` when UCX cannot be asked (no library, no
    context: its message says why)."""
    env = ucx_env()
    with _lock:
        got = _cache.get(env)
        if got is None:
            try:
                got = _query()
            except UcxUnavailable as e:
                got = str(e)
            _cache[env] = got
    if isinstance(got, str):
        raise UcxUnavailable(got)
    return list(got)


def describe() -> dict[str, Any]:
    """``{"resources": [...], "rdma": [...]}``, or ``{"error": "..."}`` when UCX cannot be asked."""
    try:
        names = resources()
    except UcxUnavailable as e:
        return {"error": str(e)}
    return {"resources": names, "rdma": rdma(names)}
