"""Evaluation tasks as `datasets.Dataset` records, built from the embedded essays, deterministic under a seed.

Every record has the fields of `FEATURES`:

- ``task``: ``"passkey"``, ``"multikey"`` or ``"ppl"``;
- ``input_ids``: the prompt (retrieval) or the text window (perplexity), token ids;
- ``answer``: the expected key (retrieval; ``""`` for perplexity);
- ``length``: the requested length in tokens (the grouping key of the results);
- ``depth``: relative depth of the asked needle in the haystack, in [0, 1] (``None`` for perplexity);
- ``seed``: the record's own seed (haystack start, keys, names, window);
- ``needle_pos``: index of the first token of the asked needle in ``input_ids`` (``None`` for perplexity);
- ``span``: number of scored tokens at the end of the window (perplexity; 0 for retrieval);
- ``name``: whose key is asked (multikey; ``""`` otherwise).

`policyzoo.eval.runner` runs any dataset with these fields (a record with ``span > 0`` is scored
by perplexity, any other by greedy retrieval of ``answer``), so users who are online can plug in
their own HF datasets. Placements are ``N`` depths evenly spread: ``(i + 0.5) / N``.
"""

from __future__ import annotations

import bisect
import random
from functools import lru_cache
from typing import Any, Iterable, Sequence

from .. import assets

TASKS = ("passkey", "multikey", "ppl")

MULTIKEY_INTRO = (
    "There are several pass keys hidden inside a lot of irrelevant text, each belonging to a different person. "
    "Find them and memorize them. I will quiz you about one of them."
)
MULTIKEY_NEEDLE = "The pass key for {name} is {key}."
MULTIKEY_QUESTION = "What is the pass key for {name}? The pass key for {name} is"
NAMES = (
    "Alice", "Bruno", "Clara", "Daniel", "Elena", "Felix", "Greta", "Hugo", "Irene", "Jonas",
    "Karla", "Louis", "Maria", "Nadia", "Oscar", "Paula", "Quentin", "Rosa", "Simon", "Tessa",
)  # fmt: skip


def features():
    """The `datasets.Features` shared by every task (so task datasets concatenate)."""
    from datasets import Features, Sequence, Value

    return Features(
        {
            "task": Value("string"),
            "input_ids": Sequence(Value("int64")),
            "answer": Value("string"),
            "length": Value("int64"),
            "depth": Value("float64"),
            "seed": Value("int64"),
            "needle_pos": Value("int64"),
            "span": Value("int64"),
            "name": Value("string"),
        }
    )


def placements(n: int) -> list[float]:
    """``n`` needle depths evenly spread over the haystack: ``(i + 0.5) / n``."""
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        raise ValueError(f"placements must be a positive int, got {n!r}")
    return [(i + 0.5) / n for i in range(n)]


def item_seed(task: str, seed: int, length: int, index: int) -> int:
    """The seed of one record, derived from the task's seed (stable across runs and platforms)."""
    return random.Random(f"{task}:{seed}:{length}:{index}").randrange(2**31)


# ------------------------------------------------------------------------------------- passkey
def passkey(tokenizer: Any, lengths: Sequence[int] | int, placements: int = 3, seed: int = 0):
    """Passkey retrieval (`assets.passkey_prompt`): one record per length and depth.

    Args:
        tokenizer: the model's tokenizer.
        lengths: prompt lengths in tokens (each prompt is at most that long, within a sentence).
        placements: ``N``: the needle goes at the ``N`` depths ``(i + 0.5) / N``.
        seed: the task seed; each record draws its own haystack start and 5-digit key from it.
    """
    records = []
    for length in _lengths(lengths):
        for i, depth in enumerate(_placements(placements)):
            s = item_seed("passkey", seed, length, i)
            ids, key = assets.passkey_prompt(tokenizer, length, depth=depth, seed=s)
            ids = ids[0].tolist()
            needle = assets.PASSKEY_NEEDLE.format(key=key)
            records.append(
                _record("passkey", ids, key, length, depth, s, needle_pos=token_index(tokenizer, ids, needle))
            )
    return _dataset(records)


