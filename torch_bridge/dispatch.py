"""The `neuron` device's aten kernels: one boxed fallback plus the explicit kernels PyTorch needs.

Every op call on neuron tensors lands here and does two things:

1. **Values.** View and metadata ops redispatch to the CPU kernels on the neuron tensors
   themselves (they touch only metadata, so the result is a real neuron view). TensorE ops (mm,
   addmm, bmm, baddbmm and, through them, linear/matmul/attention) run through the native
   datapath. Every other op runs its CPU kernel on zero-copy CPU views of the device memory;
   new results are relabelled as neuron tensors without a copy.
2. **Time.** The call lowers to a kernel (:mod:`torch_bridge.lowering`) whose cached timing-only
   report is charged, plus a launch overhead, to the current stream of the op's NeuronCore.
   Views cost the launch overhead only.

Every kernel is hidden from dynamo (``torch._disable_dynamo``): a Python kernel is otherwise a
frame dynamo tries to compile. See ``shared/notes/privateuse1-python.md`` for why each explicit
kernel exists.
"""

from __future__ import annotations

import functools
import numbers
from typing import Any, Callable

import torch
from torch._C import DispatchKey, DispatchKeySet
from torch._C._dynamo.eval_frame import get_eval_frame_callback as _eval_frame_callback

from . import memory, tensore
from .lowering import Lowered, flat_tensors
from .runtime import runtime

__all__ = ["register_kernels", "NEURON"]

NEURON = "neuron"
_CPU_KEYS = DispatchKeySet(DispatchKey.CPU)
_libs: list[torch.library.Library] = []


# ---- schema facts, cached per op ------------------------------------------------------------
class _OpInfo:
    """What the fallback needs to know about an op's schema."""

    __slots__ = ("name", "is_view", "out_names", "tensor_positions", "engine_name")

    def __init__(self, op: torch._ops.OpOverload):
        schema = op._schema
        self.name = op.overloadpacket.__name__
        self.is_view = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns) or \
            self.name in ("set_", "is_set_to", "record_stream")
        self.out_names = tuple(a.name for a in schema.arguments
                               if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write)
        self.tensor_positions = tuple(i for i, a in enumerate(schema.arguments)
                                      if str(a.type) in ("Tensor", "Optional[Tensor]") and not a.kwarg_only)


_infos: dict[Any, _OpInfo] = {}


def _info(op: Any) -> _OpInfo:
    info = _infos.get(op)
    if info is None:
        info = _infos[op] = _OpInfo(op)
    return info


