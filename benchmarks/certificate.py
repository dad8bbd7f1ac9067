"""How tight the page certificate is on a real model, and why (CPU, the embedded model).

Two measurements on passkey prompts (the essays, needle depths spread over the haystack):

1. **δ against its certified bound.** Each KV setting decodes a few tokens with the audit on; every
   (layer, step, KV head) gives the true dropped mass δ and the certificate ``U/(Z_S+U)``
   (`kv.certified`), as `policyzoo eval` records them. Plotted as a scatter, with the mean bound
   where δ < 0.05.
2. **The overshoot of page bounds.** At the first decode step of each layer, per query head and
   page, ``u_p − max_t z_t`` in nats (logits ``z = scale·q·k``): how far a page's bound sits above
   its best key. The certificate multiplies every unselected token's mass by up to ``e^{overshoot}``,
   so it is informative only when the overshoot is small. Kinds, each a valid upper bound:
   ``box`` (Quest's per-channel min/max, what the cache keeps), ``ball`` (centroid plus radius:
   ``q·c + |q|·r``), ``pca-box8+ball`` (a per-head PCA rotation from the prompt's keys, a box on the
   top 8 directions and a ball on the rest), and ``box`` on pages of 8. And a bound that needs an
   earlier exact score (``drift``): a page's exact best logit for the query ``lag`` decode steps
   earlier, plus the box bound of the query's change since, ``m_p(q0) + scale·max_t (q−q0)·k_t`` (what
   a policy that reuses a selection, and rescored it exactly when it made it, could certify).

Run:

    python -m benchmarks.certificate --kv quest:0.1 quest:0.1,rescore=3 quest:0.3 \\
        --out benchmarks/results/smollm2-certificate
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from torch import Tensor

from policyzoo import Decoder
from policyzoo.assets import load_model, passkey_prompt
from policyzoo.kernels import reference
from policyzoo.kv import AttentionTopK, KVState
from policyzoo.selection import Selection
from policyzoo.spec import parse_kv


class KeyProbe(AttentionTopK):
    """Dense decoding (a full token budget) that keeps, per layer, the first decode step's visible
    keys and every step's query for the overshoot analysis."""

    def __init__(self) -> None:
        super().__init__(budget=1.0)
        self.seen: dict[int, tuple[Tensor, Tensor, float]] = {}
        self.queries: dict[int, list[Tensor]] = {}

    def select(self, state: KVState, q: Tensor) -> Selection:
        if state.layer not in self.seen:
            c = state.cache
            start, length = int(c.start[0]), int(c.length)
            self.seen[state.layer] = (q[0].detach().double(), state.keys[0, :, start:length].detach().double(), state.scale)
        self.queries.setdefault(state.layer, []).append(q[0].detach().double())
        return super().select(state, q)


def _pages(keys: Tensor, page: int) -> tuple[Tensor, Tensor]:
    """``keys [H_kv, n, D]`` padded to whole pages ``[H_kv, P, page, D]`` and the validity mask ``[P, page]``."""
    h_kv, n, d = keys.shape
    pad = -n % page
    padded = torch.nn.functional.pad(keys, (0, 0, 0, pad)).view(h_kv, -1, page, d)
    valid = (torch.arange(n + pad) < n).view(-1, page)
    return padded, valid


