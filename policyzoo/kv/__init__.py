# Imported in the order the registry lists the built-in policies (`kv.registry.KV_POLICIES`).
from .base import KVSelector, KVState
from .dense import Dense
from .window import Window
from .topk import AttentionTopK
from .quest import Quest
from .ssa import SSA
from .entmax import EntmaxKV
from .prhs import DepthSchedule, PrHS
from .certified import Certified, certified_dropped_mass, grow_until_certified
from .forecast import Forecast, ForecastHeads
from .communitykv import CommunityKV

__all__ = [
    "AttentionTopK",
    "Certified",
    "CommunityKV",
    "DepthSchedule",
    "Dense",
    "EntmaxKV",
    "Forecast",
    "ForecastHeads",
    "KVSelector",
    "KVState",
    "PrHS",
    "Quest",
    "SSA",
    "Window",
    "certified_dropped_mass",
    "grow_until_certified",
]
