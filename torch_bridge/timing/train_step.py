"""One training step of one simulated rank, as the frameworks run it (timing-only).

What :class:`trnsim.training.Recipe` asks, done with the tensors of the run (so HBM and time
follow from what is live and what is launched, never from a formula):

* **vocab-parallel cross-entropy** (NxD's ``parallel_cross_entropy``): the LM head's logits stay
  split over the TP group; the loss takes the max, the target's logit and the sum of exponentials
  each with an all-reduce over the group, in fp32 on ``tokens x vocab / tp`` values, and keeps the
  softmax (fp32, local) for its backward, which is computed in place.
* **recomputation**: ``full`` wraps each decoder layer in ``torch.utils.checkpoint`` (non-
  reentrant: the layer keeps its input; its forward runs again in the backward, collectives
  included); ``selective`` checkpoints NxDT's module list - the RMSNorms and the MLP's
  activation-multiply - so their outputs are recomputed instead of kept.
* **sequence parallelism's saves**: a block's all-gathered input is not kept for its backward;
  the local shard is, and the backward all-gathers it again (NxD's and Megatron's linear layers),
  by a saved-tensor hook.
* **the optimizer**: fp32 master weights, fp32 gradient accumulation (each parameter's gradient
  added into its slice of a flat fp32 buffer as the backward produces it, then freed) and fp32
  AdamW moments; ``zero1`` keeps 1/dp of the master weights and moments, ``fsdp`` also of the
  parameters and gradients (each decoder layer's parameters all-gathered for its forward and
  again for its backward, its gradients reduce-scattered). All of it is allocated before the
  step, as in a run's steady state, so the peak counts it.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from trnsim.workload.training import Recipe, RecipeError

from .checkpointing import checkpointed as _checkpointed

__all__ = ["vocab_parallel_cross_entropy", "apply_recompute", "apply_mx", "sequence_parallel_saves", "OptimizerState"]


# ---- the loss ----------------------------------------------------------------------------------
class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, comm: Any, group: list[int]) -> torch.Tensor:
        rows = logits.numel() // logits.shape[-1]
        f = logits.float()  # fp32 for the loss (NxD's mixed precision keeps it there)
        m = f.amax(-1, keepdim=True)
        comm.charge("all-reduce", rows * 4, group, "fp32")  # the max over the vocabulary
        f.sub_(m)
        target = torch.empty(f.shape[:-1] + (1,), dtype=torch.long, device=f.device)
        picked = f.gather(-1, target)  # the target's logit (zero on the ranks that do not own it)
        comm.charge("all-reduce", rows * 4, group, "fp32")
        f.exp_()
        s = f.sum(-1, keepdim=True)
        comm.charge("all-reduce", rows * 4, group, "fp32")  # the sum of exponentials
        loss = (s.log() - picked).mean()
        f.div_(s)  # the softmax, kept for the backward
        ctx.save_for_backward(f)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        (f,) = ctx.saved_tensors
        f.mul_(g)  # softmax - one-hot at the target, times the loss's gradient (in place)
        return f.to(ctx.dtype), None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, comm: Any) -> torch.Tensor:
    """The mean cross-entropy of ``logits`` split over the vocabulary across the TP group."""
    group = comm.tp_group
    return _VocabParallelCE.apply(logits, comm, group)


# ---- recomputation -----------------------------------------------------------------------------


def _act_mul(mlp: nn.Module) -> Any:
    act = mlp.act_fn
    inner = _checkpointed(lambda g, u: act(g) * u)

    def forward(x: torch.Tensor) -> torch.Tensor:
        return mlp.down_proj(inner(mlp.gate_proj(x), mlp.up_proj(x)))
    return forward


def apply_recompute(layers: nn.ModuleList, mode: str, comm: Any = None) -> None:
    """Recompute ``layers``' activations in the backward as ``mode`` says (module docstring)."""
    if mode == "none":
        return
    if mode == "full":
        for layer in layers:
            layer.forward = _checkpointed(layer.forward, comm)
        return
    found = 0
    for layer in layers:
        for m in layer.modules():
            name = type(m).__name__
            if mode == "attention":  # NxD's CoreAttention and the example's activation-multiply
                if name.endswith("Attention") and hasattr(m, "o_proj"):
                    m._trnsim_recompute_core = True
                    found += 1
                elif all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
                    m.forward = _act_mul(m)
                continue
            if name.endswith("RMSNorm") or name.endswith("LayerNorm") or isinstance(m, nn.LayerNorm):
                m.forward = _checkpointed(m.forward)
                found += 1
            elif all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj", "act_fn")):
                m.forward = _act_mul(m)
                found += 1
    if not found:
        if mode == "attention":
            raise RecipeError("--recompute attention: the model's layers have no attention module with an o_proj to "
                              "recompute; use --recompute full or none")
        raise RecipeError("--recompute selective: the model's layers have no norms or gated MLP to recompute "
                          "(NxDT's module list); use --recompute full or none")


