"""Fixes to TorchInductor that policyzoo's compiled steps need on older torch builds.

One fix today. torch 2.11's Inductor fails to generate a Triton kernel that has no x dimension
(a scan or persistent reduction over a single row block, "no_x_dim") when an index expression of
that kernel names the x index: ``TritonSymbols.get_block_shape`` indexes a shape list with the
tree's ``tensor_dim``, which is None there (``TypeError: list indices must be integers or slices,
not NoneType``). `CommunityKV`'s selection at 128K tokens, a prefix sum feeding a gather, builds
such a kernel. Newer Inductor treats the x index of such a kernel as a scalar, which is what it is
(one row block per program). `apply` gives older builds the same answer: when the lookup fails, it
asks again with those symbols replaced by 0, which have no shape. Builds that already handle it
never reach the fallback.
"""

from __future__ import annotations

import functools

import sympy

_APPLIED_MARK = "_policyzoo_scalar_x_fallback"


def _scalar_range_symbols(kernel, expr: sympy.Expr) -> dict[sympy.Symbol, sympy.Integer]:
    """The range symbols of ``expr`` whose range tree has no tensor dimension, mapped to 0."""
    nodes = getattr(kernel, "range_tree_nodes", {})
    out = {}
    for var in expr.free_symbols:
        node = nodes.get(var)
        if node is not None and getattr(node.root, "tensor_dim", 0) is None:
            out[var] = sympy.Integer(0)
    return out


def with_scalar_fallback(get_block_shape, current_kernel):
    """``get_block_shape(cls, expr)`` that, where it raises TypeError, asks again with the range
    symbols of ``current_kernel()`` that have no tensor dimension replaced by 0."""

    @functools.wraps(get_block_shape)
    def wrapped(cls, expr):
        try:
            return get_block_shape(cls, expr)
        except TypeError:
            scalars = _scalar_range_symbols(current_kernel(), expr)
            if not scalars:
                raise
            return get_block_shape(cls, expr.subs(scalars))

    setattr(wrapped, _APPLIED_MARK, True)
    return wrapped


def apply() -> None:
    """Install the fallback on Inductor's ``TritonSymbols.get_block_shape`` (idempotent; a no-op
    where Inductor's Triton backend cannot be imported)."""
    try:
        from torch._inductor.codegen.triton import TritonSymbols
        from torch._inductor.virtualized import V
    except ImportError:  # no Triton: nothing of Inductor's GPU code generation runs
        return
    original = TritonSymbols.get_block_shape.__func__
    if not getattr(original, _APPLIED_MARK, False):
        TritonSymbols.get_block_shape = classmethod(with_scalar_fallback(original, lambda: V.kernel))


__all__ = ["apply", "with_scalar_fallback"]
