"""Ops PyTorch implements only for CUDA that a non-CPU device must provide: the fused LSTM and GRU
cells, and ``histc`` of integer tensors.

``nn.LSTM``/``nn.GRU`` on any device but CPU run their gates through ``_thnn_fused_lstm_cell`` /
``_thnn_fused_gru_cell`` (the matmuls before them are ordinary mm/addmm). Their values follow
CUDA's kernels (``aten/src/ATen/native/cuda/RNN.cu``), in float32 for 16-bit inputs as CUDA
accumulates, including the ``workspace`` layout the backward reads: LSTM saves the activated
gates [i, f, g, o], GRU saves [r, z, n, hx, hidden n-gate]. Each op is one generic device
kernel (elementwise work on the vector engines), costed by :mod:`torch_bridge.lowering`.

``histc`` on CPU has no integer kernel; CUDA's counts integers with integer bin arithmetic
(``(x - min) * bins / (max - min)``, the top edge in the last bin), which Mixtral's default MoE
routing in transformers relies on. The device computes it exactly, without int64's wrap-around
where the product or the widened edges leave int64 (CUDA's would wrap).
"""

from __future__ import annotations

from typing import Any

import torch

from ..eager import values

__all__ = ["lstm_cell", "lstm_cell_backward", "gru_cell", "gru_cell_backward", "histc", "KERNELS"]


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.float()


def _lstm_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, cx: torch.Tensor,
               input_bias: torch.Tensor | None = None, hidden_bias: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dt = input_gates.dtype
    gates = input_gates.float() + hidden_gates.float()
    if input_bias is not None:
        gates = gates + input_bias.float() + hidden_bias.float()  # type: ignore[union-attr]
    i, f, g, o = gates.chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx.float() + i * g
    hy = o * cy.tanh()
    workspace = torch.cat([i, f, g, o], 1)
    return hy.to(dt), cy.to(dt), workspace.to(dt)


