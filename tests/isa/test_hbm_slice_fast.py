"""HbmAP's one-pass slicing (``trnsim.isa._hbm_slice_fast``, the everyday index of ints and
step-1 slices) gives the view the general path gives, box included, and leaves everything else
(steps, negatives, out of range, other types) to the general path's checks and messages."""

from __future__ import annotations

import itertools

import pytest

import trnsim.isa as isa
from trnsim.isa import HbmTensor
from trnsim.native.dtypes import get_dtype


def _fp(v):
    return (v.tensor.name, v.offset, v.dims, v.box, v.size)


def _outcome(v, idx):
    try:
        return ("ok", _fp(v[idx]))
    except Exception as e:  # noqa: BLE001 - the error itself is compared
        return (type(e).__name__, str(e))


def test_same_views_as_the_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    t = HbmTensor("t", (3, 4, 5), get_dtype("bf16"), "input", 1)
    views = [t.full(), t[1], t[:, 1:3], t[0:2, :, 4], t[:, ::2], t.full().reshape(60), t.ap(2, [[20, 2], [0, 3], [1, 4]])]
    picks = [0, 1, -1, 2, slice(None), slice(1, 2), slice(0, 2), slice(None, None, 2), slice(3, 1), slice(0, 9), 1.5]
    fast = isa._hbm_slice_fast
    n_fast = 0
    for v in views:
        for k in (1, 2, 3):
            for idx in itertools.product(picks, repeat=min(k, len(v.dims))):
                monkeypatch.setattr(isa, "_hbm_slice_fast", fast)
                got = _outcome(v, idx)
                n_fast += fast(v, idx) is not None
                monkeypatch.setattr(isa, "_hbm_slice_fast", lambda ap, i: None)
                assert got == _outcome(v, idx), (v, idx)
    assert n_fast > 500  # the fast path ran


def test_view_with_more_dims_than_its_tensor() -> None:
    # an ap() view of a 1-D tensor with 2 dims: no box, and no tensor dim 1 to read (was an IndexError)
    t = HbmTensor("t", (12,), get_dtype("bf16"), "input", 1)
    v = t.ap(0, [[4, 3], [1, 4]])
    assert _fp(v[1, 1:3]) == ("t", 5, ((1, 2),), None, 2)
    assert _fp(v[::2, 1:3]) == ("t", 1, ((8, 2), (1, 2)), None, 4)
