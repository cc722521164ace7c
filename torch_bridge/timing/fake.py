"""Timing-only runs: tensors with a shape, a dtype and device ``neuron``, and no storage.

::

    with torch.neuron.timing_only():
        model = torch_bridge.models.from_config("llama-3.1-8b")   # no weights are ever allocated
        logits = model(torch.zeros(1, 2048, dtype=torch.long, device="neuron")).logits
    print(torch.neuron.report())                                 # where the simulated time went

Every op is lowered and charged as the eager device charges it - the same lowering
(:mod:`torch_bridge.lowering`), the same kernel costs, the same device model - but no value is
computed and no host memory is taken: the tensors are PyTorch FakeTensors on ``neuron:i``, whose
ops run only their shape functions (meta kernels). A :class:`_ChargeMode` above PyTorch's
FakeTensorMode sees each aten op with its inputs and outputs and follows the neuron device's
dispatch table (:mod:`torch_bridge.registration`) so the op stream is the one eager would launch:

* a view or metadata op runs on the host alone (counted, no launch), as in eager;
* an op with an explicit neuron kernel (matmuls, convolutions, copies, the ``_foreach_*`` ops,
  allocation) is charged as that kernel charges it;
* an op whose neuron kernel is a composite (``clone``, ``zeros``, ``slice_backward``, ...) runs
  that composite, so its inner ops are charged one by one, as in eager;
* any other op is charged as the boxed fallback charges it (:func:`lowering.op_spec`).

``F.scaled_dot_product_attention`` is caught before dispatch (a torch-function mode) and charged
as the fused attention op, forward and backward, where the eager kernel would take the call.

**HBM.** Each new storage on a neuron device counts against its logical core's HBM share until
the last tensor on it dies (a weak reference to the storage, swept every :data:`SWEEP_EVERY`
new storages and before refusing one), so a model that does not fit one logical core fails with
``torch.OutOfMemoryError`` and a hint to shard it.

**Values.** There are none: ``.item()``, ``bool(t)``, ``nonzero``, ``torch.equal`` and any
other op whose result or output shape depends on values raise :class:`TimingOnlyError` with one
line naming the op.
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode

from trnsim.device import Device, OpCost, no_work

from .. import _torch
from ..eager import lowering, memory
from ..eager.lowering import flat_tensors
from ..eager.values import is_neuron, op_info

__all__ = ["TimingOnlyError", "TimingOnly", "timing_only", "Target", "Ledger", "is_timing_only", "active",
           "materialize", "replay_layers", "SWEEP_EVERY"]

# Some of PyTorch's C++ asks a fake storage for its (null) data pointer and warns each time;
# timing-only tensors have no data by design, so the warning says nothing to a user.
_DATA_PTR_WARNING = "Accessing the data pointer of FakeTensor is deprecated"

#: New storages between two sweeps of dead ones (a sweep also runs before an allocation is refused).
SWEEP_EVERY = 256


class TimingOnlyError(RuntimeError):
    """An op that needs values ran in a timing-only run (one line naming the op)."""


# ---- where charges and memory go ---------------------------------------------------------------
Ledger = memory.Pool
"""HBM accounting per logical core (bytes), kept as the eager device's pool keeps it (the same
OOM message); ``Ledger(count, capacity_per_core)`` gives each simulated rank one of its own."""


@dataclass
class Target:
    """Where a timing-only run charges its ops: a device model, the logical core (None: each
    tensor's own ``neuron:i``) and the HBM ledger (a :class:`Ledger`, or the eager pool)."""

    device: Device
    core: int | None = None
    ledger: Any = None
    charge: bool = True  # False while a model is being built: allocations count, ops cost nothing
    tape: list[Any] | None = None  # when set, every launch is also appended here (for replays)
    # what fused attention keeps for its backward: the fp32 probabilities, as the eager kernel does
    # (True), or only their softmax statistics, one fp32 value per query row, as a flash-attention
    # kernel does (False; the cost is the same, the HBM is not)
    attention_keeps_probabilities: bool = True
    # the backward of fused attention: the eager kernels (its four matmuls and a softmax backward over
    # the probabilities in HBM; False), or flash attention's backward, which recomputes the scores on
    # chip (True): three passes of the library flash-attention kernel's instruction stream
    # (recompute + dV, dP + dS + dQ, dK), six matmul passes for the backward's five
    flash_backward: bool = False
    # attention with dropout: PyTorch's math path op by op, as eager runs it (False), or the flash
    # kernel dropping probabilities on chip (True), as a compiled training step runs it (neuronx-cc
    # and NKI's flash attention take dropout in the kernel; the backward regenerates the mask)
    attention_dropout: bool = False

    def core_of(self, index: int) -> int:
        return index if self.core is None else self.core


def _default_target() -> Target:
    from ..runtime import runtime

    return Target(runtime().device, None, memory.pool)


# ---- what the eager device does with each op -----------------------------------------------------
_NEURON = "neuron"
_CPU = torch.device("cpu")


def _unwrap_numbers(facts: "_Facts", args: tuple[Any, ...]) -> tuple[Any, ...]:
    """``args`` with a number given for a Tensor argument as a 0-dim host tensor. PyTorch hands a
    composite's wrapped scalar (remainder.Scalar's at::remainder(self, wrapped_scalar_tensor(other)))
    to Python as a number, which the op's boxed call refuses: take_along_dim failed timing-only
    with 'aten::remainder() Expected a value of type Tensor ... found type int' (found by
    difftest's long run), and so did xlogy.Scalar_Other once xlogy.Tensor had a kernel of its own
    (registration.LAYOUT_OPS). A 0-dim host tensor of the dtype the wrapped number promotes to
    promotes as it does (a default-dtype one outranked a 0-dim self: div.Scalar_mode of a 0-dim
    fp16 tensor came out float32, found by difftest's long run: div 237960526044720)."""
    numbers = [i for i in facts.tensor_args if i < len(args) and isinstance(args[i], (int, float, bool))]
    if not numbers:
        return args
    ref = next((x for x in args if isinstance(x, torch.Tensor)), None)
    return tuple(_wrapped(v, ref) if i in numbers else v for i, v in enumerate(args))


class _Facts:
    """What the charge mode needs to know about an op, read once from its schema and the
    neuron device's dispatch table."""

    __slots__ = ("name", "is_view", "out_names", "kind", "composite", "data_dependent", "tensor_args", "written")

    def __init__(self, op: Any):
        info = op_info(op)  # the eager fallback's reading of the schema: views, out= arguments
        self.name, self.is_view, self.out_names = info.name, info.is_view, info.out_names
        tags = set(op.tags)
        self.data_dependent = (torch.Tag.data_dependent_output in tags or torch.Tag.dynamic_output_shape in tags)
        # positions of the Tensor arguments (a wrapped number may arrive there: _unwrap_numbers)
        self.tensor_args = tuple(i for i, a in enumerate(_torch.op_schema(op).arguments) if str(a.type) == "Tensor")
        # the arguments it writes, as (position, name) (in-place self, out=, a foreach op's list)
        self.written = tuple((i, a.name) for i, a in enumerate(_torch.op_schema(op).arguments)
                             if a.alias_info is not None and a.alias_info.is_write)
        explicit = _torch.has_kernel(op, _torch.DispatchKey.PrivateUse1)
        self.composite = next((k for k in _torch.COMPOSITE_EXPLICIT if _torch.has_kernel(op, k)), None)
        # an implicit composite that reaches the mode (one a composite's C++ calls below autograd:
        # _safe_softmax's at::softmax) is taken apart as the dispatcher takes it apart for a neuron
        # tensor, so its inner ops are charged (softmax -> _softmax, the library kernel), not the op
        implicit = self.composite is None and _torch.has_kernel(op, _torch.DispatchKey.CompositeImplicitAutograd)
        self.kind = _EXPLICIT.get(self.name if not self.out_names else self.name + ".out", "fallback") if explicit \
            else ("composite" if self.composite is not None else "implicit" if implicit else "fallback")
        if explicit and self.name.startswith("_foreach_"):
            self.kind = "foreach" if not self.out_names else "fallback"


# ops with an explicit neuron kernel (registration.py) that do more than the fallback's costing
_EXPLICIT = {"empty": "alloc", "empty_strided": "alloc", "resize_": "alloc", "_copy_from": "copy",
             "_copy_from_and_resize": "copy", "_to_copy": "to_copy", "mm": "matmul", "addmm": "matmul",
             "bmm": "matmul", "baddbmm": "matmul", "mm.out": "matmul", "addmm.out": "matmul", "bmm.out": "matmul",
             "baddbmm.out": "matmul", "convolution_overrideable": "conv",
             "convolution_backward_overrideable": "conv_backward", "_has_compatible_shallow_copy_type": "host"}

_facts: dict[Any, _Facts] = {}


_C10_NAMES = {torch.uint8: "Byte", torch.int8: "Char", torch.int16: "Short", torch.int32: "Int", torch.int64: "Long",
              torch.bool: "Bool"}  # (c10's names of the integer dtypes, as its kernels' errors say them)


def _softmax_backward_result(name: str, grad_output: Any, output: Any, dim: int, input_dtype: Any) -> Any:
    """The softmax backwards' result as the device gives it (CPU's and CUDA's structured meta
    function): grad_output's dtype and shape, contiguous; half where a float gradient meets a half
    input (softmax(x_fp16, dtype=float32)). PyTorch's meta kernel gives input_dtype instead, and its
    out= decomposition refused the empty integer gradient CPU returns as it is (found by difftest's
    long run: _log_softmax_backward_data timing-only on empty int64/bool). Non-empty integers are
    refused as CPU's kernel refuses them."""
    dtype = torch.half if grad_output.dtype == torch.float and input_dtype == torch.half else grad_output.dtype
    if grad_output.numel() and not dtype.is_floating_point:
        raise NotImplementedError(f'"{name}" not implemented for \'{_C10_NAMES.get(dtype, str(dtype)[6:])}\'')
    return torch.empty(grad_output.shape, dtype=dtype, device=grad_output.device)


# ops whose result the device makes otherwise than PyTorch's meta kernel (name -> the result, made
# under the fake mode from the functional op's arguments)
_DEVICE_RESULTS: dict[str, Callable[..., Any]] = {
    "_softmax_backward_data": functools.partial(_softmax_backward_result, "softmax_backward_data"),
    "_log_softmax_backward_data": functools.partial(_softmax_backward_result, "log_softmax_backward_data")}


def _wrapped(v: Any, ref: torch.Tensor | None) -> torch.Tensor:
    """A Python number as a 0-dim host tensor that promotes with ``ref`` as the number does."""
    if ref is not None:
        try:
            return torch.tensor(v, dtype=torch.result_type(ref, v))
        except (RuntimeError, OverflowError):  # (a number the dtype cannot hold: no values here anyway)
            pass
    return torch.tensor(v)


def _facts_of(op: Any) -> _Facts:
    f = _facts.get(op)
    if f is None:
        f = _facts[op] = _Facts(op)
    return f


def _index(t: torch.Tensor) -> int:
    return t.device.index or 0


def _device_kwarg(kwargs: dict[str, Any]) -> torch.device | None:
    dev = kwargs.get("device")
    return torch.device(dev) if dev is not None else None


_WHY = {"_local_scalar_dense": ".item(), bool(), int() or float() of a tensor",
        "equal": "torch.equal", "nonzero": "its output's shape is the count of nonzero values",
        "masked_select": "its output's shape is the count of selected values",
        "unique": "its output's shape is the count of distinct values",
        "_unique2": "its output's shape is the count of distinct values",
        "index": "indexing with a boolean mask: its output's shape is the count of True values"}


def _real_tensors(facts: _Facts, args: tuple[Any, ...], kwargs: dict[str, Any], tensors: list[Any]) -> None:
    """Refuse, in one line, an op that would leave a tensor made outside the run (one with values;
    a meta tensor has none either) silently wrong: writing it (the write would reach a timing-only
    copy, the tensor keeping its old values), or reading one that requires grad while autograd
    records (a real model's parameter: its ``.grad`` would become a tensor without values, and
    later real steps would accumulate into it and change nothing)."""
    for i, name in facts.written:
        v = args[i] if i < len(args) else kwargs.get(name)
        for t in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(t, torch.Tensor) and not isinstance(t, _torch.FakeTensor) and t.device.type != "meta":
                raise TimingOnlyError(
                    f"timing-only: aten::{facts.name} writes a tensor made outside the timing-only block, which "
                    f"would keep its values (timing-only ops compute none): make it inside the block, or run "
                    f"this with values")
    if torch.is_grad_enabled():
        for t in tensors:
            if t.requires_grad and not isinstance(t, _torch.FakeTensor) and t.device.type != "meta":
                raise TimingOnlyError(
                    f"timing-only: aten::{facts.name} reads a tensor made outside the timing-only block that "
                    f"requires grad (a model's parameter), whose gradient would have no values: build the model "
                    f"inside the block (torch_bridge.timing.models.from_config), or run it under torch.no_grad()")


#: ops tagged data-dependent for their boolean-mask form alone: with integer indices the output's
#: shape is the indices' (``x[idx]``, as index_select), so they run timing-only
_MASKED_ONLY = frozenset({"index", "_unsafe_index"})
# ops that take host index tensors beside a device ``self``, as CUDA's do (values.MIXED_DEVICE_OPS):
# index moves them to the device first (its meta function's make_info: a host-to-device copy each,
# charged in eager), the index_put family reads them where they are (eager charges no copy)
_HOST_INDEX_MOVED = frozenset({"index", "_unsafe_index"})
_HOST_INDEX_READ = frozenset({"index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put"})
_ATEN = torch.ops.aten


def _host_indices(args: tuple[Any, ...]) -> bool:
    """A host tensor among an index op's indices (its second argument, a list)."""
    return len(args) > 1 and isinstance(args[1], (list, tuple)) and \
        any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in args[1])


