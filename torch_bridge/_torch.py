"""Every private PyTorch API the bridge uses, in one place.

They were written against torch 2.13.0 (:data:`PINNED`), which the ``torch`` extra pins. Private
APIs change between releases without notice; each one is looked up here once, at import, so a
torch that lacks one fails with a message naming it and the pinned version instead of an
``AttributeError`` deep inside an op (``tests/torch/test_private_api.py`` checks them all).
"""

from __future__ import annotations

import contextlib
import importlib
import threading
from typing import Any, Callable

import torch

__all__ = ["PINNED", "REQUIRED", "PrivateAPIError", "resolve", "profiler_enabled", "cpp_op", "op_schema",
           "is_zerotensor"]

PINNED = "2.13.0"


class PrivateAPIError(ImportError):
    """A private torch API the bridge needs is missing from the installed torch."""


# dotted path -> why the bridge needs it
REQUIRED: dict[str, str] = {
    "torch._register_device_module": "torch.neuron",
    "torch._utils._to": "storage.to('neuron') and torch.load onto neuron",
    "torch.storage._to": "storage.to('neuron') and torch.load onto neuron",
    "torch._C.DispatchKey": "redispatching to CPU kernels",
    "torch._C.DispatchKeySet": "redispatching to CPU kernels",
    "torch._C._dispatch_get_all_op_names": "claiming every _foreach_ op",
    "torch._C._dynamo.eval_frame.get_eval_frame_callback": "calling kernels directly when dynamo is off",
    "torch._guards.TracingContext.try_get": "no launch for kernels run while torch.compile traces",
    "torch._C._get_dispatch_mode": "no launch for kernels run while torch.compile traces",
    "torch._C._TorchDispatchModeKey": "no launch for kernels run while torch.compile traces",
    "torch._guards._TLS": "telling the native fast path when torch.compile traces (watch_tracing)",
    "torch._C._dynamo.eval_frame.set_code_exec_strategy": "dynamo never compiling the kernels' own wrapper frame",
    "torch._C._dynamo.eval_frame._FrameExecStrategy": "dynamo never compiling the kernels' own wrapper frame",
    "torch._C._dynamo.eval_frame._FrameAction": "dynamo never compiling the kernels' own wrapper frame",
    "torch._disable_dynamo": "hiding Python kernels from dynamo",
    "torch._C._profiler._RecordFunctionFast": "neuron::<op> events in torch.profiler",
    "torch.autograd.profiler._is_profiler_enabled": "neuron::<op> events only while profiling",
    "torch.autograd.profiler._run_on_profiler_start": "opening the device model's trace session when torch.profiler starts",
    "torch.autograd.profiler._run_on_profiler_stop": "closing it when torch.profiler stops",
    "torch._C._to_dlpack": "relabelling host memory as neuron memory",
    "torch._C._from_dlpack": "relabelling host memory as neuron memory",
    "torch._C._construct_storage_from_data_pointer": "CPU views of device memory",
    "torch._conj": "CPU views of conjugated tensors",
    "torch._neg_view": "CPU views of negated tensors",
    "torch.ops.aten.add.Tensor._op": "calling an op's C++ kernel without OpOverload's Python frame",
    "torch.ops.aten.add.Tensor._schema": "reading an op's schema (views, out= arguments)",
    "torch.Tensor._is_zerotensor": "materialising efficient zero tensors",
    "torch._softmax_backward_data": "the attention backward's softmax gradient",
    "torch.ops.aten._scaled_dot_product_attention_math": "attention calls the fused op does not take",
    "torch.ops.aten._safe_softmax": "attention rows that see no key: zeros, as CPU's math path gives",
    "torch.ops.aten._scaled_mm": "fp8 matmuls with an expanded bias made contiguous first",
    "torch._fused_sdp_choice": "whether CPU's attention takes attn_mask with is_causal (its fused kernel does)",
    "torch.utils._python_dispatch._disable_current_modes":
        "attention's input checks on their own tensors, unseen by the caller's modes (fake, flop counter)",
    "torch._C.DisableTorchFunction": "attention's input checks unseen by the caller's torch function modes",
    "torch._TorchCompileInductorWrapper": "sending graphs torch.compile gives Inductor on neuron tensors to 'neuron'",
    "torch._C._ForceDispatchKeyGuard": "autograd inside a custom op's kernel (the MoE block's backward)",
    "torch._C._dispatch_tls_local_include_set": "autograd inside a custom op's kernel (the MoE block's backward)",
    "torch._C._dispatch_tls_local_exclude_set": "autograd inside a custom op's kernel (the MoE block's backward)",
    "torch.utils._python_dispatch.TorchDispatchMode": "charging the MoE block's eager ops as they run (a dispatch mode)",
    "torch._C._len_torch_dispatch_stack": "the MoE block's loop: HF's own ops where a dispatch mode watches them",
}

