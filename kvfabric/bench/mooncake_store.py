"""Mooncake Store on loopback: the peer KV store that runs beside kvfabric here, for two benchmarks.

Mooncake's non-CUDA build (``mooncake-transfer-engine-non-cuda``; scripts/ci-vllm.sh installs it in the
vLLM virtualenv, where ``kvfabric bench serve`` finds it beside the engine's interpreter) runs on this
machine over its TCP transport. Its binaries load ``libibverbs.so.1`` and ``librdmacm.so.1`` (Debian's
``libibverbs1``, ``librdmacm1``; scripts/test-all installs them without recommends).

* :class:`MooncakeStore`: a ``mooncake_master`` (RPC and admin HTTP bound to 127.0.0.1), waited on until
  its ``/health`` says ``service_ready``, then one ``mooncake_client`` holding ``capacity`` bytes (the
  "standalone-store" mode: the clients contribute no memory, as kvfabric's clients contribute none to
  its pool), waited on until the master counts that capacity mounted; :meth:`MooncakeStore.stop` ends
  both. Every address given to Mooncake is 127.0.0.1; its transfer engine listens on every address (its
  own choice), and nothing is sent but to 127.0.0.1. ``kvfabric bench serve`` runs vLLM's
  ``MooncakeStoreConnector`` over one (configuration (c'), ``mooncake``).
* :class:`MooncakePeer`: such a store and a client in this process (``mooncake.store.
  MooncakeDistributedStore`` over TCP, its buffers registered), measuring ``get_into`` / ``put_from`` of
  one object as ``kvfabric bench transport_native`` measures its rows (its ``mooncake`` row, when the
  ``mooncake`` package imports: run that benchmark from the vLLM virtualenv). A PUT writes a fresh key each
  time, at most half the store's capacity in one cell (a cell ends at that count or at its duration); the
  keys written are removed after the cell (not timed), so a PUT never waits for, or fails on, a full store.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

from . import proc_cpu_s
from ..testing.poll import wait_for
from ..testing.ports import free_port
from ..testing.servers import stop_process_group

BINARIES = ("mooncake_master", "mooncake_client")

#: the master's /metrics samples :func:`metrics` reports, and the names it reports them under
METRICS = {"master_key_count": "keys", "master_allocated_bytes": "allocated_bytes",
           "master_total_capacity_bytes": "capacity_bytes", "master_batch_put_end_items_total": "put_items",
           "master_put_end_requests_total": "put_requests", "master_batch_get_replica_list_items_total": "get_items",
           "master_get_replica_list_requests_total": "get_requests", "master_evicted_key_count": "evicted_keys"}
#: gauges among them (the others are counters: a benchmark reports their change)
GAUGES = ("keys", "allocated_bytes", "capacity_bytes")


class NotAvailable(RuntimeError):
    """Mooncake cannot run here; the message says what is missing or what failed."""


def binaries_beside(python: str) -> str:
    """The directory holding Mooncake's binaries beside the interpreter ``python`` (its virtualenv's bin), or
    "" when they are not there."""
    d = Path(python).parent
    return str(d) if all((d / b).is_file() for b in BINARIES) else ""


def package_binaries() -> str:
    """The directory of the importable ``mooncake`` package, which ships the binaries, or "" when there is none."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return ""
    d = Path(list(spec.submodule_search_locations)[0])
    return str(d) if all((d / b).is_file() for b in BINARIES) else ""


