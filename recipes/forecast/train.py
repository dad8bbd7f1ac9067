"""Fine-tune `policyzoo.kv.Forecast`'s heads against the next layer's attention over blocks.

``python -m recipes.forecast.train [options]`` (see ``recipes/forecast/README.md``). The model is
frozen; only the heads (`ForecastHeads`, one low-rank head per layer) learn. For a chunk of text the
frozen model runs once, dense, and we keep what both sides of the loss need at a few sampled query
positions ``t``:

- the **teacher** (what layer ``i`` really attends to at ``t``): the softmax over windows of two
  tokens (the finer (2, 1) compression, keys ``(k_j + k_{j+1}) / 2`` after RoPE) of layer ``i``'s own
  queries, averaged over each GQA group's query heads, each window's mass credited to the block
  holding its first token, restricted to the blocks the policy may choose (not the forced ones) and
  renormalised;
- the **student** (what the policy would score at ``t``): the policy's own functions
  (`ForecastHeads.forward`, `rotate`, `page_means`, `block_scores`), head ``i`` reading the hidden
  state entering layer ``i - 1`` (head 0: layer 0) and scoring layer ``i``'s page means, then a
  softmax over the same candidate blocks. These are `Forecast.scores`'s scores at inference up to
  a positive factor per (layer, position): decoding skips the head's input RMS norm, which ranks
  nothing, while here it keeps the softmax's temperature independent of the hidden state's size.

Blocks and pages are laid out in the cache's slot frame, as at inference: a decode session places
the prompt so that it ends on a block boundary (`DecodeSession.prompt_slot`), so token ``j`` sits in
slot ``offset + j`` with ``offset`` in ``[0, block)`` depending on the prompt's length. Each chunk
draws its own ``offset`` (the first slots are then invisible, as a prompt's first slots are), so the
heads learn every alignment they will meet. The loss is KL(teacher ‖ student) over the teacher's
top-k candidate blocks plus one bucket for the rest of the mass. Evaluation: the held-out recall of
the teacher's top blocks by the student's, for the untrained and the trained heads, then passkey
accuracy and perplexity through `policyzoo.eval` with the trained file beside dense.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface

from policyzoo import _compat, assets
from policyzoo.argtypes import positive_int
from policyzoo.kv.forecast import Forecast, ForecastHeads, block_scores, page_means, rotate

CAPTURE_ATTENTION = "policyzoo-forecast-capture"
MIN_BLOCKS = 4  # query positions start this many blocks into a chunk: fewer leaves no candidates
NEG = -1e9  # "no candidate" as a finite logit: an all -inf row would give NaN gradients


class UsageError(ValueError):
    """Bad input to the recipe; its message names the option."""


# -------------------------------------------------------------------------------- geometry
@dataclass(frozen=True)
class Geometry:
    """The policy's block geometry (tokens): the recipe lays pages and blocks out exactly as the
    `Forecast` that will load the heads does, so it reads them off such a policy."""

    block: int = 64
    kernel: int = 32
    stride: int = 16
    sinks: int = 64
    window: int = 64

    @classmethod
    def of(cls, policy: Forecast) -> "Geometry":
        return cls(policy.block, policy.kernel, policy.stride, policy.sinks, policy.window)

    @property
    def kernel_pages(self) -> int:
        return self.kernel // self.stride

    @property
    def block_pages(self) -> int:
        return self.block // self.stride

    def n_blocks(self, offset: int, tokens: int) -> int:
        """Blocks of a cache holding ``tokens`` tokens from slot ``offset``."""
        return -(-(offset + tokens) // self.block)


DEFAULT_GEOMETRY = Geometry.of(Forecast())


# ------------------------------------------------------------------------------------ data
def load_texts(dataset: str | None, config: str | None, split: str, column: str):
    """A `datasets.Dataset` with the text in ``column``: the embedded essays (one document; no
    network) unless ``dataset`` names one for `datasets.load_dataset`."""
    from datasets import Dataset, load_dataset

    if dataset is None:
        return Dataset.from_dict({column: [assets.essays_text()]})
    texts = load_dataset(dataset, config, split=split)
    if column not in texts.column_names:
        raise UsageError(f"--text-column: the dataset {dataset!r} has no column {column!r} (it has {', '.join(texts.column_names)})")
    return texts


def make_chunks(texts: Any, tokenizer: Any, column: str, seq_len: int, max_chunks: int | None = None):
    """The texts tokenised (`Dataset.map`), documents joined by the EOS token, cut into chunks of
    ``seq_len`` tokens (the tail shorter than a chunk is dropped): a `Dataset` with ``input_ids``."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []

    def tokenize(batch: dict) -> dict:
        return {"input_ids": [tokenizer(t, add_special_tokens=False).input_ids + eos for t in batch[column]]}

    def group(batch: dict) -> dict:
        ids = [t for doc in batch["input_ids"] for t in doc]
        n = len(ids) // seq_len * seq_len
        return {"input_ids": [ids[i : i + seq_len] for i in range(0, n, seq_len)]}

    tokens = texts.map(tokenize, batched=True, remove_columns=texts.column_names, desc="tokenize")
    chunks = tokens.map(group, batched=True, desc=f"chunks of {seq_len}")
    if max_chunks is not None and len(chunks) > max_chunks:
        chunks = chunks.select(range(max_chunks))
    return chunks


