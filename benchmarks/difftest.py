"""Differential tester of the ``neuron`` device: every op the bridge serves, argument variants
made from each op's schema, run on CPU and on ``neuron`` three ways, compared.

**Which ops.** The ones the bridge itself names (:func:`served_ops`): every name of the lowering
table (:data:`torch_bridge.lowering.OPS`: the ops whose cost has a rule) and every aten op the
bridge registers a kernel for with PyTorch's dispatcher (PrivateUse1, the Python path's
PrivateUse2 key, AutogradPrivateUse1: the fast path's own ops, the TensorE ops, attention, the
``_foreach_*`` ops, the CUDA-only cells, allocation and copies). A new entry in either is tested
without touching this file. Everything else reaches the same boxed fallback. The table's one custom
op, ``trnsim::mx_matmul`` (:data:`CUSTOM_OPS`), is served where the device has MX (run with
``TRNSIM_CONFIG=trn3``; trn2 refuses it by design).

**Which variants.** For each op, samples are drawn from its overloads' schemas: each argument's
type and name decide what it gets (a tensor of the sample's shape and dtype, a broadcastable
partner, an index in range, a dim of the tensor's rank, a mask, a scalar, a dtype, a reduction
string, ...). Every sample then takes one of the variants the issue lists: the five dtypes
(float32, bfloat16, float16, int64, bool), broadcasting, boolean and float masks, non-contiguous
inputs (transposed, strided, expanded) and storage offsets, in-place ops on views of a larger
tensor, ``out=`` (of the right size, empty, of another size, non-contiguous, partially
overlapping the first argument: CPU refuses it where both are dense, the device wherever an element
is shared, since CPU's values then follow its kernel's write order and threads), empty and 0-dim
tensors, host 0-dim scalars beside device tensors, inputs that alias each other, and extreme
values (NaN, +-inf, +-0, huge and tiny values, ties). Where CPU refuses a sample it still counts:
the device must refuse it too.

**How each sample runs.** On CPU (the reference), then on ``neuron`` from inputs with the same
sizes, strides, storage offsets and storage bytes (shared storages stay shared): with the native
fast path on (twice: the first call teaches the fast path the call's cost, the second is served
by it), with the fast path off (the Python path), and under ``torch.compile(backend="neuron")``
(samples compiled together, :data:`COMPILE_BATCH` to a graph, every second graph traced with
symbolic sizes as ``dynamic=True`` traces it; a batch that fails is re-run one sample at a
time); every ``--timing-every``-th also on timing-only tensors (no values: the same shapes,
dtypes and strides, and no error where CPU has none). A compiled graph is held to what
``torch.compile`` gives on CPU (``aot_eager``) where that differs from eager CPU (out= into outs
it must resize, say), and timing-only tensors to PyTorch's meta kernels where those differ from
CPU's: such samples are counted, not reported. Random ops draw on CPU from a generator seeded
with the device generator's contract
(:func:`torch_bridge.values.host_seed`), so their values are compared too.

**What is compared.** The exception type when CPU raises (the device must raise one of the same
type, or say ``neuron:`` in a NotImplementedError only where the op holds dense tensors); else
the results' structure, dtypes, shapes, strides (where CPU defines them: eager runs; compiled
graphs only promise values), devices, values, which results are inputs or views of inputs'
memory, every input's whole storage afterwards (an in-place op on a view must write exactly
where CPU writes), and, in eager runs, which inputs' version counters moved (autograd refuses a
backward through a saved tensor whose version moved: a ``_foreach_*`` write that moved none gave
gradients from the new values where CPU refuses). Values must be bit-identical (NaNs compare equal whatever their payload), except
the TensorE ops (:data:`TENSORE_OPS`: the PE array adds fp32 products in its own fixed order):
their error against a float64 result may exceed CPU's own by :data:`TENSORE_RTOL` of the
result's largest magnitude (per dtype: fp32 1e-5, bf16 2^-7, fp16 2^-10) plus ``atol``.

A mismatch prints one line: what differs, the op, the sample's description and the command that
reruns exactly that sample (``python benchmarks/difftest.py --repro <op> <seed>``).

**Samples that crash CPU** (:data:`CRASHY`: CPU's fp16/bf16 oneDNN convolution segfaults for
some shapes, a torch bug; :data:`CRASHY_INT`: CPU's int32/int64 lcm and truncating division trap on the minimum): those
ops' reduced-precision (integer) samples run on CPU in a forked child first (on one thread, killed after 30 s); where CPU crashes on a convolution dilated over a
size-1 kernel dimension, CPU's call undilated (the same convolution) is the reference the device
must give; where it crashes otherwise, the device must refuse the call (a crash or an answer is
reported). **Samples CPU runs for ever on** (:data:`HANGY`: the Legendre and Laguerre polynomials
of a huge integer degree) are run the same way, killed after :data:`HANG_S`; the device must
refuse those too, and may refuse the ones CPU's child takes over :data:`SLOW_S` to answer (it
counts a call's steps from above).

**First calls in fresh processes** (``--fresh``): each op's samples run in a process of their
own, so the first sample is the first call the process makes (nothing taught to the fast path,
no signature costed, no buffer moved before; the in-process run learns every op first, which hid
the BatchNorm double update). :data:`STATEFUL` ops (served by the fallback, writing buffers their
schema does not annotate) are tested too.

**What the fast path may write** (``--write-guard N``): the native fast path runs an op's CPU
kernel on its arguments' memory trusting the schema's ``(a!)`` annotations (and runs it once more
in Python's path to learn a signature's cost); N samples of every aten op it serves by its schema
run on CPU with every input's bytes compared before and after, and an argument written without
an annotation is reported (the run fails if the fast path serves that op).

**The ops the fallback serves unnamed** (``--wide``): every other aten op with a CPU kernel
reaches the device through the boxed fallback too (~600 packets: pooling, windows, internal
helpers such as ``_weight_norm_interface``); ``--wide`` samples them beside the default list, each
of their CPU samples in a child process first (CPU kernels of internal ops crash on arguments they
do not check). A device run that crashes still ends the run.

    OMP_NUM_THREADS=1 python benchmarks/difftest.py [--samples N] [--seed S] [--ops a,b | --wide]
        [--dtypes float32,int64] [--no-compile] [--compile-every K] [--json out.json] [--repro op seed]
        [--fresh] [--write-guard N]

The long run (the issue's >= 100,000 samples): ``--samples 400`` over every op, or (as run on
2026-12-03) 20 shards of ``--samples 20 --compile-every 8 --seed S`` one after another under
``nice -n 10``, then ``--fresh`` and ``--write-guard`` passes.
"""

from __future__ import annotations

import argparse
import builtins
import dataclasses
import hashlib
import json
import logging
import math
import random
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch_bridge  # noqa: F401  (registers the device where autoload is off)
import torch_bridge.mx  # noqa: F401  (registers trnsim::mx_matmul, one of CUSTOM_OPS)
from torch_bridge import fastpath, lowering
from torch_bridge.values import OVERLAP_ERROR, host_seed

# fake tensors log every meta kernel that refuses a sample (the comparison reports what matters)
logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)

DEVICE = "neuron"
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool)
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int64": torch.int64,
               "bool": torch.bool, "float64": torch.float64, "int32": torch.int32}
SEED = 24
COMPILE_BATCH = 60  # samples compiled together in one graph
# shapes most samples take (see Gen.shape); the long run draws every shape at random
PALETTE: tuple[tuple[int, ...], ...] = ((), (1,), (4,), (5,), (0,), (2, 3), (3, 1), (1, 4), (4, 4), (2, 0),
                                        (2, 3, 4), (3, 1, 2), (2, 2, 2), (1, 3, 1), (2, 3, 1, 2), (1, 2, 2, 3))
PALETTE_SHARE = 0.8

# The TensorE ops: their values come from the PE array's fp32 accumulation (torch_bridge.tensore),
# which adds a dot product's terms in another order than CPU BLAS (and from a +0.0 accumulator: a
# one-term sum of -0.0 is +0.0). linear and matmul are composites the device sees as mm/addmm/bmm.
TENSORE_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "convolution_overrideable",
                         "convolution_backward_overrideable", "scaled_dot_product_attention",
                         "_euclidean_dist"})  # (a composite: its x1 @ x2.T runs on the device's mm)
# the error of a TensorE result beyond CPU's own, as a fraction of the result's largest magnitude
TENSORE_RTOL = {torch.float32: 1e-5, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}
TENSORE_ATOL = 1e-4

# The TensorE ops with an added self/bias: a 0-dim host tensor there is refused as CUDA refuses it
# (addmm checks that every tensor is on the GPU; only TensorIterator ops take host scalars), in one
# line, where CPU computes: the device's answer to such a sample is that refusal.
HOST_SCALAR_REFUSED = frozenset({"linear", "addmm", "baddbmm"})
SAME_DEVICE_ERROR = "Expected all tensors to be on the same device"

# Ops CPU has no kernel for that the device serves as CUDA does: compared with the CUDA
# semantics written out here (REFERENCES), not with CPU's refusal.
CUDA_ONLY = frozenset({"_thnn_fused_lstm_cell", "_thnn_fused_lstm_cell_backward_impl", "_thnn_fused_gru_cell",
                       "_thnn_fused_gru_cell_backward"})
# Ops CPU runs under another name: the reference calls that (same arguments, unless adapted).
def _conv_backward_reference(grad_output: Any, input: Any, weight: Any, stride: Any, padding: Any, dilation: Any,
                             transposed: Any, output_padding: Any, groups: Any, output_mask: Any, **kw: Any) -> Any:
    bias_sizes = [weight.shape[1] * groups if transposed else weight.shape[0]]
    op = torch.ops.aten.convolution_backward.out if kw else torch.ops.aten.convolution_backward.default
    return op(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
              output_mask, **kw)


REFERENCES: dict[str, Callable[..., Any]] = {
    "convolution_overrideable.default": torch.ops.aten.convolution.default,
    "convolution_overrideable.out": torch.ops.aten.convolution.out,
    "convolution_backward_overrideable.default": _conv_backward_reference,
    "convolution_backward_overrideable.out": _conv_backward_reference,
}


