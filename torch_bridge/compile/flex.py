"""FlexAttention (``torch.nn.attention.flex_attention``) in compiled graphs.

PyTorch refuses FlexAttention on devices outside its list (``_validate_device``);
:func:`torch_bridge.compile.backend.allow_neuron` lets neuron tensors through (other devices are
checked as before). Under
the neuron backend the aot graphs hold the ``flex_attention`` / ``flex_attention_backward``
higher-order ops with the score function and mask as subgraphs. :class:`FlexKernel` runs each as
one launch:

* **values** - the op's own dense implementation, run on the device with its launches muted
  (its matmuls on the TensorE datapath, as any neuron op's);
* **time** - the forward is the library's flash-attention kernel with the score function fused
  into it as a tile program over each score tile (:func:`score_program`: ops on the score, the
  query and key indices, which GpSimd's ``iota`` makes on chip, the batch and head index, which
  are constants of a head's tiles, and captured tensors read at those indices, which the kernel
  loads per tile: ``bias[h]``, ``rel[q_idx, kv_idx]``), the causal mask as the kernel's causal
  mode, and the block mask as the key blocks each query tile visits (fully masked blocks are
  skipped). What does not fuse is charged beside the kernel and said in a one-line warning: a
  score function the program cannot express (a tensor read at a computed index, a comparison)
  as one generic pass over the scores, a mask function other than the causal one as a generic
  pass over the blocks it partially masks (over the whole dense mask where the block mask holds
  no values: a timing-only run). The backward recomputes the scores (the forward keeps only the
  log-sum-exp) and runs the eager attention backward's kernels, plus a generic pass over the
  scores for the score function's gradient.
"""

from __future__ import annotations

import operator
import warnings
from typing import Any, NamedTuple

import torch
import torch.fx as fx

from trnsim.device import KernelSpec
from trnsim.isa import KernelError
from trnsim.kernels.fused import FULL, Program

from .. import _torch
from ..eager import lowering, memory
from ..runtime import runtime
from .fusion import Builder, Unfusable, emit_node, trn_dtype

__all__ = ["FlexKernel", "ScoreMod", "score_program", "is_causal", "use_flex_kernels"]

aten = torch.ops.aten
FLEX = torch.ops.higher_order.flex_attention
FLEX_BACKWARD = torch.ops.higher_order.flex_attention_backward


class ScoreMod(NamedTuple):
    """A score function as the attention kernel's tile program: ``program`` (input 0 the score),
    ``roles`` its other inputs (:func:`trnsim.kernels.attention.parse_score_input`: index tiles,
    the batch and head index, captured tensors at those indices) and ``buffers``, which of the
    op's captured tensors each ``buf<i>`` is (their positions among ``score_mod_other_buffers``)."""

    program: Program
    roles: tuple[str, ...]
    buffers: tuple[int, ...]


_INDEX_NAMES = ("b", "h", "q", "kv")


