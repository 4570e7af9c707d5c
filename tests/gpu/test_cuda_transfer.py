"""The transfer core (kvfabric_vllm.transfer) on a real GPU: CUDA KV tensors shaped as vLLM 0.32's
backends shape them, saved to and loaded from real pool servers on this machine through pinned
host buffers on a dedicated CUDA stream.

Needs torch with CUDA and a GPU, nothing else (no vLLM: the tensors are built
with the strides vLLM's ``compute_layout_strides`` gives, see
tests/e2e/vllm/test_transfer.py for the check against vLLM's own views).
Skipped without CUDA. The pool servers are the product server (``kvfabric
serve``, the C extension) when it is built, else the pure-Python reference
server over ``tcp``; ``KVFABRIC_GPU_SERVER=native|reference`` chooses
(scripts/gpu-check.sh sets it after trying the product server there: a
sandbox without io_uring builds the extension but cannot run it). Run on a
lent GPU with scripts/gpu-check.sh.
"""

from __future__ import annotations

import os
import threading

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)

from kvfabric import Client, ClientConfig, KeyHasher  # noqa: E402
from kvfabric.testing.servers import start_pool, stop_process  # noqa: E402
from kvfabric.transport import available  # noqa: E402
from kvfabric_vllm.layout import chunk_major_layer_keys  # noqa: E402
from kvfabric_vllm.transfer import CudaLane, HostLane, PagedKV, SlotPool, page_rows  # noqa: E402

NATIVE = os.environ.get("KVFABRIC_GPU_SERVER", "native" if "native" in available() else "reference") == "native"
SERVER = {} if NATIVE else {"module": "kvfabric.testing.reference"}
TRANSPORT = "native" if NATIVE else "tcp"
DEV = torch.device("cuda", 0)

# vLLM 0.32's KVCacheLayout members: physical order of the logical axes L, B, H, N, C
LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
           "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}
L, B, N = 4, 32, 16                 # layers, blocks, tokens per block


def kv_layers(order, heads: int, content: int, dtype, fill: bool) -> list[torch.Tensor]:
    """Per-layer [B, H, N, C] CUDA views of one allocation whose physical order is ``order``."""
    logical = (L, B, heads, N, content)
    phys = torch.zeros(tuple(logical[d] for d in order), dtype=dtype, device=DEV)
    if fill:
        phys.copy_(torch.randn(phys.shape, device=DEV).to(dtype))
    inverse = [order.index(d) for d in range(5)]
    view = phys.permute(*inverse)
    return [view[li] for li in range(L)]


CASES = [(name, 8, 2 * 128, torch.float16) for name in LAYOUTS] + \
        [("LBNHC", 8, 2 * 128, torch.bfloat16), ("LBHNC", 1, 576, torch.bfloat16)]   # last: MLA (H = 1)


def client(pool) -> Client:
    return Client(pool.addresses, config=ClientConfig(transport=TRANSPORT))


def save(px: PagedKV, pool_slots: SlotPool, c: Client, keys: list[bytes], chunks: list[list[int]]) -> None:
    """What the worker does for a step's saves: one lease, one gather per layer after the compute
    mark, wait the gathers, put chunk-major layer objects."""
    n = len(chunks)
    lease = pool_slots.take(n * L)
    assert lease is not None
    blocks = [b for ch in chunks for b in ch]
    marks = [px.gather(li, blocks, lease.rows[li * n:(li + 1) * n].view(-1), after=px.lane.compute_mark())
             for li in range(L)]
    for m in marks:
        px.lane.host_wait(m)
    values = [lease.rows[li * n + i].numpy() for i in range(n) for li in range(L)]
    res = c.put(chunk_major_layer_keys(KeyHasher(), keys, L), values, timeout_s=30)
    assert res.dropped == 0, res
    px.release(pool_slots, lease, marks)


def load(px: PagedKV, pool_slots: SlotPool, c: Client, keys: list[bytes], chunks: list[list[int]],
         timeout_s: float = 30) -> list[int | None]:
    """get_into the lease, then one scatter per layer of the chunks that arrived whole, after the
    compute stream's work so far; the compute stream waits for each layer's scatter. Returns the
    object sizes."""
    after = px.lane.compute_mark()
    n = len(chunks)
    lease = pool_slots.take(n * L)
    assert lease is not None
    bufs = [lease.rows[li * n + i].numpy() for i in range(n) for li in range(L)]
    sizes = c.get_into(chunk_major_layer_keys(KeyHasher(), keys, L), bufs, timeout_s=timeout_s)
    per = len(chunks[0])
    good = [i for i in range(n) if all(sizes[i * L + li] == pool_slots.obj_bytes for li in range(L))]
    pairs = [(i * per + j, chunks[i][j]) for i in good for j in range(per)]
    marks = [px.scatter(li, lease.rows[li * n:(li + 1) * n].view(-1), pairs, after=after) for li in range(L)]
    for m in marks:
        px.lane.compute_wait(m)
    px.release(pool_slots, lease, marks)
    return sizes


@pytest.mark.parametrize("name, heads, content, dtype", CASES,
                         ids=[f"{c[0]}-h{c[1]}-{str(c[3]).split('.')[-1]}" for c in CASES])
