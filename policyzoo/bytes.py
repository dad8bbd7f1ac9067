"""The byte account: bytes one decode step reads, ideal speedup bounds and the byte crossover.

Per layer (element size ``e``; ``d`` hidden size, ``H``/``H_kv`` query/KV heads of dim ``h``,
``d_ff`` feed-forward size) the projections hold ``P = d·H·h + 2·d·H_kv·h + H·h·d + 3·d·d_ff``
weights and each cached token ``2·H_kv·h`` elements. A step over ``n`` tokens with projection keep
``r_P`` and KV keep ``r_KV`` reads ``L·(P·r_P + 2·H_kv·h·n·r_KV)·e`` plus the never-sparsified LM head
and norms. The crossover, where both savings are equal, is
``n* = (1 − r_P)·P / ((1 − r_KV)·2·H_kv·h)``: the layer count cancels. Lengths are reported in
K = 1024 tokens.

A model with sliding-window layers (Mistral, Qwen2 with ``use_sliding_window``, Gemma-2/3:
``window_layers`` of its layers attend to the last ``window`` tokens) reads, in each window layer,
``min(n, window)`` tokens densely beyond the window (the policy runs on the full layers only); within
the window every layer is a full one, as the Decoder runs it. Its crossover beyond the window is
``L / L_full`` times the formula's, since only the full layers save KV bytes.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

# Dimensions written in, so no download is needed: (d, d_ff, layers, heads, kv_heads, head_dim, vocab, tied
# [, sliding window, layers with it])
BUILTIN = {
    "llama-3.1-8b": (4096, 14336, 32, 32, 8, 128, 128256, False),
    "llama-3.1-70b": (8192, 28672, 80, 64, 8, 128, 128256, False),
    "llama-3.2-3b": (3072, 8192, 28, 24, 8, 128, 128256, True),
    "mistral-7b": (4096, 14336, 32, 32, 8, 128, 32768, False),
    "mistral-7b-v0.1": (4096, 14336, 32, 32, 8, 128, 32000, False, 4096, 32),
    "gemma-3-1b": (1152, 6912, 26, 4, 1, 256, 262144, True, 512, 22),
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
    window: int = 0  # the sliding window of the model's window layers, in tokens (0: none)
    window_layers: int = 0  # how many layers attend to that window only

    @classmethod
    def from_config(cls, config: Any, dtype: torch.dtype = torch.bfloat16) -> "ByteAccount":
        """From an HF config object, a config.json path, or a built-in name (see `BUILTIN`)."""
        e = torch.empty((), dtype=dtype).element_size()
        if isinstance(config, (str, Path)):
            key = str(config).lower()
            if key in BUILTIN:
                d, ff, n_l, h, h_kv, hd, v, tied, *windows = BUILTIN[key]
                return cls(d, ff, n_l, h, h_kv, hd, v, tied, e, *windows)
            path = Path(config)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise ValueError(f"config: {config!r} is neither a built-in name ({', '.join(BUILTIN)}) nor a config.json path")
            try:
                config = json.loads(path.read_text())
            except (UnicodeDecodeError, json.JSONDecodeError) as err:
                raise ValueError(f"config: {str(path)!r} is not a JSON model config (a config.json): {err}") from None
            if not isinstance(config, dict):
                raise ValueError(f"config: {str(path)!r} holds JSON, but not a model config (an object of its dimensions)")
        if isinstance(config, dict) and "hidden_size" not in config and isinstance(config.get("text_config"), dict):
            config = config["text_config"]  # a multimodal config (Gemma-3 4B and up): its language model's
        get = config.get if isinstance(config, dict) else lambda k, default=None: getattr(config, k, default)
        try:
            d, h = int(get("hidden_size")), int(get("num_attention_heads"))
            window, window_layers = _windows(config)
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
                window=window,
                window_layers=window_layers,
            )
        except (TypeError, ValueError) as err:
            raise ValueError(f"config lacks the dimensions a byte account needs: {err}") from None

    def per_rank(self, world: int) -> "ByteAccount":
        """One rank's account under tensor parallelism over ``world`` ranks (`policyzoo.distributed`):
        a ``1/world`` share of the heads, KV heads and MLP channels (so of the projections and the
        KV cache); the LM head and norms, replicated, are read whole by every rank."""
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise ValueError(f"world must be a positive int, got {world!r}")
        for name in ("heads", "kv_heads", "ffn"):
            if getattr(self, name) % world:
                raise ValueError(f"{name}={getattr(self, name)} does not split over {world} ranks")
        return replace(self, heads=self.heads // world, kv_heads=self.kv_heads // world, ffn=self.ffn // world)

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

    def step_bytes(
        self, n: int, r_p: float = 1.0, r_kv: float = 1.0, batch: int = 1, union_keep: float | None = None,
        r_select: float = 0.0,
    ) -> float:
        """Bytes one decode step reads at context ``n``.

        With ``batch > 1`` the weights are read once for all rows (a sparse projection reads the
        union of the rows' kept columns, ``union_keep``, which defaults to ``r_p`` at batch 1 and
        must be given for larger batches when ``r_p < 1``) and each row reads its own KV.
        ``r_select`` counts what a KV policy reads to choose, as a fraction of the cached tokens'
        KV elements (`selection_overhead`: page summaries, a second stage's candidate keys).
        """
        _check_ratio(r_p, "r_p")
        _check_ratio(r_kv, "r_kv")
        if isinstance(r_select, bool) or not isinstance(r_select, (int, float)) or not 0 <= r_select < math.inf:
            raise ValueError(f"r_select must be a finite number >= 0, got {r_select!r}")
        if batch > 1 and r_p < 1 and union_keep is None:
            raise ValueError("union_keep: a batched sparse projection reads the union of the rows' columns; pass it")
        keep = _projection_keep(r_p, union_keep)
        per_layer = self.proj * keep + batch * self.kv_per_token * n * (r_kv + r_select)
        total = self.layers * per_layer
        if self.window_layers and n > self.window:  # window layers read their window, densely, not the policy's share
            total -= self.window_layers * batch * self.kv_per_token * (n * (r_kv + r_select) - self.window)
        return (total + self.fixed) * self.element_size

    def bound(
        self, n: int, r_p: float = 1.0, r_kv: float = 1.0, batch: int = 1, union_keep: float | None = None,
        r_select: float = 0.0,
    ) -> float:
        """Ideal speedup over dense: dense bytes over the setting's bytes."""
        return self.step_bytes(n, batch=batch) / self.step_bytes(n, r_p, r_kv, batch, union_keep, r_select)

    def floor_ms(
        self, n: int, bandwidth: float, r_p: float = 1.0, r_kv: float = 1.0, batch: int = 1,
        union_keep: float | None = None, r_select: float = 0.0,
    ) -> float:
        """The byte floor: step bytes over ``bandwidth`` (bytes/s), in milliseconds."""
        return self.step_bytes(n, r_p, r_kv, batch, union_keep, r_select) / bandwidth * 1e3

    def host_bytes(self, n: int, r_kv: float = 1.0, host_layers: int = 0, batch: int = 1, hit_rate: float = 0.0) -> float:
        """Bytes one step reads over the host link when ``host_layers`` layers keep their keys and
        values in host memory (`policyzoo.offload.Offload`): those layers' selected KV, less the share
        ``hit_rate`` their page caches hold on the device (`offload.PageCache`). Their page summaries
        stay on the device, so what a policy reads to choose is not counted here."""
        _check_ratio(r_kv, "r_kv")
        if isinstance(hit_rate, bool) or not isinstance(hit_rate, (int, float)) or not 0.0 <= hit_rate <= 1.0:
            raise ValueError(f"hit_rate must be a share in [0, 1], got {hit_rate!r}")
        if isinstance(host_layers, bool) or not isinstance(host_layers, int) or not 0 <= host_layers <= self.layers:
            raise ValueError(f"host_layers must be an int in [0, {self.layers}], got {host_layers!r}")
        return host_layers * batch * self.kv_per_token * n * r_kv * self.element_size * (1.0 - hit_rate)

    def offload_floor_ms(
        self, n: int, bandwidth: float, host_bandwidth: float, host_layers: int, r_p: float = 1.0, r_kv: float = 1.0,
        batch: int = 1, union_keep: float | None = None, r_select: float = 0.0, hit_rate: float = 0.0,
    ) -> float:
        """The byte floor of a step with ``host_layers`` offloaded layers (no prefetch): the device's
        bytes over ``bandwidth`` plus the host link's over ``host_bandwidth`` (bytes/s), in
        milliseconds. The two do not overlap: a layer's attention waits for its pages. With page
        caches (``hit_rate``), the hits are read on the device and only the misses cross the link."""
        if not (host_bandwidth > 0 and bandwidth > 0):
            raise ValueError(f"bandwidths must be > 0, got {bandwidth!r} and {host_bandwidth!r}")
        selected = self.host_bytes(n, r_kv, host_layers, batch)
        host = selected * (1.0 - hit_rate)
        device = self.step_bytes(n, r_p, r_kv, batch, union_keep, r_select) - host
        return (device / bandwidth + host / host_bandwidth) * 1e3

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
        keep = _projection_keep(r_p, union_keep)
        p = self.ffn_proj if ff_only else self.proj
        if r_kv >= 1.0:
            return math.inf
        n = (1.0 - keep) * p / ((1.0 - r_kv) * self.kv_per_token * batch)
        if not self.window_layers or n <= self.window:  # within the window every layer is a full one
            return n
        full = self.layers - self.window_layers  # beyond it only the full layers save KV bytes
        return n * self.layers / full if full else math.inf


SKETCH_FRACTION = 0.125  # 4 bits per key channel against 2·16 bits of key and value per channel


def selection_overhead(
    page: int | None = None, rescore: float = 0.0, r_kv: float = 1.0, summary_bytes: float = 1.0, sketch: bool = False,
    nominate: float = 0.0,
) -> float:
    """``r_select`` of a KV policy: what it reads to choose, as a fraction of the KV elements of the
    cached tokens. A page policy reads its pages' key min and max (``2·H_kv·h`` elements per page,
    ``1/page`` of a token's keys and values; ``summary_bytes`` scales it for summaries stored wider
    than the cache); one that ranks by the 4-bit key sketch (``sketch``, `bound="sketch"`) also reads
    every key's codes, an eighth of a 16-bit cache's bytes; a two-stage policy (``rescore``) also
    reads the keys (half of a token's elements) of ``rescore·r_kv`` of the tokens. A token policy
    that scores every key exactly (``page=None``, ``rescore=1/r_kv``) reads half the cache to choose.
    A two-level selection (``sketch`` with ``nominate``, `Quest(nominate=...)`) reads the codes of
    ``nominate·r_kv`` of the tokens only (its box candidates)."""
    summaries = summary_bytes / page if page else 0.0
    codes = SKETCH_FRACTION * (min(1.0, nominate * r_kv) if nominate else 1.0) if sketch else 0.0
    return summaries + codes + 0.5 * min(1.0, rescore * r_kv)


def _windows(config: Any) -> tuple[int, int]:
    """``(window, window layers)`` of a config (`_compat.layer_windows`); ``(0, 0)`` without windows."""
    from ._compat import layer_windows

    if (config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)) is None:
        return 0, 0  # a bare dimensions dict: no attention kinds to read
    windows = [w for w in layer_windows(config) if w is not None]
    if len(set(windows)) > 1:
        raise ValueError(f"the byte account takes one sliding window, the config has {sorted(set(windows))}")
    return (windows[0], len(windows)) if windows else (0, 0)