def score_program(gm: fx.GraphModule) -> ScoreMod | str | None:
    """The score function ``(score, b, h, q_idx, kv_idx, *captured) -> score`` as a tile program
    over the score, the indices it reads and the captured tensors it reads at them (a tensor
    indexed by b, h, q_idx and kv_idx: a per-head bias ``bias[h]``, a bias table
    ``rel[q_idx, kv_idx]``); None for the identity; else a line saying what it reads that a
    tile program cannot (a tensor at a computed index, a comparison)."""
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(ph) < 5:
        return None
    index_of = {n: name for n, name in zip(ph[1:5], _INDEX_NAMES)}
    buffers = ph[5:]
    roles: list[str] = []
    role_of: dict[fx.Node, int] = {}  # a placeholder or an indexing node -> its input
    used_bufs: list[int] = []
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]

    def role(node: fx.Node, name: str) -> None:
        if node not in role_of:
            roles.append(name)
            role_of[node] = len(roles)  # input 0 is the score

    def buffer_input(buf: fx.Node, axes: tuple[str, ...]) -> str:
        j = buffers.index(buf)
        if j not in used_bufs:
            used_bufs.append(j)
        return f"buf{used_bufs.index(j)}[{','.join(axes)}]"

    for n in calls:
        if n.target is aten.index.Tensor and n.args[0] in buffers:
            idx = list(n.args[1])
            val = n.args[0].meta.get("val")
            if any(i not in index_of for i in idx):
                return "it reads a captured tensor at a computed index (a gather)"
            axes = tuple(index_of[i] for i in idx)
            if val is None or len(axes) != val.dim() or len(set(axes)) != len(axes):
                return "it reads part of a captured tensor (fewer indices than dims) or one axis twice"
            if "q" in axes and "kv" in axes and axes.index("q") > axes.index("kv"):
                return "it reads a captured tensor as [kv_idx, q_idx] (transposed)"
            role(n, buffer_input(n.args[0], axes))
            continue
        for a in n.all_input_nodes:
            if a in index_of:
                role(a, {"q": "q_idx", "kv": "kv_idx"}.get(index_of[a], index_of[a]))
            elif a in buffers:
                val = a.meta.get("val")
                if val is None or val.numel() != 1:
                    return "it uses a captured tensor whole (not one value of it per score)"
                role(a, buffer_input(a, ()))
    b = Builder(("", ""))
    b.inputs.append((ph[0], FULL, "fp32"))
    b.kinds.append(FULL)
    b.values[ph[0]] = 0
    from trnsim.kernels.attention import parse_score_input

    metas = [(tuple(buffers[j].meta["val"].shape), "fp32") for j in used_bufs]
    for node, i in role_of.items():
        kind = parse_score_input(roles[i - 1], metas)[0]
        dt = "fp32"
        if node.op == "call_function":
            dt = trn_dtype(node.args[0].meta["val"].dtype)
        elif node in buffers:
            dt = trn_dtype(node.meta["val"].dtype)
        b.inputs.append((node, kind, dt))
        b.kinds.append(kind)
        b.values[node] = i
    try:
        for n in calls:
            if n in role_of:
                continue
            emit_node(b, n)
        out = next(n for n in gm.graph.nodes if n.op == "output")
        res = out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]
        v = b.values.get(res)
        if v is None or not b.steps:
            return None if res is ph[0] else "its result is not computed from the score"
        if b.kinds[v] != FULL:
            return "its result does not depend on the score"
        return ScoreMod(Program(tuple((k, d) for _, k, d in b.inputs), tuple(b.steps), ((v, "fp32"),)),
                        tuple(roles), tuple(used_bufs))
    except (Unfusable, KeyError, AttributeError) as e:
        return f"{e}" if isinstance(e, Unfusable) else f"an op without a tile-program form ({type(e).__name__})"


def is_causal(gm: fx.GraphModule) -> bool:
    """True when the mask function is ``q_idx >= kv_idx`` (or ``kv_idx <= q_idx``)."""
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    if len(ph) != 4 or len(calls) != 1:
        return False
    c = calls[0]
    q, k = ph[2], ph[3]
    return (c.target in (aten.ge.Tensor, operator.ge) and tuple(c.args) == (q, k)) or \
        (c.target in (aten.le.Tensor, operator.le) and tuple(c.args) == (k, q))


def _sub(gm: fx.GraphModule, node: Any) -> fx.GraphModule | None:
    return getattr(gm, node.target, None) if isinstance(node, fx.Node) and node.op == "get_attr" else None


