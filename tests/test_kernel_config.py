"""`policyzoo.kernels.config`: launch configurations as frozen values, chosen by shape, overridden
for a scope.

The kernels run on CPU tensors in the Triton interpreter (conftest sets ``TRITON_INTERPRET=1``
before triton is first imported on machines without a GPU).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil
import threading

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from policyzoo import kernels
from policyzoo.kernels import (
    AttentionConfig,
    AttentionEdgesConfig,
    CommunityChoiceConfig,
    DenseGemvConfig,
    EntmaxThresholdConfig,
    GatheredLogitsConfig,
    GemvConfig,
    PageFetchConfig,
    PageGaussiansConfig,
    PageScoreConfig,
    SelectPagesConfig,
    SelectTopConfig,
    SketchScoreConfig,
    config,
    reference,
)
from policyzoo.kernels import workspace
from policyzoo.kernels import config
from policyzoo.kernels.config import override
from policyzoo.kernels.ops import cache_append as append_op
from policyzoo.kernels.ops import decode_attention as attention_op
from policyzoo.kernels.ops import entmax_threshold as entmax_op
from policyzoo.kernels.ops import gathered_logits as gathered_op
from policyzoo.kernels.ops import quest_page_bound as quest_op
from policyzoo.kernels.ops import select_top as select_op
from policyzoo.kernels.ops import sketch_page_bound as sketch_op
from policyzoo.kernels.ops import sparse_gemv as gemv_op
from policyzoo.selection import Selection

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CONFIGS = (AttentionConfig, SelectTopConfig, GemvConfig, PageScoreConfig, EntmaxThresholdConfig, GatheredLogitsConfig,
           SketchScoreConfig, AttentionEdgesConfig, PageFetchConfig, SelectPagesConfig)
# The histograms and arrival counters, as a Decoder on CUDA makes them; the tests check that every
# launch leaves them zero.
WORKSPACE = kernels.Workspace(DEVICE)


def workspace_is_zero() -> bool:
    return all(int(b.abs().sum()) == 0 for b in WORKSPACE.buffers.values())


# --------------------------------------------------------------------------------------------------
# Values


@pytest.mark.parametrize("kind", CONFIGS)
def test_configs_are_frozen_values(kind):
    cfg = kind()
    field = dataclasses.fields(cfg)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(cfg, field, getattr(cfg, field))
    assert cfg == kind() and hash(cfg) == hash(kind())
    with pytest.raises(TypeError):
        kind(64)  # fields are keyword-only


@pytest.mark.parametrize(
    "kind, fields, message",
    [
        (AttentionConfig, dict(block_t=48), "block_t must be a power of two"),
        (AttentionConfig, dict(block_t=8), "block_t must be 16 at least"),
        (AttentionConfig, dict(num_warps=0), "num_warps must be a power of two"),
        (AttentionConfig, dict(block_c=24), "block_c must be a power of two or 0"),
        (AttentionConfig, dict(chunk=-1), "chunk must be an int >= 0"),
        (AttentionConfig, dict(n_bisect=0), "n_bisect must be a positive int"),
        (AttentionConfig, dict(num_stages=True), "num_stages must be a positive int"),
        (SelectTopConfig, dict(method="radix"), "method must be one of"),
        (SelectTopConfig, dict(hist_chunk=500), "hist_chunk must be a power of two"),
        (SelectTopConfig, dict(num_warps=3), "num_warps must be a power of two or 0"),
        (SelectTopConfig, dict(interp_steps=-1), "interp_steps must be an int >= 0"),
        (GemvConfig, dict(block_k=100), "block_k must be a power of two"),
        (GemvConfig, dict(wide_d_out=0), "wide_d_out must be a positive int"),
        (GemvConfig, dict(block_n=-64), "block_n must be a power of two or 0"),
        (GemvConfig, dict(split=-2), "split must be an int >= 0"),
        (GemvConfig, dict(min_fused_split=0), "min_fused_split must be a positive int"),
        (GemvConfig, dict(fuse_epilogue=1), "fuse_epilogue must be a bool"),
        (GemvConfig, dict(prefetch="yes"), "prefetch must be a bool"),
        (GemvConfig, dict(tile_sum=0), "tile_sum must be a bool"),
        (GemvConfig, dict(atomic_sum=1), "atomic_sum must be a bool"),
        (GemvConfig, dict(warm_x="on"), "warm_x must be a bool"),
        (GemvConfig, dict(max_registers=-1), "max_registers"),
        (GemvConfig, dict(dot_from_rows=0), "dot_from_rows must be a positive int"),
        (PageScoreConfig, dict(method="broadcast"), "method must be one of"),
        (PageScoreConfig, dict(block_p=2.0), "block_p must be a power of two"),
        (GatheredLogitsConfig, dict(method="gather"), "method must be one of"),
        (GatheredLogitsConfig, dict(block_t=48), "block_t must be a power of two"),
        (EntmaxThresholdConfig, dict(block_p=1000), "block_p must be a power of two"),
        (SketchScoreConfig, dict(max_registers=-1), "max_registers must be an int >= 0"),
        (SketchScoreConfig, dict(token_step=6), "token_step must be a power of two"),
        (SelectPagesConfig, dict(finish_warps=6), "finish_warps must be a power of two"),
        (SelectPagesConfig, dict(finish_min_row=-1), "finish_min_row must be an int >= 0"),
        (CommunityChoiceConfig, dict(chunk=48), "chunk must be a power of two"),
        (CommunityChoiceConfig, dict(width=0), "width must be a power of two"),
    ],
)
def test_invalid_fields_raise(kind, fields, message):
    with pytest.raises(ValueError, match=f"{kind.__name__}.{message}"):
        kind(**fields)


def test_each_op_config_names_its_kernel_once():
    """The keywords of `override` (and of the sweep's records), one per config class."""
    assert dict(config.known_kernels()) == {
        "attention": AttentionConfig, "select_top": SelectTopConfig, "gemv": GemvConfig, "page_score": PageScoreConfig,
        "sketch_score": SketchScoreConfig, "entmax_threshold": EntmaxThresholdConfig,
        "gathered_logits": GatheredLogitsConfig, "attention_edges": AttentionEdgesConfig, "page_fetch": PageFetchConfig,
        "select_pages": SelectPagesConfig, "dense_gemv": DenseGemvConfig,
        "page_gaussians": PageGaussiansConfig, "community_choice": CommunityChoiceConfig,
    }


def test_replace_validates_too():
    with pytest.raises(ValueError, match="block_m must be a power of two"):
        dataclasses.replace(AttentionConfig(), block_m=3000)


# --------------------------------------------------------------------------------------------------
# Chosen by shape: what the module constants chose


def test_attention_config_by_shape():
    rule = functools.partial(attention_op.attention_config, head_dim=128)  # the 8B shape's heads
    # 2K tokens, 8 KV heads x 1 row: 512 programs over 8 heads, 64 chunks of 32 tokens (the token
    # floor), merged in one step, walked in tiles of 32.
    assert (rule(2048, 1, 8).chunk, rule(2048, 1, 8).block_c, rule(2048, 1, 8).block_t) == (32, 64, 32)
    # 1K tokens: the floor of 32 tokens a chunk leaves 32 chunks.
    assert (rule(1024, 1, 8).chunk, rule(1024, 1, 8).block_c) == (32, 32)
    # 8,192 pages of 16 (128K): 64 chunks of 128 pages, in tiles of 64 tokens.
    assert (rule(8192, 16, 8).chunk, rule(8192, 16, 8).block_c, rule(8192, 16, 8).block_t) == (128, 64, 64)
    # 4K tokens in pages of 16: chunks of 4 pages = 64 tokens, still short: tiles of 32.
    assert (rule(256, 16, 8).chunk, rule(256, 16, 8).block_t) == (4, 32)
    # Chunks of 144 tokens (9 pages of 16) are long: tiles of 64.
    assert rule(576, 16, 8).chunk == 9 and rule(576, 16, 8).block_t == 64
    # 512 chunks (one row, 128K tokens): merged in steps of 128 (`max_block_c`); no entry: one chunk.
    assert rule(1024, 128, 1).block_c == 128 and rule(0, 16, 8).chunk == 1
    # The merge: a warp per 32 partials of a step, 2 at least (64 partials: 2; 128: 4).
    assert rule(8192, 16, 8).merge_warps == 2 and rule(1024, 128, 1).merge_warps == 4 and rule(0, 16, 8).merge_warps == 2
    assert dataclasses.replace(rule(2048, 1, 8), chunk=0, block_c=0, block_t=0, merge_warps=0) == AttentionConfig()


def test_select_top_config_by_shape():
    rule = select_op.select_top_config
    assert rule(8192, torch.bfloat16).method == "histogram" and rule(14336, torch.bfloat16).method == "histogram"
    assert rule(8191, torch.bfloat16).method == "program"
    assert rule(16384, torch.float32).method == "program" and rule(16384, torch.float16).method == "program"
    # warps by the entries held: 3,000 entries are a tile of 2,048 and a tail of 1,024
    assert rule(3000, torch.float32).num_warps == 4 and rule(4096, torch.float32).num_warps == 8
    assert rule(8203, torch.float32).num_warps == 8


def test_gemv_config_by_shape():
    rule = gemv_op.gemv_config
    down = rule(7168, 4096, 1)  # down projection at keep 0.5: 64 blocks, 8 slices, epilogue fused
    assert (down.split, down.fuse_epilogue) == (8, True)
    gate_up = rule(2048, 28672, 1)  # 448 blocks, 2 slices: the epilogue launch
    assert (gate_up.split, gate_up.fuse_epilogue) == (2, False)
    assert rule(100, 64, 1).split == 1 and not rule(100, 64, 1).fuse_epilogue  # one tile: no split
    # A split that leaves part of a tile per slice is rounded to whole tiles: 300 features in 3
    # slices of 128.
    with override(gemv=GemvConfig(split=5)):
        assert rule(300, 64, 1).split == 3


def test_gathered_logits_config_by_shape():
    assert gathered_op.gathered_logits_config(128) == GatheredLogitsConfig()
    assert gathered_op.gathered_logits_config(8).method == "loop"  # tl.dot needs 16
    with override(gathered_logits=GatheredLogitsConfig(block_t=8)):
        assert gathered_op.gathered_logits_config(64).block_t == 16
        assert gathered_op.gathered_logits_config(8).block_t == 8


@given(per=st.integers(1, 1 << 16), log_block=st.integers(5, 13))
def test_entmax_tail_block_covers_the_slice_past_its_block(per, log_block):
    block = 1 << log_block
    tail = entmax_op.tail_block(per, block)
    if per <= block:
        assert tail == 0
    elif tail is None:  # walked from memory: the overflow is too long for a tail
        assert (per - block) * entmax_op.TAIL_FRACTION > block
    else:
        assert tail >= 32 and tail & (tail - 1) == 0 and block + tail >= per
        assert tail < 2 * max(32, per - block)  # the smallest power of two that holds the overflow


def test_page_score_and_entmax_threshold_configs_by_shape():
    assert quest_op.page_score_config(128) == PageScoreConfig()
    assert quest_op.page_score_config(8).method == "loop"  # tl.dot needs 16
    with override(page_score=PageScoreConfig(block_p=8)):
        assert quest_op.page_score_config(64).block_p == 16
        assert quest_op.page_score_config(8).block_p == 8
    rule = entmax_op.entmax_threshold_config
    assert (rule(8192).split, rule(8192).block_p, rule(8192).num_warps) == (1, 2048, 16)  # one program: blocks of 2048
    assert (rule(300).block_p, rule(300).num_warps) == (512, 4)
    assert (rule(37).block_p, rule(37).num_warps) == (64, 1)
    # 32 rows of 8,192 pages on 132 SMs: 4 programs a row (one per SM), 2,048 pages each, held
    assert (rule(8192, 32, 132).split, rule(8192, 32, 132).block_p) == (4, 2048)
    assert rule(2048, 32, 132).split == 4 and rule(2048, 32, 132).block_p == 512  # 512 pages a program at least
    assert rule(8192, 200, 132).split == 1  # more rows than SMs: no split
    # A 128K cache's 8,196 pages: 2,049 a program, held as 2,048 and a tail block of 32 (not 4,096)
    assert (rule(8196, 32, 132).split, rule(8196, 32, 132).block_p) == (4, 2048)
    assert entmax_op.tail_block(2049, 2048) == 32
    assert rule(2052, 32, 132).block_p == 512 and entmax_op.tail_block(513, 512) == 32  # 513 pages: 512 + 32
    with override(entmax_threshold=EntmaxThresholdConfig(split=64)):
        assert rule(8192, 32, 132).split == 4  # never more programs than SMs
        assert rule(8192, 1, 132).split == 64


def test_sketch_score_config_by_shape():
    rule = sketch_op.sketch_score_config
    assert rule(16, 64) == SketchScoreConfig()  # the Llama shape: half2, 8 pages of 16 a program, one warp
    assert rule(16, 64).method == "half2" and rule(4, 64).method == "half2"
    # Pages above HALF2_PAGE take rows, with at most ROWS_TOKENS tokens a program
    assert (rule(64, 64).method, rule(64, 64).block_p) == ("rows", 2)
    fallback = rule(16, 7)  # 7 code bytes a token are not whole words: the sum, in its own tile
    assert (fallback.method, fallback.block_p, fallback.num_warps) == ("sum", sketch_op.SUM_BLOCK_P, sketch_op.SUM_WARPS)
    with override(sketch_score=SketchScoreConfig(method="dot", block_p=2)):
        assert rule(8, 64).method == "sum" and rule(8, 64).block_p == 2  # tl.dot needs 16 token rows
        assert rule(16, 7).method == "dot"


# --------------------------------------------------------------------------------------------------
# Overridden in a scope


def test_override_applies_inside_the_scope_only():
    wide = AttentionConfig(block_t=128)
    assert config.current(AttentionConfig) == AttentionConfig() and config.active() == {}
    with override(attention=wide, select_top=SelectTopConfig(method="program")):
        assert config.current(AttentionConfig) is wide
        assert attention_op.attention_config(2048, 1, 8, 128).block_t == 128
        assert select_op.select_top_config(14336, torch.bfloat16).method == "program"
        assert set(config.active()) == {"attention", "select_top"}
    assert config.current(AttentionConfig) == AttentionConfig() and config.active() == {}
    assert select_op.select_top_config(14336, torch.bfloat16).method == "histogram"


def test_override_is_restored_after_an_exception():
    with pytest.raises(RuntimeError, match="inside"):
        with override(gemv=GemvConfig(fuse_epilogue=False)):
            raise RuntimeError("inside")
    assert config.current(GemvConfig) == GemvConfig() and config.active() == {}


def test_overrides_nest():
    outer, inner = AttentionConfig(block_t=32), AttentionConfig(block_t=128)
    pages = PageScoreConfig(method="loop")
    with override(attention=outer, page_score=pages):
        with override(attention=inner):
            assert config.current(AttentionConfig) is inner
            assert config.current(PageScoreConfig) is pages  # the outer override of another kernel stays
        assert config.current(AttentionConfig) is outer
    assert config.active() == {}


def test_override_is_per_thread():
    """Another thread neither sees this thread's override nor leaks its own into it."""
    entered, checked = threading.Event(), threading.Event()
    seen = {}

    def worker():
        seen["outer"] = config.current(AttentionConfig)
        with override(attention=AttentionConfig(block_t=32)):
            entered.set()
            checked.wait(10)
            seen["inner"] = config.current(AttentionConfig)

    with override(attention=AttentionConfig(block_t=128)):
        thread = threading.Thread(target=worker)
        thread.start()
        assert entered.wait(10)
        assert config.current(AttentionConfig).block_t == 128
        checked.set()
        thread.join()
    assert seen == {"outer": AttentionConfig(), "inner": AttentionConfig(block_t=32)}


def test_override_refuses_unknown_kernels_and_wrong_types():
    with pytest.raises(TypeError, match="unknown kernel 'merge'"):
        with override(merge=AttentionConfig()):
            pass
    with pytest.raises(TypeError, match="takes a SelectTopConfig, got AttentionConfig"):
        with override(select_top=AttentionConfig()):
            pass
    assert config.active() == {}


# --------------------------------------------------------------------------------------------------
# Kernels under an override still match the references


def _attention_inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    b, h_kv, group, n, d, block = 2, 2, 2, 64, 32, 4
    q = torch.randn(b, h_kv * group, d, generator=g)
    keys, values = torch.randn(b, h_kv, n, d, generator=g), torch.randn(b, h_kv, n, d, generator=g)
    k_max = 10
    indices = torch.stack([torch.randperm(n // block, generator=g)[:k_max] for _ in range(b * h_kv)])
    indices = indices.view(b, h_kv, k_max)
    sel = Selection(indices.int().to(DEVICE), torch.tensor([[10, 7], [3, 0]], dtype=torch.int32, device=DEVICE),
                    torch.randn(b, h_kv, k_max, generator=g).to(DEVICE), block)
    start, length = torch.tensor([0, 5], device=DEVICE), torch.tensor(n - 3, device=DEVICE)
    return q.to(DEVICE), keys.to(DEVICE), values.to(DEVICE), sel, start, length, d**-0.5


@pytest.mark.parametrize("mode", ["softmax", "entmax15"])
def test_attention_under_an_override_matches_the_reference(mode):
    """Tiles of 16 tokens, 2 warps, chunks of 3 entries merged 16 at a time; threshold steps of 32."""
    args = _attention_inputs()
    cfg = AttentionConfig(block_t=16, num_warps=2, num_stages=2, chunk=3, block_c=16, merge_warps=1,
                          block_m=32, tau_warps=1, n_bisect=20)
    with override(attention=cfg):
        assert attention_op.attention_config(10, 4, 4, 128) == cfg
        attend = kernels.decode_attention if mode == "softmax" else kernels.decode_attention_entmax15
        out, second = attend.triton(*args)
    want = reference.decode_attention if mode == "softmax" else reference.decode_attention_entmax15
    torch.testing.assert_close((out, second), want(*args), rtol=1e-4, atol=1e-4)


def test_select_top_under_an_override_matches_the_reference():
    """bf16 rows of 300 entries by histograms in chunks of 64, then by one program with 2 warps."""
    g = torch.Generator().manual_seed(1)
    s = torch.randn(3, 300, generator=g).to(torch.bfloat16).to(DEVICE)
    count = torch.tensor([1, 150, 299], device=DEVICE)
    want = reference.select_top(s, count, 299, absolute=True)
    for cfg in (SelectTopConfig(method="auto", hist_min_n=300, hist_chunk=64), SelectTopConfig(num_warps=2)):
        with override(select_top=cfg):
            got = kernels.select_top.triton(s, count, 299, absolute=True, workspace=WORKSPACE)
            assert torch.equal(got, want), cfg
    assert workspace_is_zero()  # histograms zero again


@pytest.mark.parametrize(
    "d_out, dot, gather, tiles",
    [
        (6144, False, False, (64, 128)),  # one row, few outputs (q|k|v)
        (28672, False, False, (64, 64)),  # one row, wide (gate|up)
        (28672, False, True, (64, 128)),  # the index kernel keeps its tiles
        (4096, True, False, (128, 32)),  # row blocks, few outputs
        (28672, True, False, (256, 16)),  # row blocks, wide
    ],
)
def test_gemv_tiles_follow_the_shapes_unless_set(d_out, dot, gather, tiles):
    cfg = gemv_op.gemv_config(4096, d_out, 1, dot=dot, gather=gather)
    assert (cfg.block_n, cfg.block_k) == tiles
    with override(gemv=GemvConfig(block_n=32, block_k=16)):  # set tiles are used as they are
        cfg = gemv_op.gemv_config(4096, d_out, 1, dot=dot, gather=gather)
        assert (cfg.block_n, cfg.block_k) == (32, 16)
    with override(gemv=GemvConfig(wide_d_out=1 << 30)):  # nothing is wide
        cfg = gemv_op.gemv_config(4096, d_out, 1, dot=dot, gather=gather)
        assert (cfg.block_n, cfg.block_k) == ((128, 32) if dot else (64, 128))
    # a segment of per-column thresholds caps the outputs per block
    assert gemv_op.gemv_config(4096, d_out, 1, align=48, dot=dot).block_n == 16


@pytest.mark.parametrize("fuse, prefetch, tile_sum, atomic_sum, dot_from_rows",
                         [(True, False, False, False, 2), (False, False, False, False, 2), (True, True, True, False, 2),
                          (True, False, True, True, 2), (True, False, False, False, 1)])
def test_sparse_gemv_under_an_override_matches_the_reference(fuse, prefetch, tile_sum, atomic_sum, dot_from_rows):
    """Blocks of 16 outputs, tiles of 16 features, 3 slices (48 kept features, or all 90 scanned):
    the epilogue in the last program or launched (in blocks of 32); the scan with its activations
    loaded a tile ahead or not, at one row with each tile summed at once or not, with the slices
    added atomically into one sum, and one row in a tl.dot row block."""
    g = torch.Generator().manual_seed(2)
    x, w_t, bias = torch.randn(2, 90, generator=g), torch.randn(90, 40, generator=g), torch.randn(40, generator=g)
    idx = torch.stack([torch.randperm(90, generator=g)[:48] for _ in range(2)]).int()
    x, w_t, bias, idx = (t.to(DEVICE) for t in (x, w_t, bias, idx))
    cfg = GemvConfig(block_n=16, block_k=16, num_warps=2, split=3, sum_block=32, fuse_epilogue=fuse, min_fused_split=2,
                     prefetch=prefetch, tile_sum=tile_sum, atomic_sum=atomic_sum, dot_from_rows=dot_from_rows)
    with override(gemv=cfg):
        assert gemv_op.gemv_config(48, 40, 2) == cfg and gemv_op.gemv_config(90, 40, 2).split == 3
        got = kernels.sparse_gemv_index.triton(x, idx, w_t, bias, workspace=WORKSPACE)
        got_t = kernels.sparse_gemv_threshold.triton(x, 0.5, w_t, bias, workspace=WORKSPACE)
        # one row: the loop, or a row block
        got_1 = kernels.sparse_gemv_threshold.triton(x[:1], 0.5, w_t, bias, workspace=WORKSPACE)
    torch.testing.assert_close(got, reference.sparse_gemv_index(x, idx, w_t, bias), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_t, reference.sparse_gemv_threshold(x, 0.5, w_t, bias), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_1, reference.sparse_gemv_threshold(x[:1], 0.5, w_t, bias), rtol=1e-4, atol=1e-4)
    assert workspace_is_zero()  # arrival counters zero again


def test_page_bound_and_entmax_threshold_under_overrides_match_the_references():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 32, generator=g).to(DEVICE)
    mn = torch.randn(1, 2, 37, 32, generator=g).to(DEVICE)
    mx = mn + 1
    with override(page_score=PageScoreConfig(method="loop", block_p=16, num_warps=1)):
        got = kernels.quest_page_bound_grouped.triton(q, mn, mx, 0.25, "max")
    torch.testing.assert_close(got, reference.quest_page_bound_grouped(q, mn, mx, 0.25, "max"), rtol=1e-5, atol=1e-5)
    m, s = torch.randn(3, 100, generator=g, dtype=torch.float64), torch.rand(3, 100, generator=g, dtype=torch.float64)
    n = torch.randint(0, 5, (3, 100), generator=g)
    with override(entmax_threshold=EntmaxThresholdConfig(block_p=32, num_warps=1)):
        assert entmax_op.entmax_threshold_config(100).block_p == 32  # four blocks per pass
        tau = kernels.gaussian_entmax_threshold.triton(m.to(DEVICE), s.to(DEVICE), n.to(DEVICE))
    torch.testing.assert_close(tau.cpu(), reference.gaussian_entmax_threshold(m, s, n), rtol=1e-9, atol=1e-9)


# --------------------------------------------------------------------------------------------------
# No module-level knobs

OLD_KNOBS = {
    "decode_attention": ("BLOCK_T", "NUM_WARPS", "NUM_STAGES", "TARGET_PROGRAMS", "MIN_CHUNK_TOKENS", "BLOCK_C",
                         "MAX_BLOCK_C", "MERGE_WARPS", "FUSE_MERGE", "FUSED_BLOCK_C", "BLOCK_M", "TAU_WARPS",
                         "N_BISECT"),
    "select_top": ("NUM_WARPS", "INTERP_STEPS", "BF16_BITS", "METHOD", "HIST_CHUNK", "HIST_MIN_N"),
    "sparse_gemv": ("BLOCK_N", "BLOCK_K", "NUM_WARPS", "NUM_STAGES", "TARGET_PROGRAMS", "MIN_TILES_PER_SPLIT",
                    "SUM_BLOCK", "FUSE_EPILOGUE", "MIN_FUSED_SPLIT"),
    "page_score": ("METHOD", "METHODS", "BLOCK_P", "NUM_WARPS"),
    "entmax_threshold": ("BLOCK_P", "NUM_WARPS"),
}
OPS = {"decode_attention": attention_op, "select_top": select_op, "sparse_gemv": gemv_op, "page_score": quest_op,
       "sketch_page_bound": sketch_op, "entmax_threshold": entmax_op, "cache_append": append_op,
       "gathered_logits": gathered_op}
# Each op's seam and its Triton module, and the shared modules.
MODULES = {**OPS, **{f"{name}.kernel": m.kernel for name, m in OPS.items()},
           "workspace": workspace, "config": config, "route": kernels.route}


def test_the_old_knobs_are_gone():
    left = {name: [a for a in attrs if hasattr(MODULES[name], a) or hasattr(MODULES[f"{name}.kernel"], a)]
            for name, attrs in OLD_KNOBS.items()}
    assert left == {name: [] for name in OLD_KNOBS}
    assert set(workspace.SIZES) == {"gemv_counters", "gemv_sums", "select_histograms", "barrier_counters"}


def test_kernel_modules_hold_no_mutable_state():
    """No module of `policyzoo.kernels` keeps a dict, list or set: scratch lives in a `Workspace` the
    caller owns, configs in a context variable (`config.override`)."""
    mutable = []
    for info in pkgutil.walk_packages(kernels.__path__, "policyzoo.kernels."):
        module = importlib.import_module(info.name)
        mutable += [f"{info.name}.{name}" for name, value in vars(module).items()
                    if not name.startswith("__") and type(value) in (dict, list, set, bytearray)]
    assert mutable == []


def _constants() -> dict:
    """Every public UPPER_CASE module attribute of the kernel modules, by identity and value, less
    what Triton's CPU interpreter copies into a kernel's module the first time it runs one (its own
    module globals, such as its ``T = TypeVar("T")``): that is Triton's doing, not a knob of ours."""
    from triton.runtime import interpreter

    return {(mod, name): (id(value), repr(value)) for mod, m in MODULES.items()
            for name, value in vars(m).items()
            if name.isupper() and not name.startswith("_") and getattr(interpreter, name, None) is not value}


def test_running_the_kernels_assigns_no_module_constant():
    before = _constants()
    for attend in (kernels.decode_attention, kernels.decode_attention_entmax15):
        attend.triton(*_attention_inputs())
    s = torch.randn(2, 200).to(torch.bfloat16).to(DEVICE)
    with override(select_top=SelectTopConfig(method="histogram", hist_chunk=64)):
        kernels.select_top.triton(s, torch.tensor([3, 50], device=DEVICE), 50, workspace=WORKSPACE)
    kernels.select_top.triton(s.float(), torch.tensor([3, 50], device=DEVICE), 50)
    x, w_t = torch.randn(1, 300).to(DEVICE), torch.randn(300, 70).to(DEVICE)
    kernels.sparse_gemv_threshold.triton(x, 0.5, w_t, workspace=WORKSPACE)
    pages = torch.randn(1, 2, 20, 16).to(DEVICE)
    kernels.quest_page_bound.triton(torch.randn(1, 4, 16).to(DEVICE), pages, pages + 1, 1.0)
    kernels.gaussian_entmax_threshold.triton(x, x.abs(), torch.ones_like(x))
    assert _constants() == before


def test_overrides_parse_from_strings():
    """`parse_overrides`: a command line's ``kernel.field=value`` settings, each kernel's defaults with
    the fields named, values read as their fields' types; what a config refuses is refused here."""
    got = config.parse_overrides(["select_pages.finish_min_row=0", "attention.block_t=32",
                                  "select_pages.finish_warps=16", "gemv.prefetch=true", "select_top.method=program"])
    assert got == {"select_pages": SelectPagesConfig(finish_min_row=0, finish_warps=16),
                   "attention": AttentionConfig(block_t=32), "gemv": GemvConfig(prefetch=True),
                   "select_top": SelectTopConfig(method="program")}
    assert config.parse_overrides([]) == {}
    with config.override(**got):
        assert config.current(SelectPagesConfig).finish_warps == 16
    for bad, message in (("attention", "expected kernel.field=value"), ("nokernel.a=1", "unknown kernel 'nokernel'"),
                         ("attention.nofield=1", "AttentionConfig has no field 'nofield'"),
                         ("attention.block_t=abc", "expected an int"), ("gemv.prefetch=1", "expected true or false"),
                         ("attention.block_t=48", "block_t must be a power of two")):
        with pytest.raises(ValueError, match=message):
            config.parse_overrides([bad])
