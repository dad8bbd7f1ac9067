"""Attention, page-scoring and projection operators.

`ops` is the seam between the library and its kernels: every call site in the library goes through
these functions. Today they dispatch to the plain-torch references in `reference.py`; the Triton
kernels register here (custom ops on CUDA) without any call site changing.
"""

from . import reference
from .reference import decode_attention, dense_probs, quest_page_bound, sparse_linear

__all__ = ["reference", "decode_attention", "dense_probs", "quest_page_bound", "sparse_linear"]