class FlexKernel:
    """One flex_attention (or its backward) node run as one launch (module docstring)."""

    def __init__(self, node: fx.Node, gm: fx.GraphModule):
        self.hop = node.target
        self.backward = node.target is FLEX_BACKWARD
        args = node.args
        score = _sub(gm, args[7] if self.backward else args[3])
        block_mask = args[9] if self.backward else args[4]
        mask = _sub(gm, block_mask[-1]) if isinstance(block_mask, (tuple, list)) and block_mask else None
        self.scale = args[10] if self.backward else args[5]
        mod = score_program(score) if score is not None else None
        self.program = mod if isinstance(mod, ScoreMod) else None
        self.modified = isinstance(mod, str)
        if self.modified and not self.backward:
            warnings.warn(f"trnsim: flex_attention: the score function does not fuse into the attention kernel ({mod}); "
                          f"it is charged as one more pass over the [B, H, L, S] scores (generic:score_mod)",
                          UserWarning, stacklevel=2)
        self.causal = mask is not None and is_causal(mask)
        self.masked = mask is not None and not self.causal and not _is_all_true(mask)
        self.__name__ = "flex_attention_backward" if self.backward else "flex_attention"
        self._costs: dict[Any, list[Any]] = {}
        self._warned_mask = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        q = args[0]
        dev = runtime().device
        with dev.muted():
            out = self.hop(*args, **kwargs)
        buffers = args[7] if not self.backward and len(args) > 7 else ()
        blocks = None if self.backward else _block_pattern(args[4], q)
        key = (tuple(q.shape), q.dtype, tuple(args[1].shape), tuple((tuple(t.shape), t.dtype) for t in buffers
                                                                      if isinstance(t, torch.Tensor)), blocks)
        costs = self._costs.get(key)
        if costs is None:
            costs = self._costs[key] = [runtime().cost(s) for s in self._specs(q, args[1], buffers, blocks)]
        index = q.device.index or 0
        for c in costs:
            runtime().charge(index, self.__name__, c)
        return out

    def _specs(self, q: torch.Tensor, k: torch.Tensor, buffers: Any = (), blocks: Any = None) -> list[KernelSpec]:
        heads, (l, e), s = q.shape[-3], q.shape[-2:], k.shape[-2]
        b = q.numel() // max(1, heads * l * e)
        scores = torch.empty((b, heads, l, s), dtype=torch.float32, device="meta")
        specs: list[KernelSpec] = []
        if self.backward:
            # the forward kept the log-sum-exp, not P [B, H, L, S]: the backward recomputes S = Q Kᵀ
            # (as a flash backward does) before the eager backward's four matmuls
            specs += [sp for sp in (lowering.matmul_spec(b * heads, l, e, s, q.dtype, True, True),) if sp is not None]
            specs += lowering.attention_backward_specs(q, s, q.dtype)
            if self.program is not None or self.modified:
                specs.append(lowering.generic_spec("score_mod_backward", [scores, scores], [scores]))
            return specs
        meta = torch.empty(q.shape, dtype=q.dtype, device="meta")
        generic = lowering.generic_spec("flex_attention", [meta, meta, meta], [meta])
        scale = float(self.scale) if self.scale is not None else None
        params: dict[str, Any] = {"causal": self.causal, "scale": scale, "kv_block": 0}
        if self.program is not None:
            mod = self.program
            params.update(score_mod=mod.program, score_inputs=mod.roles, score_buffers=tuple(
                (tuple(buffers[j].shape), lowering.tile_dtype(buffers[j].dtype).name) for j in mod.buffers))
        dt = lowering.tile_dtype(q.dtype).name
        dense = KernelSpec.of("attention", (b, heads, l, e), dt, params, fallback=generic)
        spec = dense
        masked = (b, heads, l, s)  # what a mask function that does not fuse is applied to
        if blocks is not None and l == s:
            qbs, kvbs, patterns, partial = blocks
            sparse = KernelSpec.of("attention", (b, heads, l, e), dt, {**params, "block_mask": (qbs, kvbs, patterns)},
                                   fallback=dense)
            try:
                runtime().cost(sparse)
                if sparse not in runtime().device.refused():
                    spec, masked = sparse, (partial, qbs, kvbs)
            except KernelError:
                pass
        try:
            runtime().cost(spec)
        except KernelError:
            spec = generic
        specs.append(spec if l == s else generic)
        if self.modified:
            specs.append(lowering.generic_spec("score_mod", [scores], [scores]))
        if self.masked:
            if not self._warned_mask:
                self._warned_mask = True
                where = "the partially masked blocks" if len(masked) == 3 else "the whole [B, H, L, S] mask"
                warnings.warn(f"trnsim: flex_attention: the mask function does not fuse into the attention kernel "
                              f"(only causal masks do); it is charged as one generic pass over {where} "
                              f"(generic:flex_mask)", UserWarning, stacklevel=3)
            specs.append(lowering.generic_spec("flex_mask", [torch.empty(masked, dtype=torch.bool, device="meta")], []))
        return specs