# ---- MXFP8 linears ---------------------------------------------------------------------------------
MX_FORMAT = "mxfp8_e4m3fn"  # TorchAO's MXFP8 recipe: e4m3 for the inputs, weights and gradients


def _mx_linear_forward(m: nn.Linear, fmt: str, x: torch.Tensor) -> torch.Tensor:
    from .parallel import mx_matmul

    y = mx_matmul(x, m.weight, fmt, t=True)
    return y + m.bias if m.bias is not None else y


def apply_mx(layers: nn.ModuleList, fmt: str = MX_FORMAT) -> int:
    """The decoder layers' linears as MX linears (TorchAO's ``convert_to_float8``-style swap of
    every ``nn.Linear`` in them; the LM head stays bf16, as TorchTitan's MX converter leaves
    ``output``; MoE experts' grouped matmuls stay bf16): returns how many."""
    from .parallel import ColumnParallelLinear, RowParallelLinear

    found = 0
    for layer in layers:
        for m in layer.modules():
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear, _FusedProjection)):
                m.mx = fmt
                found += 1
            elif isinstance(m, nn.Linear):
                m.forward = functools.partial(_mx_linear_forward, m, fmt)
                found += 1
    if not found:
        raise RecipeError("--mxfp8: the model's layers have no linears to run in MXFP8")
    return found


