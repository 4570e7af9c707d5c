"""The arena's extent allocator: exact placement, merging, exhaustion, invariants."""

import random

import pytest

from kvfabric.testing.reference.arena import PAGE_SIZE, Arena, ArenaError, pages_for


def test_pages_for_rounds_up_with_one_page_minimum():
    assert pages_for(0) == 1
    assert pages_for(1) == 1
    assert pages_for(PAGE_SIZE) == 1
    assert pages_for(PAGE_SIZE + 1) == 2


def test_capacity_rounds_down_to_pages_and_rejects_tiny():
    assert Arena(3 * PAGE_SIZE + 100).capacity == 3 * PAGE_SIZE
    with pytest.raises(ArenaError):
        Arena(PAGE_SIZE - 1)
    with pytest.raises(ArenaError):
        Arena(4.5e6)


def test_sequential_allocation_fills_then_fails():
    a = Arena(4 * PAGE_SIZE)
    offs = [a.alloc(PAGE_SIZE) for _ in range(4)]
    assert offs == [0, PAGE_SIZE, 2 * PAGE_SIZE, 3 * PAGE_SIZE]
    assert a.alloc(1) is None
    assert a.free_bytes == 0
    a.check()


def test_free_merges_both_neighbours():
    a = Arena(8 * PAGE_SIZE)
    offs = [a.alloc(PAGE_SIZE) for _ in range(8)]
    a.free(offs[2], PAGE_SIZE)
    a.free(offs[4], PAGE_SIZE)
    a.check()
    assert a.free_extents == 2
    assert a.alloc(2 * PAGE_SIZE) is None  # two single pages, not contiguous
    a.free(offs[3], PAGE_SIZE)  # bridges pages 2..4 into one extent
    a.check()
    assert a.free_extents == 1
    assert a.largest_free() == 3 * PAGE_SIZE
    assert a.alloc(3 * PAGE_SIZE) == offs[2]


def test_exact_fit_preferred_over_split():
    a = Arena(16 * PAGE_SIZE)
    x = a.alloc(3 * PAGE_SIZE)
    a.alloc(PAGE_SIZE)  # separator
    y = a.alloc(2 * PAGE_SIZE)
    a.alloc(PAGE_SIZE)  # separator
    a.free(x, 3 * PAGE_SIZE)
    a.free(y, 2 * PAGE_SIZE)
    # free extents of 3, 2 and the 9-page tail: a 2-page request takes the exact hole
    assert a.alloc(2 * PAGE_SIZE) == y
    assert a.alloc(3 * PAGE_SIZE) == x


def test_uniform_sizes_never_fragment():
    """Freed slots of one object size always fit the next object of that size."""
    size = 5 * PAGE_SIZE + 123
    a = Arena(100 * pages_for(size) * PAGE_SIZE)
    rng = random.Random(7)
    live = [a.alloc(size) for _ in range(100)]
    assert None not in live and a.alloc(size) is None
    for _ in range(2000):
        i = rng.randrange(len(live))
        a.free(live[i], size)
        live[i] = a.alloc(size)
        assert live[i] is not None
    a.check()


def test_random_mixed_sizes_keep_invariants():
    a = Arena(256 * PAGE_SIZE)
    rng = random.Random(1)
    live: dict[int, int] = {}
    for _ in range(3000):
        if live and rng.random() < 0.45:
            off = rng.choice(list(live))
            a.free(off, live.pop(off))
        else:
            size = rng.randint(1, 20 * PAGE_SIZE)
            off = a.alloc(size)
            if off is not None:
                assert off not in live
                live[off] = size
    a.check()
    assert a.used_bytes == sum(pages_for(s) for s in live.values()) * PAGE_SIZE
    for off, size in list(live.items()):
        a.free(off, size)
    a.check()
    assert a.free_extents == 1 and a.free_bytes == a.capacity


def test_bad_free_is_an_error():
    a = Arena(4 * PAGE_SIZE)
    off = a.alloc(PAGE_SIZE)
    with pytest.raises(ArenaError):
        a.free(off, 2 * PAGE_SIZE)  # wrong size
    with pytest.raises(ArenaError):
        a.free(off + 1, PAGE_SIZE)  # not an extent start
    a.free(off, PAGE_SIZE)
    with pytest.raises(ArenaError):
        a.free(off, PAGE_SIZE)  # double free


def test_views_write_through_and_memfd_backing():
    for memfd in (False, True):
        a = Arena(2 * PAGE_SIZE, memfd=memfd)
        off = a.alloc(10)
        v = a.view(off, 10)
        v[:] = b"0123456789"
        assert bytes(a.buffer[off : off + 10]) == b"0123456789"
        assert (a.fd is not None) == memfd
        v.release()
        a.close()
