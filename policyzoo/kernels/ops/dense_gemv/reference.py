"""The dense GEMV's specification, in plain torch: ``F.linear`` for an output-major weight (nn.Linear's
layout), ``x @ w_t`` for an input-major one. cuBLAS behind these is also the fallback off the kernels."""

from __future__ import annotations

import torch
from torch import Tensor


def dense_gemv(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)``: ``x [..., d_in]``, output-major ``weight [d_out, d_in]`` (each
    output's weights a row, nn.Linear's layout), ``bias [d_out]`` → ``[..., d_out]`` in x's dtype."""
    return torch.nn.functional.linear(x, weight, bias)


def dense_gemv_t(x: Tensor, w_t: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ w_t (+ bias)``: ``x [..., d_in]``, input-major ``w_t [d_in, d_out]`` (each input's weights
    a row; a transposed view of an nn.Linear weight too), ``bias [d_out]`` → ``[..., d_out]`` in x's
    dtype."""
    y = x @ w_t
    return y if bias is None else y + bias