# ------------------------------------------------------------------------------------ multikey
def multikey(tokenizer: Any, lengths: Sequence[int] | int, placements: int = 3, n_keys: int = 4, seed: int = 0):
    """Multi-key retrieval: ``n_keys`` needles ``"The pass key for <name> is <digits>."`` at different
    depths, one asked (``"... What is the pass key for <name>? The pass key for <name> is"``).

    The asked needle goes at each of the ``placements`` depths; the others at random depths at least
    ``0.5 / n_keys`` away from every other needle. Names and 5-digit keys are distinct and drawn from
    the record's seed.
    """
    if isinstance(n_keys, bool) or not isinstance(n_keys, int) or not 1 <= n_keys <= len(NAMES):
        raise ValueError(f"n_keys must be an int in [1, {len(NAMES)}], got {n_keys!r}")
    records = []
    for length in _lengths(lengths):
        for i, depth in enumerate(_placements(placements)):
            s = item_seed("multikey", seed, length, i)
            rng = random.Random(s)
            names = rng.sample(NAMES, n_keys)
            keys: list[str] = []
            while len(keys) < n_keys:
                key = str(rng.randint(10_000, 99_999))
                if key not in keys:
                    keys.append(key)
            depths = _spread_depths(depth, n_keys, rng)
            needles = [(MULTIKEY_NEEDLE.format(name=n, key=k), d) for n, k, d in zip(names, keys, depths)]
            question = MULTIKEY_QUESTION.format(name=names[0])
            ids = needle_prompt(tokenizer, length, MULTIKEY_INTRO, needles, question, rng)
            pos = token_index(tokenizer, ids, needles[0][0])
            records.append(_record("multikey", ids, keys[0], length, depth, s, needle_pos=pos, name=names[0]))
    return _dataset(records)


def _spread_depths(asked: float, n: int, rng: random.Random) -> list[float]:
    depths = [asked]
    gap = 0.5 / n
    for _ in range(1000 * n):
        if len(depths) == n:
            break
        d = rng.random()
        if all(abs(d - e) >= gap for e in depths):
            depths.append(d)
    while len(depths) < n:  # unreachable for sane n; fall back to an even spread
        depths.append((len(depths) + 0.5) / n)
    return depths