def _block_pattern(block_mask: Any, q: torch.Tensor) -> tuple[int, int, tuple[Any, ...], int] | None:
    """A BlockMask (the flex_attention op's tuple) as the attention kernel's ``block_mask``
    pattern: (query block, key block, the key blocks each query block of each head attends to
    (one pattern when every head's is the same), how many of them are partially masked). The
    pattern is the block mask's index tensors, which a flex kernel reads to choose its work, as
    an MoE kernel reads its routing; None where they hold no values (a timing-only run)."""
    if not isinstance(block_mask, (tuple, list)) or len(block_mask) < 6:
        return None
    qbs, kvbs = block_mask[-3], block_mask[-2]
    tensors = block_mask[2:6]
    if not isinstance(qbs, int) or not isinstance(kvbs, int) or \
            any(t is not None and not isinstance(t, torch.Tensor) for t in tensors) or tensors[0] is None:
        return None
    if any(t is not None and (isinstance(t, _torch.FakeTensor) or t.is_meta) for t in tensors):
        return None
    num, idx, full_num, full_idx = (None if t is None else (memory.cpu_view(t) if t.device.type == "neuron"
                                                            else t).to(torch.int64) for t in tensors)
    heads = q.shape[-3]
    b = q.numel() // max(1, heads * q.shape[-2] * q.shape[-1])
    bb, hh = num.shape[0], num.shape[1]
    if bb not in (1, b) or hh not in (1, heads):
        return None
    per: dict[tuple[int, int], tuple[tuple[int, ...], ...]] = {}
    for i in range(bb):
        for j in range(hh):
            rows = []
            for qb in range(num.shape[2]):
                ks = set(idx[i, j, qb, :int(num[i, j, qb])].tolist())
                if full_num is not None:
                    ks |= set(full_idx[i, j, qb, :int(full_num[i, j, qb])].tolist())
                rows.append(tuple(sorted(ks)))
            per[(i, j)] = tuple(rows)
    patterns = tuple(per[(bi if bb > 1 else 0, hi if hh > 1 else 0)] for bi in range(b) for hi in range(heads))
    if len(set(patterns)) == 1:
        patterns = patterns[:1]
    partial = int(num.sum()) * (b // bb) * (heads // hh)
    return qbs, kvbs, patterns, partial


def _is_identity(gm: fx.GraphModule) -> bool:
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    res = out.args[0][0] if isinstance(out.args[0], (tuple, list)) else out.args[0]
    return bool(ph) and res is ph[0]


def _is_all_true(gm: fx.GraphModule) -> bool:
    """A mask function that keeps every score (``noop_mask``): a constant true."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    return all(c.target in (aten.new_ones.default, aten.ones.default, aten.full.default, aten.scalar_tensor.default,
                            aten.lift_fresh_copy.default, aten.clone.default) for c in calls)


def use_flex_kernels(gm: fx.GraphModule) -> bool:
    """Point ``gm``'s flex attention nodes at :class:`FlexKernel` (in place); True if any."""
    changed = False
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target in (FLEX, FLEX_BACKWARD):
            n.target = FlexKernel(n, gm)
            changed = True
    if changed:
        gm.recompile()
    return changed
