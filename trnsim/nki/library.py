"""The NKI library's transformer kernels as ``trnsim.nki`` kernels: what ``nkilib.core`` gives an
NKI file, run on the virtual chip with the instruction streams of
:mod:`trnsim.kernels.transformer` (the same kernels ``trnsim kernel NAME`` runs and checks)::

    import trnsim.nki as nki
    from trnsim.nki import library as nkilib

    attn = nkilib.kernel("attention_tkg", window=4096)       # fixed compile-time parameters
    out = attn(q, k, v, k_cache, v_cache, pos)                  # numpy in, numpy out
    r = nki.run(attn, q, k, v, k_cache, v_cache, pos)           # and the cycle report
    op = torch_bridge.nki.nki_op("nkilib::attention_tkg", attn[2], outputs=1)   # a torch op, LNC=2

A library kernel takes its tensors positionally, by the names the library kernel gives them
(``signature(kernel)``; which ones depends on the parameters: ``rope=True`` adds ``cos``, ``sin``);
its shape is read off the tensors (and, where the tensors leave it open, off the parameters:
``qkv`` and ``mlp`` take ``seq_len``, ``qkv`` ``num_q_heads`` / ``num_kv_heads``). A launch on a grid
of the logical core's size (``kernel[2]`` on trn2) runs one physical core's share per program,
as the library kernel's LNC=2 split gives it: the device model (torch ops, estimates) costs the
cores that way; ``nki.run`` runs the whole kernel on one core.

The kernels are whole library kernels, not building blocks: called inside another ``@nki.jit``
kernel (on its tiles) they are refused in one line.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from ..config import ChipConfig
from ..kernels.registry import build_spec, get_kernel, split_parts
from ..native.dtypes import get_dtype
from ._core import NkiError, NkiTensor
from ._jit import JitKernel, TensorSpec, Traced, target_config, tensor_spec

__all__ = ["kernel", "signature", "LibraryKernel", "KERNELS"]


def _t(a: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in a.shape)


def _qkv_shape(a: Mapping[str, Any], p: Mapping[str, Any]) -> tuple[int, ...]:
    t, h = _t(a["x"])
    n = _t(a["w_qkv"])[1]
    nq, nkv = int(p["num_q_heads"]), int(p["num_kv_heads"])
    s = int(p.get("seq_len") or t)
    return (t // s, s, h, nq, nkv, n // (nq + 2 * nkv))


def _mlp_shape(a: Mapping[str, Any], p: Mapping[str, Any]) -> tuple[int, ...]:
    t, h = _t(a["x"])
    s = int(p.get("seq_len") or t)
    return (t // s, s, h, _t(a["w_up"])[1])


#: library kernel -> (its shape from the tensors and parameters, parameters that are not the
#: registry kernel's own, a small shape to learn its tensors' names from)
KERNELS: dict[str, tuple[Callable[[Mapping[str, Any], Mapping[str, Any]], tuple[int, ...]], tuple[str, ...],
                         tuple[int, ...]]] = {
    "qkv": (_qkv_shape, ("num_q_heads", "num_kv_heads", "seq_len"), (1, 1, 256, 2, 1, 64)),
    "attention_tkg": (lambda a, p: _t(a["q"])[:2] + (_t(a["k"])[1], _t(a["q"])[2], _t(a["v_cache"])[2],
                                                     _t(a["q"])[3]), (), (1, 2, 1, 1, 128, 64)),
    "attention_cte": (lambda a, p: _t(a["q"])[:2] + (_t(a["k"])[1],) + _t(a["q"])[2:], (), (1, 2, 1, 128, 64)),
    "mlp": (_mlp_shape, ("seq_len",), (1, 1, 256, 256)),
    "oproj": (lambda a, p: _t(a["attn"])[:1] + (_t(a["attn"])[2], _t(a["attn"])[1], _t(a["attn"])[3],
                                                _t(a["w_o"])[1]), (), (1, 1, 2, 64, 256)),
    "rope": (lambda a, p: _t(a["x"]), (), (1, 2, 4, 64)),
    "router_topk": (lambda a, p: _t(a["x"]) + (_t(a["w_router"])[1],), (), (2, 256, 16)),
    "moe_tkg": (lambda a, p: _t(a["x"]) + (_t(a["w_up"])[2], _t(a["w_up"])[0]), (), (2, 256, 256, 8)),
}


def _names(name: str, params: Mapping[str, Any]) -> tuple[list[str], list[str], list[str]]:
    """(inputs, outputs, inputs the kernel writes) of library kernel ``name`` under ``params``,
    from a build at a small shape (which tensors a kernel has depends on its parameters only)."""
    shape = KERNELS[name][2]
    k = get_kernel(name).make(shape, "bf16", target_config(None), dict(params))
    ins = [n for n, t in k.tensors.items() if t.kind in ("input", "inout")]
    outs = [n for n, t in k.tensors.items() if t.kind in ("output", "inout")]
    return ins, outs, [n for n, t in k.tensors.items() if t.kind == "inout"]


class LibraryKernel(JitKernel):
    """Library kernel ``name`` with fixed parameters, as an ``@nki.jit`` kernel (see the module
    docstring): tracing it builds the library kernel for the tensors' shapes, unscheduled (it is
    scheduled by hand), so it runs the very instruction stream ``trnsim kernel`` runs."""

    def __init__(self, name: str, params: Mapping[str, Any], *, grid: tuple[int, ...] = (), config: Any = None):
        if name not in KERNELS:
            raise NkiError(f"nkilib: unknown kernel {name!r}; expected one of {', '.join(sorted(KERNELS))}")
        own = KERNELS[name][1]
        entry = get_kernel(name)
        unknown = set(params) - set(entry.params) - set(own)
        if unknown:
            raise NkiError(f"nkilib.{name}: unknown parameter '{sorted(unknown)[0]}'; it takes: "
                           f"{', '.join(sorted(set(entry.params) | set(own)))}")
        self.lib_name = name
        self.lib_params = dict(params)
        self.kernel_params = {k: v for k, v in params.items() if k not in own}
        try:
            self.in_names, self.out_names, self.written = _names(name, self.kernel_params)
        except Exception as e:  # a parameter the kernel refuses: its one line
            raise NkiError(f"nkilib.{name}: {e}") from None

        def fn(*args: Any) -> Any:
            raise NkiError(f"nkilib.{name} is a whole library kernel: call it on arrays (or run it with "
                           f"nki.run), not inside another nki.jit kernel")

        fn.__name__ = name
        fn.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
            [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in self.in_names])
        super().__init__(fn, grid=grid, schedule=False, config=config)

    def __repr__(self) -> str:
        return f"nkilib.{self.lib_name}({self.lib_params}){list(self.grid) if self.grid else ''}"

    def __getitem__(self, grid: Any) -> "LibraryKernel":
        g = grid if isinstance(grid, tuple) else (grid,)
        if len(g) != 1 or isinstance(g[0], bool) or not isinstance(g[0], (int, np.integer)) or g[0] < 1:
            raise NkiError(f"nkilib.{self.lib_name}[{grid}]: a library kernel launches on a 1-D grid (LNC)")
        return LibraryKernel(self.lib_name, self.lib_params, grid=(int(g[0]),), config=self.config)

    def _bind_arrays(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        try:
            bound = inspect.signature(self.fn).bind(*args, **kwargs)
        except TypeError as e:
            raise NkiError(f"nkilib.{self.lib_name}: {e}; it takes ({', '.join(self.in_names)})") from None
        out = {}
        for n, v in bound.arguments.items():
            if isinstance(v, NkiTensor):
                self.fn(v)  # inside another kernel: the one-line refusal
            if not isinstance(v, (np.ndarray, TensorSpec)) and not hasattr(v, "shape"):
                raise NkiError(f"nkilib.{self.lib_name}: argument '{n}' must be an array, got {type(v).__name__}")
            out[n] = v if isinstance(v, TensorSpec) else np.asarray(v)
        return out

    def _spec(self, arrays: Mapping[str, Any]) -> tuple[tuple[int, ...], str]:
        shape = KERNELS[self.lib_name][0](arrays, self.lib_params)
        first = arrays[self.in_names[0]]
        entry = get_kernel(self.lib_name)
        try:
            dt = get_dtype(first.dtype).short
        except ValueError:
            dt = entry.default_dtype
        # arrays of a dtype the kernel does not take (numpy's float32) run in its model dtype,
        # rounded on the way in, as `trnsim kernel --check` feeds it
        return shape, dt if dt in entry.dtypes else entry.default_dtype

    def _build(self, arrays: Mapping[str, Any], cfg: ChipConfig, program: int | None) -> Any:
        shape, dt = self._spec(arrays)
        params = dict(self.kernel_params)
        if program is not None and self.grid:
            parts = split_parts(self.lib_name, shape, {**get_kernel(self.lib_name).params, **params}, self.grid[0])
            if len(parts) == self.grid[0]:
                shape, own = parts[program]
                params.update(own)
        try:
            return build_spec(self.lib_name, shape, dt, cfg, params)
        except Exception as e:
            if isinstance(e, NkiError):
                raise
            raise NkiError(f"nkilib.{self.lib_name}: {e}") from None

    def trace(self, *args: Any, config: Any = None, programs: Sequence[int] | None = None, **kwargs: Any) -> Traced:
        cfg = target_config(config if config is not None else self.config)
        arrays = self._bind_arrays(args, kwargs)
        program = None if programs is None or len(programs) != 1 or not self.grid else int(programs[0])
        k = self._build(arrays, cfg, program)
        inputs = {n: arrays[n] for n in self.in_names}
        for n, v in inputs.items():
            want = k.tensors[n].shape
            if program is None and _t(v) != want and int(np.prod(_t(v))) != int(np.prod(want)):
                raise NkiError(f"nkilib.{self.lib_name}: argument '{n}' has shape {_t(v)}; the kernel takes {want}")
        outs = tuple(self.out_names) if len(self.out_names) > 1 else self.out_names[0]
        written = {n: arrays[n] for n in self.written}
        from ..sim.list_schedule import ScheduleStats

        stats = ScheduleStats(len(k.instructions), 0, 0, 0, 0, "as built", 0, 0)
        return Traced(k, k, cfg, inputs, outs, written, stats)

    def output_specs(self, *args: Any, config: Any = None, **kwargs: Any) -> Any:
        cfg = target_config(config if config is not None else self.config)
        k = self._build(self._bind_arrays(args, kwargs), cfg, None)
        specs = [tensor_spec(k.tensors[n].shape, k.tensors[n].dtype.name) for n in self.out_names]
        return tuple(specs) if len(specs) > 1 else specs[0]


def kernel(name: str, **params: Any) -> LibraryKernel:
    """Library kernel ``name`` (``qkv``, ``attention_tkg``, ``attention_cte``, ``mlp``, ``oproj``,
    ``rope``, ``router_topk``, ``moe_tkg``) with its compile-time ``params`` fixed."""
    return LibraryKernel(name, params)


def signature(k: LibraryKernel) -> tuple[list[str], list[str]]:
    """(the tensors ``k`` takes, in order; the tensors it returns, in order)."""
    return list(k.in_names), list(k.out_names)
