"""NKI kernels as PyTorch custom ops on the neuron device: :func:`nki_op`.

``nki_op("mylib::rmsnorm", kernel)`` registers a ``trnsim.nki`` kernel as the ``torch.library``
custom op ``torch.ops.mylib.rmsnorm``, called on neuron tensors in eager mode and inside
``torch.compile(backend="neuron")``, as torch-neuronx's ``nki_op`` does on a real device:

* **values** - the kernel's own instruction stream, run on zero-copy CPU views of the device
  memory (:meth:`trnsim.nki.NkiFamily.values`: bit for bit what ``nki.run`` returns);
* **time** - the kernel's own cycle report, through the device model: the call is a
  :class:`~trnsim.device.KernelSpec` of the kernel's family (:mod:`trnsim.nki.family`), simulated
  once per input shapes, dtypes and compile-time arguments, split over the two physical cores of
  an LNC=2 logical core when the kernel is launched on a grid of 2 (``kernel[2]``), and shown in
  the run report under the op's name;
* **compiled graphs** - a fake implementation traces the kernel (without scheduling or simulating
  it) for the outputs' shapes and dtypes, so dynamo and aot_autograd capture the call as one
  graph node; the compiled graph runs it as its own kernel launch;
* **autograd** - without ``backward=`` the op has no derivative and differentiating through it
  raises PyTorch's usual error; ``backward=bwd_kernel`` registers ``<name>_backward`` (an NKI op
  of its own, charged under that name) as its derivative: the backward kernel takes the forward's
  tensor arguments, then one gradient per forward output, then the forward's other arguments by
  name, and returns one gradient per forward tensor argument.

The op's schema is read off the kernel's Python signature: parameters without a default are
tensors, parameters with a default take its type (``float eps=1e-06``); annotations, where the
kernel has them, win. ``outputs`` says how many tensors the kernel returns (default 1, or 0 when
it only writes inputs listed in ``mutates_args``); ``schema=`` gives the whole schema instead.
"""

from __future__ import annotations

import inspect
import json
import threading
from typing import Any, Callable, Iterable

import ml_dtypes
import numpy as np
import torch

from trnsim.nki import NkiError, NkiFamily, TensorSpec, as_kernel, tensor_spec

from ..eager import memory, values
from ..runtime import runtime

__all__ = ["nki_op", "NkiOpError", "family_of"]

_lock = threading.Lock()
_FAMILIES: dict[str, NkiFamily] = {}  # op name -> its kernel family


class NkiOpError(RuntimeError):
    """A call an NKI op cannot make (wrong device, a dtype NKI lacks, shapes the kernel refuses)."""


# torch dtype -> (numpy dtype the bytes are read as, the view dtype torch can export to numpy)
_TO_NUMPY: dict[torch.dtype, tuple[Any, torch.dtype]] = {
    torch.float32: (np.float32, torch.float32), torch.float16: (np.float16, torch.float16),
    torch.bfloat16: (ml_dtypes.bfloat16, torch.int16), torch.int32: (np.int32, torch.int32),
    torch.int16: (np.int16, torch.int16), torch.int8: (np.int8, torch.int8), torch.uint8: (np.uint8, torch.uint8),
    torch.bool: (np.uint8, torch.uint8), torch.float8_e4m3fn: (ml_dtypes.float8_e4m3fn, torch.uint8),
    torch.float8_e5m2: (ml_dtypes.float8_e5m2, torch.uint8),
}
# trnsim dtype name -> (torch dtype, the numpy dtype its bytes are handed to torch as, where torch
# cannot take the numpy dtype itself)
_TO_TORCH: dict[str, tuple[torch.dtype, Any]] = {
    "float32": (torch.float32, None), "float16": (torch.float16, None), "bfloat16": (torch.bfloat16, np.int16),
    "int32": (torch.int32, None), "int16": (torch.int16, None), "int8": (torch.int8, None),
    "uint8": (torch.uint8, None), "float8_e4m3fn": (torch.float8_e4m3fn, np.uint8),
    "float8_e5m2": (torch.float8_e5m2, np.uint8),
}
_DTYPES = "float32, bfloat16, float16, float8_e4m3fn, float8_e5m2, int8/16/32, uint8 or bool"


