"""Save / load GB/s of the vLLM connector's GPU transfer path against pinned cudaMemcpy, in one run.

The connector's transfer core (``kvfabric_vllm.transfer``, what the worker
uses when vLLM's KV cache is on a GPU) on CUDA KV tensors laid out as vLLM
0.32 lays them out (``--layout``, default ``LBNHC``: FlashAttention's),
``--chunks`` one-block chunks of ``--layers`` layers per measured batch, every
cell the median of ``--repeat`` rounds taken interleaved, so each figure and
the ceiling it is divided by were taken seconds apart:

ceilings
  * ``memcpy-d2h`` / ``memcpy-h2d``: one ``cudaMemcpyAsync`` of the batch's
    bytes between a contiguous device tensor and pinned host memory (torch
    ``copy_(non_blocking=True)``), synchronised;
  * ``cpu-put`` / ``cpu-get``: the same bytes put to / received from the pool
    (``Client.put`` / ``get_into`` into the registered host slab) with no GPU
    part: what the pool path reaches for a CPU KV cache.

paths
  * ``gather``: one batched device gather + one device-to-host copy per layer
    into the pinned slab (a step's saves), ``/memcpy-d2h``;
  * ``scatter``: one host-to-device copy + one batched scatter per layer
    (a load), ``/memcpy-h2d``;
  * ``save``: gather + put (fresh keys each round), ``/cpu-put``;
  * ``load``: ``get_into`` the slab + scatter, ``/cpu-get``.

Targets (issue 21): gather and scatter >= 0.8x pinned cudaMemcpy; save and
load over loopback ``native`` >= 0.8x the CPU-only figures. The pool server is
the product server when the C extension is built, else the pure-Python
reference server over ``tcp`` (``--server``; the table says which). Prints a table; writes
JSON (``--out``, default bench-results/gpu_transfer.json). Needs torch with
CUDA and a GPU, and the connector package (``connectors/`` on the path); not
vLLM. ``--device cpu`` runs the same cells on host tensors (the connector's
``HostLane``: what the worker does with vLLM's CPU build, the memcpy ceilings
then being host copies); CI's smoke run uses it, the GPU figures need a GPU.
Same as ``kvfabric bench gpu_transfer``.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

from .. import Client, ClientConfig, KeyHasher
from ..testing.servers import start_server
from ..transport import available
from . import write_json

# vLLM 0.32's KVCacheLayout members: physical order of the logical axes L, B, H, N, C
LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
           "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="cuda: the GPU path (the figures); cpu: the same cells on host tensors (a smoke run)")
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="LBNHC")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--blocks", type=int, default=1024, help="blocks of the KV cache per layer")
    p.add_argument("--chunks", type=int, default=128, help="one-block chunks per measured batch")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default="float16")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--transport", choices=["auto", "native", "tcp"], default="auto")
    p.add_argument("--server", choices=["auto", "native", "reference"], default="auto",
                   help="the product server (C extension) or the pure-Python reference server; auto: "
                        "the product server when the extension is built")
    p.add_argument("--capacity", default="8GiB", help="the pool server's arena")
    p.add_argument("--no-pool", action="store_true", help="only the host<->device cells")
    p.add_argument("--out", default="bench-results/gpu_transfer.json")
    a = p.parse_args(argv)
    if not 1 <= 2 * a.chunks <= a.blocks or a.layers < 1 or a.repeat < 1:
        p.error("need 1 <= 2 x chunks <= blocks (saved and loaded blocks are distinct), layers >= 1, repeat >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    try:
        import torch
        from kvfabric_vllm.layout import chunk_major_layer_keys
        from kvfabric_vllm.transfer import CudaLane, HostLane, PagedKV, SlotPool
    except ImportError as e:
        print(f"gpu_transfer: needs torch and the connector package (connectors/ on PYTHONPATH): {e}",
              file=sys.stderr)
        return 2
    cuda = a.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("gpu_transfer: no CUDA device; nothing measured (--device cpu runs the host path)", file=sys.stderr)
        return 2

    def timed(fn) -> float:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = getattr(torch, a.dtype)
    order = LAYOUTS[a.layout]
    logical = (a.layers, a.blocks, a.heads, a.block_size, 2 * a.head_size)
    phys = torch.randn(tuple(logical[d] for d in order), device=dev).to(dtype)
    layers = [phys.permute(*[order.index(d) for d in range(5)])[li] for li in range(a.layers)]
    px = PagedKV(layers, CudaLane(dev) if cuda else HostLane())
    n, nl, page = a.chunks, a.layers, px.page_bytes
    nbytes = n * nl * page
    slots = SlotPool(2 * n * nl, page, pin=cuda)             # one lease to save from, one to load into
    src_lease, dst_lease = slots.take(n * nl), slots.take(n * nl)
    assert src_lease is not None and dst_lease is not None
    dev_flat = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    g = torch.Generator().manual_seed(7)
    perm = torch.randperm(a.blocks, generator=g).tolist()   # scattered blocks, as a real step's are
    blocks, into = perm[:n], perm[n:2 * n]

    def gather() -> list:
        return [px.gather(li, blocks, src_lease.rows[li * n:(li + 1) * n].view(-1), after=px.lane.compute_mark())
                for li in range(nl)]

    def scatter() -> None:
        pairs = list(enumerate(into))
        for li in range(nl):
            px.lane.compute_wait(px.scatter(li, dst_lease.rows[li * n:(li + 1) * n].view(-1), pairs))

    cells: dict[str, list[float]] = {k: [] for k in ("memcpy-d2h", "memcpy-h2d", "gather", "scatter")}
    server = client = None
    transport = "-"
    try:
        if not a.no_pool:
            native = a.server == "native" or (a.server == "auto" and "native" in available())
            server = start_server(capacity=a.capacity, **({} if native else {"module": "kvfabric.testing.reference"}))
            client = Client([server.address], config=ClientConfig(transport=a.transport, timeout_s=60))
            client.register_buffers([slots.slab.numpy()])
            for k in ("save", "load", "cpu-put", "cpu-get"):
                cells[k] = []
        hasher = KeyHasher()
        for r in range(a.repeat + 1):                        # round 0 warms up (not kept)
            got = {
                "memcpy-d2h": timed(lambda: src_lease.rows.view(-1).copy_(dev_flat, non_blocking=True)),
                "memcpy-h2d": timed(lambda: dev_flat.copy_(dst_lease.rows.view(-1), non_blocking=True)),
                "gather": timed(lambda: [px.lane.host_wait(m) for m in gather()]),
                "scatter": timed(scatter),
            }
            if client is not None:
                keys = chunk_major_layer_keys(hasher, [os.urandom(16) for _ in range(n)], nl)
                cpu_keys = chunk_major_layer_keys(hasher, [os.urandom(16) for _ in range(n)], nl)
                src_vals = [src_lease.rows[li * n + i].numpy() for i in range(n) for li in range(nl)]
                dst_vals = [dst_lease.rows[li * n + i].numpy() for i in range(n) for li in range(nl)]

                def save() -> None:
                    for m in gather():
                        px.lane.host_wait(m)
                    res = client.put(keys, src_vals)
                    assert res.dropped == 0, res

                def load() -> None:
                    sizes = client.get_into(keys, dst_vals)
                    assert all(s == page for s in sizes), "a load missed"
                    scatter()

                def cpu_put() -> None:
                    res = client.put(cpu_keys, src_vals)
                    assert res.dropped == 0, res

                def cpu_get() -> None:
                    assert all(s == page for s in client.get_into(cpu_keys, dst_vals)), "a load missed"

                got.update({"save": timed(save), "cpu-put": timed(cpu_put),
                            "load": timed(load), "cpu-get": timed(cpu_get)})
            if r:
                for k, t in got.items():
                    cells[k].append(t)
        if client is not None:
            transport = ",".join(sorted({t for t in client.transports.values() if t})) or "?"
        # the load put the saved objects into other blocks: check the bytes once
        if cuda:
            torch.cuda.synchronize()
        exact = all(torch.equal(layers[li][b], layers[li][i]) for li in range(nl) for b, i in zip(blocks, into)) \
            if client is not None else None
    finally:
        if client is not None:
            client.close()
        if server is not None:
            server.stop()

    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in cells.items() if v}
    ratios = {"gather/memcpy-d2h": gbps["gather"] / gbps["memcpy-d2h"],
              "scatter/memcpy-h2d": gbps["scatter"] / gbps["memcpy-h2d"]}
    if "save" in gbps:
        ratios.update({"save/cpu-put": gbps["save"] / gbps["cpu-put"], "load/cpu-get": gbps["load"] / gbps["cpu-get"]})
    with open("/proc/loadavg") as f:
        load = f.read().split()[:3]
    report = {
        "device": torch.cuda.get_device_name(dev) if cuda else f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__, "cuda": torch.version.cuda,
        "device_kind": a.device, "host": platform.node(), "loadavg": load, "transport": transport, "layout": a.layout,
        "page_bytes": page, "layers": nl, "chunks": n, "batch_bytes": nbytes, "repeat": a.repeat,
        "dtype": a.dtype, "gbps": gbps, "ratios": ratios, "targets": {"host<->device": 0.8, "pool": 0.8},
        "bytes_exact_after_load": exact,
    }
    print(f"gpu_transfer on {report['device']} (torch {torch.__version__}, CUDA {torch.version.cuda}), "
          f"layout {a.layout}, {nl} layers x {n} chunks of {page} B = {nbytes / 2**20:.1f} MiB per batch, "
          f"transport {transport}, loadavg {' '.join(load)}")
    print(f"{'cell':<14}{'GB/s':>9}")
    for k, v in gbps.items():
        print(f"{k:<14}{v:>9.2f}")
    for k, v in ratios.items():
        print(f"{k:<20}{v:>6.2f}x  (target >= 0.80x)")
    if exact is not None:
        print(f"loaded blocks byte-identical to the saved ones: {exact}")
    write_json(a.out, report)
    return 0 if exact in (True, None) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
