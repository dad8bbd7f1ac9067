from .base import KVSelector, KVState
from .certified import Certified, certified_dropped_mass, grow_until_certified
from .dense import Dense
from .entmax import EntmaxKV
from .quest import Quest
from .ssa import SSA
from .topk import AttentionTopK
from .window import Window

__all__ = [
    "AttentionTopK",
    "Certified",
    "Dense",
    "EntmaxKV",
    "KVSelector",
    "KVState",
    "Quest",
    "SSA",
    "Window",
    "certified_dropped_mass",
    "grow_until_certified",
]