def overshoot(q: Tensor, keys: Tensor, scale: float, kind: str, page: int = 16) -> Tensor:
    """``u_p − max_t z_t`` per query head and page (nats) for one bound ``kind``."""
    h, d = q.shape
    h_kv = keys.shape[0]
    qg = q.view(h_kv, h // h_kv, d)
    kp, valid = _pages(keys, page)
    vm = valid[None, :, :, None]
    z = torch.einsum("kgd,kpnd->kgpn", qg, kp).masked_fill(~valid, -math.inf) * scale
    best = z.amax(-1)  # [H_kv, G, P]
    count = valid.sum(-1).clamp(min=1)[None, :, None]
    centre = (kp * vm).sum(2) / count  # [H_kv, P, D]
    dev = kp - centre[:, :, None]
    if kind.startswith("pca"):
        rot = _pca(keys)  # [H_kv, D, D], rows: directions by decreasing variance
        dev, qg, centre = (torch.einsum("ked,kpnd->kpne", rot, dev), torch.einsum("ked,kgd->kge", rot, qg),
                           torch.einsum("ked,kpd->kpe", rot, centre))  # fmt: skip
    base = torch.einsum("kgd,kpd->kgp", qg, centre)
    huge = torch.finfo(dev.dtype).max
    if kind == "sketch":
        return (_sketch_page_bound(qg, kp, valid, scale) - best)[:, :, valid.any(-1)]
    if kind == "ball":
        radius = dev.norm(dim=-1).masked_fill(~valid, 0).amax(-1)
        u = base + qg.norm(dim=-1)[..., None] * radius[:, None]
    else:
        split = 8 if kind.startswith("pca") else d
        lo = dev[..., :split].masked_fill(~vm, huge).amin(2)
        hi = dev[..., :split].masked_fill(~vm, -huge).amax(2)
        box = torch.maximum(qg[:, :, None, :split] * lo[:, None], qg[:, :, None, :split] * hi[:, None]).sum(-1)
        radius = dev[..., split:].norm(dim=-1).masked_fill(~valid, 0).amax(-1)
        u = base + box + qg[..., split:].norm(dim=-1)[..., None] * radius[:, None]
    return (u * scale - best)[:, :, valid.any(-1)]


def _sketch_page_bound(qg: Tensor, kp: Tensor, valid: Tensor, scale: float) -> Tensor:
    """``[H_kv, G, P]``: the cache's 4-bit key-sketch bound of each page's best logit (`kernels.reference`)."""
    h_kv, g, d = qg.shape
    n_pages, page = valid.shape
    vm = valid[None, :, :, None]
    huge = torch.finfo(kp.dtype).max
    lo = torch.where(valid.any(-1)[None, :, None], kp.masked_fill(~vm, huge).amin(2), 0.0)[None]  # [1, H_kv, P, D]
    hi = torch.where(valid.any(-1)[None, :, None], kp.masked_fill(~vm, -huge).amax(2), 0.0)[None]
    codes = reference.sketch_encode(kp[None], lo, hi).flatten(2, 3)  # [1, H_kv, P·page, D/2]
    tb = reference.sketch_token_bound(qg.reshape(1, h_kv * g, d), codes, lo, hi, scale)
    return tb.view(h_kv, g, n_pages, page).masked_fill(~valid, -math.inf).amax(-1)


def drift_overshoot(q0: Tensor, q: Tensor, keys: Tensor, scale: float, page: int = 16) -> Tensor:
    """``u_p − max_t z_t`` per query head and page (nats) for the bound from an earlier query ``q0``:
    ``u_p = max_t scale·q0·k_t + scale·(Δ·c_p + Σ_i max(Δ_i·lo_i, Δ_i·hi_i))`` with ``Δ = q − q0``
    and the page's centre ``c_p`` and per-channel deviations ``lo, hi`` (the box of the change)."""
    h, d = q.shape
    h_kv = keys.shape[0]
    kp, valid = _pages(keys, page)
    vm = valid[None, :, :, None]

    def best(query: Tensor) -> Tensor:  # [H_kv, G, P], nats
        z = torch.einsum("kgd,kpnd->kgpn", query.view(h_kv, h // h_kv, d), kp) * scale
        return z.masked_fill(~valid, -math.inf).amax(-1)

    delta = (q - q0).view(h_kv, h // h_kv, d)
    count = valid.sum(-1).clamp(min=1)[None, :, None]
    centre = (kp * vm).sum(2) / count
    dev = kp - centre[:, :, None]
    huge = torch.finfo(dev.dtype).max
    lo, hi = dev.masked_fill(~vm, huge).amin(2), dev.masked_fill(~vm, -huge).amax(2)
    box = torch.maximum(delta[:, :, None] * lo[:, None], delta[:, :, None] * hi[:, None]).sum(-1)
    u = best(q0) + scale * (torch.einsum("kgd,kpd->kgp", delta, centre) + box)
    return (u - best(q))[:, :, valid.any(-1)]


def _pca(keys: Tensor) -> Tensor:
    centred = keys - keys.mean(1, keepdim=True)
    cov = torch.einsum("knd,kne->kde", centred, centred) / keys.shape[1]
    _, vectors = torch.linalg.eigh(cov)
    return vectors.flip(-1).transpose(1, 2)


KINDS = {"box (page 16)": ("box", 16), "ball (page 16)": ("ball", 16), "pca-box8+ball (page 16)": ("pca", 16),
         "box (page 8)": ("box", 8), "4-bit key sketch on the box's grid (page 16)": ("sketch", 16)}
DRIFT_LAGS = (1, 4)  # decode steps between the exact score and the query it bounds



def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kv", nargs="+", required=True, help="page-policy specs (policyzoo.spec)")
    p.add_argument("--lengths", default="1500,3000", help="prompt tokens")
    p.add_argument("--depths", default="0.1,0.35,0.6,0.85", help="needle depths")
    p.add_argument("--steps", type=int, default=4, help="decode steps audited per prompt")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    model, tok = load_model()
    prompts = [passkey_prompt(tok, int(n), float(d), seed=7)[0] for n in args.lengths.split(",") for d in args.depths.split(",")]
    pairs: dict[str, tuple[list[Tensor], list[Tensor]]] = {}
    keeps: dict[str, list[Tensor]] = {}
    reuses: dict[str, list[Tensor]] = {}
    for spec in args.kv:
        deltas, bounds = pairs.setdefault(spec, ([], []))
        for ids in prompts:
            dec = Decoder(model, kv=parse_kv(spec))
            dec.generate(ids, args.steps + 1, audit=True)
            audit = dec.last_audit
            deltas.append(audit.per_layer("dropped_mass").flatten())
            bounds.append(audit.per_layer("certified_bound").flatten())
            keeps.setdefault(spec, []).append(audit.per_layer("kv_keep").flatten())
            if audit.reuse_time:  # a PrHS selection: 1.0 where the record reused along time
                reuses.setdefault(spec, []).append(audit.per_layer("reuse_time").flatten())
        print(f"{spec}: {sum(len(d) for d in deltas)} (layer, step, head) records", flush=True)
    over: dict[str, list[Tensor]] = {k: [] for k in KINDS}
    over.update({f"drift: exact {lag} step{'s' if lag > 1 else ''} earlier + box of the change (page 16)": [] for lag in DRIFT_LAGS})
    for ids in prompts:
        probe = KeyProbe()
        Decoder(model, kv=probe).generate(ids, max(DRIFT_LAGS) + 2)  # the prefill's step, then decode steps
        for layer, (q, keys, scale) in probe.seen.items():
            for name, (kind, page) in KINDS.items():
                over[name].append(overshoot(q, keys, scale, kind, page).flatten().float())
            steps = probe.queries[layer]
            for lag in DRIFT_LAGS:  # the step-0 keys bound both queries: later tokens are pages of their own
                name = f"drift: exact {lag} step{'s' if lag > 1 else ''} earlier + box of the change (page 16)"
                over[name].append(drift_overshoot(steps[0], steps[lag], keys, scale).flatten().float())
    rows = []
    for spec, (deltas, bounds) in pairs.items():
        d, b = torch.cat(deltas), torch.cat(bounds)
        small = d < 0.05
        rows.append({"section": "certificate", "setting": spec, "records": len(d), "delta_mean": d.mean().item(),
                     "delta_p99": d.quantile(0.99).item(), "kv_keep_mean": torch.cat(keeps[spec]).mean().item(),
                     "reuse_time": torch.cat(reuses[spec]).mean().item() if spec in reuses else math.nan,
                     "frac_delta_below_0.05": small.float().mean().item(),
                     "bound_mean_where_delta_below_0.05": b[small].mean().item() if small.any() else math.nan,
                     "bound_median": b.median().item(), "bound_ge_delta": (b >= d - 1e-6).float().mean().item()})
    for name, values in over.items():
        o = torch.cat(values)
        rows.append({"section": "overshoot", "setting": name, "mean_nats": o.mean().item(), "median_nats": o.median().item(),
                     "p10_nats": o.quantile(0.1).item(), "min_nats": o.min().item()})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"lengths": args.lengths, "depths": args.depths, "steps": args.steps, "torch": torch.__version__}
    (out / "certificate.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    write_markdown(out / "certificate.md", rows)
    plot(out / "certificate.png", {s: (torch.cat(d), torch.cat(b)) for s, (d, b) in pairs.items()}, over)
    print((out / "certificate.md").read_text())


def write_markdown(path: Path, rows: list[dict]) -> None:
    lines = ["# Certified bound against true dropped mass (SmolLM2-135M, passkey prompts)", "",
             "| setting | records | kv keep | reuse along time | mean δ | δ p99 | share δ < 0.05 | mean bound where δ < 0.05 | median bound | bound ≥ δ |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["section"] == "certificate":
            reuse = "—" if math.isnan(r.get("reuse_time", math.nan)) else f"{r['reuse_time']:.2f}"
            lines.append(f"| `{r['setting']}` | {r['records']} | {r.get('kv_keep_mean', math.nan):.3f} | {reuse} | "
                         f"{r['delta_mean']:.3f} | {r.get('delta_p99', math.nan):.3f} | {r['frac_delta_below_0.05']:.2f} | "
                         f"{r['bound_mean_where_delta_below_0.05']:.3f} | {r['bound_median']:.3f} | {r['bound_ge_delta']:.3f} |")
    lines += ["", "## Overshoot of page bounds over the page's best logit (nats, first decode step, every layer)", "",
              "| bound | mean | median | p10 | min |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        if r["section"] == "overshoot":
            lines.append(f"| {r['setting']} | {r['mean_nats']:.2f} | {r['median_nats']:.2f} | {r['p10_nats']:.2f} | {r['min_nats']:.2f} |")
    path.write_text("\n".join(lines) + "\n")


def plot(path: Path, pairs: dict[str, tuple[Tensor, Tensor]], over: dict[str, list[Tensor]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 5))
    for spec, (d, b) in pairs.items():
        ax.scatter(d.clamp_min(1e-6), b.clamp_min(1e-6), s=4, alpha=0.35, label=spec)
    ax.plot([1e-6, 1], [1e-6, 1], color="gray", linewidth=0.8)
    ax.axvline(0.05, color="gray", linestyle=":", linewidth=0.8)
    ax.axhline(0.2, color="gray", linestyle=":", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("true dropped mass δ")
    ax.set_ylabel("certified bound U/(Z_S+U)")
    ax.set_title("every (layer, step, KV head); dotted: δ = 0.05, bound = 0.2", fontsize=9)
    ax.legend(fontsize=8, markerscale=3)
    for name, values in over.items():
        ax2.hist(torch.cat(values).numpy(), bins=60, histtype="step", label=name, density=True)
    ax2.set_xlabel("page bound − page's best logit (nats)")
    ax2.set_title("overshoot of valid page bounds", fontsize=9)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
