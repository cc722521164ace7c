"""Which neuron kernel serves which aten op: the table registered with PyTorch's dispatcher.

One boxed fallback serves every op without an explicit kernel: the native fast path
(:mod:`torch_bridge.fastpath`) on PrivateUse1, which runs the common call itself and hands every
other to :func:`torch_bridge.values.fallback`, registered on :data:`SLOW_KEY`. Explicit kernels are registered where PyTorch needs them (allocation and copies, resize,
the TensorE ops, convolution), where a composite would decompose an op before the device sees
it (:data:`WHOLE_OPS`), where skipping a composite round trip saves per-op time
(:data:`DIRECT_OPS`), for the ``_foreach_*`` ops (one multi-tensor kernel each), attention, and
autocast. Every Python kernel is hidden from dynamo: a Python kernel is otherwise a frame dynamo
tries to compile. See ``shared/notes/privateuse1-python.md`` for why each explicit kernel exists.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from . import _torch
from .eager import alloc, values
from .eager.autocast import register_autocast

__all__ = ["register_kernels", "WHOLE_OPS", "DIRECT_OPS", "FAST_MATMULS"]

_libs: list[torch.library.Library] = []

# The dispatch key of the Python fallback and of WHOLE_OPS/DIRECT_OPS' Python kernels: the native
# fast path on PrivateUse1 redispatches there for every call it does not serve itself.
SLOW_KEY = "PrivateUse2"

# Ops with a composite kernel that PyTorch would otherwise decompose before the device sees them.
# Claiming them runs the CPU kernel whole (the same numbers as on CPU; the math decomposition of
# layer norm differs by ~1e-4; group norm's, in bf16 statistics, by up to 0.09) and lets them
# lower to their library kernels. mode.values's composite refuses any device but CPU/CUDA/XPU.
# silu_backward, mish_backward and native_channel_shuffle have CPU kernels and a
# CompositeImplicitAutograd decomposition that every other device runs: on neuron SiLU's backward
# came out of five elementwise ops, an ulp off CPU's, and took integer tensors CPU refuses
# (tests/torch/test_differential.py keeps this list complete). pixel_shuffle and pixel_unshuffle
# have CPU kernels and a CompositeExplicitAutogradNonFunctional decomposition (reshape, permute,
# clone) that lays a channels-last input's result out contiguous where CPU's kernel keeps it
# channels-last (found by an adversarial values hunt: the same values, strides (192, 192, 16, 1)
# against CPU's (192, 1, 16, 1)).
WHOLE_OPS = ("native_layer_norm", "native_group_norm", "embedding", "mode.values", "silu_backward", "mish_backward",
             "native_channel_shuffle", "pixel_shuffle", "pixel_unshuffle")
# Frequent functional ops claimed directly, so they skip the composite `empty` + `op.out` round
# trip (one allocation and one dispatch fewer per call; the values are the same CPU kernels).
# mse_loss's and smooth_l1_loss's CPU out= kernels also warn that they resized their output, on every call.
# cat (~176 a dynamic-cache generate() step: the KV cache) and isin ... eq.Scalar (a generate()
# step's stopping criteria, masks and rotary embedding: 16-49 calls each) are the ones a zoo step
# made most often through that round trip.
DIRECT_OPS = ("add.Tensor", "sub.Tensor", "mul.Tensor", "div.Tensor", "add.Scalar", "mul.Scalar", "neg", "exp",
              "sqrt", "rsqrt", "relu", "gelu", "silu", "sigmoid", "tanh", "pow.Tensor_Scalar", "where.self",
              "_softmax", "_log_softmax", "sum.dim_IntList", "mean.dim", "eq.Tensor", "ne.Scalar", "gt.Scalar",
              "lt.Scalar", "masked_fill.Scalar", "clamp", "threshold_backward", "gelu_backward",
              "_softmax_backward_data", "mse_loss", "smooth_l1_loss", "cat", "isin.Tensor_Tensor", "all", "all.dim",
              "any", "any.dim", "isneginf", "cos", "sin", "argmax", "bitwise_not", "eq.Scalar")
# Structured ops whose meta function builds a TensorIterator that does not take CPU scalars: left
# to their CompositeExplicitAutogradNonFunctional kernels, a 0-dim host min/max beside device
# tensors was refused ("Expected all tensors to be on the same device") where CPU computes with it
# (found by difftest: clamp.Tensor). Claimed, they take the fallback's device check (0-dim host
# tensors act as scalars, as for add) and CPU's kernel, so CPU's promotion and values.
HOST_SCALAR_OPS = ("clamp.Tensor", "clamp_.Tensor", "clamp.Tensor_out", "clamp_min.Tensor", "clamp_min_.Tensor",
                   "clamp_min.Tensor_out", "clamp_max.Tensor", "clamp_max_.Tensor", "clamp_max.Tensor_out")

# Ops whose CompositeExplicitAutograd kernel (what a device without its own runs) skips a check
# CPU's kernel makes: all/any over several dims reduce one dim at a time into bool temporaries and
# copy into the out, so a float out= CPU refuses ("all only supports bool tensor for result, got:
# Float") was filled with 1.0/0.0 (found by difftest: all 13945163706620). Claimed, they take
# CPU's kernel on the host views: its checks, its messages, its values. A scan for the rest of the
# kind (a CPU kernel and a CompositeExplicitAutograd one) found three more, each off CPU: addr's
# composite (outer, mul, add) rounded otherwise than CPU's one expression (bfloat16 up to 0.016)
# and took a float beta for integer tensors CPU refuses; linalg._powsum's (abs, pow, sum) summed
# otherwise (bfloat16 up to 1.0); _stack's (cat of unsqueezed) took unequal sizes CPU refuses and
# wrote an out= of another size. tests/torch/test_differential.py keeps the list complete.
# _batch_norm_no_update's CompositeExplicitAutograd kernel (an exported model's eval BatchNorm)
# calls CPU's batch_norm_cpu directly, so on any device without its own kernel it raised "Expected
# tensor to have CPU Backend" for every call (found by difftest --wide); claimed, it runs on the host
# views as CPU runs it. kaiser_window's composite calls its kernel stub by device type, which has no
# entry for this device: torch.kaiser_window(5, device="neuron") failed an INTERNAL ASSERT
# ("DispatchStub: missing kernel"); claimed, CPU's kernel fills the window (the other windows are
# arange and pointwise ops, and ran already).
CPU_CHECKED_OPS = ("all.dims", "all.dims_out", "any.dims", "any.dims_out", "addr", "addr.out", "linalg__powsum",
                   "_stack", "_stack.out", "_batch_norm_no_update", "_batch_norm_no_update.out",
                   "kaiser_window", "kaiser_window.periodic", "kaiser_window.beta", "kaiser_window.out",
                   "kaiser_window.periodic_out", "kaiser_window.beta_out")

# The functional pointwise ops of two or more tensors that would otherwise reach the device through
# their CompositeExplicitAutogradNonFunctional kernel (structured: its meta function, then the op's
# out= variant): claimed as DIRECT_OPS are, so CPU's kernel runs on the host views and the result
# has CPU's layout. The composite's TensorIterator ordered the dims on the device tensors as they
# are, where CPU's first casts an input of another dtype to the common one (a dense copy):
# ne(a, b) of an expanded int64 a and a permuted bfloat16 b came out with b's strides (1, 4, 4, 2)
# where CPU's are (6, 2, 2, 1), the same values (found by difftest: ne 277120007080837; 57 such op
# and dtype pairs, every comparison and binary math op that promotes). The unary ones lay out as
# CPU does (scanned) and stay composite. The rest of the kind is claimed by the lists above
# (add.Tensor, eq.Tensor, clamp.Tensor, gelu_backward, ...). A literal list, as WHOLE_OPS is:
# finding the kind by tag and kernel took ~15 ms of every `import torch`;
# tests/torch/test_differential.py keeps it complete, as a torch release adds to the kind.
LAYOUT_OPS = ("addcdiv", "addcmul", "atan2", "bitwise_and.Tensor", "bitwise_left_shift.Tensor", "bitwise_or.Tensor",
              "bitwise_right_shift.Tensor", "bitwise_xor.Tensor", "copysign.Tensor", "div.Tensor_mode", "fmax", "fmin",
              "fmod.Tensor", "gcd", "ge.Tensor", "gt.Tensor", "heaviside", "hypot", "igamma", "igammac", "lcm",
              "le.Tensor", "lerp.Scalar", "lerp.Tensor", "logaddexp", "logaddexp2", "logit_backward", "lt.Tensor",
              "maximum", "minimum", "ne.Tensor", "nextafter", "pow.Tensor_Tensor", "remainder.Tensor",
              "sigmoid_backward", "special_chebyshev_polynomial_t", "special_chebyshev_polynomial_u",
              "special_chebyshev_polynomial_v", "special_chebyshev_polynomial_w", "special_hermite_polynomial_h",
              "special_hermite_polynomial_he", "special_laguerre_polynomial_l", "special_legendre_polynomial_p",
              "special_shifted_chebyshev_polynomial_t", "special_shifted_chebyshev_polynomial_u",
              "special_shifted_chebyshev_polynomial_v", "special_shifted_chebyshev_polynomial_w", "special_xlog1py",
              "special_zeta", "tanh_backward", "xlogy.Tensor")

# TensorE ops whose float32 calls the fast path runs on the datapath itself (values.mm's, addmm's
# and bmm's Python kernels, on SLOW_KEY, serve every other call).
FAST_MATMULS = ("mm", "addmm", "bmm")
# Allocation and copies into the device, which the fast path serves itself in the common case
# (csrc/neuron.cpp's fast_empty, fast_copy and fast_to_copy: a dtype or layout change within a
# device); their Python kernels, on SLOW_KEY, serve the rest.
FAST_ALLOC = ("empty.memory_format", "empty_strided", "_copy_from", "_to_copy")
# nn.LSTM's and nn.GRU's cells (torch_bridge.ops.cells), which the fast path computes itself (csrc/neuron.cpp's fast_cell)
FAST_CELLS = ("_thnn_fused_lstm_cell", "_thnn_fused_lstm_cell_backward_impl", "_thnn_fused_gru_cell",
              "_thnn_fused_gru_cell_backward")

# float32 2-d convolutions on the datapath and every convolution's backward (CPU's kernel), which the
# fast path computes itself (csrc/neuron.cpp's fast_conv, fast_conv_backward)
FAST_CONVS = ("convolution_overrideable", "convolution_backward_overrideable")


def _hidden(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` hidden from dynamo. Its wrapper swaps the eval-frame callback out and back on every
    call (a few us, on every op); with no callback installed (no compiled frame running) there is
    nothing to hide from, so the kernel is called directly."""
    hidden = _torch.disable_dynamo(fn, recursive=True)
    callback = _torch.eval_frame_callback

    def kernel(*args: Any, **kwargs: Any) -> Any:
        if callback() is None:
            return fn(*args, **kwargs)
        return hidden(*args, **kwargs)
    # an op run eagerly inside a compiled function (at a graph break) calls this wrapper with the
    # callback installed: dynamo would compile the wrapper itself, break at callback() and
    # recompile its remainder per signature until its recompile limit (the tester saw the warnings)
    _torch.dynamo_skip(kernel.__code__)
    return kernel


