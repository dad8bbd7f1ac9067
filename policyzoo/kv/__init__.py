from .base import KVSelector, KVState
from .dense import Dense
from .quest import Quest
from .topk import AttentionTopK
from .window import Window

__all__ = ["AttentionTopK", "Dense", "KVSelector", "KVState", "Quest", "Window"]
