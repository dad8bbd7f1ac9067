"""Why CommunityKV(0.1) lost multi-key answers: multikey records through `policyzoo.Decoder`, and at
every decode step, layer and KV head, what the policy keeps against what dense attention ranks highest.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/results/smollm2-communitykv-multikey/diagnose.py LENGTH [DEPTH_INDEX ...] [key=value ...]

The policy runs with ``split=0`` (Leiden's communities as they are, the code before this change)
unless a ``split=N`` argument says otherwise; other ``key=value`` arguments go to CommunityKV too.
Per (step, layer, KV head): the dense attention of the group's query heads over every visible key
(local indices: slot minus the row's first slot); the kept slots ("actual"); and what the same budget
would keep under other rankings, simulated with the policy's fill rule (whole units best first, the
last cut after its first tokens; forced tokens counted against the budget, so "mean" keeps a little
less than "actual"): the communities ranked by their mean key ("mean"), by the exact best logit of
their keys ("max", an oracle that reads every key), by a min/max box bound as Quest's ("box"), by a
ball around the mean ("ball"), by a diagonal-Gaussian log-mean-exp ``q·μ + ½·Σ q²σ²`` ("gauss"), by
the best of the mean and the 4 most central keys ("rep4"); the communities cut into parts of at most
N tokens along their keys' principal axis, ranked by the parts' mean keys ("partN", what
``split=N`` does); the dense top-k ("topk"). Printed per record: the recall (dense attention mass
kept, mean over query heads, layers and steps), the share of each head's dense top-16 kept, and over
the (step, layer, query head) that put at least 0.1 of their attention on the asked needle's
sentence, the share of that mass kept.
"""
import re
import sys

import torch

from policyzoo import assets
from policyzoo.decoder import Decoder
from policyzoo.eval import tasks
from policyzoo.eval.data import new_tokens
from policyzoo.kv.communitykv import CommunityKV

torch.set_num_threads(1)
args = [a for a in sys.argv[1:] if "=" not in a]
kw = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
kw = {"split": 0, **{k: (int(v) if v.isdigit() else v) for k, v in kw.items()}}
length = int(args[0]) if args else 3072
which = [int(a) for a in args[1:]] or [0, 1, 2, 3]
REPS = (4,)
VERBOSE = bool(int(__import__("os").environ.get("VERBOSE", "0")))

model, tok = assets.load_model()
data = tasks.multikey(tok, [length], placements=4)


def fill(order, off, size, scores, free):
    """The slots the policy's fill rule keeps from communities ranked by ``scores`` (best first)."""
    kept = []
    for c in torch.argsort(-scores, stable=True).tolist():
        s = int(size[c])
        if s == 0 or free <= 0:
            break
        take = min(s, free)
        kept += order[int(off[c]): int(off[c]) + take].tolist()
        free -= take
    return torch.tensor(kept, dtype=torch.long)


def bisect(idx, keys, most):
    """``idx`` split in halves along its keys' principal axis until each part has at most ``most``."""
    if len(idx) <= most:
        return [idx]
    x = keys[idx] - keys[idx].mean(0)
    v = torch.linalg.svd(x, full_matrices=False).Vh[0]
    order = torch.argsort(x @ v)
    half = len(idx) // 2
    return bisect(idx[order[:half]], keys, most) + bisect(idx[order[half:]], keys, most)


PARTS = (4, 8)
_parts = {}


