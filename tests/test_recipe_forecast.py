"""The Forecast fine-tuning recipe (``recipes/forecast/``): its teacher and loss on small
hand-made tensors, its student against the policy's own scores in a real decode, its errors, and a
short end-to-end run on the embedded model whose heads file the policy loads and decodes with."""

from __future__ import annotations

import json
import math

import pytest
import torch
from tiny_models import tiny_model

from policyzoo import Decoder
from policyzoo.kv.forecast import Forecast, ForecastHeads, block_scores
from recipes.forecast.data import load_texts
from recipes.forecast.errors import UsageError
from recipes.forecast.evaluate import format_tasks, task_specs
from recipes.forecast.examples import make_example
from recipes.forecast.geometry import DEFAULT_GEOMETRY, Geometry
from recipes.forecast.objective import (
    LayerQueries,
    candidate_blocks,
    forecast_loss,
    slot_page_means,
    student_scores,
    teacher_block_mass,
    teacher_distribution,
    topk_recall,
)
from recipes.forecast.train import build_parser, initial_heads, main, run, save_heads

SMALL = Geometry(block=8, kernel=4, stride=2, sinks=8, window=8)


# ------------------------------------------------------------------------------------ teacher
def test_candidates_leave_out_the_sink_block_and_the_blocks_of_the_last_window():
    geo = SMALL
    positions = torch.tensor([31, 39])  # blocks of 8 tokens
    cand = candidate_blocks(positions, 5, geo)
    # t = 31: block 0 (sinks), block 3 (tokens 24..31, the window and t's own) forced; block 4 unseen
    assert cand[0].tolist() == [False, True, True, False, False]
    # t = 39: the window is tokens 32..39, block 4 only
    assert cand[1].tolist() == [False, True, True, True, False]
    # slot offset 3: token j sits in slot j + 3, so the sinks (slots 3..10) reach block 1, and t = 36
    # (slot 39) has the window in block 4 alone
    shifted = candidate_blocks(torch.tensor([36]), 5, geo, offset=3)
    assert shifted[0].tolist() == [False, False, True, True, False]


def test_the_teacher_is_a_distribution_over_candidates_led_by_the_dominant_key():
    geo = SMALL
    g = torch.Generator().manual_seed(0)
    h_kv, group, t, d = 2, 2, 40, 8
    keys = torch.randn(h_kv, t, d, generator=g) * 0.1
    queries = torch.randn(h_kv * group, 2, d, generator=g) * 0.1
    positions = torch.tensor([33, 39])
    # group 0's queries all point at keys 12 and 13 (block 1), group 1's at keys 21 and 22 (block 2)
    direction = torch.zeros(d)
    direction[0] = 1.0
    keys[0, 12:14] += 8 * direction
    keys[1, 21:23] += 8 * direction
    queries[:, :, 0] += 1.0
    teacher = teacher_distribution(queries, keys, positions, 1.0, geo)
    assert teacher.shape == (2, h_kv, 5)
    cand = candidate_blocks(positions, 5, geo)
    torch.testing.assert_close(teacher.sum(-1), torch.ones(2, h_kv))
    assert bool((teacher[~cand[:, None, :].expand_as(teacher)] == 0).all())  # forced blocks carry nothing
    assert teacher[:, 0].argmax(-1).tolist() == [1, 1]
    assert teacher[:, 1].argmax(-1).tolist() == [2, 2]
    # before renormalising, each row is the group's mean attention, all of it credited to blocks
    mass = teacher_block_mass(queries, keys, positions, 1.0, geo.block)
    torch.testing.assert_close(mass.sum(-1), torch.ones(2, h_kv))


def test_the_teacher_sees_only_windows_ending_at_or_before_the_query():
    geo = SMALL
    keys = torch.zeros(1, 24, 4)
    keys[0, 20, 0] = 100.0  # a key the query would love, but after it
    queries = torch.zeros(1, 1, 4)
    queries[0, 0, 0] = 1.0
    mass = teacher_block_mass(queries, keys, torch.tensor([18]), 1.0, geo.block)
    # 18 windows seen (0..17), all scoring 0: windows 16 and 17 in block 2, none of those with key 20
    assert mass[0, 0].tolist() == pytest.approx([8 / 18, 8 / 18, 2 / 18])


