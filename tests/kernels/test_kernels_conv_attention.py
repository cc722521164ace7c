"""The conv2d and flash-attention library kernels: values against numpy references, the tiling
paths (ragged tiles, key blocks, input bands), causal tile skipping, and pinned input errors."""

from __future__ import annotations

import re

import numpy as np
import pytest

from trnsim import Chip, KernelError
from trnsim.config import load_config
from trnsim.kernels import get_kernel
from trnsim.kernels.check import check_entry


def _check(name, shape, dtype, config, params):
    res = check_entry(get_kernel(name), shape, dtype, config, params)
    assert res["ok"], res["errors"]
    return res


# ---- attention ---------------------------------------------------------------------------------

@pytest.mark.parametrize("shape, dtype, causal, config", [
    ((1, 2, 200, 64), "fp32", False, "trn2"),   # ragged S: a 72-query tile and a 200-key tile
    ((1, 1, 200, 64), "bf16", True, "trn2"),
    ((1, 1, 256, 128), "fp16", True, "trn3"),
    ((2, 1, 130, 128), "bf16", False, "trn3"),
    ((1, 1, 640, 32), "fp32", True, "trn2"),     # two key tiles, the second ragged and partly masked
    ((1, 5, 100, 32), "bf16", True, "trn2"),     # more heads than K/V buffers: head 4 reuses head 1's
])
def test_attention_matches_reference(shape, dtype, causal, config):
    _check("attention", shape, dtype, config, {"causal": causal})


def test_attention_custom_scale():
    _check("attention", (1, 1, 150, 64), "fp32", "trn2", {"scale": 0.5})


@pytest.mark.parametrize("shape, dtype, causal, config", [
    ((2, 3, 128, 64), "bf16", False, "trn1"),    # BERT's attention: heads of one tile each
    ((1, 1, 640, 32), "fp32", True, "trn2"),     # two key tiles, the second ragged and partly masked
])
def test_attention_dropout_matches_reference(shape, dtype, causal, config):
    # the reference drops the normalised probabilities at the same positions and scales by 1/(1-p)
    _check("attention", shape, dtype, config, {"causal": causal, "dropout_p": 0.1, "dropout_seed": 5})


def test_attention_dropout_is_one_vector_pass_per_score_tile():
    def counts(p):
        k = get_kernel("attention").make((1, 2, 1024, 64), "bf16", load_config("trn2"), {"dropout_p": p})
        return Chip("trn2").run(k, timing_only=True).report.instruction_counts

    # 8 query tiles x 2 key tiles of each of 2 heads: one dropout each, nothing else added
    with_dropout, without = counts(0.1), counts(0.0)
    assert with_dropout.pop("Dropout") == 2 * 8 * 2
    assert "Dropout" not in without
    assert with_dropout == without


@pytest.mark.parametrize("causal", [False, True])
def test_attention_key_blocks_are_loaded_once_per_head(causal):
    # 1300 keys in 512-key blocks: the blocks are the outer loop and every query tile walks each,
    # so K and V are read once, as when they stay resident
    res = _check("attention", (1, 1, 1300, 64), "bf16", "trn2", {"causal": causal, "kv_block": 512})
    resident = _check("attention", (1, 1, 1300, 64), "bf16", "trn2", {"causal": causal})
    assert res["report"].hbm_read_bytes == resident["report"].hbm_read_bytes
    assert res["report"].total_cycles < 1.25 * resident["report"].total_cycles


def test_attention_reloads_key_blocks_when_query_state_does_not_fit():
    # a 48 KiB-per-partition SBUF holds no head's query state beside two blocks: each group of
    # query tiles walks all blocks, reloading them (the NKI sample's scheme)
    cfg = load_config("trn2", ["core.sbuf.partition_bytes=48KiB"])
    res = check_entry(get_kernel("attention"), (1, 1, 1300, 64), "bf16", cfg, {"kv_block": 512})
    assert res["ok"], res["errors"]
    once = 4 * 1300 * 64 * 2  # q, k, v read once (bf16)
    assert res["report"].hbm_read_bytes > 2 * once


def test_attention_causal_skips_tiles_above_the_diagonal():
    kern = {c: get_kernel("attention").make((1, 1, 1024, 64), "bf16", load_config("trn2"), {"causal": c})
            for c in (False, True)}
    counts = {c: Chip("trn2").run(k, timing_only=True).report.instruction_counts for c, k in kern.items()}
    # 8 query tiles x 2 key tiles, 1 q.kT + 4 p.v matmuls each
    assert counts[False]["MatMul"] == 16 * 5
    # causal: query tiles 0-3 skip key tile 1 (12 q.kT), and query tile i stops its keys at its
    # diagonal, so its p.v runs over i+1 128-key chunks (36)
    assert counts[True]["MatMul"] == 12 + 36
    # masks: the diagonal key tile of every query tile
    assert counts[True]["AffineSelect"] == 8
    assert "AffineSelect" not in counts[False]


def test_attention_pipeline_keeps_engines_busy_and_causal_is_cheaper():
    def run(causal):
        k = get_kernel("attention").make((1, 2, 2048, 64), "bf16", load_config("trn2"), {"causal": causal})
        return Chip("trn2").run(k, timing_only=True).report

    full, causal = run(False), run(True)
    # VectorE bounds this kernel; with the stages issued in order it was ~35% busy
    assert full.engines["Vector"].active_percent > 60
    assert causal.total_cycles < 0.8 * full.total_cycles
    assert run(True).total_cycles == causal.total_cycles