def _traced(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` shown in torch.profiler as ``neuron::<op>``."""
    label = name.split(".")[0]

    def kernel(*args: Any, **kwargs: Any) -> Any:
        return values.call_traced(label, fn, *args, **kwargs)
    kernel.__name__ = getattr(fn, "__name__", name)
    return kernel


def _aten(name: str) -> Any:
    packet, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, packet), overload or "default")


def _in_place_foreach(op: Any) -> bool:
    """``_foreach_*_`` whose first argument is the one list it writes and that returns nothing:
    the native fast path serves it (csrc/neuron.cpp's ``classify_foreach``, which also leaves
    ``_foreach_copy_`` to Python: it copies from host tensors)."""
    schema = _torch.op_schema(op)
    args = schema.arguments
    return (not schema.returns and bool(args) and schema.name != "aten::_foreach_copy_"
            and all((a.alias_info is not None and a.alias_info.is_write) == (i == 0) for i, a in enumerate(args)))


def _functional_foreach(op: Any) -> bool:
    """``_foreach_*`` that writes nothing and returns one fresh tensor list (``_foreach_sqrt``,
    ``_foreach_norm``): the native fast path serves it too (``classify_foreach``)."""
    schema = _torch.op_schema(op)
    rets = schema.returns
    return (schema.name not in ("aten::_foreach_copy", "aten::_foreach_copy_") and len(rets) == 1
            and str(rets[0].type) == "List[Tensor]" and rets[0].alias_info is None
            and all(a.alias_info is None and "Generator" not in str(a.type) for a in schema.arguments))


def register_kernels() -> None:
    """Register the fallback and explicit kernels once per process."""
    if _libs:
        return
    impl = torch.library.Library("aten", "IMPL")
    fallback = torch.library.Library("_", "IMPL")
    _libs.extend([impl, fallback])
    kernels: dict[str, Callable[..., Any]] = {
        "empty.memory_format": alloc.empty_memory_format,
        "empty_strided": alloc.empty_strided,
        "_copy_from": alloc.copy_from,
        "_copy_from_and_resize": alloc.copy_from_and_resize,
        "resize_": alloc.resize_,
        "_to_copy": alloc.to_copy,
        "mm": values.mm,
        "mm.out": values.out_variant(values.mm),
        "addmm": values.addmm,
        "addmm.out": values.out_variant(values.addmm),
        "bmm": values.bmm,
        "bmm.out": values.out_variant(values.bmm),
        "baddbmm": values.baddbmm,
        "baddbmm.out": values.out_variant(values.baddbmm),
        "convolution_overrideable": values.convolution,
        "convolution_backward_overrideable": values.convolution_backward,
        "histc": values.histc,
        "_scaled_mm": values.scaled_mm,
        "_scaled_mm.out": values.scaled_mm,
    }
    from .ops.cells import KERNELS as CELLS

    kernels.update(CELLS)
    for name, fn in kernels.items():
        native = name in FAST_MATMULS + FAST_ALLOC + FAST_CELLS + FAST_CONVS  # the fast path's kernel is on PrivateUse1
        impl.impl(name, _hidden(_traced(name, fn)), SLOW_KEY if native else "PrivateUse1")
    impl.impl("_has_compatible_shallow_copy_type", _hidden(alloc.has_compatible_shallow_copy_type), "PrivateUse1")
    # The fallback and these ops' kernels are the native fast path's (torch_bridge.fastpath); the
    # Python ones it redispatches to when it steps aside sit on PrivateUse2, a key nothing else uses.
    claimed = WHOLE_OPS + DIRECT_OPS + HOST_SCALAR_OPS + LAYOUT_OPS + CPU_CHECKED_OPS
    for name in claimed:
        kernel = functools.partial(values.fallback if name in WHOLE_OPS else values.same_device_fallback, _aten(name))
        impl.impl(name, _hidden(kernel), SLOW_KEY)
    fast_foreach = []  # in-place ones: the fast path's kernel, their Python one on SLOW_KEY
    for qualified in _torch.all_op_names():  # every functional/in-place _foreach_* op
        if qualified.startswith("aten::_foreach_"):
            name = qualified[len("aten::"):]
            op = _aten(name)
            info = values.op_info(op)
            if not info.out_names:  # out= variants keep the fallback's resizing of outs
                key = "PrivateUse1"
                if _in_place_foreach(op) or _functional_foreach(op):
                    fast_foreach.append(name)
                    key = SLOW_KEY
                impl.impl(name, _hidden(functools.partial(values.foreach, op)), key)
    # copying a conj/neg-bit tensor must not loop through the conj fallback (a segfault otherwise)
    impl.impl("_copy_from", torch.library.fallthrough_kernel, "Conjugate")
    impl.impl("_copy_from", torch.library.fallthrough_kernel, "Negative")
    # attention as one op: an AutogradPrivateUse1 kernel beats the op's CompositeImplicitAutograd
    # math path; the PrivateUse1 one serves calls below autograd (inference mode)
    from .ops.attention import FORWARD, sdpa

    for key in ("AutogradPrivateUse1", "PrivateUse1"):
        impl.impl(FORWARD, _hidden(_traced(FORWARD, sdpa)), key)
    # nn.LSTM/GRU/RNN as one op each (CPU's kernel's values, the composite's launches): the same two keys
    from .ops import rnn

    for name in rnn.RNNS:
        for key in ("AutogradPrivateUse1", "PrivateUse1"):
            impl.impl(f"{name}.input", _hidden(_traced(name, rnn.kernel(name))), key)
    fallback.fallback(_hidden(values.fallback), SLOW_KEY)
    for key in ("SparsePrivateUse1", "SparseCsrPrivateUse1"):
        fallback.fallback(_hidden(values.sparse_fallback), key)
    # a CSR/CSC/BSR/BSC tensor is made on neuron through this factory (``.to("neuron")``,
    # ``sparse_csr_tensor(device="neuron")``), whose composite kernel would build one without
    # asking the device: refused there, as a COO tensor's move is, so none exists to fail later
    # (``.cpu()`` of one said "col_indices expected sparse row compressed tensor layout")
    unsafe = _aten("_sparse_compressed_tensor_unsafe")
    impl.impl("_sparse_compressed_tensor_unsafe", _hidden(functools.partial(values.sparse_fallback, unsafe)),
              "SparseCsrPrivateUse1")
    fallback.fallback(_hidden(values.quantized_fallback), "QuantizedPrivateUse1")
    fallback.fallback(_hidden(values.nested_fallback), "NestedTensorPrivateUse1")
    from .eager import memory

    memory.install_process_transfer()
    from . import _native
    from .eager import fastpath

    fastpath.install(_native.load(), list(claimed + FAST_MATMULS + FAST_ALLOC + FAST_CELLS + FAST_CONVS) + fast_foreach,
                     values.screened_overloads())
    register_autocast(fallback)