# --------------------------------------------------------------------------------------- loss
def _distribution_case(seed=0, nb=12):
    g = torch.Generator().manual_seed(seed)
    cand = torch.rand(3, 5, nb, generator=g) > 0.2
    cand[..., 0] = True
    teacher = torch.rand(3, 5, nb, generator=g).pow(4) * cand
    return teacher / teacher.sum(-1, keepdim=True), cand


def test_the_loss_is_zero_when_the_student_is_the_teacher_and_positive_otherwise():
    teacher, cand = _distribution_case()
    same = teacher.clamp(min=1e-12).log() + 3.0  # any shift: the student is a softmax
    assert float(forecast_loss(same, teacher, cand, k=4)) == pytest.approx(0.0, abs=1e-6)
    other = torch.randn(teacher.shape, generator=torch.Generator().manual_seed(1))
    assert float(forecast_loss(other, teacher, cand, k=4)) > 1e-3
    # outside the teacher's top k only the rest's total counts
    top = teacher.masked_fill(~cand, -1).topk(4, -1).indices
    in_top = torch.zeros_like(cand).scatter(-1, top, True)
    rest = cand & ~in_top
    shuffled = teacher.clone()
    shuffled[rest] = shuffled[rest].flip(0)  # moves mass between rest blocks of different rows
    per_row = (teacher * rest).sum(-1, keepdim=True) / (shuffled * rest).sum(-1, keepdim=True).clamp(min=1e-30)
    shuffled = torch.where(rest, shuffled * per_row, teacher)  # same rest total per row
    moved = shuffled.clamp(min=1e-12).log()
    assert float(forecast_loss(moved, teacher, cand, k=4)) == pytest.approx(0.0, abs=1e-5)
    assert float(forecast_loss(moved, teacher, cand, k=12)) > 1e-4  # the full KL sees it


def test_the_loss_gradient_reaches_the_heads():
    geo = SMALL
    g = torch.Generator().manual_seed(0)
    layers, t, d_model, h_kv, d = 2, 40, 12, 2, 8
    heads = ForecastHeads(layers, d_model, h_kv, d, rank=4)
    keys = torch.randn(layers, h_kv, t, d, generator=g)
    positions = torch.tensor([33, 37, 39])
    means, counts = slot_page_means(keys, 0, geo.stride)
    hidden = torch.randn(layers, len(positions), d_model, generator=g)
    rotary = (torch.ones(len(positions), d), torch.zeros(len(positions), d))
    queries = LayerQueries(heads)(hidden)
    scores = student_scores(queries, rotary, means, counts, torch.ones(layers), geo)
    teacher = torch.stack([teacher_distribution(torch.randn(2 * h_kv, 3, d, generator=g), keys[i], positions, 1.0, geo) for i in range(layers)])
    cand = candidate_blocks(positions, teacher.shape[-1], geo)[None, :, None, :]
    loss = forecast_loss(scores, teacher, cand, k=2)
    loss.backward()
    for p in (heads.down, heads.up):
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()) and float(p.grad.abs().sum()) > 0


def test_recall_counts_the_shared_top_blocks_where_there_is_a_choice():
    teacher = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.6, 0.4, 0.0, 0.0]])
    cand = torch.tensor([[True, True, True, False], [True, True, False, False]])
    scores = torch.tensor([[0.0, 2.0, 1.0, 9.0], [1.0, 0.0, 5.0, 5.0]])
    assert topk_recall(scores, teacher, cand, 2) == (0.5, 1)  # row 2 has only 2 candidates
    assert topk_recall(scores, teacher, cand, 1) == (1.0, 2)  # row 1 misses, row 2 hits