def _projection_keep(r_p: float, union_keep: float | None) -> float:
    """Fraction of projection weights a step reads: ``r_p`` for one row, the rows' union for a batch.

    The union can only be larger than one row's keep, and a dense projection (``r_p = 1``) stays dense.
    """
    if union_keep is None or r_p >= 1.0:
        return r_p
    _check_ratio(union_keep, "union_keep")
    if union_keep < r_p:
        raise ValueError(f"union_keep ({union_keep}) cannot be below r_p ({r_p}): the union holds every row's columns")
    return union_keep


def _check_ratio(value: float, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be a keep ratio in (0, 1], got {value!r}")


# ------------------------------------------------------------------------------------ reports
K = 1024
DEFAULT_BANDWIDTH = 4.27e12  # bytes/s: device-to-device copy bandwidth measured on an H200 (benchmarks/results)
SETTINGS = ("dense", "proj", "kv", "both")  # the four settings a step can run (and the gate chooses from)


def parse_tokens(text: str) -> int:
    """A token count: ``"4096"``, ``"4k"``/``"4K"`` (× 1024) or ``"1m"`` (× 1024²); must be positive."""
    s = str(text).strip().lower()
    scale = {"k": K, "m": K * K}.get(s[-1:], 1)
    digits = s[:-1] if scale > 1 else s
    try:
        value = float(digits)
    except ValueError:
        raise ValueError(f"{text!r} is not a token count (examples: 4096, 4k, 128k, 1m)") from None
    n = value * scale
    if not (math.isfinite(n) and n >= 1 and n == int(n)):
        raise ValueError(f"{text!r} is not a positive whole number of tokens")
    return int(n)


def format_k(tokens: float) -> str:
    """Tokens in K = 1024 with one decimal (``76_087 -> "74.3K"``); ``"never"`` for ``inf``."""
    if math.isinf(tokens):
        return "never"
    return f"{tokens / K:.1f}K"


def format_context(tokens: int) -> str:
    """A context length for a table: ``"32K"`` for whole multiples of 1024, else one decimal."""
    return f"{tokens // K}K" if tokens % K == 0 else format_k(tokens)


def setting_ratios(setting: str, r_p: float, r_kv: float) -> tuple[float, float]:
    """``(r_P, r_KV)`` a setting runs with: ``dense`` keeps everything, ``both`` applies both ratios."""
    if setting not in SETTINGS:
        raise ValueError(f"setting must be one of {', '.join(SETTINGS)}, got {setting!r}")
    return (r_p if setting in ("proj", "both") else 1.0, r_kv if setting in ("kv", "both") else 1.0)


def report(
    acct: ByteAccount,
    r_p: float,
    r_kv: float,
    contexts: list[int],
    batch: int = 1,
    union_keep: float | None = None,
    bandwidth: float = DEFAULT_BANDWIDTH,
    model: str | None = None,
    dtype: str | None = None,
) -> dict:
    """The byte account of one pair of keep ratios, as a JSON-ready dict (what ``policyzoo bytes`` prints).

    ``crossover`` holds the crossover in tokens and in K for all seven projections (``all``) and for
    the feed-forward projections only (``ff_only``; ``None`` when the KV branch saves nothing). ``rows``
    holds, per context and setting (``dense``, ``proj``, ``kv``, ``both``), the step bytes, the byte
    floor in ms at ``bandwidth`` bytes/s and the ideal speedup bound over dense. With ``batch > 1`` a
    setting with sparse projections reads ``union_keep`` of the weight columns.
    """
    _check_ratio(r_p, "r_p")
    _check_ratio(r_kv, "r_kv")
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be a positive int, got {batch!r}")
    if union_keep is not None:
        _check_ratio(union_keep, "union_keep")
        if batch == 1:
            raise ValueError("union_keep applies to batch > 1 only (at batch 1 the projection reads r_p of the columns)")
        if union_keep < r_p:
            raise ValueError(f"union_keep ({union_keep}) cannot be below r_p ({r_p}): the union of the rows' columns holds each row's")
    elif batch > 1 and r_p < 1:
        raise ValueError("union_keep: a batched sparse projection reads the union of the rows' kept columns; give it (in [r_p, 1])")
    if not (isinstance(bandwidth, (int, float)) and math.isfinite(bandwidth) and bandwidth > 0):
        raise ValueError(f"bandwidth must be a positive number of bytes/s, got {bandwidth!r}")
    if not contexts:
        raise ValueError("contexts: give at least one context length")
    crossover = {}
    for key, ff_only in (("all", False), ("ff_only", True)):
        n = acct.crossover(r_p, r_kv, ff_only=ff_only, batch=batch, union_keep=union_keep)
        crossover[key] = {"tokens": None if math.isinf(n) else n, "K": None if math.isinf(n) else n / K}
    rows = []
    for n in contexts:
        for setting in SETTINGS:
            sp, skv = setting_ratios(setting, r_p, r_kv)
            union = union_keep if sp < 1 else None  # a dense projection reads every column
            step = acct.step_bytes(n, sp, skv, batch, union)
            rows.append({
                "context": n, "setting": setting, "r_p": sp, "r_kv": skv, "step_bytes": step,
                "floor_ms": step / bandwidth * 1e3, "bound": acct.step_bytes(n, batch=batch) / step,
            })  # fmt: skip
    return {
        "model": model, "dtype": dtype, "element_size": acct.element_size, "r_p": r_p, "r_kv": r_kv, "batch": batch,
        "union_keep": union_keep, "bandwidth_TBps": bandwidth / 1e12, "crossover": crossover, "rows": rows,
        "window": acct.window, "window_layers": acct.window_layers, "layers": acct.layers,
    }  # fmt: skip


def format_report(rep: dict) -> str:
    """`report` as the text ``policyzoo bytes`` prints."""

    def size(b: float) -> str:
        return f"{b / 1e9:.2f} GB" if b >= 1e9 else f"{b / 1e6:.1f} MB"

    cross = {k: (format_k(v["tokens"]) if v["tokens"] is not None else "never") for k, v in rep["crossover"].items()}
    batch = f", batch {rep['batch']}" + (f", union keep {rep['union_keep']}" if rep["union_keep"] is not None else "")
    label = {"dense": "dense", "proj": f"proj (r_P {rep['r_p']:g})", "kv": f"kv (r_KV {rep['r_kv']:g})", "both": "both"}
    lines = [
        f"byte account: {rep['model']}, {rep.get('dtype') or 'elements of'} ({rep['element_size']} bytes per element){batch}",
        f"keep ratios: projections r_P = {rep['r_p']:g}, KV cache r_KV = {rep['r_kv']:g}",
    ]
    if rep.get("window_layers"):
        lines.append(f"sliding-window layers: {rep['window_layers']} of {rep['layers']}, window {rep['window']} tokens "
                     "(read densely beyond it; the KV policy runs on the other layers)")
    lines += [
        "",
        "crossover (K = 1024 tokens; below it the projection branch saves more bytes, above it the KV branch):",
        f"  all seven projections  {cross['all']:>8}",
        f"  feed-forward only      {cross['ff_only']:>8}",
        "",
        f"per decode step: bytes read, byte floor at {rep['bandwidth_TBps']:g} TB/s, ideal speedup bound over dense:",
    ]
    width = max(len(v) for v in label.values())
    head = f"{'context':>8}  {'setting':<{width}}  {'step bytes':>10}  {'floor ms':>9}  {'bound':>6}"
    lines += [head, "-" * len(head)]
    previous = None
    for r in rep["rows"]:
        ctx = format_context(r["context"]) if r["context"] != previous else ""
        previous = r["context"]
        lines.append(f"{ctx:>8}  {label[r['setting']]:<{width}}  {size(r['step_bytes']):>10}  {r['floor_ms']:>9.3f}  {r['bound']:>5.2f}x")
    return "\n".join(lines)
