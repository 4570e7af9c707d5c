"""``kvfabric serve``'s size parser and its --help text, without starting a server."""

from __future__ import annotations

import pytest

from kvfabric.errors import ConfigError
from kvfabric.server.eviction import POLICIES
from kvfabric.server.main import help_epilog
from kvfabric.server.sizes import approx_size, format_size, parse_size


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


def test_help_lists_every_policy_with_a_line():
    text = help_epilog()
    for name, cls in POLICIES.items():
        line = next(ln for ln in text.splitlines() if ln.split()[:1] == [name])
        assert cls.summary in line and len(line) <= 80, line
