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
  into it as a tile program over each score tile (:func:`score_program`: ops on the score and the
  query and key indices, which GpSimd's ``iota`` makes on chip) and the causal mask as the
  kernel's causal mode; a mask it cannot read is charged as a read of the dense mask, a score
  function it cannot express (one reading the batch or head index, or a captured buffer) as one
  generic pass over the scores. The backward is the eager attention backward's kernels, plus a
  generic pass over the scores for the score function's gradient.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from trnsim.device import KernelSpec
from trnsim.isa import KernelError
from trnsim.kernels.fused import FULL, Program

from .. import _torch, lowering
from ..runtime import runtime
from .fusion import Builder, Unfusable, _emit

__all__ = ["FlexKernel", "score_program", "is_causal", "use_flex_kernels"]

aten = torch.ops.aten
FLEX = torch.ops.higher_order.flex_attention
FLEX_BACKWARD = torch.ops.higher_order.flex_attention_backward


def score_program(gm: fx.GraphModule) -> Program | None:
    """The score function ``(score, b, h, q_idx, kv_idx) -> score`` as a tile program over
    (score, q_idx, kv_idx), or None where it reads something else (or is the identity)."""
    ph = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(ph) != 5:
        return None
    b = Builder(("", ""))
    for node in (ph[0], ph[3], ph[4]):
        b.inputs.append((node, FULL, "fp32"))
        b.kinds.append(FULL)
        b.values[node] = len(b.inputs) - 1
    try:
        for n in gm.graph.nodes:
            if n.op == "call_function":
                _emit(b, n)
            elif n.op == "output":
                out = n.args[0][0] if isinstance(n.args[0], (tuple, list)) else n.args[0]
                v = b.values.get(out)
                if v is None or not b.steps:
                    return None
                return Program(((FULL, "fp32"),) * 3, tuple(b.steps), ((v, "fp32"),))
    except (Unfusable, KeyError, AttributeError):
        return None
    return None


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
        self.program = score_program(score) if score is not None else None
        self.modified = score is not None and self.program is None and not _is_identity(score)
        self.causal = mask is not None and is_causal(mask)
        self.masked = mask is not None and not self.causal and not _is_all_true(mask)
        self.__name__ = "flex_attention_backward" if self.backward else "flex_attention"
        self._costs: dict[Any, list[Any]] = {}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        q = args[0]
        dev = runtime().device
        with dev.muted():
            out = self.hop(*args, **kwargs)
        key = (tuple(q.shape), q.dtype, tuple(args[1].shape))
        costs = self._costs.get(key)
        if costs is None:
            costs = self._costs[key] = [runtime().cost(s) for s in self._specs(q, args[1])]
        index = q.device.index or 0
        for c in costs:
            runtime().charge(index, self.__name__, c)
        return out

    def _specs(self, q: torch.Tensor, k: torch.Tensor) -> list[KernelSpec]:
        heads, (l, e), s = q.shape[-3], q.shape[-2:], k.shape[-2]
        b = q.numel() // max(1, heads * l * e)
        scores = torch.empty((b, heads, l, s), dtype=torch.float32, device="meta")
        specs: list[KernelSpec] = []
        if self.backward:
            specs += lowering.attention_backward_specs(q, s, q.dtype)
            if self.program is not None or self.modified:
                specs.append(lowering.generic_spec("score_mod_backward", [scores, scores], [scores]))
            return specs
        meta = torch.empty(q.shape, dtype=q.dtype, device="meta")
        generic = lowering.generic_spec("flex_attention", [meta, meta, meta], [meta])
        scale = float(self.scale) if self.scale is not None else None
        spec = KernelSpec.of("attention", (b, heads, l, e), lowering.tile_dtype(q.dtype).name,
                             {"causal": self.causal, "scale": scale, "kv_block": 0, "score_mod": self.program},
                             fallback=generic)
        try:
            runtime().cost(spec)
        except KernelError:
            spec = generic
        specs.append(spec if l == s else generic)
        if self.modified:
            specs.append(lowering.generic_spec("score_mod", [scores], [scores]))
        if self.masked:
            specs.append(lowering.generic_spec("flex_mask", [torch.empty((b, heads, l, s), dtype=torch.bool,
                                                                          device="meta")], []))
        return specs


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
