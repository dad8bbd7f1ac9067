from .base import KVSelector, KVState
from .certified import Certified, certified_dropped_mass, grow_until_certified
from .communitykv import CommunityKV
from .dense import Dense
from .entmax import EntmaxKV
from .forecast import Forecast, ForecastHeads
from .prhs import DepthSchedule, PrHS
from .quest import Quest
from .ssa import SSA
from .topk import AttentionTopK
from .window import Window

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
