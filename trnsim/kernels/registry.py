"""The kernel library's registry: what `trnsim kernel --list` shows and `trnsim kernel NAME` runs.

A library kernel is a build function written with the public builder, plus what the CLI and the
tests need to drive it without knowing it:

* ``build(*dims, dtype=..., config=..., **params) -> Kernel`` — the shape's dims come first, in
  the order of ``dims``; extra keyword parameters have defaults listed in ``params``;
* ``inputs(shape, dtype, params, rng) -> {input name: float32/int array}`` — random inputs for a
  value check (the kernel rounds them to its input dtypes);
* ``reference(inputs, shape, dtype, params) -> {output name: array}`` — the expected outputs,
  computed with numpy (float64 where that matters) from the *rounded* inputs the kernel saw;
* ``tolerance(dtype) -> (rtol, atol)`` — how close outputs must be, relative to the largest
  reference magnitude.

* ``split(shape, params, n) -> [shape, ...] | None`` - how the kernel's work is shared out over
  the ``n`` physical cores of a logical core (LNC=2): each part is the shape one core runs, as an
  SPMD kernel splits it (None, or no rule: the kernel runs on one core); a part may be a
  ``(shape, params)`` pair when the cores run different shares of the same shape
  (:func:`split_parts`).

User kernels (``trnsim kernel path.py:fn``) follow the same calling convention as ``build`` and
need nothing else; the CLI then runs them timing-only. Importing :mod:`trnsim.kernels` registers
every built-in kernel; this module only holds the table.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from ..config import ChipConfig, clip_text, load_config
from ..isa import KernelError
from ..builder.kernel import Kernel, gc_paused
from ..native.dtypes import get_dtype
from .generic import STREAM, build_stream, split_stream
from .reference import default_tolerance

__all__ = [
    "KernelEntry",
    "register_kernel",
    "get_kernel",
    "kernel_names",
    "parse_shape",
    "parse_params",
    "call_build",
    "split_dims",
    "build_spec",
    "split_spec",
    "split_parts",
    "checked_dtype",
    "checked_dims",
    "KERNELS",
    "KernelFamily",
    "FAMILIES",
    "register_family",
]

InputsFn = Callable[[tuple[int, ...], str, Mapping[str, Any], np.random.Generator], dict[str, np.ndarray]]
ReferenceFn = Callable[[Mapping[str, np.ndarray], tuple[int, ...], str, Mapping[str, Any]], dict[str, np.ndarray]]
SplitFn = Callable[[tuple[int, ...], Mapping[str, Any], int], "list[tuple[int, ...]] | None"]


def _parts(d: int, n: int) -> list[int]:
    q, r = divmod(d, n)
    return [q + 1] * r + [q] * (n - r)


def split_dims(*candidates: int) -> SplitFn:
    """A split rule: the first of the ``candidates`` dims (by index) that has at least ``n``
    elements is cut into ``n`` near-equal parts."""
    def split(shape: tuple[int, ...], params: Mapping[str, Any], n: int) -> list[tuple[int, ...]] | None:
        for i in candidates:
            if shape[i] >= n:
                return [shape[:i] + (p,) + shape[i + 1:] for p in _parts(shape[i], n)]
        return None
    return split


@dataclass(frozen=True)
class KernelEntry:
    name: str
    build: Callable[..., Kernel]
    dims: tuple[str, ...]
    dtypes: tuple[str, ...]
    default_shape: tuple[int, ...]
    default_dtype: str
    summary: str
    params: Mapping[str, Any] = field(default_factory=dict)
    inputs: InputsFn | None = None
    reference: ReferenceFn | None = None
    tolerance: Callable[[str], tuple[float, float]] = default_tolerance
    split: SplitFn | None = None

    @property
    def shape_doc(self) -> str:
        return "x".join(self.dims)

    def make(self, shape: tuple[int, ...], dtype: str, config: ChipConfig, params: Mapping[str, Any] | None = None
             ) -> Kernel:
        """Build the kernel for ``shape``/``dtype`` on ``config``, checking shape arity and dtype."""
        if len(shape) != len(self.dims):
            raise KernelError(f"kernel '{self.name}': --shape needs {len(self.dims)} dims {self.shape_doc}, "
                              f"got {'x'.join(map(str, shape))}")
        if get_dtype(dtype).short not in self.dtypes:
            raise KernelError(f"kernel '{self.name}': dtype {dtype} not supported; expected one of "
                              f"{', '.join(self.dtypes)}")
        merged = {**self.params, **(params or {})}
        return call_build(self.build, shape, dtype, config, merged, what=f"kernel '{self.name}'")


KERNELS: dict[str, KernelEntry] = {}


def register_kernel(name: str, *, dims: str, dtypes: tuple[str, ...] | list[str], default_shape: tuple[int, ...],
                    summary: str, default_dtype: str | None = None, params: Mapping[str, Any] | None = None,
                    inputs: InputsFn | None = None, reference: ReferenceFn | None = None,
                    tolerance: Callable[[str], tuple[float, float]] | None = None, split: SplitFn | None = None
                    ) -> Callable[[Callable[..., Kernel]], Callable[..., Kernel]]:
    """Decorator: register ``build`` under ``name``. ``dims`` is written like the CLI's shape,
    e.g. ``"MxKxN"``; ``dtypes`` are short names (``"bf16"``)."""
    dim_names = tuple(dims.split("x"))
    if len(dim_names) != len(default_shape):
        raise ValueError(f"kernel '{name}': default_shape {default_shape} does not match dims {dims}")
    dts = tuple(get_dtype(d).short for d in dtypes)

    def deco(build: Callable[..., Kernel]) -> Callable[..., Kernel]:
        if name in KERNELS:
            raise ValueError(f"kernel '{name}' registered twice")
        KERNELS[name] = KernelEntry(
            name=name, build=build, dims=dim_names, dtypes=dts, default_shape=tuple(default_shape),
            default_dtype=get_dtype(default_dtype).short if default_dtype else dts[0],
            summary=summary, params=dict(params or {}), inputs=inputs, reference=reference,
            tolerance=tolerance or default_tolerance, split=split,
        )
        return build

    return deco


@dataclass(frozen=True)
class KernelFamily:
    """A kernel the device model builds by name that is not in the library table: an NKI kernel
    registered as a framework op (:mod:`trnsim.nki.family`). ``build`` and ``split`` follow the
    library's conventions; a family has no CLI entry and no reference (its values are its own)."""

    name: str
    build: Callable[..., Kernel]
    split: SplitFn | None = None


