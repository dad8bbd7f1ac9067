"""The Inductor backport: a block-shape lookup that fails on a kernel without an x dimension is
asked again with that kernel's x symbols as scalars; anything else is left alone."""

from types import SimpleNamespace

import pytest
import sympy

from policyzoo import inductor_compat

x0, r0 = sympy.Symbol("x0", integer=True), sympy.Symbol("r0_0", integer=True)


def fake_kernel(x_dim):
    node = lambda dim: SimpleNamespace(root=SimpleNamespace(tensor_dim=dim))  # noqa: E731
    return SimpleNamespace(range_tree_nodes={x0: node(x_dim), r0: node(0)})


def old_lookup(cls, expr):
    """torch 2.11's behaviour: a shape of one entry per symbol, indexing by the tree's dimension."""
    shape = ["1"]
    for var in expr.free_symbols:
        dim = cls.kernel.range_tree_nodes[var].root.tensor_dim
        shape[dim] = "RBLOCK"  # TypeError when dim is None
    return tuple(shape) if expr.free_symbols else ()


def test_the_x_index_of_a_kernel_without_an_x_dimension_is_a_scalar():
    cls = SimpleNamespace(kernel=fake_kernel(None))
    lookup = inductor_compat.with_scalar_fallback(old_lookup, lambda: cls.kernel)
    with pytest.raises(TypeError):
        old_lookup(cls, x0 * 7 + r0)
    assert lookup(cls, x0 * 7 + r0) == ("RBLOCK",)  # the r index keeps its shape
    assert lookup(cls, 3 * x0) == ()


def test_other_failures_and_other_kernels_are_untouched():
    cls = SimpleNamespace(kernel=fake_kernel(0))
    lookup = inductor_compat.with_scalar_fallback(old_lookup, lambda: cls.kernel)
    assert lookup(cls, x0 + r0) == old_lookup(cls, x0 + r0)

    def broken(cls, expr):
        raise TypeError("something else")

    with pytest.raises(TypeError, match="something else"):
        inductor_compat.with_scalar_fallback(broken, lambda: cls.kernel)(cls, x0 + r0)


def test_apply_installs_once():
    pytest.importorskip("triton")
    from torch._inductor.codegen.triton import TritonSymbols

    inductor_compat.apply()
    installed = TritonSymbols.get_block_shape.__func__
    inductor_compat.apply()
    assert TritonSymbols.get_block_shape.__func__ is installed
    assert getattr(installed, inductor_compat._APPLIED_MARK)
