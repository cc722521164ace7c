"""TensorE against the weight-stationary closed forms (benchmarks/fidelity_tensor.py explains
the measurement and the findings; this file asserts its tolerances on a subset, without SCALE-Sim).

R = C = 128 PE rows/cols, F folds (distinct stationaries, each used once), M moving free size.
"""

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from trnsim import Chip, bfloat16

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "fidelity_tensor.py"
_spec = importlib.util.spec_from_file_location("fidelity_tensor", _PATH)
ft = importlib.util.module_from_spec(_spec)
sys.modules["fidelity_tensor"] = ft  # dataclasses look their module up here
_spec.loader.exec_module(ft)

R = C = 128
FOLDS = (1, 16, 64)
MOVING = (64, 128, 512)


@pytest.fixture(scope="module")
def form_chip():
    return Chip("trn2", ft.FORM_ARRAY)


@pytest.mark.parametrize("folds", FOLDS)
@pytest.mark.parametrize("m", MOVING)
def test_pipelined_ws_form_within_2_percent(form_chip, folds, m):
    sim = ft.measure(form_chip, folds, m)
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
    chip = Chip("trn2", {**ft.FORM_ARRAY, **ft.NO_OVERLAP})
    sim = ft.measure(chip, folds, m)
    form = folds * (2 * R + C + m - 2)
    assert abs(sim - form) <= 0.01 * form


@pytest.mark.parametrize("folds, m", [(1, 64), (16, 128), (64, 512)])
def test_shipped_fast_load_stationary_beats_the_r_cycle_form(folds, m):
    """trn2 as shipped loads a stationary in 128/4 = 32 cycles and issues an MM every
    max(64, M) cycles (datasheet §7), so it is faster than the R-cycle-load form."""
    sim = ft.measure(Chip("trn2", ft.NO_RAMP), folds, m)
    issue = max(64, m)
    derived = 32 + (folds - 1) * issue + issue + (R + C - 2)
    assert abs(sim - derived) <= 0.02 * derived
    assert sim < R + folds * max(m, R) + (R + C - 2)


def test_measured_interval_is_first_load_to_last_result(form_chip):
    """The interval the tables print: first LoadStationary start to the last MultiplyMoving's
    end plus the R+C-2 fill/drain, read off the timeline."""
    rep = form_chip.run(ft.fold_kernel(form_chip, 4, 256), timing_only=True).report
    tpc = form_chip.config.ticks_per_cycle("Tensor")
    first_ls = min(s for _, _, s, _, _ in rep.segments("Tensor (LS)"))
    last_mm = max(e for _, _, _, e, _ in rep.segments("Tensor"))
    assert len(rep.segments("Tensor")) == 4
    assert ft.measure(form_chip, 4, 256) == (last_mm - first_ls) // tpc + (R + C - 2)


def test_fold_kernel_computes_the_gemm(form_chip):
    folds, m = 4, 128
    rng = np.random.default_rng(7)
    ops = rng.standard_normal((R, folds * (C + m))).astype(np.float32)
    out = form_chip.run(ft.fold_kernel(form_chip, folds, m, store=True), {"ops": ops})["out"]
    x = ops.astype(bfloat16.np_dtype).astype(np.float64)
    want = sum(x[:, f * (C + m):f * (C + m) + C].T @ x[:, f * (C + m) + C:(f + 1) * (C + m)] for f in range(folds))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)