def test_save_and_load_into_other_blocks_is_byte_exact(name, heads, content, dtype):
    order = LAYOUTS[name]
    src, dst = kv_layers(order, heads, content, dtype, True), kv_layers(order, heads, content, dtype, False)
    a, b = PagedKV(src, CudaLane(DEV)), PagedKV(dst, CudaLane(DEV))
    per = 2                                                   # two blocks per chunk
    slots = SlotPool(64, per * a.page_bytes, pin=True)
    assert slots.slab.is_pinned()
    with start_pool(2, capacity="512MiB", **SERVER) as pool, client(pool) as c:
        keys = [os.urandom(16) for _ in range(5)]
        from_blocks = [[3, 17], [0, 1], [30, 8], [12, 13], [5, 29]]
        into_blocks = [[31, 2], [4, 6], [9, 10], [20, 21], [27, 26]]
        save(a, slots, c, keys, from_blocks)
        sizes = load(b, slots, c, keys, into_blocks)
        assert sizes == [slots.obj_bytes] * len(sizes)
        torch.cuda.synchronize()
        for li in range(L):
            for fb, ib in zip(from_blocks, into_blocks):
                for f, i in zip(fb, ib):
                    assert torch.equal(src[li][f], dst[li][i]), f"{name} layer {li}: block {f} -> {i}"
        untouched = [blk for blk in range(B) if blk not in {x for ib in into_blocks for x in ib}]
        assert all(torch.count_nonzero(dst[li][untouched]) == 0 for li in range(L))
        assert slots.free_slots() == slots.n_slots


def test_gpu_objects_equal_the_cpu_paths_objects():
    # LBHNC (vLLM's CPU layout) on the GPU: each object is the bytes the CPU connector stores
    # for the same page (page_rows of the CPU tensor, received / sent in place there)
    src = kv_layers(LAYOUTS["LBHNC"], 8, 256, torch.float16, True)
    px = PagedKV(src, CudaLane(DEV))
    rows = torch.empty(3 * px.page_bytes, dtype=torch.uint8, pin_memory=True)
    px.lane.host_wait(px.gather(2, [7, 0, 31], rows, after=px.lane.compute_mark()))
    cpu = src[2].cpu()
    cpu_rows = page_rows(cpu, PagedKV([cpu], HostLane()).layout)
    assert rows.numpy().tobytes() == b"".join(cpu_rows[b].numpy().tobytes() for b in (7, 0, 31))


def test_a_save_reads_blocks_only_after_the_forward_wrote_them():
    kv = kv_layers(LAYOUTS["LBNHC"], 8, 256, torch.float16, False)
    px = PagedKV(kv, CudaLane(DEV))
    rows = torch.empty(4 * px.page_bytes, dtype=torch.uint8, pin_memory=True)
    # the "forward": a long kernel, then the layer's KV written, all on the compute stream
    torch.cuda._sleep(200_000_000)
    kv[1].fill_(3.0)
    mark = px.lane.compute_mark()
    done = px.gather(1, [4, 9, 0, 22], rows, after=mark)
    px.lane.host_wait(done)
    expect = torch.full(kv[1][0].shape, 3.0, dtype=torch.float16).view(torch.uint8).numpy().tobytes()
    got = rows.numpy().tobytes()
    assert got == expect * 4, "the gather ran before the compute stream wrote the blocks"


def test_attention_reads_a_load_only_after_its_scatter():
    kv = kv_layers(LAYOUTS["LBNHC"], 8, 256, torch.float16, False)
    px = PagedKV(kv, CudaLane(DEV))
    src = torch.empty(2 * px.page_bytes, dtype=torch.uint8, pin_memory=True)
    src.view(torch.float16).fill_(5.0)
    # keep the transfer stream busy, so a read not ordered after the scatter would see zeros
    px.lane.launch(None, lambda: torch.cuda._sleep(200_000_000))
    mark = px.scatter(0, src, [(0, 11), (1, 12)])
    px.lane.compute_wait(mark)                       # what wait_for_layer_load does for the layer
    seen = kv[0][[11, 12]].clone()                   # "attention": on the compute stream
    torch.cuda.synchronize()
    assert torch.all(seen == 5.0), "the compute stream read the blocks before the scatter finished"


def test_pool_killed_mid_load_gives_misses_and_no_hang():
    kv = kv_layers(LAYOUTS["LBNHC"], 8, 256, torch.float16, True)
    dst = kv_layers(LAYOUTS["LBNHC"], 8, 256, torch.float16, False)
    a, b = PagedKV(kv, CudaLane(DEV)), PagedKV(dst, CudaLane(DEV))
    slots = SlotPool(256, a.page_bytes, pin=True)
    with start_pool(1, capacity="512MiB", **SERVER) as pool, client(pool) as c:
        keys = [os.urandom(16) for _ in range(16)]
        save(a, slots, c, keys, [[i] for i in range(16)])
        stop_process(pool[0].pid)                   # the load below is in flight against a stopped server
        out: dict[str, object] = {}

        def run() -> None:
            try:
                out["sizes"] = load(b, slots, c, keys, [[16 + i] for i in range(16)], timeout_s=5)
            except BaseException as exc:  # noqa: BLE001 - reported below
                out["error"] = exc

        t = threading.Thread(target=run)
        t.start()
        pool[0].kill()                              # SIGKILL while the load waits on it
        t.join(120)
        assert not t.is_alive(), "the load hung after the pool was killed"
        assert "error" not in out, out
        assert out["sizes"] == [None] * (16 * L), out["sizes"]
        torch.cuda.synchronize()
        assert all(torch.count_nonzero(d[16:]) == 0 for d in dst)   # nothing scattered
        assert slots.free_slots() == slots.n_slots
