"""``kvf_copy`` (csrc/kvf_copy.c), the bulk copy of object bytes, through the bindings that use it.

kvfabric copies objects between the arena and callers' buffers with its own
SSE2 loop rather than glibc's memcpy (REP MOVSB into a destination a little
ahead of its source is up to 20x slower on AMD Zen 3/4: kvf_copy.h). The loop
aligns the destination, copies 64 bytes a step and finishes with memcpy, so
what can go wrong is at the edges: sizes around the 4 KiB switch and the
64-byte step, and source and destination misaligned within 64 bytes (seven
pairs each way: aligned, 1, 16, 37 bytes apart and the like).
Checked here through ``_native.copy_out`` / ``copy_in`` (the shm transport's
copies, and the same function as the shm GET/PUT and the SSD tier's): the
bytes copied are the source's, and not one byte before or after the
destination range changes.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvfabric import _native, protocol

SIZES = [0, 1, 63, 64, 4095, 4096, 4097, 4096 + 63, 4096 + 64, 65536 + 13, (1 << 20) + 7]
GUARD = 128


def _case(rng: np.random.Generator, size: int, src_mis: int, dst_mis: int):
    """An arena with the object at a 64-byte-aligned offset + src_mis, a destination at a 64-byte-aligned
    address + dst_mis with GUARD bytes of a known pattern either side."""
    arena = np.frombuffer(bytearray(rng.integers(0, 256, size + 2 * GUARD + 128, dtype=np.uint8).tobytes()),
                          dtype=np.uint8)
    src_off = (-arena.ctypes.data) % 64 + GUARD + src_mis
    raw = np.full(size + 2 * GUARD + 128, 0xA5, dtype=np.uint8)
    base = (-raw.ctypes.data) % 64 + GUARD
    dst = raw[base + dst_mis: base + dst_mis + size]
    return arena, src_off, raw, base + dst_mis, dst


@pytest.mark.parametrize("size", SIZES)
def test_copy_out_is_exact_at_every_alignment_and_touches_nothing_else(size):
    rng = np.random.default_rng(size)
    for src_mis, dst_mis in [(0, 0), (0, 16), (0, 1), (16, 0), (5, 37), (63, 1), (32, 8)]:
        arena, src_off, raw, at, dst = _case(rng, size, src_mis, dst_mis)
        key = b"k%d" % size
        (digest,) = _native.copy_out(arena, [src_off], [size], [dst], [key])
        want = arena[src_off:src_off + size]
        where = f"size {size}, source +{src_mis}, destination +{dst_mis}"
        assert np.array_equal(dst, want), f"{where}: first wrong byte at {int(np.argmax(dst != want))}"
        assert (raw[:at] == 0xA5).all() and (raw[at + size:] == 0xA5).all(), f"{where}: a byte outside was written"
        assert digest == protocol.checksum(key, want.tobytes()), where


@pytest.mark.parametrize("size", SIZES)
def test_copy_in_is_exact_at_every_alignment_and_touches_nothing_else(size):
    rng = np.random.default_rng(1000 + size)
    for part_mis, slot_mis in [(0, 0), (16, 0), (1, 0), (0, 16), (37, 5), (1, 63)]:
        arena = np.full(size + 2 * GUARD + 64, 0xA5, dtype=np.uint8)
        src_raw = np.frombuffer(bytearray(rng.integers(0, 256, size + 128, dtype=np.uint8).tobytes()),
                                dtype=np.uint8)
        s0 = (-src_raw.ctypes.data) % 64 + part_mis
        part = src_raw[s0:s0 + size]
        a0 = (-arena.ctypes.data) % 64
        off = GUARD - (GUARD % 64) + a0 + slot_mis
        _native.copy_in(arena, [off], [part])
        where = f"size {size}, part +{part_mis}, slot +{slot_mis}"
        assert np.array_equal(arena[off:off + size], part), where
        assert (arena[:off] == 0xA5).all() and (arena[off + size:] == 0xA5).all(), f"{where}: a byte outside was written"