# ---- sequence parallelism: keep the shard, gather again in the backward -------------------------
class _Regather:
    """A block's gathered input as its backward sees it: the shard (kept), gathered again once
    (charged) when the first of the block's matmuls needs it, shared by the others."""

    def __init__(self, local: torch.Tensor, nbytes: int, ref: StorageWeakRef, dtype: torch.dtype):
        self.local, self.nbytes, self.ref, self.dtype = local, nbytes, ref, dtype
        self._full: Any = None

    def full(self, comm: Any) -> torch.Tensor:
        if self._full is None:  # held until the block's last matmul has run its backward (this record dies)
            # issued ahead, as NxD's and Megatron's sequence-parallel linears issue it (async, beside the
            # input-gradient matmul): it starts once the collective stream is free
            comm.charge("all-gather", self.nbytes, comm.tp_group,
                        {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(self.dtype, "fp32"), early=True)
            self._full = torch.empty(self.nbytes // self.local.element_size(), dtype=self.local.dtype,
                                     device=self.local.device)
        return self._full


@contextlib.contextmanager
def sequence_parallel_saves(comm: Any) -> Iterator[None]:
    """Within: a sequence-parallel block's gathered input, when autograd saves it, is kept as the
    rank's shard, and all-gathered again (charged) when the backward unpacks it."""
    gathered: dict[int, tuple[torch.Tensor, int, StorageWeakRef]] = {}
    original = comm.gather_sequence

    def gather_sequence(x: torch.Tensor) -> torch.Tensor:
        full = original(x)
        ref = StorageWeakRef(full.untyped_storage())
        for key in [k for k, v in gathered.items() if v[2].expired()]:
            del gathered[key]  # a freed storage's address may come back for another tensor
        gathered[ref.cdata] = (x, full.untyped_storage().nbytes(), ref)
        return full

    records: dict[int, _Regather] = {}

    def pack(t: torch.Tensor) -> Any:
        if t.device.type == "neuron":
            key = StorageWeakRef(t.untyped_storage()).cdata
            hit = gathered.get(key)
            if hit is not None and not hit[2].expired():
                rec = records.get(key)
                if rec is None or rec.ref.expired():
                    rec = records[key] = _Regather(hit[0], hit[1], hit[2], t.dtype)
                return (rec, t.storage_offset(), t.shape, t.stride())  # the matmuls of one block share one
        return t

    def unpack(p: Any) -> torch.Tensor:
        if isinstance(p, tuple) and p and isinstance(p[0], _Regather):
            rec, offset, shape, stride = p
            return torch.as_strided(rec.full(comm), shape, stride, offset)
        return p

    comm.gather_sequence = gather_sequence
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        comm.gather_sequence = original
        gathered.clear()
        records.clear()


# ---- the optimizer's state -----------------------------------------------------------------------
class OptimizerState:
    """Master weights, gradient buffer and AdamW moments of one rank (module docstring)."""

    def __init__(self, params: list[nn.Parameter], recipe: Recipe, dp: int):
        self.params = params
        self.recipe = recipe
        self.dp = dp
        self.numel = sum(p.numel() for p in params)
        self.shard = -(-self.numel // dp) if recipe.sharding in ("zero1", "fsdp") and dp > 1 else self.numel
        fp32, low = torch.float32, params[0].dtype if params else torch.bfloat16
        self.master = torch.empty(self.shard, dtype=fp32, device="neuron") if recipe.master_bytes else None
        state = fp32 if recipe.state_bytes == 4 else low
        self.moments = [torch.empty(self.shard, dtype=state, device="neuron") for _ in range(2)]
        grad_numel = self.shard if recipe.sharding == "fsdp" and dp > 1 else self.numel
        self.grads = torch.empty(grad_numel, dtype=fp32 if recipe.grad_bytes == 4 else low, device="neuron")
        self._hooks: list[Any] = []
        self.ready: list[tuple[int, int]] | None = None  # (tick, gradient bytes) as the backward finishes each
        self.device: Any = None
        off = 0
        for p in params:
            n = p.numel()
            if self.grads.numel() == self.numel:
                view = (off, n)
            else:  # FSDP: this rank's shard of the parameter's gradient
                view = (off // dp, -(-n // dp))
            off += n
            self._hooks.append(p.register_post_accumulate_grad_hook(functools.partial(self._accumulate, view)))

    def _accumulate(self, view: tuple[int, int], p: nn.Parameter) -> None:
        g = p.grad
        if g is None:
            return
        lo, n = view
        if n == g.numel():
            src = g
        else:  # FSDP: the rank's rows of the (reduce-scattered) gradient
            rows = max(1, -(-g.shape[0] // self.dp)) if g.dim() else 1
            src = g.narrow(0, 0, rows) if g.dim() else g
            n = src.numel()
        dst = self.grads.narrow(0, min(lo, self.grads.numel() - n), n).view(src.shape)
        dst.add_(src)  # accumulated in fp32 as it arrives, in the gradient's layout; the bf16 gradient is freed
        p.grad = None
        if self.ready is not None:
            self.ready.append((self.device.now(0), p.numel() * p.element_size()))

    def nbytes(self) -> tuple[int, int, int]:
        """(master, gradients, moments) bytes."""
        m = self.master.untyped_storage().nbytes() if self.master is not None else 0
        return m, self.grads.untyped_storage().nbytes(), sum(t.untyped_storage().nbytes() for t in self.moments)

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()


# ---- NxD's fused projections ------------------------------------------------------------------------
class _FusedProjection(nn.Module):
    """Several projections of one input as one linear (NxD's ``GQAQKVColumnParallelLinear`` with
    ``fuse_qkv``, and its MLP's ``gate_up_proj``): one matmul over the concatenated weights, split
    into the parts; the parts' modules call it with the same input one after the other, so the
    matmul runs on the first call and the others take their slice of it."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        first = parts[0]
        self.sizes = [m.out_features for m in parts]
        self.column = not isinstance(first, nn.Linear)  # a ColumnParallelLinear: weight [in, out], collectives
        total = sum(self.sizes)
        shape = (first.in_features, total) if self.column else (total, first.in_features)
        self.weight = nn.Parameter(torch.empty(shape, dtype=first.weight.dtype, device="meta"),
                                   requires_grad=first.weight.requires_grad)
        biases = [m.bias for m in parts]
        self.bias = nn.Parameter(torch.empty((total,), dtype=biases[0].dtype, device="meta")) \
            if all(b is not None for b in biases) else None
        self.comm = getattr(first, "comm", None)
        self.sp = getattr(first, "sp", False)
        self.mx: str | None = None  # an MX format: the fused linear's matmuls as MX linears (apply_mx)
        self._key: Any = None
        self._outs: list[torch.Tensor] = []
        self._left = 0

    def part(self, x: torch.Tensor, i: int) -> torch.Tensor:
        if self._key is None or self._key() is not x or self._left == 0:
            import weakref

            if self.column and self.comm.tp_overlap and self.comm.plan.tp > 1:
                from .parallel import async_linear

                y = async_linear(x, self.weight, self.bias, self.comm, self.mx)  # NxD's async linear (its backward)
            elif self.column:
                from .parallel import sharded_linear

                xin = x if (self.sp and self.comm.sp_active) else self.comm.copy_to_group(x)
                y = sharded_linear(xin, self.weight, self.bias, self.mx)
            elif self.mx:
                from .parallel import mx_matmul

                y = mx_matmul(x, self.weight, self.mx, t=True)
                y = y + self.bias if self.bias is not None else y
            else:
                y = nn.functional.linear(x, self.weight, self.bias)
            self._key, self._outs, self._left = weakref.ref(x), list(torch.split(y, self.sizes, dim=-1)), len(self.sizes)
        out = self._outs[i]
        self._left -= 1
        if self._left == 0:
            self._outs = []  # the parts hold their slices; the module keeps nothing alive
        return out


class _Part(nn.Module):
    def __init__(self, fused: _FusedProjection, index: int, out_features: int):
        super().__init__()
        self.fused = [fused]  # not a submodule: the fused weight is counted once, on the fused module
        self.index, self.out_features = index, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused[0].part(x, self.index)


def fuse_projections(net: nn.Module) -> nn.Module:
    """q/k/v and gate/up of every layer as NxD's fused linears (on the meta model)."""
    from .parallel import ColumnParallelLinear

    for m in list(net.modules()):
        for names in (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")):
            parts = [getattr(m, n, None) for n in names]
            if not all(isinstance(p, (nn.Linear, ColumnParallelLinear)) for p in parts):
                continue
            if len({type(p) for p in parts}) != 1 or len({p.in_features for p in parts}) != 1:
                continue
            fused = _FusedProjection(parts)
            setattr(m, "_trnsim_fused_" + names[0].split("_")[0], fused)
            for i, (n, p) in enumerate(zip(names, parts)):
                setattr(m, n, _Part(fused, i, p.out_features))
    return net


# ---- expert parallelism ---------------------------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Any, group: list[int]) -> torch.Tensor:
        ctx.comm, ctx.group = comm, group
        comm.charge("all-to-all", x.numel() * x.element_size(), group, _dtype_name(x.dtype))
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:
        ctx.comm.charge("all-to-all", g.numel() * g.element_size(), ctx.group, _dtype_name(g.dtype))
        return g, None, None


def _dtype_name(dt: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dt, "fp32")


def expert_parallel(ep: int, plan: Any, comm: Any) -> Any:
    """A ``then`` for the stage model: every experts module (3-d ``gate_up_proj`` / ``down_proj``)
    keeps ``experts / ep`` experts, and its routed tokens go to the ranks of their experts and
    back by all-to-all over ``ep`` data-parallel ranks (forward and backward)."""
    d, p_i, t = plan.coords(comm.rank)
    lo = d // ep * ep
    group = [plan.rank(dd, p_i, t) for dd in range(lo, lo + ep)]

    def send(x: torch.Tensor) -> torch.Tensor:
        return _AllToAll.apply(x, comm, group)

    def shard(net: nn.Module) -> nn.Module:
        found = 0
        for m in net.modules():
            gu, dn = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
            if isinstance(gu, nn.Parameter) and isinstance(dn, nn.Parameter) and gu.dim() == 3:
                experts = gu.shape[0]
                if experts % ep:
                    raise RecipeError(f"--ep {ep}: the model has {experts} experts, not a multiple of {ep}")
                for name, prm in (("gate_up_proj", gu), ("down_proj", dn)):
                    setattr(m, name, nn.Parameter(torch.empty((experts // ep, *prm.shape[1:]), dtype=prm.dtype,
                                                              device="meta"), requires_grad=prm.requires_grad))
                m._trnsim_ep = send
                found += 1
        if not found:
            raise RecipeError(f"--ep {ep}: the model has no experts to split (a mixture-of-experts model)")
        return net
    return shard


# ---- FSDP: the parameters held as shards, gathered per layer --------------------------------------
class _FullyShard:
    """FSDP2 over the data-parallel group on a rank whose parameters were built whole: the ledger
    keeps 1/dp of each decoder layer's parameters, and each layer's forward and backward hold its
    whole parameters (all-gathered, charged) until the layer is done (reshard after forward).

    The parameters outside the layers (embedding, final norm, LM head: ``net``'s own) are the root
    unit, as TorchTitan's ``fully_shard(model)`` makes them after the blocks: kept as 1/dp shards,
    all-gathered when the forward starts and held through the backward (FSDP2 does not reshard the
    root after forward), their gradients reduce-scattered when the backward ends
    (:meth:`finish_backward`)."""

    def __init__(self, layers: nn.ModuleList, rank: Any, group: list[int], dtype: str, net: nn.Module | None = None):
        self.rank, self.group, self.dtype = rank, group, dtype
        self.dp = len(group)
        ledger = rank.ledger
        self.sizes = [sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in layers]
        inner = {id(p) for layer in layers for p in layer.parameters()}
        root = sum(p.numel() * p.element_size() for p in (net.parameters() if net is not None else ())
                   if id(p) not in inner)
        self.root = len(self.sizes)  # the root unit's index in sizes (when it has parameters)
        if root:
            self.sizes.append(root)
        self.root_gathered = False
        for i in range(len(self.sizes)):
            ledger.release(0, self._gathered(i))  # the rank keeps its shard of each unit
        self.handles = []
        for i, layer in enumerate(layers):
            self.handles.append(layer.register_forward_pre_hook(functools.partial(self._gather, i)))
            self.handles.append(layer.register_forward_hook(functools.partial(self._free, i)))
            self.handles.append(layer.register_full_backward_pre_hook(functools.partial(self._gather_bwd, i)))
            self.handles.append(layer.register_full_backward_hook(functools.partial(self._reduce, i)))
        if root:
            self.handles.append(net.register_forward_pre_hook(self._gather_root))

    def _gathered(self, i: int) -> int:
        """The bytes unit ``i`` holds gathered beyond its shard."""
        n = self.sizes[i]
        return n - -(-n // self.dp)

    def _gather_root(self, module: nn.Module, args: Any) -> None:
        self._hold(self.root)
        self.root_gathered = True

    def root_held(self) -> int:
        """The bytes the root unit's gathered parameters hold beyond its shard now."""
        return self._gathered(self.root) if self.root_gathered else 0

    def finish_backward(self) -> None:
        """The end of the backward: the root unit's gradients reduce-scattered, its parameters
        resharded (nothing for a stage without parameters outside its layers)."""
        if self.root_gathered:
            self._reduce(self.root, None, None, None)
            self.root_gathered = False

    def _hold(self, i: int) -> None:
        self.rank.run._reserve(0, self._gathered(i))
        self.rank.comm.charge("all-gather", self.sizes[i], self.group, self.dtype)

    def _drop(self, i: int) -> None:
        self.rank.ledger.release(0, self._gathered(i))

    def _gather(self, i: int, module: nn.Module, args: Any) -> None:
        self._hold(i)

    def _free(self, i: int, module: nn.Module, args: Any, out: Any) -> None:
        self._drop(i)

    def _gather_bwd(self, i: int, module: nn.Module, grad_out: Any) -> None:
        self._hold(i)

    def _reduce(self, i: int, module: nn.Module, grad_in: Any, grad_out: Any) -> None:
        self.rank.comm.charge("reduce-scatter", self.sizes[i], self.group, self.dtype)
        self._drop(i)

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        for i in range(len(self.sizes)):
            self.rank.ledger.devices[0].add(self._gathered(i))  # whole again, as the storages are freed


# ---- one role's step ------------------------------------------------------------------------------
def _layers_of(net: nn.Module) -> nn.ModuleList:
    """The repeated blocks of a model: a decoder's ``layers``, an encoder's ``encoder.layer``."""
    base = getattr(net, net.base_model_prefix, net)
    for path in ("layers", "encoder.layer", "h", "decoder.layers"):
        mod: Any = base
        for part in path.split("."):
            mod = getattr(mod, part, None)
        if isinstance(mod, nn.ModuleList) and len(mod):
            return mod
    raise RecipeError(f"model type '{net.config.model_type}' has no repeated layers (model.layers or "
                      f"encoder.layer) to recompute or shard")


def _sweep_allocated(rank: Any) -> int:
    rank.run.sweep()
    return rank.ledger.devices[0].allocated


def run_train_role(rank: Any, spec: Any, plan: Any, dt: torch.dtype, last: bool, micro_batch: int, seq: int,
                   trace: bool, recipe: Recipe, micro: int) -> dict[str, Any]:
    """One micro-batch's forward and backward, the gradient reduction and the optimizer step of
    ``rank``'s role, with the recipe's memory; returns the ticks, reports and memory."""
    from trnsim.workload.plan import RoleMemory, summarise
    from trnsim.workload.training import TrainMemory, in_flight

    from . import models
    from .roles import scope, stage_model, torch_dtype_name

    role = rank.role
    comm = rank.comm
    vocab_parallel = recipe.loss == "vocab-parallel" and plan.tp > 1
    out: dict[str, Any] = {"traces": []}
    dname = torch_dtype_name(dt)
    dp_group = plan.dp_group(role.rank)
    comm.tp_overlap = recipe.tp_overlap
    with rank.run, models.quiet():
        if recipe.ep > 1 and plan.dp % recipe.ep:
            raise RecipeError(f"--ep {recipe.ep}: expert parallelism splits the data-parallel ranks; --dp {plan.dp} "
                              f"is not a multiple of it")
        ep = expert_parallel(recipe.ep, plan, comm) if recipe.ep > 1 else None

        def then(m: nn.Module) -> nn.Module:
            if recipe.fused_projections:
                m = fuse_projections(m)
            return ep(m) if ep is not None else m
        net = stage_model(spec, role, plan, comm, dt, last, gather_logits=not vocab_parallel, then=then,
                          attention=models.CORE_ATTENTION if recipe.attention == "core" else models.ATTENTION)
        net.train()
        params = [p for p in net.parameters() if p.requires_grad]
        base = getattr(net, net.base_model_prefix, net)
        emb = getattr(base, "embed_tokens", None)
        out["params"] = sum(p.numel() for p in params) - (emb.weight.numel() if isinstance(emb, nn.Module)
                                                          and hasattr(emb, "weight") else 0)
        layers = _layers_of(net)
        fsdp = _FullyShard(layers, rank, dp_group, dname, net) if recipe.sharding == "fsdp" and plan.dp > 1 else None
        weights = _sweep_allocated(rank)
        state = OptimizerState(params, recipe, plan.dp)
        if recipe.mxfp8:
            apply_mx(layers)
        if recipe.cp > 1:  # the ring: the rank's CP group, cp consecutive data-parallel replicas (as EP's)
            d, p_i, t = plan.coords(comm.rank)
            lo = d // recipe.cp * recipe.cp
            rank.run.ring = (comm, [plan.rank(dd, p_i, t) for dd in range(lo, lo + recipe.cp)])
        apply_recompute(layers, recipe.recompute, comm)
        sp = contextlib.nullcontext() if not (plan.sp and plan.tp > 1) else sequence_parallel_saves(comm)
        if recipe.fused:  # the step lowered as the compiled path lowers it
            from .fuse_regions import Fuser

            rank.run.fuser = Fuser(rank.run)
            rank.run.target.flash_backward = True
            rank.run.target.attention_dropout = True
        before = _sweep_allocated(rank)
        rank.ledger.devices[0].reset_peak()
        with scope(rank.device, trace) as rep:
            start = rank.step_start()
            with sp:
                labels = torch.empty((micro_batch, seq), dtype=torch.long, device="neuron") \
                    if last and not vocab_parallel else None
                if role.first:
                    ids = torch.empty((micro_batch, seq), dtype=torch.long, device="neuron")
                    res = net(input_ids=ids, labels=labels, use_cache=False)
                else:
                    x = torch.empty((micro_batch, seq, spec.hidden), dtype=dt, device="neuron", requires_grad=True)
                    res = net(inputs_embeds=x, labels=labels, use_cache=False)
                if not last:
                    y = res.last_hidden_state
                elif vocab_parallel:
                    y = vocab_parallel_cross_entropy(res.logits, comm)
                else:
                    y = res.loss
                del res
            rank.run._flush()
            out["forward_ticks"] = rank.step_end(start)
        out["forward_report"] = summarise(rep[0], out["forward_ticks"])
        # (FSDP's root unit, gathered when the forward started and held into the backward, is not an
        # activation: its bytes count in the peak, under temporaries)
        activations = _sweep_allocated(rank) - before - (fsdp.root_held() if fsdp is not None else 0)
        state.ready, state.device = [], rank.device
        with scope(rank.device, trace) as rep:
            start = rank.step_start()
            state.ready.append((start, 0))
            y.backward(None if last else torch.empty_like(y))
            if fsdp is not None:
                fsdp.finish_backward()
            rank.run._flush()
            out["backward_ticks"] = rank.step_end(start)
        out["backward_report"] = summarise(rep[0], out["backward_ticks"])
        if trace:
            out["traces"] += [("forward", role, None), ("backward", role, rep[0])]
        del y
        grad_bytes = out["params_local"] = state.numel
        nbytes = grad_bytes * dt.itemsize  # gradients reduced in the compute dtype (NxD: bf16)
        ready = [(t - start, n) for t, n in state.ready[1:]]
        state.ready = None
        out["dp_ticks"], out["buckets"] = 0, []
        if fsdp is None and plan.dp > 1 and ready:  # FSDP reduce-scatters each layer in its backward
            from trnsim.workload.training import gradient_buckets, overlap_buckets

            coll = "reduce-scatter" if recipe.sharding == "zero1" else "all-reduce"
            buckets = gradient_buckets(ready, recipe.bucket_mb * 2 ** 20)
            times = [round(comm.report(coll, n, dp_group, dname).time_s * comm.system.tick_hz) for _, n in buckets]
            out["dp_ticks"], spans = overlap_buckets([t for t, _ in buckets], times, out["backward_ticks"],
                                                     recipe.overlap)
            out["buckets"] = [(n, a, b) for (_, n), (a, b) in zip(buckets, spans)]
        start = rank.step_start()
        if recipe.fused:
            _fused_optimizer_step(state, dt, rank)
        else:
            _optimizer_step(state, dt)
        if fsdp is None and recipe.sharding == "zero1" and plan.dp > 1:
            comm.charge("all-gather", nbytes, dp_group, dname)  # the updated parameters to every replica
        rank.run._flush()
        out["optimizer_ticks"] = rank.step_end(start)
        out["fused_regions"] = rank.run.fuser.regions if rank.run.fuser is not None else 0
        rank.run.fuser = None
        rank.run.ring = None
        mem = rank.ledger.devices[0]
        measured = mem.peak
        master, grads, moments = state.nbytes()
        state.remove()
        if fsdp is not None:
            fsdp.close()
        held = in_flight(plan.pp, role.stage, micro, recipe.virtual_stages)
        fixed = weights + master + grads + moments
        tm = out["train_memory"] = TrainMemory(
            role.stage, role.ranks, weights, master, grads, moments, activations, held,
            max(0, measured - fixed - activations), measured + (held - 1) * activations, mem.capacity)
        out["memory"] = RoleMemory(role.stage, role.ranks, weights, 0, master + grads + moments, tm.peak, mem.capacity)
        del state, net, params
        rank.run.sweep()
    return out


def _optimizer_step(state: OptimizerState, dt: torch.dtype) -> None:
    """AdamW over this rank's shard, op by op as torch.optim's foreach path launches it, then the
    fp32 master weights cast into the parameters' dtype."""
    master = state.master if state.master is not None else torch.empty(state.shard, dtype=dt, device="neuron")
    p = nn.Parameter(master, requires_grad=True)
    p.grad = state.grads.narrow(0, 0, state.shard).to(master.dtype)
    opt = torch.optim.AdamW([p], lr=1e-4, foreach=True)
    opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": state.moments[0], "exp_avg_sq": state.moments[1]}
    opt.step()
    if state.master is not None:
        torch.empty(state.shard, dtype=dt, device="neuron").copy_(master)  # master -> bf16 parameters


def _fused_optimizer_step(state: OptimizerState, dt: torch.dtype, rank: Any) -> None:
    """AdamW over this rank's shard as the compiled step runs it: one multi-tensor kernel
    (:mod:`trnsim.kernels.foreach`, pattern ``adamw``) reading the master weights, gradients and
    moments once and writing them back, and with mixed precision also writing the parameters in
    their compute dtype (the cast as one more output of the same program)."""
    from trnsim.device import KernelSpec
    from trnsim.kernels.foreach import PATTERNS_INPLACE, pattern
    from trnsim.kernels.fused import Program

    from ..eager.lowering import tile_dtype

    sdt = "fp32" if state.recipe.state_bytes == 4 else tile_dtype(dt).name
    prog = pattern("adamw", sdt)
    params: dict[str, Any] = {"pattern": "adamw"}
    if state.master is not None and sdt != tile_dtype(dt).name:
        prog = Program(prog.inputs, prog.steps, prog.outputs + ((prog.outputs[0][0], tile_dtype(dt).name),))
        params = {"program": prog, "inplace": PATTERNS_INPLACE["adamw"]}
    cost = rank.device.cost(KernelSpec.of("foreach_fused", (1, state.shard), sdt, params))
    rank.run.launch(0, "_fused_adamw", cost)


def assumptions(recipe: Recipe) -> tuple[str, ...]:
    """What an estimate of ``recipe`` assumes, one line each (printed with the estimate)."""
    out = ["each micro-batch forward and backward is one compiled graph: one host dispatch each"]
    if recipe.fused:
        out.append("elementwise ops between two other launches lowered as the compile path lowers them (fused "
                   "regions of the library's fused kernel; the rest one kernel per aten op)")
        out.append("flash attention forward as the library kernel, backward as three passes of its instruction "
                   "stream (six matmul passes for the backward's five); attention dropout inside the kernel "
                   "(VectorE dropout on each probability tile, the mask regenerated in the backward)")
        out.append("AdamW as one multi-tensor kernel over the rank's optimizer shard")
    else:
        out.append("one kernel per aten op (no cross-op fusion); AdamW op by op")
    out.append(("q/k/v and gate/up as one linear each (NxD's fused projections)" +
                ("; their backward as NxD's async linear: the sequence-parallel all-gather beside the input-gradient "
                 "matmul, the input gradient's reduce-scatter (all-reduce without SP) beside the weight-gradient "
                 "matmul, each waited on where its result is first read" if recipe.tp_overlap else
                 "; their backward waits for each TP collective"))
               if recipe.fused_projections else "q/k/v and gate/up as separate linears")
    if recipe.cp > 1:
        out.append(f"context parallelism over {recipe.cp} data-parallel ranks: each holds 1/{recipe.cp} of every "
                   f"sequence (load-balanced causal chunks); attention as ring attention: key/value blocks passed "
                   f"around the group by permutes beside the attention of the block in hand, partial outputs merged "
                   f"by their log-sum-exp; the backward passes the blocks and their gradients on")
    if recipe.mxfp8:
        out.append("the decoder layers' linears in MXFP8 as TorchAO runs them: each matmul's two operands cast along "
                   "its contraction by the mx_quantize kernel (six casts a linear a step: x, w, the output gradient, "
                   "each twice), then matmul_mx on nc_matmul_mx, each its own launch (the fused NKI kernel would hide "
                   "casts behind the matmul: not modelled); LM head and MoE experts bf16; MFU against the bf16 peak")
    out.append(("1F1B pipeline schedule" if recipe.schedule == "1f1b" else
                f"interleaved 1F1B with {recipe.virtual_stages} chunks per pipeline rank (list-scheduled in Megatron's "
                f"order)") + "; activations sent stage to stage with send/recv on the links")
    out.append(f"data-parallel gradients in {recipe.bucket_mb} MB buckets, " +
               ("each reduced as soon as the backward has filled it (overlapped; the step pays what runs past "
                "the last backward)" if recipe.overlap else "reduced after the last backward"))
    out.append("each collective simulated beside the same call of its sibling groups (the other TP or DP groups, "
               "sharing links, HBM and DMA); different collectives of a step (a gradient bucket beside the TP "
               "collectives) do not slow each other")
    return tuple(out)