def _lstm_cell_backward(grad_hy: torch.Tensor | None, grad_cy: torch.Tensor | None, cx: torch.Tensor,
                        cy: torch.Tensor, workspace: torch.Tensor, has_bias: bool
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    dt = workspace.dtype
    i, f, g, o = workspace.float().chunk(4, 1)
    zeros = torch.zeros(cx.shape, dtype=torch.float32)
    go = grad_hy.float() if grad_hy is not None else zeros
    gcy = grad_cy.float() if grad_cy is not None else zeros
    tcy = cy.float().tanh()
    gog = go * tcy
    gc = go * o * (1 - tcy * tcy) + gcy
    gig = gc * g * i * (1 - i)
    gfg = gc * cx.float() * f * (1 - f)
    gcg = gc * i * (1 - g * g)
    gog = gog * o * (1 - o)
    grad_gates = torch.cat([gig, gfg, gcg, gog], 1)
    grad_cx = gc * f
    grad_bias = grad_gates.sum(0).to(dt) if has_bias else None
    return grad_gates.to(dt), grad_cx.to(dt), grad_bias


def _gru_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, hx: torch.Tensor,
              input_bias: torch.Tensor | None = None, hidden_bias: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    dt = input_gates.dtype
    ig, hg = input_gates.float(), hidden_gates.float()
    if input_bias is not None:
        ig = ig + input_bias.float()
        hg = hg + hidden_bias.float()  # type: ignore[union-attr]
    ir, ii, in_ = ig.chunk(3, 1)
    hr, hi, hn = hg.chunk(3, 1)
    r = (ir + hr).sigmoid()
    z = (ii + hi).sigmoid()
    n = (in_ + r * hn).tanh()
    h = hx.float()
    hy = n + z * (h - n)
    workspace = torch.cat([r, z, n, h, hn], 1)
    return hy.to(dt), workspace.to(dt)


def _gru_cell_backward(grad_hy: torch.Tensor, workspace: torch.Tensor, has_bias: bool
                       ) -> tuple[torch.Tensor, ...]:
    dt = workspace.dtype
    r, z, n, h, hn = workspace.float().chunk(5, 1)
    go = grad_hy.float()
    gz = go * (h - n) * (1 - z) * z
    ghx = go * z
    gn = go * (1 - z) * (1 - n * n)
    ghn = gn * r
    gr = gn * hn * (1 - r) * r
    grad_input = torch.cat([gr, gz, gn], 1)
    grad_hidden = torch.cat([gr, gz, ghn], 1)
    gib = grad_input.sum(0).to(dt) if has_bias else None
    ghb = grad_hidden.sum(0).to(dt) if has_bias else None
    return grad_input.to(dt), grad_hidden.to(dt), ghx.to(dt), gib, ghb


def _histc(self: torch.Tensor, bins: int = 100, min: Any = 0, max: Any = 0) -> torch.Tensor:
    if self.is_floating_point():
        return torch.histc(self, bins, min, max)
    if self.dtype == torch.bool:  # CUDA's histc takes integers, not bool (nor does CPU's)
        raise NotImplementedError("\"histc\" not implemented for 'Bool'")
    if bins <= 0:
        raise RuntimeError(f"torch.histc: bins must be > 0, but got {bins} for dimension 0")
    x = self.reshape(-1).long()
    lo, hi = int(min), int(max)
    if lo == hi and x.numel():
        lo, hi = int(x.min()), int(x.max())
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    if lo > hi:
        raise RuntimeError(f"torch.histc: max must be larger than min, but got min {lo} max {hi}")
    if (hi - lo) * bins >= 2 ** 63 or lo < -2 ** 63 or hi >= 2 ** 63:
        # (x - lo) * bins would wrap in int64 (found by difftest: a range up to int64's max binned
        # every value into the last bin but one), or the edges widened around one extreme value
        # lie outside int64 (found by difftest: int64's max alone was compared with a wrapped
        # edge and counted nowhere): the same integer arithmetic with Python's integers, which
        # do not wrap (a float64 histogram rounds values past 2**53 into other bins)
        counts = [0] * bins
        for v in x.tolist():
            if lo <= v <= hi:
                counts[(v - lo) * bins // (hi - lo) if v < hi else bins - 1] += 1
        return torch.tensor(counts, dtype=self.dtype)
    x = x[(x >= lo) & (x <= hi)]
    idx = ((x - lo) * bins).div((hi - lo), rounding_mode="floor").clamp_(max=bins - 1)
    return torch.bincount(idx, minlength=bins).to(self.dtype)


def lstm_cell(*args: Any, **kwargs: Any) -> Any:
    return values.host_kernel("_thnn_fused_lstm_cell", _lstm_cell, args, kwargs)


def lstm_cell_backward(*args: Any, **kwargs: Any) -> Any:
    return values.host_kernel("_thnn_fused_lstm_cell_backward_impl", _lstm_cell_backward, args, kwargs)


def gru_cell(*args: Any, **kwargs: Any) -> Any:
    return values.host_kernel("_thnn_fused_gru_cell", _gru_cell, args, kwargs)


def gru_cell_backward(*args: Any, **kwargs: Any) -> Any:
    return values.host_kernel("_thnn_fused_gru_cell_backward", _gru_cell_backward, args, kwargs)


def histc(*args: Any, **kwargs: Any) -> Any:
    return values.host_kernel("histc", _histc, args, kwargs)


# aten op -> its neuron kernel (registered by torch_bridge.registration)
KERNELS = {
    "_thnn_fused_lstm_cell": lstm_cell,
    "_thnn_fused_lstm_cell_backward_impl": lstm_cell_backward,
    "_thnn_fused_gru_cell": gru_cell,
    "_thnn_fused_gru_cell_backward": gru_cell_backward,
    "histc": histc,
    "histc.out": values.out_variant(histc),  # (else integers reached CPU's kernel, which refuses them)
}
