"""A whole system in one process: a parallelism plan, one rank's shard of a model, and its
collectives charged from the NeuronLink model.

A :class:`Plan` places ``tp x pp x dp`` ranks on a system (logical NeuronCores, tensor-parallel
ranks innermost, so a TP group fills whole chips first, as Neuron's libraries place it: rank =
``(dp_i * pp + pp_i) * tp + tp_i``). Ranks that run the same program are simulated once: every
rank of a TP group, every DP replica and every pipeline stage of the same layers run the same
kernels at the same times, so one of them (:meth:`Plan.roles`) stands for all.

:class:`Shard` rewrites a model built on ``meta`` into one rank's slice the way NeuronX
Distributed's layers shard it, following the model's tensor-parallel plan in transformers
(``config.base_model_tp_plan``):

* ``colwise`` -> a column-parallel linear (``out / tp`` rows of the weight; its input's gradient
  is all-reduced in backward). Key/value projections whose heads are fewer than ``tp`` are
  replicated so each rank owns one head, as NxD Inference does.
* ``rowwise`` -> a row-parallel linear (``in / tp`` columns; its output is all-reduced, or
  reduce-scattered over the sequence with sequence parallelism).
* the embedding is sharded across its hidden dimension (an all-gather after the lookup), the LM
  head column-parallel with its logits gathered; MoE experts' weights (``packed_colwise`` /
  ``rowwise`` parameters) are sharded per expert, their output all-reduced.
* ``sp``: sequence parallelism (NxD's ``sequence_parallel_enabled``) - the decoder layers' norms
  and residuals run on ``seq / tp`` tokens; each attention and MLP block all-gathers its input
  over the sequence, its row-parallel linear reduce-scatters the output. A decode step (one
  token) runs plain tensor parallelism, as NxD Inference's token generation does.

:class:`Comm` charges each collective on the simulated rank's core: the call is simulated on the
system's links for the real group beside the same call of its sibling groups (the plan's
other TP or DP groups make it at the same time: ``trnsim.collectives.simulate_with_siblings``,
cached per call), launched on the core's collective stream once the compute before it is done,
and the compute after it waits for its result.
"""

from __future__ import annotations

import contextlib
import fnmatch
from typing import Any

import torch
from torch import nn

from trnsim.config import SystemConfig
from trnsim.device import Device
from trnsim.workload.plan import Plan, PlanError, Role

from ..eager.lowering import tile_dtype

__all__ = ["Plan", "PlanError", "Comm", "Shard", "Role", "ColumnParallelLinear", "RowParallelLinear",
           "ParallelEmbedding"]


