"""Attention, page-scoring and projection operators: every call site in the library goes through
these functions.

Each op lives in one package under ``ops/``: its public function, its torch custom op and fake, its
launch config and shape rule, its Triton kernel (``kernel.py``) and its plain-torch reference
(``reference.py``, the specification; `reference` indexes them all). One rule (`route`) sends a call
to the Triton kernel — CUDA tensors with triton installed, or ``POLICYZOO_TRITON=1`` — or to the
reference (the default on CPU), without any call site changing. Launch parameters are values
(`config`), overridden for a scope with ``kernels.config.override(...)``. Scratch the kernels need
zeroed comes from the caller's `Workspace` (``workspace=``).
"""

from . import config, reference, route
from .ops.attention_edges import AttentionEdgesConfig, attention_edges
from .ops.cache_append import cache_append
from .ops.community_choice import CommunityChoiceConfig, community_choice
from .ops.decode_attention import AttentionConfig, decode_attention, decode_attention_entmax15
from .ops.dense_gemv import DenseGemvConfig, dense_gemv, dense_gemv_decode_rows, dense_gemv_t
from .ops.entmax_threshold import EntmaxThresholdConfig, gaussian_entmax_threshold
from .ops.gathered_logits import GatheredLogitsConfig, gathered_logits
from .ops.page_fetch import PageFetchConfig, page_fetch
from .ops.page_gaussians import PageGaussiansConfig, page_gaussians
from .ops.prefetch import prefetch_pages_op, wait_for_prefetch
from .ops.quest_page_bound import PageScoreConfig, quest_page_bound, quest_page_bound_grouped
from .ops.select_pages import MAX_ROW as SELECT_PAGES_ROW
from .ops.select_pages import SelectPagesConfig, select_page_scores, select_pages, select_scores
from .ops.select_pages import takes as select_pages_takes
from .ops.select_pages import takes_scores as select_scores_takes
from .ops.select_top import MAX_BLOCK_N as SELECT_TOP_ROW
from .ops.select_top import SelectTopConfig, select_top
from .ops.sketch_page_bound import SketchScoreConfig, sketch_page_bound
from .ops.sparse_gemv import GemvConfig, sparse_gemv_index, sparse_gemv_mask, sparse_gemv_threshold, sparse_linear
from .reference import dense_probs
from .route import use_triton
from .workspace import Workspace

__all__ = [
    "config",
    "reference",
    "route",
    "use_triton",
    "Workspace",
    "attention_edges",
    "cache_append",
    "community_choice",
    "decode_attention",
    "decode_attention_entmax15",
    "dense_gemv",
    "dense_gemv_decode_rows",
    "dense_gemv_t",
    "dense_probs",
    "gaussian_entmax_threshold",
    "gathered_logits",
    "page_fetch",
    "page_gaussians",
    "prefetch_pages_op",
    "quest_page_bound",
    "quest_page_bound_grouped",
    "select_page_scores",
    "select_pages",
    "select_scores",
    "select_pages_takes",
    "select_scores_takes",
    "SELECT_PAGES_ROW",
    "select_top",
    "SELECT_TOP_ROW",
    "sketch_page_bound",
    "sparse_gemv_index",
    "sparse_gemv_mask",
    "sparse_gemv_threshold",
    "sparse_linear",
    "wait_for_prefetch",
    "AttentionConfig",
    "AttentionEdgesConfig",
    "CommunityChoiceConfig",
    "DenseGemvConfig",
    "EntmaxThresholdConfig",
    "GatheredLogitsConfig",
    "GemvConfig",
    "PageFetchConfig",
    "PageGaussiansConfig",
    "PageScoreConfig",
    "SelectPagesConfig",
    "SelectTopConfig",
    "SketchScoreConfig",
]
