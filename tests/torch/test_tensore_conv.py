"""Convolution values on the datapath: tensore.conv_f32 gives, bit for bit, one datapath matmul
per group of the weights and the im2col patches (the definition), whichever way it computes
them (one matmul, a batch of them, or trnsim.native.conv2d_grouped for depthwise-like groups)."""

import math

import numpy as np
import pytest
import torch

from torch_bridge import tensore
from trnsim import native


def _by_definition(x, w, stride, padding, dilation, groups):
    one_d = x.dim() == 3
    x2, w2, st, pad, dil = tensore._as_2d(x, w, stride, padding, dilation)
    n, _, h, wd = x2.shape
    k, cg, r, s = w2.shape
    ho = (h + 2 * pad[0] - dil[0] * (r - 1) - 1) // st[0] + 1
    wo = (wd + 2 * pad[1] - dil[1] * (s - 1) - 1) // st[1] + 1
    cols = torch.nn.functional.unfold(x2, (r, s), dilation=dil, padding=pad, stride=st)
    kg, ck = k // groups, cg * r * s
    out = torch.empty((n, k, ho * wo), dtype=torch.float32)
    for g in range(groups):
        patches = cols[:, g * ck:(g + 1) * ck].permute(1, 0, 2).reshape(ck, -1)
        res = tensore.matmul_f32(w2[g * kg:(g + 1) * kg].reshape(kg, ck), patches)
        out[:, g * kg:(g + 1) * kg] = res.view(kg, n, -1).permute(1, 0, 2)
    out = out.view(n, k, ho, wo)
    return out.squeeze(2) if one_d else out


CASES = [((2, 96, 9, 9), (96, 1, 3, 3), (1, 1), (1, 1), (1, 1), 96),
         ((2, 32, 7, 11), (32, 1, 5, 5), (2, 2), (2, 2), (1, 1), 32),
         ((2, 4, 12, 12), (8, 1, 3, 3), (3, 1), (2, 0), (1, 2), 4),
         ((2, 8, 10, 10), (16, 2, 3, 3), (2, 2), (1, 1), (1, 1), 4),
         ((1, 260, 5, 5), (260, 130, 3, 3), (1, 1), (1, 1), (1, 1), 2),  # 1170 taps: chunks of 128 added
         ((1, 3, 9, 9), (6, 3, 5, 5), (1, 1), (2, 2), (1, 1), 1),
         ((3, 12, 8), (24, 3, 3), (1,), (1,), (2,), 4),
         ((1, 2, 3, 3), (2, 1, 3, 3), (1, 1), (0, 0), (1, 1), 2),
         ((2, 16, 3, 3), (4, 8, 5, 5), (1, 1), (2, 2), (1, 1), 2),  # 9 outputs of 200 taps: 2 chunks, element by element
         ((3, 300, 1, 1), (20, 300, 1, 1), (1, 1), (0, 0), (1, 1), 1),  # 1 pixel per image: one matmul for the batch
         ((2, 7, 5, 5), (9, 7, 3, 3), (2, 2), (0, 0), (1, 1), 1),  # 2x2 pixels of 63 taps
         ((2, 6, 7, 5), (6, 1, 3, 3), (2, 2), (1, 1), (2, 1), 6),  # 4x3 outputs, strided and dilated
         ((2, 300, 6, 6), (16, 300, 1, 1), (1, 1), (0, 0), (1, 1), 1),  # pointwise: the input is the patches
         ((3, 24, 5, 7), (16, 24, 1, 1), (2, 1), (0, 0), (1, 1), 1)]  # strided 1x1: im2col


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_conv_f32_is_one_datapath_matmul_per_group_bit_for_bit(case, dtype):
    xs, ws, st, pad, dil, groups = CASES[case]
    g = torch.Generator().manual_seed(case)
    for scale in (1.0, 1e-20, 1e18):  # subnormal products; overflow to inf and inf - inf = NaN
        x = (torch.randn(*xs, generator=g) * scale).to(dtype)
        w = (torch.randn(*ws, generator=g) * scale).to(dtype)
        if not (x.isfinite().all() and w.isfinite().all()):
            continue
        want = _by_definition(x, w, st, pad, dil, groups)
        got = tensore.conv_f32(x, w, st, pad, dil, groups)
        assert got.shape == want.shape and got.stride() == want.stride()
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_conv2d_grouped_refuses_bad_geometry_in_one_error():
    x = np.zeros((1, 4, 5, 5), np.float32)
    w = np.zeros((4, 1, 3, 3), np.float32)
    assert native.conv2d_grouped(x, w, 4, (1, 1), (1, 1), (3, 3)).shape == (1, 4, 3, 3)
    with pytest.raises(Exception):
        native.conv2d_grouped(x, w, 4, (1, 1), (1, 1), (4, 4))  # reads past the padded input
    with pytest.raises(Exception):
        native.conv2d_grouped(x, w, 3, (1, 1), (1, 1), (3, 3))  # channels not groups x C/g