# ---- collectives ---------------------------------------------------------------------------------
class Comm:
    """The collectives of one simulated rank (see the module docstring). ``reports`` may be
    shared between ranks' Comms: a call on the same group and bytes is simulated once. The
    plan's step is one compiled graph, so a call pays the system's ``graph_launch``, not the
    ``launch`` of a collective run by itself (trnsim.collectives.runtime)."""

    def __init__(self, system: SystemConfig, device: Device, core: int, rank: int, plan: Plan,
                 reports: dict[tuple[Any, ...], Any] | None = None):
        from trnsim.collectives.runtime import in_graph

        self.system = in_graph(system)
        self.device = device
        self.core = core
        self.rank = rank
        self.plan = plan
        self.reports = {} if reports is None else reports
        self.costs: dict[tuple[Any, ...], Any] = {}  # a call's launch cost on this rank
        self.sp_active = False  # this forward runs sequence-parallel (set by the first layer's hook)
        self.tp_overlap = False  # NxD's fused linears overlap their backward's collectives with its matmuls
        self._shards: dict[int, tuple[Any, Any]] = {}  # a gathered sequence's storage -> (its weak ref, the shard's)

    @property
    def tp_group(self) -> list[int]:
        return self.plan.tp_group(self.rank)

    def report(self, collective: str, nbytes: int, group: list[int], dtype: str) -> Any:
        """The call on ``group`` simulated beside the same call of its sibling groups in the plan
        (every other TP group, or every other DP group, makes it at the same time in an SPMD
        step: :func:`trnsim.collectives.simulate_with_siblings`), sharing links, HBM and DMA."""
        from trnsim.collectives import simulate_with_siblings

        key = (collective, nbytes, tuple(group), dtype)
        rep = self.reports.get(key)
        if rep is None:
            rep = self.reports[key] = simulate_with_siblings(self.system, collective, nbytes, group,
                                                             self.plan.size, dtype=dtype)[0]
        return rep

    def charge(self, collective: str, nbytes: int, group: list[int], dtype: str = "bf16", early: bool = False,
               result: Any = None) -> None:
        """Charge ``collective`` of ``nbytes`` (nccl-tests' S) over ``group`` on this rank's core:
        it starts when the compute issued before it is done (``early``: once the collective
        stream is free); the compute issued after it waits - or, with ``result`` (the tensor(s)
        it writes), only the first op reading them (an asynchronous collective,
        :meth:`TimingOnly.collective`)."""
        if len(group) < 2 or nbytes == 0:
            return
        from .fake import active

        run = active()
        if run is None or not run.target.charge:
            return
        key = (collective, nbytes, tuple(group), dtype, self.rank)
        cost = self.costs.get(key)
        if cost is None:
            def simulate() -> Any:
                return self.report(collective, nbytes, group, dtype)
            cached = getattr(self.device, "cached_collective", None)  # a CachedDevice: costs on disk
            cost = cached(self.system, (*key[:4], "siblings", self.plan.size), self.rank, simulate) \
                if cached is not None else \
                self.device.collective_cost(simulate(), self.rank)
            self.costs[key] = cost
        run.collective(self.core, collective.replace("-", "_"), cost, early, result)

    # ---- autograd-aware collectives on timing-only tensors ------------------------------------
    def all_reduce(self, x: torch.Tensor, group: list[int] | None = None) -> torch.Tensor:
        return _AllReduce.apply(x, self, group or self.tp_group)

    def copy_to_group(self, x: torch.Tensor) -> torch.Tensor:
        """Identity forward, all-reduce of the gradient (a column-parallel linear's input)."""
        return _CopyToGroup.apply(x, self, self.tp_group) if x.requires_grad else x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return _Gather.apply(x, self, dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return _Scatter.apply(x, self, dim)

    def gather_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """The full sequence of a sequence-parallel activation (a block's input)."""
        full = self.all_gather(x, 1)
        import weakref

        from torch.multiprocessing.reductions import StorageWeakRef

        ref = StorageWeakRef(full.untyped_storage())
        self._shards = {k: v for k, v in self._shards.items() if not v[0].expired()}
        self._shards[ref.cdata] = (ref, weakref.ref(x))
        return full

    def shard_of(self, full: torch.Tensor) -> torch.Tensor | None:
        """The rank's shard that :meth:`gather_sequence` gathered into ``full`` (None: not one)."""
        from torch.multiprocessing.reductions import StorageWeakRef

        hit = self._shards.get(StorageWeakRef(full.untyped_storage()).cdata)
        if hit is None or hit[0].expired() or full.shape[1] % self.plan.tp:
            return None
        return hit[1]()


def _nbytes(x: torch.Tensor) -> int:
    return x.numel() * x.element_size()


def _dtype(x: torch.Tensor) -> str:
    return tile_dtype(x.dtype).name


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, group: list[int]) -> torch.Tensor:
        comm.charge("all-reduce", _nbytes(x), group, _dtype(x))
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        return g, None, None


class _CopyToGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, group: list[int]) -> torch.Tensor:
        ctx.comm, ctx.group = comm, group
        return x

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        ctx.comm.charge("all-reduce", _nbytes(g), ctx.group, _dtype(g))
        return g, None, None


def _resized(x: torch.Tensor, dim: int, factor: float) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = int(shape[dim] * factor)
    return x.new_empty(shape)


