"""TensorE against the weight-stationary closed forms.

The measurement: a kernel loads the operands of F folds into one SBUF tile with one DMA, then
issues F ``nc_matmul``: fold f multiplies its own 128x128 bf16 stationary (distinct, used once)
with its own [128, M] bf16 moving tile and accumulates into one PSUM bank. The figure is the
TensorE time in PE cycles from the start of the first LoadStationary to the instant the last
fold's result is visible in PSUM (the last MultiplyMoving's end plus its R+C-2 fill/drain). The
dI/dt power ramp is off (``core.tensor.throttle_initial_util=1``): neither form has one.

The forms (R = C = 128 PE rows/cols, F folds, M moving free size):

* pipelined weight stationary, ``R + F*max(M,R) + (R+C-2)``: the next stationary loads (R cycles)
  while the current fold streams. For M < R it pads the last fold to R cycles, though no next
  stationary waits for it: that fold ends M cycles after it starts.
* SCALE-Sim v3 weight stationary, ``F*(2R+C+M-2)`` (load, stream, drain, one fold at a time;
  ``core.tensor.overlap_load_stationary=false``). SCALE-Sim 3.0.0 itself prints one cycle less: its
  "Total Cycles" is the last cycle index counted from 0.

Both forms load a stationary in R cycles; Trainium's fast LoadStationary takes ~C/4 = 32 (datasheet
§7), so they are checked with ``load_stationary_speedup=1`` and the shipped config against its own
derivation.
"""

import numpy as np
import pytest

from trnsim import Chip, Kernel, bfloat16

NO_RAMP = {"core.tensor.throttle_initial_util": 1.0}
#: the forms' array: a stationary loads in R cycles, one row per cycle
FORM_ARRAY = {**NO_RAMP, "core.tensor.load_stationary_speedup": 1}
NO_OVERLAP = {"core.tensor.overlap_load_stationary": False}


def fold_kernel(chip: Chip, folds: int, m: int, *, store: bool = False) -> Kernel:
    """F folds of a GEMM, operands resident in SBUF before the first LoadStationary; ``store``
    appends a PSUM->SBUF copy and a DMA to output ``out`` for a value check."""
    t = chip.config.core.tensor
    rows, cols = t.pe_rows, t.stationary_max_free
    width = folds * (cols + m)
    k = chip.kernel(f"ws_folds_F{folds}_M{m}")
    src = k.input("ops", (rows, width), "bf16")
    ops = k.sbuf((rows, width), "bf16", name="ops")
    k.dma_copy(ops, src)
    acc = k.psum((cols, m), "fp32", name="acc")
    for f in range(folds):
        base = f * (cols + m)
        k.nc_matmul(acc, ops[:, base:base + cols], ops[:, base + cols:base + cols + m], accumulate=f > 0)
    if store:
        res = k.sbuf((cols, m), "fp32", name="res")
        k.tensor_copy(res, acc)
        k.dma_copy(k.output("out", (cols, m), "fp32"), res)
    return k


def measure(chip: Chip, folds: int, m: int) -> int:
    """PE cycles from the first LoadStationary to the last fold's result visible in PSUM."""
    rep = chip.run(fold_kernel(chip, folds, m), timing_only=True).report
    loads = rep.segments("Tensor (LS)")
    assert len(loads) == folds
    dma_end = max(end for lane, _, _, end, _ in rep.timeline if lane.startswith("q"))
    first = min(start for _, _, start, _, _ in loads)
    assert first >= dma_end  # no LoadStationary before the operands are in SBUF
    span, rest = divmod(rep.total_ticks - first, chip.config.ticks_per_cycle("Tensor"))
    assert rest == 0
    return span


R = C = 128
FOLDS = (1, 16, 64)
MOVING = (64, 128, 512)


@pytest.fixture(scope="module")
def form_chip():
    return Chip("trn2", FORM_ARRAY)


@pytest.mark.parametrize("folds", FOLDS)
@pytest.mark.parametrize("m", MOVING)
def test_pipelined_ws_form_within_2_percent(form_chip, folds, m):
    sim = measure(form_chip, folds, m)
    form = R + folds * max(m, R) + (R + C - 2)
    if m >= R:
        assert abs(sim - form) <= 0.02 * form
    else:
        # the form pads the last fold to R cycles; it has no next stationary to wait for
        assert sim == form - (R - m)
    exact = R + (folds - 1) * max(m, R) + m + (R + C - 2)
    assert abs(sim - exact) <= 0.02 * exact


@pytest.mark.parametrize("folds", FOLDS)
@pytest.mark.parametrize("m", MOVING)
def test_no_overlap_matches_scalesim_ws_form_within_1_percent(folds, m):
    chip = Chip("trn2", {**FORM_ARRAY, **NO_OVERLAP})
    sim = measure(chip, folds, m)
    form = folds * (2 * R + C + m - 2)
    assert abs(sim - form) <= 0.01 * form


@pytest.mark.parametrize("folds, m", [(1, 64), (16, 128), (64, 512)])
def test_shipped_fast_load_stationary_beats_the_r_cycle_form(folds, m):
    """trn2 as shipped loads a stationary in 128/4 = 32 cycles and issues an MM every
    max(64, M) cycles (datasheet §7), so it is faster than the R-cycle-load form."""
    sim = measure(Chip("trn2", NO_RAMP), folds, m)
    issue = max(64, m)
    derived = 32 + (folds - 1) * issue + issue + (R + C - 2)
    assert abs(sim - derived) <= 0.02 * derived
    assert sim < R + folds * max(m, R) + (R + C - 2)


def test_measured_interval_is_first_load_to_last_result(form_chip):
    """The interval the tables print: first LoadStationary start to the last MultiplyMoving's
    end plus the R+C-2 fill/drain, read off the timeline."""
    rep = form_chip.run(fold_kernel(form_chip, 4, 256), timing_only=True).report
    tpc = form_chip.config.ticks_per_cycle("Tensor")
    first_ls = min(s for _, _, s, _, _ in rep.segments("Tensor (LS)"))
    last_mm = max(e for _, _, _, e, _ in rep.segments("Tensor"))
    assert len(rep.segments("Tensor")) == 4
    assert measure(form_chip, 4, 256) == (last_mm - first_ls) // tpc + (R + C - 2)


def test_fold_kernel_computes_the_gemm(form_chip):
    folds, m = 4, 128
    rng = np.random.default_rng(7)
    ops = rng.standard_normal((R, folds * (C + m))).astype(np.float32)
    out = form_chip.run(fold_kernel(form_chip, folds, m, store=True), {"ops": ops})["out"]
    x = ops.astype(bfloat16.np_dtype).astype(np.float64)
    want = sum(x[:, f * (C + m):f * (C + m) + C].T @ x[:, f * (C + m) + C:(f + 1) * (C + m)] for f in range(folds))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)
