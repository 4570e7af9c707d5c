"""Byte sizes, as people write them: ``4GiB``, ``4GB`` or ``4294967296``, never a guess.

Every size kvfabric reads is parsed here, by :func:`parse_size` (re-exported as
``kvfabric.parse_size``): the server's size options (``--capacity``, ``--min-rate``, the
``--*-budget`` options, ``--ssd-capacity``, ``--ssd-write-queue``), client settings and the
benchmarks' size flags:

* a plain number is bytes: ``4096``, ``4096B``;
* a binary unit is a power of 1024: ``KiB``, ``MiB``, ``GiB``, ``TiB`` (any case, ``Ki``/``Gi``
  as Kubernetes writes them too): ``4GiB`` = 4294967296;
* a decimal unit is a power of 1000, and only written as the SI unit it is: ``kB``/``KB``,
  ``MB``, ``GB``, ``TB`` (capital B): ``4GB`` = 4000000000, as a disk vendor means it;
* a bare ``K``, ``M``, ``G`` or ``T`` (or ``4gb``, ``4Gb``: bits?) is refused with the two
  readings spelled out, because the old parser silently read ``4G`` as 4000000000 bytes, 7%
  less than the 4 GiB most people who type it mean.

A fraction is allowed with a unit (``1.5GiB``), rounded down to whole bytes. :func:`format_size`
writes a byte count back with its unit, for start-up lines and warnings.
"""

from __future__ import annotations

import re

from .errors import ConfigError

_BINARY = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_DECIMAL = {"k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4}
_NUMBER_UNIT = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
# the unit as written -> its multiplier; anything else with a k/m/g/t prefix is ambiguous
_UNITS = {"": 1, "B": 1, "kB": 1000, **{p.upper() + "B": m for p, m in _DECIMAL.items()}}
_EXAMPLES = "e.g. 4GiB, 512MiB, 64KiB, 4GB (decimal), 1048576 (bytes)"


def parse_size(text: str | int) -> int:
    """``"4GiB"`` -> 4294967296, ``"4GB"`` -> 4000000000, ``"4096"`` or ``4096`` -> 4096.

    Raises :class:`~kvfabric.errors.ConfigError` for a negative or unparsable size and for an
    ambiguous unit (``4G``), the message saying what was probably meant; the caller prefixes the
    option's name and the text (``--capacity 4G: did you mean 4GiB (4294967296 bytes) or 4GB
    (4000000000)?``)."""
    if isinstance(text, bool):
        raise ConfigError(f"not a size: {text!r} ({_EXAMPLES})")
    if isinstance(text, int):
        if text < 0:
            raise ConfigError("a size must be >= 0 bytes")
        return text
    m = _NUMBER_UNIT.match(text)
    if not m:
        raise ConfigError(f"not a size ({_EXAMPLES})")
    number, unit = m.group(1), m.group(2)
    if unit in _UNITS:
        mult = _UNITS[unit]
    elif unit.lower() in (p + "ib" for p in _BINARY) or unit.lower() in (p + "i" for p in _BINARY):
        mult = _BINARY[unit[0].lower()]
    elif unit[:1].lower() in _BINARY and unit[1:].lower() in ("", "b"):
        p = unit[0].lower()
        binary = f"{number}{p.upper()}iB"
        decimal = f"{number}{'k' if p == 'k' else p.upper()}B"
        raise ConfigError(f"did you mean {binary} ({_whole(number, _BINARY[p])} bytes) or {decimal} "
                          f"({_whole(number, _DECIMAL[p])})?")
    else:
        raise ConfigError(f"unknown unit {unit!r} ({_EXAMPLES})")
    if mult == 1 and "." in number:
        raise ConfigError("a number of bytes must be whole")
    return _whole(number, mult)


def _whole(number: str, mult: int) -> int:
    """``number`` x ``mult`` in whole bytes, exactly for integers (no float rounding of 1000**4)."""
    if "." not in number:
        return int(number) * mult
    whole, frac = number.split(".")
    return int(whole) * mult + int(frac) * mult // 10 ** len(frac)


def format_size(n: int) -> str:
    """A byte count in the unit that writes it exactly in the fewest digits, binary on a tie:
    ``4GiB``, ``4GB``, ``1536MiB``; ``4097 bytes`` when no unit divides it. What a start-up line
    shows back, so the operator sees which reading of the flag the server took."""
    best = f"{n} bytes"
    digits = len(str(n))
    for unit, mult in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10),
                       ("TB", 1000**4), ("GB", 1000**3), ("MB", 1000**2), ("kB", 1000)):
        if n >= mult and n % mult == 0 and len(str(n // mult)) < digits:
            best, digits = f"{n // mult}{unit}", len(str(n // mult))
    return best


def approx_size(n: int) -> str:
    """A byte count rounded to one decimal of a binary unit (``22.8GiB``), for memory figures."""
    for unit, mult in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= mult:
            return f"{n / mult:.1f}{unit}"
    return f"{n} bytes"


__all__ = ["approx_size", "format_size", "parse_size"]