def _http_get(url: str, timeout_s: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status, r.read(1 << 20).decode(errors="replace")
    except (OSError, ValueError) as e:
        return 0, str(e)


def metrics(admin_url: str) -> dict[str, float]:
    """The master's figures in :data:`METRICS` from its ``/metrics`` (Prometheus text); RuntimeError when it
    does not answer 200."""
    code, text = _http_get(admin_url + "/metrics")
    if code != 200:
        raise RuntimeError(f"{admin_url}/metrics answered {code}: {text[:300]}")
    out = dict.fromkeys(METRICS.values(), 0.0)
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in METRICS:
            try:
                out[METRICS[name]] += float(value.split()[0])
            except (ValueError, IndexError):
                continue
    return out


def _root_cause(log: Path) -> str:
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    errs = [ln for ln in lines if "error" in ln.lower() or ln.startswith(("E", "F"))]
    return (errs or lines or ["(empty log)"])[0][:600]


class MooncakeStore:
    """A master and one holder of ``capacity`` bytes on loopback (see the module doc); logs in ``workdir``."""

    def __init__(self, bin_dir: str, capacity: int, workdir: str | os.PathLike, *, timeout_s: float = 120.0) -> None:
        if not bin_dir:
            raise NotAvailable("Mooncake's binaries (mooncake_master, mooncake_client) were not found: install "
                               "mooncake-transfer-engine-non-cuda (scripts/ci-vllm.sh puts it in .venvs/vllm)")
        self.capacity = capacity
        self.rpc = f"127.0.0.1:{free_port()}"
        self.admin_url = f"http://127.0.0.1:{free_port()}"
        self.procs: list[subprocess.Popen] = []
        workdir = Path(workdir)
        try:
            self._start(Path(bin_dir) / "mooncake_master", ["--rpc_port", self.rpc.split(":")[1], "--rpc_address",
                        "127.0.0.1", "--metrics_port", self.admin_url.rsplit(":", 1)[1], "--metrics_host",
                        "127.0.0.1"], workdir / "mooncake-master.log", self._master_ready, timeout_s)
            self._start(Path(bin_dir) / "mooncake_client", ["--host", "127.0.0.1", "--port", str(free_port()),
                        "--global_segment_size", str(capacity), "--master_server_address", self.rpc,
                        "--metadata_server", "P2PHANDSHAKE", "--protocol", "tcp"],
                        workdir / "mooncake-client.log", self._mounted, timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, binary: Path, args: list[str], log: Path, ready, timeout_s: float) -> None:
        with open(log, "w") as f:
            proc = subprocess.Popen([str(binary), *args], stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        self.procs.append(proc)

        def up() -> bool:
            if proc.poll() is not None:
                raise NotAvailable(f"{binary.name} exited with status {proc.returncode}: {_root_cause(log)}")
            return ready()

        if not wait_for(up, timeout_s, 0.2):
            raise RuntimeError(f"{binary.name} not ready in {timeout_s} s; its log ends:\n"
                               f"{log.read_text(errors='replace')[-2000:]}")

    def _master_ready(self) -> bool:
        code, text = _http_get(self.admin_url + "/health")
        try:
            return code == 200 and json.loads(text).get("service_ready") is True
        except (ValueError, AttributeError):   # not its JSON (yet)
            return False

    def _mounted(self) -> bool:
        try:
            return metrics(self.admin_url)["capacity_bytes"] >= self.capacity
        except RuntimeError:
            return False

    def metrics(self) -> dict[str, float]:
        return metrics(self.admin_url)

    def cpu_s(self) -> float:
        """CPU seconds the master and the holder used so far."""
        total = 0.0
        for p in self.procs:
            try:
                total += proc_cpu_s(p.pid)
            except (OSError, ValueError, IndexError):
                continue
        return total

    def vllm_config(self, path: str | os.PathLike) -> Path:
        """Write the ``MOONCAKE_CONFIG_PATH`` file of vLLM's ``MooncakeStoreConnector`` for this store."""
        p = Path(path)
        p.write_text(json.dumps({"metadata_server": "P2PHANDSHAKE", "master_server_address": self.rpc,
                                 "protocol": "tcp", "device_name": "", "mode": "standalone-store",
                                 "global_segment_size": 0, "local_buffer_size": 64 << 20}))
        return p

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                stop_process_group(p)


class MooncakePeer:
    """A :class:`MooncakeStore` and an in-process client moving ``size``-byte objects; ``close()`` ends both."""

    def __init__(self, size: int, capacity: int = 1 << 30) -> None:
        import numpy as np
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise NotAvailable(f"mooncake does not import here ({e}): run from the vLLM virtualenv "
                               "(scripts/ci-vllm.sh installs mooncake-transfer-engine-non-cuda there)") from e
        self.size = size
        self._dir = tempfile.TemporaryDirectory(prefix="kvfabric-bench-mooncake-")
        self.store = MooncakeStore(package_binaries(), capacity, self._dir.name)
        try:
            self.client = MooncakeDistributedStore()
            rc = self.client.setup("127.0.0.1", "P2PHANDSHAKE", 0, 16 << 20, "tcp", "", self.store.rpc)
            if rc != 0:
                raise NotAvailable(f"MooncakeDistributedStore.setup returned {rc}")
            self.src = np.frombuffer(os.urandom(size), dtype=np.uint8).copy()
            self.dst = np.zeros(size, dtype=np.uint8)
            for buf in (self.src, self.dst):
                rc = self.client.register_buffer(buf.ctypes.data, size)
                if rc != 0:
                    raise NotAvailable(f"register_buffer returned {rc}")
            self._n = 0
            self._max_puts = max(1, capacity // size // 2)   # per cell: the store stays at most half full
            self._check(self.client.put_from("kvf-bench-get", self.src.ctypes.data, size), "put_from")
            self._check(self.client.get_into("kvf-bench-get", self.dst.ctypes.data, size), "get_into")
            if not (self.dst == self.src).all():
                raise RuntimeError("Mooncake returned other bytes than it was given")
        except BaseException:
            self.close()
            raise

    def _check(self, rc: int, what: str) -> None:
        if rc < 0 or (what == "get_into" and rc != self.size):
            raise RuntimeError(f"Mooncake {what} of {self.size} bytes returned {rc}")

    def measure(self, op: str, duration: float) -> tuple[float, float, float, float]:
        """(GB/s, p50 us, p99 us, the store's CPU s per GB) of ``op`` ("get": ``get_into`` of one key; "put":
        ``put_from`` of a fresh key each time, at most half the capacity) for about ``duration`` s."""
        lat: list[float] = []
        written: list[str] = []
        cpu0 = self.store.cpu_s()
        start = time.perf_counter()
        while True:
            if op == "get":
                t0 = time.perf_counter()
                rc = self.client.get_into("kvf-bench-get", self.dst.ctypes.data, self.size)
                lat.append(time.perf_counter() - t0)
                self._check(rc, "get_into")
            else:
                self._n += 1
                key = f"kvf-bench-put-{self._n}"
                t0 = time.perf_counter()
                rc = self.client.put_from(key, self.src.ctypes.data, self.size)
                lat.append(time.perf_counter() - t0)
                self._check(rc, "put_from")
                written.append(key)
                if len(written) >= self._max_puts:
                    break
            if time.perf_counter() - start >= duration:
                break
        secs = sum(lat)
        cpu = self.store.cpu_s() - cpu0
        for key in written:           # not timed: the next cell starts with the store as empty as this one
            self.client.remove(key)
        lat.sort()
        moved = len(lat) * self.size
        return (moved / secs / 1e9, lat[len(lat) // 2] * 1e6, lat[min(len(lat) - 1, int(len(lat) * 0.99))] * 1e6,
                cpu / (moved / 1e9))

    def close(self) -> None:
        client = getattr(self, "client", None)
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing a half-set-up client must not hide the first error
                pass
        store = getattr(self, "store", None)
        if store is not None:
            store.stop()
        self._dir.cleanup()


__all__ = ["GAUGES", "METRICS", "MooncakePeer", "MooncakeStore", "NotAvailable", "binaries_beside", "metrics",
           "package_binaries"]
