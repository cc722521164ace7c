"""Context parallelism: attention over a sequence split across a CP group, as ring attention
(TorchTitan's ``context_parallel``, Megatron's CP), on timing-only tensors.

Each of the group's ``c`` ranks holds ``seq / c`` tokens of every sequence, load-balanced as
both frameworks shard a causal sequence: rank ``i`` holds chunks ``i`` and ``2c - 1 - i`` of
``2c``. The ranks pass their key/value blocks around the ring (``c - 1`` permutes, each issued
before the block in hand is attended and waited on where the next block is read, so it runs
beside the attention) and attend their queries to each block:

* step 0, the rank's own block: causal flash attention of ``seq / c`` tokens;
* each later step: half of a block survives the causal mask - all the queries against the
  block's first chunk, or the second chunk's queries against the whole block - charged as the
  flash kernel, not causal, on two query halves of ``seq / 2c`` rows against ``seq / 2c`` keys;
  without a causal mask, the whole block;
* each later step's partial output merged into the running one by its log-sum-exp (fp32
  elementwise ops: TorchTitan's ``_SDPAMerger``).

The backward runs the ring again: each step's flash backward (as the fused attention's), the
key/value blocks passed on (``c - 1`` permutes) and each block's key/value gradient sent on with
it (``c`` permutes, the last one home), the gradients accumulated as they arrive. Every permute
is simulated beside the same call of the plan's other CP groups (sharing links, HBM and DMA).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ..eager import lowering
from ..eager.lowering import tile_dtype

__all__ = ["ring_attention"]


def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def _block_queries(q: torch.Tensor, first: bool, causal: bool) -> tuple[torch.Tensor, bool]:
    """The query shape step ``first``/later's flash kernel runs on (module docstring)."""
    if first or not causal:
        return q, causal and first
    b, h, sl, e = q.shape
    return torch.empty((2 * b, h, sl // 2, e), dtype=q.dtype, device="meta"), False


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None,
                run: Any, dropout: float, comm: Any, group: list[int], flash: bool) -> torch.Tensor:
        from ..ops.attention import FORWARD, cpu_layout

        c = len(group)
        dt = tile_dtype(k.dtype).name
        kv = _nbytes(k, v)
        core = q.device.index or 0
        out_shape = q.shape[:-1] + (v.shape[-1],)
        acc = lse = None
        cur = (k, v)
        for j in range(c):
            if j < c - 1:  # the next block, sent on while this one is attended
                nxt = (k.new_empty(k.shape), v.new_empty(v.shape))
                comm.charge("permute", kv, group, dt, early=True, result=nxt)
            run.await_reads(cur)
            qb, cb = _block_queries(q, j == 0, causal)
            run.charge_specs(core, FORWARD, ("ring-fwd", tuple(qb.shape), q.dtype, cb, scale, dropout),
                             lambda qb=qb, cb=cb: lowering.attention_specs(qb, None, cb, scale, dropout))
            o = q.new_empty(out_shape)
            lj = q.new_empty(q.shape[:-1] + (1,), dtype=torch.float32)
            if acc is None:
                acc, lse = o.float(), lj
            else:  # the online softmax's merge of this block's partial output
                w = torch.sigmoid(lj - lse)
                acc = acc - w * (acc - o)
                lse = lse - F.logsigmoid(lse - lj)
            if j < c - 1:
                cur = nxt
        out = q.new_empty(out_shape)
        laid = cpu_layout(q, out, flash)
        if laid is not None:  # laid out as the fused op lays it (o_proj then reads it without a copy)
            out = q.new_empty_strided(out_shape, laid)
        out.copy_(acc)  # the merged output rounded to the compute dtype
        ctx.save_for_backward(q, k, v, out, lse)  # what flash attention's backward reads, as without CP
        ctx.args = (causal, scale, run, dropout, comm, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        from ..ops.attention import BACKWARD

        q, k, v, out, lse = ctx.saved_tensors
        causal, scale, run, dropout, comm, group = ctx.args
        c = len(group)
        dt = tile_dtype(k.dtype).name
        kv = _nbytes(k, v)
        core = grad_out.device.index or 0
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dkv = None
        cur = (k, v)
        for j in range(c):
            if j < c - 1:
                nxt = (k.new_empty(k.shape), v.new_empty(v.shape))
                comm.charge("permute", kv, group, dt, early=True, result=nxt)
            run.await_reads(cur)
            qb, cb = _block_queries(q, j == 0, causal)
            if run.target.flash_backward:
                run.charge_specs(core, BACKWARD, ("ring-bwd", tuple(qb.shape), q.dtype, cb, scale, dropout),
                                 lambda qb=qb, cb=cb: 3 * lowering.attention_specs(qb, None, cb, scale, dropout))
            else:
                run.charge_specs(core, BACKWARD, ("ring-bwd-eager", tuple(qb.shape), q.dtype),
                                 lambda qb=qb: lowering.attention_backward_specs(qb, qb.shape[-2], q.dtype))
            dq_j, dk_j, dv_j = q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)
            dq.add_(dq_j)
            if dkv is not None:  # the gradient of the block in hand arrived with it: add this step's
                run.await_reads(dkv)
                dk_j = dk_j + dkv[0]
                dv_j = dv_j + dkv[1]
            dkv = (k.new_empty(k.shape), v.new_empty(v.shape))  # sent on once computed (the last one home)
            comm.charge("permute", kv, group, dt, result=dkv)
            if j < c - 1:
                cur = nxt
        run.await_reads(dkv)
        return (dq.to(q.dtype), dkv[0], dkv[1], None, None, None, None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None, run: Any,
                   dropout: float, ring: tuple[Any, list[int]], flash: bool = True) -> torch.Tensor:
    """Attention of the rank's ``q`` [B, H, seq / c, E] over the whole sequence of its CP group
    (``ring``: the rank's Comm and the group), as the module docstring runs it."""
    comm, group = ring
    if q.shape[-2] % 2:
        from trnsim.workload.training import RecipeError

        raise RecipeError(f"--cp {len(group)}: ring attention splits each rank's {q.shape[-2]} tokens in two "
                          f"(load-balanced causal chunks); make --seq a multiple of {2 * len(group)}")
    return _RingAttention.apply(q, k, v, causal, scale, run, dropout, comm, group, flash)