def split_holdout(n_chunks: int, fraction: float) -> tuple[list[int], list[int]]:
    """Training and held-out chunk indices: the last ``fraction`` of the chunks (at least one) are
    held out, so evaluation reads text the heads never saw."""
    held = max(1, round(n_chunks * fraction))
    if n_chunks - held < 1:
        raise UsageError(f"--holdout {fraction} of {n_chunks} chunk(s) leaves no training chunk (more text, a shorter --seq-len or a smaller --holdout)")
    return list(range(n_chunks - held)), list(range(n_chunks - held, n_chunks))


def draw_positions(seq_len: int, count: int, geo: Geometry, generator: torch.Generator) -> tuple[Tensor, int]:
    """``(positions int64[P], offset)`` of one chunk: ``count`` query positions drawn uniformly
    without replacement among those with at least `MIN_BLOCKS` blocks of context (earlier ones have
    almost nothing to choose), sorted; and the chunk's slot offset, uniform in ``[0, block)``."""
    first = MIN_BLOCKS * geo.block - 1
    pool = torch.arange(first, seq_len)
    take = torch.randperm(len(pool), generator=generator)[: min(count, len(pool))]
    offset = int(torch.randint(geo.block, (), generator=generator))
    return pool[take].sort().values, offset


# --------------------------------------------------------------------------------- capture
@dataclass
class Capture:
    """The frozen model's internals on one chunk of ``T`` tokens (fp32, CPU)."""

    hidden: Tensor  # [L, T, d]: the hidden state entering each layer
    queries: Tensor  # [L, H, T, D]: after RoPE (and any q norm)
    keys: Tensor  # [L, H_kv, T, D]: after RoPE (and any k norm)
    rotary: tuple[Tensor, Tensor] | None  # (cos, sin) [T, D_rot]: what the layers receive
    scales: list[float]  # each layer's softmax scale


_STASH: list[dict] = []  # the records of the capture in progress (a stack: empty outside `capture`)


def capture_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
    scaling: float | None = None, dropout: float = 0.0, **kwargs: Any,
) -> tuple[Tensor, None]:  # fmt: skip
    """An attention function (`AttentionInterface`) that keeps the layer's post-RoPE query and key
    and attends as SDPA does. The chunk is one unpadded causal sequence, so the causal flag is the
    whole mask (transformers builds none for an implementation it does not know)."""
    if not _STASH:
        raise RuntimeError(f"attention implementation {CAPTURE_ATTENTION!r} only runs inside recipes.forecast.train.capture")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    _STASH[-1][module] = (query.detach(), key.detach(), scale)
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2), None


AttentionInterface.register(CAPTURE_ATTENTION, capture_attention)


