"""The plain-torch references, the specification every kernel is tested against: one index of the
``reference.py`` beside each op (`kernels.ops`), so that callers and tests find them in one place.

Shapes use ``B`` batch rows, ``H`` query heads, ``H_kv`` KV heads (``G = H // H_kv`` query heads per
group), ``N`` cache slots, ``D`` head dim, ``P`` pages.
"""

from __future__ import annotations

from .ops.attention_edges.reference import EDGES_BLOCK_ELEMENTS, attention_edges
from .ops.cache_append.reference import cache_append, page_summaries
from .ops.community_choice.reference import community_choice
from .ops.decode_attention.reference import (
    decode_attention,
    decode_attention_entmax15,
    dense_probs,
    entmax15_threshold,
)
from .ops.dense_gemv.reference import dense_gemv, dense_gemv_t
from .ops.entmax_threshold.reference import (
    censored_relu_sq,
    gaussian_entmax_threshold,
    gaussian_relu,
    gaussian_relu_sq,
    pool_scale,
)
from .ops.gathered_logits.reference import gathered_logits
from .ops.page_fetch.reference import page_fetch
from .ops.page_gaussians.reference import page_gaussians
from .ops.quest_page_bound.reference import quest_page_bound, quest_page_bound_grouped
from .ops.select_pages.reference import (
    page_choice_inputs,
    page_count,
    page_flags,
    round_for_ranking,
    select_page_scores,
    select_pages,
    select_scores,
    visible_pages,
)
from .ops.select_top.reference import select_top
from .ops.sketch_page_bound.reference import (
    SKETCH_LEVELS,
    half2_slack,
    sketch_decode_codes,
    sketch_encode,
    sketch_grid,
    sketch_page_bound,
    sketch_token_bound,
)
from .ops.sparse_gemv.reference import sparse_gemv_index, sparse_gemv_threshold, sparse_linear
from .visibility import visible

__all__ = [
    "EDGES_BLOCK_ELEMENTS",
    "SKETCH_LEVELS",
    "attention_edges",
    "cache_append",
    "community_choice",
    "censored_relu_sq",
    "decode_attention",
    "decode_attention_entmax15",
    "dense_gemv",
    "dense_gemv_t",
    "dense_probs",
    "entmax15_threshold",
    "gathered_logits",
    "gaussian_entmax_threshold",
    "gaussian_relu",
    "gaussian_relu_sq",
    "half2_slack",
    "page_choice_inputs",
    "page_count",
    "page_flags",
    "page_fetch",
    "page_gaussians",
    "page_summaries",
    "pool_scale",
    "quest_page_bound",
    "quest_page_bound_grouped",
    "round_for_ranking",
    "select_page_scores",
    "select_pages",
    "select_scores",
    "select_top",
    "sketch_decode_codes",
    "sketch_encode",
    "sketch_grid",
    "sketch_page_bound",
    "sketch_token_bound",
    "sparse_gemv_index",
    "sparse_gemv_threshold",
    "sparse_linear",
    "visible",
    "visible_pages",
]