# Private APIs of torch.compile's machinery. Importing it takes seconds, so these are resolved on
# first use (torch_bridge.compile), not at import; tests/torch/test_compile_backend.py checks them.
COMPILE_REQUIRED: dict[str, str] = {
    "torch._dynamo.register_backend": "registering the 'neuron' backend by name",
    "torch._functorch.aot_autograd.aot_module_simplified": "forward and backward graphs (aot_autograd)",
    "torch._functorch.partitioners.min_cut_rematerialization_partition":
        "recomputing cheap ops in the backward instead of saving them (fewer region outputs)",
    "torch._functorch.aot_autograd.make_boxed_func": "the boxed calling convention of compiled graphs",
    "torch.nn.attention.flex_attention._validate_device": "FlexAttention on neuron tensors",
    "torch._dynamo.convert_frame._compile": "timing torch.compile's own work in the host profile (hostprof)",
}

#: where Dynamo compiles a frame: the module and the function its callers look up there at each
#: call, which the host profile wraps while it records (torch_bridge.neuron.hostprof)
DYNAMO_COMPILE_MODULE, DYNAMO_COMPILE_NAME = "torch._dynamo.convert_frame", "_compile"


def compile_api(name: str) -> Any:
    """A private API of torch.compile's machinery by its last name (see :data:`COMPILE_REQUIRED`)."""
    path = next(p for p in COMPILE_REQUIRED if p.rsplit(".", 1)[-1] == name)
    return resolve(path)


def resolve(path: str) -> Any:
    """The object at dotted ``path`` (``torch._C._dynamo.eval_frame.get_eval_frame_callback``), or :class:`PrivateAPIError`."""
    parts = path.split(".")
    obj: Any = None
    for i in range(len(parts), 0, -1):  # the longest importable module prefix, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        rest = parts[i:]
        break
    try:
        for name in rest:
            obj = getattr(obj, name)
    except AttributeError:
        raise PrivateAPIError(
            f"torch_bridge needs {path} ({REQUIRED.get(path, 'a private torch API')}), which torch "
            f"{torch.__version__} lacks; the neuron device is written against torch {PINNED}: "
            f"pip install 'torch=={PINNED}'") from None
    return obj


for _path in REQUIRED:  # fail at import, naming the missing API, rather than inside an op
    resolve(_path)

DispatchKey = torch._C.DispatchKey
DispatchKeySet = torch._C.DispatchKeySet
COMPOSITE_IMPLICIT = torch._C.DispatchKey.CompositeImplicitAutograd  # (run_composite's key for a C++ composite)
CPU_KEYS = DispatchKeySet(DispatchKey.CPU)
register_device_module = torch._register_device_module
all_op_names = torch._C._dispatch_get_all_op_names
eval_frame_callback = resolve("torch._C._dynamo.eval_frame.get_eval_frame_callback")
_tracing_context = resolve("torch._guards.TracingContext.try_get")
_dispatch_mode = resolve("torch._C._get_dispatch_mode")
_FAKE = resolve("torch._C._TorchDispatchModeKey").FAKE


def tracing() -> bool:
    """Whether torch.compile is tracing: dynamo and AOTAutograd propagate example values through
    the graph on fake tensors, and run the real kernel of an op whose inputs are constants.
    Kernels run then are the compiler's, not the program's (two thread-local lookups)."""
    return _tracing_context() is not None or _dispatch_mode(_FAKE) is not None


