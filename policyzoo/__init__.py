"""policyzoo: KV-cache selection policies and activation-sparse projections for faster decoding.

    from policyzoo import Decoder, Quest, TopK
    dec = Decoder(model, kv=Quest(budget=0.25), proj=TopK(0.5))
    out = dec.generate(input_ids, max_new_tokens=64)
"""

from .cache import PagedKVCache
from .decoder import Decoder
from .hf import apply
from .kv import SSA, AttentionTopK, Certified, CommunityKV, Dense, DepthSchedule, EntmaxKV, Forecast, KVSelector, KVState, PrHS, Quest, Window
from .kv.context import StepContext
from .offload import Offload
from .proj import ProjectionSparsifier, Threshold, TopK
from .selection import Selection
from .session import DecodeSession

__version__ = "0.1.0"

__all__ = [
    "AttentionTopK",
    "Certified",
    "CommunityKV",
    "DecodeSession",
    "Decoder",
    "Dense",
    "DepthSchedule",
    "EntmaxKV",
    "Forecast",
    "KVSelector",
    "KVState",
    "Offload",
    "PagedKVCache",
    "PrHS",
    "ProjectionSparsifier",
    "Quest",
    "SSA",
    "Selection",
    "StepContext",
    "Threshold",
    "TopK",
    "Window",
    "apply",
]
