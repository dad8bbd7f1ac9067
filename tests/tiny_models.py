"""Tiny random-weight models of each supported family, shared by the decoder-level tests."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers

from policyzoo import SSA, AttentionTopK, Certified, CommunityKV, EntmaxKV, Forecast, PrHS, Quest, Window
from policyzoo.kv.choose import choose_topk
from policyzoo.kv.scoring import forced_pages, group_page_bounds, page_budget

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

_CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
}

# Families beyond FAMILIES (which most decoder tests run over), each checked by its own tests, with
# the config fields that make them differ from Llama: Granite's multipliers (its attention scale
# is not head_dim**-0.5).
MORE_FAMILIES = ("gemma", "granite", "olmo2")
_EXTRA = {"granite": dict(attention_multiplier=0.2, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=4.0)}


def tiny_model(family: str = "llama", seed: int = 0, layers: int = 2, heads: int = 4, kv_heads: int = 2, vocab: int = 128):
    config_cls, model_cls = (getattr(transformers, n) for n in _CLASSES[family])
    config = config_cls(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=16,
        max_position_embeddings=1024,
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
        **_EXTRA.get(family, {}),
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    # Random init gives near-uniform attention; larger q/k weights make attention peaked, so a
    # sparse policy that drops the wrong keys actually changes the output.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    return model


def padded_batch(batch: int, length: int, vocab: int = 128, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random prompts, left-padded: row ``i`` has ``i * 3`` pad tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, length), generator=g)
    mask = torch.ones_like(ids)
    for i in range(batch):
        mask[i, : min(i * 3, length - 1)] = 0
    return ids * mask, mask


@dataclass
class LearnedQuest(Quest):
    """A toy policy with learned parameters, for the contract tests: Quest's page bound plus a
    recency bonus per KV head that a linear head reads off the hidden state entering the layer."""

    hidden_size: int = 64
    kv_heads: int = 2
    step_context = ("hidden",)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.head = torch.nn.Linear(self.hidden_size, self.kv_heads)

    def select(self, state, q):
        k_max, count = page_budget(state, self._budget, self.page, self.sinks, self.window, "LearnedQuest")
        hidden = state.context.hidden
        pages = torch.arange(state.cache.num_pages, device=q.device, dtype=torch.float32)
        bonus = self.head(hidden.to(self.head.weight.dtype)).float()[:, :, None] * pages  # [B, H_kv, P]
        scores = group_page_bounds(state, q) + bonus
        return choose_topk(scores, forced_pages(state, self.sinks, self.window), k_max, count, block=self.page)


class RecordingStreamer:
    """An HF-protocol streamer that keeps what it is given: ``chunks`` (the prompt first, then each
    step's tokens) and whether ``end`` was called."""

    def __init__(self) -> None:
        self.chunks: list[torch.Tensor] = []
        self.ended = False

    def put(self, value: torch.Tensor) -> None:
        self.chunks.append(value.clone())

    def end(self) -> None:
        self.ended = True


# Every built-in KV policy, small enough that a tiny prompt spans many of its pages and budgets bite.
BUILTIN_POLICIES = {
    "dense": lambda: None,
    "window": lambda: Window(sinks=2, window=6),
    "attn-topk": lambda: AttentionTopK(0.3, sinks=2, window=2),
    "quest": lambda: Quest(0.3, page=4, sinks=2, window=2),
    "quest-sketch": lambda: Quest(0.3, page=4, sinks=2, window=2, bound="sketch"),
    "quest-nominate": lambda: Quest(0.3, page=4, sinks=2, window=2, bound="sketch", nominate=2),
    "certified-quest-sketch": lambda: Certified(Quest(0.1, page=4, sinks=2, window=2, bound="sketch"), eps=0.05),
    "ssa-page": lambda: SSA(0.2, 0.2, page=4, sinks=2, window=2),
    "ssa-page-gumbel": lambda: SSA(0.2, 0.2, page=4, sinks=2, window=2, scheme="gumbel_topk"),
    "ssa-exact": lambda: SSA(0.2, 0.2, proxy="exact", sinks=2, window=2),
    "entmax-kv": lambda: EntmaxKV(0.3, page=4, sinks=2, window=2),
    "certified-quest": lambda: Certified(Quest(0.2, page=4, sinks=2, window=2), eps=0.05),
    "quest-rescore": lambda: Quest(0.3, page=4, sinks=2, window=2, rescore=2),
    "ssa-page-rescore": lambda: SSA(0.2, 0.2, page=4, sinks=2, window=2, rescore=2),
    "entmax-kv-rescore": lambda: EntmaxKV(0.3, page=4, sinks=2, window=2, rescore=3),
    "entmax-kv-sketch": lambda: EntmaxKV(0.3, page=4, sinks=2, window=2, bound="sketch"),
    "ssa-page-sketch": lambda: SSA(0.2, 0.2, page=4, sinks=2, window=2, bound="sketch"),
    "prhs": lambda: PrHS(Quest(0.3, page=4, sinks=2, window=2), time=0.5, layer=(0, 0)),
    "prhs-certified": lambda: PrHS(Quest(0.3, page=4, sinks=2, window=2), eps=0.5, time=0.5, layer=(0, 0)),
    "forecast": lambda: Forecast(0.3, block=8, kernel=8, stride=4, sinks=2, window=2, rank=4),
    "community-kv": lambda: CommunityKV(0.3, sinks=2, window=2),
    "community-kv-head": lambda: CommunityKV(0.3, sinks=2, window=2, graph="head"),
}


def hybrid_model(family: str, window: int = 8, seed: int = 0) -> torch.nn.Module:
    """A tiny random model of ``family`` with sliding-window layers of ``window`` tokens: every layer
    (mistral), layers from the second on (qwen2, qwen3: ``max_window_layers=1``), or the first and
    third of three (gemma3, gemma2, without soft-capping)."""
    common = dict(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, pad_token_id=0, bos_token_id=None,
        eos_token_id=None, sliding_window=window,
    )  # fmt: skip
    if family == "mistral":
        config, cls = transformers.MistralConfig(**common), transformers.MistralForCausalLM
    elif family in ("qwen2", "qwen3"):
        prefix = "Qwen2" if family == "qwen2" else "Qwen3"
        config = getattr(transformers, f"{prefix}Config")(use_sliding_window=True, max_window_layers=1, **common)
        cls = getattr(transformers, f"{prefix}ForCausalLM")
    elif family == "gemma3":  # query_pre_attn_scalar != head_dim: the model's own softmax scale must reach the kernels
        layer_types = ["sliding_attention", "full_attention", "sliding_attention"]
        config = transformers.Gemma3TextConfig(layer_types=layer_types, query_pre_attn_scalar=24, **common)
        cls = transformers.Gemma3ForCausalLM
    else:
        config = transformers.Gemma2Config(attn_logit_softcapping=None, query_pre_attn_scalar=24, **common)
        cls = transformers.Gemma2ForCausalLM
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():  # peaked attention, so that what a layer attends to shows in its output
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    return model
