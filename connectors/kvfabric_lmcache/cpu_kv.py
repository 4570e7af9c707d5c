"""A CPU stand-in for LMCache's GPU connector: the "KV cache" is one CPU tensor.

LMCache's engine moves KV between the serving engine's paged GPU cache and its
own memory objects through a ``GPUConnectorInterface``. Without a GPU (CI,
this project's machines) :class:`CPUKVConnector` plays that part: the engine's
KV for one request is a dense CPU tensor of shape ``[2, num_layers, tokens,
hidden]`` (LMCache's ``KV_2LTD`` layout, the layout of its memory objects),
passed to ``store``/``retrieve`` as the ``kv`` keyword argument. Storing
copies token slices of that tensor into memory objects; retrieving copies
them back. It moves bytes only, so a retrieve that reports a hit must have
put exactly the stored bytes into the caller's tensor.

Only the non-layerwise, non-MLA path is supported (``use_layerwise`` false):
that is what LMCache's engine uses with a remote backend by default. A wrong
tensor shape, dtype or a missing ``kv`` argument raises ``ValueError``.
"""

from __future__ import annotations

from typing import Any

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
from lmcache.v1.memory_management import MemoryFormat, MemoryObj


class CPUKVConnector(GPUConnectorInterface):
    """Copies token ranges between a ``[2, L, T, D]`` CPU tensor and LMCache memory objects."""

    def __init__(self, num_layers: int, hidden_dim: int, dtype: torch.dtype) -> None:
        if num_layers <= 0 or hidden_dim <= 0:
            raise ValueError(f"num_layers and hidden_dim must be positive, got {num_layers}, {hidden_dim}")
        self.num_layers = num_layers
        self.hidden_dim = hidden_dim
        self.dtype = dtype
        self.kvcaches = None

    @staticmethod
    def kv_shape(num_layers: int, num_kv_heads: int, head_size: int, chunk_size: int) -> tuple[int, int, int, int, int]:
        """The ``LMCacheMetadata.kv_shape`` tuple matching this layout: (L, 2, chunk, heads, head_size)."""
        return (num_layers, 2, chunk_size, num_kv_heads, head_size)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.hidden_dim])

    def _kv(self, kwargs: dict[str, Any], start: int, end: int) -> torch.Tensor:
        kv = kwargs.get("kv")
        if not isinstance(kv, torch.Tensor):
            raise ValueError("CPUKVConnector needs the request's KV tensor as the 'kv' keyword argument")
        if kv.device.type != "cpu" or kv.dtype != self.dtype:
            raise ValueError(f"kv must be a CPU tensor of dtype {self.dtype}, got {kv.device} {kv.dtype}")
        if kv.dim() != 4 or kv.shape[0] != 2 or kv.shape[1] != self.num_layers or kv.shape[3] != self.hidden_dim:
            raise ValueError(f"kv must have shape [2, {self.num_layers}, tokens, {self.hidden_dim}], got {list(kv.shape)}")
        if not 0 <= start <= end <= kv.shape[2]:
            raise ValueError(f"token range [{start}, {end}) outside the kv tensor of {kv.shape[2]} tokens")
        return kv[:, :, start:end, :]

    @staticmethod
    def _obj_tensor(memory_obj: MemoryObj, tokens: int) -> torch.Tensor:
        if memory_obj.get_memory_format() != MemoryFormat.KV_2LTD:
            raise ValueError(f"CPUKVConnector handles KV_2LTD memory objects, got {memory_obj.get_memory_format()}")
        t = memory_obj.tensor
        if t is None or t.dim() != 4 or t.shape[2] != tokens:
            raise ValueError(f"memory object shape {None if t is None else list(t.shape)} does not hold {tokens} tokens")
        return t

    def from_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        src = self._kv(kwargs, start, end)
        self._obj_tensor(memory_obj, end - start).copy_(src)

    def to_gpu(self, memory_obj: MemoryObj, start: int, end: int, **kwargs: Any) -> None:
        dst = self._kv(kwargs, start, end)
        dst.copy_(self._obj_tensor(memory_obj, end - start))

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs: Any) -> None:  # type: ignore[override]
        for obj, s, e in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, s, e, **kwargs)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs: Any) -> None:  # type: ignore[override]
        if memory_objs is None or starts is None or ends is None:
            raise ValueError("CPUKVConnector.batched_to_gpu needs memory_objs, starts and ends (no layerwise mode)")
        for obj, s, e in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, s, e, **kwargs)