def needle_prompt(
    tokenizer: Any, n_tokens: int, intro: str, needles: Sequence[tuple[str, float]], question: str, rng: random.Random
) -> list[int]:
    """A completion-format prompt of at most ``n_tokens`` tokens: ``intro``, essay haystack with each
    ``(needle, depth)`` on a distinct sentence boundary nearest to its relative depth (in haystack
    tokens), then ``question``. The haystack starts at a sentence drawn from ``rng``."""
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int):
        raise TypeError(f"n_tokens must be an int, got {type(n_tokens).__name__}")

    def count(s: str) -> int:
        return len(tokenizer(s, add_special_tokens=False).input_ids)

    intro, question = intro + "\n\n", "\n\n" + question
    special = max(len(tokenizer("x").input_ids) - count("x"), 0)
    overhead = count(intro) + sum(count(" " + n) for n, _ in needles) + count(question) + special + 2 * len(needles)
    min_tokens = overhead + 32
    if n_tokens < min_tokens:
        raise ValueError(f"n_tokens must be at least {min_tokens} for this tokenizer and these needles, got {n_tokens}")
    text, starts = assets._haystack()
    budget = n_tokens - overhead
    room = len(text) - 5 * budget
    first = starts[rng.randrange(bisect.bisect_right(starts, room))] if room > 0 else 0
    for _ in range(8):  # shrink the haystack if boundary merges overshoot (rare)
        taken = assets._take_tokens(tokenizer, text, starts, first, budget)
        if taken is None and first > 0:
            first = 0
            taken = assets._take_tokens(tokenizer, text, starts, 0, budget)
        if taken is None:
            raise ValueError(f"n_tokens ({n_tokens}) is larger than the essays allow (about {len(text) // 4} tokens)")
        hay, sentence_starts = taken
        offsets = tokenizer(hay, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        boundaries = [0] + list(sentence_starts) + [len(hay)]
        token_starts = [o[0] for o in offsets]
        token_at = [bisect.bisect_left(token_starts, c) for c in boundaries]
        used: set[int] = set()
        cuts = []
        for needle, depth in needles:
            target = round(float(depth) * len(offsets))
            free = [i for i in range(len(boundaries)) if i not in used]
            if not free:
                raise ValueError(f"n_tokens ({n_tokens}) is too short for {len(needles)} needles")
            best = min(free, key=lambda i: (abs(token_at[i] - target), i))
            used.add(best)
            cuts.append((boundaries[best], needle))
        cuts.sort()
        pieces, prev = [], 0
        for cut, needle in cuts:
            pieces += [hay[prev:cut].strip(), needle]
            prev = cut
        pieces.append(hay[prev:].strip())
        body = " ".join(p for p in pieces if p)
        ids = tokenizer(intro + body + question).input_ids
        if len(ids) <= n_tokens:
            return list(ids)
        budget -= len(ids) - n_tokens
    raise RuntimeError(f"could not fit the prompt in {n_tokens} tokens")  # pragma: no cover


def token_index(tokenizer: Any, ids: Sequence[int], fragment: str) -> int:
    """Index of the token of ``ids`` holding the first character of the first ``fragment`` in the
    decoded text (found by bisection over decoded prefixes, so any tokenizer works)."""
    ids = list(ids)
    text = tokenizer.decode(ids)
    char = text.find(fragment)
    if char < 0:
        raise ValueError(f"{fragment!r} is not in the prompt")
    lo, hi = 0, len(ids) - 1  # smallest i with len(decode(ids[: i + 1])) > char
    while lo < hi:
        mid = (lo + hi) // 2
        if len(tokenizer.decode(ids[: mid + 1])) > char:
            hi = mid
        else:
            lo = mid + 1
    return lo


# ---------------------------------------------------------------------------------- perplexity
@lru_cache(maxsize=2)
def _essay_ids(tokenizer: Any) -> tuple[int, ...]:
    return tuple(tokenizer(assets.essays_text(), add_special_tokens=False).input_ids)


def perplexity(tokenizer: Any, length: Sequence[int] | int, span: int = 64, n_windows: int = 2, seed: int = 0):
    """Windows of real essay text for teacher-forced perplexity: one record per length and window.

    Each window is ``length`` consecutive tokens of the essays (windows of one length never overlap);
    the first ``length - span`` tokens are the prefix (prefilled dense) and the last ``span`` are
    scored, each predicted by one decode step through the policy.
    """
    if isinstance(span, bool) or not isinstance(span, int) or span <= 0:
        raise ValueError(f"span must be a positive int, got {span!r}")
    if isinstance(n_windows, bool) or not isinstance(n_windows, int) or n_windows <= 0:
        raise ValueError(f"n_windows must be a positive int, got {n_windows!r}")
    corpus = _essay_ids(tokenizer)
    records = []
    for n in _lengths(length):
        if span >= n:
            raise ValueError(f"span ({span}) must be shorter than the window ({n})")
        slots = len(corpus) // n
        if slots < n_windows:
            raise ValueError(f"the essays hold {slots} windows of {n} tokens, fewer than n_windows={n_windows}")
        s = item_seed("ppl", seed, n, 0)
        chosen = random.Random(s).sample(range(slots), n_windows)
        for i, slot in enumerate(chosen):
            ids = list(corpus[slot * n : (slot + 1) * n])
            records.append(_record("ppl", ids, "", n, None, item_seed("ppl", seed, n, i + 1), span=span))
    return _dataset(records)


# ----------------------------------------------------------------------------------- build all
def build(
    tokenizer: Any,
    tasks: Iterable[str],
    lengths: Sequence[int],
    placements: int = 3,
    *,
    n_keys: int = 4,
    span: int = 64,
    n_windows: int | None = None,
    seed: int = 0,
):
    """The concatenated dataset of ``tasks`` (names from `TASKS`); ``n_windows`` defaults to ``placements``."""
    from datasets import concatenate_datasets

    parts = []
    for task in tasks:
        if task == "passkey":
            parts.append(passkey(tokenizer, lengths, placements, seed=seed))
        elif task == "multikey":
            parts.append(multikey(tokenizer, lengths, placements, n_keys=n_keys, seed=seed))
        elif task == "ppl":
            parts.append(perplexity(tokenizer, lengths, span=span, n_windows=n_windows or placements, seed=seed))
        else:
            raise ValueError(f"unknown task {task!r}; accepted: {', '.join(TASKS)}")
    if not parts:
        raise ValueError(f"no tasks given; accepted: {', '.join(TASKS)}")
    return concatenate_datasets(parts)


# ----------------------------------------------------------------------------------- internals
def _lengths(lengths: Sequence[int] | int) -> list[int]:
    values = [lengths] if isinstance(lengths, int) else list(lengths)
    if not values or any(isinstance(n, bool) or not isinstance(n, int) or n <= 0 for n in values):
        raise ValueError(f"lengths must be positive ints, got {lengths!r}")
    return values


def _placements(n: int) -> list[float]:
    return placements(n)


def _record(
    task: str, ids: list[int], answer: str, length: int, depth: float | None, seed: int,
    needle_pos: int | None = None, span: int = 0, name: str = "",
) -> dict:  # fmt: skip
    return {
        "task": task, "input_ids": [int(t) for t in ids], "answer": answer, "length": int(length),
        "depth": depth, "seed": int(seed), "needle_pos": needle_pos, "span": int(span), "name": name,
    }  # fmt: skip


def _dataset(records: list[dict]):
    from datasets import Dataset

    return Dataset.from_list(records, features=features())
