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

The pieces live beside this file, one job each: ``geometry`` (the policy's block layout), ``data``
(text, chunks, positions), ``capture`` (the frozen model's forward), ``objective`` (teacher,
student, loss, oracle), ``examples`` (what a chunk keeps, and their store), ``evaluate`` (held-out
recall, task evaluation) and ``errors`` (`UsageError`); this module trains, writes the outputs and
holds the command line.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor, nn

from policyzoo import _compat, assets
from policyzoo.argtypes import positive_int
from policyzoo.kv.forecast import Forecast, ForecastHeads

from .data import MIN_BLOCKS, MIN_QUERY_BLOCKS, load_texts, make_chunks, split_holdout
from .errors import UsageError
from .evaluate import evaluate_heads, format_tasks, task_eval
from .examples import Example, ExampleStore
from .geometry import DEFAULT_GEOMETRY, Geometry
from .objective import LayerQueries, forecast_loss, student_scores


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


# --------------------------------------------------------------------------------- outputs
def save_heads(heads: ForecastHeads, path: Path, budget: float, geo: Geometry = DEFAULT_GEOMETRY) -> Path:
    """The heads as a Forecast policy file of the geometry they were trained for (`Forecast.save`:
    the format `Forecast(heads=PATH)`, `Forecast.load` and the ``forecast:...,heads=PATH`` spec read)."""
    return Forecast(budget, heads=heads, rank=heads.rank, **asdict(geo)).save(path)


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
    least = (MIN_BLOCKS + MIN_QUERY_BLOCKS) * geo.block
    if args.seq_len < least:
        raise UsageError(f"--seq-len must be at least {MIN_BLOCKS + MIN_QUERY_BLOCKS} blocks ({least} tokens): query positions start "
                         f"{MIN_BLOCKS} blocks in, and {MIN_QUERY_BLOCKS} blocks of them are the fewest that train; got {args.seq_len}")
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


def _geometry(text: str) -> Geometry:
    """``--geometry``: ``name=tokens`` pairs over Forecast's defaults, checked by `Forecast` itself."""
    params: dict[str, int] = {}
    names = [f.name for f in fields(Geometry)]
    for item in filter(None, text.split(",")):
        name, eq, value = item.partition("=")
        if not eq or name not in names:
            raise argparse.ArgumentTypeError(f"expected name=tokens with a name of {', '.join(names)}, got {item!r}")
        try:
            params[name] = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be a whole number of tokens, got {value!r}") from None
    try:
        return Geometry.of(Forecast(**params))
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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
    data.add_argument("--geometry", type=_geometry, default=DEFAULT_GEOMETRY,
                      help="the Forecast block geometry the heads are for, as policy parameters, e.g. "
                           "'block=16,sinks=16,window=16' (block, kernel, stride, sinks, window in tokens; default Forecast's)")
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

    geo = args.geometry
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
        save_heads(initial, out / "checkpoint-0.safetensors", args.eval_keep, geo)
    queries_of = LayerQueries(heads.float())
    optimizer = torch.optim.AdamW(queries_of.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    queries_of, optimizer = accelerator.prepare(queries_of, optimizer)

    metrics: dict[str, Any] = {
        "args": {k: asdict(v) if isinstance(v, Geometry) else v for k, v in vars(args).items()},
        "model": args.model,
        "chunks": {"train": len(train_idx), "held_out": len(held_idx), "seq_len": args.seq_len},
        "heads": {"rank": heads.rank, "layers": heads.num_layers, "parameters": sum(p.numel() for p in heads.parameters())},
        "geometry": asdict(geo),
    }

    def trained_heads() -> ForecastHeads:
        return accelerator.unwrap_model(queries_of).heads

    def checkpoint(step: int, history: list[float]) -> None:
        if accelerator.is_main_process:
            save_heads(trained_heads(), out / f"checkpoint-{step}.safetensors", args.eval_keep, geo)
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
    save_heads(final, out / f"checkpoint-{args.steps}.safetensors", args.eval_keep, geo)
    heads_file = save_heads(final, out / "heads.safetensors", args.eval_keep, geo)

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
        rows = task_eval(model, tokenizer, {"forecast init": out / "checkpoint-0.safetensors", "forecast trained": heads_file}, args,
                         geo)
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