class _WatchedTLS(threading.local):
    """torch._guards' thread-local state, telling :data:`_tracing_watchers` on the thread that
    enters or leaves a TracingContext (``torch._guards.tracing`` sets ``tracing_context``)."""

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "tracing_context":
            for notify in _tracing_watchers:
                notify(value is not None)


_tracing_watchers: list[Callable[[bool], None]] = []


def watch_tracing(notify: Callable[[bool], None]) -> None:
    """Call ``notify(on)`` on the thread that enters (True) or leaves (False) torch.compile's
    trace. Native code cannot read the Python thread-local :func:`tracing` reads (the native fast
    path must step aside while dynamo traces), so torch._guards' thread-local becomes one that
    says when its ``tracing_context`` changes. Only ``torch._guards`` reads it (by its global name)."""
    guards = importlib.import_module("torch._guards")
    _tracing_watchers.append(notify)
    if not isinstance(guards._TLS, _WatchedTLS):
        watched = _WatchedTLS()
        for name, value in vars(guards._TLS).items():  # this thread's state (others' is set later by them)
            setattr(watched, name, value)
        guards._TLS = watched
    notify(_tracing_context() is not None)


def dynamo_skip(code: Any) -> None:
    """Dynamo never compiles frames of ``code`` (it runs them as written; what they call is
    dynamo's as usual): torch._dynamo.eval_frame.skip_code, without importing torch._dynamo."""
    ef = resolve("torch._C._dynamo.eval_frame")
    ef.set_code_exec_strategy(code, ef._FrameExecStrategy(ef._FrameAction.SKIP, ef._FrameAction.DEFAULT))
disable_dynamo = torch._disable_dynamo
TorchDispatchMode = resolve("torch.utils._python_dispatch.TorchDispatchMode")
RecordFunctionFast = torch._C._profiler._RecordFunctionFast
to_dlpack = torch._C._to_dlpack
from_dlpack = torch._C._from_dlpack
storage_from_pointer = torch._C._construct_storage_from_data_pointer
conj_view = torch._conj
neg_view = torch._neg_view
softmax_backward_data = torch._softmax_backward_data
sdpa_math = torch.ops.aten._scaled_dot_product_attention_math
safe_softmax = torch.ops.aten._safe_softmax
scaled_mm = torch.ops.aten._scaled_mm
fused_sdp_choice = torch._fused_sdp_choice
disable_current_modes = resolve("torch.utils._python_dispatch._disable_current_modes")
dispatch_modes = resolve("torch._C._len_torch_dispatch_stack")  # how many dispatch modes are in force
DisableTorchFunction = torch._C.DisableTorchFunction
_profiler = torch.autograd.profiler
InductorWrapper = torch._TorchCompileInductorWrapper


def autograd_inside_op() -> Any:
    """A guard under which autograd records again inside a custom op's kernel, which runs with
    the Autograd keys excluded (torch.enable_grad alone records nothing there)."""
    exclude = torch._C._dispatch_tls_local_exclude_set().remove(DispatchKey.AutogradFunctionality)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def profiler_enabled() -> bool:
    """True while a torch.profiler session records (read each call: the flag changes)."""
    return bool(_profiler._is_profiler_enabled)


def hook_profiler(on_start: Any, on_stop: Any) -> None:
    """Call ``on_start()`` after torch.profiler starts recording and ``on_stop()`` after it stops
    (torch.autograd.profiler calls these module functions by name from its profile classes)."""
    start, stop = _profiler._run_on_profiler_start, _profiler._run_on_profiler_stop
    if getattr(start, "_neuron_hook", False):
        return

    def started() -> None:
        start()
        on_start()

    def stopped() -> None:
        stop()
        on_stop()

    started._neuron_hook = stopped._neuron_hook = True  # type: ignore[attr-defined]
    _profiler._run_on_profiler_start = started
    _profiler._run_on_profiler_stop = stopped


def cpp_op(op: Any) -> Any:
    """The C++ callable behind an OpOverload (calling it skips OpOverload.__call__'s frame)."""
    return op._op


def op_schema(op: Any) -> Any:
    return op._schema


def is_zerotensor(t: torch.Tensor) -> bool:
    return bool(t._is_zerotensor())


