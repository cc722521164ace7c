"""The multi-tensor kernel of a compiled optimizer step (trnsim.kernels.foreach): its values
against the numpy definition for each preset over ragged tensor lists, its HBM traffic (each
tensor read and written once, the state updated in place), and its errors."""

from __future__ import annotations

import pytest

from trnsim import Chip
from trnsim.config import load_config
from trnsim.isa import KernelError
from trnsim.kernels import get_kernel
from trnsim.kernels.check import check_entry
from trnsim.kernels.foreach import PATTERNS, build_foreach_fused, shares
from trnsim.kernels.fused import FULL, Program

# a ragged list: a matrix, a bias, a tensor shorter than the partitions, one with a remainder
SIZES = (256 * 300, 768, 100, 128 * 5 + 37)


@pytest.mark.parametrize("config", ["trn2", "trn3"])
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
def test_pattern_matches_numpy(pattern, config):
    for dtype in ("fp32", "bf16"):
        out = check_entry(get_kernel("foreach_fused"), (len(SIZES), sum(SIZES)), dtype, config,
                          {"pattern": pattern, "sizes": SIZES, "scalar_args": pattern == "adamw_host"})
        assert out["ok"], f"{pattern} {dtype}: {out['errors']}"


def test_host_scalars_are_one_argument_block_each():
    for config in ("trn2", "trn3"):
        out = check_entry(get_kernel("foreach_fused"), (len(SIZES), sum(SIZES)), "fp32", config,
                          {"pattern": "adamw_host", "sizes": SIZES, "scalar_args": True})
        assert out["ok"], out["errors"]
    k = build_foreach_fused(len(SIZES), sum(SIZES), "fp32", "trn2", pattern="adamw_host", sizes=SIZES, scalar_args=True)
    assert k.tensors["in4"].shape == (len(SIZES),) and "in4_0" not in k.tensors
    with pytest.raises(KernelError, match=r"^foreach_fused: scalar input 4 is a host argument \(scalar_args\); it "
                                          r"cannot be written$"):
        build_foreach_fused(2, 100, pattern="adamw", scalar_args=True)


def test_each_tensor_moves_through_hbm_once_and_state_is_updated_in_place():
    k = build_foreach_fused(len(SIZES), sum(SIZES), "fp32", "trn2", pattern="adamw", sizes=SIZES)
    n = sum(SIZES)
    inout = sorted(name for name, t in k.tensors.items() if t.kind == "inout")
    assert inout == sorted(f"in{i}_{t}" for t in range(len(SIZES)) for i in (0, 2, 3, 4))  # p, m, v, step
    assert not [t for t in k.tensors.values() if t.kind == "output"]
    rep = Chip("trn2").run(k, timing_only=True).report
    # reads p, g, m, v (4 B each) and one step per tensor; writes p, m, v and the step
    assert rep.hbm_read_bytes == 4 * 4 * n + 4 * len(SIZES)
    assert rep.hbm_write_bytes == 3 * 4 * n + 4 * len(SIZES)


def test_faster_than_the_eager_step_on_trn2():
    """GPT-2 small's 52 tensors: the fused step against the step's 8 eager foreach kernels as
    generic streams (20 tensor passes: each one's bytes at the DMA rate, datasheet §6)."""
    from trnsim.kernels import build_spec

    sizes = [65536, 32768] + [256, 256, 196608, 768, 65536, 256, 256, 256, 262144, 1024, 262144, 256] * 4 + [256, 256]
    cfg = load_config("trn2")
    fused = Chip(cfg).run(build_foreach_fused(len(sizes), sum(sizes), "fp32", cfg, sizes=sizes), timing_only=True)
    n = sum(sizes)
    eager = 0.0
    for reads in (2, 1, 2, 1, 1, 1, 1, 3):  # lerp, mul, addcmul, mul, sqrt, div, add, addcdiv
        k = build_spec("stream", (reads * n, n, n), "fp32", cfg, {"engine": "vector", "binary": reads > 1})
        eager += Chip(cfg).run(k, timing_only=True).report.total_us
    assert fused.report.total_us < 0.6 * eager
    assert fused.report.bound == "DMA/HBM"


def test_shares_follow_sizes_and_split_every_tensor():
    assert shares(3, 60, (10, 20, 30)) == [10, 20, 30]
    assert shares(3, 30, (10, 20, 30)) == [5, 10, 15]
    assert sum(shares(3, 31, (10, 20, 30))) == 31


def test_errors_are_one_line():
    with pytest.raises(KernelError, match=r"^foreach_fused: sizes must be 2 element counts >= 0 \(one per tensor\), got 3$"):
        build_foreach_fused(2, 100, sizes=(1, 2, 3))
    with pytest.raises(KernelError, match=r"^foreach_fused: sizes must be element counts joined by ','"):
        build_foreach_fused(2, 100, sizes="1,x")
    red = Program(((FULL, "fp32"),), (("red", "add", 0),), ((1, "fp32"),))
    with pytest.raises(KernelError, match=r"^foreach_fused: a multi-tensor program is elementwise on 'full' and "
                                          r"'scalar' values only$"):
        build_foreach_fused(2, 100, program=red)
    with pytest.raises(KernelError, match=r"^foreach_fused: inplace pair \(5, 0\) must name an output and an input"):
        build_foreach_fused(2, 100, inplace=((5, 0),))
    with pytest.raises(KernelError, match=r"^foreach_fused: inplace must be \(output, input\) pairs, e\.g\. "
                                          r"inplace=0:0,1:2; got '0'$"):
        build_foreach_fused(2, 100, inplace="0")
    with pytest.raises(KernelError, match=r"^foreach_fused: program must be a trnsim\.kernels\.fused\.Program"):
        build_foreach_fused(2, 100, program="x")
    with pytest.raises(KernelError, match=r"^foreach_fused: 2 elements leave tensor 2 of 3 with none; give each "
                                          r"tensor at least one \(ELEMS >= TENSORS, sizes > 0\)$"):
        build_foreach_fused(3, 2)


def test_cli_errors_exit_2_in_one_line(capsys):
    from trnsim.cli import main

    for params in (["inplace=0"], ["program=x"], ["sizes=1,2"]):
        assert main(["kernel", "foreach_fused", "--shape", "3x30", "--param", *params]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("trnsim: error: foreach_fused: ") and "\n" not in err


def test_a_tensor_too_small_to_share_keeps_the_kernel_on_one_core():
    from trnsim.kernels.registry import split_spec

    assert split_spec("foreach_fused", (2, 1001), {"sizes": (1, 1000)}, 2) == [(2, 1001)]
    assert split_spec("foreach_fused", (2, 2000), {"sizes": (1000, 1000)}, 2) == [(2, 1000), (2, 1000)]
