"""An NKI kernel as a kernel family of the device model: costed by name and input shapes.

A framework that calls an ``@nki.jit`` kernel as one of its ops (``torch_bridge.nki``) needs
three things of it, none of them framework-specific, which :class:`NkiFamily` gives:

* **outputs** for given input shapes and dtypes (to allocate them, and for a compiler's fake
  tensors): the kernel traced, not scheduled or simulated (:meth:`NkiFamily.outputs`);
* **values** for given arrays: the kernel's own scheduled instruction stream executed on the
  datapath (:meth:`NkiFamily.values`), the same stream and the same numbers as ``nki.run``;
* **a cost**: :meth:`NkiFamily.spec` names the call as a :class:`~trnsim.device.KernelSpec` of a
  kernel family registered in :mod:`trnsim.kernels.registry`, whose build traces and schedules the
  kernel for the spec's input shapes. So :meth:`trnsim.device.Device.cost` simulates it once per
  shapes, dtypes and compile-time arguments and caches it, as it does a library kernel, and LNC
  applies unchanged: a kernel launched on an SPMD grid of the logical core's size (``kernel[2]``
  on a trn2 LNC=2 core, as NKI launches LNC=2 kernels) runs one program on each physical core;
  any other kernel runs on one physical core.

The spec's shape is the range of grid programs a physical core runs, ``(first, end)``; its
params hold the arguments: tensors as (shape, dtype), everything else by value (compile-time
arguments must be hashable: numbers, strings, bools, None, tuples of them).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Mapping, Sequence

import numpy as np

from ..sim.chip import Chip
from ..config import ChipConfig
from ..device import KernelSpec
from ..builder.kernel import Kernel as BuilderKernel
from ..kernels.registry import register_family
from ..native.dtypes import get_dtype
from ._core import NkiError
from ._jit import JitKernel, TensorSpec, Traced, as_kernel, target_config, restructure

__all__ = ["NkiFamily", "family", "FAMILY_PREFIX"]

#: kernel family names are ``nki:<name>``: never a library kernel's
FAMILY_PREFIX = "nki:"
_TRACE_CACHE = 64  # traced + scheduled kernels kept per family (one per input signature)


def _encode(value: Any, what: str) -> Any:
    """One argument as spec metadata: a tensor as ("T", shape, dtype), a sequence of tensors
    element by element, anything else by value (it must be hashable)."""
    if isinstance(value, TensorSpec):
        return ("T", value.shape, value.dtype)
    if isinstance(value, np.ndarray):
        shape = value.shape if value.ndim else (1,)
        dt = np.uint8 if value.dtype.kind == "b" else value.dtype
        try:
            name = get_dtype(dt).name
        except ValueError:
            raise NkiError(f"{what} is a {value.dtype} array; NKI tensors are float32, bfloat16, float16, fp8, "
                           f"int8/16/32 or uint8/32: cast it") from None
        return ("T", tuple(int(n) for n in shape), name)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, (np.ndarray, TensorSpec)) for v in value):
        return ("L", type(value).__name__, tuple(_encode(v, f"{what}[{i}]") for i, v in enumerate(value)))
    try:
        hash(value)
    except TypeError:
        raise NkiError(f"{what} = {type(value).__name__}: a compile-time argument of an NKI op must be hashable "
                       f"(a number, string, bool, None or a tuple of them)") from None
    return ("C", value)


def _decode(enc: Any) -> Any:
    """A spec's argument back as a trace argument (tensors as :class:`TensorSpec`)."""
    tag = enc[0]
    if tag == "T":
        return TensorSpec(tuple(enc[1]), enc[2])
    if tag == "L":
        items = [_decode(e) for e in enc[2]]
        return tuple(items) if enc[1] == "tuple" else items
    return enc[1]


def _flat_arrays(value: Any, path: tuple[Any, ...], out: dict[tuple[Any, ...], Any]) -> None:
    if isinstance(value, (np.ndarray, TensorSpec)):
        out[path] = value
    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, (np.ndarray, TensorSpec)) for v in value):
        for i, v in enumerate(value):
            out[path + (i,)] = v


class _Entry:
    """A traced, scheduled kernel for one input signature, and where each argument's array goes."""

    def __init__(self, traced: Traced, names: dict[tuple[Any, ...], str]):
        self.traced = traced
        self.names = names  # argument path -> kernel input name