# ------------------------------------------------------------------------------------ student
def test_student_scores_are_what_the_policy_scores_when_it_decodes():
    """The same prompt decoded by a Decoder (full budget, so the hidden states are dense): the block
    scores `Forecast.scores` makes for each layer at the first step are the recipe's student scores
    on every candidate block (times the head's input norm, which decoding skips: a positive factor
    per row, ranking nothing), the candidates are exactly the blocks the policy does not force, and
    the ranking agrees. The prompt's length is not a multiple of the block, so the slot offset counts."""
    model = tiny_model("llama", layers=3)
    heads = ForecastHeads.from_model(model, rank=8)
    policy = Forecast(1.0, heads=heads)
    seen = []
    scores_of = policy.scores

    def recording(state, layer, hidden, rotary):
        out = scores_of(state, layer, hidden, rotary)
        first, last = state.cache.page_spans(policy.block)
        cache = state.cache
        forced = (first < cache.start[:, None] + policy.sinks) | (last > cache.length - max(policy.window, 1))
        norm = hidden[0].float().pow(2).mean().add(1e-6).sqrt()  # the RMS norm the heads apply in training
        seen.append((layer, out[0].clone() / norm, ((first < last) & ~forced)[0].clone()))
        return out

    policy.scores = recording
    prompt = 300
    ids = torch.randint(1, 128, (1, prompt), generator=torch.Generator().manual_seed(0))
    out = Decoder(model, kv=policy).generate(ids, 2)
    first_step = seen[:3]  # heads 0, 1 at layer 0, head 2 at layer 1
    assert [s[0] for s in first_step] == [0, 1, 2]

    geo = Geometry.of(policy)
    offset = -prompt % geo.block  # where the session put token 0 (`DecodeSession.prompt_slot`)
    example = make_example(model, out[0, : prompt + 1], torch.tensor([prompt]), offset, geo)
    student = student_scores(LayerQueries(heads)(example.inputs), example.rotary, example.means, example.counts, example.scales, geo)
    nb = student.shape[-1]
    cand = example.candidates[0]
    assert int(cand.sum()) >= 2
    for layer, scores, policy_cand in first_step:
        assert torch.equal(policy_cand[:nb], cand) and not bool(policy_cand[nb:].any())
        torch.testing.assert_close(student[layer, 0][:, cand], scores[:, :nb][:, cand], atol=1e-5, rtol=1e-5)
        assert torch.equal(student[layer, 0][:, cand].argsort(-1), scores[:, :nb][:, cand].argsort(-1))


def test_student_block_scores_rank_as_a_brute_force_over_windows():
    """`student_scores` with the offset: each block's score is the best score of a window of two
    pages overlapping it, a window scoring the mean of its visible keys (brute force)."""
    geo = SMALL
    g = torch.Generator().manual_seed(3)
    t, offset, d = 29, 3, 4
    keys = torch.randn(1, 1, t, d, generator=g)
    q = torch.randn(1, 1, 1, d, generator=g)
    means, counts = slot_page_means(keys, offset, geo.stride)
    got = student_scores(q, None, means, counts, torch.tensor([0.5]), geo)[0, 0, 0]
    slots = offset + t
    want = torch.full((math.ceil(slots / geo.block),), -math.inf)
    for w in range(0, math.ceil(slots / geo.stride)):  # window from page w: slots 2w .. 2w + 3
        toks = [s - offset for s in range(w * geo.stride, w * geo.stride + geo.kernel) if offset <= s < slots]
        if toks:
            score = 0.5 * float(q[0, 0, 0] @ keys[0, 0, toks].mean(0))
            for b in range(len(want)):
                if w * geo.stride < (b + 1) * geo.block and w * geo.stride + geo.kernel > b * geo.block:
                    want[b] = max(float(want[b]), score)
    torch.testing.assert_close(got, want)
    direct = block_scores((0.5 * means[0, 0] @ q[0, 0, 0])[None, None], counts[None], geo.kernel_pages, geo.block_pages)[0, 0]
    torch.testing.assert_close(got, direct)


# ------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize(
    "argv, option",
    [
        (["--steps", "0"], "--steps"),
        (["--seq-len", "200"], "--seq-len"),
        (["--seq-len", "256"], "--seq-len"),  # 4 blocks: one query position, nothing to train
        (["--mixed-precision", "fp8"], "--mixed-precision"),
        (["--holdout", "1.5"], "--holdout"),
        (["--init", "/nonexistent/heads.safetensors"], "--init"),
        (["--geometry", "block=24"], "--geometry"),  # not a multiple of the stride
        (["--geometry", "blocks=16"], "--geometry"),
    ],
)
def test_bad_options_name_themselves(argv, option, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv + ["--no-task-eval"])
    assert e.value.code == 2
    assert option in capsys.readouterr().err


def test_a_dataset_without_the_text_column_is_refused(tmp_path):
    (tmp_path / "data.csv").write_text("body,id\nsome text,1\nmore text,2\n")
    with pytest.raises(UsageError, match="--text-column"):
        load_texts(str(tmp_path), None, "train", "text")