class _Lazy:
    """Private APIs of a torch subsystem the bridge loads only when it is used (torch.distributed:
    importing FSDP alone takes most of a second), resolved on first use with the same error."""

    def __init__(self, required: dict[str, str]):
        self.required = required
        self._resolved: dict[str, Any] = {}

    def __call__(self, path: str) -> Any:
        obj = self._resolved.get(path)
        if obj is None:
            if path not in self.required:
                raise KeyError(f"{path} is not fenced in torch_bridge._torch")
            obj = self._resolved[path] = resolve(path)
        return obj


# torch.distributed: the neuron process-group backend (torch_bridge.distributed)
DIST_REQUIRED: dict[str, str] = {
    "torch._C._distributed_c10d.ProcessGroupGloo": "moving the neuron backend's values through gloo",
    "torch._C._distributed_c10d._DistributedBackendOptions": "the neuron backend's creator (extended API)",
    "torch.distributed._Work": "the neuron backend's Work objects (a Python subclass)",
    "torch._C._current_graph_task_id": "knowing a collective was issued inside a backward pass",
    "torch.autograd.Variable._execution_engine": "completing a backward pass's unwaited collectives at its end",
    "torch.distributed.fsdp._fully_shard._fsdp_param.alloc_storage": "FSDP2's parameter storage (resize)",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group.alloc_storage": "FSDP2's parameter storage (resize)",
    "torch.distributed.fsdp._fully_shard._fsdp_param.free_storage": "FSDP2's parameter storage (resize)",
}
dist_api = _Lazy(DIST_REQUIRED)


def gloo_process_group() -> Any:
    """``ProcessGroupGloo``, the class the neuron backend moves values through."""
    return dist_api("torch._C._distributed_c10d.ProcessGroupGloo")


def work_base() -> Any:
    """``torch.distributed._Work``, the base of the neuron backend's Work objects."""
    return dist_api("torch.distributed._Work")


_interpreters = resolve("torch._C._functorch.peek_interpreter_stack")


def functorch_active() -> bool:
    """Whether a torch.func transform (grad, vjp, vmap, jacrev, ...) is running: its tensors are
    wrappers whose values only its own interpreters read, and an ``autograd.Function`` without a
    ``setup_context`` is refused inside one (a fused op runs its composite there instead)."""
    return _interpreters() is not None


def batched_grad(grad: Any) -> bool:
    """True for an output gradient batched by vmap (autograd's ``is_grads_batched``,
    ``jacobian(vectorize=True)``, or a torch.func transform): a wrapper without memory of its own,
    which a fused op's backward cannot read as a host view (it differentiates its composite)."""
    if functorch_active():
        return True
    try:
        grad.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return True
    return False


_saved_hooks = resolve("torch._C._autograd._top_saved_tensors_default_hooks")


def saved_tensor_hooks() -> bool:
    """Whether default saved-tensor hooks are in force (``torch.autograd.graph.save_on_cpu``,
    non-reentrant ``torch.utils.checkpoint``): what autograd keeps of a forward is theirs."""
    return _saved_hooks(False) is not None


def keep_graph() -> bool:
    """Inside a backward: whether this graph task keeps the graph (``retain_graph``)."""
    return bool(torch._C._autograd._get_current_graph_task_keep_graph())


def graph_task_id() -> int:
    """The running backward pass's id (-1 outside one)."""
    return int(dist_api("torch._C._current_graph_task_id")())


def at_end_of_backward(fn: Any) -> None:
    """Run ``fn`` when the running backward pass has finished (the autograd engine's callback)."""
    dist_api("torch.autograd.Variable._execution_engine").queue_callback(fn)


def fsdp_storage() -> tuple[Any, Any]:
    """FSDP2's ``alloc_storage`` and ``free_storage`` (importing FSDP2 if it is not yet)."""
    return (dist_api("torch.distributed.fsdp._fully_shard._fsdp_param.alloc_storage"),
            dist_api("torch.distributed.fsdp._fully_shard._fsdp_param.free_storage"))


#: the FSDP2 module whose import the bridge waits for to patch its storage (it imports
#: _fsdp_param's alloc_storage): torch_bridge.dist patches FSDP only once a program imports it
FSDP_PARAM_GROUP_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_param_group"


