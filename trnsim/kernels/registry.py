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

User kernels (``trnsim kernel path.py:fn``) follow the same calling convention as ``build`` and
need nothing else; the CLI then runs them timing-only.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from ..config import ChipConfig, load_config
from ..isa import KernelError
from ..kernel import Kernel
from ..native.dtypes import get_dtype

__all__ = [
    "KernelEntry",
    "register_kernel",
    "get_kernel",
    "kernel_names",
    "parse_shape",
    "parse_params",
    "call_build",
    "round_to",
    "check_entry",
    "KERNELS",
]

InputsFn = Callable[[tuple[int, ...], str, Mapping[str, Any], np.random.Generator], dict[str, np.ndarray]]
ReferenceFn = Callable[[Mapping[str, np.ndarray], tuple[int, ...], str, Mapping[str, Any]], dict[str, np.ndarray]]

_DEFAULT_TOL = {"float32": (1e-5, 1e-5), "bfloat16": (2e-2, 2e-2), "float16": (4e-3, 4e-3)}


def default_tolerance(dtype: str) -> tuple[float, float]:
    name = get_dtype(dtype).name
    return _DEFAULT_TOL.get(name, (1.5e-1, 1.5e-1))  # fp8 and friends


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
                    tolerance: Callable[[str], tuple[float, float]] | None = None
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
            tolerance=tolerance or default_tolerance,
        )
        return build

    return deco


def _load_all() -> None:
    from . import library  # noqa: F401  (importing registers every built-in kernel)


def get_kernel(name: str) -> KernelEntry:
    _load_all()
    try:
        return KERNELS[name]
    except KeyError:
        raise KernelError(f"unknown kernel '{name}'; expected one of {', '.join(sorted(KERNELS))} "
                          f"or path/to/file.py:function") from None


def kernel_names() -> list[str]:
    _load_all()
    return sorted(KERNELS)


def parse_shape(text: str) -> tuple[int, ...]:
    """``"4096x4096x4096"`` -> ``(4096, 4096, 4096)``; dims are positive integers."""
    parts = str(text).lower().replace("×", "x").split("x")
    try:
        dims = tuple(int(p) for p in parts)
    except ValueError:
        dims = ()
    if not dims or any(d <= 0 for d in dims):
        raise KernelError(f"--shape {text!r}: expected positive integers joined by 'x', e.g. 4096x4096x4096")
    return dims


def _parse_value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    for conv in (int, float):
        try:
            return conv(text)
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
            raise KernelError(f"--param {item!r}: expected NAME=VALUE, e.g. transpose_a=true")
        value = _parse_value(val.strip())
        if allowed is not None:
            if key not in allowed:
                names = ", ".join(sorted(allowed)) or "none"
                raise KernelError(f"{what}: unknown parameter '{key}'; it takes: {names}")
            default = allowed[key]
            if isinstance(default, bool) and not isinstance(value, bool):
                raise KernelError(f"{what}: parameter '{key}' expects true or false, got {val!r}")
            if isinstance(default, int) and not isinstance(default, bool) and (
                    isinstance(value, bool) or not isinstance(value, int)):
                raise KernelError(f"{what}: parameter '{key}' expects an integer, got {val!r}")
            if isinstance(default, float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise KernelError(f"{what}: parameter '{key}' expects a number, got {val!r}")
            if isinstance(default, str) and not isinstance(value, str):
                value = val.strip()
        out[key] = value
    return out


def call_build(fn: Callable[..., Kernel], shape: tuple[int, ...], dtype: str | None, config: ChipConfig,
               params: Mapping[str, Any], what: str) -> Kernel:
    """Call a build function with the library's convention, passing ``dtype``/``config`` only if
    it takes them (a user's ``build_softmax(rows, cols, config)`` works as is)."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        sig = None
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
                              f"{'x'.join(map(str, shape))}: {e}") from None
    kernel = fn(*shape, **kwargs)
    if not isinstance(kernel, Kernel):
        raise KernelError(f"{what}: {getattr(fn, '__name__', fn)} returned {type(kernel).__name__}, "
                          f"expected a trnsim.Kernel")
    return kernel


def round_to(x: np.ndarray, dtype: str) -> np.ndarray:
    """``x`` rounded to ``dtype`` (RNE) and widened back to float64: what a kernel's input holds."""
    from ..native import convert

    dt = get_dtype(dtype)
    if not dt.is_float:
        return np.asarray(x).astype(dt.np_dtype).astype(np.float64)
    return np.asarray(convert(np.asarray(x, dtype=np.float32), dt.name)).astype(np.float64)


def check_entry(entry: KernelEntry, shape: tuple[int, ...], dtype: str, config: ChipConfig | str = "trn2",
                params: Mapping[str, Any] | None = None, seed: int = 0, schedule: bool = False) -> dict[str, Any]:
    """Run ``entry`` with values and compare every output with its reference (list-scheduled
    first with ``schedule``, :mod:`trnsim.schedule`).

    Returns ``{"report": KernelReport, "errors": {output: max abs error / max |ref|}, "ok": bool}``.
    """
    from ..chip import Chip

    cfg = load_config(config)
    merged = {**entry.params, **(params or {})}
    if entry.inputs is None or entry.reference is None:
        raise KernelError(f"kernel '{entry.name}' has no reference to check against")
    kernel = entry.make(shape, dtype, cfg, merged)
    if schedule:
        from ..schedule import schedule as schedule_pass

        kernel = schedule_pass(kernel)
    inputs = entry.inputs(shape, dtype, merged, np.random.default_rng(seed))
    result = Chip(cfg).run(kernel, inputs)
    ref = entry.reference(inputs, shape, dtype, merged)
    rtol, atol = entry.tolerance(dtype)
    errors: dict[str, float] = {}
    ok = True
    for name, want in ref.items():
        got = np.asarray(result[name], dtype=np.float64)
        want = np.asarray(want, dtype=np.float64)
        if got.shape != want.shape:
            raise KernelError(f"kernel '{entry.name}': output '{name}' has shape {got.shape}, reference {want.shape}")
        scale = float(np.max(np.abs(want))) if want.size else 0.0
        diff = np.abs(got - want)
        err = float(np.max(diff)) / scale if scale and diff.size else float(np.max(diff, initial=0.0))
        errors[name] = err
        if not np.all(np.isfinite(got)) or np.any(diff > atol * max(scale, 1.0) + rtol * np.abs(want)):
            ok = False
    return {"report": result.report, "errors": errors, "ok": ok}