#: families registered at run time, by name (never the name of a library kernel)
FAMILIES: dict[str, KernelFamily] = {}


def register_family(name: str, build: Callable[..., Kernel], split: SplitFn | None = None) -> KernelFamily:
    """Register ``build`` as kernel family ``name`` for :func:`build_spec`/:func:`split_spec`.
    Registering the same build again is a no-op; another build under a taken name is an error
    (costs are cached by name, so a second kernel under it would be charged the first one's)."""
    if name in KERNELS or name == STREAM:
        raise ValueError(f"kernel family '{name}': the name is a library kernel's")
    old = FAMILIES.get(name)
    if old is not None:
        if old.build is not build:
            raise ValueError(f"kernel family '{name}' is already registered with another kernel")
        return old
    fam = FAMILIES[name] = KernelFamily(name, build, split)
    return fam


def get_kernel(name: str) -> KernelEntry:
    try:
        return KERNELS[name]
    except KeyError:
        raise KernelError(f"unknown kernel '{clip_text(name)}'; expected one of {', '.join(sorted(KERNELS))} "
                          f"or path/to/file.py:function") from None


def kernel_names() -> list[str]:
    return sorted(KERNELS)


def build_spec(kernel: str, shape: tuple[int, ...], dtype: str, config: ChipConfig, params: Mapping[str, Any]
               ) -> Kernel:
    """Build kernel ``kernel`` (a registry name, a registered family, or the generic ``stream``)
    for one core."""
    if kernel == STREAM:
        return build_stream(*shape, dtype=dtype, config=config, **params)
    fam = FAMILIES.get(kernel)
    if fam is not None:
        return call_build(fam.build, shape, dtype, config, params, what=f"kernel '{kernel}'")
    return get_kernel(kernel).make(shape, dtype, config, params)


def split_spec(kernel: str, shape: tuple[int, ...], params: Mapping[str, Any], n: int) -> list[tuple[int, ...]]:
    """The shapes ``kernel``'s work takes on each of ``n`` physical cores (one shape: one core)."""
    return [s for s, _ in split_parts(kernel, shape, params, n)]


def split_parts(kernel: str, shape: tuple[int, ...], params: Mapping[str, Any], n: int
                ) -> list[tuple[tuple[int, ...], dict[str, Any]]]:
    """What each of ``n`` physical cores runs of ``kernel``: (shape, parameters that differ from
    ``params``). A split rule returns shapes, or (shape, parameters) pairs where the cores run
    different shares of one output (a column range: ``shard="0/2"``), which a shape alone cannot
    say."""
    if n <= 1:
        return [(shape, {})]
    if kernel == STREAM:
        return [(s, {}) for s in split_stream(shape, n) or [shape]]
    fam = FAMILIES.get(kernel)
    if fam is not None:
        parts = fam.split(shape, params, n) if fam.split is not None else None
    else:
        entry = get_kernel(kernel)
        parts = entry.split(shape, {**entry.params, **params}, n) if entry.split is not None else None
    out: list[tuple[tuple[int, ...], dict[str, Any]]] = []
    for part in parts or [shape]:
        if len(part) == 2 and isinstance(part[0], tuple) and isinstance(part[1], Mapping):
            out.append((tuple(part[0]), dict(part[1])))
        else:
            out.append((tuple(part), {}))  # type: ignore[arg-type]
    return out


