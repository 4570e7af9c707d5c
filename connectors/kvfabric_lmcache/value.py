"""The object this plugin stores per LMCache chunk: a small header, then the chunk bytes.

LMCache rebuilds a chunk with ``local_cpu_backend.allocate(shapes, dtypes, fmt)``,
so the stored object carries that metadata in front of the raw bytes (one
object per key: metadata and bytes can never disagree or be half-written)::

    offset  size      field
    0       4         magic  b"KFLC"
    4       1         version (2; 1 is still read)
    5       1         reserved, 0
    6       2         meta_len, u16 little-endian, 1..MAX_META_BYTES
    8       meta_len  msgpack map {"fmt": int, "shapes": [[int, ...], ...],
                                   "dtypes": [str, ...], "nbytes": int}
    8+meta_len        zero padding up to the header's end, R (version 2 only)
    R       nbytes    the chunk bytes (MemoryObj.byte_array)

Version 2 pads the header to ``R = header_region(meta_len)``, a multiple of
``HEADER_ALIGN`` (256; every header this plugin writes for ordinary chunks
is exactly 256 bytes), so a reader knows where the bytes start before it has
seen the header: it receives the first 256 bytes into a small buffer and the
rest straight into LMCache's memory object (``Client.get_into_parts``, no
staging copy; see the connector). Version 1 (``R = 8 + meta_len``, written
before) still decodes, through the copying path.

``fmt`` is ``MemoryFormat.value``; ``dtypes`` are torch dtype names without
the ``torch.`` prefix, from the fixed table ``DTYPES``. Decoding checks the
magic, version, the meta length against ``MAX_META_BYTES`` and the buffer
before unpacking, group count (``MAX_GROUPS``), rank (``MAX_DIMS``), known
dtypes and formats, and that ``nbytes`` is exactly what follows; anything
else raises :class:`ValueFormatError`, which the connector counts and treats
as a miss (never as KV).
"""

from __future__ import annotations

import struct

import msgpack
import numpy as np
import torch
from lmcache.v1.memory_management import MemoryFormat, MemoryObj

MAGIC = b"KFLC"
VERSION = 2
_READS = (1, 2)  # versions decode() accepts
_FIXED = struct.Struct("<4sBBH")
HEADER_FIXED_BYTES = _FIXED.size  # 8
HEADER_ALIGN = 256
MAX_META_BYTES = 1024
MAX_GROUPS = 16
MAX_DIMS = 8