class Probe(CommunityKV):
    def select(self, state, q):
        sel = super().select(state, q)
        layer = state.layer_state_of(self)
        b, h, d = q.shape
        h_kv = state.keys.shape[1]
        g = h // h_kv
        s0 = int(state.cache.start[0])  # the prompt's first slot: local index = slot - s0
        n = int(state.cache.length) - s0
        forced = torch.zeros(n, dtype=torch.bool)
        forced[: self.sinks] = True
        forced[n - self.window:] = True
        for kv in range(h_kv):
            keys = state.keys[0, kv, s0:s0 + n].float()
            qq = q[0, kv * g:(kv + 1) * g].float()
            logits = state.scale * qq @ keys.T  # [g, n]
            p = logits.softmax(-1)  # [g, n]
            cnt = int(sel.count[0, kv])
            kept = torch.zeros(n, dtype=torch.bool)
            kept[sel.indices[0, kv, :cnt].long() - s0] = True
            size, off, order = layer.size[0, kv], layer.offset[0, kv], layer.order[0, kv].long() - s0
            member = torch.full((n,), -1, dtype=torch.long)
            for c in torch.nonzero(size).flatten().tolist():
                member[order[int(off[c]): int(off[c]) + int(size[c])]] = c
            ok = member >= 0
            C = size.shape[0]
            mean_sc = (state.scale * qq @ layer.centroid[0, kv].T).max(0).values.masked_fill(size == 0, -1e30)
            mx = torch.full((C,), -1e30).scatter_reduce(0, member[ok], logits.max(0).values[ok], "amax")
            lo = torch.full((C, d), 1e30).scatter_reduce(0, member[ok][:, None].expand(-1, d), keys[ok], "amin")
            hi = torch.full((C, d), -1e30).scatter_reduce(0, member[ok][:, None].expand(-1, d), keys[ok], "amax")
            box = (state.scale * torch.maximum(qq[:, None] * lo[None], qq[:, None] * hi[None]).sum(-1)).max(0).values
            box = box.masked_fill(size == 0, -1e30)
            # diagonal-Gaussian log-mean-exp: scale·q·μ + ½·scale²·Σ_d q_d² σ_d² (the group's max)
            sq = torch.zeros(C, d).index_add_(0, member[ok], keys[ok] ** 2) / size.clamp(min=1)[:, None].float()
            mu = torch.zeros(C, d).index_add_(0, member[ok], keys[ok]) / size.clamp(min=1)[:, None].float()
            var = (sq - mu ** 2).clamp(min=0)
            gauss = (state.scale * qq @ mu.T + 0.5 * state.scale ** 2 * (qq ** 2) @ var.T).max(0).values.masked_fill(size == 0, -1e30)
            # ball bound: q·μ + |q|·max|k − μ|
            rad = torch.zeros(C).scatter_reduce(0, member[ok], (keys[ok] - mu[member[ok]]).norm(dim=-1), "amax")
            ball = (state.scale * (qq @ mu.T + qq.norm(dim=-1, keepdim=True) * rad)).max(0).values.masked_fill(size == 0, -1e30)
            scores = [("mean", mean_sc), ("max", mx), ("box", box), ("gauss", gauss), ("ball", ball)]
            for r in REPS:  # the max over the community's r most central keys (the first of its range), and the centroid
                ar = torch.arange(r)
                slots = order[(off[:, None] + ar).clamp(max=order.shape[0] - 1)]
                valid = (ar[None] < size[:, None]) & (slots < n) & (slots >= 0)
                lr = (state.scale * qq @ keys[slots.clamp(0, n - 1)].reshape(-1, d).T).max(0).values.view(C, r)
                rep = lr.masked_fill(~valid, -1e30).amax(-1)
                scores.append((f"rep{r}", torch.maximum(rep, mean_sc).masked_fill(size == 0, -1e30)))
            for most in PARTS:
                key_ = (state.layer, kv, most)
                if key_ not in _parts:  # the prompt's communities (decoded tokens are in the window here)
                    pm, pc = [], []
                    for c in torch.nonzero(size).flatten().tolist():
                        idx = order[int(off[c]): int(off[c]) + int(size[c])]
                        idx = idx[(idx >= 0) & (idx < n)]
                        for part in bisect(idx, keys, most):
                            pm.append(part)
                            pc.append(c)
                    _parts[key_] = (pm, torch.tensor(pc), torch.stack([keys[x].mean(0) for x in pm]))
                pm, pc, pmean = _parts[key_]
                psc = (state.scale * qq @ pmean.T).max(0).values
                # (a) parts as the units: fill by part
                porder = torch.cat([x for x in pm])
                psize = torch.tensor([len(x) for x in pm])
                poff = psize.cumsum(0) - psize
                scores.append((f"part{most}", (porder, poff, psize, psc)))
                # (b) whole communities, scored by their best part
                scores.append((f"cmax{most}", torch.full((C,), -1e30).scatter_reduce(0, pc, psc, "amax").masked_fill(size == 0, -1e30)))
            free = cnt - int(forced.sum())
            sims = {}
            for name, sc in scores:
                m = forced.clone()
                if isinstance(sc, tuple):
                    m[fill(*sc[:3], sc[3], free)] = True
                    sims[name] = m
                    continue
                m[fill(order, off, size, sc.masked_fill(size == 0, -1e30), free)] = True
                sims[name] = m
            topk = torch.zeros(n, dtype=torch.bool)
            topk[p.mean(0).topk(cnt).indices] = True
            sims["topk"] = topk
            self.log.append(dict(layer=state.layer, kv=kv, p=p, kept=kept, sims=sims, member=member, size=size.clone(),
                                 mean=mean_sc, mx=mx, box=box, count=cnt))
        return sel


