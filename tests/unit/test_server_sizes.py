"""``kvfabric serve``'s size parser, its memory check and its --help text, without starting a server."""

from __future__ import annotations

import pytest

from kvfabric.errors import ConfigError
from kvfabric.server import memory
from kvfabric.server.eviction import POLICIES
from kvfabric.server.main import help_epilog
from kvfabric.sizes import approx_size, format_size, parse_size


@pytest.mark.parametrize("text, n", [
    ("4096", 4096), (4096, 4096), ("0", 0), ("4096B", 4096), (" 4096 ", 4096),
    ("64KiB", 64 << 10), ("512MiB", 512 << 20), ("4GiB", 4 << 30), ("1TiB", 1 << 40),
    ("4gib", 4 << 30), ("4GIB", 4 << 30), ("4Gi", 4 << 30), ("4 GiB", 4 << 30),
    ("1.5MiB", 1572864), ("0.5KiB", 512),
    ("4kB", 4000), ("4KB", 4000), ("512MB", 512_000_000), ("4GB", 4_000_000_000), ("2TB", 2 * 10**12),
    ("1.5TB", 1_500_000_000_000),
])
def test_sizes_in_bytes_binary_and_written_out_decimal_units(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("text, hint", [
    ("4G", "did you mean 4GiB (4294967296 bytes) or 4GB (4000000000)?"),
    ("4g", "did you mean 4GiB (4294967296 bytes) or 4GB (4000000000)?"),
    ("4gb", "did you mean 4GiB (4294967296 bytes) or 4GB (4000000000)?"),  # gigabits?
    ("4Gb", "did you mean 4GiB (4294967296 bytes) or 4GB (4000000000)?"),
    ("64k", "did you mean 64KiB (65536 bytes) or 64kB (64000)?"),
    ("512M", "did you mean 512MiB (536870912 bytes) or 512MB (512000000)?"),
    ("1T", "did you mean 1TiB (1099511627776 bytes) or 1TB (1000000000000)?"),
    ("1.5G", "did you mean 1.5GiB (1610612736 bytes) or 1.5GB (1500000000)?"),
])
def test_a_bare_prefix_is_refused_with_both_readings(text, hint):
    with pytest.raises(ConfigError) as e:
        parse_size(text)
    assert str(e.value) == hint


@pytest.mark.parametrize("bad", ["", "GiB", "-1", -1, "4X", "4b", "1.5", "4 G B", "4GiBs", "0x10", True, "1e9"])
def test_anything_else_is_not_a_size(bad):
    with pytest.raises(ConfigError):
        parse_size(bad)


@pytest.mark.parametrize("n, text", [
    (4 << 30, "4GiB"), (4_000_000_000, "4GB"), (1536 << 20, "1536MiB"), (4096, "4KiB"), (4000, "4kB"),
    (1 << 40, "1TiB"), (10**12, "1TB"), (4097, "4097 bytes"), (0, "0 bytes"), (1000 << 30, "1000GiB"),
])
def test_format_size_writes_the_reading_back_in_its_unit(n, text):
    assert format_size(n) == text
    if not text.endswith("bytes"):
        assert parse_size(text) == n  # it reads back to the same bytes


def test_approx_size():
    assert approx_size(int(22.8 * (1 << 30))) == "22.8GiB"
    assert approx_size(232 << 20) == "232.0MiB"
    assert approx_size(10) == "10 bytes"


def test_dram_needs_counts_arena_page_map_fixed_part_budgets_and_tier_queue():
    cap = 4 << 30
    assert memory.dram_needs(cap, reply_budget=32 << 20, request_budget=32 << 20) == (
        cap + cap // 256 + memory.FIXED_BYTES + (64 << 20))
    assert memory.dram_needs(cap, reply_budget=1, request_budget=1, tier_write_queue=64 << 20) == (
        cap + cap // 256 + memory.FIXED_BYTES + 2 + (64 << 20))
    # the metrics endpoint's share, with --metrics-port: a fixed part and one term per connection it serves
    assert memory.metrics_bytes(8) == memory.METRICS_FIXED_BYTES + 8 * memory.METRICS_CONN_BYTES
    assert memory.dram_needs(cap, reply_budget=1, request_budget=1, metrics_connections=8) == (
        cap + cap // 256 + memory.FIXED_BYTES + 2 + memory.metrics_bytes(8))


def test_the_memory_warning_fires_only_above_what_is_available():
    cap = 1 << 40
    needs = memory.dram_needs(cap, reply_budget=32 << 20, request_budget=32 << 20)
    text = memory.over_memory_warning(cap, needs, (24 << 30, "MemAvailable in /proc/meminfo"))
    assert text is not None
    assert "--capacity 1TiB" in text and "24.0GiB available here (MemAvailable in /proc/meminfo)" in text, text
    assert "not faulted in ahead of use" in text and "Lower --capacity" in text, text
    assert memory.over_memory_warning(cap, needs, (needs, "x")) is None
    assert memory.over_memory_warning(cap, needs, None) is None  # unknown: no guess


def test_meminfo_and_cgroup_limits_are_read_from_their_files(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683584 kB\nMemFree: 1 kB\nMemAvailable:   23872440 kB\n")
    assert memory._meminfo_available(str(meminfo)) == 23872440 * 1024
    assert memory._meminfo_available(str(tmp_path / "none")) is None

    root = tmp_path / "cg"
    (root / "pod" / "c1").mkdir(parents=True)
    proc = tmp_path / "cgroup"
    proc.write_text("0::/pod/c1\n")
    assert memory._cgroup_limit(str(proc), str(root)) is None  # no memory.max: no limit
    (root / "pod" / "c1" / "memory.max").write_text("max\n")
    assert memory._cgroup_limit(str(proc), str(root)) is None
    (root / "pod" / "c1" / "memory.max").write_text("8589934592\n")
    assert memory._cgroup_limit(str(proc), str(root)) == 8 << 30
    # cgroup v1, the host's path absent inside the container: the mount's root holds its limit
    proc.write_text("4:memory:/docker/abc\n1:cpu:/docker/abc\n")
    (root / "memory").mkdir()
    (root / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert memory._cgroup_limit(str(proc), str(root)) is None  # v1's "unlimited"
    (root / "memory" / "memory.limit_in_bytes").write_text("4294967296\n")
    assert memory._cgroup_limit(str(proc), str(root)) == 4 << 30


def test_help_lists_every_policy_with_a_line():
    text = help_epilog()
    for name, cls in POLICIES.items():
        line = next(ln for ln in text.splitlines() if ln.split()[:1] == [name])
        assert cls.summary in line and len(line) <= 80, line


def test_dram_needs_counts_the_kv_events_publisher():
    from kvfabric.server import kv_events

    cap = 1 << 30
    share = kv_events.kv_events_bytes(1000, 65536)
    assert share == (1000 * (kv_events.TIER_EVENT_BYTES + 2 * kv_events.PY_EVENT_BYTES)
                     + 65536 * kv_events.PY_EVENT_BYTES + kv_events.DEFAULT_BUFFER_BYTES
                     + kv_events.DEFAULT_BUFFER_STEPS * kv_events.BATCH_OVERHEAD_BYTES)
    assert memory.dram_needs(cap, reply_budget=1, request_budget=1, kv_events=share) == (
        cap + cap // 256 + memory.FIXED_BYTES + 2 + share)