def test_an_init_file_that_is_not_forecast_heads_is_refused(tmp_path):
    from safetensors.torch import save_file

    model = tiny_model("llama", layers=2)
    other = tmp_path / "other.safetensors"
    save_file({"x": torch.zeros(2)}, str(other), metadata={"policy": "Quest", "params": "{}"})
    text = tmp_path / "notes.txt"
    text.write_text("not a tensor file")
    wrong = Forecast(0.1, heads=ForecastHeads(5, 64, 2, 16, rank=4)).save(tmp_path / "wrong.safetensors")
    for path in (other, text, wrong):
        with pytest.raises(UsageError, match="--init"):
            initial_heads(model, str(path), None)
    good = Forecast(0.1, heads=ForecastHeads.from_model(model, rank=4)).save(tmp_path / "good.safetensors")
    assert initial_heads(model, str(good), None).rank == 4


def test_a_geometry_reaches_the_heads_file_and_the_task_specs(tmp_path):
    """Heads trained for another block geometry (``--geometry``) are saved as a policy of that
    geometry, and the task evaluation decodes with it."""
    geo = build_parser().parse_args(["--geometry", "block=16,sinks=16,window=16"]).geometry
    assert (geo.block, geo.kernel, geo.stride, geo.sinks, geo.window) == (16, 32, 16, 16, 16)
    assert build_parser().parse_args([]).geometry == DEFAULT_GEOMETRY
    heads = ForecastHeads.from_model(tiny_model("llama", layers=2), rank=4)
    path = save_heads(heads, tmp_path / "heads.safetensors", 0.1, geo)
    loaded = Forecast.load(path)
    assert (loaded.block, loaded.kernel, loaded.sinks, loaded.window) == (16, 32, 16, 16)
    specs = task_specs({"trained": path}, 0.1, geo)
    assert specs == {"dense": "dense", "trained": f"forecast:0.1,heads={path},block=16,sinks=16,window=16"}
    assert task_specs({"trained": path}, 0.1) == {"dense": "dense", "trained": f"forecast:0.1,heads={path}"}


def test_the_task_table_has_a_line_per_setting_and_length():
    rows = [
        {"setting": "dense", "task": "passkey", "length": 1024, "accuracy": 1.0},
        {"setting": "dense", "task": "ppl", "length": 1024, "ppl": 10.0, "dense_ppl": 10.0, "ppl_increase_rel": 0.0, "kv_keep": 1.0},
        {"setting": "forecast trained", "task": "passkey", "length": 1024, "accuracy": 0.5},
    ]
    lines = format_tasks(rows).splitlines()
    assert len(lines) == 3 and "forecast trained" in lines[2] and "0.50" in lines[2]


# --------------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_a_short_run_writes_heads_the_policy_decodes_with(tmp_path):
    pytest.importorskip("gguf")
    from policyzoo.assets import essays_text, load_model

    model, tokenizer = load_model()
    out = tmp_path / "run"
    args = build_parser().parse_args(
        ["--steps", "20", "--seq-len", "512", "--positions", "16", "--holdout", "0.2", "--max-chunks", "5",
         "--save-every", "10", "--no-task-eval", "--no-progress", "--out", str(out)]
    )  # fmt: skip
    metrics = run(args, model, tokenizer)

    for name in ("heads.safetensors", "checkpoint-0.safetensors", "checkpoint-10.safetensors", "checkpoint-20.safetensors", "loss.png", "metrics.json"):
        assert (out / name).is_file(), name
    saved = json.loads((out / "metrics.json").read_text())
    loss = saved["loss"]
    assert len(loss) == 20 and all(math.isfinite(x) for x in loss)
    assert sum(loss[-5:]) / 5 < sum(loss[:5]) / 5
    for heads in ("init", "trained", "oracle"):
        e = saved["eval"][heads]
        assert e["recall"] is not None and 0.0 <= e["recall"] <= 1.0 and e["recall_k"] in (1, 2, 4, 8, 16)
        assert set(e["recall_at"]) == {"1", "2", "4", "8", "16"}
    assert saved["eval"]["trained"]["loss"] < saved["eval"]["init"]["loss"]
    assert saved["chunks"] == {"train": 4, "held_out": 1, "seq_len": 512}
    assert metrics["timing"]["captures"] == 4  # each training chunk once: kept across epochs

    policy = Forecast(0.1, heads=out / "heads.safetensors")
    assert policy.predictor.rank == saved["heads"]["rank"]
    assert not torch.equal(policy.predictor.down, Forecast.load(out / "checkpoint-0.safetensors").predictor.down)
    ids = torch.tensor(tokenizer(essays_text()[:4000], add_special_tokens=False).input_ids[:400])[None]
    generated = Decoder(model, kv=policy).generate(ids, 3)
    assert generated.shape == (1, 403)