results = []
for i in which:
    _parts.clear()
    rec = data[i]
    ids = torch.tensor(rec["input_ids"])
    name, answer = rec["name"], rec["answer"]
    text = tok.decode(ids)
    needles = re.findall(r"The pass key for (\w+) is (\d+)\.", text)
    spans = {}
    for nm, key in needles:
        pos = tasks.token_index(tok, ids.tolist(), tasks.MULTIKEY_NEEDLE.format(name=nm, key=key))
        ntok = len(tok(" " + tasks.MULTIKEY_NEEDLE.format(name=nm, key=key), add_special_tokens=False).input_ids)
        spans[nm] = list(range(pos, pos + ntok))
    asked = spans[name]
    others = [s for nm, s in spans.items() if nm != name for s in s]
    digits = [j for j in asked if tok.decode(ids[j:j + 1]).strip().isdigit()]
    steps = new_tokens(tok, [answer])
    policy = Probe(0.1, workers=1, **kw)
    policy.log = []
    outs = {}
    for label, pol in (("dense", None), ("ckv", policy)):
        dec = Decoder(model, kv=pol)
        logits = dec.session.prefill(ids[None], capacity=len(ids) + steps)[:, -1]
        out = []
        for s in range(steps):
            t = logits.argmax(-1)
            out.append(int(t))
            if s == steps - 1:
                break
            logits = dec.session.step(t)
        outs[label] = tok.decode(out)
    log = policy.log
    nl = max(e["layer"] for e in log) + 1
    allc = torch.cat([e["size"][e["size"] > 0] for e in log[: nl * 3]]).float()
    print(f"\n== {length} depth {rec['depth']} {name} {answer} (first slot {int(dec.session.cache.start[0])}): dense {outs['dense']!r} ckv {outs['ckv']!r}; "
          f"{len(ids)} tokens, budget {log[0]['count']} slots/head; communities per unit {allc.numel() / (nl * 3):.0f}, "
          f"size median {allc.median():.0f} mean {allc.mean():.1f} p90 {allc.quantile(0.9):.0f} max {allc.max():.0f}")
    # Over the (step, layer, query head) whose dense attention puts >= 0.1 on the asked needle's sentence:
    hot = [(e, p) for e in log for p in e["p"] if float(p[asked].sum()) >= 0.1]
    for sim in ["actual"] + list(log[0]["sims"]):
        def kept(e):
            return e["kept"] if sim == "actual" else e["sims"][sim]
        rec_all = torch.tensor([float((e["p"] * kept(e)).sum(-1).mean()) for e in log]).mean()
        top16 = torch.tensor([float(kept(e)[e["p"].topk(16, dim=-1).indices].float().mean()) for e in log]).mean()
        def share(ix):
            return sum(float(p[ix][kept(e)[ix]].sum()) for e, p in hot) / max(sum(float(p[ix].sum()) for e, p in hot), 1e-9)
        print(f"  {sim:6s}: recall {rec_all:.3f}, dense top-16 kept {top16:.3f} | on the {len(hot)} hot (step,layer,head): "
              f"asked-needle mass kept {share(asked):.2f}, its digits' {share(digits):.2f}, other needles' {share(others):.2f}")
    if VERBOSE:
        for e in log:
            for j, p in enumerate(e["p"]):
                if float(p[asked].sum()) < 0.1:
                    continue
                cs = sorted({int(e["member"][t]) for t in asked if e["member"][t] >= 0})
                info = " ".join(f"c{c}(n{int(e['size'][c])} r{int((e['mean'] > e['mean'][c]).sum())}/{int((e['mx'] > e['mx'][c]).sum())}/{int((e['box'] > e['box'][c]).sum())})" for c in cs)
                print(f"   L{e['layer']:2d} kv{e['kv']} h{j} asked {float(p[asked].sum()):.2f} kept {float(p[asked][e['kept'][asked]].sum()):.2f} "
                      f"others {float(p[others].sum()):.2f} kept {float(p[others][e['kept'][others]].sum()):.2f}  {info}")