def family_of(op: Any) -> NkiFamily:
    """The :class:`~trnsim.nki.NkiFamily` behind an NKI op (its name or the op itself)."""
    name = op if isinstance(op, str) else getattr(op, "_qualname", getattr(op, "__name__", str(op)))
    return _FAMILIES[name]


# ---- schema -------------------------------------------------------------------------------------
_ANNOTATIONS = {torch.Tensor: "Tensor", float: "float", int: "int", bool: "bool", str: "str",
                "Tensor": "Tensor", "torch.Tensor": "Tensor", "float": "float", "int": "int", "bool": "bool",
                "str": "str"}


def _default_literal(v: Any) -> str:
    if isinstance(v, bool):
        return "True" if v else "False"
    if isinstance(v, str):
        return json.dumps(v)
    return repr(v)


def infer_schema(name: str, fn: Callable[..., Any], mutates_args: Iterable[str], outputs: int) -> str:
    """The schema of an NKI op from its kernel's signature (see the module docstring)."""
    sig = inspect.signature(fn)
    mutated = set(mutates_args)
    parts: list[str] = []
    kw_only = False
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise NkiOpError(f"nki_op {name}: the kernel takes *{p.name}; give the op's schema with schema=")
        if p.kind is p.KEYWORD_ONLY and not kw_only:
            parts.append("*")
            kw_only = True
        ann = _ANNOTATIONS.get(p.annotation) if p.annotation is not p.empty else None
        if ann is None and p.annotation is not p.empty:
            raise NkiOpError(f"nki_op {name}: cannot read the annotation of '{p.name}' ({p.annotation!r}); give the "
                             f"op's schema with schema=")
        if ann is None:
            if p.default is p.empty:
                ann = "Tensor"
            elif isinstance(p.default, (bool, int, float, str)):
                ann = _ANNOTATIONS[type(p.default)]
            else:
                raise NkiOpError(f"nki_op {name}: cannot tell the type of '{p.name}' from its default "
                                 f"{p.default!r}; annotate it or give the op's schema with schema=")
        if p.name in mutated:
            if ann != "Tensor":
                raise NkiOpError(f"nki_op {name}: mutates_args names '{p.name}', which is not a tensor")
            ann = "Tensor(a!)"
        text = f"{ann} {p.name}"
        if p.default is not p.empty:
            text += f"={_default_literal(p.default)}"
        parts.append(text)
    unknown = mutated - set(sig.parameters)
    if unknown:
        raise NkiOpError(f"nki_op {name}: mutates_args names '{sorted(unknown)[0]}', which the kernel does not take")
    ret = "()" if outputs == 0 else "Tensor" if outputs == 1 else "(" + ", ".join(["Tensor"] * outputs) + ")"
    return f"({', '.join(parts)}) -> {ret}"


# ---- tensors <-> arrays ---------------------------------------------------------------------------
def _array(t: torch.Tensor, what: str) -> np.ndarray:
    """A numpy array over the device memory of neuron tensor ``t`` (no copy)."""
    conv = _TO_NUMPY.get(t.dtype)
    if conv is None:
        raise NkiOpError(f"{what} is {t.dtype}; an NKI kernel takes {_DTYPES} tensors: cast it")
    npdt, view = conv
    v = memory.cpu_view(t)
    a = v.view(view).numpy() if view != t.dtype else v.numpy()
    return a.view(npdt) if a.dtype != np.dtype(npdt) else a


def _torch_dtype(name: str) -> tuple[torch.dtype, Any]:
    conv = _TO_TORCH.get(name)
    if conv is None:
        raise NkiOpError(f"an NKI kernel returns a {name} tensor, which torch has no dtype for")
    return conv


def _tensor(a: np.ndarray, index: int) -> torch.Tensor:
    """A kernel output (numpy) as a new neuron tensor (no copy)."""
    dt, raw = _torch_dtype(a.dtype.name)
    a = np.ascontiguousarray(a)
    t = torch.from_numpy(a.view(raw)).view(dt) if raw is not None else torch.from_numpy(a)
    return memory.relabel(t, index)


