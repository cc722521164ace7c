"""The ``neuron`` torch.compile backend: dynamo graph -> aot_autograd forward/backward graphs ->
:class:`~torch_bridge.compile.graph.CompiledGraph` (fused regions, one launch per graph).

Found by name three ways: the ``torch_dynamo_backends`` entry point (an installed trnsim; no
import needed), :func:`register` (``import torch_bridge.compile``'s way for a source checkout),
and graphs that ``torch.compile`` would give Inductor on neuron tensors (the default backend, or
an explicit ``backend="inductor"``), which go to this backend with a one-line warning: Inductor
has no code generator for the device.
"""

from __future__ import annotations

import time
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx

from .. import _torch
from ..runtime import runtime

__all__ = ["neuron_backend", "register", "divert_inductor", "INDUCTOR_WARNING", "allow_neuron", "allow_neuron_on_import"]

INDUCTOR_WARNING = ("torch.compile: Inductor has no code generator for the neuron device; compiling this graph with "
                    "trnsim's 'neuron' backend instead (backend='neuron' or "
                    "torch.compiler.set_default_backend('neuron') chooses it directly)")


def _compiler(kind: str) -> Callable[[fx.GraphModule, Sequence[Any]], Any]:
    def compile_graph(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Any:
        from .graph import CompiledGraph

        t0 = time.perf_counter()
        compiled = CompiledGraph(gm, kind)
        if kind == "backward":  # the forward's compile time is counted with the backend call
            runtime().device.note_compile(time.perf_counter() - t0)
        return _torch.compile_api("make_boxed_func")(compiled)
    return compile_graph


def neuron_backend(gm: fx.GraphModule, example_inputs: Sequence[Any], **options: Any) -> Any:
    """The dynamo backend: aot_autograd with the min-cut partitioner (it recomputes cheap ops
    in the backward instead of saving them, so regions write fewer tensors), each graph run as a
    :class:`CompiledGraph`. ``options`` (``mode``, Inductor options) are accepted and ignored.
    A graph two of whose inputs overlap in memory and which writes in place runs its ops one by
    one instead, with a warning (:func:`_aliased_and_written`: AOTAutograd's values are wrong there)."""
    t0 = time.perf_counter()
    if _aliased_and_written(gm, example_inputs):
        warnings.warn(ALIASED_WARNING, UserWarning, stacklevel=2)
        return gm.forward  # its ops run one by one on the device, as dynamo's "eager" backend runs them
    from .attention import use_attention_op

    use_attention_op(gm)
    aot = _torch.compile_api("aot_module_simplified")
    mincut = _torch.compile_api("min_cut_rematerialization_partition")
    fn = aot(gm, list(example_inputs), fw_compiler=_compiler("forward"), bw_compiler=_compiler("backward"),
             partition_fn=mincut, keep_inference_input_mutations=True)
    runtime().device.note_compile(time.perf_counter() - t0)
    return fn


ALIASED_WARNING = ("torch.compile: a graph whose tensor inputs overlap in memory and which writes in place runs "
                   "its ops one by one on the neuron device, not compiled: PyTorch's AOTAutograd can return a wrong "
                   "tensor for such a graph on every device (docs/compile.md)")

# dynamo's names for Python's in-place operators (``x += y`` is ``operator.iadd``)
_INPLACE_OPERATORS = {"setitem", "iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior",
                      "ixor", "ilshift", "irshift", "imatmul"}


def _writes_in_place(gm: fx.GraphModule) -> bool:
    """Whether any op of the dynamo graph may write into a tensor it was given: an in-place method
    or function (a name ending in one underscore), an out= argument, an operator such as ``+=``
    or item assignment, or a mutable aten overload. Over-approximates: a write into an
    intermediate counts too."""
    for n in gm.graph.nodes:
        if n.op not in ("call_method", "call_function"):
            continue
        if "out" in n.kwargs:
            return True
        name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
        if name.endswith("_") and not name.endswith("__") or name in _INPLACE_OPERATORS:
            return True
        schema = getattr(n.target, "_schema", None)
        if schema is not None and schema.is_mutable:
            return True
    return False


def _aliased_and_written(gm: fx.GraphModule, inputs: Sequence[Any]) -> bool:
    """Two tensor inputs overlap in one storage and the graph writes in place. AOTAutograd merges
    such a pair into one base when one of them is written, and then an in-place op on another
    input returns that input's storage re-viewed at offset 0 (PyTorch 2.13, on every device;
    a difftest finding). Sizes that are symbols count as overlapping."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from ..eager.values import byte_extent

    spans: dict[Any, list[tuple[int, int] | None]] = {}
    for t in inputs:
        if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
            continue
        try:
            key = StorageWeakRef(t.untyped_storage())
        except Exception:  # noqa: BLE001 - a tensor without a storage (a wrapper subclass) aliases nothing here
            continue
        dims = (*t.shape, *t.stride(), t.storage_offset())
        span: tuple[int, int] | None = None  # symbolic sizes (read without adding a guard): assume the worst
        if not any(isinstance(d, torch.SymInt) for d in dims):
            if 0 in t.shape:
                continue
            span = byte_extent(t)
        for other in spans.setdefault(key, []):
            if span is None or other is None or (span[0] < other[1] and other[0] < span[1]):
                return _writes_in_place(gm)
        spans[key].append(span)
    return False


def register() -> None:
    """Register ``neuron`` by name unless the entry point already provides it (idempotent)."""
    if "neuron" in torch.compiler.list_backends(exclude_tags=()):
        return
    _torch.compile_api("register_backend")(compiler_fn=neuron_backend, name="neuron")


def _on_neuron(gm: Any, inputs: Sequence[Any]) -> bool:
    if any(isinstance(t, torch.Tensor) and t.device.type == "neuron" for t in inputs):
        return True
    for n in getattr(getattr(gm, "graph", None), "nodes", ()):
        v = n.meta.get("example_value")
        if isinstance(v, torch.Tensor) and v.device.type == "neuron":
            return True
    return False


def divert_inductor() -> None:
    """Graphs torch.compile hands Inductor that hold neuron tensors go to the neuron backend."""
    wrapper = _torch.InductorWrapper
    if getattr(wrapper.__call__, "_trnsim", False):
        return
    original = wrapper.__call__

    def __call__(self: Any, model_: Any, inputs_: Sequence[Any]) -> Any:
        if not _on_neuron(model_, inputs_):
            return original(self, model_, inputs_)
        warnings.warn(INDUCTOR_WARNING, UserWarning, stacklevel=2)
        return neuron_backend(model_, inputs_)

    __call__._trnsim = True  # type: ignore[attr-defined]
    wrapper.__call__ = __call__
    allow_neuron_on_import()  # FlexAttention's device check lets neuron tensors through


# ---- FlexAttention's device check ----------------------------------------------------------
FLEX_MODULE = "torch.nn.attention.flex_attention"


def allow_neuron() -> None:
    """FlexAttention accepts neuron tensors (every other device is validated as before)."""
    import importlib

    original = _torch.compile_api("_validate_device")
    module = importlib.import_module("torch.nn.attention.flex_attention")
    if getattr(original, "_trnsim", False):
        return

    def validate(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        if query.device.type == "neuron" and key.device == query.device and value.device == query.device:
            return
        original(query, key, value)

    validate._trnsim = True  # type: ignore[attr-defined]
    module._validate_device = validate


def allow_neuron_on_import() -> None:
    """:func:`allow_neuron` now if FlexAttention is imported, else as soon as it is (importing
    it eagerly would add seconds to ``import torch``)."""
    from ..imports import after_import

    after_import(FLEX_MODULE, lambda module: allow_neuron())