def test_attention_values_are_bit_identical_across_runs():
    entry = get_kernel("attention")
    outs = [check_entry(entry, (1, 1, 200, 64), "bf16", "trn2", {"causal": True})["report"].total_cycles
            for _ in range(2)]
    assert outs[0] == outs[1]
    cfg = load_config("trn2")
    rng = np.random.default_rng(1)
    inputs = {n: rng.standard_normal((1, 1, 200, 64), dtype=np.float32) for n in "qkv"}
    vals = [Chip(cfg).run(entry.make((1, 1, 200, 64), "bf16", cfg, {}), inputs)["out"] for _ in range(2)]
    assert np.array_equal(vals[0].view(np.uint16), vals[1].view(np.uint16))


@pytest.mark.parametrize("shape, params, message", [
    ((1, 1, 128, 192), {}, "attention: head dim D=192 exceeds 128 (the PE array's contraction partitions on trn2)"),
    ((1, 1, 128, 64), {"scale": -1.0}, "attention: scale must be a positive number, got -1.0"),
    ((1, 1, 128, 64), {"kv_block": 100}, "attention: kv_block must be 0 (auto) or a positive multiple of 512 keys, "
                                          "got 100"),
    ((1, 1, 128, 64), {"causal": "yes"}, "attention: causal must be true or false, got 'yes'"),
    ((1, 1, 128, 64), {"dropout_p": 1.0}, "attention: dropout_p must be a probability in [0, 1), got 1.0"),
])
def test_attention_bad_input(shape, params, message):
    with pytest.raises(KernelError, match=f"^{re.escape(message)}$"):
        get_kernel("attention").make(shape, "bf16", load_config("trn2"), params)


def test_attention_rejects_fp8():
    with pytest.raises(KernelError, match=r"^kernel 'attention': dtype fp8_e4m3 not supported; expected one of "
                                          r"bf16, fp16, fp32$"):
        get_kernel("attention").make((1, 1, 128, 64), "fp8_e4m3", load_config("trn2"), {})


# ---- conv2d ------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape, dtype, params, config", [
    ((1, 3, 8, 8, 4, 3), "fp32", {}, "trn2"),
    ((1, 3, 8, 8, 4, 3), "bf16", {"padding": "2"}, "trn2"),          # as the CLI passes it
    ((2, 130, 9, 7, 140, 3), "bf16", {"padding": 1}, "trn2"),        # ragged C and K tiles
    ((1, 5, 11, 10, 6, 3), "fp16", {"stride": 2, "padding": 2}, "trn3"),
    ((1, 4, 6, 6, 3, 4), "fp32", {"padding": "same"}, "trn3"),       # even filter: 1 before, 2 after
    ((1, 8, 3, 600, 8, 1), "bf16", {}, "trn2"),                      # rows wider than a PSUM bank
    ((1, 2, 2, 2, 3, 3), "fp32", {"padding": 3}, "trn2"),            # bands made only of padding
])
def test_conv2d_matches_reference(shape, dtype, params, config):
    _check("conv2d", shape, dtype, config, params)


def test_conv2d_small_sbuf_uses_row_bands_and_weight_groups():
    tiny = load_config("trn2", {"core.sbuf.partition_bytes": "4KiB"})
    res = _check("conv2d", (2, 3, 30, 30, 4, 3), "fp32", tiny, {"padding": 1})
    assert res["report"].instruction_counts["DmaCopy"] > 2 * 2 + 1  # several input bands per image
    small = load_config("trn2", {"core.sbuf.partition_bytes": "16KiB"})
    res = _check("conv2d", (1, 130, 12, 12, 140, 3), "bf16", small, {"padding": 1})
    # one output-channel tile of weights at a time: the image is loaded once per K tile
    assert res["report"].hbm_read_bytes > 2 * 130 * 12 * 12 * 2


def test_conv2d_matmul_count_and_tensor_engine_busy():
    k = get_kernel("conv2d").make((2, 256, 56, 56, 256, 3), "bf16", load_config("trn2"), {"padding": 1})
    rep = Chip("trn2").run(k, timing_only=True).report
    # 56 output rows in bands of whole 9-row (504-pixel) tiles: 7 tiles per image
    assert rep.instruction_counts["MatMul"] == 2 * 7 * 2 * 2 * 9
    # padded rows are staged, so TensorE does not wait on one short DMA descriptor per row (72% before)
    assert rep.engines["Tensor"].active_percent > 85


@pytest.mark.parametrize("shape, params, message", [
    ((1, 3, 4, 4, 8, 5), {}, "conv2d: filter 5x5 is larger than the padded input 4x4 (H x W = 4x4 with padding 0+0)"),
    ((1, 3, 4, 4, 8, 3), {"padding": "same", "stride": 2}, "conv2d: padding='same' needs stride 1, got stride 2"),
    ((1, 3, 4, 4, 8, 3), {"stride": 0}, "conv2d: stride must be an integer >= 1, got 0"),
    ((1, 3, 4, 4, 8, 3), {"padding": "full"}, "conv2d: padding must be an integer >= 0, 'valid' or 'same', "
                                               "got 'full'"),
])
def test_conv2d_bad_input(shape, params, message):
    with pytest.raises(KernelError, match=f"^{re.escape(message)}$"):
        get_kernel("conv2d").make(shape, "bf16", load_config("trn2"), params)


@pytest.mark.parametrize("causal", [True, False])
def test_long_attention_keeps_each_query_tiles_running_state(causal):
    """10,048 keys walk the key blocks outermost with every query tile's max and sum held in
    SBUF between visits; a shared rotating pool reused a tile's live running max there."""
    from trnsim.kernels.attention import build_attention

    kern = build_attention(1, 1, 10048, 128, "bf16", "trn2", causal=causal)
    assert len(kern.instructions) > 10_000