# ---- helpers --------------------------------------------------------------------------------
def _is_neuron(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device in _NEURON_DEVICES


# Every neuron device a tensor can be on: ``t.device in _NEURON_DEVICES`` is a third of the cost
# of ``t.device.type == NEURON`` (building the type string), and the fallback asks it per argument.
_NEURON_DEVICES = frozenset(torch.device("privateuseone", i) for i in range(256))  # NEURON is not named yet


def _device_of(args: Any, kwargs: dict[str, Any]) -> int:
    first = args[0] if args else None
    if isinstance(first, torch.Tensor) and first.device in _NEURON_DEVICES:  # the usual case, made cheap
        return first.device.index or 0
    for t in flat_tensors(list(args) + list(kwargs.values()), []):
        if t.device.type == NEURON:
            return t.device.index or 0
    dev = kwargs.get("device")
    if dev is not None:
        dev = torch.device(dev)
        if dev.type == NEURON:
            return dev.index or 0
    return _current_device()


def _current_device() -> int:
    from .device import current_device

    return current_device()


class _ToCpu:
    """Converts op arguments to CPU: neuron tensors become zero-copy views; remembers which."""

    def __init__(self) -> None:
        self.views: dict[int, torch.Tensor] = {}  # id(cpu view) -> neuron tensor
        self.storages: dict[int, torch.Tensor] = {}  # device address -> a neuron tensor on that storage

    def __call__(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if x.device not in _NEURON_DEVICES:
                return x
            v = memory.cpu_view(x)  # may be the view another argument got (the same window)
            self.views.setdefault(id(v), x)  # the first such argument (self of an in-place op) wins
            ptr = x.untyped_storage().data_ptr()
            if ptr:
                self.storages.setdefault(ptr, x)
            return v
        if isinstance(x, (list, tuple)):
            return type(x)(self(y) for y in x)
        if isinstance(x, torch.device) and x.type == NEURON:
            return torch.device("cpu")
        return x


def _back(x: Any, conv: _ToCpu, index: int) -> Any:
    """Map a CPU result back to the device: an argument's view -> that neuron tensor; a result
    over an argument's memory (an op whose schema does not say it aliases) -> a neuron view of
    that storage, never a second owner of it; a new tensor -> relabelled in place of a copy."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            return x
        mine = conv.views.get(id(x))
        if mine is not None:
            return mine
        if x._is_zerotensor():  # an _efficientzerotensor (sgn's gradient) has no memory: materialise it
            return memory.relabel(torch.zeros(x.shape, dtype=x.dtype), index)
        owner = conv.storages.get(x.untyped_storage().data_ptr())
        if owner is not None:
            alias = torch.empty(0, dtype=x.dtype, device=owner.device)
            return torch.ops.aten.set_.source_Storage_storage_offset.redispatch(
                _CPU_KEYS, alias, owner.untyped_storage(), x.storage_offset(), x.size(), x.stride())
        return memory.relabel(x, index)
    if isinstance(x, (list, tuple)):
        return type(x)(_back(y, conv, index) for y in x)
    return x


def _call_traced(label: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, shown in torch.profiler as ``neuron::<label>`` while it records."""
    if not torch.autograd.profiler._is_profiler_enabled:
        return fn(*args, **kwargs)
    with torch._C._profiler._RecordFunctionFast(f"neuron::{label}"):
        return fn(*args, **kwargs)


def _charge(index: int, op: str, lowered: Lowered) -> None:
    runtime().charge(index, op, lowered)


def _charge_generic(index: int, op: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> None:
    rt = runtime()
    rt.charge(index, op, rt.lowering.generic(op, inputs, outputs))


_VIEW = Lowered("view (metadata only)", False, None)


def _charge_view(index: int, op: str) -> None:
    runtime().charge(index, op, _VIEW)


# ---- the boxed fallback -----------------------------------------------------------------------
def _fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    info = _info(op)
    return _call_traced(info.name, _run, op, info, args, kwargs)


def _run(op: Any, info: _OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    index = _device_of(args, kwargs)
    if info.is_view:
        if info.name == "record_stream":
            return None
        out = op.redispatch(_CPU_KEYS, *args, **kwargs)
        _charge_view(index, info.name)
        return out
    if info.name == "_local_scalar_dense":  # item(): the host waits for the device
        from .device import synchronize

        synchronize(index)
    conv = _ToCpu()
    cargs = [conv(a) for a in args]
    ckwargs = {k: conv(v) for k, v in kwargs.items()}
    fresh: dict[str, torch.Tensor] = {}
    for name in info.out_names:  # device-aliased outs cannot be resized: compute into fresh ones
        out = kwargs.get(name)
        if isinstance(out, torch.Tensor) and out.device.type == NEURON and out.numel() == 0:
            fresh[name] = ckwargs[name] = torch.empty(0, dtype=out.dtype)
    call = op._op  # the C++ callable (OpOverload.__call__ adds a Python frame)
    n = len(args)
    for i in info.tensor_positions:
        if i < n and not isinstance(args[i], torch.Tensor) and isinstance(args[i], numbers.Number):
            call = op.overloadpacket  # a C++ "wrapped number" arrives as a Python scalar
            break
    try:
        try:
            result = call(*cargs, **ckwargs)
        except RuntimeError as e:
            outs = [n for n in info.out_names if _is_neuron(kwargs.get(n)) and n not in fresh]
            if "not resizable" not in str(e) or not outs:
                raise
            for name in outs:  # an out= of the wrong size: let the kernel allocate, then adopt it
                fresh[name] = ckwargs[name] = torch.empty(0, dtype=kwargs[name].dtype)
            result = call(*cargs, **ckwargs)
    except NotImplementedError as e:  # no CPU kernel for these arguments: say so for neuron, in one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise NotImplementedError(f"neuron: aten::{info.name} cannot run on the neuron device with these arguments "
                                  f"({first}); run this op on CPU (move its tensors with .cpu())") from None
    for t in flat_tensors(result, []):
        if t.layout != torch.strided:
            raise NotImplementedError(f"neuron: aten::{info.name} returns a {t.layout} tensor, and the neuron device "
                                      f"holds dense (strided) tensors only; run this op on CPU (.cpu())")
    for name, cpu_out in fresh.items():
        dev_out = kwargs[name]
        dev_out.set_(memory.relabel(cpu_out, index))
        conv.views[id(cpu_out)] = dev_out
    out = _back(result, conv, index)
    rt = runtime()
    key = (op, _signature(args), _signature(tuple(kwargs.items())), _signature(out))
    lowered = _lowered.get(key)
    if lowered is None:
        inputs = flat_tensors(list(args) + [v for k, v in kwargs.items() if k not in info.out_names], [])
        lowered = rt.lowering.op(info.name, args, kwargs, [t for t in inputs if t.device.type == NEURON],
                                 flat_tensors(out, []))
        _lowered[key] = lowered
    rt.charge(index, info.name, lowered)
    return out


# (op, argument signature) -> its Lowered: skips re-deriving the kernel key of a repeated call
_lowered: dict[tuple[Any, ...], Lowered] = {}


def _signature(x: Any) -> Any:
    """What of an argument can change the kernel: tensor shapes, dtypes and devices, ints, strings,
    bools; not float values (a learning rate changes every step, the kernel does not). A
    tensor's device is told apart by is_cpu/is_meta (else neuron: this torch build has no other
    device), which is cheaper than building its ``torch.device``; it runs for every op call."""
    tp = type(x)
    if tp is tuple or tp is list:
        return tuple([_signature(y) for y in x])
    if tp is float:
        return float
    if tp is int or tp is str or tp is bool or x is None:
        return x
    if isinstance(x, torch.Tensor):
        return (x.shape, x.dtype, x.is_cpu, x.is_meta)
    if isinstance(x, (list, tuple)):
        return tuple([_signature(y) for y in x])
    if isinstance(x, float):
        return float
    if isinstance(x, (int, str, bool, torch.dtype)):
        return x
    return type(x)


def _check_one_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The device check a composite would have made (TensorIterator's): one device, except 0-dim
    CPU tensors, which act as scalars."""
    devices = {t.device for t in flat_tensors(list(args) + list(kwargs.values()), [])
               if t.device in _NEURON_DEVICES or t.dim() > 0}
    if len(devices) > 1:
        a, b = sorted(devices, key=str)[:2]
        raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                           f"{a} and {b}!")


def _same_device_fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    """The fallback for a claimed elementwise op, with its composite's device check."""
    _check_one_device(args, kwargs)
    return _fallback(op, *args, **kwargs)


def _foreach(op: Any, *args: Any, **kwargs: Any) -> Any:
    """A ``_foreach_*`` op whole: the CPU foreach kernel over zero-copy views, charged as one
    launch of a generic kernel over all its tensors (bytes and elements summed over each list),
    as a fused multi-tensor kernel would run. PyTorch's slow path for a backend without foreach
    kernels would split it into one device op per tensor: an AdamW step plus gradient clipping
    on the demo's 28-tensor GPT-2 was ~330 launches, and is 12 this way."""
    _check_one_device(args, kwargs)
    info = _info(op)
    return _call_traced(info.name, _run_foreach, op, info, args, kwargs)


def _run_foreach(op: Any, info: _OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    index = _device_of(args, kwargs)
    conv = _ToCpu()
    out = _back(op(*[conv(a) for a in args], **{k: conv(v) for k, v in kwargs.items()}), conv, index)
    key = (op, _signature(args), _signature(tuple(kwargs.items())))
    lowered = _lowered.get(key)
    if lowered is None:
        lists = [list(a) for a in args if isinstance(a, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in a)]
        inputs = [_fused(ts) for ts in lists] + [a for a in args if _is_neuron(a)]
        produced = flat_tensors(out, [])
        outputs = [_fused(produced)] if produced else [_fused(lists[0])] if lists else []  # in place: self
        lowered = _lowered[key] = runtime().lowering.generic(info.name, inputs, outputs)
    runtime().charge(index, info.name, lowered)
    return out


def _fused(ts: list[Any]) -> torch.Tensor:
    """A meta tensor holding as many elements as the tensors of ``ts`` together (for costing)."""
    tensors = [t for t in ts if isinstance(t, torch.Tensor)]
    return torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device="meta")


# ---- allocation, copies, resize ---------------------------------------------------------------
def _index(device: Any) -> int:
    if device is None:
        return _current_device()
    d = torch.device(device)
    idx = d.index if d.index is not None else _current_device()
    count = runtime().device_count
    if not 0 <= idx < count:
        raise RuntimeError(f"neuron:{idx} does not exist: the {runtime().config.name} config has {count} "
                           f"logical NeuronCores (neuron:0..neuron:{count - 1})")
    return idx


def _empty_memory_format(size: Any, dtype: Any = None, layout: Any = None, device: Any = None,
                         pin_memory: Any = None, memory_format: Any = None) -> torch.Tensor:
    dtype = dtype or torch.get_default_dtype()
    stride = None
    if memory_format not in (None, torch.contiguous_format, torch.preserve_format):
        stride = torch.empty(size, dtype=dtype, device="meta", memory_format=memory_format).stride()
    return memory.allocate(size, stride, dtype, _index(device))


def _empty_strided(size: Any, stride: Any, dtype: Any = None, layout: Any = None, device: Any = None,
                   pin_memory: Any = None) -> torch.Tensor:
    return memory.allocate(size, stride, dtype or torch.get_default_dtype(), _index(device))


def _copy_from(self: torch.Tensor, dst: torch.Tensor, non_blocking: bool = False) -> torch.Tensor:
    src_dev = self.device.type == NEURON
    dst_dev = dst.device.type == NEURON
    index = (self.device.index or 0) if src_dev else (dst.device.index or 0)
    if src_dev and not dst_dev:
        from .device import synchronize

        synchronize(index)  # device -> host: the host waits for the work that produced it
    dst_view = memory.cpu_view(dst) if dst_dev else dst
    src_view = memory.cpu_view(self) if src_dev else self
    dst_view.copy_(src_view)
    kind = "copy_d2d" if src_dev and dst_dev else "copy_h2d" if dst_dev else "copy_d2h"
    rt = runtime()
    rt.charge(index, "_copy_from", rt.lowering.generic(kind, [self], [dst]))
    return dst


def _copy_from_and_resize(self: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    dst.resize_(self.shape)
    return _copy_from(self, dst)


def _contiguous_strides(size: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(size):
        strides.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(strides))


def _resize_(self: torch.Tensor, size: Any, memory_format: Any = None) -> torch.Tensor:
    size = tuple(size)
    if memory_format not in (None, torch.contiguous_format, torch.preserve_format):
        stride = torch.empty(size, device="meta", memory_format=memory_format).stride()
    else:
        stride = _contiguous_strides(size)
    numel = 1
    for s in size:
        numel *= s
    need = (self.storage_offset() + numel) * self.element_size() if numel else 0
    storage = self.untyped_storage()
    if need > storage.nbytes():
        index = self.device.index or 0
        grown = memory.allocate((int(need),), None, torch.uint8, index)
        if storage.nbytes():
            old = torch.empty(0, dtype=torch.uint8, device=self.device).set_(storage)
            memory.cpu_view(grown)[:storage.nbytes()].copy_(memory.cpu_view(old))
        storage = grown.untyped_storage()
    torch.ops.aten.set_.source_Storage_storage_offset.redispatch(
        _CPU_KEYS, self, storage, self.storage_offset(), size, stride)
    return self


def _has_compatible_shallow_copy_type(self: torch.Tensor, from_: torch.Tensor) -> bool:
    """Dense CPU and neuron tensors may take each other's place in ``.data =`` (as CPU and CUDA
    ones do). c10's default list of dense backends lacks PrivateUse1 and asks a PrivateUse1
    backend to say so here; without it ``Module.to("neuron")`` builds new Parameter objects and
    unties tied weights (an LM head sharing its embedding)."""
    return (self.layout == torch.strided and from_.layout == torch.strided
            and {self.device.type, from_.device.type} <= {"cpu", NEURON})


def _to_copy(self: torch.Tensor, *, dtype: Any = None, layout: Any = None, device: Any = None,
             pin_memory: Any = None, non_blocking: bool = False, memory_format: Any = None) -> torch.Tensor:
    """``Tensor.to`` to or from neuron, without ``non_blocking`` (its pinned-memory path is not
    implementable from Python): the copy is synchronous either way."""
    out = torch.empty_like(self, dtype=dtype or self.dtype, device=device or self.device,
                           memory_format=memory_format or torch.preserve_format)
    out.copy_(self)
    return out


# ---- TensorE ops through the native datapath -----------------------------------------------
def _matmul_time(index: int, op: str, batch: int, m: int, k: int, n: int, dtype: torch.dtype,
                 a: torch.Tensor | None = None, b: torch.Tensor | None = None) -> None:
    """Charge a matmul; the operands' memory layouts pick the kernel's operand forms: a row-major
    A[M,K] is loaded as ``a`` (transpose_a), a column-major one is already lhsT[K,M]; a row-major
    B[K,N] is ``rhs``, a column-major one (``x @ w.t()``) is stored as b[N,K] (transpose_b)."""
    ta = a is not None and a.stride(-1) == 1 and a.shape[-1] > 1
    tb = b is not None and b.stride(-1) != 1 and b.shape[-1] > 1
    rt = runtime()
    rt.charge(index, op, rt.lowering.matmul(op, batch, m, k, n, dtype, ta, tb))


def _mm(self: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    index = self.device.index or 0
    a, b = memory.cpu_view(self), memory.cpu_view(mat2)
    if tensore.on_datapath(a, b):
        res = tensore.matmul_f32(a, b).to(self.dtype)
    else:
        res = torch.mm(a, b)
    _matmul_time(index, "mm", 1, self.shape[0], self.shape[1], mat2.shape[1], self.dtype, self, mat2)
    return memory.relabel(res, index)


def _add_scaled(prod: torch.Tensor, c: torch.Tensor, alpha: Any, beta: Any) -> torch.Tensor:
    """``alpha * prod + beta * c`` in fp32 over the PSUM result, in place (addmm/baddbmm)."""
    if alpha != 1:
        prod.mul_(alpha)
    if beta != 0:  # beta == 0 ignores self entirely (even NaN), as aten does
        prod.add_(c.float() if beta == 1 else c.float() * beta)
    return prod


def _addmm(self: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *, beta: Any = 1, alpha: Any = 1
           ) -> torch.Tensor:
    index = mat1.device.index or 0
    a, b, c = memory.cpu_view(mat1), memory.cpu_view(mat2), memory.cpu_view(self)
    if tensore.on_datapath(a, b) and c.dtype == a.dtype:
        res = _add_scaled(tensore.matmul_f32(a, b), c, alpha, beta).to(mat1.dtype)
    else:
        res = torch.addmm(c, a, b, beta=beta, alpha=alpha)
    _matmul_time(index, "addmm", 1, mat1.shape[0], mat1.shape[1], mat2.shape[1], mat1.dtype, mat1, mat2)
    return memory.relabel(res, index)


def _bmm(self: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    index = self.device.index or 0
    a, b = memory.cpu_view(self), memory.cpu_view(mat2)
    if tensore.on_datapath(a, b):
        res = tensore.bmm_f32(a, b).to(self.dtype)
    else:
        res = torch.bmm(a, b)
    _matmul_time(index, "bmm", self.shape[0], self.shape[1], self.shape[2], mat2.shape[2], self.dtype, self, mat2)
    return memory.relabel(res, index)


def _baddbmm(self: torch.Tensor, batch1: torch.Tensor, batch2: torch.Tensor, *, beta: Any = 1, alpha: Any = 1
             ) -> torch.Tensor:
    index = batch1.device.index or 0
    a, b, c = memory.cpu_view(batch1), memory.cpu_view(batch2), memory.cpu_view(self)
    if tensore.on_datapath(a, b) and c.dtype == a.dtype:
        res = _add_scaled(tensore.bmm_f32(a, b), c, alpha, beta).to(batch1.dtype)
    else:
        res = torch.baddbmm(c, a, b, beta=beta, alpha=alpha)
    _matmul_time(index, "baddbmm", batch1.shape[0], batch1.shape[1], batch1.shape[2], batch2.shape[2], batch1.dtype,
                 batch1, batch2)
    return memory.relabel(res, index)


def _out_variant(functional: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``op.out`` from its functional kernel: compute, then resize ``out`` and copy into it."""
    def out_kernel(*args: Any, out: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        res = functional(*args, **kwargs)
        if out.shape != res.shape:
            out.resize_(res.shape)
        memory.cpu_view(out).copy_(memory.cpu_view(res))
        return out
    return out_kernel


# ---- convolution (aten sends non-CPU/CUDA convolutions to the *_overrideable ops) -------------
def _conv_time(index: int, op: str, inp: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, groups: int,
               stride: Any = None, padding: Any = None, dilation: Any = None, transposed: bool = True) -> None:
    """A plain 2-d convolution (one group, square filter, equal strides and paddings, no
    dilation) lowers to the library's conv2d kernel. Any other convolution is costed as the
    matmul of its im2col patches: M = batch x output positions, K = input channels per group x
    filter size, N = output channels per group; one per group."""
    if (not transposed and groups == 1 and inp.dim() == 4 and weight.shape[2] == weight.shape[3]
            and len(set(stride)) == 1 and len(set(padding)) == 1 and set(dilation) == {1}):
        n, c, h, w = inp.shape
        rt = runtime()
        rt.charge(index, op, rt.lowering.library(
            "conv2d", (n, c, h, w, weight.shape[0], weight.shape[2]), inp.dtype,
            {"stride": int(stride[0]), "padding": int(padding[0])},
            lambda: rt.lowering.matmul(op, 1, out.shape[0] * out.shape[2] * out.shape[3], c * weight.shape[2] ** 2,
                                       weight.shape[0], inp.dtype)))
        return
    kernel_numel = 1
    for s in weight.shape[2:]:
        kernel_numel *= s
    positions = 1
    for s in out.shape[2:]:
        positions *= s
    m = out.shape[0] * positions
    k = weight.shape[1] * kernel_numel
    n = weight.shape[0] // groups
    _matmul_time(index, op, groups, m, k, n, inp.dtype)


def _convolution(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: Any, padding: Any,
                 dilation: Any, transposed: bool, output_padding: Any, groups: int) -> torch.Tensor:
    index = input.device.index or 0
    x, w = memory.cpu_view(input), memory.cpu_view(weight)
    cb = memory.cpu_view(bias) if bias is not None else None
    if tensore.conv_on_datapath(x, w, transposed) and (cb is None or cb.dtype == x.dtype):
        acc = tensore.conv_f32(x, w, stride, padding, dilation, groups)
        if cb is not None:
            acc += cb.float().view(1, -1, *([1] * (acc.dim() - 2)))
        res = acc.to(input.dtype)
    else:
        res = torch.ops.aten.convolution.default(x, w, cb, stride, padding, dilation, transposed, output_padding,
                                                 groups)
    _conv_time(index, "convolution", input, weight, res, groups, stride, padding, dilation, transposed)
    return memory.relabel(res, index)


def _convolution_backward(grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, stride: Any,
                          padding: Any, dilation: Any, transposed: bool, output_padding: Any, groups: int,
                          output_mask: Any) -> tuple[Any, Any, Any]:
    index = input.device.index or 0
    g, x, w = memory.cpu_view(grad_output), memory.cpu_view(input), memory.cpu_view(weight)
    bias_sizes = [weight.shape[1] * groups if transposed else weight.shape[0]]
    gi, gw, gb = torch.ops.aten.convolution_backward.default(g, x, w, bias_sizes, stride, padding, dilation,
                                                            transposed, output_padding, groups, output_mask)
    if output_mask[0]:
        _conv_time(index, "convolution_backward", grad_output, weight, input, groups)
    if output_mask[1]:
        _conv_time(index, "convolution_backward", input, weight, grad_output, groups)
    res = tuple(memory.relabel(t, index) if t is not None else None for t in (gi, gw, gb))
    if res[2] is not None:
        _charge_generic(index, "convolution_backward", [grad_output], [res[2]])
    return res  # type: ignore[return-value]


# ---- autocast -------------------------------------------------------------------------------
_AUTOCAST_KEYS = DispatchKeySet(getattr(DispatchKey, "AutocastPrivateUse1"))  # missing from the stubs
AUTOCAST_OPS = ("mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "convolution", "conv1d", "conv2d", "conv3d",
                "addbmm", "_convolution", "prelu", "scaled_dot_product_attention")


def _autocast_kernel(op: Any) -> Callable[..., Any]:
    """Lower-precision ops under ``torch.autocast("neuron")``: cast floating neuron operands to the
    autocast dtype, then run the op with autocast excluded (autograd records the casts)."""
    def kernel(*args: Any, **kwargs: Any) -> Any:
        dt = torch.get_autocast_dtype(NEURON)

        def cast(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.device.type == NEURON and x.dtype != dt:
                return x.to(dt)
            if isinstance(x, (list, tuple)):
                return type(x)(cast(y) for y in x)
            return x
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
            return op(*cast(list(args)), **{k: cast(v) for k, v in kwargs.items()})
    return kernel


# ---- registration ---------------------------------------------------------------------------
# Ops with a composite kernel that PyTorch would otherwise decompose before the device sees them.
# Claiming them runs the CPU kernel whole (the same numbers as on CPU; the math decomposition of
# layer norm differs by ~1e-4; group norm's, in bf16 statistics, by up to 0.09) and lets them
# lower to their library kernels. mode.values's composite refuses any device but CPU/CUDA/XPU.
WHOLE_OPS = ("native_layer_norm", "native_group_norm", "embedding", "mode.values")
# Frequent functional ops claimed directly, so they skip the composite `empty` + `op.out` round
# trip (one allocation and one dispatch fewer per call; the values are the same CPU kernels).
# mse_loss's and smooth_l1_loss's CPU out= kernels also warn that they resized their output, on every call.
DIRECT_OPS = ("add.Tensor", "sub.Tensor", "mul.Tensor", "div.Tensor", "add.Scalar", "mul.Scalar", "neg", "exp",
              "sqrt", "rsqrt", "relu", "gelu", "silu", "sigmoid", "tanh", "pow.Tensor_Scalar", "where.self",
              "_softmax", "_log_softmax", "sum.dim_IntList", "mean.dim", "eq.Tensor", "ne.Scalar", "gt.Scalar",
              "lt.Scalar", "masked_fill.Scalar", "clamp", "threshold_backward", "gelu_backward",
              "_softmax_backward_data", "mse_loss", "smooth_l1_loss")

def _hidden(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` hidden from dynamo. Its wrapper swaps the eval-frame callback out and back on every
    call (a few us, on every op); with no callback installed (no compiled frame running) there is
    nothing to hide from, so the kernel is called directly."""
    hidden = torch._disable_dynamo(fn, recursive=True)

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if _eval_frame_callback() is None:
            return fn(*args, **kwargs)
        return hidden(*args, **kwargs)
    return kernel


def register_kernels() -> None:
    """Register the fallback and explicit kernels once per process."""
    if _libs:
        return
    impl = torch.library.Library("aten", "IMPL")
    fallback = torch.library.Library("_", "IMPL")
    _libs.extend([impl, fallback])
    kernels: dict[str, Callable[..., Any]] = {
        "empty.memory_format": _empty_memory_format,
        "empty_strided": _empty_strided,
        "_copy_from": _copy_from,
        "_copy_from_and_resize": _copy_from_and_resize,
        "resize_": _resize_,
        "_to_copy": _to_copy,
        "mm": _mm,
        "mm.out": _out_variant(_mm),
        "addmm": _addmm,
        "addmm.out": _out_variant(_addmm),
        "bmm": _bmm,
        "bmm.out": _out_variant(_bmm),
        "baddbmm": _baddbmm,
        "baddbmm.out": _out_variant(_baddbmm),
        "convolution_overrideable": _convolution,
        "convolution_backward_overrideable": _convolution_backward,
    }
    for name, fn in kernels.items():
        impl.impl(name, _hidden(_traced(name, fn)), "PrivateUse1")
    impl.impl("_has_compatible_shallow_copy_type", _hidden(_has_compatible_shallow_copy_type), "PrivateUse1")
    for name in WHOLE_OPS + DIRECT_OPS:
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet), overload or "default")
        kernel = functools.partial(_same_device_fallback if name in DIRECT_OPS else _fallback, op)
        impl.impl(name, _hidden(kernel), "PrivateUse1")
    for qualified in torch._C._dispatch_get_all_op_names():  # every functional/in-place _foreach_* op
        if qualified.startswith("aten::_foreach_"):
            name = qualified[len("aten::"):]
            packet, _, overload = name.partition(".")
            op = getattr(getattr(torch.ops.aten, packet), overload or "default")
            if not _info(op).out_names:  # out= variants keep the fallback's resizing of outs
                impl.impl(name, _hidden(functools.partial(_foreach, op)), "PrivateUse1")
    # copying a conj/neg-bit tensor must not loop through the conj fallback (a segfault otherwise)
    impl.impl("_copy_from", torch.library.fallthrough_kernel, "Conjugate")
    impl.impl("_copy_from", torch.library.fallthrough_kernel, "Negative")
    # attention as one op: an AutogradPrivateUse1 kernel beats the op's CompositeImplicitAutograd
    # math path; the PrivateUse1 one serves calls below autograd (inference mode)
    from .attention import FORWARD, sdpa

    for key in ("AutogradPrivateUse1", "PrivateUse1"):
        impl.impl(FORWARD, _hidden(_traced(FORWARD, sdpa)), key)
    fallback.fallback(_hidden(_fallback), "PrivateUse1")
    fallback.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    for name in AUTOCAST_OPS:
        packet = getattr(torch.ops.aten, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            impl.impl(f"{name}.{overload}" if overload != "default" else name, _hidden(_autocast_kernel(op)),
                      "AutocastPrivateUse1")


def _traced(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` shown in torch.profiler as ``neuron::<op>``."""
    label = name.split(".")[0]

    def kernel(*args: Any, **kwargs: Any) -> Any:
        return _call_traced(label, fn, *args, **kwargs)
    kernel.__name__ = getattr(fn, "__name__", name)
    return kernel