def _spec_of(t: torch.Tensor, what: str) -> TensorSpec:
    """A (fake) tensor as a :class:`TensorSpec` (symbolic sizes are specialised to their values)."""
    conv = _TO_NUMPY.get(t.dtype)
    if conv is None:
        raise NkiOpError(f"{what} is {t.dtype}; an NKI kernel takes {_DTYPES} tensors: cast it")
    return tensor_spec([int(n) for n in t.shape] or [1], np.dtype(conv[0]).name)


# ---- the op -------------------------------------------------------------------------------------
class _Op:
    """What one registered NKI op needs at call time."""

    def __init__(self, name: str, fam: NkiFamily, outputs: int, mutates: tuple[str, ...]):
        self.name = name
        self.family = fam
        self.outputs = outputs
        self.mutates = mutates
        self.sig = inspect.signature(fam.kernel.fn)
        self.short = name.split("::", 1)[-1]

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> inspect.BoundArguments:
        bound = self.sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound

    def split(self, bound: inspect.BoundArguments, conv: Callable[[torch.Tensor, str], Any]
              ) -> tuple[list[Any], dict[str, Any], list[torch.Tensor]]:
        """The kernel's positional/keyword arguments with tensors converted by ``conv``."""
        pos: list[Any] = []
        kw: dict[str, Any] = {}
        tensors: list[torch.Tensor] = []
        for pname, value in bound.arguments.items():
            if isinstance(value, torch.Tensor):
                tensors.append(value)
                value = conv(value, f"{self.name}: argument '{pname}'")
            elif isinstance(value, (list, tuple)) and value and all(isinstance(v, torch.Tensor) for v in value):
                tensors.extend(value)
                value = type(value)(conv(v, f"{self.name}: argument '{pname}'[{i}]") for i, v in enumerate(value))
            if self.sig.parameters[pname].kind is inspect.Parameter.KEYWORD_ONLY:
                kw[pname] = value
            else:
                pos.append(value)
        return pos, kw, tensors

    def flat(self, result: Any) -> list[Any]:
        if result is None:
            got: list[Any] = []
        elif isinstance(result, (tuple, list)):
            got = list(result)
        else:
            got = [result]
        if len(got) != self.outputs or any(isinstance(g, (tuple, list, dict)) for g in got):
            raise NkiOpError(f"{self.name}: the kernel returns {_count(result)}, but the op was registered with "
                             f"outputs={self.outputs}; register it with outputs={len(got)}")
        return got

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return values.call_traced(self.short, self._run, args, kwargs)

    def _run(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        bound = self.bind(args, kwargs)
        index = _device_index(self.name, bound)
        pos, kw, _ = self.split(bound, _array)
        rt = runtime()
        try:
            written = self.family.written(pos, kw, rt.config)
            undeclared = [p for p in written if p not in self.mutates]
            if undeclared:
                raise NkiOpError(f"{self.name}: the kernel writes its argument '{undeclared[0]}'; register the op "
                                 f"with mutates_args=('{undeclared[0]}',)")
            outs, new = self.family.values(pos, kw, rt.config)
        except NkiError as e:
            raise NkiOpError(f"{self.name}: {e}") from None
        got = self.flat(outs)
        for pname, arr in new.items():  # in-place updates, into the device memory
            dst = _array(bound.arguments[pname], pname)
            np.copyto(dst, arr.reshape(dst.shape))
        rt.charge(index, self.name, self.family.spec(pos, kw))
        res = [_tensor(a, index) for a in got]
        return None if self.outputs == 0 else res[0] if self.outputs == 1 else tuple(res)

    def fake(self, *args: Any, **kwargs: Any) -> Any:
        bound = self.bind(args, kwargs)
        pos, kw, tensors = self.split(bound, _spec_of)
        like = tensors[0]
        try:
            specs = self.family.outputs(pos, kw, runtime().config)
        except NkiError as e:
            raise NkiOpError(f"{self.name}: {e}") from None
        got = self.flat(specs)
        res = [like.new_empty(s.shape, dtype=_torch_dtype(s.dtype)[0]) for s in got]
        return None if self.outputs == 0 else res[0] if self.outputs == 1 else tuple(res)


def _count(result: Any) -> str:
    n = 0 if result is None else len(result) if isinstance(result, (tuple, list)) else 1
    return f"{n} tensor{'s' if n != 1 else ''}"


def _device_index(name: str, bound: inspect.BoundArguments) -> int:
    """The neuron device every tensor argument is on (one line naming the first that is not)."""
    index: int | None = None
    for pname, value in bound.arguments.items():
        items = value if isinstance(value, (list, tuple)) else [value]
        for v in items:
            if not isinstance(v, torch.Tensor):
                continue
            if not values.is_neuron(v):
                raise NkiOpError(f"{name}: argument '{pname}' is on {v.device}; an NKI op runs on neuron tensors "
                                 f"(move it with .to('neuron'))")
            i = v.device.index or 0
            if index is not None and i != index:
                raise NkiOpError(f"{name}: arguments are on neuron:{index} and neuron:{i}; an NKI kernel runs on one "
                                 f"NeuronCore")
            index = i
    if index is None:
        raise NkiOpError(f"{name}: no tensor argument; an NKI op needs at least one neuron tensor")
    return index


def nki_op(name: str, kernel: Any = None, *, mutates_args: Iterable[str] = (), outputs: int | None = None,
           schema: str | None = None, backward: Any = None) -> Any:
    """Register ``kernel`` (an ``@nki.jit`` kernel, optionally on a grid: ``kernel[2]``) as the
    torch custom op ``name`` (``"namespace::op"``); returns the op (a ``torch.library``
    CustomOpDef: call it, or ``torch.ops.namespace.op``). Used bare it is a decorator:
    ``@nki_op("mylib::add")`` above ``@nki.jit``. See the module docstring for the rest."""
    if kernel is None:
        return lambda k: nki_op(name, k, mutates_args=mutates_args, outputs=outputs, schema=schema, backward=backward)
    if not isinstance(name, str) or "::" not in name or not all(name.split("::", 1)):
        raise NkiOpError(f"nki_op: the op name must be 'namespace::name', got {name!r}")
    k = as_kernel(kernel)
    mutates = tuple(mutates_args)
    n_out = outputs if outputs is not None else (0 if mutates else 1)
    if isinstance(n_out, bool) or not isinstance(n_out, int) or n_out < 0:
        raise NkiOpError(f"nki_op {name}: outputs must be a count of tensors (>= 0), got {outputs!r}")
    text = schema or infer_schema(name, k.fn, mutates, n_out)
    with _lock:
        if name in _FAMILIES:
            raise NkiOpError(f"nki_op: {name} is already registered")
        fam = NkiFamily(k, name)
        _FAMILIES[name] = fam
    op = _Op(name, fam, n_out, mutates)
    custom = torch.library.custom_op(name, op, mutates_args=mutates, schema=text)
    custom.register_fake(op.fake)
    if backward is not None:
        _register_backward(custom, op, backward)
    return custom


def _register_backward(custom: Any, op: _Op, backward: Any) -> None:
    """``backward`` (an NKI kernel) as ``<name>_backward``, the derivative of ``custom``."""
    params = list(op.sig.parameters.values())
    tensor_params = [p.name for p in params if p.default is p.empty and p.kind is not p.KEYWORD_ONLY]
    const_params = [p.name for p in params if p.name not in tensor_params]
    bwd_kernel = as_kernel(backward)
    bwd_sig = inspect.signature(bwd_kernel.fn)
    n_grads = len([p for p in bwd_sig.parameters.values() if p.default is p.empty]) - len(tensor_params)
    if n_grads != max(op.outputs, 1):
        raise NkiOpError(f"nki_op {op.name}: backward kernel {bwd_kernel.fn.__name__} takes {n_grads} gradient "
                         f"argument(s) after the forward's {len(tensor_params)} tensor(s); the op has "
                         f"{op.outputs} output(s)")
    bwd = nki_op(op.name + "_backward", bwd_kernel, outputs=len(tensor_params))

    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        bound = op.bind(inputs, {})
        ctx.save_for_backward(*[bound.arguments[p] for p in tensor_params])
        ctx.consts = {p: bound.arguments[p] for p in const_params}

    def derivative(ctx: Any, *grads: Any) -> tuple[Any, ...]:
        saved = ctx.saved_tensors
        got = bwd(*saved, *[g.contiguous() for g in grads], **ctx.consts)
        got = got if isinstance(got, tuple) else (got,)
        by_name = dict(zip(tensor_params, got))
        return tuple(by_name.get(p.name) for p in params)

    custom.register_autograd(derivative, setup_context=setup_context)
