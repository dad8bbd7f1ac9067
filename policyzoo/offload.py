"""`Offload`: whole layers' keys and values in pinned host memory, read by the GPU in place.

A 1M-token cache of an 8B model (Llama-3.1-8B: 128 KiB per token) is 128 GiB. That does not fit
beside the weights on one 141 GB GPU, which holds about 928K tokens. `Decoder(model, kv=Quest(0.1),
offload=Offload(layers=8))` keeps the keys and values of the last 8 layers in pinned host memory,
exposed to CUDA as device tensors at the pinned buffer's unified address (`host_tensor`):
- Kernels read and write them in place over the host link (about 50 GB/s on an H200's PCIe host,
  against the GPU memory's 4.3 TB/s).
- Nothing else changes: the attention function, the Triton kernels, `torch.compile` and CUDA
  graphs see an ordinary CUDA tensor.

Every layer's page summaries stay on the GPU, as do the other layers' keys and values. A page
policy (`Quest`, `SSA`'s proxy, ...) therefore scores pages without touching the host. Over the
link, a step reads only the selected pages of the offloaded layers (`bytes.ByteAccount.host_bytes`),
plus the one token each layer appends.

This is the synchronous form: an offloaded layer's attention reads its pages over the link when it
runs. Prefetching the next layer's predicted pages on a side stream, behind the current layer's
work, is not built yet. A persistent zero-copy gather on a quarter of the SMs measured 50 GB/s and
hid behind GPU work on another stream (`benchmarks/results/2026-12-03-h200-run18/`).

On a CPU device the cache is in host memory anyway: the layers are ordinary tensors, and decoding is
the same as without offload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

# The array-interface type of each element size: the bytes are wrapped as integers of that size and
# viewed as the cache's dtype (the interface has no bfloat16).
_TYPESTR = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}
_INTEGER = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Offload:
    """Which layers keep their keys and values in pinned host memory (module docstring).

    Args:
        layers: an int ``n``, the last ``n`` layers (a prefetch, once built, runs behind the layer
            before, which layer 0 does not have); or the layer indices themselves.
    """

    layers: int | tuple[int, ...] = 1

    def __post_init__(self) -> None:
        layers = self.layers
        if isinstance(layers, bool):
            raise TypeError(f"layers must be an int or a tuple of layer indices, got {layers!r}")
        if isinstance(layers, int):
            if layers < 1:
                raise ValueError(f"layers must be at least 1 (no offload: leave offload=None), got {layers}")
            return
        if not isinstance(layers, Sequence) or not layers or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
            raise TypeError(f"layers must be an int or a non-empty tuple of layer indices, got {layers!r}")
        if len(set(layers)) != len(layers) or min(layers) < 0:
            raise ValueError(f"layer indices must be distinct and >= 0, got {tuple(layers)}")
        object.__setattr__(self, "layers", tuple(sorted(layers)))

    def host_layers(self, num_layers: int) -> frozenset[int]:
        """The offloaded layer indices of a model with ``num_layers`` layers."""
        if isinstance(self.layers, int):
            if self.layers > num_layers:
                raise ValueError(f"Offload(layers={self.layers}) asks for more layers than the model's {num_layers}")
            return frozenset(range(num_layers - self.layers, num_layers))
        if max(self.layers) >= num_layers:
            raise ValueError(f"Offload(layers={self.layers}) names layer {max(self.layers)}; the model has {num_layers}")
        return frozenset(self.layers)


def host_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """Zeros in host memory, as a tensor of ``device``.

    On CUDA the memory is pinned (page-locked) and the tensor is a CUDA tensor at its unified address.
    Kernels read and write it in place over the host link, and it keeps the pinned buffer alive. On
    other devices it is a plain tensor: a CPU cache is in host memory already.
    """
    device = torch.device(device)
    if device.type != "cuda":
        return torch.zeros(shape, dtype=dtype, device=device)
    host = torch.zeros(shape, dtype=dtype, pin_memory=True)
    size = host.element_size()
    wrapped = torch.as_tensor(_PinnedBuffer(host.view(_INTEGER[size])), device=device)
    return wrapped.view(dtype)


class _PinnedBuffer:
    """A pinned host tensor as the CUDA array interface sees it (its unified address). The tensor that
    `torch.as_tensor` makes from it holds a reference to it, so the pinned buffer lives as long."""

    def __init__(self, host: Tensor) -> None:
        self.host = host
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": _TYPESTR[host.element_size()],
            "data": (host.data_ptr(), False),
            "strides": None,
            "version": 3,
        }


__all__ = ["Offload", "host_tensor"]