def test_a_channels_last_input_gives_the_same_bits():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 32, 6, 6, generator=g)
    xl = x.contiguous(memory_format=torch.channels_last)
    for ws, pad in (((16, 32, 1, 1), (0, 0)), ((16, 32, 3, 3), (1, 1)), ((32, 1, 3, 3), (1, 1))):
        w = torch.randn(*ws, generator=g)
        groups = 32 if ws[1] == 1 else 1
        want = _by_definition(x, w, (1, 1), pad, (1, 1), groups)
        got = tensore.conv_f32(xl, w, (1, 1), pad, (1, 1), groups)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_a_neuron_convolution_takes_the_datapath_exactly_when_its_inputs_are_finite():
    """all_finite is 'every element finite', made by a sum first (finite elements whose sum
    overflows are finite). values.convolution takes the datapath when its products are bounded
    (tensore.bounded: finite, and k * max|x| * max|w| far from overflow): an infinity or NaN
    anywhere, or elements so large that products or partial sums may overflow, take CPU's."""
    from torch_bridge.eager.values import all_finite

    g = torch.Generator().manual_seed(5)
    big = torch.randn(2, 64, 6, 6, generator=g)
    big[0, 0, 0, :2] = 3e38  # finite, but the sum overflows
    assert all_finite(big) and not math.isfinite(big.sum().item())
    assert not all_finite(big.new_tensor([1.0, float("nan")]))
    assert not all_finite(torch.tensor([float("inf"), -float("inf")]))  # sums to NaN
    assert all_finite(torch.zeros(0)) and all_finite(torch.tensor([65504.0, 65504.0]).half())
    w = torch.randn(8, 64, 3, 3, generator=g) * 1e-3
    x = torch.randn(2, 64, 6, 6, generator=g)
    for x, wt, datapath in ((x, w, True), (big, w, False),
                            (x, w.clone().index_fill_(0, torch.tensor([2]), float("inf")), False),
                            (x.clone().index_fill_(3, torch.tensor([1]), float("nan")), w, False)):
        want = tensore.conv_f32(x, wt, (1, 1), (1, 1), (1, 1), 1)
        cpu = torch.nn.functional.conv2d(x, wt, padding=1)
        assert not torch.equal(want.view(torch.int32), cpu.view(torch.int32))  # the two paths tell apart
        got = torch.nn.functional.conv2d(x.to("neuron"), wt.to("neuron"), padding=1).cpu()
        assert torch.equal(got.view(torch.int32), (want if datapath else cpu).view(torch.int32))


def test_im2col_gives_unfolds_patches_bit_for_bit():
    """tensore.im2col (a strided view of the padded input, copied once) against F.unfold: the
    same elements in the same order for random geometries, dtypes, layouts and NaNs."""
    import random

    rng = random.Random(7)
    checked = 0
    while checked < 300:
        n, c, h, w = rng.randint(1, 3), rng.randint(1, 5), rng.randint(1, 12), rng.randint(1, 12)
        r, s = rng.randint(1, 4), rng.randint(1, 4)
        st, pad, dil = ((rng.randint(1, 3), rng.randint(1, 3)), (rng.randint(0, 3), rng.randint(0, 3)),
                        (rng.randint(1, 3), rng.randint(1, 3)))
        ho = (h + 2 * pad[0] - dil[0] * (r - 1) - 1) // st[0] + 1
        wo = (w + 2 * pad[1] - dil[1] * (s - 1) - 1) // st[1] + 1
        if ho <= 0 or wo <= 0:
            continue
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
        x = torch.randn(n, c, h, 2 * w).to(dtype)
        x = [x[..., :w].contiguous(), x[..., :w].contiguous(memory_format=torch.channels_last), x[..., ::2]][checked % 3]
        if rng.random() < 0.3:
            x[0, 0, 0, 0] = float("nan")
        want = torch.nn.functional.unfold(x, (r, s), dilation=dil, padding=pad, stride=st)
        got = tensore.im2col(x, (r, s), st, pad, dil, (ho, wo))
        bits = torch.int32 if dtype == torch.float32 else torch.int16
        assert got.shape == want.shape and torch.equal(got.contiguous().view(bits), want.contiguous().view(bits))
        checked += 1