def patch_fsdp_storage(alloc: Any, free: Any) -> None:
    """Replace FSDP2's ``alloc_storage``/``free_storage`` (and the copy its param group imported)."""
    import torch.distributed.fsdp._fully_shard._fsdp_param as fsdp_param
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_param_group

    fsdp_param.alloc_storage = fsdp_param_group.alloc_storage = alloc
    fsdp_param.free_storage = free


def patch_storage_to(wrap: Any) -> None:
    """Wrap ``torch._utils._to`` and ``torch.storage._to`` (storage moves) with ``wrap``."""
    torch._utils._to = wrap(torch._utils._to)  # type: ignore[attr-defined]
    torch.storage._to = wrap(torch.storage._to)  # type: ignore[attr-defined]


# ---- timing-only runs (torch_bridge.timing_only): fake tensors and dispatch modes ----------------
REQUIRED.update({
    "torch._subclasses.fake_tensor.FakeTensorMode": "tensors with shapes and no storage (timing-only runs)",
    "torch._subclasses.fake_tensor.FakeTensor": "telling timing-only tensors apart",
    "torch._subclasses.fake_tensor.DataDependentOutputException": "a clear error for ops that need values",
    "torch._subclasses.fake_tensor.DynamicOutputShapeException": "a clear error for ops that need values",
    "torch._subclasses.fake_tensor.UnsupportedOperatorException": "a clear error for ops without a shape rule",
    "torch.utils._python_dispatch.TorchDispatchMode": "charging every op of a timing-only run",
    "torch.utils._python_dispatch._disable_current_modes": "building a meta model fast inside a timing-only run",
})
for _path in list(REQUIRED)[-7:]:
    resolve(_path)

FakeTensorMode = resolve("torch._subclasses.fake_tensor.FakeTensorMode")
FakeTensor = resolve("torch._subclasses.fake_tensor.FakeTensor")
DataDependentOutputException = resolve("torch._subclasses.fake_tensor.DataDependentOutputException")
DynamicOutputShapeException = resolve("torch._subclasses.fake_tensor.DynamicOutputShapeException")
UnsupportedOperatorException = resolve("torch._subclasses.fake_tensor.UnsupportedOperatorException")
TorchDispatchMode = resolve("torch.utils._python_dispatch.TorchDispatchMode")
no_dispatch_modes = resolve("torch.utils._python_dispatch._disable_current_modes")


def held_constant(t: Any) -> Any:
    """The values a FakeTensor made from data keeps (its ``constant``), or None. Fake mode runs an
    op on such a tensor for real too, to keep the result's values, so a copy of it to the device
    would also run, and be charged, on the real device (timing_only's tensors from data)."""
    return getattr(t, "constant", None) if isinstance(t, FakeTensor) else None


def forget_constant(t: Any) -> None:
    """Drop :func:`held_constant`'s values of ``t`` for good (a host tensor made only to be copied)."""
    if isinstance(t, FakeTensor):
        t.constant = None


@contextlib.contextmanager
def constant_hidden(t: Any) -> Any:
    """:func:`held_constant`'s values of ``t`` hidden from fake mode inside the block, given back after
    (``t.item()`` still works)."""
    held = held_constant(t)
    if held is None:
        yield
        return
    t.constant = None
    try:
        yield
    finally:
        t.constant = held
COMPOSITE_EXPLICIT = (DispatchKey.CompositeExplicitAutograd, DispatchKey.CompositeExplicitAutogradNonFunctional)


def has_kernel(op: Any, key: Any) -> bool:
    """Whether ``op`` (an OpOverload) has a kernel registered at dispatch key ``key`` itself."""
    return bool(op.has_kernel_for_dispatch_key(key))


def run_composite(op: Any, key: Any, *args: Any, **kwargs: Any) -> Any:
    """``op``'s composite kernel at ``key``: its inner ops dispatch again from the top."""
    return op.redispatch(DispatchKeySet(key), *args, **kwargs)


def non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s strides are a permutation of a contiguous layout (its elements fill its span)."""
    from torch._prims_common import is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense

    return bool(is_non_overlapping_and_dense(t))
