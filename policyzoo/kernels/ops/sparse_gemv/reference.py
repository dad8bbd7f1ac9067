"""The sparse GEMV's specification, in plain torch: a dense ``F.linear`` over the kept features."""

from __future__ import annotations

import torch
from torch import Tensor


def sparse_linear(x: Tensor, weight: Tensor, bias: Tensor | None, keep: Tensor) -> Tensor:
    """``F.linear`` over the kept input features only.

    ``keep`` is a bool mask shaped like ``x`` (features not kept count as zero), so the result is
    what a sparse GEMV reading only the kept weight columns computes.
    """
    return torch.nn.functional.linear(x * keep.to(x.dtype), weight, bias)


def sparse_gemv_index(x: Tensor, idx: Tensor, w_t: Tensor, bias: Tensor | None = None) -> Tensor:
    """`sparse_linear` over the input features listed in ``idx``.

    ``x [B, d_in]``, ``idx int[B, k]`` (distinct features per row), ``w_t [d_in, d_out]`` the
    input-major (transposed) weight → ``[B, d_out]`` in x's dtype.
    """
    keep = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, idx.long(), True)
    return sparse_linear(x, w_t.t(), bias, keep)


def sparse_gemv_threshold(
    x: Tensor, t: Tensor | float, w_t: Tensor, bias: Tensor | None = None, segment: int = 0
) -> Tensor:
    """`sparse_linear` over the inputs with ``|x| >= t``, compared in fp32, like
    `Threshold.keep_mask`. ``t``: a scalar, ``[B, 1]`` (per row) or ``[1, d_out]`` (per output
    column, constant over runs of ``segment`` columns: each run is its own projection)."""
    t = torch.as_tensor(t, device=x.device, dtype=torch.float32)
    mags = x.abs().float()
    if t.dim() < 2 or t.shape[1] == 1:
        return sparse_linear(x, w_t.t(), bias, mags >= t)
    runs = range(0, w_t.shape[1], segment)
    return torch.cat(
        [sparse_linear(x, w_t[:, c : c + segment].t(), None if bias is None else bias[c : c + segment], mags >= t[:, c])
         for c in runs],
        dim=-1,
    )