def checked_dtype(name: str, dtype: str, allowed: tuple[str, ...]) -> Any:
    """The :class:`~trnsim.native.dtypes.Dtype` a build function was given, or a KernelError
    naming the kernel and the dtypes it takes."""
    try:
        dt = get_dtype(dtype)
    except ValueError as e:
        raise KernelError(f"{name}: {e}") from None
    if dt.short not in allowed:
        raise KernelError(f"{name}: dtype {dt.short} not supported; expected one of {', '.join(allowed)}")
    return dt


def checked_dims(name: str, **dims: Any) -> None:
    """Every named dim a positive integer, or a KernelError naming the first one that is not."""
    for nm, v in dims.items():
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise KernelError(f"{name}: {nm} must be a positive integer, got {v!r}")


def parse_shape(text: str) -> tuple[int, ...]:
    """``"4096x4096x4096"`` -> ``(4096, 4096, 4096)``; dims are positive integers."""
    text = str(text)
    parts = text.lower().replace("×", "x").split("x") if len(text) <= 200 else []
    try:
        # at most 18 digits: a dim is a count of elements, and int() of 5,000 digits is an error
        dims = tuple(int(p) if len(p.strip()) <= 18 else 0 for p in parts)
    except ValueError:
        dims = ()
    if not dims or len(dims) > 8 or any(d <= 0 for d in dims):
        raise KernelError(f"--shape {clip_text(text, quoted=True)}: expected positive integers joined by 'x', "
                          f"e.g. 4096x4096x4096")
    return dims


def _parse_value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    for conv in (int, float):
        try:
            return conv(text) if len(text) <= 64 else text  # int() of 5,000 digits is a ValueError
        except ValueError:
            pass
    return text


def parse_params(items: list[str] | None, allowed: Mapping[str, Any] | None = None, what: str = "kernel"
                 ) -> dict[str, Any]:
    """``["transpose_a=true", "bufs=3"]`` -> ``{"transpose_a": True, "bufs": 3}``. With ``allowed``
    (the kernel's parameter defaults), unknown names and values of the wrong type are errors."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, val = str(item).partition("=")
        key = key.strip()
        if not sep or not key:
            raise KernelError(f"--param {clip_text(item, quoted=True)}: expected NAME=VALUE, e.g. transpose_a=true")
        value = _parse_value(val.strip())
        shown = clip_text(val, quoted=True)
        if isinstance(value, float) and not math.isfinite(value):
            raise KernelError(f"{what}: parameter '{clip_text(key)}' = {shown}: expected a finite number")
        if allowed is not None:
            if key not in allowed:
                names = ", ".join(sorted(allowed)) or "none"
                raise KernelError(f"{what}: unknown parameter '{clip_text(key)}'; it takes: {names}")
            default = allowed[key]
            if isinstance(default, bool) and not isinstance(value, bool):
                raise KernelError(f"{what}: parameter '{key}' expects true or false, got {shown}")
            if isinstance(default, int) and not isinstance(default, bool) and (
                    isinstance(value, bool) or not isinstance(value, int)):
                raise KernelError(f"{what}: parameter '{key}' expects an integer, got {shown}")
            if isinstance(default, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise KernelError(f"{what}: parameter '{key}' expects a number, got {shown}")
            if isinstance(default, str) and not isinstance(value, str):
                value = val.strip()
        out[key] = value
    return out


_SIGNATURES: dict[Any, Any] = {}  # build function -> its signature (None: it has none)


def _signature(fn: Callable[..., Kernel]) -> inspect.Signature | None:
    """``inspect.signature(fn)``, worked out once per function (a device builds thousands of
    small kernels; reading a signature costs as much as building a small one's stream)."""
    try:
        return _SIGNATURES[fn]
    except (KeyError, TypeError):
        pass
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
    try:
        _SIGNATURES[fn] = sig
    except TypeError:  # an unhashable callable: ask again next time
        pass
    return sig


def call_build(fn: Callable[..., Kernel], shape: tuple[int, ...], dtype: str | None, config: ChipConfig,
               params: Mapping[str, Any], what: str) -> Kernel:
    """Call a build function with the library's convention, passing ``dtype``/``config`` only if
    it takes them (a user's ``build_softmax(rows, cols, config)`` works as is)."""
    sig = _signature(fn)
    kwargs: dict[str, Any] = dict(params)
    takes_var_kw = sig is None or any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values())
    names = set() if sig is None else set(sig.parameters)
    if "config" in names or takes_var_kw:
        kwargs["config"] = config
    if dtype is not None and ("dtype" in names or takes_var_kw):
        kwargs["dtype"] = dtype
    if sig is not None:
        try:
            sig.bind(*shape, **kwargs)
        except TypeError as e:
            raise KernelError(f"{what}: cannot call {getattr(fn, '__name__', fn)}{sig} with shape "
                              f"{'x'.join(map(str, shape))}: {clip_text(e, 200)}") from None
    with gc_paused():
        kernel = fn(*shape, **kwargs)
    if not isinstance(kernel, Kernel):
        raise KernelError(f"{what}: {getattr(fn, '__name__', fn)} returned {type(kernel).__name__}, "
                          f"expected a trnsim.Kernel")
    return kernel