class NkiFamily:
    """``kernel`` (an ``@nki.jit`` kernel or function, possibly launched on a grid) as the
    kernel family ``nki:<name>`` of the device model. See the module docstring."""

    def __init__(self, kernel: Any, name: str):
        self.kernel: JitKernel = as_kernel(kernel)
        self.name = name
        self.family = FAMILY_PREFIX + name
        self.label = f"nki:{getattr(self.kernel.fn, '__name__', name)}"
        self._traces: OrderedDict[tuple[Any, ...], _Entry] = OrderedDict()
        self._outputs: dict[tuple[Any, ...], Any] = {}
        self._chips: dict[str, Chip] = {}
        self._lock = threading.Lock()
        register_family(self.family, self._build, self._split)

    def __repr__(self) -> str:
        return f"NkiFamily({self.name!r}, {self.kernel!r})"

    # ---- metadata ----------------------------------------------------------------------------
    def signature(self, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> tuple[Any, ...]:
        """The call's metadata (tensors by shape and dtype, other arguments by value): what its
        outputs, cost and instruction stream depend on."""
        kwargs = kwargs or {}
        return (tuple(_encode(a, f"{self.name}: argument {i}") for i, a in enumerate(args)),
                tuple(sorted((k, _encode(v, f"{self.name}: argument '{k}'")) for k, v in kwargs.items())))

    def spec(self, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None) -> KernelSpec:
        """The device model's name for one call: build, split over LNC and cache it by this."""
        enc_args, enc_kwargs = self.signature(args, kwargs)
        dtypes = [e[2] for e in enc_args if e[0] == "T"] + [e[2] for _, e in enc_kwargs if e[0] == "T"]
        dtype = get_dtype(dtypes[0]).short if dtypes else "fp32"
        return KernelSpec.of(self.family, (0, len(self.kernel.programs())), dtype,
                             {"args": enc_args, "kwargs": enc_kwargs}, label=self.label)

    def outputs(self, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None,
                config: ChipConfig | str | None = None) -> Any:
        """The kernel's outputs for these arguments as :class:`TensorSpec`, in the structure the
        kernel returns them (None if it returns nothing); traced once per signature."""
        cfg = target_config(config)
        key = (self.signature(args, kwargs), cfg.name)
        hit = self._outputs.get(key)
        if hit is None:
            enc_args, enc_kwargs = key[0]
            hit = self.kernel.output_specs(*[_decode(a) for a in enc_args], config=cfg,
                                           **{k: _decode(v) for k, v in enc_kwargs})
            self._outputs[key] = hit
        return hit

    def written(self, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None,
                config: ChipConfig | str | None = None) -> list[str]:
        """The kernel parameters whose tensors the kernel writes (in place), for these arguments."""
        return sorted(self._entry(args, kwargs, config).traced.written_inputs)

    # ---- values ------------------------------------------------------------------------------
    def _entry(self, args: Sequence[Any], kwargs: Mapping[str, Any] | None, config: Any) -> _Entry:
        cfg = target_config(config)
        key = (self.signature(args, kwargs), cfg.name)
        with self._lock:
            hit = self._traces.get(key)
            if hit is not None:
                self._traces.move_to_end(key)
                return hit
        enc_args, enc_kwargs = key[0]
        targs = [_decode(a) for a in enc_args]
        tkwargs = {k: _decode(v) for k, v in enc_kwargs}
        traced = self.kernel.trace(*targs, config=cfg, **tkwargs)
        # which kernel input each argument's array became: the trace keeps the very TensorSpec
        by_id = {id(v): n for n, v in traced.inputs.items() if isinstance(v, TensorSpec)}
        paths: dict[tuple[Any, ...], Any] = {}
        for i, a in enumerate(targs):
            _flat_arrays(a, ("a", i), paths)
        for k, v in tkwargs.items():
            _flat_arrays(v, ("k", k), paths)
        names = {p: by_id[id(v)] for p, v in paths.items() if id(v) in by_id}
        entry = _Entry(traced, names)
        with self._lock:
            self._traces[key] = entry
            while len(self._traces) > _TRACE_CACHE:
                self._traces.popitem(last=False)
        return entry

    def values(self, args: Sequence[Any], kwargs: Mapping[str, Any] | None = None,
               config: ChipConfig | str | None = None) -> tuple[Any, dict[str, np.ndarray]]:
        """Run the kernel on these arrays for values only (no timing): its outputs, in the
        structure it returns them, and the new values of the inputs it writes, by parameter
        name (the caller's arrays are not touched)."""
        kwargs = kwargs or {}
        entry = self._entry(args, kwargs, config)
        t = entry.traced
        arrays: dict[tuple[Any, ...], Any] = {}
        for i, a in enumerate(args):
            _flat_arrays(a, ("a", i), arrays)
        for k, v in kwargs.items():
            _flat_arrays(v, ("k", k), arrays)
        inputs = {n: v for n, v in t.inputs.items() if not isinstance(v, TensorSpec)}  # nl.shared_constant
        for path, name in entry.names.items():
            arr = np.asarray(arrays[path])
            if arr.dtype.kind == "b":
                arr = arr.astype(np.uint8)
            inputs[name] = arr.reshape(t.kernel.tensors[name].shape)
        chip = self._chips.get(t.config.name)
        if chip is None:
            chip = self._chips[t.config.name] = Chip(t.config)
        result = chip.execute(t.kernel, inputs)
        return restructure(t.outputs, result), {p: result[p] for p in t.written_inputs}

    # ---- the device model's build and split --------------------------------------------------
    def _build(self, first: int, end: int, dtype: str = "fp32", config: ChipConfig | str = "trn2",
               args: tuple[Any, ...] = (), kwargs: tuple[tuple[str, Any], ...] = ()) -> BuilderKernel:
        """The scheduled kernel of grid programs ``first..end-1`` for the spec's arguments."""
        programs = None if (first, end) == (0, len(self.kernel.programs())) else range(first, end)
        traced = self.kernel.trace(*[_decode(a) for a in args], config=config, programs=programs,
                                   **{k: _decode(v) for k, v in kwargs})
        return traced.kernel

    def _split(self, shape: tuple[int, ...], params: Mapping[str, Any], n: int) -> list[tuple[int, ...]] | None:
        """A grid of exactly ``n`` programs (NKI's LNC launch, ``kernel[2]``) runs one program
        per physical core; any other kernel runs on one physical core."""
        first, end = shape
        if self.kernel.grid == (n,) and end - first == n:
            return [(i, i + 1) for i in range(first, end)]
        return None


def family(kernel: Any, name: str) -> NkiFamily:
    """``kernel`` as the device-model kernel family ``nki:<name>`` (see :class:`NkiFamily`)."""
    return NkiFamily(kernel, name)