@torch.no_grad()
def capture(model: nn.Module, ids: Tensor) -> Capture:
    """Run the frozen model on ``ids [T]`` and keep, per layer, the hidden state entering it (a
    forward pre-hook), its queries and keys (`capture_attention`, selected only for this forward)
    and the rotary embedding the layers receive. Works for any model whose decoder layers take
    ``position_embeddings`` and whose attention calls the registered function (Llama, Mistral, Qwen)."""
    layers, attention = _compat.decoder_layers(model), _compat.attention_modules(model)
    n = len(layers)
    hidden: list[Tensor | None] = [None] * n
    rotary: list = [None]

    def enter(i: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        h = args[0] if args else kwargs["hidden_states"]
        hidden[i] = h[0].float().cpu()
        if i == 0 and kwargs.get("position_embeddings") is not None:
            cos, sin = kwargs["position_embeddings"]
            rotary[0] = (cos[0].float().cpu(), sin[0].float().cpu())

    hooks = [layer.register_forward_pre_hook(partial(enter, i), with_kwargs=True) for i, layer in enumerate(layers)]
    _STASH.append({})
    try:
        device = next(model.parameters()).device
        with _compat.attn_implementation(model, CAPTURE_ATTENTION):
            model(input_ids=ids[None].to(device), use_cache=False, logits_to_keep=1)
    finally:
        records = _STASH.pop()
        for hook in hooks:
            hook.remove()
    missing = [i for i, a in enumerate(attention) if a not in records]
    if missing or any(h is None for h in hidden):
        raise RuntimeError(f"capture: layers {missing or '?'} did not call the attention function (an unsupported model?)")
    queries = torch.stack([records[a][0][0].float().cpu() for a in attention])
    keys = torch.stack([records[a][1][0].float().cpu() for a in attention])
    return Capture(torch.stack(hidden), queries, keys, rotary[0], [float(records[a][2]) for a in attention])


# --------------------------------------------------------------------------------- teacher
def candidate_blocks(positions: Tensor, n_blocks: int, geo: Geometry, offset: int = 0) -> Tensor:
    """``bool[P, NB]``: the blocks the policy may choose for the query at each position, i.e. the
    visible blocks that are not forced. `Forecast.choose` always keeps the block holding the first
    ``sinks`` tokens and the blocks touching the last ``window`` ones (the query's own block too),
    so they carry no training signal. Slot frame: token ``j`` is slot ``offset + j``, the cache's
    first visible slot is ``offset`` and its length ``offset + t + 1``, as at inference."""
    length = offset + positions[:, None] + 1
    lo = torch.arange(n_blocks) * geo.block
    first = lo.clamp(min=offset)[None, :]
    last = torch.minimum(lo[None, :] + geo.block, length)
    visible = first < last
    forced = (first < offset + geo.sinks) | (last > length - max(geo.window, 1))
    return visible & ~forced


def teacher_block_mass(queries: Tensor, keys: Tensor, positions: Tensor, scale: float, block: int, offset: int = 0) -> Tensor:
    """``[P, H_kv, NB]``: where each GQA group's attention at each position goes, per block.

    ``queries [H, P, D]`` are the layer's queries at ``positions``, ``keys [H_kv, T, D]`` its keys
    (both after RoPE). Window ``j`` is the mean of keys ``j`` and ``j + 1`` (the finer (2, 1)
    compression: twice the policy's resolution, so the target is close to token-level attention);
    a query at ``t`` sees the windows that end at or before ``t``. Each query head's softmax over its
    windows is summed over its group and divided by the group size, and window ``j``'s mass goes to
    the block holding token ``j`` (slot ``offset + j``). Rows sum to 1 over all blocks.
    """
    h, p, d = queries.shape
    h_kv, t, _ = keys.shape
    keys = keys.float()
    windows = (keys[:, :-1] + keys[:, 1:]) / 2  # [H_kv, T-1, D]
    q = queries.float().reshape(h_kv, h // h_kv, p, d)
    logits = torch.einsum("kgpd,kwd->kgpw", q, windows) * scale
    seen = torch.arange(1, t)[None, :] <= positions[:, None]  # window j ends at token j + 1
    probs = logits.masked_fill(~seen, -torch.inf).softmax(-1).mean(1)  # [H_kv, P, T-1]
    n_blocks = -(-(offset + t) // block)
    owner = (offset + torch.arange(t - 1)) // block
    mass = probs.new_zeros(h_kv, p, n_blocks).index_add_(-1, owner, probs)
    return mass.transpose(0, 1)


def teacher_distribution(queries: Tensor, keys: Tensor, positions: Tensor, scale: float, geo: Geometry, offset: int = 0) -> Tensor:
    """``[P, H_kv, NB]``: `teacher_block_mass` restricted to the candidate blocks
    (`candidate_blocks`) and renormalised there (zero elsewhere)."""
    mass = teacher_block_mass(queries, keys, positions, scale, geo.block, offset)
    cand = candidate_blocks(positions, mass.shape[-1], geo, offset)[:, None, :]
    mass = mass * cand
    return mass / mass.sum(-1, keepdim=True).clamp(min=1e-30)


# --------------------------------------------------------------------------------- student
def slot_page_means(keys: Tensor, offset: int, stride: int) -> tuple[Tensor, Tensor]:
    """``(means [L, H_kv, pages, D], counts int64[pages])`` of a chunk's keys ``[L, H_kv, T, D]``
    laid out from slot ``offset``: `page_means` over the visible slots, as `Forecast.prefill` makes
    them from the cache (the first page holds ``offset`` invisible slots)."""
    n_layers, h_kv, t, d = keys.shape
    pages = -(-(offset + t) // stride)
    slots = F.pad(keys.float(), (0, 0, offset, pages * stride - offset - t))
    valid = torch.zeros(pages * stride, dtype=torch.bool)
    valid[offset : offset + t] = True
    means = page_means(slots, valid[None].expand(n_layers, -1), stride)
    return means, valid.view(pages, stride).sum(-1)


def student_scores(queries: Tensor, rotary: tuple[Tensor, Tensor] | None, means: Tensor, counts: Tensor, scales: Tensor, geo: Geometry) -> Tensor:
    """``[L, P, H_kv, NB]``: the block scores `Forecast.scores` computes at inference (divided by
    the hidden state's RMS, which decoding leaves out), for every layer and position at once: the
    heads' queries ``[L, P, H_kv, D]`` (before RoPE) rotated with
    the positions' ``rotary [P, D_rot]``, scored against the layer's page means ``[L, H_kv, pages,
    D]`` times ``scales [L]`` (the softmax scale the selecting layer's state holds), windows and
    blocks by `block_scores` with the pages' visible ``counts``."""
    n_layers, p, h_kv, d = queries.shape
    rot = None if rotary is None else tuple(x.to(queries.device).repeat(n_layers, 1) for x in rotary)
    f = rotate(queries.float().flatten(0, 1), rot).unflatten(0, (n_layers, p))
    page_scores = torch.einsum("lphd,lhnd->lphn", f, means.float()) * scales.float()[:, None, None, None]
    c = counts[None].expand(n_layers * p, -1)
    return block_scores(page_scores.flatten(0, 1), c, geo.kernel_pages, geo.block_pages).unflatten(0, (n_layers, p))


class LayerQueries(nn.Module):
    """Every head's query in one forward call: the unit accelerate prepares, so a step makes one
    forward (one autocast region, one DDP forward) however many layers there are."""

    def __init__(self, heads: ForecastHeads) -> None:
        super().__init__()
        self.heads = heads

    def forward(self, inputs: Tensor) -> Tensor:
        """``inputs [L, N, d]`` (head ``i``'s input in row ``i``) → ``[L, N, H_kv, D]``."""
        return torch.stack([self.heads(inputs[i], i) for i in range(inputs.shape[0])])


# ------------------------------------------------------------------------------------ loss
def forecast_loss(scores: Tensor, teacher: Tensor, candidates: Tensor, k: int) -> Tensor:
    """KL(teacher ‖ student) over the teacher's top-``k`` candidate blocks plus one bucket for the
    rest of the mass, averaged over every leading index (layers, positions, groups).

    ``scores [..., NB]`` are the student's block scores (its distribution is their softmax over the
    candidates), ``teacher [..., NB]`` the teacher's distribution over the candidates,
    ``candidates`` a bool mask broadcastable to them. The bucket keeps the loss about what the
    policy decides (the few best blocks) without ignoring the mass the student puts elsewhere; where
    there are at most ``k`` candidates it is the full KL. Zero exactly when the two agree on the top
    ``k`` and on the rest's total.
    """
    cand = candidates.expand_as(scores)
    k = min(k, scores.shape[-1])
    s = scores.float().masked_fill(~cand, NEG)
    log_z = torch.logsumexp(s, -1, keepdim=True)
    p = teacher.float() * cand
    top = p.masked_fill(~cand, -1.0).topk(k, dim=-1).indices
    in_top = torch.zeros_like(cand).scatter(-1, top, True)
    p_top = p.gather(-1, top)
    logq_top = s.gather(-1, top) - log_z
    p_rest = (p * (cand & ~in_top)).sum(-1, keepdim=True)
    logq_rest = torch.logsumexp(s.masked_fill(in_top | ~cand, NEG), -1, keepdim=True) - log_z
    p_all, logq = torch.cat([p_top, p_rest], -1), torch.cat([logq_top, logq_rest], -1)
    terms = torch.where(p_all > 0, p_all * (p_all.clamp(min=1e-30).log() - logq), 0.0)
    return terms.sum(-1).mean()


def topk_recall(scores: Tensor, teacher: Tensor, candidates: Tensor, k: int) -> tuple[float, int]:
    """``(sum, count)`` of |student top-k ∩ teacher top-k| / k over the candidate blocks, for the
    (layer, position, group) rows with more than ``k`` candidates (with fewer, any choice recalls
    everything, so they would only dilute the measure)."""
    cand = candidates.expand_as(scores)
    rows = cand.sum(-1) > k
    if k >= scores.shape[-1] or not bool(rows.any()):
        return 0.0, 0
    s = scores.float().masked_fill(~cand, -torch.inf)[rows].topk(k, -1).indices
    t = teacher.float().masked_fill(~cand, -1.0)[rows].topk(k, -1).indices
    hits = (s[:, :, None] == t[:, None, :]).any(-1).sum(-1).float() / k
    return float(hits.sum()), int(rows.sum())


# -------------------------------------------------------------------------------- examples
@dataclass
class Example:
    """What training and evaluation need of one chunk at its sampled positions (CPU tensors):
    small enough to keep in memory across epochs (the model is frozen, so it never changes)."""

    inputs: Tensor  # [L, P, d]: head i's input, the hidden state entering layer max(i - 1, 0)
    rotary: tuple[Tensor, Tensor] | None  # [P, D_rot]
    means: Tensor  # [L, H_kv, pages, D]
    counts: Tensor  # [pages]
    scales: Tensor  # [L]: the selecting layer's softmax scale, as `Forecast.scores` reads it
    teacher: Tensor  # [L, P, H_kv, NB]
    candidates: Tensor  # [P, NB]
    positions: Tensor  # [P]
    offset: int
    oracle: Tensor  # [L, P, H_kv, NB]: block scores of the layer's own queries (`oracle_scores`)

    def nbytes(self) -> int:
        parts = [self.inputs, self.means, self.counts, self.scales, self.teacher, self.candidates, self.positions, self.oracle]
        parts += list(self.rotary or ())
        return sum(t.numel() * t.element_size() for t in parts)


def make_example(model: nn.Module, ids: Tensor, positions: Tensor, offset: int, geo: Geometry) -> Example:
    """Capture the chunk ``ids [T]`` and build its `Example` at ``positions`` with slot ``offset``."""
    cap = capture(model, ids)
    n = cap.hidden.shape[0]
    below = [max(i - 1, 0) for i in range(n)]  # head i reads the hidden state entering layer i - 1
    inputs = cap.hidden[below][:, positions]
    rotary = None if cap.rotary is None else (cap.rotary[0][positions], cap.rotary[1][positions])
    means, counts = slot_page_means(cap.keys, offset, geo.stride)
    teacher = torch.stack([teacher_distribution(cap.queries[i][:, positions], cap.keys[i], positions, cap.scales[i], geo, offset) for i in range(n)])
    candidates = candidate_blocks(positions, teacher.shape[-1], geo, offset)
    scales = torch.tensor([cap.scales[b] for b in below])
    oracle = oracle_scores(cap.queries[:, :, positions], means, counts, scales, geo)
    return Example(inputs, rotary, means, counts, scales, teacher, candidates, positions, offset, oracle)


def oracle_scores(queries: Tensor, means: Tensor, counts: Tensor, scales: Tensor, geo: Geometry) -> Tensor:
    """``[L, P, H_kv, NB]``: the student's scoring fed with each layer's own queries ``[L, H, P, D]``
    (after RoPE, averaged over each GQA group) instead of a head's forecast: what a perfect
    forecast of the group's query would score with the policy's page means and blocks, the
    reference the heads' recall is read against (not a strict bound: a head trained on the teacher
    may rank better than the group's mean query)."""
    n_layers, h, p, d = queries.shape
    h_kv = means.shape[1]
    grouped = queries.reshape(n_layers, h_kv, h // h_kv, p, d).mean(2).permute(0, 2, 1, 3)  # [L, P, H_kv, D]
    return student_scores(grouped, None, means, counts, scales, geo)


class ExampleStore:
    """Examples by chunk index, kept in memory up to ``max_bytes`` and rebuilt (the same positions
    and offset: they are drawn from the chunk's own seed) when they did not fit."""

    def __init__(self, model: nn.Module, chunks: Any, args: argparse.Namespace, geo: Geometry, max_bytes: int) -> None:
        self.model, self.chunks, self.args, self.geo, self.max_bytes = model, chunks, args, geo, max_bytes
        self.kept: dict[int, Example] = {}
        self.bytes = 0
        self.built = 0
        self.build_s = 0.0

    def __getitem__(self, index: int) -> Example:
        if index in self.kept:
            return self.kept[index]
        start = time.perf_counter()
        g = torch.Generator().manual_seed(self.args.seed * 1_000_003 + index)
        ids = torch.tensor(self.chunks[index]["input_ids"], dtype=torch.long)
        positions, offset = draw_positions(len(ids), self.args.positions, self.geo, g)
        example = make_example(self.model, ids, positions, offset, self.geo)
        self.built += 1
        self.build_s += time.perf_counter() - start
        if self.bytes + example.nbytes() <= self.max_bytes:
            self.kept[index] = example
            self.bytes += example.nbytes()
        return example


# ------------------------------------------------------------------------------- training
def batch_loss(queries_of: nn.Module, examples: Sequence[Example], geo: Geometry, k: int, device: torch.device) -> Tensor:
    """The mean `forecast_loss` of ``examples`` under the heads ``queries_of`` (a `LayerQueries`,
    maybe wrapped by accelerate): one forward for all their positions, then each chunk's scoring."""
    inputs = torch.cat([e.inputs for e in examples], dim=1).to(device)
    queries = queries_of(inputs)
    losses = []
    for e, q in zip(examples, queries.split([e.inputs.shape[1] for e in examples], dim=1)):
        scores = student_scores(q, e.rotary, e.means.to(device), e.counts.to(device), e.scales.to(device), geo)
        losses.append(forecast_loss(scores, e.teacher.to(device), e.candidates.to(device)[None, :, None, :], k))
    return torch.stack(losses).mean()


def chunk_order(indices: Sequence[int], seed: int, rank: int = 0, world: int = 1) -> Iterator[int]:
    """Training chunks forever, reshuffled every epoch; each process takes its own share."""
    epoch = 0
    while True:
        g = torch.Generator().manual_seed(seed + 7919 * epoch)
        order = [indices[i] for i in torch.randperm(len(indices), generator=g).tolist()]
        yield from order[rank::world] or order[:1]
        epoch += 1


def train(
    queries_of: nn.Module, optimizer: torch.optim.Optimizer, accelerator: Any, store: ExampleStore,
    train_indices: Sequence[int], args: argparse.Namespace, geo: Geometry, checkpoint: Any,
) -> list[float]:  # fmt: skip
    """The loop: ``--steps`` AdamW steps of ``--batch`` chunks each, a progress bar with the loss,
    ``checkpoint(step, history)`` every ``--save-every`` steps. Returns the loss of every step."""
    from tqdm.auto import tqdm

    history: list[float] = []
    order = chunk_order(train_indices, args.seed, accelerator.process_index, accelerator.num_processes)
    queries_of.train()
    bar = tqdm(range(1, args.steps + 1), desc="train", disable=args.no_progress or not accelerator.is_main_process, file=sys.stderr)
    for step in bar:
        examples = [store[next(order)] for _ in range(args.batch)]
        loss = batch_loss(queries_of, examples, geo, args.topk_blocks, accelerator.device)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        history.append(float(loss.detach()))
        recent = history[-20:]
        bar.set_postfix(loss=f"{sum(recent) / len(recent):.4f}", cached=len(store.kept))
        if step % args.save_every == 0 and step < args.steps:
            checkpoint(step, history)
    return history


# ----------------------------------------------------------------------------- evaluation
def recall_ks(topk: int) -> list[int]:
    """The k at which recall is reported: powers of two up to ``--topk-blocks``, and it (the policy
    keeps a handful of blocks at the usual budgets, so the small k matter most)."""
    ks = [k for k in (1, 2, 4, 8, 16, 32, 64) if k < topk]
    return ks + [topk]


@torch.no_grad()
def evaluate_heads(heads: ForecastHeads | None, examples: Sequence[Example], geo: Geometry, topk: int, device: torch.device) -> dict[str, Any]:
    """Held-out loss and recall of the teacher's top blocks by ``heads`` (``None``: by the layers'
    own queries, `oracle_scores`): ``recall_at[k]`` is the mean over (layer, position, group) rows
    with more than k candidates (None if there are none), ``rows_at[k]`` how many; ``recall`` is at
    ``--topk-blocks`` or, when no row has that many candidates (short chunks), at the largest k that
    has rows (``recall_k``)."""
    queries_of = None if heads is None else LayerQueries(heads).to(device).eval()
    ks = recall_ks(topk)
    sums, counts, losses = dict.fromkeys(ks, 0.0), dict.fromkeys(ks, 0), []
    for e in examples:
        if queries_of is None:
            scores = e.oracle
        else:
            q = queries_of(e.inputs.to(device))
            scores = student_scores(q, e.rotary, e.means.to(device), e.counts.to(device), e.scales.to(device), geo).cpu()
        cand = e.candidates[None, :, None, :]
        losses.append(float(forecast_loss(scores, e.teacher, cand, topk)))
        for k in ks:
            s, c = topk_recall(scores, e.teacher, cand, k)
            sums[k] += s
            counts[k] += c
    recall_at = {k: (sums[k] / counts[k] if counts[k] else None) for k in ks}
    defined = [k for k in ks if recall_at[k] is not None]
    head_k = topk if recall_at[topk] is not None else (defined[-1] if defined else None)
    return {
        "loss": sum(losses) / len(losses),
        "recall": recall_at[head_k] if head_k is not None else None,
        "recall_k": head_k,
        "recall_at": {str(k): v for k, v in recall_at.items()},
        "rows_at": {str(k): counts[k] for k in ks},
    }


def task_eval(model: nn.Module, tokenizer: Any, files: dict[str, Path], args: argparse.Namespace) -> list[dict]:
    """Passkey accuracy and perplexity through the library's harness (`policyzoo.eval`), dense and
    ``Forecast(--eval-keep, heads=FILE)`` for each named heads file, on the embedded essays."""
    from policyzoo.eval import tasks
    from policyzoo.eval.runner import evaluate
    from policyzoo.eval.settings import make_settings

    specs = {"dense": "dense"}
    specs.update({name: f"forecast:{args.eval_keep},heads={path}" for name, path in files.items()})
    data = tasks.build(tokenizer, ["passkey", "ppl"], args.eval_lengths, args.placements, seed=args.seed)
    settings = make_settings(list(specs.values()), ["none"])
    names = {s.label: name for s, name in zip(settings, specs)}
    results = evaluate(model, tokenizer, settings, data, progress=not args.no_progress)
    keep = ("n", "accuracy", "ppl", "dense_ppl", "ppl_increase_rel", "delta_mean", "kv_keep", "recall")
    return [{"setting": names[r["setting"]], "spec": r["setting"], "task": r["task"], "length": r["length"], **{k: r.get(k) for k in keep}} for r in results["rows"]]


def format_tasks(rows: Sequence[dict]) -> str:
    """The task results as a small table: one line per setting and length."""

    def num(x: Any, fmt: str) -> str:
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)

    table: dict[tuple[str, int], dict] = {}
    for r in rows:
        cell = table.setdefault((r["setting"], r["length"]), {})
        if r["task"] == "passkey":
            cell["passkey"] = r["accuracy"]
        else:
            cell.update(ppl=r["ppl"], dense_ppl=r["dense_ppl"], rel=r["ppl_increase_rel"], keep=r["kv_keep"])
    lines = [f"{'setting':<18} {'length':>6} {'passkey':>8} {'ppl':>8} {'vs dense':>9} {'kv keep':>8}"]
    for (setting, length), c in table.items():
        rel = None if c.get("rel") is None else 100 * c["rel"]
        lines.append(f"{setting:<18} {length:>6} {num(c.get('passkey'), '.2f'):>8} {num(c.get('ppl'), '.3f'):>8} {num(rel, '+.2f') + '%':>9} {num(c.get('keep'), '.3f'):>8}")
    return "\n".join(lines)


# --------------------------------------------------------------------------------- outputs
def save_heads(heads: ForecastHeads, path: Path, budget: float) -> Path:
    """The heads as a Forecast policy file (`Forecast.save`: the format `Forecast(heads=PATH)`,
    `Forecast.load` and the ``forecast:...,heads=PATH`` spec read)."""
    return Forecast(budget, heads=heads, rank=heads.rank).save(path)


def plot_loss(history: Sequence[float], title: str, path: Path) -> Path:
    """``loss.png``: the loss of every step and its running mean over 20 steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(1, len(history) + 1)
    run = [sum(history[max(0, i - 19) : i + 1]) / len(history[max(0, i - 19) : i + 1]) for i in range(len(history))]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, history, color="tab:blue", alpha=0.3, lw=0.8, label="step")
    ax.plot(steps, run, color="tab:blue", lw=1.6, label="mean of 20")
    ax.set_xlabel("step")
    ax.set_ylabel("KL(teacher ‖ student), top-k + rest")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def recall_title(model: str, evaluation: dict) -> str:
    """The plot's title: held-out recall@1 and at the headline k, untrained → trained (oracle)."""
    parts = []
    for k in dict.fromkeys(["1", str(evaluation["init"]["recall_k"])]):
        values = [evaluation[h]["recall_at"].get(k) for h in ("init", "trained", "oracle")]
        if None not in values:
            parts.append(f"@{k} {values[0]:.3f} → {values[1]:.3f} (oracle {values[2]:.3f})")
    return f"Forecast heads, {model}: held-out recall " + ", ".join(parts or ["n/a"])


def write_metrics(path: Path, metrics: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(metrics, f, indent=1)
        f.write("\n")


# ------------------------------------------------------------------------------------ setup
def initial_heads(model: nn.Module, init: str | None, rank: int | None) -> ForecastHeads:
    """The heads training starts from: a heads file (``--init``), checked against the model, or the
    model's own query projections at ``--rank`` (`ForecastHeads.from_model`)."""
    if init is None:
        return ForecastHeads.from_model(model, rank)
    try:
        policy = Forecast.load(init)
    except Exception as e:  # a missing file, another policy's, or not safetensors at all
        raise UsageError(f"--init {init}: not a Forecast heads file ({e})") from None
    try:
        policy.attach(model)
    except ValueError as e:
        raise UsageError(f"--init {init}: {e}") from None
    return policy.predictor.float()


def check_args(args: argparse.Namespace, geo: Geometry = DEFAULT_GEOMETRY) -> None:
    """What argparse's types cannot say alone, each error naming its option."""
    if args.seq_len < MIN_BLOCKS * geo.block:
        raise UsageError(f"--seq-len must be at least {MIN_BLOCKS} blocks ({MIN_BLOCKS * geo.block} tokens): query positions start {MIN_BLOCKS} blocks in; got {args.seq_len}")
    if not 0.0 < args.holdout < 1.0:
        raise UsageError(f"--holdout must be a fraction in (0, 1), got {args.holdout}")
    if not args.lr > 0:
        raise UsageError(f"--lr must be positive, got {args.lr}")
    if args.weight_decay < 0:
        raise UsageError(f"--weight-decay must be non-negative, got {args.weight_decay}")
    if not 0.0 < args.eval_keep <= 1.0:
        raise UsageError(f"--eval-keep must be a keep ratio in (0, 1], got {args.eval_keep}")
    if args.cache_mb < 0:
        raise UsageError(f"--cache-mb must be non-negative, got {args.cache_mb}")
    if args.init is not None and not Path(args.init).is_file():
        raise UsageError(f"--init {args.init}: no such file")
    if not args.no_task_eval and any(c in str(args.out) for c in " \t,[]"):
        raise UsageError(f"--out {args.out!r}: the task evaluation names the heads file in a policy spec, which cannot hold spaces, commas or brackets")


def _fraction(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None


def _lengths(text: str) -> list[int]:
    from policyzoo.eval.cli import parse_length

    values = [parse_length(t) for t in text.split(",") if t.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"no lengths in {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m recipes.forecast.train",
        description="Fine-tune Forecast's heads (policyzoo.kv.Forecast) against the next layer's attention over blocks, the model frozen.",
    )
    data = p.add_argument_group("model and data")
    data.add_argument("--model", default=assets.DEFAULT_MODEL, help=f"model for policyzoo.assets.load_model: {assets.DEFAULT_MODEL!r} (embedded, default), a Hub name or a path")
    data.add_argument("--dataset", default=None, help="a dataset for datasets.load_dataset (default: the embedded essays)")
    data.add_argument("--dataset-config", default=None, help="the dataset's configuration name")
    data.add_argument("--split", default="train", help="the dataset split, slices allowed, e.g. 'train[:2%%]' (default train)")
    data.add_argument("--text-column", default="text", help="the column holding the text (default text)")
    data.add_argument("--seq-len", type=positive_int, default=1024, help="tokens per chunk (default 1024; at least 4 blocks)")
    data.add_argument("--max-chunks", type=positive_int, default=None, help="use only the first N chunks (default: all)")
    data.add_argument("--holdout", type=_fraction, default=0.1, help="fraction of the chunks (the last ones, at least one) held out for evaluation (default 0.1)")
    data.add_argument("--positions", type=positive_int, default=64, help="query positions sampled per chunk (default 64)")
    train_ = p.add_argument_group("training")
    train_.add_argument("--steps", type=positive_int, default=2000, help="optimizer steps (default 2000)")
    train_.add_argument("--batch", type=positive_int, default=1, help="chunks per step (default 1)")
    train_.add_argument("--lr", type=_fraction, default=5e-4, help="AdamW learning rate (default 5e-4)")
    train_.add_argument("--weight-decay", type=_fraction, default=0.0, help="AdamW weight decay (default 0)")
    train_.add_argument("--rank", type=positive_int, default=None, help="rank of new heads (default: Forecast's, policyzoo.kv.forecast.default_rank: 16 on SmolLM2-135M)")
    train_.add_argument("--init", default=None, help="start from this heads file (Forecast.save / an earlier run) instead of the model's query projections")
    train_.add_argument("--topk-blocks", type=positive_int, default=16, help="k of the loss's top-k + rest buckets and of the recall (default 16)")
    train_.add_argument("--mixed-precision", choices=("no", "bf16", "fp16"), default="no", help="accelerate's mixed precision for the heads (default no)")
    train_.add_argument("--cache-mb", type=_fraction, default=2048, help="memory for chunk captures kept across epochs, in MB (default 2048; the rest are recaptured)")
    train_.add_argument("--seed", type=int, default=0, help="seed of the positions, offsets, chunk order and tasks (default 0)")
    train_.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's)")
    out = p.add_argument_group("outputs and evaluation")
    out.add_argument("--out", default="runs/forecast", help="output folder (default runs/forecast)")
    out.add_argument("--save-every", type=positive_int, default=500, help="checkpoint every N steps (default 500)")
    out.add_argument("--no-task-eval", action="store_true", help="skip the passkey / perplexity evaluation")
    out.add_argument("--eval-lengths", type=_lengths, default=[1024, 2048, 3072], help="task lengths, comma-separated, K = 1024 (default 1024,2048,3072)")
    out.add_argument("--eval-keep", type=_fraction, default=0.1, help="Forecast's budget (keep ratio) in the task evaluation and in the saved files (default 0.1)")
    out.add_argument("--placements", type=positive_int, default=4, help="needle depths (and perplexity windows) per length (default 4)")
    out.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


# ------------------------------------------------------------------------------------- main
def run(args: argparse.Namespace, model: nn.Module | None = None, tokenizer: Any = None) -> dict[str, Any]:
    """The whole recipe (``model`` / ``tokenizer``: already loaded, else ``--model`` is loaded).
    Returns the metrics it writes to ``metrics.json``."""
    from accelerate import Accelerator

    geo = DEFAULT_GEOMETRY
    check_args(args, geo)
    t_start = time.perf_counter()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    try:
        accelerator = Accelerator(mixed_precision=args.mixed_precision)
    except (ValueError, RuntimeError) as e:
        raise UsageError(f"--mixed-precision {args.mixed_precision}: {e}") from None
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if model is None:
        model, tokenizer = assets.load_model(args.model)
    _compat.check_supported(model)
    window = _compat.sliding_window(model)
    if window is not None and args.seq_len > window:
        raise UsageError(f"--seq-len {args.seq_len} exceeds the model's sliding window ({window}): the capture attends causally over the whole chunk")
    model.eval().requires_grad_(False)
    if not hasattr(model, "hf_device_map"):
        model.to(accelerator.device)

    texts = load_texts(args.dataset, args.dataset_config, args.split, args.text_column)
    chunks = make_chunks(texts, tokenizer, args.text_column, args.seq_len, args.max_chunks)
    if len(chunks) < 2:
        raise UsageError(f"--seq-len {args.seq_len}: the text makes {len(chunks)} chunk(s); training and evaluation need at least 2")
    train_idx, held_idx = split_holdout(len(chunks), args.holdout)
    store = ExampleStore(model, chunks, args, geo, int(args.cache_mb * 2**20))

    heads = initial_heads(model, args.init, args.rank)
    initial = copy.deepcopy(heads).cpu()
    if accelerator.is_main_process:
        save_heads(initial, out / "checkpoint-0.safetensors", args.eval_keep)
    queries_of = LayerQueries(heads.float())
    optimizer = torch.optim.AdamW(queries_of.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    queries_of, optimizer = accelerator.prepare(queries_of, optimizer)

    metrics: dict[str, Any] = {
        "args": {k: v for k, v in vars(args).items()},
        "model": args.model,
        "chunks": {"train": len(train_idx), "held_out": len(held_idx), "seq_len": args.seq_len},
        "heads": {"rank": heads.rank, "layers": heads.num_layers, "parameters": sum(p.numel() for p in heads.parameters())},
        "geometry": asdict(geo),
    }

    def trained_heads() -> ForecastHeads:
        return accelerator.unwrap_model(queries_of).heads

    def checkpoint(step: int, history: list[float]) -> None:
        if accelerator.is_main_process:
            save_heads(trained_heads(), out / f"checkpoint-{step}.safetensors", args.eval_keep)
            write_metrics(out / "metrics.json", {**metrics, "loss": history, "step": step})

    t_train = time.perf_counter()
    history = train(queries_of, optimizer, accelerator, store, train_idx, args, geo, checkpoint)
    train_s = time.perf_counter() - t_train
    accelerator.wait_for_everyone()
    metrics["loss"] = history
    metrics["timing"] = {
        "train_s": round(train_s, 1),
        "step_s": round(train_s / len(history), 3),
        "captures": store.built,
        "capture_s": round(store.build_s, 1),
        "step_s_without_captures": round((train_s - store.build_s) / len(history), 4),
        "cached_chunks": len(store.kept),
        "cache_mb": round(store.bytes / 2**20, 1),
    }
    if not accelerator.is_main_process:
        return metrics

    final = trained_heads()
    save_heads(final, out / f"checkpoint-{args.steps}.safetensors", args.eval_keep)
    heads_file = save_heads(final, out / "heads.safetensors", args.eval_keep)

    t_held = time.perf_counter()
    held = [store[i] for i in held_idx]
    device = accelerator.device
    metrics["timing"]["held_out_capture_s"] = round(time.perf_counter() - t_held, 1)
    metrics["eval"] = {
        "init": evaluate_heads(initial, held, geo, args.topk_blocks, device),
        "trained": evaluate_heads(copy.deepcopy(final).float(), held, geo, args.topk_blocks, device),
        "oracle": evaluate_heads(None, held, geo, args.topk_blocks, device),
        "positions": sum(len(e.positions) for e in held),
    }
    init_eval, trained_eval = metrics["eval"]["init"], metrics["eval"]["trained"]
    print(f"held-out ({len(held)} chunks, {metrics['eval']['positions']} positions; oracle: the layers' own queries):")
    print(f"  {'heads':<8} {'loss':>8} " + " ".join(f"{'recall@' + k:>10}" for k in init_eval["recall_at"]))
    for name, e in (("init", init_eval), ("trained", trained_eval), ("oracle", metrics["eval"]["oracle"])):
        cells = " ".join(f"{'-' if v is None else format(v, '.4f'):>10}" for v in e["recall_at"].values())
        print(f"  {name:<8} {e['loss']:>8.4f} {cells}")

    if not args.no_task_eval:
        t_eval = time.perf_counter()
        rows = task_eval(model, tokenizer, {"forecast init": out / "checkpoint-0.safetensors", "forecast trained": heads_file}, args)
        metrics["tasks"] = rows
        metrics["timing"]["task_eval_s"] = round(time.perf_counter() - t_eval, 1)
        print(format_tasks(rows))
    metrics["timing"]["total_s"] = round(time.perf_counter() - t_start, 1)
    plot_loss(history, recall_title(args.model, metrics["eval"]), out / "loss.png")
    write_metrics(out / "metrics.json", metrics)
    print(f"wrote {heads_file}, {out / 'metrics.json'}, {out / 'loss.png'} ({metrics['timing']['total_s']:.0f} s)")
    return metrics


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        run(args)
    except UsageError as e:
        parser.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
