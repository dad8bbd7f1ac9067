from .base import ProjectionSparsifier
from .threshold import Threshold
from .topk import TopK

__all__ = ["ProjectionSparsifier", "Threshold", "TopK"]