def _has_mask(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """A boolean or uint8 index tensor among an index op's indices (its output's shape is then a count)."""
    return any(t.dtype in (torch.bool, torch.uint8) for t in flat_tensors(list(args[1:]) + list(kwargs.values()), []))


def _data_error(name: str, why: str | None = None) -> TimingOnlyError:
    why = why or _WHY.get(name, "its result depends on the tensors' values")
    shown = name if "." in name else f"aten::{name}"
    return TimingOnlyError(f"timing-only: {shown} needs tensor values ({why}), and timing-only tensors have "
                           f"none; data-dependent code cannot run timing-only: give it static shapes, or run it "
                           f"with values")


#: Python-level tensor methods that hand a tensor's values to the host: caught by the run's
#: function mode (they never reach an aten op the dispatcher could refuse)
_VALUE_METHODS = {torch.Tensor.numpy: ("Tensor.numpy()", "a NumPy array of its values"),
                  torch.Tensor.__array__: ("Tensor.__array__", "np.asarray of a tensor"),
                  torch.Tensor.tolist: ("Tensor.tolist()", "a list of its values"),
                  torch.Tensor.__reduce_ex__: ("torch.save", "pickling or saving a tensor writes its values")}


def _key(x: Any) -> Any:
    """What of an argument can change the kernel an op lowers to (shapes, dtypes, strides,
    devices, ints, strings, bools; not float values)."""
    tp = type(x)
    if tp is tuple or tp is list:
        return tuple([_key(y) for y in x])
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape), x.stride(), x.dtype, x.device)
    if tp is float:
        return float
    if tp in (int, str, bool) or x is None or isinstance(x, (torch.dtype, torch.device)):
        return x
    return tp