class _Gather(torch.autograd.Function):
    """All-gather along ``dim`` over the TP group; backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        n = comm.plan.tp
        out = _resized(x, dim, n)
        comm.charge("all-gather", _nbytes(out), comm.tp_group, _dtype(x))
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        comm = ctx.comm
        comm.charge("reduce-scatter", _nbytes(g), comm.tp_group, _dtype(g))
        return _resized(g, ctx.dim, 1 / comm.plan.tp), None, None


class _Scatter(torch.autograd.Function):
    """Reduce-scatter along ``dim`` over the TP group; backward all-gathers the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, dim: int) -> torch.Tensor:
        ctx.comm, ctx.dim = comm, dim
        comm.charge("reduce-scatter", _nbytes(x), comm.tp_group, _dtype(x))
        return _resized(x, dim, 1 / comm.plan.tp)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        comm = ctx.comm
        out = _resized(g, ctx.dim, comm.plan.tp)
        comm.charge("all-gather", _nbytes(out), comm.tp_group, _dtype(g))
        return out, None, None


class _AsyncLinear(torch.autograd.Function):
    """A column-parallel linear as NxD's ``LinearWithAsyncCommunication`` runs it. Forward:
    ``x W (+ b)``. Backward, in NxD's order: with sequence parallelism (``local``, the rank's
    shard of the gathered ``x``, is what the forward keeps) the all-gather of ``local`` is issued
    first and runs beside the input-gradient matmul ``g W^T``; that gradient's reduce-scatter
    (the shard's gradient) is issued next and runs beside the weight-gradient matmul ``x^T g``,
    which waits for the all-gather's result; without it the input gradient's all-reduce runs
    beside the weight-gradient matmul. Each collective is asynchronous: the first op that reads
    its result waits for it (:meth:`Comm.charge` with ``result``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm,
                local: torch.Tensor | None, mx: str | None = None) -> torch.Tensor:
        ctx.comm, ctx.sp, ctx.shape, ctx.bias, ctx.mx = comm, local is not None, x.shape, bias is not None, mx
        ctx.save_for_backward(local if local is not None else x, weight)
        with mx_scope(mx):
            return sharded_linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        kept, weight = ctx.saved_tensors
        comm = ctx.comm
        full = kept
        if ctx.sp:  # the forward kept the shard: gather it again, beside the input-gradient matmul
            full = kept.new_empty(ctx.shape)
            comm.charge("all-gather", _nbytes(full), comm.tp_group, _dtype(kept), early=True, result=full)
        grad_in = None
        if ctx.needs_input_grad[4 if ctx.sp else 0]:
            with mx_scope(ctx.mx):
                gi = torch.matmul(g, weight.t())
            if ctx.sp:
                grad_in = _resized(gi, 1, 1 / comm.plan.tp)
                comm.charge("reduce-scatter", _nbytes(gi), comm.tp_group, _dtype(gi), result=grad_in)
            else:
                grad_in = gi
                comm.charge("all-reduce", _nbytes(gi), comm.tp_group, _dtype(gi), result=gi)
        g2 = g.reshape(-1, g.shape[-1])
        with mx_scope(ctx.mx):
            gw = torch.matmul(full.reshape(-1, full.shape[-1]).t(), g2) if ctx.needs_input_grad[1] else None
        gb = g2.sum(0) if ctx.bias and ctx.needs_input_grad[2] else None
        return (None, gw, gb, None, grad_in, None) if ctx.sp else (grad_in, gw, gb, None, None, None)


def async_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, comm: Comm,
                 mx: str | None = None) -> torch.Tensor:
    """A column-parallel linear of ``x`` (the block's gathered sequence with sequence
    parallelism, else the replicated input) whose backward overlaps its collectives with its
    matmuls (:class:`_AsyncLinear`); the sequence-parallel gather's own backward is not run
    (the linear reduce-scatters its input's gradient itself)."""
    local = comm.shard_of(x) if comm.sp_active else None
    if local is not None:
        return _AsyncLinear.apply(x.detach(), weight, bias, comm, local, mx)
    return _AsyncLinear.apply(x, weight, bias, comm, None, mx)


# ---- MX linears (TorchAO's MXFP8 training on trn3) --------------------------------------------------
@contextlib.contextmanager
def mx_scope(fmt: str | None) -> Any:
    """Within: each 2-d matmul of the timing-only run is charged as an MX linear's (its operands'
    ``mx_quantize`` kernels and ``matmul_mx``, :func:`torch_bridge.lowering.mx_linear_specs`)."""
    from .fake import active

    run = active() if fmt else None
    if run is None:
        yield
        return
    old, run.mx = run.mx, fmt
    try:
        yield
    finally:
        run.mx = old


class _MxMatmul(torch.autograd.Function):
    """``x @ w`` of an MX linear (``w`` stored ``[in, out]``; ``t``: stored ``[out, in]``, an
    ``nn.Linear``'s, and used transposed): the forward, the input-gradient and the weight-gradient
    matmuls each cast their two operands along their contraction (TorchAO's ``mx_mm``: six casts
    and three MX matmuls a step). The weight gradient comes out in the weight's layout, as
    autograd's matmul makes it; it keeps what that keeps (the bf16 ``x`` and ``w``)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, fmt: str, t: bool) -> torch.Tensor:
        ctx.fmt, ctx.t = fmt, t
        ctx.save_for_backward(x, w)
        with mx_scope(fmt):
            return torch.matmul(x, w.t() if t else w)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        x, w = ctx.saved_tensors
        gx = gw = None
        x2, g2 = x.reshape(-1, x.shape[-1]), g.reshape(-1, g.shape[-1])
        with mx_scope(ctx.fmt):
            if ctx.needs_input_grad[0]:
                gx = torch.matmul(g, w if ctx.t else w.t())
            if ctx.needs_input_grad[1]:
                gw = torch.matmul(g2.t(), x2) if ctx.t else torch.matmul(x2.t(), g2)
        return gx, gw, None, None


def mx_matmul(x: torch.Tensor, w: torch.Tensor, fmt: str | None, t: bool = False) -> torch.Tensor:
    """``x @ w`` (``x @ w.T`` with ``t``), as an MX linear's matmuls with ``fmt`` (an MX format),
    else as it is."""
    if fmt:
        return _MxMatmul.apply(x, w, fmt, t)
    return torch.matmul(x, w.t() if t else w)


# ---- sharded layers ------------------------------------------------------------------------------
def _meta_param(shape: tuple[int, ...], like: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=like.dtype, device="meta"), requires_grad=like.requires_grad)


def sharded_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, mx: str | None = None
                   ) -> torch.Tensor:
    """``x @ weight + bias`` for a weight stored ``[in, out]``: the layout the PE array reads a
    static weight in (the compiler lays weights out once, at load), so no step transposes it
    (``mx``: as an MX linear, :func:`mx_matmul`)."""
    y = mx_matmul(x, weight, mx)
    return y + bias if bias is not None else y


class ColumnParallelLinear(nn.Module):
    mx: str | None = None  # an MX format: the linear's matmuls as MX linears (train_step.apply_mx)

    """``y = x W_local + b_local`` with ``out_local`` of the output features (NxD's
    ColumnParallelLinear; the weight is stored ``[in, out_local]``, see :func:`sharded_linear`;
    ``gather`` all-gathers the output features, ``sp`` gathers the input sequence first)."""

    def __init__(self, base: nn.Linear, out_local: int, comm: Comm, gather: bool = False, sp: bool = False):
        super().__init__()
        self.in_features, self.out_features = base.in_features, out_local
        self.weight = _meta_param((base.in_features, out_local), base.weight)
        self.bias = _meta_param((out_local,), base.bias) if base.bias is not None else None
        self.comm, self.gather, self.sp = comm, gather, sp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.sp and self.comm.sp_active):  # sequence parallel: its block gathered the input
            x = self.comm.copy_to_group(x)
        y = sharded_linear(x, self.weight, self.bias, self.mx)
        return self.comm.all_gather(y, -1) if self.gather else y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out_local={self.out_features}, tp={self.comm.plan.tp}, sp={self.sp}"


class RowParallelLinear(nn.Module):
    mx: str | None = None  # as ColumnParallelLinear.mx

    """``y = reduce(x_local W_local) + b`` with ``in_local`` of the input features (NxD's
    RowParallelLinear: all-reduce, or reduce-scatter over the sequence with ``sp``; the weight is
    stored ``[in_local, out]``, see :func:`sharded_linear`)."""

    def __init__(self, base: nn.Linear, in_local: int, comm: Comm, sp: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_local, base.out_features
        self.weight = _meta_param((in_local, base.out_features), base.weight)
        self.bias = _meta_param((base.out_features,), base.bias) if base.bias is not None else None
        self.comm, self.sp = comm, sp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = mx_matmul(x, self.weight, self.mx)
        y = self.comm.reduce_scatter(y, 1) if self.sp and self.comm.sp_active else self.comm.all_reduce(y)
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return f"in_local={self.in_features}, out={self.out_features}, tp={self.comm.plan.tp}, sp={self.sp}"


class ParallelEmbedding(nn.Module):
    """An embedding sharded across its hidden dimension, its lookups all-gathered (NxD's
    ParallelEmbedding with ``shard_across_embedding``)."""

    def __init__(self, base: nn.Embedding, comm: Comm):
        super().__init__()
        tp = comm.plan.tp
        self.num_embeddings, self.embedding_dim = base.num_embeddings, base.embedding_dim // tp
        self.weight = _meta_param((base.num_embeddings, base.embedding_dim // tp), base.weight)
        self.padding_idx = base.padding_idx
        self.comm = comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather(nn.functional.embedding(ids, self.weight, self.padding_idx), -1)


# ---- the plan over a transformers model ------------------------------------------------------------
class Shard:
    """Rewrites a meta model into one rank's shard (see the module docstring); call it on the
    model before its weights are given storage (:func:`torch_bridge.models.from_config`)."""

    def __init__(self, plan: Plan, comm: Comm, role: Role | None = None, pipeline: bool = False):
        self.plan, self.comm, self.role, self.pipeline = plan, comm, role, pipeline
        self.replaced: dict[str, str] = {}
        self.gather_logits = True  # False: the LM head's logits stay split (a vocab-parallel loss)

    def __call__(self, model: nn.Module) -> nn.Module:
        if self.plan.tp > 1:
            self._tensor_parallel(model)
        return model

    # ---- tensor parallelism -----------------------------------------------------------------------
    def _tensor_parallel(self, model: nn.Module) -> None:
        cfg = model.config
        plan = getattr(cfg, "base_model_tp_plan", None) or {}
        if not plan:
            raise PlanError(f"--tp {self.plan.tp}: transformers has no tensor-parallel plan for model type "
                            f"'{cfg.model_type}' (config.base_model_tp_plan); run it with --tp 1")
        tp, sp = self.plan.tp, self.plan.sp
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        if heads % tp:
            raise PlanError(f"--tp {tp}: num_attention_heads {heads} is not a multiple of {tp}")
        if kv % tp and tp % kv:
            raise PlanError(f"--tp {tp}: num_key_value_heads {kv} neither divides nor is divided by {tp}")
        base = getattr(model, model.base_model_prefix, model)
        prefix = model.base_model_prefix + "." if base is not model else ""
        mods = dict(model.named_modules())
        params = dict(model.named_parameters())
        for pattern, style in plan.items():
            full = prefix + pattern
            for name in [n for n in mods if fnmatch.fnmatchcase(n, full)] + \
                    [n for n in params if fnmatch.fnmatchcase(n, full)]:
                self._apply(model, name, style, mods, params, tp, sp, kv, head_dim)
        emb = getattr(base, "embed_tokens", None)
        if isinstance(emb, nn.Embedding):
            if emb.embedding_dim % tp:
                raise PlanError(f"--tp {tp}: hidden size {emb.embedding_dim} is not a multiple of {tp}")
            base.embed_tokens = ParallelEmbedding(emb, self.comm)
            self.replaced[prefix + "embed_tokens"] = "embedding"
        head = getattr(model, "lm_head", None)
        if isinstance(head, nn.Linear) and head.out_features % tp == 0:
            model.lm_head = ColumnParallelLinear(head, head.out_features // tp, self.comm, gather=self.gather_logits)
            self.replaced["lm_head"] = "colwise_gather_output"
        if sp:
            self._sequence_parallel(base)

    def _apply(self, model: nn.Module, name: str, style: str, mods: dict[str, nn.Module],
               params: dict[str, nn.Parameter], tp: int, sp: bool, kv: int, head_dim: int) -> None:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        mod = mods.get(name)
        if isinstance(mod, nn.Linear):
            if style in ("colwise", "colwise_gather_output"):
                out = mod.out_features
                if leaf in ("k_proj", "v_proj") and kv < tp:
                    local = head_dim  # fewer KV heads than ranks: replicated, one per rank (NxD Inference)
                elif out % tp:
                    raise PlanError(f"--tp {tp}: {name} has {out} output features, not a multiple of {tp}")
                else:
                    local = out // tp
                setattr(parent, leaf, ColumnParallelLinear(mod, local, self.comm, style == "colwise_gather_output", sp))
            elif style == "rowwise":
                if mod.in_features % tp:
                    raise PlanError(f"--tp {tp}: {name} has {mod.in_features} input features, not a multiple of {tp}")
                setattr(parent, leaf, RowParallelLinear(mod, mod.in_features // tp, self.comm, sp))
            else:
                raise PlanError(f"--tp {tp}: {name}: transformers' plan style '{style}' is not one trnsim shards "
                                f"(colwise, rowwise, packed_colwise and rowwise expert weights)")
            self.replaced[name] = style
        elif name in params and mod is None:  # an experts module's 3-d weight [experts, out, in]
            p = params[name]
            dim = {"colwise": -2, "packed_colwise": -2, "rowwise": -1}.get(style)
            if dim is None or p.dim() != 3:
                raise PlanError(f"--tp {tp}: {name}: transformers' plan style '{style}' for a {p.dim()}-d weight is "
                                f"not one trnsim shards")
            shape = list(p.shape)
            if shape[dim] % tp:
                raise PlanError(f"--tp {tp}: {name} has {shape[dim]} features on its sharded dim, not a multiple of {tp}")
            shape[dim] //= tp
            setattr(parent, leaf, _meta_param(tuple(shape), p))
            self.replaced[name] = style
        elif mod is not None and style in ("moe_tp_experts", "ep_router", "local", "gather"):
            if style == "moe_tp_experts":
                mod._trnsim_after = self.comm.all_reduce  # the experts' row-parallel output
                self.replaced[name] = style
        elif mod is not None and style == "replicated_with_grad_allreduce":
            # (Qwen3's q/k norms over each head: whole on every rank, their gradients summed over
            # the TP group when the backward reaches them, as DTensor reduces a Replicate weight's)
            nbytes = sum(p.numel() * p.element_size() for p in mod.parameters())
            comm = self.comm
            if nbytes:
                mod.register_full_backward_hook(
                    lambda m, gi, go: comm.charge("all-reduce", nbytes, comm.tp_group,
                                                  _dtype(next(m.parameters()))))
            self.replaced[name] = style
        elif mod is not None:
            raise PlanError(f"--tp {tp}: {name}: transformers' plan style '{style}' is not one trnsim shards")

    def _sequence_parallel(self, base: nn.Module) -> None:
        layers = getattr(base, "layers", None)
        if not isinstance(layers, nn.ModuleList) or not len(layers):
            raise PlanError("--sp: the model has no decoder layers (model.layers) to run sequence-parallel")
        comm, tp = self.comm, self.plan.tp

        def scatter(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            x = args[0] if args else kwargs["hidden_states"]
            seq = x.shape[1]
            comm.sp_active = seq > 1 and seq % tp == 0  # a decode step (one token) runs plain TP, as NxD's does
            if not comm.sp_active:
                return None
            local = x.narrow(1, comm.plan.coords(comm.rank)[2] * (seq // tp), seq // tp)
            return ((local, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": local})

        def gather(module: nn.Module, args: Any, out: Any) -> Any:
            if not comm.sp_active:
                return None
            comm.sp_active = False
            return comm.all_gather(out, 1) if isinstance(out, torch.Tensor) else \
                (comm.all_gather(out[0], 1), *out[1:])

        def gather_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if not comm.sp_active:
                return None
            x = args[0] if args else kwargs["hidden_states"]
            full = comm.gather_sequence(x)
            return ((full, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": full})

        layers[0].register_forward_pre_hook(scatter, with_kwargs=True)
        layers[-1].register_forward_hook(gather)
        for layer in layers:  # each block that ends in a row-parallel linear reads the whole sequence
            for block in layer.children():
                if any(isinstance(m, RowParallelLinear) or getattr(m, "_trnsim_after", None) is not None
                       for m in block.modules()):
                    block.register_forward_pre_hook(gather_input, with_kwargs=True)