def header_region(meta_len: int, version: int = VERSION) -> int:
    """Bytes from the object's start to its chunk bytes, for a header with ``meta_len`` bytes of metadata."""
    n = HEADER_FIXED_BYTES + meta_len
    return n if version == 1 else -(-n // HEADER_ALIGN) * HEADER_ALIGN


MAX_HEADER_BYTES = header_region(MAX_META_BYTES)  # 1280

DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8,
    "int8": torch.int8,
    "int16": torch.int16,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


class ValueFormatError(ValueError):
    """A stored object is not a valid kvfabric-LMCache chunk (corrupt, foreign or newer)."""


class ChunkMeta:
    """Shapes, dtypes and format of one stored chunk, plus its byte count."""

    __slots__ = ("fmt", "shapes", "dtypes", "nbytes")

    def __init__(self, fmt: MemoryFormat, shapes: list[torch.Size], dtypes: list[torch.dtype], nbytes: int) -> None:
        self.fmt = fmt
        self.shapes = shapes
        self.dtypes = dtypes
        self.nbytes = nbytes

    def __repr__(self) -> str:
        return f"ChunkMeta(fmt={self.fmt.name}, shapes={[list(s) for s in self.shapes]}, dtypes={self.dtypes}, nbytes={self.nbytes})"


def shapes_dtypes(memory_obj: MemoryObj) -> tuple[list[torch.Size], list[torch.dtype]]:
    """The object's groups: ``get_shapes()``/``get_dtypes()``, or its single ``get_shape()``/``get_dtype()``.

    LMCache 0.5 objects built with only ``MemoryObjMetadata(shape=, dtype=)``
    (its own L2-adapter check, ``lmcache bench l2``) assert in ``get_shapes()``
    because ``meta.shapes`` is None; they are one group.
    """
    try:
        shapes, dtypes = memory_obj.get_shapes(), memory_obj.get_dtypes()
    except (AssertionError, AttributeError, NotImplementedError):
        shapes = dtypes = None
    if not shapes or dtypes is None:
        shapes, dtypes = [memory_obj.get_shape()], [memory_obj.get_dtype()]
    return [torch.Size(s) for s in shapes], list(dtypes)


def encode_header(memory_obj: MemoryObj) -> bytes:
    """The header for ``memory_obj``. ValueError for a dtype outside ``DTYPES`` or too many groups/dims."""
    obj_shapes, dtypes = shapes_dtypes(memory_obj)
    shapes = [list(map(int, s)) for s in obj_shapes]
    if not 1 <= len(shapes) <= MAX_GROUPS or len(dtypes) != len(shapes):
        raise ValueError(f"a chunk needs 1..{MAX_GROUPS} groups with one dtype each, got {len(shapes)} shapes, {len(dtypes)} dtypes")
    names = []
    for d in dtypes:
        if d not in _DTYPE_NAMES:
            raise ValueError(f"dtype {d} is not storable (known: {sorted(DTYPES)})")
        names.append(_DTYPE_NAMES[d])
    if any(len(s) > MAX_DIMS for s in shapes):
        raise ValueError(f"a chunk shape has more than {MAX_DIMS} dimensions")
    meta = msgpack.packb(
        {"fmt": memory_obj.get_memory_format().value, "shapes": shapes, "dtypes": names, "nbytes": memory_obj.get_size()},
        use_bin_type=True,
    )
    if len(meta) > MAX_META_BYTES:
        raise ValueError(f"chunk metadata of {len(meta)} bytes exceeds MAX_META_BYTES={MAX_META_BYTES}")
    head = _FIXED.pack(MAGIC, VERSION, 0, len(meta)) + meta
    return head + bytes(header_region(len(meta)) - len(head))


def encoded_size(memory_obj: MemoryObj) -> int:
    """Bytes :func:`encode` produces for ``memory_obj`` (at most ``MAX_HEADER_BYTES`` + its size)."""
    return len(encode_header(memory_obj)) + memory_obj.get_size()


def encode_into(memory_obj: MemoryObj, out: np.ndarray) -> np.ndarray:
    """Write header + chunk bytes into the uint8 array ``out``; returns the used prefix of ``out``.

    ValueError if ``out`` is too small. numpy's slice copy runs at memcpy
    speed (LMCache's ctypes-backed ``'<B'`` memoryview would be copied
    element by element by ``bytearray``).
    """
    header = encode_header(memory_obj)
    data = np.frombuffer(memory_obj.byte_array, dtype=np.uint8)
    total = len(header) + data.size
    if out.dtype != np.uint8 or out.ndim != 1 or out.size < total:
        raise ValueError(f"encode_into needs a 1-D uint8 array of at least {total} bytes")
    out[: len(header)] = np.frombuffer(header, dtype=np.uint8)
    out[len(header):total] = data
    return out[:total]


def encode(memory_obj: MemoryObj) -> np.ndarray:
    """Header + chunk bytes in one new uint8 array (one copy of the chunk)."""
    return encode_into(memory_obj, np.empty(encoded_size(memory_obj), dtype=np.uint8))


def header_length(head: bytes | bytearray | memoryview) -> int:
    """Where the chunk bytes of the object starting with ``head`` begin (its header region).

    Reads only the fixed 8 bytes. ValueFormatError when they are short, not this
    plugin's, or a version this code does not read.
    """
    view = memoryview(head).cast("B")
    if len(view) < HEADER_FIXED_BYTES:
        raise ValueFormatError(f"object of {len(view)} bytes is shorter than the {HEADER_FIXED_BYTES}-byte header")
    magic, version, reserved, meta_len = _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        raise ValueFormatError(f"bad magic {bytes(magic)!r} (not written by kvfabric's LMCache plugin)")
    if version not in _READS or reserved != 0:
        raise ValueFormatError(f"unsupported value version {version} (reserved={reserved}); this plugin reads {_READS}")
    if not 1 <= meta_len <= MAX_META_BYTES:
        raise ValueFormatError(f"meta_len {meta_len} out of range 1..{MAX_META_BYTES}")
    return header_region(meta_len, version)


def decode_header(head: bytes | bytearray | memoryview, size: int) -> ChunkMeta:
    """The metadata of a ``size``-byte object whose header region is in ``head`` (at least
    :func:`header_length` bytes of it). Checks everything :func:`decode` checks, including that
    exactly ``nbytes`` follow the header. ValueFormatError otherwise."""
    view = memoryview(head).cast("B")
    region = header_length(view)
    if region > len(view) or region > size:
        raise ValueFormatError(f"header of {region} bytes out of range for an object of {size} bytes")
    meta_len = _FIXED.unpack_from(view, 0)[3]
    end = HEADER_FIXED_BYTES + meta_len
    if any(view[end:region]):
        raise ValueFormatError("header padding is not zero")
    try:
        meta = msgpack.unpackb(view[HEADER_FIXED_BYTES:end], raw=False, max_array_len=MAX_GROUPS * (MAX_DIMS + 1))
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise ValueFormatError(f"chunk metadata is not valid msgpack: {exc}") from None
    if not isinstance(meta, dict) or set(meta) != {"fmt", "shapes", "dtypes", "nbytes"}:
        raise ValueFormatError(f"chunk metadata has the wrong fields: {meta!r:.200}")
    fmt_v, shapes, names, nbytes = meta["fmt"], meta["shapes"], meta["dtypes"], meta["nbytes"]
    try:
        fmt = MemoryFormat(fmt_v)
    except ValueError:
        raise ValueFormatError(f"unknown memory format {fmt_v!r}") from None
    if (
        not isinstance(shapes, list) or not isinstance(names, list)
        or not 1 <= len(shapes) <= MAX_GROUPS or len(names) != len(shapes)
        or not all(isinstance(s, list) and len(s) <= MAX_DIMS and all(type(d) is int and d >= 0 for d in s) for s in shapes)
        or not all(isinstance(n, str) and n in DTYPES for n in names)
    ):
        raise ValueFormatError(f"chunk metadata has bad shapes/dtypes: {shapes!r:.200} {names!r:.200}")
    if type(nbytes) is not int or nbytes != size - region:
        raise ValueFormatError(f"chunk metadata says {nbytes!r} bytes but {size - region} follow")
    return ChunkMeta(fmt, [torch.Size(s) for s in shapes], [DTYPES[n] for n in names], nbytes)


def decode(buf: bytes | bytearray | memoryview) -> tuple[ChunkMeta, memoryview]:
    """(metadata, view of the chunk bytes inside ``buf``). ValueFormatError if invalid."""
    view = memoryview(buf).cast("B")
    meta = decode_header(view, len(view))
    return meta, view[len(view) - meta.nbytes:]


__all__ = ["ChunkMeta", "DTYPES", "HEADER_ALIGN", "MAGIC", "MAX_HEADER_BYTES", "MAX_META_BYTES", "ValueFormatError",
           "decode", "decode_header", "encode", "encode_header", "encode_into", "encoded_size", "header_length",
           "header_region", "shapes_dtypes"]