class _ChargeMode(_torch.TorchDispatchMode):  # type: ignore[misc]
    """Charges each aten op of a timing-only run on the target (see the module docstring)."""

    def __init__(self, run: "TimingOnly"):
        super().__init__()
        self.run = run
        self.costs: dict[tuple[Any, ...], OpCost] = {}
        self._layouts: dict[tuple[Any, ...], Any] = {}  # composite signature -> the functional layout, or None
        self._composites = 0  # how many composite kernels are running (nested)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.prim.device.default:
            return func(*args, **kwargs)
        facts = _facts_of(func)
        tensors = flat_tensors(list(args) + list(kwargs.values()), [])
        _real_tensors(facts, args, kwargs, tensors)
        neuron = [t for t in tensors if t.device.type == _NEURON]
        dev = _device_kwarg(kwargs)
        if not neuron and not (dev is not None and dev.type == _NEURON):
            if self._composites and not any(isinstance(t, _torch.FakeTensor) for t in tensors):
                # a composite's own host temporary (torch 2.13's repeat builds its permutation with
                # arange and stack and reads it): made with values, as eager makes it; nothing charged
                with _torch.disable_current_modes():
                    return func(*args, **kwargs)
            return self._call(func, facts, args, kwargs)  # a CPU (or meta) op: no device, no charge
        if facts.data_dependent and not (facts.name in _MASKED_ONLY and not _has_mask(args, kwargs)):
            raise _data_error(facts.name)
        if not neuron and tensors and facts.composite is not None:
            return self._composite(func, facts, args, kwargs)  # a CPU op making a neuron tensor (x.to("neuron"))
        index = _index(neuron[0]) if neuron else (dev.index or 0 if dev is not None else 0)
        target = self.run.target
        kind = facts.kind
        fuser = self.run.fuser
        if self.run._awaiting and neuron and not facts.is_view and kind not in ("host", "alloc", "direct"):
            self.run.await_reads(neuron)  # an asynchronous collective's result read here: wait for it
        if facts.name == "lift_fresh" and neuron:
            # a tensor made from data on the device by PyTorch's C++ (a list index, x[[0, 2]]): fake
            # mode made it there directly; eager copies it from the host, one charged copy
            src = args[0]
            self.run.launch(target.core_of(index), "_copy_from",
                            self._cost(("copy", "copy_h2d", _key(src), _key(src)),
                                       lambda: lowering.copy_spec("copy_h2d", src, src)))
        if facts.is_view or kind == "host":
            self.run.host_op(facts.name)
            out = self._call(func, facts, args, kwargs)
            if fuser is not None and fuser.pending and not fuser.flushing and facts.is_view:
                fuser.record(target.core_of(index), func, args, kwargs, out, None)  # a region may read through it
            return out
        device_result = _DEVICE_RESULTS.get(facts.name) if not facts.out_names else None
        if device_result is not None:
            kind = "fallback"  # (charged as the op, as eager's fallback charges it)
        if kind == "direct":
            return self._call(func, facts, args, kwargs)
        if kind == "composite":
            return self._composite(func, facts, args, kwargs)
        if facts.name in _HOST_INDEX_MOVED | _HOST_INDEX_READ and _host_indices(args):
            return self._host_index_op(func, facts, args, kwargs, core_of=target.core_of(index))
        if kind == "implicit":
            with self:  # the decomposition's ops come back through this mode
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        core = target.core_of(index)
        if kind == "to_copy":
            src = args[0]
            if fuser is not None and not fuser.flushing and is_neuron(src) and src.dtype.is_floating_point and \
                    torch.device(kwargs.get("device") or src.device) == src.device and \
                    (kwargs.get("dtype") or src.dtype).is_floating_point:
                with self:  # a cast in a compiled region: recorded, launched when the region is lowered
                    out = torch.empty_like(src, dtype=kwargs.get("dtype") or src.dtype,
                                           memory_format=kwargs.get("memory_format") or torch.preserve_format)
                cost = self._cost(("copy", "copy_d2d", _key(src), _key(out)),
                                  lambda: lowering.copy_spec("copy_d2d", src, out))
                fuser.record(core, func, args, kwargs, out, ("_copy_from", cost))
                return out
            return self._to_copy(args, kwargs)
        if kind == "copy":  # the device's copy hook (no meta kernel): the bytes move, the shape is dst's
            src, dst = args[0], args[1]
            if facts.name == "_copy_from_and_resize" and dst.shape != src.shape:
                with self:
                    dst.resize_(src.shape)
            direction = "copy_d2d" if is_neuron(src) and is_neuron(dst) else \
                "copy_h2d" if is_neuron(dst) else "copy_d2h"
            self.run.launch(core, "_copy_from", self._cost(("copy", direction, _key(src), _key(dst)),
                                                           lambda: lowering.copy_spec(direction, src, dst)))
            if is_neuron(src) and not is_neuron(dst):  # to the host: the host waits for the device
                self.run.synchronize(core)
            return dst
        if device_result is not None:
            with self:  # (its allocation comes back through this mode, as a composite's do)
                out = device_result(*args, **kwargs)
        else:
            out = self._call(func, facts, args, kwargs)
        if kind == "alloc":
            return out
        if kind == "matmul":
            self._matmul(core, facts.name, args)
        elif kind == "conv":
            self._conv(core, args, out)
        elif kind == "conv_backward":
            self._conv_backward(core, args, out)
        elif kind == "foreach":
            self._foreach(core, facts.name, func, args, kwargs, out)
        else:
            outs = flat_tensors(out, [])
            cost = self._op_cost(func, facts, args, kwargs, outs)
            if fuser is not None and not fuser.flushing and fuser.fusable(func) and outs and \
                    all(t.device.type == _NEURON for t in outs):
                fuser.record(core, func, args, kwargs, out, (facts.name, cost))  # lowered with its region
            else:
                self.run.launch(core, facts.name, cost)
        return out

    def _host_index_op(self, func: Any, facts: _Facts, args: tuple[Any, ...], kwargs: dict[str, Any],
                       core_of: int) -> Any:
        """An index op given host index tensors beside a device tensor, as eager runs it (a
        FakeTensor op refuses the mix): ``index`` copies each host index to the device (charged)
        and indexes with the copies; the ``index_put`` family reads them on the host, so its
        kernel is charged without them (as the eager fallback charges only device tensors)."""
        device = args[0].device
        moved = facts.name in _HOST_INDEX_MOVED
        target = self.run.target
        charging = target.charge
        if not moved:
            target.charge = False  # (their device twins only give the meta kernel its devices)
        try:
            with self:  # (as make_info's index.to(self.device()): a _to_copy, an empty and a copy)
                indices = [_ATEN._to_copy.default(t, device=device)
                           if isinstance(t, torch.Tensor) and t.device.type == "cpu" else t for t in args[1]]
        finally:
            target.charge = charging
        new_args = (args[0], indices, *args[2:])
        if moved:
            with self:  # the op on device indices comes back through this mode, as any op
                return func(*new_args, **kwargs)
        out = self._call(func, facts, new_args, kwargs)
        self.run.launch(core_of, facts.name, self._op_cost(func, facts, args, kwargs, flat_tensors(out, [])))
        return out

    def _op_cost(self, func: Any, facts: _Facts, args: tuple[Any, ...], kwargs: dict[str, Any],
                 outs: list[Any]) -> OpCost:
        """An op's charge as the eager fallback prices it: its kernel over its device tensors."""
        inputs = [t for t in flat_tensors(list(args) + [v for k, v in kwargs.items() if k not in facts.out_names], [])
                  if t.device.type == _NEURON]
        key = (func, _key(args), _key(tuple(kwargs.items())), _key(outs),
               lowering.out_is_self(args, kwargs, facts.out_names))
        return self._cost(key, lambda: lowering.op_spec(facts.name, args, kwargs, inputs, outs))

    # ---- running an op on fake tensors ---------------------------------------------------------
    def _call(self, func: Any, facts: _Facts, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        args = _unwrap_numbers(facts, args)
        try:
            out = func(*args, **kwargs)
        except (_torch.DataDependentOutputException, _torch.DynamicOutputShapeException):
            raise _data_error(facts.name) from None
        except _torch.UnsupportedOperatorException:
            raise TimingOnlyError(f"timing-only: aten::{facts.name} has no shape function (meta kernel) in torch "
                                  f"{torch.__version__}, so it cannot run without values; run it with values"
                                  ) from None
        if not facts.is_view:
            self.run.track(out)
        return out

    def _composite(self, func: Any, facts: _Facts, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        args = _unwrap_numbers(facts, args)
        self._composites += 1
        try:
            with self:  # the composite's inner ops come back through this mode
                out = _torch.run_composite(func, facts.composite, *args, **kwargs)
        finally:
            self._composites -= 1
        if all(isinstance(t, _torch.FakeTensor) for t in flat_tensors(out, [])):
            if isinstance(out, torch.Tensor) and not facts.out_names and not facts.is_view and not facts.written \
                    and out.is_contiguous():
                # (an in-place op's result is its input, laid out as it is: running it again for the
                # layout applied unsqueeze_ or transpose_ twice on a signature's first call)
                self._functional_layout(func, args, kwargs, out)
            return out
        # a composite that builds its result on the TensorImpl itself (_unsafe_view, ...): eager
        # runs it on the host without a dispatch, so nothing is charged; fake mode makes the output
        facts.kind = "direct"
        return self._call(func, facts, args, kwargs)

    def _functional_layout(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        """Give a composite's result the layout of the functional op's meta kernel where the two
        differ. abs and logical_not allocate an empty result and call their out= form, whose meta
        kernel resizes it contiguous; CPU's TensorIterator (and the functional op's own meta
        kernel) keep a transposed input's layout (found by difftest's long run: abs of a
        (1, 2, 2, 3) tensor of strides (12, 6, 1, 2) came out (12, 6, 3, 1) timing-only). The
        functional op runs below this mode (nothing charged), once per signature."""
        key = (func, _key(args), _key(tuple(kwargs.items())))
        strides = self._layouts.get(key, False)
        if strides is False:
            strides = None
            try:
                ref = func(*args, **kwargs)
            except Exception:  # noqa: BLE001 - no meta kernel of its own: the composite's layout stands
                ref = None
            if isinstance(ref, torch.Tensor) and ref.shape == out.shape and ref.dtype == out.dtype and \
                    ref.stride() != out.stride() and _torch.non_overlapping_and_dense(ref):
                strides = ref.stride()
            self._layouts[key] = strides
        if strides is not None:
            out.as_strided_(out.shape, strides, out.storage_offset())

    def _to_copy(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """alloc.to_copy: an empty tensor like the source, then a copy into it."""
        src = args[0]
        with self:
            out = torch.empty_like(src, dtype=kwargs.get("dtype") or src.dtype, device=kwargs.get("device") or src.device,
                                   memory_format=kwargs.get("memory_format") or torch.preserve_format)
            out.copy_(src)
        return out

    # ---- costing as the explicit kernels do ------------------------------------------------------
    def _cost(self, key: tuple[Any, ...], spec: Callable[[], Any], label: str = "launch only") -> OpCost:
        cost = self.costs.get(key)
        if cost is None:
            s = spec()
            cost = self.costs[key] = no_work(label) if s is None else self.run.target.device.cost(s)
        return cost

    def _matmul(self, core: int, name: str, args: tuple[Any, ...]) -> None:
        if name in ("mm", "bmm"):
            a, b = args[0], args[1]
        else:  # addmm(self, mat1, mat2), baddbmm(self, batch1, batch2)
            a, b = args[1], args[2]
        if name in ("mm", "addmm"):
            batch, (m, k), n = 1, a.shape, b.shape[1]
        else:
            batch, m, k, n = a.shape[0], a.shape[1], a.shape[2], b.shape[2]
        ta, tb = lowering.matmul_layout(a, b)
        mx = self.run.mx
        if mx is not None and name == "mm":
            for i, spec in enumerate(lowering.mx_linear_specs(m, k, n, a.dtype, ta, tb, mx)):
                self.run.launch(core, ("mx_quantize", "mx_quantize", "matmul_mx")[i],
                                self._cost(("mx", m, k, n, a.dtype, ta, tb, mx, i), lambda s=spec: s))
            return
        spec = functools.partial(lowering.matmul_spec, batch, m, k, n, a.dtype, ta, tb)
        self.run.launch(core, name, self._cost(("mm", batch, m, k, n, a.dtype, ta, tb), spec,
                                               "empty matmul (launch only)"))

    def _conv(self, core: int, args: tuple[Any, ...], out: torch.Tensor) -> None:
        inp, weight, _, stride, padding, dilation, transposed, _, groups = args[:9]
        specs = lowering.conv_specs(inp, weight, out, groups, stride, padding, dilation, transposed)
        for i, spec in enumerate(specs):
            self.run.launch(core, "convolution", self._cost(("conv", _key(args[:9]), i), lambda s=spec: s))

    def _conv_backward(self, core: int, args: tuple[Any, ...], out: tuple[Any, ...]) -> None:
        grad_output, inp, weight = args[0], args[1], args[2]
        groups, mask = args[8], args[9]
        if mask[0]:
            for i, spec in enumerate(lowering.conv_specs(grad_output, weight, inp, groups)):
                self.run.launch(core, "convolution_backward",
                                self._cost(("convbi", _key(args[:9]), i), lambda s=spec: s))
        if mask[1]:
            for i, spec in enumerate(lowering.conv_specs(inp, weight, grad_output, groups)):
                self.run.launch(core, "convolution_backward",
                                self._cost(("convbw", _key(args[:9]), i), lambda s=spec: s))
        if out[2] is not None:
            gb = out[2]
            self.run.launch(core, "convolution_backward", self._cost(
                ("convbb", _key(grad_output), _key(gb)),
                lambda: lowering.generic_spec("convolution_backward", [grad_output], [gb])))

    def _foreach(self, core: int, name: str, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 out: Any) -> None:
        produced = flat_tensors(out, [])
        key = (func, _key(args), _key(tuple(kwargs.items())))
        lists = [list(a) for a in args if isinstance(a, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in a)]
        singles = [a for a in args if is_neuron(a)]
        self.run.launch(core, name, self._cost(key, lambda: lowering.fused_spec(name, lists, singles, produced)))


# ---- attention: the fused op, as the eager kernel charges it ----------------------------------
class _Attention(torch.autograd.Function):
    """``scaled_dot_product_attention`` on timing-only tensors: the output (and the fp32
    probabilities the eager kernel keeps for its backward) as new tensors, the forward and
    backward charged as the eager kernel charges them (:mod:`torch_bridge.attention`)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                is_causal: bool, scale: float | None, run: "TimingOnly", dropout_p: float = 0.0,
                flash: bool = False) -> torch.Tensor:
        from ..ops.attention import FORWARD, cpu_layout

        s = k.shape[-2]
        kept = q.shape[:-1] + (s,) if run.target.attention_keeps_probabilities else q.shape[:-1]
        p = q.new_empty(kept, dtype=torch.float32)  # P (as the eager kernel keeps it), or its statistics
        ctx.shapes = (q.shape, q.dtype, k.shape, v.shape, s)
        ctx.run = run
        ctx.flash = (attn_mask, is_causal, scale, dropout_p)
        kv = (k.shape[-3], s)
        key = ("fwd", q.shape, lowering.kv_cost_key(kv, q.shape[-2]), q.dtype,
               None if attn_mask is None else (attn_mask.shape, attn_mask.dtype), is_causal, scale, dropout_p)
        run.charge_specs(_index(q), FORWARD, key,
                         lambda: lowering.attention_specs(q, attn_mask, is_causal, scale, dropout_p, kv=kv))
        out = q.new_empty(q.shape[:-1] + (v.shape[-1],))
        laid = cpu_layout(q, out, flash)
        if laid is not None:  # as the eager kernel lays it out (CPU's flash kernel: as the query)
            out = q.new_empty_strided(out.shape, laid)
        if run.target.attention_keeps_probabilities:
            ctx.p = p  # as the eager kernel keeps them
        else:
            ctx.save_for_backward(q, k, v, out, p)  # what flash attention's backward reads: inputs, output, statistics
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        from ..ops.attention import BACKWARD

        q_shape, dtype, k_shape, v_shape, s = ctx.shapes
        q = grad_out.new_empty(q_shape, dtype=dtype)
        mask, causal, scale, dropout_p = ctx.flash
        if ctx.run.target.flash_backward and mask is None and q_shape[-2] == s:
            # each pass regenerates the forward's dropout mask from its seed, as flash attention does
            ctx.run.charge_specs(_index(grad_out), BACKWARD, ("flash-bwd", q_shape, dtype, causal, scale, dropout_p),
                                 lambda: 3 * lowering.attention_specs(q, None, causal, scale, dropout_p))
        else:
            ctx.run.charge_specs(_index(grad_out), BACKWARD, ("bwd", q_shape, s, dtype),
                                 lambda: lowering.attention_backward_specs(q, s, dtype))
        return (q, grad_out.new_empty(k_shape, dtype=dtype), grad_out.new_empty(v_shape, dtype=dtype),
                None, None, None, None, None, None)


class FunctionMode(TorchFunctionMode):
    """Catches ``F.scaled_dot_product_attention`` before dispatch decomposes it."""

    def __init__(self, run: "TimingOnly"):
        super().__init__()
        self.run = run

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        value = _VALUE_METHODS.get(func)
        if value is not None and args and is_timing_only(args[0]):
            raise _data_error(*value)
        if func is torch.nn.functional.scaled_dot_product_attention:
            done = self.run.attention(*args, **kwargs)
            if done is not None:
                return done
        if func in _FROM_DATA and args and not isinstance(args[0], torch.Tensor) and \
                _is_neuron_device(kwargs.get("device")):
            return _from_data(func, args, kwargs)
        held = _held_values(func, args, kwargs)
        if held is not None:  # a host tensor from data moved to the device: one copy, as in eager
            with _torch.constant_hidden(held):
                return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if func is torch.Tensor.backward or func is torch.autograd.backward or func is torch.autograd.grad:
            self.run.raise_deferred_oom()
        return out


# tensors made from Python data (lists, numbers, numpy arrays)
_FROM_DATA = (torch.tensor, torch.as_tensor)


def _is_neuron_device(device: Any) -> bool:
    if device is None:
        return False
    try:
        return torch.device(device).type == _NEURON
    except (RuntimeError, TypeError):
        return False  # (the op itself gives its error)


def _held_values(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The host tensor of ``t.to(<neuron>)`` or ``<neuron tensor>.copy_(t)`` when it was made from
    data inside the run and fake mode keeps its values (``torch.tensor(0)``): fake mode would run
    that copy for real too, and the real device would charge it a second time. The caller hides
    the values for the copy (:func:`_torch.constant_hidden`); else None."""
    if func is torch.Tensor.to and args:
        t = args[0]
        moved = any(_is_neuron_device(a) if isinstance(a, (str, torch.device)) else
                    isinstance(a, torch.Tensor) and a.device.type == _NEURON for a in args[1:]) or \
            _is_neuron_device(kwargs.get("device"))
    elif func is torch.Tensor.copy_ and len(args) > 1 and isinstance(args[0], torch.Tensor):
        t, moved = args[1], args[0].device.type == _NEURON
    else:
        return None
    return t if moved and _torch.held_constant(t) is not None and t.device.type == "cpu" else None


def _from_data(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.Tensor:
    """``torch.tensor(data, device="neuron")`` as eager makes it: the values on the host, then
    one host-to-device copy (charged). Made directly, PyTorch's fake mode took a device tensor
    from below the charge mode: nothing was charged for a list, and a number went through the
    real device (a copy charged there as device to device)."""
    device = kwargs["device"]
    grad = bool(kwargs.get("requires_grad", False))
    host = func(*args, **{k: v for k, v in kwargs.items() if k not in ("device", "requires_grad", "pin_memory")})
    _torch.forget_constant(host)  # (else the copy also runs, and is charged, on the real device)
    out = host.to(device)
    return out.requires_grad_() if grad else out


def _sdpa_args(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
               dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
               enable_gqa: bool = False) -> tuple[Any, ...]:
    return query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa


# ---- the run -------------------------------------------------------------------------------------
class TimingOnly:
    """A timing-only run: enter it (``with``) to create and run timing-only tensors. See the
    module docstring; :func:`timing_only` makes one on the ``neuron`` device's own timeline."""

    def __init__(self, target: Target | None = None):
        self._target = target
        self._fake: Any = None
        self._modes: list[Any] = []
        self._live: dict[int, tuple[int, int, StorageWeakRef]] = {}  # storage id -> (core, bytes, weak ref)
        self._new = 0
        self._dying: list[int] = []  # storages one of whose tensors died since the last check
        self._weak: dict[int, Any] = {}  # the weak references themselves (by id), until they fire
        self._lock = threading.RLock()
        self.specs: dict[tuple[Any, ...], list[OpCost]] = {}
        self._thread: int | None = None  # the thread that entered the run
        self._oom: torch.OutOfMemoryError | None = None  # an OOM on another thread, raised on this one
        self.fuser: Any = None  # a torch_bridge.fuse_regions.Fuser: elementwise ops lowered as compiled regions
        # an MX format ("mxfp8_e4m3fn") while an MX linear runs its matmuls (train_step.mx_linear): each
        # 2-d matmul is charged as its operands' MX quantisation kernels and the MX matmul
        self.mx: str | None = None
        # (the rank's Comm, its CP group) while a context-parallel step runs: attention is ring
        # attention over the group (torch_bridge.context_parallel)
        self.ring: tuple[Any, list[int]] | None = None
        # asynchronous collectives not yet waited on: their results' storages -> (weak ref, core, end tick);
        # the first op that reads one waits for the collective's end (collective(result=...))
        self._awaiting: dict[int, tuple[StorageWeakRef, int, int]] = {}

    @property
    def target(self) -> Target:
        if self._target is None:
            self._target = _default_target()
        return self._target

    def __enter__(self) -> "TimingOnly":
        self.target  # noqa: B018  (fix the device now: set_config after this point is an error)
        if not any(f[0] == "ignore" and f[1] is not None and f[1].pattern.startswith(_DATA_PTR_WARNING)
                   for f in warnings.filters):
            warnings.filterwarnings("ignore", message=_DATA_PTR_WARNING)
        self._fake = _torch.FakeTensorMode(allow_non_fake_inputs=True, allow_fallback_kernels=False)
        self._modes = [self._fake, _ChargeMode(self), FunctionMode(self)]
        for m in self._modes:
            m.__enter__()
        self._thread, self._oom = threading.get_ident(), None
        _active.append(self)
        sweep_lingering()
        return self

    def __exit__(self, *exc: Any) -> None:
        _active.remove(self)
        for m in reversed(self._modes):
            m.__exit__(*exc)
        self._modes = []
        self.sweep()
        if self._live:  # tensors that outlive the run: swept when a run starts or ends and when the
            _lingering.add(self)  # device's allocated bytes are read
        sweep_lingering()

    # ---- charging: every device interaction goes through these (and onto the tape) ---------------
    def _flush(self) -> None:
        f = self.fuser
        if f is not None and f.pending and not f.flushing:
            f.flush()

    def launch(self, core: int, op: str, cost: OpCost) -> None:
        self._flush()
        t = self.target
        if t.charge:
            t.device.launch(core, op, cost)
            if t.tape is not None:
                t.tape.append(("launch", core, op, cost))

    def host_op(self, op: str) -> None:
        t = self.target
        if t.charge:
            t.device.host_op(op)
            if t.tape is not None:
                t.tape.append(("host", op))

    def synchronize(self, core: int) -> None:
        self._flush()
        t = self.target
        if t.charge:
            t.device.synchronize(core)
            if t.tape is not None:
                t.tape.append(("sync", core))

    def collective(self, core: int, op: str, cost: OpCost, early: bool = False, result: Any = None) -> None:
        """A collective on ``core``'s collective stream: it starts when the compute issued before
        it is done (``early``: as soon as the collective stream is free, its data being ready
        long before, a prefetch), and the compute issued after it waits for its result - or,
        given the ``result`` tensor(s) it writes (an asynchronous collective: issued, waited on
        at the first read, as a compiled graph schedules a collective by its data), only the
        first op that reads one of them waits; the compute between runs beside it, sharing the
        core's DMA. A run recording a tape (a replay) waits at once."""
        self._flush()
        t = self.target
        if t.charge:
            from trnsim.device import COLLECTIVE_STREAM

            dev = t.device
            _, end = dev.launch_collective(core, op, cost, after=COLLECTIVE_STREAM if early else None)
            outs = [r for r in flat_tensors(result, []) if r.device.type == _NEURON] if result is not None else []
            if outs and t.tape is None:
                if len(self._awaiting) > 64:  # results dropped unread: forget them
                    self._awaiting = {k: v for k, v in self._awaiting.items() if not v[0].expired()}
                for r in outs:
                    ref = StorageWeakRef(r.untyped_storage())
                    self._awaiting[ref.cdata] = (ref, core, end)
            else:
                dev.stream_wait(core, dev.cores[core].current_stream, end)
            if t.tape is not None:
                t.tape.append(("collective", core, op, cost, early))

    def await_reads(self, tensors: Any) -> None:
        """Before an op reading ``tensors`` runs: for each one an asynchronous collective writes
        and has not been waited on, the core's current stream waits for the collective's end
        (the region being fused is launched first: it was issued before the wait)."""
        if not self._awaiting:
            return
        for x in tensors:
            if not isinstance(x, torch.Tensor) or x.device.type != _NEURON:
                continue
            hit = self._awaiting.pop(StorageWeakRef(x.untyped_storage()).cdata, None)
            if hit is None or hit[0].expired():
                continue
            self._flush()
            dev = self.target.device
            dev.stream_wait(hit[1], dev.cores[hit[1]].current_stream, hit[2])

    def replay(self, tape: list[tuple[Any, ...]]) -> None:
        """Issue a recorded tape's device interactions again, in order."""
        do = {"launch": self.launch, "host": self.host_op, "sync": self.synchronize, "collective": self.collective}
        for item in tape:
            do[item[0]](*item[1:])

    def charge_specs(self, index: int, op: str, key: tuple[Any, ...], specs: Callable[[], list[Any]]) -> None:
        costs = self.specs.get(key)
        if costs is None:
            costs = self.specs[key] = [self.target.device.cost(s) for s in specs()]
        core = self.target.core_of(index)
        for c in costs:
            self.launch(core, op, c)

    def attention(self, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        """The fused attention op where the eager kernel would take the call, else None (PyTorch's
        math path then runs op by op, as in eager)."""
        from ..ops.attention import check, takes_meta

        q, k, v, mask, dropout_p, is_causal, scale, enable_gqa = _sdpa_args(*args, **kwargs)
        if not all(is_neuron(t) for t in (q, k, v)):
            return None
        flash = check(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa)
        self.await_reads((q, k, v, mask))
        dropout = float(dropout_p) if self.target.attention_dropout else 0.0
        if self.ring is not None:
            if mask is not None or q.dim() != 4 or q.shape[-2] != k.shape[-2]:
                from trnsim.workload.training import RecipeError

                raise RecipeError(f"--cp {len(self.ring[1])}: ring attention takes self-attention without an explicit "
                                  f"mask (causal or not); this model's attention passes one")
            from .context_parallel import ring_attention

            return ring_attention(q, k, v, bool(is_causal), scale, self, dropout, self.ring, flash)
        if not takes_meta(q, k, v, mask, dropout_p - dropout, enable_gqa):
            return None
        return _Attention.apply(q, k, v, mask, is_causal, scale, self, dropout, flash)

    # ---- HBM -------------------------------------------------------------------------------------
    def track(self, out: Any) -> None:
        """Count each new storage among ``out``'s neuron tensors against its core's HBM. Every
        tensor gets a weak reference whose callback has its storage checked on the next call, so
        memory is released at the next op after its last tensor dies (a tensor made outside
        dispatch, such as an ``nn.Parameter`` over a result, keeps it alive until a sweep)."""
        if self._dying:
            self._check_dying()
        for t in flat_tensors(out, []):
            if t.device.type != _NEURON:
                continue
            ref = StorageWeakRef(t.untyped_storage())
            key = ref.cdata
            seen = self._live.get(key)
            if seen is not None and seen[2].expired():
                self._forget(key)  # the address was freed and reused
                seen = None
            if seen is None:
                nbytes = t.untyped_storage().nbytes()
                core = self.target.core_of(_index(t))
                self._reserve(core, nbytes)
                self._live[key] = (core, nbytes, ref)
            r = weakref.ref(t, functools.partial(_died, self._dying, self._weak, key))
            self._weak[id(r)] = r

    def _check_dying(self) -> None:
        dying, self._dying[:] = list(self._dying), []
        for key in dying:
            seen = self._live.get(key)
            if seen is not None and seen[2].expired():
                self._forget(key)

    def _reserve(self, core: int, nbytes: int) -> None:
        ledger = self.target.ledger
        self._new += 1
        if self._new % SWEEP_EVERY == 0:
            self.sweep()
        try:
            ledger.reserve(core, nbytes)
        except torch.OutOfMemoryError:
            self.sweep()
            try:
                ledger.reserve(core, nbytes)
            except torch.OutOfMemoryError as e:
                err = torch.OutOfMemoryError(
                    f"{e} - timing-only: the tensors do not fit one logical core's HBM; shard the model over more "
                    f"cores (trnsim estimate --tp N / --pp N, or a parallelism plan)")
                if threading.get_ident() == self._thread:
                    raise err from None
                # the autograd engine's device thread (a backward): an exception raised there
                # aborts the process in torch 2.13 (std::terminate), so count the bytes past the
                # capacity and raise the first such OOM when the backward returns (raise_deferred_oom)
                if self._oom is None:
                    self._oom = err
                with ledger.lock:
                    ledger.devices[core].add(nbytes)

    def raise_deferred_oom(self) -> None:
        """Raise the OOM a backward met on the autograd engine's thread, if any (see _reserve)."""
        err, self._oom = self._oom, None
        if err is not None:
            raise err

    def _forget(self, key: int) -> None:
        core, nbytes, _ = self._live.pop(key)
        self.target.ledger.release(core, nbytes)

    def sweep(self) -> None:
        """Release the HBM of every storage no tensor holds any more."""
        with self._lock:
            self._dying.clear()
            for key in [k for k, (_, _, ref) in self._live.items() if ref.expired()]:
                self._forget(key)

    def allocated(self, core: int = 0) -> int:
        """Bytes of live timing-only storages on ``core`` (after a sweep)."""
        self.sweep()
        return sum(n for c, n, _ in self._live.values() if c == core)


_active: list[TimingOnly] = []
_lingering: set[TimingOnly] = set()  # ended runs some of whose tensors were still alive


def sweep_lingering() -> None:
    """Release the bytes of ended runs' tensors that have died since (their ``_died`` callbacks
    only queue a check for the run's next op, which an ended run never has)."""
    for run in list(_lingering):
        run.sweep()
        if not run._live:
            _lingering.discard(run)


memory.settlers.append(sweep_lingering)


def _died(dying: list[int], weak: dict[int, Any], key: int, ref: Any) -> None:
    weak.pop(id(ref), None)
    dying.append(key)  # checked at the next op: the storage may outlive this tensor (views, parameters)


def active() -> TimingOnly | None:
    """The innermost timing-only run entered on this process, if any."""
    return _active[-1] if _active else None


def is_timing_only(t: Any) -> bool:
    """True for a timing-only tensor (shape, dtype and device, no storage)."""
    return isinstance(t, _torch.FakeTensor)


def timing_only() -> TimingOnly:
    """``with torch.neuron.timing_only():`` - a timing-only run on the neuron device's timeline
    (the chip of ``torch.neuron.config()``; ops are charged to its report, tensors count against
    its HBM, as ``torch.neuron.memory_allocated`` shows)."""
    return TimingOnly()


def materialize(module: torch.nn.Module, device: Any = "neuron", dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Give ``module``'s meta parameters and buffers timing-only storage on ``device`` (inside a
    timing-only run): their HBM counts, no op is charged, no value exists (a model built under
    ``torch.device("meta")`` had its weights never allocated; this puts them on the device).
    A parameter or buffer that several modules share (tied input and output embeddings) stays
    one tensor, as ``module.to(device)`` keeps it: its HBM counts once, and autograd sums the
    gradients of its uses into it, as in the run with values."""
    run = active()
    if run is None:
        raise TimingOnlyError("timing-only: materialize() runs inside a timing-only run "
                              "(with torch.neuron.timing_only(): ...)")
    target = run.target
    charging, target.charge = target.charge, False
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id of a meta tensor -> (it, its replacement)
    try:
        for mod in module.modules():
            for name, p in list(mod._parameters.items()):
                if p is not None:
                    if id(p) not in made:
                        dt = dtype if dtype is not None and p.is_floating_point() else p.dtype
                        made[id(p)] = (p, torch.nn.Parameter(torch.empty_like(p, device=device, dtype=dt),
                                                             requires_grad=p.requires_grad))
                    mod._parameters[name] = made[id(p)][1]
            for name, b in list(mod._buffers.items()):
                if b is not None:
                    if id(b) not in made:
                        made[id(b)] = (b, torch.empty_like(b, device=device))
                    mod._buffers[name] = made[id(b)][1]
    finally:
        target.charge = charging
    return module


def _signature(layer: torch.nn.Module) -> tuple[Any, ...]:
    return (type(layer), tuple((n, tuple(p.shape), p.dtype) for n, p in layer.named_parameters()),
            tuple((n, tuple(b.shape), b.dtype) for n, b in layer.named_buffers()),
            tuple(type(m) for m in layer.modules()))


def replay_layers(layers: torch.nn.ModuleList, after: Callable[[int, int], None] | None = None) -> bool:
    """Run the first of ``layers`` and replay its device tape for each of the others, when they
    are the same program (same module types, parameter and buffer shapes). Each replayed layer
    issues exactly the launches, host ops and collectives the first one did, in order, and
    returns a new tensor like its output (without a gradient: for inference). ``after(i, tokens)``
    runs for each replayed layer (a KV cache moves its length on). Returns whether the layers
    replay (False: they differ, and each runs)."""
    if len(layers) < 2:
        return False
    sig = _signature(layers[0])
    if any(_signature(m) != sig for m in layers):
        return False
    state: dict[str, Any] = {}
    first = layers[0]
    forward0 = first.forward

    def record(*args: Any, **kwargs: Any) -> Any:
        run = active()
        if run is None:
            return forward0(*args, **kwargs)
        target = run.target
        outer, target.tape = target.tape, []
        try:
            out = forward0(*args, **kwargs)
        finally:
            tape, target.tape = target.tape, outer
            if outer is not None:
                outer.extend(tape)
        x = args[0] if args else kwargs.get("hidden_states")
        state.update(tape=tape, out=out, shape=tuple(x.shape) if isinstance(x, torch.Tensor) else None)
        return out

    def replayed(index: int) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            run = active()
            x = args[0] if args else kwargs.get("hidden_states")
            if run is None or "tape" not in state or (isinstance(x, torch.Tensor) and tuple(x.shape) != state["shape"]):
                return type(layers[index]).forward(layers[index], *args, **kwargs)
            run.replay(state["tape"])
            out = state["out"]
            new = torch.empty_like(out) if isinstance(out, torch.Tensor) else \
                (torch.empty_like(out[0]), *out[1:])
            if after is not None:
                after(index, x.shape[1] if isinstance(x, torch.Tensor) and x.dim() > 1 else 1)
            return new
        return forward

    first.forward = record
    for i in range(1, len(layers)):
        layers[i].forward = replayed(i)
    return True
