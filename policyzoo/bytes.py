"""The byte account: bytes one decode step reads, ideal speedup bounds and the byte crossover.

Per layer (element size ``e``; ``d`` hidden size, ``H``/``H_kv`` query/KV heads of dim ``h``,
``d_ff`` feed-forward size) the projections hold ``P = d·H·h + 2·d·H_kv·h + H·h·d + 3·d·d_ff``
weights and each cached token ``2·H_kv·h`` elements. A step over ``n`` tokens with projection keep
``r_P`` and KV keep ``r_KV`` reads ``L·(P·r_P + 2·H_kv·h·n·r_KV)·e`` plus the never-sparsified LM head
and norms. The crossover, where both savings are equal, is
``n* = (1 − r_P)·P / ((1 − r_KV)·2·H_kv·h)``: the layer count cancels. Lengths are reported in
K = 1024 tokens.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# Dimensions written in, so no download is needed: (d, d_ff, layers, heads, kv_heads, head_dim, vocab, tied)
BUILTIN = {
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, 128, 128256, False),
    "llama-3.1-70b": (8192, 28672, 80, 64, 8, 128, 128256, False),
    "llama-3.2-3b": (3072, 8192, 28, 24, 8, 128, 128256, True),
    "mistral-7b": (4096, 14336, 32, 32, 8, 128, 32768, False),
    "qwen3-8b": (4096, 12288, 36, 32, 8, 128, 151936, False),
    "smollm2-135m": (576, 1536, 30, 9, 3, 64, 49152, True),
}


@dataclass(frozen=True)
class ByteAccount:
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = False
    element_size: int = 2

    @classmethod
    def from_config(cls, config: Any, dtype: torch.dtype = torch.bfloat16) -> "ByteAccount":
        """From an HF config object, a config.json path, or a built-in name (see `BUILTIN`)."""
        e = torch.empty((), dtype=dtype).element_size()
        if isinstance(config, (str, Path)):
            key = str(config).lower()
            if key in BUILTIN:
                d, ff, n_l, h, h_kv, hd, v, tied = BUILTIN[key]
                return cls(d, ff, n_l, h, h_kv, hd, v, tied, e)
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise ValueError(f"config: {config!r} is neither a built-in name ({', '.join(BUILTIN)}) nor a config.json path")
            config = json.loads(path.read_text())
        get = config.get if isinstance(config, dict) else lambda k, default=None: getattr(config, k, default)
        try:
            d, h = int(get("hidden_size")), int(get("num_attention_heads"))
            return cls(
                hidden=d,
                ffn=int(get("intermediate_size")),
                layers=int(get("num_hidden_layers")),
                heads=h,
                kv_heads=int(get("num_key_value_heads") or h),
                head_dim=int(get("head_dim") or d // h),
                vocab=int(get("vocab_size")),
                tied_embeddings=bool(get("tie_word_embeddings", False)),
                element_size=e,
            )
        except (TypeError, ValueError) as err:
            raise ValueError(f"config lacks the dimensions a byte account needs: {err}") from None

    # ------------------------------------------------------------------ elements per layer / step
    @property
    def attn_proj(self) -> int:
        """q, k, v and o weights of one layer."""
        return 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_heads * self.head_dim

    @property
    def ffn_proj(self) -> int:
        """gate, up and down weights of one layer."""
        return 3 * self.hidden * self.ffn

    @property
    def proj(self) -> int:
        """``P``: all seven projections of one layer."""
        return self.attn_proj + self.ffn_proj

    @property
    def kv_per_token(self) -> int:
        """Elements one cached token occupies in one layer (keys and values)."""
        return 2 * self.kv_heads * self.head_dim

    @property
    def fixed(self) -> int:
        """Elements read every step whatever the keep ratios: LM head and norms."""
        return self.vocab * self.hidden + (2 * self.layers + 1) * self.hidden

    def step_bytes(self, n: int, r_p: float = 1.0, r_kv: float = 1.0, batch: int = 1, union_keep: float | None = None) -> float:
        """Bytes one decode step reads at context ``n``.

        With ``batch > 1`` the weights are read once for all rows (a sparse projection reads the
        union of the rows' kept columns, ``union_keep``, which defaults to ``r_p`` at batch 1 and
        must be given for larger batches when ``r_p < 1``) and each row reads its own KV.
        """
        _check_ratio(r_p, "r_p")
        _check_ratio(r_kv, "r_kv")
        if batch > 1 and r_p < 1 and union_keep is None:
            raise ValueError("union_keep: a batched sparse projection reads the union of the rows' columns; pass it")
        keep = r_p if union_keep is None else union_keep
        per_layer = self.proj * keep + batch * self.kv_per_token * n * r_kv
        return (self.layers * per_layer + self.fixed) * self.element_size

    def bound(self, n: int, r_p: float = 1.0, r_kv: float = 1.0, batch: int = 1, union_keep: float | None = None) -> float:
        """Ideal speedup over dense: dense bytes over the setting's bytes."""
        return self.step_bytes(n, batch=batch) / self.step_bytes(n, r_p, r_kv, batch, union_keep)

    def floor_ms(self, n: int, bandwidth: float, r_p: float = 1.0, r_kv: float = 1.0, batch: int = 1, union_keep: float | None = None) -> float:
        """The byte floor: step bytes over ``bandwidth`` (bytes/s), in milliseconds."""
        return self.step_bytes(n, r_p, r_kv, batch, union_keep) / bandwidth * 1e3

    def crossover(self, r_p: float, r_kv: float, ff_only: bool = False, batch: int = 1, union_keep: float | None = None) -> float:
        """Context (tokens) where the projection and KV savings are equal.

        ``n* = (1 − r_P)·P / ((1 − r_KV)·2·H_kv·h)``; ``ff_only`` counts only gate/up/down. With a
        batch, the projection saving is shared by all rows (and shrinks to ``1 − union_keep``) while
        each row's KV saving adds up. ``inf`` when the KV branch saves nothing.
        """
        _check_ratio(r_p, "r_p")
        _check_ratio(r_kv, "r_kv")
        if batch > 1 and r_p < 1 and union_keep is None:
            raise ValueError("union_keep: a batched sparse projection reads the union of the rows' columns; pass it")
        keep = r_p if union_keep is None else union_keep
        p = self.ffn_proj if ff_only else self.proj
        if r_kv >= 1.0:
            return math.inf
        return (1.0 - keep) * p / ((1.0 - r_kv) * self.kv_per_token * batch)


def _check_ratio(value: float, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be a keep ratio in (0, 1], got {value!r}")
