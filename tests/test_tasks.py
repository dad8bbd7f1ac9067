"""policyzoo.eval.tasks: datasets of passkey, multi-key and perplexity records on the essays."""

from __future__ import annotations

import pytest

pytest.importorskip("datasets")

from policyzoo import assets
from policyzoo.eval import tasks


@pytest.fixture(scope="module")
def tok():
    pytest.importorskip("gguf")
    return assets.load_tokenizer()


def _haystack_depth(tok, record, intro: str, needle: str, question: str) -> float:
    """Where the needle starts, as a fraction of the haystack tokens (intro and question excluded)."""
    n_intro = len(tok(intro + "\n\n", add_special_tokens=False).input_ids)
    n_question = len(tok("\n\n" + question, add_special_tokens=False).input_ids)
    n_needles = len(tok(" " + needle, add_special_tokens=False).input_ids)
    hay = len(record["input_ids"]) - n_intro - n_question - n_needles
    return (record["needle_pos"] - n_intro) / hay


def test_placements_are_evenly_spread():
    assert tasks.placements(1) == [0.5]
    assert tasks.placements(4) == [0.125, 0.375, 0.625, 0.875]
    with pytest.raises(ValueError):
        tasks.placements(0)


def test_passkey_is_deterministic_under_a_seed(tok):
    a = tasks.passkey(tok, [512], placements=2, seed=3)
    b = tasks.passkey(tok, [512], placements=2, seed=3)
    c = tasks.passkey(tok, [512], placements=2, seed=4)
    assert a.to_list() == b.to_list()
    assert a["input_ids"] != c["input_ids"]
    assert a[0]["seed"] != a[1]["seed"]  # every record draws its own haystack and key


def test_passkey_needle_is_where_it_says(tok):
    data = tasks.passkey(tok, [512, 1024], placements=3, seed=0)
    assert len(data) == 6 and set(data["task"]) == {"passkey"}
    for r in data:
        ids, key = r["input_ids"], r["answer"]
        assert len(ids) <= r["length"] and len(ids) > r["length"] - 100
        assert tok.decode(ids[r["needle_pos"] :]).lstrip().startswith(f"The pass key is {key}. Remember it.")
        assert tok.decode(ids).endswith(assets.PASSKEY_QUESTION)
        depth = _haystack_depth(tok, r, assets.PASSKEY_INTRO, assets.PASSKEY_NEEDLE.format(key=key), assets.PASSKEY_QUESTION)
        assert abs(depth - r["depth"]) < 60 / r["length"], (depth, r["depth"])  # within a sentence or two
        assert r["span"] == 0 and r["name"] == ""


def test_multikey_asks_one_of_the_inserted_keys(tok):
    data = tasks.multikey(tok, [1024], placements=3, n_keys=4, seed=0)
    assert len(data) == 3
    for r in data:
        text = tok.decode(r["input_ids"])
        name, key = r["name"], r["answer"]
        assert text.endswith(f"What is the pass key for {name}? The pass key for {name} is")
        needles = [n for n in tasks.NAMES if f"The pass key for {n} is " in text.split("\n\nWhat is")[0]]
        assert len(needles) == 4 and name in needles  # four distinct people, the asked one among them
        assert f"The pass key for {name} is {key}." in text
        assert tok.decode(r["input_ids"][r["needle_pos"] :]).lstrip().startswith(f"The pass key for {name} is {key}.")
        assert len(r["input_ids"]) <= r["length"]
        # the asked needle is at its depth (the other three needles also count as haystack-free text)
        n_intro = len(tok(tasks.MULTIKEY_INTRO + "\n\n", add_special_tokens=False).input_ids)
        n_question = len(tok("\n\n" + tasks.MULTIKEY_QUESTION.format(name=name), add_special_tokens=False).input_ids)
        hay = len(r["input_ids"]) - n_intro - n_question - 4 * 12
        depth = (r["needle_pos"] - n_intro) / hay
        assert abs(depth - r["depth"]) < 0.12, (depth, r["depth"])
    assert tasks.multikey(tok, [1024], 3, seed=0).to_list() == data.to_list()


def test_perplexity_windows_are_real_text_deterministic_and_disjoint(tok):
    data = tasks.perplexity(tok, [256, 512], span=16, n_windows=3, seed=1)
    assert len(data) == 6
    corpus = tasks._essay_ids(tok)
    for n in (256, 512):
        rows = [r for r in data if r["length"] == n]
        starts = []
        for r in rows:
            ids = r["input_ids"]
            assert len(ids) == n and r["span"] == 16 and r["answer"] == "" and r["depth"] is None
            # a window of the tokenized essays, at a multiple of its length (so windows never overlap)
            matches = [s for s in range(0, len(corpus) - n + 1, n) if list(corpus[s : s + n]) == ids]
            assert len(matches) == 1
            starts.append(matches[0])
        assert len(set(starts)) == 3
    assert tasks.perplexity(tok, [256, 512], span=16, n_windows=3, seed=1).to_list() == data.to_list()
    with pytest.raises(ValueError, match="span"):
        tasks.perplexity(tok, 64, span=64)


def test_build_concatenates_tasks_with_shared_features(tok):
    data = tasks.build(tok, ["passkey", "multikey", "ppl"], [512], placements=2, span=8, n_windows=1)
    assert data["task"] == ["passkey", "passkey", "multikey", "multikey", "ppl"]
    assert data.features == tasks.features()
    with pytest.raises(ValueError, match="accepted: passkey, multikey, ppl"):
        tasks.build(tok, ["needle"], [512])
