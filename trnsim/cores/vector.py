"""VectorE: elementwise, reductions and PSUM evacuation; 128 lanes, one per partition.

Costs are the published "estimated instruction cost" formulas (datasheet §7) in VectorE cycles,
divided by the NC-v3/v4 performance modes (§4.3) when their conditions hold:

* 4x (``perf_mode_fast``): tensor_copy / tensor_scalar, SBUF to SBUF, 16-bit float in and out,
  unit innermost stride;
* 2x (``perf_mode_mid``): the same ops when not contiguous or when one side is PSUM, and
  tensor_tensor with both inputs in SBUF and every tensor 16-bit float.

scalar_tensor_tensor costs ``2N`` (``N`` for bf16 subtract-then-multiply, N even; §7, S16).

A dependent instruction sees the result ``dependency_latency_cycles`` after the end, so a
chain of tiny dependent ops runs at ~100 cycles each (§7, S8).
"""

from __future__ import annotations

from ..isa import Instruction, Memset, ScalarTensorTensor, TensorCopy, TensorReduce, TensorScalar, TensorTensor, TileAP
from .alu import ElementwiseExec
from .base import Engine, register_engine


def is16(ap: TileAP) -> bool:
    return ap.dtype.is_float and ap.dtype.itemsize == 2


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@register_engine
class VectorEngine(ElementwiseExec, Engine):
    name = "Vector"

    def perf_copy(self, dst: TileAP, src: TileAP) -> int:
        v = self.config.core.vector
        if is16(dst) and is16(src):
            if dst.space == src.space == "sbuf" and dst.is_contiguous() and src.is_contiguous():
                return v.perf_mode_fast
            return v.perf_mode_mid
        if "psum" in (dst.space, src.space):
            return v.perf_mode_mid
        return 1

    def cycles(self, ins: Instruction) -> int:
        v = self.config.core.vector
        mi = v.min_ii_cycles
        if isinstance(ins, (TensorCopy, TensorScalar)):
            n = ins.data.free_size
            return max(mi, ceil_div(n, self.perf_copy(ins.dst, ins.data)))
        if isinstance(ins, TensorTensor):
            a, b, d = ins.data1, ins.data2, ins.dst
            n = a.free_size
            spaces = {a.space, b.space}
            bf16_fast = (spaces == {"sbuf"} and all(x.dtype.name == "bfloat16" for x in (a, b, d))
                         and ins.op in ("add", "multiply", "subtract") and a.is_contiguous() and b.is_contiguous())
            k = 1 if spaces == {"sbuf", "psum"} or bf16_fast else 2
            perf = v.perf_mode_mid if spaces == {"sbuf"} and all(is16(x) for x in (a, b, d)) else 1
            return max(mi, ceil_div(k * n, perf))
        if isinstance(ins, ScalarTensorTensor):
            # N for bf16 subtract-then-multiply with N even, else 2N (datasheet §7, S16)
            n = ins.data.free_size
            fast = (all(x.dtype.name == "bfloat16" for x in (ins.data, ins.data2, ins.dst))
                    and (ins.op0, ins.op1) == ("subtract", "multiply") and n % 2 == 0)
            return max(mi, n if fast else 2 * n)
        if isinstance(ins, TensorReduce):
            n = ins.data.free_size
            half = ins.data.dtype.name == "bfloat16" and ins.dst.dtype.name == "bfloat16" and ins.op in ("add", "max")
            return max(mi, ceil_div(n, 2) if half else n)
        if isinstance(ins, Memset):
            n = ins.dst.free_size
            return max(mi, ceil_div(n, 2) if ins.value == 0 and is16(ins.dst) else n)
        return super().cycles(ins)

    def latency_cycles(self, ins: Instruction) -> int:
        return self.config.core.vector.dependency_latency_cycles