def _histc_cuda(self: torch.Tensor, bins: int = 100, min: Any = 0, max: Any = 0, **kw: Any) -> Any:
    """CUDA's histc of integers, in exact integer arithmetic (CUDA's bin of a value, (v - min) *
    bins // (max - min), the top edge in the last bin, computed without int64's wrap-around;
    min == max: the data's range, widened by one each way where it is one value), counts in the
    input's dtype. (A float64 histogram was the reference before: past 2**53 it rounds values
    into other bins.) Bad arguments raise as CPU's float64 histc does."""
    if self.is_floating_point() or self.dtype == torch.bool:
        return torch.ops.aten.histc.default(self, bins, min, max) if not kw else \
            torch.ops.aten.histc.out(self, bins, min, max, **kw)
    res = torch.histc(self.double(), bins, min, max).to(self.dtype)  # (its errors, shape and dtype)
    vals = self.reshape(-1).tolist()
    lo, hi = int(min), int(max)
    if lo == hi and vals:
        lo, hi = builtins.min(vals), builtins.max(vals)
    if lo == hi:
        lo, hi = lo - 1, hi + 1
    counts = [0] * bins
    for v in vals:
        if lo <= v <= hi:
            counts[(v - lo) * bins // (hi - lo) if v < hi else bins - 1] += 1
    res = torch.tensor(counts, dtype=self.dtype)
    if kw:
        kw["out"].resize_(res.shape).copy_(res)
        return kw["out"]
    return res


def _scaled_mm_defined(self: torch.Tensor, mat2: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
                       bias: Any = None, *args: Any, **kw: Any) -> Any:
    """CPU's _scaled_mm of a bias that is not contiguous, made contiguous: CPU's kernel reads the
    bias as contiguous whatever its strides (an expanded one: memory past its storage, other
    values each run), so it is no reference there; the device adds the bias's values."""
    if isinstance(bias, torch.Tensor) and not bias.is_contiguous():
        bias = bias.contiguous()
    op = torch.ops.aten._scaled_mm.out if "out" in kw else torch.ops.aten._scaled_mm.default
    return op(self, mat2, scale_a, scale_b, bias, *args, **kw)


REFERENCES["_scaled_mm.default"] = _scaled_mm_defined
REFERENCES["_scaled_mm.out"] = _scaled_mm_defined
REFERENCES["histc.default"] = _histc_cuda
REFERENCES["histc.out"] = _histc_cuda

def _sdpa_math() -> Any:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


# Ops CPU answers two ways: a sample matches if the device agrees with either. CPU's fused
# attention kernel drops a NaN score from its running max (a query row whose only score is NaN
# comes out 0), its math path propagates it (NaN), as the device does.
ALTERNATIVES: dict[str, Callable[[], Any]] = {"scaled_dot_product_attention": _sdpa_math}

# Device plumbing every sample exercises (each copy is _copy_from, each allocation
# empty_strided/empty.memory_format, each .to() _to_copy): tested through the user-facing ops
# that reach them, added below.
PLUMBING = frozenset({"_copy_from", "_copy_from_and_resize", "_has_compatible_shallow_copy_type"})
USER_FACING = ("copy_", "clone", "contiguous", "to")
# Overloads whose CPU kernel is no reference: native_batch_norm.out of a non-contiguous input
# (an expanded or transposed one) gives other values than the functional op on CPU, and other ones
# on each run (it reads memory it never wrote: torch 2.13's own bug; the device runs the same kernel).
NO_REFERENCE = frozenset({"native_batch_norm.out"})
# Results that are uninitialised memory: shapes, dtypes and strides are compared, values are not.
NO_VALUES = frozenset({"empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like"})
# Overloads this tester does not draw (their schemas take no tensor or are TorchScript list/str ops)
_SKIP_TYPES = ("complex", "t", "List[t]", "List[str]", "Dimname", "List[Dimname]", "Device", "Storage",
               "List[complex]", "Any", "AnyEnumType", "Stream")


# The bridge's own custom ops in the lowering table (not aten ops): packet -> namespace. Served
# where the device runs them: mx_matmul needs NeuronCore-v4's MX matmul (a trn3 config; trn2
# refuses it in one line by design), so a run under TRNSIM_CONFIG=trn3 tests it.
CUSTOM_OPS = {"mx_matmul": "trnsim"}


def _custom_served(packet: str) -> bool:
    if packet == "mx_matmul":
        import os

        from torch_bridge import runtime as rt
        from trnsim.config import load_config

        if rt.is_initialized():
            cfg = rt.runtime().config
        else:  # the config the device will take, without fixing it (set_config stays possible)
            name, overrides = rt._requested or (os.environ.get("TRNSIM_CONFIG", "").strip() or "trn2", None)
            cfg = load_config(name, overrides)
        return bool(cfg.core.tensor.mx_quad)
    return False


def packet_ops(packet: str) -> Any:
    """The op packet ``packet`` names: aten's, or the bridge's own (:data:`CUSTOM_OPS`)."""
    return getattr(getattr(torch.ops, CUSTOM_OPS.get(packet, "aten")), packet)


def _unqualified(name: str) -> str:
    return name.split("::", 1)[1]


# ---- which ops ----------------------------------------------------------------------------------
def served_ops() -> dict[str, str]:
    """Every aten op packet the bridge serves by name -> where it is named ("lowering",
    "kernel", or both): the lowering table's names and the ops with a neuron kernel registered
    with the dispatcher. Distributed (c10d) ops are left out (they need a process group)."""
    found: dict[str, set[str]] = {}
    aten = set()
    for qualified in torch._C._dispatch_get_all_op_names():
        if not qualified.startswith("aten::"):
            continue
        packet = qualified[len("aten::"):].split(".")[0]
        aten.add(packet)
        for key in ("PrivateUse1", "PrivateUse2", "AutogradPrivateUse1"):
            if torch._C._dispatch_has_kernel_for_dispatch_key(qualified, getattr(torch._C.DispatchKey, key)):
                found.setdefault(packet, set()).add("kernel")
    for name in lowering.OPS:
        found.setdefault(name, set()).add("lowering")
    for name in PLUMBING:
        found.pop(name, None)
    for name in USER_FACING:
        found.setdefault(name, set()).add("plumbing")
    aten |= {name for name in CUSTOM_OPS if _custom_served(name)}
    for name in STATEFUL:
        found.setdefault(name, set()).add("stateful")
    return {name: "+".join(sorted(how)) for name, how in sorted(found.items()) if name in aten}


# packet prefixes of other backends' kernels, test-only ops and layouts the device does not hold,
# which --wide leaves out (the device refuses them in one line, or they are plumbing)
_NOT_WIDE = ("cudnn", "_cudnn", "miopen", "mkldnn", "_mkldnn", "mps", "_mps", "_nested", "_test", "_foreach",
             "quantize", "q_", "_sparse", "sparse", "_fake_quant", "fake_quant", "_triton", "_nnpack", "to_mkldnn",
             "_weight_int", "_dyn_quant", "_convert_weight", "_make_per", "_empty_affine", "_empty_per",
             "_fused_moving", "_print", "_assert", "_functional_", "_pin_memory", "is_pinned", "from_file",
             "_lazy_clone", "_lstm_mps", "lstm_mps", "_local_scalar_dense", "_copy_from", "_to_dense",
             "_to_sparse", "to_padded_tensor", "_jagged", "_padded_dense", "_cudnn", "sym_constrain",
             "_make_dep_token", "_efficientzerotensor", "_has_same_storage", "resize", "set", "_resize_output",
             "_convert_indices", "_ctc_loss", "_convolution", "_cummax_helper", "_cummin_helper")


def wide_ops() -> list[str]:
    """:func:`served_ops` and every other aten op packet with a CPU or CompositeExplicitAutograd
    kernel (the boxed fallback serves those on the device too), bar :data:`_NOT_WIDE`'s: what
    ``--wide`` samples. A scan of the ops the default list leaves to the fallback found the
    median, repeat and _weight_norm_interface bugs."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    ops = set(served_ops())
    for q in torch._C._dispatch_get_all_op_names():
        if q.startswith("aten::") and (has(q, "CPU") or has(q, "CompositeExplicitAutograd")):
            packet = q[len("aten::"):].split(".")[0]
            if not packet.startswith(_NOT_WIDE):
                ops.add(packet)
    return sorted(ops)


# Ops the fallback serves that write buffers their schema does not annotate (native_batch_norm's
# running statistics in training): the fast path must leave them to Python, and their first call
# in a fresh process must move the buffers once (the BatchNorm double update, 2e3c152).
STATEFUL = ("native_batch_norm",)


def dead_table_names() -> list[str]:
    """Lowering-table names no aten op has (they cost nothing, so nothing tests them), and the
    bridge's own ops where the device does not serve them (mx_matmul on a config without MX)."""
    aten = {q[len("aten::"):].split(".")[0] for q in torch._C._dispatch_get_all_op_names() if q.startswith("aten::")}
    aten |= {name for name in CUSTOM_OPS if _custom_served(name)}
    return sorted(n for n in lowering.OPS if n not in aten)


def overloads(packet: str) -> list[Any]:
    """The overloads of ``packet`` this tester draws: tensors in or out, argument types it knows."""
    pk = packet_ops(packet)
    out = []
    for name in pk.overloads():
        op = getattr(pk, name)
        s = op._schema
        types = [str(a.type) for a in s.arguments] + [str(r.type) for r in s.returns]
        if not any("Tensor" in t for t in types):
            continue
        if any(t in _SKIP_TYPES or "Dimname" in t or t.startswith("Optional[Dimname") for t in types):
            continue
        if "hacked_twin" in name or name.endswith("_generator") or "dimname" in name.lower() or \
                name.startswith("prim_"):  # (TorchScript's own overloads)
            continue
        if f"{packet}.{name}" in NO_REFERENCE:
            continue
        out.append(op)
    return out


# ---- samples ------------------------------------------------------------------------------------
@dataclass
class Sample:
    """One call: ``op`` on CPU tensors ``args``/``kwargs`` (the device run gets copies with the
    same layout and bytes). ``tags`` name the variants it exercises; ``seed`` regenerates it."""

    packet: str
    op: Any
    args: list[Any]
    kwargs: dict[str, Any]
    tags: list[str]
    seed: int
    random: bool = False

    @property
    def qualified(self) -> str:
        s = self.op._schema
        return _unqualified(s.name) + (f".{s.overload_name}" if s.overload_name else "")

    def describe(self) -> str:
        def one(x: Any) -> str:
            if isinstance(x, _Host):
                return f"host {one(x.t)}"
            if isinstance(x, torch.Tensor):
                lay = "" if x.is_contiguous() and x.storage_offset() == 0 else \
                    f" stride={tuple(x.stride())} off={x.storage_offset()}"
                return f"T{tuple(x.shape)}:{str(x.dtype)[6:]}{lay}"
            if x is DEV:
                return "device"
            if isinstance(x, (list, tuple)):
                return "[" + ",".join(one(y) for y in x) + "]"
            if isinstance(x, torch.dtype):
                return str(x)[6:]
            if isinstance(x, float) and not math.isfinite(x):
                return repr(x)
            return repr(x)
        parts = [one(a) for a in self.args] + [f"{k}={one(v)}" for k, v in self.kwargs.items()]
        return f"{self.qualified}({', '.join(parts)}) [{','.join(self.tags)}]"

    def repro(self) -> str:
        return f"python benchmarks/difftest.py --repro {self.packet} {self.seed}"


class _Host:
    """A 0-dim tensor that stays on the host beside device tensors (a CPU scalar tensor)."""

    def __init__(self, t: torch.Tensor):
        self.t = t


class _Dev:
    """The run's device (a ``device=`` argument): cpu for the reference, neuron for the device."""


DEV = _Dev()


class Gen:
    """Draws tensors and arguments for one sample (``rng`` decides everything)."""

    def __init__(self, seed: int, dtype: torch.dtype):
        self.rng = random.Random(seed)
        self.torch_gen = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self.tags: list[str] = []
        self.extreme = self.rng.random() < 0.15
        if self.extreme:
            self.tags.append("extreme")
        self.ties = self.rng.random() < 0.1
        if self.ties:
            self.tags.append("ties")

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def shape(self, max_rank: int = 4, min_rank: int = 0) -> tuple[int, ...]:
        if PALETTE and self.chance(PALETTE_SHARE):
            # most shapes from a small palette: each distinct size is costed (simulated) once per
            # process, and the palette's sizes recur across ops
            fits = [p for p in PALETTE if min_rank <= len(p) <= max_rank]
            if fits:
                dims = list(self.rng.choice(fits))
                self.tag("empty") if 0 in dims else None
                self.tag("0-dim") if not dims else None
                return tuple(dims)
        r = self.rng.choice([k for k in (0, 1, 2, 2, 3, 3, 4) if min_rank <= k <= max_rank] or [min_rank])
        dims = [self.rng.choice((1, 2, 3, 4, 5)) for _ in range(r)]
        if dims and self.chance(0.06):
            dims[self.rng.randrange(len(dims))] = 0
            self.tag("empty")
        if not dims:
            self.tag("0-dim")
        return tuple(dims)

    def tag(self, t: str) -> None:
        if t not in self.tags:
            self.tags.append(t)

    def values(self, n: int, dtype: torch.dtype, low: float | None = None, high: float | None = None
               ) -> torch.Tensor:
        """``n`` values of ``dtype`` (a flat CPU tensor), extreme or tied where the sample says."""
        g = self.torch_gen
        if dtype == torch.bool:
            return torch.rand(n, generator=g) > 0.5
        if not dtype.is_floating_point:
            lo = -5 if low is None else int(low)
            hi = 6 if high is None else int(high)
            v = torch.randint(lo, max(hi, lo + 1), (n,), generator=g, dtype=torch.int64)
            if self.extreme and low is None and n:
                k = torch.randint(0, n, (max(1, n // 5),), generator=g)
                picks = torch.tensor([0, -1, 2 ** 62, -(2 ** 62), 2 ** 63 - 1, -(2 ** 63)])
                v[k] = picks[torch.randint(0, len(picks), (len(k),), generator=g)]
            return v.to(dtype)
        if low is not None:
            v = torch.rand(n, generator=g, dtype=torch.float64) * ((high or 1.0) - low) + low
        else:
            v = torch.randn(n, generator=g, dtype=torch.float64) * self.rng.choice((0.5, 1.0, 3.0))
            if self.ties:
                v = v.round()
            if self.extreme and n:
                k = torch.randint(0, n, (max(1, n // 4),), generator=g)
                picks = torch.tensor([math.nan, math.inf, -math.inf, 0.0, -0.0, 1e30, -1e30, 1e-30, 60000.0],
                                     dtype=torch.float64)
                v[k] = picks[torch.randint(0, len(picks), (len(k),), generator=g)]
        return v.to(dtype)

    def tensor(self, shape: Sequence[int], dtype: torch.dtype | None = None, *, writable: bool = False,
               layout: str | None = None, low: float | None = None, high: float | None = None) -> torch.Tensor:
        """A CPU tensor of ``shape``: contiguous, or (drawn) transposed, strided, expanded
        (not when ``writable``), channels-last or at a storage offset; the storage it lives in
        is filled whole, so bytes outside the view are defined too."""
        dtype = self.dtype if dtype is None else dtype
        shape = tuple(shape)
        if layout is None:
            options = ["contiguous"] * 4 + ["transposed", "strided", "offset"]
            if not writable:
                options.append("expanded")
            if len(shape) == 4:
                options.append("channels_last")
            layout = self.rng.choice(options)
        numel = math.prod(shape)
        if layout == "transposed" and len(shape) >= 2:
            perm = list(range(len(shape)))
            self.rng.shuffle(perm)
            inv = [perm.index(i) for i in range(len(shape))]
            base = self.values(numel, dtype, low, high).view([shape[p] for p in perm])
            t = base.permute(inv)
        elif layout == "strided" and len(shape) >= 1:
            big = list(shape)
            big[-1] = shape[-1] * 2 + 1
            d = self.rng.randrange(len(shape))
            big[d] = big[d] if d == len(shape) - 1 else shape[d] * 2
            base = self.values(math.prod(big), dtype, low, high).view(big)
            idx = [slice(None)] * len(shape)
            idx[-1] = slice(1, 1 + 2 * shape[-1], 2)
            if d != len(shape) - 1:
                idx[d] = slice(0, 2 * shape[d], 2)
            t = base[tuple(idx)]
        elif layout == "offset":
            off = self.rng.randint(1, 5)
            base = self.values(numel + off + self.rng.randint(0, 3), dtype, low, high)
            t = base[off:off + numel].view(shape)
        elif layout == "expanded" and any(s > 1 for s in shape):
            small = [1 if (s > 1 and self.chance(0.5)) else s for s in shape]
            if small == list(shape):
                small[[i for i, s in enumerate(shape) if s > 1][0]] = 1
            t = self.values(math.prod(small), dtype, low, high).view(small).expand(shape)
        elif layout == "channels_last" and len(shape) == 4:
            t = self.values(numel, dtype, low, high).view(shape).contiguous(memory_format=torch.channels_last)
        else:
            layout = "contiguous"
            t = self.values(numel, dtype, low, high).view(shape)
        if layout != "contiguous":
            self.tag(layout)
        return t

    def broadcast_partner(self, shape: Sequence[int]) -> tuple[int, ...]:
        """A shape that broadcasts with ``shape``: the same, a suffix, some dims 1, or 0-dim."""
        shape = tuple(shape)
        kind = self.rng.choice(("same", "same", "same", "suffix", "ones", "scalar"))
        if kind == "suffix" and shape:
            self.tag("broadcast")
            return shape[self.rng.randrange(len(shape) + 1):]
        if kind == "ones" and shape:
            self.tag("broadcast")
            return tuple(1 if self.chance(0.5) else s for s in shape)
        if kind == "scalar":
            self.tag("0-dim-partner")
            return ()
        return shape


# ---- argument rules -----------------------------------------------------------------------------
_PRIMARY = ("self", "input", "a", "grad_output", "grad", "sorted_sequence", "query", "mean", "input_gates",
            "batch1", "mat1", "condition", "weight")
_OPTIONAL_TENSORS = ("weight", "bias", "sorter", "min", "max", "input_bias", "hidden_bias", "attn_mask", "grad_hy",
                     "grad_cy", "std", "scale")
_INDEX_LIKE = {"gather", "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
               "take_along_dim"}
_INDEX_VECTOR = {"index_select", "index_add", "index_add_", "index_copy", "index_copy_", "index_fill",
                 "index_fill_"}
_REDUCE_STRINGS = {"scatter_reduce": ("sum", "prod", "mean", "amax", "amin"),
                   "scatter": ("add", "multiply")}


class Args:
    """Builds one overload's arguments from its schema (see the module docstring)."""

    def __init__(self, gen: Gen, sample_packet: str, op: Any):
        self.g = gen
        self.packet = sample_packet
        self.base = sample_packet.rstrip("_")
        self.op = op
        self.schema = op._schema
        self.values: dict[str, Any] = {}
        self.primary: torch.Tensor | None = None
        self.shape = gen.shape()
        self.dim: int | None = None
        self.written = {a.name for a in self.schema.arguments if a.alias_info is not None and a.alias_info.is_write}

    # -- the argument list --
    def build(self) -> tuple[list[Any], dict[str, Any]] | None:
        args: list[Any] = []
        kwargs: dict[str, Any] = {}
        recipe = RECIPES.get(self.base)
        preset = recipe(self) if recipe is not None else {}
        if preset is None:
            return None
        for a in self.schema.arguments:
            if a.kwarg_only and a.name in self.written:
                continue  # out= tensors: chosen once the CPU run knows the results
            t = str(a.type)
            fits = a.name in preset and (not isinstance(preset[a.name], torch.Tensor) or "Tensor" in t) and \
                (not isinstance(preset[a.name], list) or t.startswith(("List", "Optional[List")))
            v = preset[a.name] if fits else self.arg(a)
            if fits and isinstance(v, torch.Tensor) and self.primary is None:
                self.primary = v
            if v is _OMIT:
                if not a.has_default_value():
                    return None
                continue
            self.values[a.name] = v
            if a.kwarg_only:
                kwargs[a.name] = v
            else:
                args.append(v)
        return args, kwargs

    def arg(self, a: Any) -> Any:
        t = str(a.type)
        name = a.name
        g = self.g
        if t == "Tensor":
            return self.tensor_arg(name, a)
        if t == "Optional[Tensor]":
            if g.chance(0.35) and not (name == "weight" and self.base in ("embedding",)):
                return None
            return self.tensor_arg(name, a, optional=True)
        if t == "List[Tensor]":
            return self.tensor_list(name)
        if t == "List[Optional[Tensor]]":
            return self.index_list()
        if t == "number":
            return self.scalar(name)
        if t == "Optional[number]":
            return None if g.chance(0.3) else self.scalar(name)
        if t == "List[number]":
            n = len(self.values.get("self", [])) if isinstance(self.values.get("self"), list) else 1
            return [self.scalar("scalar") for _ in range(n)]
        if t in ("int", "SymInt"):
            return self.int_arg(name)
        if t in ("Optional[int]", "Optional[SymInt]"):
            return self.opt_int(name)
        if t == "bool":
            return self.bool_arg(name)
        if t == "Optional[bool]":
            if name == "pin_memory":
                return None
            return g.rng.choice((None, True, False))
        if t in ("List[int]", "List[SymInt]"):
            return self.int_list(name)
        if t in ("Optional[List[int]]", "Optional[List[SymInt]]"):
            return None if g.chance(0.3) else self.int_list(name)
        if t == "float":
            return self.float_arg(name)
        if t == "Optional[float]":
            return None if g.chance(0.5) else g.rng.choice((0.5, 1.3))
        if t == "str":
            return self.str_arg(name)
        if t == "Optional[str]":
            if name == "rounding_mode":
                return g.rng.choice((None, "trunc", "floor"))
            if name == "side":
                return g.rng.choice((None, "left", "right"))
            return None
        if t == "List[bool]":
            return [g.chance(0.8) for _ in range(3)]
        if t == "Optional[Generator]":
            return None
        if t == "Optional[Device]":
            return DEV
        if t == "Optional[List[float]]" or t == "List[float]":
            return [g.rng.choice((0.5, 2.0)) for _ in range(2)]
        if t.startswith("Optional["):
            return None
        return _OMIT

    # -- tensors --
    def tensor_arg(self, name: str, a: Any, optional: bool = False) -> Any:
        g = self.g
        writable = name in self.written
        if self.primary is None and (name in _PRIMARY or name not in ("index", "indices", "mask", "target")):
            t = self.primary_tensor(name, writable)
            self.primary = t
            return t
        p = self.primary
        shape = tuple(p.shape)
        if name in ("index", "indices") and self.base not in ("embedding", "embedding_dense_backward"):
            return self.index_tensor(name)
        if name == "indices" and self.base in ("embedding", "embedding_dense_backward"):
            rows = p.shape[0] if p.dim() >= 1 else 1
            if self.base == "embedding_dense_backward":
                rows = 4
            return g.tensor(g.shape(max_rank=2), torch.int64, low=0, high=max(rows, 1))
        if name in ("mask", "condition") or name == "attn_mask":
            if name == "attn_mask":
                return self.attn_mask()
            return g.tensor(g.broadcast_partner(shape), torch.bool)
        if name == "target":
            return self.target()
        if name == "boundaries":
            return g.tensor((g.rng.randint(0, 5),), layout="contiguous").sort().values
        if self.base in ("native_layer_norm",) and name in ("weight", "bias"):
            ns = self.values.get("normalized_shape", [])
            return g.tensor(tuple(ns), writable=False)
        if self.base == "native_group_norm" and name in ("weight", "bias"):
            # contiguous: CPU's kernel reads them as dense arrays (an expanded one reads past its storage)
            return g.tensor((self.values.get("C", shape[1] if len(shape) > 1 else 1),), layout="contiguous")
        if name == "weight" and self.base.startswith("nll_loss"):
            c = shape[1] if len(shape) >= 2 else (shape[0] if shape else 1)
            return g.tensor((c,), low=0.1, high=2.0) if g.dtype.is_floating_point else g.tensor((c,))
        if self.base in ("index_add", "index_copy") and name == "source":
            idx = self.values.get("index")
            d = self.dim if self.dim is not None else 0
            s = list(shape) or [1]
            s[d % len(s)] = idx.numel() if isinstance(idx, torch.Tensor) else 1
            return g.tensor(s if shape else idx.shape if isinstance(idx, torch.Tensor) else ())
        if self.base in _INDEX_LIKE and name in ("src", "value"):
            idx = self.values.get("index")
            if isinstance(idx, torch.Tensor):
                return g.tensor(tuple(i + g.rng.randint(0, 1) for i in idx.shape))
        if self.base in ("masked_scatter",) and name == "source":
            return g.tensor((math.prod(shape) + g.rng.randint(0, 2),))
        if self.base in ("index_put", "index_put_", "_index_put_impl_") and name == "values":
            return self.put_values()
        if self.base == "scaled_dot_product_attention" and name in ("key", "value"):
            return self.matmul_partner(name)
        if "backward" in self.base:  # CPU's backward kernels take same-sized tensors unchecked
            return g.tensor(shape)
        partner = g.broadcast_partner(shape)
        dtype = g.dtype
        if g.chance(0.12):
            dtype = g.rng.choice(DTYPES)
            g.tag("promotion")
        t = g.tensor(partner, dtype)
        # (to.other's other names the result's device and dtype: a host tensor there asks for a
        # copy to the host, another call than CPU's, not a host scalar beside device tensors)
        if t.dim() == 0 and g.chance(0.3) and not (self.base == "to" and name == "other"):
            g.tag("host-scalar")
            return _Host(t)
        if g.chance(0.05) and t.shape == p.shape and t.dtype == p.dtype and name != "out":
            g.tag("aliased-inputs")
            return p
        return t

    def primary_tensor(self, name: str, writable: bool) -> torch.Tensor:
        g = self.g
        shape = self.shape
        if self.base == "scaled_dot_product_attention":
            shape = (g.rng.randint(1, 2), g.rng.randint(1, 4), g.rng.randint(1, 6), g.rng.choice((4, 8)))
            if g.chance(0.2):
                shape = shape[1:]
        elif self.base == "native_group_norm":
            shape = (g.rng.randint(1, 3), g.rng.choice((2, 4)), g.rng.randint(1, 5), g.rng.randint(1, 5))
        elif self.base in ("multinomial",):
            shape = (g.rng.randint(1, 3), g.rng.randint(1, 6))[g.rng.randint(0, 1):]
            return g.tensor(shape, low=0.0, high=1.0) if g.dtype.is_floating_point else g.tensor(shape)
        elif self.base == "embedding":
            shape = (g.rng.randint(1, 6), g.rng.randint(1, 4))
        t = g.tensor(shape, writable=writable, layout=None)
        self.shape = tuple(t.shape)
        if writable and g.chance(0.5) and t.numel() > 0:
            g.tag("inplace-view")
        return t

    def matmul_partner(self, name: str) -> torch.Tensor:
        g = self.g
        p = self.primary
        assert p is not None
        if self.base == "scaled_dot_product_attention":
            s = g.rng.randint(1, 6)
            shape = list(p.shape)
            shape[-2] = s if name == "key" else self.values["key"].shape[-2]
            if len(shape) == 4 and name == "key" and g.chance(0.25) and shape[1] % 2 == 0:
                shape[1] //= 2  # grouped-query attention (needs enable_gqa)
            if name == "value" and len(shape) == 4:
                shape[1] = self.values["key"].shape[1]
            return g.tensor(shape)
        return g.tensor(tuple(p.shape))  # (the matmuls' and the cells' shapes come from their recipes)

    def attn_mask(self) -> torch.Tensor:
        g = self.g
        q, k = (x.t if isinstance(x, _Host) else x for x in (self.values["query"], self.values["key"]))
        if not (isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor) and q.dim() >= 2 and k.dim() >= 2):
            # (an op whose query and key were drawn without SDPA's recipe, e.g. a 0-d host tensor:
            # any mask, which CPU refuses where it does not fit; it crashed the sample's build)
            return g.tensor((2, 2))
        l, s = q.shape[-2], k.shape[-2]
        shape = g.rng.choice(((l, s), (s,), (1, s), (q.shape[0], 1, 1, s) if q.dim() == 4 else (1, s),
                              tuple(q.shape[:-1]) + (s,)))
        if g.chance(0.5):
            g.tag("bool-mask")
            return g.tensor(shape, torch.bool)
        g.tag("float-mask")
        m = g.tensor(shape, q.dtype if q.dtype.is_floating_point else torch.float32)
        if m.numel() and g.chance(0.5):
            m = m.masked_fill(torch.rand(m.shape, generator=g.torch_gen) > 0.6, -math.inf)
        return m

    def index_tensor(self, name: str) -> torch.Tensor:
        g = self.g
        p = self.primary
        assert p is not None
        shape = tuple(p.shape)
        d = self.dim if self.dim is not None else 0
        r = len(shape)
        size = shape[d % r] if r else 1
        if self.base == "take":
            n = max(1, p.numel())
            return g.tensor(g.shape(max_rank=2), torch.int64, low=-n if p.numel() else 0, high=n if p.numel() else 1)
        if self.base in _INDEX_LIKE:
            ishape = tuple(g.rng.randint(0 if s == 0 else 1, s) if i != d % max(r, 1) else g.rng.randint(1, 4)
                           for i, s in enumerate(shape)) if r else ()
            return g.tensor(ishape, torch.int64, low=0, high=max(size, 1), layout="contiguous")
        if self.base in _INDEX_VECTOR:
            return g.tensor((g.rng.randint(0, 4),) if g.chance(0.85) else (), torch.int64, low=0, high=max(size, 1),
                            layout="contiguous")
        return g.tensor((g.rng.randint(0, 4),), torch.int64, low=0, high=max(size, 1))

    def index_list(self) -> list[Any]:
        g = self.g
        p = self.primary
        assert p is not None
        shape = tuple(p.shape)
        out: list[Any] = []
        n = g.rng.randint(1, max(1, len(shape))) if shape else 1
        common = (g.rng.randint(1, 3),)
        for i in range(n):
            size = shape[i] if i < len(shape) else 1
            kind = g.rng.choice(("int", "int", "none", "bool"))
            if kind == "none" and i < n - 1:
                out.append(None)
            elif kind == "bool":
                g.tag("bool-index")
                out.append(g.tensor((size,), torch.bool, layout="contiguous"))
            else:
                out.append(g.tensor(common, torch.int64, low=-size if size else 0, high=max(size, 1)))
        return out

    def put_values(self) -> torch.Tensor:
        g = self.g
        p = self.primary
        try:
            res = torch.ops.aten.index.Tensor(p, self.values["indices"])
            shape = tuple(res.shape)
        except Exception:
            shape = ()
        return g.tensor(g.broadcast_partner(shape) if shape else ())

    def target(self) -> torch.Tensor:
        g = self.g
        p = self.primary
        assert p is not None
        if self.base.startswith("nll_loss"):
            c = p.shape[1] if p.dim() >= 2 else (p.shape[0] if p.dim() else 1)
            shape = (p.shape[0],) + tuple(p.shape[2:]) if p.dim() >= 2 else ()
            return g.tensor(shape, torch.int64, low=0, high=max(c, 1))
        return g.tensor(tuple(p.shape))

    def tensor_list(self, name: str) -> list[torch.Tensor]:
        g = self.g
        if name == "self" or not isinstance(self.values.get("self"), list):
            n = g.rng.randint(1, 4)
            dtype = g.dtype
            shapes = [g.shape(max_rank=3) for _ in range(n)]
            ts = [g.tensor(s, dtype, writable=name in self.written) for s in shapes]
            self.primary = ts[0] if ts else None
            return ts
        first = self.values["self"]
        return [g.tensor(tuple(t.shape), t.dtype) for t in first]

    # -- scalars --
    def scalar(self, name: str) -> Any:
        g = self.g
        floating = g.dtype.is_floating_point
        if name in ("alpha", "beta"):
            return g.rng.choice((1, 2, -0.5, 0)) if floating else g.rng.choice((1, 2, 0))
        if name in ("start", "end", "step"):
            return {"start": g.rng.choice((0, -2, 1.5)), "end": g.rng.choice((5, 3.5, 0)),
                    "step": g.rng.choice((1, 2, 0.5))}[name]
        if self.base == "histc" and name in ("min", "max"):
            return {"min": g.rng.choice((0, -1)), "max": g.rng.choice((0, 2))}[name]
        if g.dtype == torch.bool and g.chance(0.5):
            return g.chance(0.5)
        if not floating and g.chance(0.7):
            return g.rng.choice((0, 1, -2, 3))
        choices = [2, -1.5, 0, 0.5, 3, 1]
        if g.extreme:
            choices += [math.nan, math.inf, -math.inf]
        return g.rng.choice(choices)

    def int_arg(self, name: str) -> Any:
        g = self.g
        r = max(len(self.shape), 1)
        if name == "dim":
            self.dim = g.rng.randrange(-r, r)
            return self.dim
        if name == "diagonal":
            return g.rng.randint(-2, 2)
        if name == "k":
            if self.shape:
                size = self.shape[self.dim % r] if self.dim is not None else self.shape[-1]
            else:
                size = 1
            return g.rng.randint(0, size)
        if name == "bins":
            return g.rng.randint(1, 8)
        if name in ("n",):
            return g.rng.randint(0, 6)
        if name == "num_samples":
            return g.rng.randint(1, 3)
        if name == "reduction":
            return g.rng.choice((0, 1, 2))
        if name == "ignore_index":
            return g.rng.choice((-100, 0, 1))
        if name == "padding_idx":
            return g.rng.choice((-1, 0, 2))
        if name == "num_weights":
            return 4
        if name in ("N", "C", "HxW", "group"):
            p = self.primary
            assert p is not None
            n, c = p.shape[0], p.shape[1]
            group = g.rng.choice([d for d in (1, 2) if c % d == 0])
            return {"N": n, "C": c, "HxW": math.prod(p.shape[2:]), "group": group}[name]
        if name in ("from",):
            return g.rng.choice((0, -3, 1))
        if name in ("to",):
            return g.rng.choice((5, 2))
        if name == "groups":
            return 1
        if name in ("input_dtype", "out_dtype"):
            return g.dtype
        return g.rng.randint(0, 3)

    def opt_int(self, name: str) -> Any:
        g = self.g
        if name == "dim":
            return None if g.chance(0.3) else self.int_arg("dim")
        if name == "dtype":
            if g.chance(0.8):
                return None
            g.tag("dtype-arg")
            return g.rng.choice(DTYPES)
        if name == "memory_format":
            return g.rng.choice((None, None, torch.contiguous_format, torch.preserve_format))
        if name == "to":
            return g.rng.choice((None, 7))
        return None

    def bool_arg(self, name: str) -> bool:
        g = self.g
        if name in ("half_to_float", "non_blocking", "sparse", "sparse_grad", "unsafe", "transposed"):
            return False
        if name in ("train",):
            return True
        return g.chance(0.5)

    def int_list(self, name: str) -> list[int]:
        g = self.g
        r = len(self.shape)
        if name in ("dim", "dims"):
            k = g.rng.randint(0 if name == "dim" else 1, max(r, 1))
            ds = g.rng.sample(range(r), min(k, r)) if r else ([0] if g.chance(0.5) else [])
            ds = [d - r if g.chance(0.3) and r else d for d in ds]
            self.values.setdefault("_dims", ds)
            return ds
        if name == "shifts":
            return [g.rng.randint(-3, 3) for _ in range(max(1, len(self.values.get("_dims", [0]))))]
        if name == "normalized_shape":
            k = g.rng.randint(0, r)
            return list(self.shape[r - k:]) if k else ([] if g.chance(0.2) else list(self.shape[-1:]))
        if name in ("size",):
            return list(g.shape(max_rank=3))
        if name in ("stride",) and self.base.startswith("convolution"):
            return [g.rng.choice((1, 2))] * 2
        if name in ("padding",):
            return [g.rng.choice((0, 1))] * 2
        if name in ("dilation",):
            return [1, 1]
        if name == "output_padding":
            return [0, 0]
        if name == "stride":
            return [1] * r
        return [g.rng.randint(0, 2) for _ in range(max(1, r))]

    def float_arg(self, name: str) -> float:
        g = self.g
        if name == "eps":
            return g.rng.choice((1e-5, 0.1))
        if name == "p":
            return g.rng.choice((0.0, 0.3, 0.5, 1.0))
        if name == "dropout_p":
            return 0.0
        if name in ("beta", "lambd"):
            return g.rng.choice((1.0, 0.5))
        if name == "std":
            return g.rng.choice((1.0, 0.5))
        if name == "from":
            return 0.0
        if name == "to":
            return 1.0
        return g.rng.choice((0.0, 1.0, -0.5, 2.0))

    def str_arg(self, name: str) -> str:
        g = self.g
        if name == "approximate":
            return g.rng.choice(("none", "tanh"))
        if name == "reduce":
            return g.rng.choice(_REDUCE_STRINGS.get(self.base, ("sum", "mean")))
        return "none"


_OMIT = object()


# ---- recipes: the arguments of ops whose tensors must fit one another -----------------------
# A recipe presets some arguments (by schema name) so that most samples are calls CPU accepts;
# the rest of the arguments, and every tensor's layout, dtype and values, are drawn as for any op.
def _matmul_recipe(a: Args) -> dict[str, Any]:
    g = a.g
    n, m, p = g.rng.choice((0, 1, 2, 3, 5)), g.rng.choice((1, 2, 3, 5, 8)), g.rng.choice((0, 1, 2, 4))
    b = g.rng.randint(1, 3)
    if a.base == "mm":
        return {"self": g.tensor((n, m)), "mat2": g.tensor((m, p))}
    if a.base == "bmm":
        return {"self": g.tensor((b, n, m)), "mat2": g.tensor((b, m, p))}
    if a.base == "addmm":
        bias = g.rng.choice(((n, p), (p,), (1, p), (n, 1), ()))
        return {"self": g.tensor(bias, writable="self" in a.written), "mat1": g.tensor((n, m)),
                "mat2": g.tensor((m, p))}
    bias = g.rng.choice(((b, n, p), (n, p), (1, 1, p), ()))
    return {"self": g.tensor(bias, writable="self" in a.written), "batch1": g.tensor((b, n, m)),
            "batch2": g.tensor((b, m, p))}


def _foreach_mm_recipe(a: Args) -> dict[str, Any]:
    g = a.g
    k = g.rng.randint(1, 3)
    dims = [(g.rng.randint(1, 3), g.rng.randint(1, 4), g.rng.randint(1, 3)) for _ in range(k)]
    return {"self": [g.tensor((n, m)) for n, m, _ in dims], "mat2": [g.tensor((m, p)) for _, m, p in dims]}


def _where_recipe(a: Args) -> dict[str, Any]:
    g = a.g
    shape = g.shape()
    a.shape = shape
    out: dict[str, Any] = {"condition": g.tensor(g.broadcast_partner(shape), torch.bool)}
    if any(x.name == "self" and str(x.type) == "Tensor" for x in a.schema.arguments):
        out["self"] = g.tensor(shape)
    return out


def _searchsorted_recipe(a: Args) -> dict[str, Any]:
    g = a.g
    lead = g.rng.choice(((), (2,), (2, 3)))
    seq = g.tensor(lead + (g.rng.randint(0, 5),)).sort(-1).values if g.dtype != torch.bool else \
        g.tensor(lead + (3,), torch.bool)
    if g.chance(0.3):
        seq = g.tensor((g.rng.randint(1, 5),)).sort().values if g.dtype != torch.bool else seq
    vals = g.tensor((lead if seq.dim() > 1 else g.shape(max_rank=2)[:1]) + (g.rng.randint(0, 4),))
    return {"sorted_sequence": seq, "self": vals, "sorter": None, "side": None} if a.base == "searchsorted" else \
        {"self": vals, "boundaries": g.tensor((g.rng.randint(0, 5),)).sort().values if g.dtype != torch.bool
         else g.tensor((2,), torch.bool)}


def _conv_recipe(a: Args) -> dict[str, Any] | None:
    g = a.g
    one_d = g.chance(0.25)
    groups = g.rng.choice((1, 1, 2))
    c, k = 2 * groups * g.rng.randint(1, 2) // 1, groups * g.rng.randint(1, 2)
    r = g.rng.choice((1, 2, 3))
    spatial = [g.rng.randint(r, r + 3) for _ in range(1 if one_d else 2)]
    n = g.rng.randint(1, 2)
    transposed = g.chance(0.2)
    stride, pad = g.rng.choice((1, 2)), g.rng.choice((0, 1))
    dil = g.rng.choice((1, 1, 2)) if not transposed else 1
    if dil == 2 and any(s < 2 * (r - 1) + 1 for s in spatial):
        dil = 1
    nd = len(spatial)
    x = g.tensor((n, c) + tuple(spatial))
    w = g.tensor(((c, k // groups) if transposed else (k, c // groups)) + (r,) * nd)
    outs = k
    bias = g.tensor((outs,), layout="contiguous") if g.chance(0.6) else None
    preset = {"input": x, "weight": w, "bias": bias, "stride": [stride] * nd, "padding": [pad] * nd,
              "dilation": [dil] * nd, "transposed": transposed, "output_padding": [0] * nd, "groups": groups}
    if a.base == "convolution_backward_overrideable":
        try:
            y = torch.ops.aten.convolution.default(x.float(), w.float(), None, [stride] * nd, [pad] * nd, [dil] * nd,
                                                   transposed, [0] * nd, groups)
        except RuntimeError:
            return None
        preset["grad_output"] = g.tensor(tuple(y.shape))
        preset["output_mask"] = [g.chance(0.8), g.chance(0.8), g.chance(0.5)]
        del preset["bias"]
    return preset


def _nll_recipe(a: Args) -> dict[str, Any] | None:
    g = a.g
    two_d = a.base.startswith("nll_loss2d")
    n, c = g.rng.randint(1, 4), g.rng.randint(1, 5)
    spatial = (g.rng.randint(1, 3), g.rng.randint(1, 3)) if two_d else ()
    batched = two_d or g.chance(0.8)
    x = g.tensor(((n, c) if batched else (c,)) + spatial)
    target = g.tensor(((n,) if batched else ()) + spatial, torch.int64, low=0, high=c)
    ignore = g.rng.choice((-100, 0, 1))
    weight = g.tensor((c,), low=0.1, high=2.0, layout="contiguous") if g.chance(0.5) else None
    reduction = g.rng.choice((0, 1, 2))
    preset = {"self": x, "target": target, "weight": weight, "reduction": reduction, "ignore_index": ignore}
    if a.base.endswith("_backward"):
        fwd = torch.ops.aten.nll_loss2d_forward if two_d else torch.ops.aten.nll_loss_forward
        try:
            out, total = fwd(x.float(), target, None if weight is None else weight.float(), reduction, ignore)
        except (RuntimeError, IndexError):
            return None
        preset["grad_output"] = g.tensor(tuple(out.shape))
        preset["total_weight"] = total.to(x.dtype) if x.dtype.is_floating_point else total
    return preset


def _embedding_backward_recipe(a: Args) -> dict[str, Any]:
    g = a.g
    idx = g.tensor(g.shape(max_rank=2), torch.int64, low=0, high=4)
    return {"indices": idx, "grad_output": g.tensor(tuple(idx.shape) + (g.rng.randint(1, 3),)), "num_weights": 4,
            "padding_idx": g.rng.choice((-1, 0, 2))}


def _cell_recipe(a: Args) -> dict[str, Any] | None:
    g = a.g
    lstm = "lstm" in a.base
    b, h = g.rng.randint(1, 3), g.rng.randint(1, 3)
    gates = (4 if lstm else 3) * h
    bias = g.chance(0.6)
    preset: dict[str, Any] = {}
    if not a.base.endswith(("backward", "backward_impl")):
        preset = {"input_gates": g.tensor((b, gates)), "hidden_gates": g.tensor((b, gates)),
                  "input_bias": g.tensor((gates,)) if bias else None,
                  "hidden_bias": g.tensor((gates,)) if bias else None}
        preset["cx" if lstm else "hx"] = g.tensor((b, h))
        return preset
    if lstm:
        preset = {"grad_hy": g.tensor((b, h)) if g.chance(0.8) else None, "grad_cy": g.tensor((b, h)) if g.chance(0.8)
                  else None, "cx": g.tensor((b, h)), "cy": g.tensor((b, h)), "workspace": g.tensor((b, gates)),
                  "has_bias": bias}
    else:
        preset = {"grad_hy": g.tensor((b, h)), "workspace": g.tensor((b, 5 * h)), "has_bias": bias}
    return preset


def _scaled_mm_recipe(a: Args) -> dict[str, Any]:
    """fp8 operands (mat2 column-major, as CPU's kernel wants), per-tensor or row/column scales."""
    g = a.g
    m, k, n = g.rng.choice((1, 2, 16)), g.rng.choice((16, 32)), g.rng.choice((16, 32))
    fp8 = g.rng.choice((torch.float8_e4m3fn, torch.float8_e5m2))
    x = g.tensor((m, k), torch.float32, layout="contiguous").to(fp8)
    w = g.tensor((n, k), torch.float32, layout="contiguous").to(fp8).t()
    rowwise = g.chance(0.3)
    sa = g.tensor((m, 1) if rowwise else (), torch.float32, low=0.5, high=2.0)
    sb = g.tensor((1, n) if rowwise else (), torch.float32, low=0.5, high=2.0)
    out_dtype = g.rng.choice((torch.bfloat16, torch.float32, torch.float16, None))
    bias = g.tensor((n,), out_dtype or torch.bfloat16) if g.chance(0.3) else None
    return {"self": x, "mat2": w, "scale_a": sa, "scale_b": sb, "bias": bias, "out_dtype": out_dtype,
            "scale_result": None}


def _mx_recipe(a: Args) -> dict[str, Any]:
    """torch.neuron.mx_matmul in torchao's layout: fp8 operands (E4M3 or E5M2, each its own), one
    E8M0 scale per 32 values along K (exponents near 1.0, or anywhere in E8M0's range), and an
    output dtype; extreme operand values come from the generator as for every op."""
    g = a.g
    m, n, k = g.rng.choice((1, 2, 16, 33)), g.rng.choice((1, 3, 16, 40)), 32 * g.rng.choice((1, 2, 4))
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    x = g.tensor((m, k), torch.float32, layout="contiguous").to(g.rng.choice(fp8))
    w = g.tensor((k, n), torch.float32, layout="contiguous").to(g.rng.choice(fp8))
    lo, hi = (124, 131) if g.chance(0.8) else (0, 255)
    gen = torch.Generator().manual_seed(g.rng.randrange(2**31))
    sa = torch.randint(lo, hi, (m, k // 32), generator=gen, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    sb = torch.randint(lo, hi, (k // 32, n), generator=gen, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    return {"a": x, "a_scale": sa, "b": w, "b_scale": sb,
            "out_dtype": g.rng.choice((torch.bfloat16, torch.float32, torch.float16))}


def _empty_strided_recipe(a: Args) -> dict[str, Any]:
    g = a.g
    size = list(g.shape())
    stride = [1] * len(size)
    for i in range(len(size) - 2, -1, -1):
        stride[i] = stride[i + 1] * max(size[i + 1], 1)
    if len(size) >= 2 and g.chance(0.5):  # a permuted layout
        stride[-1], stride[-2] = size[-2] if size[-2] else 1, 1
    return {"size": size, "stride": stride}


def _slow_conv_recipe(a: Args) -> dict[str, Any]:
    g = a.g
    n, c, k, r = g.rng.randint(1, 2), g.rng.randint(1, 3), g.rng.randint(1, 3), g.rng.choice((1, 2, 3))
    h, w = g.rng.randint(r, r + 3), g.rng.randint(r, r + 3)
    return {"self": g.tensor((n, c, h, w)), "weight": g.tensor((k, c, r, r)), "kernel_size": [r, r],
            "bias": g.tensor((k,), layout="contiguous") if g.chance(0.5) else None,
            "stride": [g.rng.choice((1, 2))] * 2, "padding": [g.rng.choice((0, 1))] * 2}


def _batch_norm_recipe(a: Args) -> dict[str, Any]:
    """An (N, C, ...) input and per-channel weight, bias and running statistics (each present or
    None), training or not: the running statistics are what a training call writes, unannotated
    in native_batch_norm's schema (the fast path's BatchNorm double update)."""
    g = a.g
    n, c = g.rng.randint(1, 4), g.rng.randint(1, 4)
    x = g.tensor((n, c) + tuple(g.rng.randint(1, 3) for _ in range(g.rng.randint(0, 2))))
    fdt = x.dtype if x.dtype.is_floating_point else torch.float32
    stat = lambda low, high: g.tensor((c,), fdt, low=low, high=high, layout="contiguous")  # noqa: E731
    training = g.chance(0.6)
    # (eval mode without running statistics is a segmentation fault in CPU's kernel: F.batch_norm refuses it)
    keep = [g.chance(0.8), g.chance(0.8)] + [True, True] if not training else [g.chance(0.8) for _ in range(4)]
    preset = {"input": x, "weight": stat(0.5, 2.0) if keep[0] else None, "bias": stat(-1.0, 1.0) if keep[1] else None,
              "running_mean": stat(-1.0, 1.0) if keep[2] else None,
              "running_var": stat(0.5, 2.0) if keep[3] else None, "training": training,
              "momentum": g.rng.choice((0.1, 0.5)), "eps": 1e-5}
    if a.base.endswith("_backward"):
        preset["grad_out"] = g.tensor(tuple(x.shape))
    return preset


RECIPES: dict[str, Callable[[Args], dict[str, Any] | None]] = {
    "native_batch_norm": _batch_norm_recipe,
    "_scaled_mm": _scaled_mm_recipe, "mx_matmul": _mx_recipe, "_slow_conv2d_forward": _slow_conv_recipe, "empty_strided": _empty_strided_recipe,
    "mm": _matmul_recipe, "addmm": _matmul_recipe, "bmm": _matmul_recipe, "baddbmm": _matmul_recipe,
    "_foreach_mm": _foreach_mm_recipe, "where": _where_recipe, "searchsorted": _searchsorted_recipe,
    "bucketize": _searchsorted_recipe, "convolution_overrideable": _conv_recipe,
    "convolution_backward_overrideable": _conv_recipe, "nll_loss_forward": _nll_recipe,
    "nll_loss_backward": _nll_recipe,
    "nll_loss2d_forward": _nll_recipe, "nll_loss2d_backward": _nll_recipe,
    "embedding_dense_backward": _embedding_backward_recipe, "_thnn_fused_lstm_cell": _cell_recipe,
    "_thnn_fused_lstm_cell_backward_impl": _cell_recipe, "_thnn_fused_gru_cell": _cell_recipe,
    "_thnn_fused_gru_cell_backward": _cell_recipe,
}


def _lstm_cell_cuda(input_gates: Any, hidden_gates: Any, cx: Any, input_bias: Any = None, hidden_bias: Any = None,
                    **out: Any) -> Any:
    """CUDA's fused LSTM cell (aten/src/ATen/native/cuda/RNN.cu), accumulating in fp32."""
    dt = input_gates.dtype
    gates = input_gates.float() + hidden_gates.float()
    if input_bias is not None:
        gates = gates + input_bias.float() + hidden_bias.float()
    i, f, g, o = gates.chunk(4, 1)
    i, f, g, o = torch.sigmoid(i), torch.sigmoid(f), torch.tanh(g), torch.sigmoid(o)
    cy = f * cx.float() + i * g
    res = ((o * torch.tanh(cy)).to(dt), cy.to(dt), torch.cat([i, f, g, o], 1).to(dt))
    return _into(res, out)


def _gru_cell_cuda(input_gates: Any, hidden_gates: Any, hx: Any, input_bias: Any = None, hidden_bias: Any = None,
                   **out: Any) -> Any:
    """CUDA's fused GRU cell, accumulating in fp32; its workspace is [r, z, n, hx, hidden n-gate]."""
    dt = input_gates.dtype
    ig, hg = input_gates.float(), hidden_gates.float()
    if input_bias is not None:
        ig, hg = ig + input_bias.float(), hg + hidden_bias.float()
    ir, iz, inn = ig.chunk(3, 1)
    hr, hz, hn = hg.chunk(3, 1)
    r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
    n = torch.tanh(inn + r * hn)
    hy = n + z * (hx.float() - n)
    return _into((hy.to(dt), torch.cat([r, z, n, hx.float(), hn], 1).to(dt)), out)


def _lstm_cell_backward_cuda(grad_hy: Any, grad_cy: Any, cx: Any, cy: Any, workspace: Any, has_bias: bool,
                             **out: Any) -> Any:
    """CUDA's LSTM cell backward from the saved activated gates, in fp32."""
    dt = workspace.dtype
    i, f, g, o = workspace.float().chunk(4, 1)
    zeros = torch.zeros(cx.shape)
    ghy = grad_hy.float() if grad_hy is not None else zeros
    gcy = grad_cy.float() if grad_cy is not None else zeros
    tcy = torch.tanh(cy.float())
    gc = ghy * o * (1 - tcy * tcy) + gcy
    gates = torch.cat([gc * g * i * (1 - i), gc * cx.float() * f * (1 - f), gc * i * (1 - g * g),
                       ghy * tcy * o * (1 - o)], 1)
    res = (gates.to(dt), (gc * f).to(dt), gates.sum(0).to(dt) if has_bias else None)
    return _into(res, out)


def _gru_cell_backward_cuda(grad_hy: Any, workspace: Any, has_bias: bool, **out: Any) -> Any:
    """CUDA's GRU cell backward from its workspace [r, z, n, hx, hidden n-gate], in fp32."""
    dt = workspace.dtype
    r, z, n, hx, hn = workspace.float().chunk(5, 1)
    go = grad_hy.float()
    gn = go * (1 - z) * (1 - n * n)
    gz = go * (hx - n) * (1 - z) * z
    gr = gn * hn * (1 - r) * r
    gi, gh = torch.cat([gr, gz, gn], 1), torch.cat([gr, gz, gn * r], 1)
    res = (gi.to(dt), gh.to(dt), (go * z).to(dt), gi.sum(0).to(dt) if has_bias else None,
           gh.sum(0).to(dt) if has_bias else None)
    return _into(res, out)


def _into(res: tuple[torch.Tensor, ...], out: dict[str, Any]) -> Any:
    if not out:
        return res
    outs = [out[k] for k in sorted(out)]
    if any(r is None for r in res):  # as CUDA's generated out= wrapper: an undefined result has no out
        raise RuntimeError("Expected out tensor to have dtype nullptr (uninitialized), but got float instead")
    for o, r in zip(outs, res):
        o.resize_(r.shape).copy_(r)
    return tuple(outs)


REFERENCES["_thnn_fused_lstm_cell.default"] = _lstm_cell_cuda
REFERENCES["_thnn_fused_lstm_cell.out"] = _lstm_cell_cuda
REFERENCES["_thnn_fused_gru_cell.default"] = _gru_cell_cuda
REFERENCES["_thnn_fused_gru_cell.out"] = _gru_cell_cuda
REFERENCES["_thnn_fused_lstm_cell_backward_impl.default"] = _lstm_cell_backward_cuda
REFERENCES["_thnn_fused_lstm_cell_backward_impl.out"] = _lstm_cell_backward_cuda
REFERENCES["_thnn_fused_gru_cell_backward.default"] = _gru_cell_backward_cuda
REFERENCES["_thnn_fused_gru_cell_backward.out"] = _gru_cell_backward_cuda


def _packet_random(packet: str) -> bool:
    from torch_bridge.values import RANDOM_WITHOUT_GENERATOR

    pk = packet_ops(packet)
    return packet in RANDOM_WITHOUT_GENERATOR or any(
        "Generator" in str(a.type) for ov in pk.overloads() for a in getattr(pk, ov)._schema.arguments)


def sample_seed(run_seed: int, packet: str, index: int) -> int:
    h = hashlib.sha256(f"{run_seed}:{packet}:{index}".encode()).digest()
    return int.from_bytes(h[:6], "little")


def make_sample(packet: str, seed: int, dtypes: Sequence[torch.dtype] = DTYPES) -> Sample | None:
    """The sample ``seed`` of ``packet`` (None when the drawn overload cannot be built)."""
    ops = overloads(packet)
    if not ops:
        return None
    rng = random.Random(seed)
    op = rng.choice(ops)
    dtype = rng.choice(list(dtypes))
    gen = Gen(seed, dtype)
    gen.tag(str(dtype)[6:])
    try:
        built = Args(gen, packet, op).build()
    except (IndexError, KeyError, ValueError, RuntimeError, ZeroDivisionError, TypeError, AssertionError):
        return None  # a rule that does not fit this overload: counted as unbuildable
    if built is None:
        return None
    args, kwargs = built
    if op._schema.overload_name.endswith("out") or any(a.kwarg_only and a.alias_info is not None and
                                                     a.alias_info.is_write for a in op._schema.arguments):
        gen.tag("out=")
    return Sample(packet, op, args, kwargs, gen.tags, seed, random=_packet_random(packet))


# ---- what the native fast path may write ---------------------------------------------------------
def fast_served_packets() -> list[str]:
    """Every aten packet with an overload the native fast path serves by its schema (it runs the
    CPU kernel on the arguments' memory, trusting the schema's ``(a!)`` annotations to say what is
    written), plus native_batch_norm, the one op known to write without saying so (denied to it)."""
    packets = set()
    for qualified in torch._C._dispatch_get_all_op_names():
        if not qualified.startswith("aten::"):
            continue
        name, _, overload = qualified[len("aten::"):].partition(".")
        op = getattr(getattr(torch.ops.aten, name, None), overload or "default", None)
        if op is not None and fastpath.kind(op) in ("functional", "writes"):
            packets.add(name)
    return sorted(packets | {"native_batch_norm"})


def unannotated_writes(s: Sample) -> list[str]:
    """The arguments of ``s`` that its op writes on CPU (their storage's bytes change) although
    its schema annotates no argument sharing their storage as written (``Tensor(a!)``)."""
    m = Materialised(s, "cpu")
    named: list[tuple[str, torch.Tensor]] = []
    schema_args = s.op._schema.arguments
    for a, v in list(zip(schema_args, m.args)) + [(next(x for x in schema_args if x.name == k), v)
                                                  for k, v in m.kwargs.items()]:
        for t in (v if isinstance(v, (list, tuple)) else [v]):
            if isinstance(t, torch.Tensor):
                named.append((a.name, t))
    if not named:
        return []
    written = {a.name for a in schema_args if a.alias_info is not None and a.alias_info.is_write}
    allowed = {t.untyped_storage()._cdata for name, t in named if name in written}
    before = {t.untyped_storage()._cdata: bytes(torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy())
              for _, t in named}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            s.op(*m.args, **m.kwargs)
    except Exception:
        return []
    found = []
    for name, t in named:
        key = t.untyped_storage()._cdata
        if key in allowed or name in found:
            continue
        if bytes(torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy()) != before[key]:
            found.append(name)
    return found


def _guard_packet(packet: str, samples_per_op: int, seed: int) -> tuple[int, dict[str, list[str]]]:
    ran, found = 0, {}
    for i in range(samples_per_op):
        s = make_sample(packet, sample_seed(seed, packet, i))
        if s is None or _packet_random(packet):
            continue
        ran += 1
        wrote = unannotated_writes(s)
        if wrote:
            found[s.qualified] = sorted(set(found.get(s.qualified, [])) | set(wrote))
    return ran, found


def write_guard(packets: Iterable[str], samples_per_op: int, seed: int = SEED
                ) -> tuple[int, dict[str, tuple[str, list[str]]], list[str]]:
    """Samples of ``packets`` run on CPU, each held to :func:`unannotated_writes`: (samples run,
    {overload: (how the fast path serves it, arguments written without an annotation)}, packets
    whose CPU kernel crashed the process on a drawn sample). Each packet runs in a forked child:
    CPU's kernels of internal ops given arguments their callers never pass can crash (eval-mode
    native_batch_norm without running statistics is a segmentation fault)."""
    import os

    def forked(chunk: list[str]) -> tuple[int, dict[str, list[str]]] | None:
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: its findings as JSON, then out without Python's teardown
            code = 0
            try:
                os.close(r)
                n, got = 0, {}
                for packet in chunk:
                    k, more = _guard_packet(packet, samples_per_op, seed)
                    n += k
                    got.update(more)
                os.write(w, json.dumps([n, got]).encode())
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.close(w)
        with os.fdopen(r, "rb") as f:
            data = f.read()
        _, status = os.waitpid(pid, 0)
        return json.loads(data) if data and status == 0 else None

    ran, found, crashed = 0, {}, []
    packets = list(packets)
    for start in range(0, len(packets), 50):  # fifty to a child; a chunk that crashes, one by one
        chunk = packets[start:start + 50]
        results = [forked(chunk)]
        if results[0] is None:
            results = [forked([p]) for p in chunk]
            crashed += [p for p, res in zip(chunk, results) if res is None]
        for res in results:
            if res is None:
                continue
            ran += res[0]
            for key, wrote in res[1].items():
                name, _, overload = key.partition(".")
                found[key] = (fastpath.kind(getattr(getattr(torch.ops.aten, name), overload or "default")), wrote)
    return ran, found, crashed


# ---- running ------------------------------------------------------------------------------------
@dataclass
class Run:
    """What one run of a sample gave: ``error`` (an exception) or ``result`` with the inputs'
    storages afterwards and how results alias inputs."""

    error: BaseException | None = None
    result: Any = None
    storages: list[torch.Tensor] = field(default_factory=list)  # every input storage's bytes, after
    aliases: list[Any] = field(default_factory=list)  # per result tensor: ("is", i) / ("view", i) / None
    inputs: list[torch.Tensor] = field(default_factory=list)
    # how far each input's version counter moved (None: an inference tensor, which has none)
    versions: list[int | None] = field(default_factory=list)


class Materialised:
    """A sample's inputs on one device: each CPU input storage copied once (so tensors sharing a
    storage share it on the device too), every tensor rebuilt with its sizes, strides and offset."""

    def __init__(self, sample: Sample, device: str, out_specs: list[Any] | None = None):
        self.device = device
        self._storages: dict[int, Any] = {}
        self.inputs: list[torch.Tensor] = []  # in argument order, each tensor once
        self._seen: dict[int, torch.Tensor] = {}
        self.args = [self.conv(a) for a in sample.args]
        self.kwargs = {k: self.conv(v) for k, v in sample.kwargs.items()}
        if out_specs is not None:
            for name, spec in out_specs:
                self.kwargs[name] = self.conv(spec)

    def conv(self, x: Any) -> Any:
        if isinstance(x, _Host):
            return x.t.clone()
        if x is DEV:
            return torch.device(self.device)
        if isinstance(x, torch.Tensor):
            seen = self._seen.get(id(x))
            if seen is not None:
                return seen
            key = x.untyped_storage()._cdata  # the storage itself (empty ones all have address 0)
            st = self._storages.get(key)
            if st is None:
                raw = torch.empty(0, dtype=torch.uint8).set_(x.untyped_storage()).clone()
                st = self._storages[key] = raw.to(self.device).untyped_storage()
            t = torch.empty(0, dtype=x.dtype, device=self.device).set_(st, x.storage_offset(), x.shape, x.stride())
            self._seen[id(x)] = t
            self.inputs.append(t)
            return t
        if isinstance(x, list):
            return [self.conv(y) for y in x]
        if isinstance(x, tuple):
            return tuple(self.conv(y) for y in x)
        return x

    def storage_bytes(self, sizes: Sequence[int] | None = None) -> list[torch.Tensor]:
        """Each input storage's bytes now, up to the size it had before the call (a storage an
        out= or resize_ grew is compared over what it held; past that, CPU's kernels may leave
        scratch values)."""
        seen: set[int] = set()
        out = []
        for j, t in enumerate(self.inputs):
            st = t.untyped_storage()
            if st._cdata in seen:
                continue
            seen.add(st._cdata)
            raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st).cpu()
            out.append(raw[:sizes[j]] if sizes is not None else raw)
        return out


def _flat(x: Any) -> list[Any]:
    if isinstance(x, (list, tuple)):
        return [z for y in x for z in _flat(y)]
    return [x]


def _aliases(result: Any, inputs: list[torch.Tensor]) -> list[Any]:
    out = []
    for r in _flat(result):
        if not isinstance(r, torch.Tensor):
            out.append(None)
            continue
        rel = None
        for i, t in enumerate(inputs):
            if r is t:
                rel = ("is", i)
                break
        if rel is None and r.numel() and r.untyped_storage().nbytes():
            ptr = r.untyped_storage().data_ptr()
            for i, t in enumerate(inputs):
                if t.untyped_storage().data_ptr() == ptr:
                    rel = ("view", i)
                    break
        out.append(rel)
    return out


def _seed_random(sample: Sample, device: str) -> Any:
    """Seed the run's generator: the device's default one, or on CPU the host generator the
    device's contract says a draw at (seed, offset 0) uses."""
    s = sample.seed % (2 ** 31)
    if device == DEVICE:
        torch.neuron.manual_seed(s)
        return None
    torch.manual_seed(host_seed(s, 0))
    return torch.Generator().manual_seed(host_seed(s, 0))


def run_on(sample: Sample, device: str, out_specs: list[Any] | None = None, fn: Callable[..., Any] | None = None
           ) -> Run:
    m = Materialised(sample, device, out_specs)
    kwargs = dict(m.kwargs)
    args = m.args
    if sample.random:
        gen = _seed_random(sample, device)
        where = next((i for i, a in enumerate(sample.op._schema.arguments) if a.name == "generator"), None)
        if gen is not None and where is not None:
            if where < len(args):  # given in place (--wide's samples pass every argument): the seeded one there
                args = [*args[:where], gen, *args[where + 1:]]
            else:
                kwargs["generator"] = gen
    run = Run(inputs=m.inputs)
    m.sizes = [t.untyped_storage().nbytes() for t in m.inputs]
    before = [None if t.is_inference() else t._version for t in m.inputs]
    if fn is None and device == "cpu":
        fn = REFERENCES.get(sample.qualified if "." in sample.qualified else sample.qualified + ".default")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run.result = (fn or sample.op)(*args, **kwargs)
    except Exception as e:  # the comparison is of what each device raises
        run.error = e
        return run
    run.aliases = _aliases(run.result, m.inputs)
    run.storages = m.storage_bytes(m.sizes)
    run.versions = [None if v is None else t._version - v for t, v in zip(m.inputs, before)]
    return run


# ---- comparing ----------------------------------------------------------------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values as comparable integers (NaNs made one value: payloads are not values)."""
    if t.dtype.is_floating_point:
        width = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}[t.element_size()]
        nan = t.isnan()
        b = t.contiguous().view(width).clone()
        b[nan] = -1
        return b
    if t.dtype.is_complex:
        return _bits(torch.view_as_real(t))
    return t


def _equal_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(_bits(a), _bits(b))


def _tensore_close(got: torch.Tensor, want: torch.Tensor, exact: torch.Tensor | None) -> str | None:
    """None when a TensorE result is as close to the float64 result as CPU's plus the
    dtype's share of its largest magnitude (the module docstring); else why not."""
    if not got.dtype.is_floating_point:
        return None if torch.equal(got, want) else "integer values differ"
    if got.isnan().ne(want.isnan()).any():
        return "NaN positions differ"
    g, w = got.double(), want.double()
    x = exact.double() if exact is not None else w
    fin = x.isfinite() & w.isfinite()
    gn, wn = g[~fin], w[~fin]
    if not ((gn == wn) | (gn.isnan() & wn.isnan())).all():
        return "non-finite values differ"
    if not fin.any():
        return None
    err_g = (g - x).abs()[fin].max().item()
    err_w = (w - x).abs()[fin].max().item()
    scale = x[fin].abs().max().item()
    bound = err_w + TENSORE_RTOL.get(got.dtype, 1e-5) * scale + TENSORE_ATOL
    if err_g <= bound:
        return None
    return f"TensorE error {err_g:.3g} > bound {bound:.3g} (CPU's {err_w:.3g}, scale {scale:.3g})"


def _exact(sample: Sample, out_specs: Any) -> Any:
    """The sample's results in float64 (the TensorE comparison's reference), or None."""
    def up(x: Any) -> Any:
        if isinstance(x, _Host):
            return _Host(up(x.t))
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.double()
        if isinstance(x, list):
            return [up(y) for y in x]
        return x
    s = dataclasses.replace(sample, args=[up(a) for a in sample.args],
                            kwargs={k: up(v) for k, v in sample.kwargs.items()})
    r = run_on(s, "cpu", [(n, up(v)) for n, v in out_specs] if out_specs else None)
    return None if r.error is not None else r.result


@dataclass
class Mismatch:
    sample: Sample
    mode: str
    what: str

    def line(self) -> str:
        return f"MISMATCH [{self.mode}] {self.what} :: {self.sample.describe()} :: {self.sample.repro()}"


def _same_error(cpu: BaseException, dev: BaseException) -> bool:
    if isinstance(dev, type(cpu)) or isinstance(cpu, type(dev)):
        return True
    # torch.compile wraps what a graph raised while tracing; its cause is the op's own error
    inner = dev.__cause__ or dev.__context__
    while inner is not None:
        if isinstance(inner, type(cpu)):
            return True
        inner = inner.__cause__ or inner.__context__
    return False


def compare(sample: Sample, cpu: Run, dev: Run, mode: str, exact: Callable[[], Any], strides: bool = True
            ) -> str | None:
    """None when the device's run agrees with CPU's; else what differs."""
    if sample.packet in CUDA_ONLY and cpu.error is not None:
        return None  # no CPU reference: REFERENCES would be the comparison
    if cpu.error is not None or dev.error is not None:
        if cpu.error is None and sample.packet.rstrip("_") in HOST_SCALAR_REFUSED and "host-scalar" in sample.tags \
                and isinstance(dev.error, RuntimeError) and SAME_DEVICE_ERROR in str(dev.error):
            return None  # CUDA's refusal (HOST_SCALAR_REFUSED)
        if cpu.error is None:
            return f"device raised {type(dev.error).__name__}: {_first(dev.error)}; CPU did not"
        if dev.error is None:
            return f"CPU raised {type(cpu.error).__name__}: {_first(cpu.error)}; device did not"
        if not _same_error(cpu.error, dev.error):
            return (f"CPU raised {type(cpu.error).__name__} ({_first(cpu.error)}), device "
                    f"{type(dev.error).__name__} ({_first(dev.error)})")
        return None
    want, got = _flat(cpu.result), _flat(dev.result)
    if len(want) != len(got):
        return f"{len(got)} results, CPU {len(want)}"
    tensore = sample.packet.rstrip("_") in TENSORE_OPS
    ex: list[Any] | None = None
    for i, (w, g) in enumerate(zip(want, got)):
        if isinstance(w, torch.Tensor) != isinstance(g, torch.Tensor):
            return f"result {i}: {type(g).__name__}, CPU {type(w).__name__}"
        if not isinstance(w, torch.Tensor):
            if w != g and not (isinstance(w, float) and math.isnan(w) and isinstance(g, float) and math.isnan(g)):
                return f"result {i}: {g!r}, CPU {w!r}"
            continue
        if g.dtype != w.dtype:
            return f"result {i}: dtype {g.dtype}, CPU {w.dtype}"
        if g.shape != w.shape:
            return f"result {i}: shape {tuple(g.shape)}, CPU {tuple(w.shape)}"
        host = sample.packet == "to" and any(isinstance(x, _Host) for x in sample.args)  # .to(a host tensor)
        if g.device.type != ("cpu" if host else DEVICE):
            return f"result {i}: on {g.device}, not on the device"
        if strides and w.numel() > 1 and _strides(g) != _strides(w):
            return f"result {i}: strides {g.stride()}, CPU {w.stride()}"
        if sample.packet in NO_VALUES or (sample.packet == "resize_" and _grew(w, cpu)):
            continue
        gc = g.detach().cpu()
        if tensore:
            if ex is None:
                e = exact()
                ex = _flat(e) if e is not None else [None] * len(want)
            why = _tensore_close(gc, w.detach(), ex[i] if i < len(ex) else None)
            if why:
                return f"result {i}: {why}"
        elif not _equal_bits(gc, w.detach()):
            return f"result {i}: values differ ({_diff(gc, w.detach())})"
    if cpu.aliases != dev.aliases and mode != "compiled":
        return f"aliasing: results alias inputs as {dev.aliases}, CPU {cpu.aliases}"
    if mode != "compiled" and [v is not None and v > 0 for v in cpu.versions] != \
            [v is not None and v > 0 for v in dev.versions]:
        # (autograd refuses a backward through a saved tensor whose version moved: whether each
        # input's moved is what a program can tell)
        return f"version counters: inputs moved by {dev.versions}, CPU {cpu.versions}"
    if not tensore and sample.packet not in NO_VALUES:
        for j, (a, b) in enumerate(zip(cpu.storages, dev.storages)):
            if not torch.equal(a, b):
                return f"input storage {j} differs afterwards (a write outside/inside the view)"
    return None


def _grew(result: torch.Tensor, run: Run) -> bool:
    """resize_ took ``result`` past its old storage: the new elements are uninitialised."""
    end = (result.storage_offset() + sum((s - 1) * st for s, st in zip(result.shape, result.stride())) + 1) \
        * result.element_size() if result.numel() else 0
    return any(end > len(b) for b in run.storages[:1])


def _strides(t: torch.Tensor) -> tuple[int, ...]:
    """The strides that mean something: those of dims of size > 1 (a size-1 dim's is arbitrary)."""
    return tuple(st for n, st in zip(t.shape, t.stride()) if n > 1)


def _diff(g: torch.Tensor, w: torch.Tensor) -> str:
    if g.numel() == 0:
        return "empty"
    bad = (_bits(g) != _bits(w)).nonzero()
    if not len(bad):
        return "?"
    i = tuple(bad[0].tolist())
    return f"{len(bad)} of {g.numel()} elements, first at {i}: {g[i].item()!r} vs CPU {w[i].item()!r}"


def _first(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0][:160] if s else ""


# ---- out= tensors -------------------------------------------------------------------------------
def _overlapping(sample: Sample, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """An out of ``shape`` over the first tensor argument's storage, one element past (or before)
    that argument's first element: it partially overlaps what the op reads, which CPU refuses
    where it checks (and the device must refuse as CPU does). None where the storage has no room."""
    a0 = next((x for x in sample.args if isinstance(x, torch.Tensor)), None)
    n = math.prod(shape)
    if a0 is None or a0.dtype != dtype or a0.numel() < 2 or n < 2:
        return None
    elems = a0.untyped_storage().nbytes() // a0.element_size()
    for o in (a0.storage_offset() + 1, a0.storage_offset() - 1):
        if 0 <= o and o + n <= elems:
            strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
            return torch.empty(0, dtype=dtype).set_(a0.untyped_storage(), o, shape, strides)
    return None


def out_specs(sample: Sample, cpu_functional: Any, gen: random.Random) -> list[tuple[str, Any]] | None:
    """The out= tensors of an out overload: of the result's size, empty (resized), of another
    size, non-contiguous (a transposed or strided view), or partially overlapping the first
    argument (where its storage has room; else of the result's size); None when the op has none."""
    outs = _out_args(sample.op)
    if not outs:
        return None
    results = _flat(cpu_functional) if cpu_functional is not None else []
    specs: list[tuple[str, Any]] = []
    g = Gen(sample.seed + 1, sample.args[0].dtype if sample.args and isinstance(sample.args[0], torch.Tensor)
            else torch.float32)
    kind = gen.choice(("exact", "exact", "empty", "other-size", "strided", "overlap"))
    if kind == "overlap":
        r0 = results[0] if results and isinstance(results[0], torch.Tensor) else None
        if r0 is None or len(outs) != 1 or str(outs[0].type) != "Tensor" or \
                _overlapping(sample, tuple(r0.shape), r0.dtype) is None:
            kind = "exact"
    sample.tags.append(f"out-{kind}")
    for i, a in enumerate(outs):
        r = results[i] if i < len(results) and isinstance(results[i], torch.Tensor) else None
        if str(a.type) == "List[Tensor]":
            rs = results if results else []
            specs.append((a.name, [g.tensor(tuple(x.shape), x.dtype, writable=True, layout="contiguous")
                                   if kind != "empty" else torch.empty(0, dtype=x.dtype) for x in rs
                                   if isinstance(x, torch.Tensor)]))
            continue
        dtype = r.dtype if r is not None else torch.float32
        shape = tuple(r.shape) if r is not None else (0,)
        if kind == "overlap":
            t = _overlapping(sample, shape, dtype)
        elif kind == "empty" or r is None:
            t = torch.empty(0, dtype=dtype)
        elif kind == "other-size":
            t = g.tensor((max(1, math.prod(shape)) + 2,), dtype, layout="contiguous")
        elif kind == "strided":
            t = g.tensor(shape, dtype, writable=True, layout=gen.choice(("transposed", "strided", "offset")))
        else:
            t = g.tensor(shape, dtype, writable=True, layout="contiguous")
        specs.append((a.name, t))
    return specs


def _out_args(op: Any) -> list[Any]:
    """The schema's out= arguments (keyword-only, written)."""
    return [a for a in op._schema.arguments if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write]


def functional_of(op: Any) -> Any:
    """The functional overload an out= overload writes the results of (None if not found)."""
    s = op._schema
    pk = getattr(getattr(torch.ops, s.name.split("::", 1)[0]), _unqualified(s.name))
    want = [a.name for a in s.arguments if not (a.kwarg_only and a.alias_info is not None and a.alias_info.is_write)]
    for name in pk.overloads():
        o = getattr(pk, name)
        os_ = o._schema
        if any(a.alias_info is not None and a.alias_info.is_write for a in os_.arguments):
            continue
        if [a.name for a in os_.arguments] == want:
            return o
    return None


# ---- the tester ---------------------------------------------------------------------------------
@dataclass
class Stats:
    samples: int = 0
    cpu_errors: int = 0
    compiled: int = 0
    fast_hits: int = 0
    by_op: dict[str, list[int]] = field(default_factory=dict)  # op -> [samples, valid]
    by_dtype: dict[str, int] = field(default_factory=dict)
    mismatches: list[Mismatch] = field(default_factory=list)
    unbuildable: dict[str, int] = field(default_factory=dict)
    compiled_dynamic: int = 0  # of them traced with symbolic sizes
    torch_compile_differs: int = 0  # compiled samples where torch.compile on CPU differs from eager CPU alike
    timing_only: int = 0  # samples run on timing-only tensors
    meta_differs: int = 0  # timing-only samples that differ from CPU as PyTorch's meta kernels do
    cpu_crashes: int = 0  # samples CPU's own kernel crashes on (run in a child process: CRASHY)
    cpu_crashes_undilated: int = 0  # of which the same convolution undilated is CPU's reference (_undilated)
    overlap_refused: int = 0  # out= over part of an input, which CPU ran and the device refuses (OVERLAP_ERROR)
    child_hangs: int = 0  # children (CRASHY samples) killed after their timeout: no verdict, left out
    cpu_reads_outside: int = 0  # samples CPU's kernel reads past an input or leaves output unwritten on


# Ops whose CPU kernel crashes the process for some reduced-precision arguments (a torch bug: an
# fp16 oneDNN convolution segfaults for x (2,4,2,1), w (1,4,1,1), stride 2, pad 1, dilation 2 and
# others): their fp16/bf16 samples run on CPU in a child process first, and where CPU crashes the
# device must refuse the call (raise), not crash and not answer (no reference to compare with).
CRASHY = frozenset({"convolution_overrideable", "convolution_backward_overrideable", "_slow_conv2d_forward"})
# ... and for some int32/int64 arguments: CPU's lcm divides the minimum by a gcd of -1 (SIGFPE; seed
# 20261214 killed the whole run at lcm 136296707370916), its div with rounding_mode="trunc" divides it by -1
CRASHY_INT = frozenset({"lcm", "lcm_", "div", "div_"})
# ... or runs for ever: CPU's Legendre and Laguerre kernels loop once per degree for each element (seed 99,
# int64, stalled at legendre_polynomial_p 196759261572661: n = 2^62). Their integer samples run on CPU
# in a child first, killed after HANG_S; where CPU runs past that, the device must refuse the call
HANGY = frozenset({"special_legendre_polynomial_p", "special_laguerre_polynomial_l"})
HANG_S = 10.0
# The device counts a call's steps from above (a float32 recurrence can break down into a NaN after ~1e9
# steps, CPU's loop stopping there: laguerre_polynomial_l(4, 2**62) returns NaN in 4.4 s): where CPU's child
# took more than SLOW_S, the device may refuse the call instead of answering (its one line names the recurrence)
SLOW_S = 1.0
RECURRENCE_REFUSAL = "would run its recurrence"


def _in_child(fn: Callable[[], Any], timeout: float = 30.0) -> str:
    """Run ``fn`` in a forked child: "crashed" (killed by a signal), "raised", "returned" or "hung"
    (killed after ``timeout`` seconds).

    The child runs its kernels on one thread: a forked child has none of its parent's OpenMP
    workers, and a parallel region asking for them waits forever (CI's run, with OpenMP's default
    thread count, hung here at the first fp16 convolution). Any other lock another thread held at
    the fork can still hold the child, so the parent waits ``timeout`` at most."""
    import os
    import signal
    import time

    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 3
        try:
            torch.set_num_threads(1)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                r = fn()
            code = 1 if isinstance(r, Run) and r.error is not None else 0
        except BaseException:
            code = 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return "hung"
        time.sleep(0.002)
    if os.WIFSIGNALED(status):
        return "crashed"
    return "raised" if os.WEXITSTATUS(status) == 1 else "returned"


def _undilated(s: Sample) -> Sample | None:
    """``s`` (a convolution) with dilation 1 in its kernel's size-1 dimensions, where it had more:
    the same convolution (a size-1 kernel's dilation moves no tap, the output size is the same),
    which CPU computes where its fp16 kernel crashes on the dilated form; None for any other sample.
    The device computes it too (torch_bridge.eager.values._cpu_dilation) and must give its values."""
    names = [a.name for a in s.op._schema.arguments]
    if "dilation" not in names or "weight" not in names:
        return None
    args, kwargs = list(s.args), dict(s.kwargs)

    def get(name: str) -> Any:
        i = names.index(name)
        return args[i] if i < len(args) else kwargs.get(name)
    w, dil = get("weight"), get("dilation")
    w = w.t if isinstance(w, _Host) else w
    if not isinstance(w, torch.Tensor) or not isinstance(dil, (list, tuple)) or len(dil) != w.dim() - 2:
        return None
    new = [1 if k == 1 and d > 1 else d for k, d in zip(w.shape[2:], dil)]
    if new == list(dil):
        return None
    i = names.index("dilation")
    if i < len(args):
        args[i] = new
    else:
        kwargs["dilation"] = new
    return dataclasses.replace(s, args=args, kwargs=kwargs)


# CPU's flash attention kernels read these positional operands' last dim as contiguous
_FLASH_OPERANDS = {"_scaled_dot_product_flash_attention_for_cpu": (0, 1, 2),
                   "_scaled_dot_product_flash_attention_for_cpu_backward": (1, 2, 3, 4)}


def _dense_reference(s: Sample) -> Sample | None:
    """``s`` with the inputs CPU's kernel reads outside of laid out densely, the same values:
    median.dim / nanmedian.dim of an input that repeats elements along the reduced dim (stride 0;
    torch 2.13 gives other values on each call, 4.6e-41 for the median of [5, 5, 5]), and CPU's
    flash attention kernels' query/key/value (the backward's out too) whose last dim is not
    contiguous (read as if it were: past the operand, or its neighbours' values), and a native batch
    norm's strided weight, bias or statistics it only reads (read as if contiguous too). The same
    values densely are the reference; the device computes them so (torch_bridge.eager.values._dense_input,
    _flash_rows, _batch_norm_family). None for any other sample."""
    if s.packet in BN_FAMILY and s.args:
        return _bn_dense(s)
    flash = _FLASH_OPERANDS.get(s.packet)
    if flash is not None:
        args = list(s.args)
        for i in flash:
            t = args[i] if i < len(args) else None
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
                args[i] = t.contiguous()
        return dataclasses.replace(s, args=args) if any(a is not b for a, b in zip(args, s.args)) else None
    if s.packet not in ("median", "nanmedian") or len(s.args) < 2:
        return None
    x, dim = s.args[0], s.args[1]
    if not isinstance(x, torch.Tensor) or not isinstance(dim, int) or x.dim() == 0:
        return None
    d = dim % x.dim()
    if x.stride(d) != 0 or x.shape[d] <= 1:
        return None
    return dataclasses.replace(s, args=[x.contiguous(), *s.args[1:]])


def _input_tensors(sample: Sample, specs: list[Any] | None) -> list[torch.Tensor]:
    """The tensors :class:`Materialised` makes inputs of, in its order (each object once)."""
    flat = _flat(list(sample.args)) + _flat(list(sample.kwargs.values())) + _flat([v for _, v in specs or []])
    seen: set[int] = set()
    out = []
    for x in flat:
        if isinstance(x, torch.Tensor) and id(x) not in seen:
            seen.add(id(x))
            out.append(x)
    return out


def _own_storages(s: Sample, ref: Sample, cpu: Run, specs: list[Any] | None) -> list[torch.Tensor]:
    """The input storages afterwards of ``cpu`` (a run of ``s``'s dense reference ``ref``), as
    ``s``'s own storages in ``s``'s order: the reference's for an input it kept, and for one it
    replaced by a dense copy the sample's own bytes (the ops with a dense reference do not write
    their inputs), so the device's storages compare against the sample's own."""
    mine, theirs = _input_tensors(s, specs), _input_tensors(ref, specs)
    if len(mine) != len(theirs):
        return cpu.storages
    index: dict[int, int] = {}
    for t in theirs:
        index.setdefault(t.untyped_storage()._cdata, len(index))
    out, seen = [], set()
    for a, b in zip(mine, theirs):
        key = a.untyped_storage()._cdata
        if key in seen:
            continue
        seen.add(key)
        out.append(cpu.storages[index[b.untyped_storage()._cdata]] if a is b else
                   torch.empty(0, dtype=torch.uint8).set_(a.untyped_storage()).clone())
    return out


BN_FAMILY = frozenset({"native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
                       "_native_batch_norm_legit_functional", "native_batch_norm_backward", "batch_norm_backward"})


def _bn_call(s: Sample) -> tuple[dict[str, Any], bool, Any] | None:
    """A native batch norm's (or its backward's) arguments by name, host scalars unwrapped, whether
    it is a backward, and its training flag; None where CPU's own checks answer (an input of under
    2 dims, one running statistic without the other)."""
    names = [a.name for a in s.op._schema.arguments]
    vals = dict(zip(names, [a.t if isinstance(a, _Host) else a for a in s.args]))
    vals.update({k: (v.t if isinstance(v, _Host) else v) for k, v in s.kwargs.items()})
    x = vals.get("input")
    backward = s.packet.endswith("_backward")
    if not isinstance(x, torch.Tensor) or x.dim() < 2 or \
            (not backward and (vals.get("running_mean") is None) != (vals.get("running_var") is None)):
        return None
    train = vals.get("update", vals.get("train")) if backward else \
        (False if s.packet == "_native_batch_norm_legit_no_training" else vals.get("training"))
    return vals, backward, train


def _bn_reads_outside(s: Sample) -> bool:
    """A native batch norm (or its backward) whose kernel reads a statistic or the weight at
    input.size(1) places though it holds fewer, or dereferences statistics it was not given: the
    running ones of an evaluation, the saved ones of a training backward (CPU crashes there)."""
    call = _bn_call(s)
    if call is None:
        return False
    vals, backward, train = call
    x = vals["input"]
    if s.packet == "_native_batch_norm_legit_functional":  # (a composite: _native_batch_norm_legit on clones)
        vals.update({n: vals[n].clone() for n in ("running_mean", "running_var") if isinstance(vals.get(n), torch.Tensor)})
    if backward and x.numel() == 0:
        return True  # (CPU's kernels crash on an empty input's backward)
    saved = ("save_mean", "save_var" if "save_var" in vals else "save_invstd")
    if backward:
        needed = saved if train else ("running_mean", "running_var")
        used = ("weight", *needed)
    else:
        needed = () if train else ("running_mean", "running_var")
        used = ("weight", "bias", "running_mean", "running_var")
    if any(vals.get(n) is None for n in needed):
        return True
    written = ("running_mean", "running_var") if not backward and train else ()
    if any(isinstance(vals.get(n), torch.Tensor) and not vals[n].is_contiguous() and (vals[n].dim() != 1 or n in written)
           for n in used):
        return True  # (read as if contiguous: refused, but for a 1-D one only read: _bn_dense)
    return any(isinstance(vals.get(n), torch.Tensor) and vals[n].numel() < x.shape[1] for n in used)


def _bn_dense(s: Sample) -> Sample | None:
    """A native batch norm's (or its backward's) weight, bias and statistics that its kernel only
    reads, laid out densely where they are strided (CPU's kernel reads them as if contiguous)."""
    call = _bn_call(s)
    if call is None:
        return None  # (CPU's own checks: the device passes such a call on as it is)
    _, backward, train = call
    # (a training forward updates its running statistics; the functional form's are clones, dense already)
    read = {"weight", "running_mean", "running_var", "save_mean", "save_invstd", "save_var"} if backward else \
        ({"weight", "bias"} if train else {"weight", "bias", "running_mean", "running_var"})
    names = [a.name for a in s.op._schema.arguments]
    args = [a.contiguous() if i < len(names) and names[i] in read and isinstance(a, torch.Tensor)
            and a.dim() == 1 and not a.is_contiguous() else a for i, a in enumerate(s.args)]
    return dataclasses.replace(s, args=args) if any(a is not b for a, b in zip(args, s.args)) else None


def _reads_outside(s: Sample, specs: Any = None) -> bool:
    """True for a sample whose CPU kernel reads past an input's memory or leaves part of its
    output unwritten, so its values are no reference and the device must refuse it
    (torch_bridge.eager.values._weight_norm_g): a ``_weight_norm_interface`` given a ``g`` of
    other than ``v.size(dim)`` elements, or a ``v`` or ``g`` that is not contiguous (read as if it
    were); a ``_compute_linear_combination`` whose coefficients are not a matrix of at most
    ``input.size(0)`` columns of input's dtype; a ``_logcumsumexp.out`` whose out (``specs``) is of
    another dtype than its input (CPU's kernel writes the input's dtype into it)."""
    if s.packet == "_slow_conv2d_backward":  # (values._slow_conv2d_lists: read as two values each)
        return any(isinstance(a, (list, tuple)) and len(a) != 2 for a in s.args[3:6])
    if s.packet == "_weight_norm_interface_backward" and len(s.args) >= 5:  # (values._weight_norm_grads)
        gw, v, g, n, dim = (a.t if isinstance(a, _Host) else a for a in s.args[:5])
        if not all(isinstance(t, torch.Tensor) for t in (gw, v, g, n)) or not isinstance(dim, int) or not v.dim() \
                or dim not in (0, v.dim() - 1) or not (v.is_contiguous() and g.is_contiguous() and n.is_contiguous()):
            return False  # (CPU's own checks)
        return not gw.is_contiguous() or gw.shape != v.shape or min(g.numel(), n.numel()) < v.shape[dim]
    if s.packet in BN_FAMILY and s.args:  # (values._batch_norm_family)
        return _bn_reads_outside(s)
    if s.packet == "_logcumsumexp" and specs and s.args:  # (values._logcumsumexp_out)
        x, out = s.args[0], dict(specs).get("out")
        x = x.t if isinstance(x, _Host) else x
        return isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor) and out.dtype != x.dtype
    if s.packet == "_batch_norm_no_update" and s.args:  # (values._batch_norm_args)
        x, *rest = (a.t if isinstance(a, _Host) else a for a in list(s.args[:5]) + [None] * (5 - len(s.args[:5])))
        if not isinstance(x, torch.Tensor) or (rest[2] is None) != (rest[3] is None):
            return False
        return rest[2] is None or x.dim() < 2 or any(
            isinstance(t, torch.Tensor) and (t.numel() != x.shape[1] or not t.is_floating_point()) for t in rest)
    if s.packet == "_compute_linear_combination" and len(s.args) >= 2:  # (values._linear_combination)
        x, c = (a.t if isinstance(a, _Host) else a for a in s.args[:2])
        return (isinstance(x, torch.Tensor) and isinstance(c, torch.Tensor) and x.dim() > 0
                and (c.dim() != 2 or c.shape[1] > x.shape[0] or c.dtype != x.dtype))
    if s.packet != "_weight_norm_interface" or len(s.args) < 2:
        return False
    v, g = (a.t if isinstance(a, _Host) else a for a in s.args[:2])
    dim = s.args[2] if len(s.args) > 2 else s.kwargs.get("dim", 0)
    return (isinstance(v, torch.Tensor) and isinstance(g, torch.Tensor) and isinstance(dim, int) and v.dim() > 0
            and dim in (0, v.dim() - 1) and v.shape[dim] > 0  # (empty there: CPU's kernel crashes, _may_crash)
            and (g.numel() != v.shape[dim] or not v.is_contiguous() or not g.is_contiguous()))


# --wide's packets beyond the default list: each CPU run of theirs goes to a child first (internal
# ops' CPU kernels crash or corrupt the heap on arguments they do not check: _cummax_helper,
# _masked_softmax_backward, ...), so one does not end the run
_CHILD_FIRST: set[str] = set()


def _may_crash(s: Sample) -> bool:
    return s.packet in _CHILD_FIRST or (s.packet in CRASHY and any(t in s.tags for t in ("float16", "bfloat16"))) or \
        (s.packet in CRASHY_INT | HANGY and any(t in s.tags for t in ("int32", "int64"))) or \
        (s.packet == "_weight_norm_interface" and "empty" in s.tags) or \
        s.packet == "_batch_norm_no_update"  # CPU's kernels divide by zero (SIGFPE) / crash without statistics


def _set_fast(on: bool) -> None:
    fastpath.set_enabled(on)


class Tester:
    """Runs samples of ops on CPU and three ways on neuron, collecting mismatches."""

    def __init__(self, seed: int = SEED, dtypes: Sequence[torch.dtype] = DTYPES, compile_every: int = 1,
                 echo: Callable[[str], None] | None = print, timing_every: int = 0):
        self.seed = seed
        self.dtypes = tuple(dtypes)
        self.compile_every = compile_every
        self._flushes = 0
        self.timing_every = timing_every
        self._timing_queue: list[tuple[Sample, Run]] = []
        self.stats = Stats()
        self.echo = echo
        self._compile_queue: list[tuple[Sample, Any, Run]] = []
        self._slow = False  # the sample being run: CPU's child took over SLOW_S (HANGY)

    def report(self, m: Mismatch) -> None:
        self.stats.mismatches.append(m)
        if self.echo:
            self.echo(m.line())

    def samples(self, packet: str, n: int) -> Iterator[Sample]:
        """``n`` samples of ``packet`` (drawn seeds that cannot be built are skipped, up to 4n)."""
        made = 0
        for i in range(4 * n):
            s = make_sample(packet, sample_seed(self.seed, packet, i), self.dtypes)
            if s is None:
                self.stats.unbuildable[packet] = self.stats.unbuildable.get(packet, 0) + 1
                continue
            yield s
            made += 1
            if made == n:
                return

    def check(self, s: Sample, cpu: Run, dev: Run, mode: str, exact: Callable[[], Any], specs: Any,
              strides: bool = True) -> str | None:
        """:func:`compare`, also against CPU's other answer where CPU has two (ALTERNATIVES)."""
        why = compare(s, cpu, dev, mode, exact, strides)
        if why and self._slow and cpu.error is None and RECURRENCE_REFUSAL in str(dev.error):
            return None  # (a call CPU runs for seconds: the device may refuse it, see SLOW_S)
        if why and cpu.error is None and "out-overlap" in s.tags and str(dev.error) == OVERLAP_ERROR:
            if mode == "python-path":  # CPU ran an out= over part of its input: its values are its kernel's
                self.stats.overlap_refused += 1  # write order (and threads'), so the device refuses them all
            return None
        if why and s.packet in ALTERNATIVES:
            with ALTERNATIVES[s.packet]():
                other = run_on(s, "cpu", specs)
            if compare(s, other, dev, mode, exact, strides) is None:
                return None
        return why

    def run_sample(self, s: Sample) -> None:
        st = self.stats
        specs = None
        outs = _out_args(s.op)
        if outs:
            fn = functional_of(s.op)
            probe = run_on(dataclasses.replace(s, op=fn), "cpu") if fn is not None and not _may_crash(s) else None
            specs = out_specs(s, probe.result if probe is not None and probe.error is None else None,
                              random.Random(s.seed))
        hangy = s.packet in HANGY
        started = time.monotonic()
        verdict = _in_child(lambda: run_on(s, "cpu", specs), HANG_S if hangy else 30.0) if _may_crash(s) else \
            "returned"
        self._slow = hangy and verdict == "returned" and time.monotonic() - started > SLOW_S
        if verdict == "hung" and not hangy:  # no verdict either way: left out (counted), not run here where it may crash
            self.stats.child_hangs += 1
            return
        crashes = verdict in ("crashed", "hung")
        ref = _dense_reference(s) or s  # (CPU's median over a repeated dim reads outside its input)
        if crashes:  # a dilated size-1 kernel dimension (fp16): the same convolution undilated is the reference
            u = _undilated(s)
            if u is not None and _in_child(lambda: run_on(u, "cpu", specs)) == "returned":
                ref, crashes = u, False
                self.stats.cpu_crashes_undilated += 1
        st.samples += 1
        row = st.by_op.setdefault(s.packet, [0, 0])
        row[0] += 1
        dt = next((t for t in s.tags if t in DTYPE_NAMES), "?")
        st.by_dtype[dt] = st.by_dtype.get(dt, 0) + 1
        if _reads_outside(s, specs):  # no reference (CPU's values are reads past an input): the device must refuse it
            st.cpu_errors += 1
            st.cpu_reads_outside += 1
            for label, fast in (("fast-path (first call)", True), ("python-path", False)):
                _set_fast(fast)
                got = run_on(s, DEVICE, specs)
                if got.error is None or not str(got.error).startswith("neuron:"):
                    self.report(Mismatch(s, label, "CPU's kernel reads past an input or leaves output unwritten on "
                                                   "this sample; the device did not refuse it"))
                    break
            return
        cpu = Run(error=RuntimeError("CPU's kernel crashes")) if crashes else run_on(ref, "cpu", specs)
        if ref is not s and not crashes and cpu.storages:  # the dense reference's inputs: the sample's own
            cpu.storages = _own_storages(s, ref, cpu, specs)
        if crashes:  # no reference: the device must refuse it (each way it runs), in a child too
            st.cpu_crashes += 1
            st.cpu_errors += 1
            for label, fast in (("fast-path (first call)", True), ("python-path", False)):
                def dev_run(fast: bool = fast) -> Run:
                    _set_fast(fast)
                    return run_on(s, DEVICE, specs)
                got = _in_child(dev_run)
                if got == "hung" and not hangy:
                    st.child_hangs += 1
                elif got != "raised":
                    cpu_does = f"runs past {HANG_S:g} s" if verdict == "hung" else "crashes"
                    self.report(Mismatch(s, label, f"CPU's own kernel {cpu_does} on this sample; the device "
                                                   f"{got} instead of refusing it"))
                    break
            return
        if cpu.error is None:
            row[1] += 1
        else:
            st.cpu_errors += 1
        exact_cache: list[Any] = []

        def exact() -> Any:
            if not exact_cache:
                exact_cache.append(_exact(s, specs))
            return exact_cache[0]
        # the fast path: the first call teaches it the call's cost, the second is its own
        _set_fast(True)
        for label in ("fast-path (first call)", "fast-path"):
            hits = fastpath.hits()
            dev = run_on(s, DEVICE, specs)
            if label == "fast-path":
                st.fast_hits += fastpath.hits() > hits
            why = self.check(s, cpu, dev, label, exact, specs)
            if why:
                self.report(Mismatch(s, label, why))
                break
        _set_fast(False)
        try:
            dev = run_on(s, DEVICE, specs)
        finally:
            _set_fast(True)
        why = self.check(s, cpu, dev, "python-path", exact, specs)
        if why:
            self.report(Mismatch(s, "python-path", why))
        if self.timing_every and cpu.error is None and (st.samples % self.timing_every == 0) and \
                not any(t.startswith("out-") for t in s.tags) and not s.random and not self._slow:
            self._timing_queue.append((s, cpu))
        if self.compile_every and cpu.error is None and (st.samples % self.compile_every == 0) and _compilable(s) \
                and not self._slow:
            self._compile_queue.append((s, specs, cpu))
            if len(self._compile_queue) >= COMPILE_BATCH:
                self.flush_compiled()

    def run_timing_only(self, items: list[tuple[Sample, Run]]) -> None:
        """Valid samples of one op on timing-only tensors (no values, one timing-only run for them
        all): the same shapes, dtypes and strides as CPU's results, and no error where CPU had
        none, unless the op needs values (TimingOnlyError: its output depends on them)."""
        from torch_bridge.timing_only import TimingOnlyError

        with warnings.catch_warnings(), torch.neuron.timing_only():
            warnings.simplefilter("ignore")
            for s, cpu in items:
                self.stats.timing_only += 1
                try:
                    args, kwargs = _fake_inputs(s)
                    got = s.op(*args, **kwargs)
                except TimingOnlyError:
                    continue
                except Exception as e:
                    meta = _on_meta(s)
                    if isinstance(meta, type(e)):  # PyTorch's meta kernel refuses it too: not the device's
                        self.stats.meta_differs += 1
                        continue
                    self.report(Mismatch(s, "timing-only", f"raised {type(e).__name__}: {_first(e)}; CPU did not"))
                    continue
                why = _same_metadata(cpu.result, got)
                if why:
                    meta = _on_meta(s)
                    if not isinstance(meta, BaseException) and _same_metadata(meta, got) is None:
                        self.stats.meta_differs += 1  # as PyTorch's meta kernel says: CPU's kernel differs
                        continue
                    self.report(Mismatch(s, "timing-only", why))

    def flush_compiled(self) -> None:
        """Compile the queued samples together (one graph), or one by one if that fails."""
        queue, self._compile_queue = self._compile_queue, []
        if not queue:
            return
        # a random op draws from the device generator where the graph reaches it: alone in its graph
        # it draws what the eager reference's seeded draw does
        plain = [q for q in queue if not q[0].random]
        queue = plain + [q for q in queue if q[0].random]
        self._flushes += 1
        dynamic = self._flushes % 2 == 0  # every second graph traced with symbolic sizes
        results = _compiled_runs([(s, sp) for s, sp, _ in plain], dynamic) if plain else []
        results += [_compiled_runs([(s, sp)], dynamic)[0] for s, sp, _ in queue[len(plain):]]
        batch_ref: list[list[Run] | None] = []  # the plain samples' graph compiled on CPU, made once if needed
        for i, ((s, specs, cpu), dev) in enumerate(zip(queue, results)):
            self.stats.compiled += 1
            self.stats.compiled_dynamic += dynamic
            exact_cache: list[Any] = []

            def exact(s: Sample = s, specs: Any = specs) -> Any:
                if not exact_cache:
                    exact_cache.append(_exact(s, specs))
                return exact_cache[0]
            why = self.check(s, cpu, dev, "compiled", exact, specs, strides=False)
            if why and (_fake_device_rule(s, dev) or _any_device_rule(s, specs, dev, dynamic)):
                self.stats.torch_compile_differs += 1  # (PyTorch's fake tensors refuse the host scalar)
                continue
            if why:
                # torch.compile's own semantics (what CPU compiled with aot_eager gives) are the
                # reference for a compiled graph; an eager CPU result they differ from is not the device's
                ref = _compile_batch([(s, specs)], "cpu", dynamic)
                if ref is not None and self.check(s, ref[0], dev, "compiled", exact, specs, strides=False) is None:
                    self.stats.torch_compile_differs += 1
                    continue
                # compiled beside other samples, a sample can differ where alone it does not: the same
                # graph compiled on CPU is then the reference (AOTAutograd's synthetic base for two
                # overlapping inputs, one written, re-viewed another input's in-place result on every
                # device; the neuron backend now runs such a graph op by op, so that case no longer
                # reaches here, but others of the kind would: --seed 7017 --samples 8)
                if i < len(plain) and len(plain) > 1:
                    if not batch_ref:
                        batch_ref.append(_compile_batch([(p, sp) for p, sp, _ in plain], "cpu", dynamic))
                    whole = batch_ref[0]
                    if whole is not None and \
                            self.check(s, whole[i], dev, "compiled", exact, specs, strides=False) is None:
                        self.stats.torch_compile_differs += 1
                        continue
                self.report(Mismatch(s, "compiled", why))

    def run_op(self, packet: str, n: int) -> None:
        for s in self.samples(packet, n):
            try:
                self.run_sample(s)
            except Exception as e:  # the harness's own failure on a sample is a finding too
                self.report(Mismatch(s, "harness", f"{type(e).__name__}: {_first(e)}"))
        queue, self._timing_queue = self._timing_queue, []
        if queue:
            try:
                self.run_timing_only(queue)
            except Exception as e:
                self.report(Mismatch(queue[0][0], "harness", f"timing-only: {type(e).__name__}: {_first(e)}"))


def _fake_inputs(s: Sample) -> tuple[list[Any], dict[str, Any]]:
    """The sample's inputs as timing-only tensors (inside torch.neuron.timing_only()): each CPU
    storage one fake neuron storage, each tensor a view of it with the same sizes, strides, offset."""
    bases: dict[int, torch.Tensor] = {}

    def conv(x: Any) -> Any:
        if isinstance(x, _Host):
            return x.t.clone()
        if x is DEV:
            return torch.device(DEVICE)
        if isinstance(x, torch.Tensor):
            st = x.untyped_storage()
            base = bases.get(st._cdata)
            if base is None:
                base = bases[st._cdata] = torch.empty(st.nbytes(), dtype=torch.uint8, device=DEVICE)
            return base.view(x.dtype).as_strided(x.shape, x.stride(), x.storage_offset())
        if isinstance(x, list):
            return [conv(y) for y in x]
        if isinstance(x, tuple):
            return tuple(conv(y) for y in x)
        return x
    return [conv(a) for a in s.args], {k: conv(v) for k, v in s.kwargs.items()}


def _on_meta(s: Sample) -> Any:
    """The sample's results on meta tensors (PyTorch's own shape functions), or what they raise.
    Timing-only tensors and compiled graphs run those: where they differ from CPU's kernels
    (the mean and rstd of a 16-bit layer norm are float32 there, CUDA's accumulate type; a log
    softmax of an empty bool tensor is refused), the device cannot do better."""
    def conv(x: Any) -> Any:
        if isinstance(x, _Host):
            return x.t.clone()
        if x is DEV:
            return torch.device("meta")
        if isinstance(x, torch.Tensor):
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        if isinstance(x, list):
            return [conv(y) for y in x]
        if isinstance(x, tuple):
            return tuple(conv(y) for y in x)
        return x
    try:
        return s.op(*[conv(a) for a in s.args], **{k: conv(v) for k, v in s.kwargs.items()})
    except Exception as e:
        return e


def _same_metadata(want: Any, got: Any) -> str | None:
    w, g = _flat(want), _flat(got)
    if len(w) != len(g):
        return f"{len(g)} results, CPU {len(w)}"
    for i, (a, b) in enumerate(zip(w, g)):
        if not isinstance(a, torch.Tensor):
            continue
        if not isinstance(b, torch.Tensor):
            return f"result {i}: {type(b).__name__}, CPU a tensor"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"result {i}: {tuple(b.shape)} {b.dtype}, CPU {tuple(a.shape)} {a.dtype}"
        if a.numel() > 1 and _strides(a) != _strides(b):
            return f"result {i}: strides {b.stride()}, CPU {a.stride()}"
    return None


def _compilable(s: Sample) -> bool:
    """Samples a compiled graph can express: not out= into outs that must be resized, nor
    resize_ itself (torch.compile resizes no graph input, on any device: CPU's aot_eager fails or
    differs from eager CPU the same way)."""
    return s.packet != "resize_" and not any(t in s.tags for t in ("out-empty", "out-other-size"))


def _compiled_runs(items: list[tuple[Sample, Any]], dynamic: bool = False) -> list[Run]:
    """Each sample run under torch.compile(backend="neuron"): all in one graph first; if that
    graph fails, each on its own (so one refusal cannot hide the others' values)."""
    runs = _compile_batch(items, dynamic=dynamic)
    if runs is not None:
        return runs
    return [(_compile_batch([it], dynamic=dynamic) or [Run(error=RuntimeError("compile failed"))])[0] for it in items]


def _fake_device_rule(s: Sample, dev: Run) -> bool:
    """The compiled run failed tracing on PyTorch's device rule for a host 0-dim tensor beside
    device tensors: its fake tensors treat one as a scalar except for the ops they list as CUDA's
    eager kernels refuse it (``bypass_zero_dim_cpu_tensor_check_ops``: ``nextafter``), and raise
    FakeTensorDeviceMismatchError, which dynamo reports as "Tensor device mismatch". CPU's compiled
    reference has no second device, so cannot show it; the eager device takes the scalar as CPU's
    kernel does. torch.compile's semantics, not the device's."""
    if dev.error is None or not _has_host(s):
        return False
    mismatch = getattr(torch._subclasses.fake_tensor, "FakeTensorDeviceMismatchError", ())
    return any((mismatch and isinstance(err, mismatch)) or str(err).startswith("Tensor device mismatch")
               for err in _causes(dev.error))


def _has_host(s: Sample) -> bool:
    """Whether the sample has a host 0-dim tensor among its arguments."""
    return any(isinstance(a, _Host) for a in list(s.args) + list(s.kwargs.values()))


def _causes(e: BaseException) -> Iterator[BaseException]:
    """``e``, then what it was raised from (``__cause__``, else ``__context__``), and so on: each once."""
    seen = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def _innermost(e: BaseException) -> BaseException:
    """The first exception in ``e``'s chain of causes (what dynamo wrapped)."""
    *_, last = _causes(e)
    return last


def _any_device_rule(s: Sample, specs: Any, dev: Run, dynamic: bool) -> bool:
    """The compiled run failed tracing where PyTorch fails for any device but CPU: a host 0-dim
    tensor beside device tensors that a reference torch.compile traces refuses itself
    (``torch._refs.copysign`` checks that both tensors are on one device; dynamo takes the
    reference with symbolic sizes). Shown without trnsim: the same graph compiled with
    aot_eager on the meta device raises the same error, the device's name aside. CPU's compiled
    reference has no second device, so cannot show it."""
    if dev.error is None or not _has_host(s):
        return False
    try:
        ref = _compile_batch([(s, specs)], "meta", dynamic)
    except Exception:  # noqa: BLE001 - the meta inputs could not be made: nothing shown, nothing excused
        return False
    if ref is None or ref[0].error is None:
        return False
    mine, theirs = _innermost(dev.error), _innermost(ref[0].error)
    return type(mine) is type(theirs) and \
        str(mine).replace(f"{DEVICE}:0", "meta").replace(DEVICE, "meta") == str(theirs)


def _lift(items: list[tuple[Sample, Any]], mats: list["Materialised"]) -> tuple[list[Any], list[torch.Tensor]]:
    """The samples' calls with each tensor argument replaced by ("__t", its index among the graph's
    inputs), and those inputs, each tensor once, in order of first appearance."""
    tensors: list[torch.Tensor] = []
    index: dict[int, int] = {}

    def lift(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if id(x) not in index:
                index[id(x)] = len(tensors)
                tensors.append(x)
            return ("__t", index[id(x)])
        if isinstance(x, list):
            return [lift(y) for y in x]
        if isinstance(x, tuple):
            return tuple(lift(y) for y in x)
        return x
    specs = [(s.op, lift(m.args), {k: lift(v) for k, v in m.kwargs.items()}) for (s, _), m in zip(items, mats)]
    return specs, tensors


def _compile_batch(items: list[tuple[Sample, Any]], device: str = DEVICE, dynamic: bool = False) -> list[Run] | None:
    """The samples as one compiled graph on ``device`` (neuron: backend "neuron"; cpu: the
    reference, "aot_eager"); None when the graph of several fails. ``dynamic``: traced with
    symbolic sizes (``torch.compile(dynamic=True)``), as a function called at a second shape is."""
    mats = [Materialised(s, device, specs) for s, specs in items]
    specs, tensors = _lift(items, mats)

    def drop(x: Any, ts: Sequence[torch.Tensor]) -> Any:
        if isinstance(x, tuple) and len(x) == 2 and x[0] == "__t":
            return ts[x[1]]
        if isinstance(x, list):
            return [drop(y, ts) for y in x]
        if isinstance(x, tuple):
            return tuple(drop(y, ts) for y in x)
        return x

    def graph(*ts: torch.Tensor) -> list[Any]:
        return [op(*drop(a, ts), **{k: drop(v, ts) for k, v in kw.items()}) for op, a, kw in specs]
    seeds = [s for s, _ in items if s.random]
    # the compile runs a random op without a meta kernel on zeros (PyTorch's fake-tensor fallback), which
    # draws from the device generator as on any device with an offset-counted generator: then the draws
    # under test are a second call's, on fresh inputs, seeded again as eager's were
    calls = 2 if device == DEVICE and any(_fake_falls_back(x) for x in seeds) else 1
    torch._dynamo.reset()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn = torch.compile(graph, backend="neuron" if device == DEVICE else "aot_eager", dynamic=dynamic or None)
            for call in range(calls):
                if call:
                    mats = [Materialised(s, device, specs) for s, specs in items]
                    _, tensors = _lift(items, mats)
                if seeds:
                    _seed_random(seeds[0], device)
                for m in mats:  # (storages are compared over what they held before the call, as eager runs' are)
                    m.sizes = [t.untyped_storage().nbytes() for t in m.inputs]
                outs = fn(*tensors)
    except Exception as e:
        if len(items) == 1:
            return [Run(error=e)]
        return None
    runs = []
    for (s, _), m, r in zip(items, mats, outs):
        runs.append(Run(result=r, aliases=_aliases(r, m.inputs), storages=m.storage_bytes(m.sizes), inputs=m.inputs))
    if device == DEVICE and not seeds:
        _second_call(items, fn, runs)
    return runs


def _fake_falls_back(s: Sample) -> bool:
    """The sample's op has no meta kernel, so tracing it runs its real kernel on zeros
    (torch._subclasses.fake_tensor's fallback: a random op draws from the device generator then)."""
    return not torch._C._dispatch_has_kernel_for_dispatch_key(s.op.name(), "Meta")


def _second_call(items: list[tuple[Sample, Any]], fn: Any, runs: list[Run]) -> None:
    """Call the compiled graph again on fresh copies of the same inputs: a region's later calls
    run its generated code (torch_bridge.compile.graph.RegionKernel._specialise), its first call
    walked the ops. Each result must be the first call's bit for bit; a sample whose result is
    not gets an error in its run (a mismatch, as CPU raised nothing)."""
    _, tensors = _lift(items, [Materialised(s, DEVICE, specs) for s, specs in items])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            again = fn(*tensors)
    except Exception as e:  # the first call ran: a second that raises is the device's fault
        again = [e] * len(items)
    for i, ((s, _), r) in enumerate(zip(items, again)):
        if runs[i].error is not None or s.packet in NO_VALUES or s.packet == "resize_":
            continue
        if isinstance(r, BaseException) or not _same_bits(runs[i].result, r):
            runs[i] = Run(error=AssertionError(
                f"neuron: the compiled graph's second call on the same inputs gave other values than its first "
                f"({type(r).__name__ if isinstance(r, BaseException) else 'values differ'})"))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A tensor's elements as a flat uint8 tensor (conj/neg bits resolved)."""
    c = t.detach().cpu().resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format).reshape(-1)
    if c.is_complex():
        c = torch.view_as_real(c).clone().reshape(-1)
    return c.view(torch.uint8)


def _same_bits(a: Any, b: Any) -> bool:
    """The same structure, and tensors of the same dtype, shape and bytes (NaNs included)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(_bytes(a), _bytes(b))
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same_bits(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def run(ops: Iterable[str], samples_per_op: int, seed: int = SEED, dtypes: Sequence[torch.dtype] = DTYPES,
        compile_every: int = 1, echo: Callable[[str], None] | None = print, progress: bool = False,
        timing_every: int = 0) -> Stats:
    t = Tester(seed, dtypes, compile_every, echo, timing_every)
    t0 = time.perf_counter()
    for i, packet in enumerate(ops):
        t.run_op(packet, samples_per_op)
        if progress and echo:
            st = t.stats
            echo(f"progress: {i + 1} ops ({packet}), {st.samples} samples, {st.compiled} compiled, "
                 f"{len(st.mismatches)} mismatches, {time.perf_counter() - t0:.0f} s")
    t.flush_compiled()
    return t.stats


def run_fresh(ops: Sequence[str], argv: Sequence[str]) -> Stats:
    """Each op's samples in a process of its own (this script, the same arguments, one op), so
    its first sample is the first call the process makes: nothing taught to the fast path, no
    signature costed, no buffer moved before (the in-process run learns every op first, which hid
    the BatchNorm double update). The children's summaries are added up; their mismatch lines
    are printed as they come."""
    import os
    import subprocess
    import tempfile

    keep, skip = [], False
    for a in argv:  # the same arguments bar --fresh, --ops, --json and --progress
        if skip:
            skip = False
            continue
        if a in ("--ops", "--json"):
            skip = True
            continue
        if a in ("--fresh", "--progress") or a.startswith(("--ops=", "--json=")):
            continue
        keep.append(a)
    st = Stats()
    with tempfile.TemporaryDirectory() as tmp:
        for op in ops:
            out = os.path.join(tmp, "child.json")
            r = subprocess.run([sys.executable, __file__, *keep, "--ops", op, "--json", out], capture_output=True,
                               text=True)
            if not os.path.exists(out):
                first = next((ln for ln in reversed(r.stderr.splitlines()) if ln.strip()), f"exit {r.returncode}")
                line = f"MISMATCH [fresh process] {op}: the process failed: {first}"
                print(line)
                st.mismatches.append(_Reported(line))
                continue
            with open(out) as f:
                got = json.load(f)
            os.unlink(out)
            st.samples += got["samples"]
            st.cpu_errors += got["cpu_errors"]
            st.compiled += got["compiled"]
            st.compiled_dynamic += got.get("compiled_dynamic", 0)
            st.fast_hits += got["fast_hits"]
            st.cpu_crashes += got.get("cpu_crashes", 0)
            st.child_hangs += got.get("child_hangs", 0)
            st.cpu_crashes_undilated += got.get("cpu_crashes_undilated", 0)
            st.cpu_reads_outside += got.get("cpu_reads_outside", 0)
            st.overlap_refused += got.get("overlap_refused", 0)
            st.torch_compile_differs += got["torch_compile_differs"]
            for k, v in got["by_dtype"].items():
                st.by_dtype[k] = st.by_dtype.get(k, 0) + v
            st.by_op.update(got["by_op"])
            for line in got["mismatches"]:
                print(line)
                st.mismatches.append(_Reported(line))
    return st


@dataclass
class _Reported:
    """A mismatch a child process reported (its line)."""

    text: str
    mode: str = "fresh process"
    sample: Any = None

    def line(self) -> str:
        return self.text


def main(argv: Sequence[str] | None = None) -> int:
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:  # (tests load this file by its path, and may call main() again)
        sys.path.insert(0, here)
    from _args import share, whole

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=whole(1), default=20, help="samples per op")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--ops", default="", help="comma-separated op packets (default: every op the bridge serves)")
    p.add_argument("--wide", action="store_true",
                   help="also every other aten op with a CPU kernel, which reaches the device through its fallback")
    p.add_argument("--dtypes", default=",".join(str(d)[6:] for d in DTYPES))
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--compile-every", type=whole(0), default=1, help="compile every k-th valid sample (0: none)")
    p.add_argument("--json", default="")
    p.add_argument("--progress", action="store_true", help="a line after each op")
    p.add_argument("--timing-every", type=whole(0), default=10,
                   help="also run every k-th valid sample on timing-only tensors (0: none)")
    p.add_argument("--palette-share", type=share, default=0.8,
                   help="share of samples whose shape comes from the palette (the rest are drawn at random)")
    p.add_argument("--repro", nargs=2, metavar=("OP", "SEED"))
    p.add_argument("--fresh", action="store_true",
                   help="each op in a fresh process: its first sample is the first call the process makes")
    p.add_argument("--write-guard", type=whole(0), default=0, metavar="N",
                   help="instead: N samples on CPU of every op the fast path serves by its schema, each argument "
                        "written without an (a!) annotation reported")
    ns = p.parse_args(argv)
    global PALETTE_SHARE
    PALETTE_SHARE = ns.palette_share
    unknown = [d for d in ns.dtypes.split(",") if d and d not in DTYPE_NAMES]
    if unknown or not any(ns.dtypes.split(",")):
        p.error(f"--dtypes {ns.dtypes!r}: expected comma-separated names of {', '.join(DTYPE_NAMES)}")
    for o in (o for o in ns.ops.split(",") if o):
        if o in CUSTOM_OPS and not _custom_served(o):
            p.error(f"--ops: {o} is not served by this config's device (it refuses it in one line); "
                    f"run with TRNSIM_CONFIG=trn3")
        if o not in CUSTOM_OPS and not hasattr(torch.ops.aten, o):
            p.error(f"--ops: {o!r} is not an aten op packet (e.g. add, matmul, index_put) or one of "
                    f"{', '.join(CUSTOM_OPS)}")
    dtypes = [DTYPE_NAMES[d] for d in ns.dtypes.split(",") if d]
    if ns.repro:
        packet, seed = ns.repro[0], int(ns.repro[1])
        s = make_sample(packet, seed, dtypes)
        if s is None:
            print(f"difftest: error: sample {seed} of {packet} cannot be built", file=sys.stderr)
            return 2
        print(s.describe())
        t = Tester(ns.seed, dtypes, 0 if ns.no_compile else 1, timing_every=1)
        t.run_sample(s)
        queued = list(t._compile_queue)
        t.flush_compiled()  # compiled with static sizes,
        t._compile_queue = queued
        t.flush_compiled()  # and with symbolic ones (the long run compiles every second graph so)
        t.run_timing_only(t._timing_queue)  # (the long run's timing-only mismatches rerun too)
        print("ok" if not t.stats.mismatches else f"{len(t.stats.mismatches)} mismatch(es)")
        return 1 if t.stats.mismatches else 0
    if ns.write_guard:
        packets = [o for o in ns.ops.split(",") if o] or fast_served_packets()
        ran, found, crashed = write_guard(packets, ns.write_guard, ns.seed)
        for key, (kind, wrote) in sorted(found.items()):
            print(f"{key}: writes {', '.join(wrote)} without an annotation; the fast path serves it as: {kind}")
        served = [k for k, (kind, _) in found.items() if kind not in ("python", None)]
        print(f"difftest --write-guard: {len(packets)} ops, {ran} CPU samples; {len(found)} write unannotated "
              f"arguments, {len(served)} of them served by the fast path"
              + (f"; CPU's kernel crashed on samples of {', '.join(crashed)}" if crashed else ""))
        return 1 if served else 0
    ops = [o for o in ns.ops.split(",") if o] or (wide_ops() if ns.wide else list(served_ops()))
    if ns.wide:
        _CHILD_FIRST.update(set(ops) - set(served_ops()))
    t0 = time.perf_counter()
    if ns.fresh:
        stats = run_fresh(ops, argv if argv is not None else sys.argv[1:])
    else:
        stats = run(ops, ns.samples, ns.seed, dtypes, 0 if ns.no_compile else ns.compile_every,
                    progress=ns.progress, timing_every=ns.timing_every)
    dt = time.perf_counter() - t0
    print(f"difftest: {len(ops)} ops, {stats.samples} samples ({stats.samples - stats.cpu_errors} valid, "
          f"{stats.cpu_errors} refused by CPU), {stats.compiled} compiled ({stats.compiled_dynamic} with symbolic "
          f"sizes), {stats.timing_only} timing-only, "
          f"fast path served {stats.fast_hits}; "
          f"{len(stats.mismatches)} mismatches; {dt:.0f} s ({time.process_time():.0f} s of CPU)")
    if stats.child_hangs:
        print(f"  {stats.child_hangs} child runs of crash-prone samples hung and were killed (left out)")
    if stats.cpu_reads_outside:
        print(f"  {stats.cpu_reads_outside} samples CPU's kernel computes by reading past an input or leaving "
              f"output unwritten, which the device refuses")
    if stats.cpu_crashes_undilated:
        print(f"  {stats.cpu_crashes_undilated} samples crash CPU's kernel only dilated over a size-1 kernel "
              f"dimension: compared with the same convolution undilated")
    if stats.overlap_refused:
        print(f"  {stats.overlap_refused} samples write an out= over part of an input, which CPU runs in its kernel's "
              f"write order and the device refuses")
    if stats.cpu_crashes:
        print(f"  {stats.cpu_crashes} samples crash CPU's own kernel (run in a child; the device must refuse them)")
    if stats.meta_differs:
        print(f"  {stats.meta_differs} timing-only samples differ from CPU as PyTorch's meta kernels do "
              f"(their shape functions, not the device's)")
    if stats.torch_compile_differs:
        print(f"  {stats.torch_compile_differs} compiled samples differ from eager CPU as torch.compile on CPU "
              f"(aot_eager) does: torch's compile semantics, not the device's")
    print("  by dtype: " + ", ".join(f"{k} {v}" for k, v in sorted(stats.by_dtype.items())))
    bad = {}
    for m in stats.mismatches:
        d = next((t for t in (m.sample.tags if m.sample is not None else ()) if t in DTYPE_NAMES), "?")
        bad[(d, m.mode)] = bad.get((d, m.mode), 0) + 1
    print("  mismatches by dtype and mode: " + (", ".join(f"{d}/{mode} {n}" for (d, mode), n in sorted(bad.items()))
                                               or "none"))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump({"ops": len(ops), "samples": stats.samples, "cpu_errors": stats.cpu_errors,
                       "cpu_seconds": time.process_time(), "torch_compile_differs": stats.torch_compile_differs,
                       "fast_hits": stats.fast_hits, "cpu_crashes": stats.cpu_crashes,
                       "child_hangs": stats.child_hangs, "cpu_crashes_undilated": stats.cpu_crashes_undilated,
                       "cpu_reads_outside": stats.cpu_reads_outside,
                       "overlap_refused": stats.overlap_refused,
                       "compiled": stats.compiled, "compiled_dynamic": stats.compiled_dynamic, "seconds": dt, "by_op": stats.by_op, "by_dtype": stats.by_dtype,
                       "mismatches": [m.line() for m in stats.mismatches]}, f, indent=1)
    return 1 if stats.mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
