"""Values of the `neuron` device's ops: every op computes its real numbers on the host.

View and metadata ops redispatch to the CPU kernels on the neuron tensors themselves (they touch
only metadata, so the result is a real neuron view; they launch nothing on the device). TensorE
ops (mm, addmm, bmm, baddbmm and, through them, linear/matmul; convolutions) run through the
native datapath (:mod:`torch_bridge.tensore`). Every other op runs its CPU kernel on zero-copy
CPU views of the device memory; new results are relabelled as neuron tensors without a copy.

Each op then charges its cost: :mod:`torch_bridge.lowering` turns the call's metadata into a
kernel, and :func:`torch_bridge.runtime.Runtime.charge` launches it on the device model. That is
the only costing the value path does.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable

import numpy as np
import torch

from .. import _native, _torch
from . import fastpath, lowering, memory
from ..neuron import profiler
from . import tensore
from ..neuron.generators import device_generator
from .lowering import flat_tensors
from ..runtime import runtime

__all__ = ["NEURON", "fallback", "same_device_fallback", "foreach", "mm", "addmm", "bmm", "baddbmm", "out_variant",
           "convolution", "convolution_backward", "call_traced", "host_seed", "host_kernel", "is_neuron",
           "NEURON_DEVICES", "check_one_device", "same_device", "raise_devices", "OVERLAP_ERROR", "partial_overlap",
           "refuse_overlapping_out"]

NEURON = "neuron"
_CPU_KEYS = _torch.CPU_KEYS

# Ops that draw random numbers from the default generator without taking a Generator argument.
RANDOM_WITHOUT_GENERATOR = frozenset({"native_dropout"})

# ---- schema facts, cached per op ------------------------------------------------------------
class _OpInfo:
    """What the fallback needs to know about an op's schema."""

    __slots__ = ("name", "qualified", "is_view", "out_names", "tensor_positions", "random", "generator_pos",
                 "bump_lists")

    def __init__(self, op: Any):
        schema = _torch.op_schema(op)
        self.name = op.overloadpacket.__name__
        self.qualified = schema.name + (f".{schema.overload_name}" if schema.overload_name else "")
        self.is_view = any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns) or \
            self.name in ("set_", "is_set_to", "record_stream")
        self.out_names = tuple(a.name for a in schema.arguments
                               if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write)
        self.tensor_positions = tuple(i for i, a in enumerate(schema.arguments)
                                      if str(a.type) in ("Tensor", "Optional[Tensor]") and not a.kwarg_only)
        gens = [i for i, a in enumerate(schema.arguments) if str(a.type) in ("Optional[Generator]", "Generator")]
        # where a generator argument sits positionally (-1: keyword-only or none)
        self.generator_pos = gens[0] if gens and not schema.arguments[gens[0]].kwarg_only else -1
        self.random = bool(gens) or self.name in RANDOM_WITHOUT_GENERATOR
        # the tensor lists a ``_foreach_*`` op writes (its self, or an out= list), as (position,
        # name): CPU runs these ops as their composite, a loop of per-tensor in-place ops, each of
        # which bumps its tensor's version counter; a kernel registered for the device replaces
        # that loop, so it bumps them itself (:func:`bump_written`)
        self.bump_lists = tuple((i, a.name) for i, a in enumerate(schema.arguments)
                                if a.alias_info is not None and a.alias_info.is_write
                                and str(a.type) == "List[Tensor]") if self.name.startswith("_foreach_") else ()


_infos: dict[Any, _OpInfo] = {}


def op_info(op: Any) -> _OpInfo:
    info = _infos.get(op)
    if info is None:
        info = _infos[op] = _OpInfo(op)
    return info


# ---- helpers --------------------------------------------------------------------------------
def is_neuron(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device in NEURON_DEVICES


# Every neuron device a tensor can be on: ``t.device in NEURON_DEVICES`` is a third of the cost
# of ``t.device.type == NEURON`` (building the type string), and the fallback asks it per argument.
NEURON_DEVICES = frozenset(torch.device("privateuseone", i) for i in range(256))  # NEURON is not named yet


def _device_of(args: Any, kwargs: dict[str, Any]) -> int:
    first = args[0] if args else None
    if isinstance(first, torch.Tensor) and first.device in NEURON_DEVICES:  # the usual case, made cheap
        return first.device.index or 0
    runtime()  # (a factory, kaiser_window(device="neuron"), may be the process's first use: its memory is set up here)
    index = _neuron_index(args, kwargs)
    return _current_device() if index is None else index


def _neuron_index(args: Any, kwargs: dict[str, Any]) -> int | None:
    """The neuron device a call works on: its first neuron tensor's, or ``device=``'s; None for
    neither (a factory call on the current device, or one that makes host tensors)."""
    for t in flat_tensors(list(args) + list(kwargs.values()), []):
        if t.device.type == NEURON:
            return t.device.index or 0
    dev = kwargs.get("device")
    if dev is not None:
        dev = torch.device(dev)
        if dev.type == NEURON:
            return dev.index or 0
    return None


def _current_device() -> int:
    return _native.lib.trnsim_current_device()  # kept by the native device guard, per thread


class _ToCpu:
    """Converts op arguments to CPU: neuron tensors become zero-copy views; remembers which."""

    def __init__(self) -> None:
        self.views: dict[int, torch.Tensor] = {}  # id(cpu view) -> neuron tensor
        self.same: dict[int, torch.Tensor] = {}  # id(neuron tensor) -> its CPU view
        self.storages: dict[int, torch.Tensor] = {}  # device address -> a neuron tensor on that storage
        self.device: torch.device | None = None  # the first neuron argument's device
        self.other: torch.device | None = None  # a second device seen (another core, or host non-scalars)

    def __call__(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            dev = x.device
            if dev not in NEURON_DEVICES:
                if self.other is None and x.dim() and not x.is_meta:
                    self.other = dev  # a host tensor that is not a 0-dim scalar
                return x
            if self.device is None:
                self.device = dev
            elif dev != self.device and self.other is None:
                self.other = dev
            v = self.same.get(id(x))  # one tensor passed twice is one CPU tensor, as on CPU (an empty
            if v is None:  # one too: CPU's overlap check refuses it as its own source)
                v = self.same[id(x)] = memory.cpu_view(x)  # may be the view another argument got (the same window)
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


def view_of(owner: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A neuron tensor laid out as the host tensor ``x`` over the storage of the neuron tensor
    ``owner``, whose memory ``x`` lies in (a view of owner's host view): a view of that storage,
    never a second owner of it (host views do not own their memory; relabelling one would leave
    the result pointing at memory ``owner`` frees, and count its bytes twice). No launch, no host op."""
    alias = torch.empty(0, dtype=x.dtype, device=owner.device)
    return torch.ops.aten.set_.source_Storage_storage_offset.redispatch(
        _CPU_KEYS, alias, owner.untyped_storage(), x.storage_offset(), x.size(), x.stride())


def result_over(x: torch.Tensor, args: Any, index: int) -> torch.Tensor:
    """A host-side computation's result ``x`` as a neuron tensor: a view of the neuron argument of
    ``args`` whose memory ``x`` lies in (:func:`view_of`: a view op's result over an input's host
    view), else ``x`` itself relabelled (:func:`memory.adopt`)."""
    st = x.untyped_storage()
    if st.nbytes():
        ptr = st.data_ptr()
        for a in args:
            if is_neuron(a) and a.untyped_storage().data_ptr() == ptr:
                return view_of(a, x)
    return memory.adopt(x, index)


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
        if _torch.is_zerotensor(x):  # an _efficientzerotensor (sgn's gradient) has no memory: materialise it
            return memory.relabel(torch.zeros(x.shape, dtype=x.dtype), index)
        owner = conv.storages.get(x.untyped_storage().data_ptr())
        if owner is not None:
            return view_of(owner, x)
        return memory.relabel(x, index)
    if isinstance(x, (list, tuple)):
        return type(x)(_back(y, conv, index) for y in x)
    return x


#: the profile torch_bridge.neuron.hostprof is recording, which times each Python-path op (set and
#: cleared by hostprof.profile(): the profiler instruments this module, which does not import it)
host_profile: Any = None


def call_traced(label: str, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, shown in torch.profiler as ``neuron::<label>`` while it records,
    its launches tied to that record (:func:`torch_bridge.profiler.traced`)."""
    prof = host_profile
    if prof is not None:  # timed as the op's Python path (torch_bridge.neuron.hostprof)
        return prof.call("python " + label, _call_traced, (label, fn, args, kwargs), {})
    return _call_traced(label, fn, args, kwargs)


def _call_traced(label: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    # the kernel's host-side results and temporaries (datapath outputs, softmax and its backward,
    # copies) come from the host cache of freed device blocks, not from pages faulted in anew
    with memory.host_scope():
        if not _torch.profiler_enabled():
            return fn(*args, **kwargs)
        return profiler.traced(label, fn, args, kwargs)



def _cpu_call(call: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> Any:
    """A Python-path op's CPU kernel (one function, for torch_bridge.hostprof to time)."""
    return call(*args, **kwargs)


# ---- the boxed fallback -----------------------------------------------------------------------
def fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    """The boxed PrivateUse1 fallback: any op without an explicit neuron kernel."""
    info = op_info(op)
    return call_traced(info.name, _run, op, info, args, kwargs)


class _Draw:
    """One random op's draw from a neuron generator (the one passed, or the device's default).

    The generator's state is (seed, offset), Philox-style: the op's CPU kernel draws from a CPU
    generator seeded with a mix of the two, and the offset then advances by the values drawn
    (the outputs' elements, in multiples of 4 as one Philox round makes). So a seed gives the
    same numbers every run, saving and restoring the state replays them, and neither CPU's
    generator nor any other device's is touched. Ops without a generator argument (dropout)
    draw from CPU's default generator, which is borrowed for the call and restored."""

    __slots__ = ("gen", "saved")

    def __init__(self, info: _OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any], cargs: list[Any],
                 ckwargs: dict[str, Any], index: int):
        pos = info.generator_pos
        gen = args[pos] if 0 <= pos < len(args) else kwargs.get("generator")
        if gen is not None:
            # a generator of another device, or a neuron one on an op that makes host tensors (its
            # key sent the op here): refused as CPU and CUDA refuse them, in their words. The first
            # read "CPU Generator does not use offset"; the second drew host values from the
            # neuron generator without a word.
            if gen.device.type != NEURON:
                raise RuntimeError(f"Expected a 'neuron' device type for generator but found '{gen.device.type}'")
            if _neuron_index(args, kwargs) is None:
                raise RuntimeError("Expected a 'cpu' device type for generator but found 'neuron'")
        else:
            gen = device_generator(index)
        self.gen = gen
        self.saved = None
        seed = host_seed(gen.initial_seed(), gen.get_offset())
        if info.name in RANDOM_WITHOUT_GENERATOR:
            self.saved = torch.default_generator.get_state()
            torch.default_generator.manual_seed(seed)
            return
        cpu = _scratch.manual_seed(seed)
        if 0 <= pos < len(cargs):
            cargs[pos] = cpu
        else:
            ckwargs["generator"] = cpu

    def done(self, result: Any) -> None:
        if self.saved is not None:
            torch.default_generator.set_state(self.saved)
        drawn = sum(t.numel() for t in flat_tensors(result, []))
        self.gen.set_offset(self.gen.get_offset() + 4 * max(1, -(-drawn // 4)))


_scratch = torch.Generator()
_MASK = (1 << 64) - 1


def host_seed(seed: int, offset: int) -> int:
    """The host generator seed a neuron draw at (``seed``, ``offset``) uses: splitmix64 of the
    two, 63 bits (manual_seed's range). Part of the device's RNG contract (tests rely on it)."""
    z = (seed + 0x9E3779B97F4A7C15 * (offset + 1)) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) >> 1


def _int_operands(a: Any, b: Any) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """Host operands ``a``, ``b`` as tensors of their int32/int64 result dtype, and its minimum
    (None for any other result dtype: nothing of theirs traps)."""
    ta, tb = (x if isinstance(x, torch.Tensor) else torch.tensor(x) for x in (a, b))
    dtype = torch.result_type(ta, tb)
    if dtype not in (torch.int32, torch.int64):
        return None
    return ta.to(dtype), tb.to(dtype), torch.iinfo(dtype).min


def _lcm_traps(a: Any, b: Any, kwargs: dict[str, Any]) -> str | None:
    """Where CPU's ``lcm`` kernel would kill the process, what it would divide: it computes
    ``a / gcd(a, b) * b`` elementwise, with a gcd that comes out -1 for the int32/int64 minimum and
    an odd number (``abs`` of the minimum is the minimum), and the minimum divided by -1 traps
    (SIGFPE). CPU crashes there too; the device refuses the call instead. None where it does not."""
    ops = _int_operands(a, b)
    if ops is None:
        return None
    ta, tb, low = ops
    at = ta == low
    if not bool(at.any()):
        return None
    bad = at & (torch.gcd(ta, tb) == -1)  # (CPU's gcd has no division that traps)
    if not bool(bad.any()):
        return None
    other = torch.broadcast_to(tb, bad.shape)[bad][0].item()
    return _trap(f"{low} / gcd({low}, {other}) = {low} / -1")


def _trunc_traps(a: Any, b: Any, kwargs: dict[str, Any]) -> str | None:
    """Where CPU's ``div(..., rounding_mode="trunc")`` would kill the process: the int32/int64
    minimum divided by -1 traps (SIGFPE; ``floor`` and the other integer divisions handle it)."""
    ops = None if kwargs.get("rounding_mode") != "trunc" else _int_operands(a, b)
    if ops is None:
        return None
    ta, tb, low = ops
    return _trap(f"{low} / -1") if bool(((ta == low) & (tb == -1)).any()) else None


def _trap(division: str) -> str:
    return f"would compute {division}, which overflows: CPU's kernel traps there (SIGFPE: the process dies on CPU too)"


#: recurrence steps a call of a polynomial below may run in all (~5 s of CPU's kernel, ~4.5 ns a step)
RECURRENCE_STEPS = 2 ** 30
_EMULATED = 1024  # steps of a polynomial's recurrence run here to find the arguments that overflow early


class _Recurrence:
    """What refuses a call of a polynomial whose CPU kernel runs a three-term recurrence once per
    degree for each element, stopping early only at a NaN: a degree of 2^62 runs for centuries, on
    CPU and on the device alike (difftest --seed 99, int64: legendre_polynomial_p with
    n = 4611686018427387904 hung the run). The steps a call would run are counted as CPU's loop
    runs them: in the op's computing dtype (integers become the default float), the degree cast to
    int64 as CPU's kernel casts it (one past int64's range makes no loop), no loop where the
    polynomial has a closed form, and each element's loop cut where its values overflow into a NaN
    (the recurrence itself run for :data:`_EMULATED` steps; past that, the polynomial's growth
    rate). Calls of more than :data:`RECURRENCE_STEPS` steps are refused; None for the rest."""

    def __init__(self, first: Callable[[torch.Tensor], torch.Tensor], step: Callable[..., torch.Tensor],
                 closed: Callable[[torch.Tensor], torch.Tensor], overflows: Callable[[torch.Tensor, float], torch.Tensor]):
        self.first, self.step, self.closed, self.overflows = first, step, closed, overflows

    def __call__(self, x: Any, n: Any, kwargs: dict[str, Any]) -> str | None:
        tx, tn = (t if isinstance(t, torch.Tensor) else torch.tensor(t) for t in (x, n))
        if tn.numel() == 0 or tx.numel() == 0 or tx.is_complex() or tn.is_complex():
            return None
        dtype = torch.result_type(x, n)
        dtype = dtype if dtype.is_floating_point else torch.get_default_dtype()
        deg = tn.to(dtype).double()
        deg = torch.where(deg.isfinite() & (deg.abs() < 2.0 ** 63), deg.trunc(), -1.0)  # (else INT64_MIN)
        steps = torch.where(deg > 1, deg - 1, 0.0)  # (degrees 0 and 1 have closed forms too)
        top = float(steps.max())
        try:
            elements = math.prod(torch.broadcast_shapes(tx.shape, tn.shape))
        except RuntimeError:
            return None  # (shapes that do not broadcast: the op's own error)
        if top * elements <= RECURRENCE_STEPS:
            return None  # (a bound of the count below, met by nearly every call)
        xs, where = torch.unique(tx.to(dtype), return_inverse=True)
        total = float(torch.minimum(steps, self._until_nan(xs)[where]).sum())
        if total <= RECURRENCE_STEPS:
            return None
        return (f"would run its recurrence {total:.3g} times (once per degree for each element, as CPU's kernel "
                f"does, which runs as long); a call may run 2^30 steps: lower the degree n (the largest here: "
                f"{top + 1:.3g})")

    def _until_nan(self, x: torch.Tensor) -> torch.Tensor:
        """For each value of ``x``, the steps its loop runs before a NaN stops it (inf: never)."""
        p, q = torch.ones_like(x), self.first(x)
        until = torch.where(q.isnan() | self.closed(x), 0.0, math.inf).double()
        for k in range(1, _EMULATED + 1):
            p, q = q, self.step(x, p, q, k)
            until = torch.where(until.isinf() & q.isnan(), float(k), until)
            if k % 64 == 0 and not bool(until.isinf().any()):
                break
        big = math.log(torch.finfo(x.dtype).max)
        return torch.where(until.isinf(), self.overflows(x.double(), big), until)


_legendre = _Recurrence(  # P_n: r = ((2k + 1) x q - k p) / (k + 1); closed at |x| = 1; grows as e^(n acosh|x|)
    lambda x: x, lambda x, p, q, k: ((k + k + 1) * x * q - k * p) / (k + 1), lambda x: x.abs() == 1,
    lambda x, big: torch.where(x.abs() > 1, big / torch.acosh(x.abs().clamp(min=1)) + 2, math.inf))
_laguerre = _Recurrence(  # L_n: r = ((2k + 1 - x) q - k p) / (k + 1); closed at 0; grows as e^(2 sqrt(-n x)) for x < 0
    lambda x: 1 - x, lambda x, p, q, k: (((k + k) + (1 - x)) * q - k * p) / (k + 1), lambda x: x == 0,
    lambda x, big: torch.where(x < 0, big * big / (4 * -x) + 2, math.inf))

# ops whose CPU kernel kills the process (integer division traps) or runs for ever for some
# arguments, which the native fast path leaves to this path -> what finds those arguments (their
# first two) and says what the call would do
_REFUSED_ARGS = {"lcm": _lcm_traps, "lcm_": _lcm_traps, "div": _trunc_traps, "div_": _trunc_traps,
                 "special_legendre_polynomial_p": _legendre, "special_laguerre_polynomial_l": _laguerre}
# ... the argument a screen reads, where only the overloads that have it can trap (div's rounding modes)
_SCREENED_ARGUMENT = {"div": "rounding_mode", "div_": "rounding_mode"}


def _reduced_dim_expanded(x: Any, dim: Any) -> bool:
    """True when ``x`` repeats elements along reduction dim ``dim`` (stride 0 over more than one)."""
    if not isinstance(x, torch.Tensor) or not isinstance(dim, int) or x.dim() == 0:
        return False
    d = dim % x.dim()
    return x.stride(d) == 0 and x.shape[d] > 1


def _arg(cargs: list[Any], ckwargs: dict[str, Any], i: int, name: str) -> Any:
    """A screen's argument: the ``i``-th positional one, else the keyword ``name``."""
    return cargs[i] if len(cargs) > i else ckwargs.get(name)


def _dense_input(cargs: list[Any], ckwargs: dict[str, Any]) -> None:
    """median.dim / nanmedian.dim: CPU's kernel reads outside its input when the input repeats
    elements along the reduced dim (an expanded tensor, stride 0: torch 2.13 returns other values
    on each call, 4.6e-41 for the median of [5, 5, 5]); those calls get a dense copy of the input,
    so the device gives the median (as CPU gives it for the same values laid out densely) and
    the same one on every call (found by difftest: nanmedian 36194534138583)."""
    dim = cargs[1] if len(cargs) > 1 else ckwargs.get("dim")
    if _reduced_dim_expanded(cargs[0], dim):
        cargs[0] = cargs[0].contiguous()


def _weight_norm_g(cargs: list[Any], ckwargs: dict[str, Any]) -> None:
    """_weight_norm_interface: CPU's kernel reads ``v.size(dim)`` elements of ``g`` and writes as
    many norms into an output shaped as ``g``, without checking that g has that many: with fewer
    it reads past g's memory, with more the rest of the norms output is left unwritten (found by
    difftest: _weight_norm_interface 141929214407897, a 0-dim g; 79453927807880, g of 6 for 3).
    Either way some values are undefined: refused in one line. So are a v empty along dim, where
    CPU's kernel divides by zero and kills the process (SIGFPE), and a v or g that is not
    contiguous, which CPU's kernel reads as if it were (other values than the same tensors made
    contiguous)."""
    v = cargs[0] if cargs else ckwargs.get("v")
    g = cargs[1] if len(cargs) > 1 else ckwargs.get("g")
    dim = cargs[2] if len(cargs) > 2 else ckwargs.get("dim", 0)
    if not (isinstance(v, torch.Tensor) and isinstance(g, torch.Tensor) and isinstance(dim, int) and v.dim()):
        return
    if dim not in (0, v.dim() - 1):
        return  # CPU's own assertion refuses it
    need = v.shape[dim]
    if need == 0:
        raise RuntimeError(f"neuron: aten::_weight_norm_interface of a v {tuple(v.shape)} empty along dim {dim}: "
                           f"CPU's kernel divides by zero there and kills the process; weight-normalize a non-empty "
                           f"weight")
    if not (v.is_contiguous() and g.is_contiguous()):
        raise RuntimeError("neuron: aten::_weight_norm_interface takes contiguous v and g (CPU's kernel reads them as "
                           "contiguous and gives other values for these strides); pass v.contiguous() and "
                           "g.contiguous()")
    if g.numel() != need:
        raise RuntimeError(f"neuron: aten::_weight_norm_interface needs g with v.size({dim}) = {need} elements "
                           f"and got {g.numel()} (CPU's kernel would read past g or leave norms unwritten: "
                           f"undefined values); give g v.size({dim}) elements, as torch.nn.utils.weight_norm does")


def _weight_norm_grads(cargs: list[Any], ckwargs: dict[str, Any]) -> None:
    """_weight_norm_interface_backward: CPU's kernel checks that saved_v, saved_g and saved_norms
    are contiguous, but reads grad_w as if it were too, and reads v.size(dim) elements of saved_g
    and saved_norms and v.numel() of grad_w without checking they hold that many (found by
    difftest --wide, seed 9111: a strided grad_w, 4.7e30 on the device where CPU gave 4.6e-41),
    and an empty saved_v kills the process. Refused in one line; a well-formed call (what
    autograd makes) gives CPU's values."""
    names = ("grad_w", "saved_v", "saved_g", "saved_norms", "dim")
    gw, v, g, norms, dim = (_arg(cargs, ckwargs, i, n) for i, n in enumerate(names))
    if not all(isinstance(t, torch.Tensor) for t in (gw, v, g, norms)) or not isinstance(dim, int) or not v.dim():
        return
    if dim not in (0, v.dim() - 1) or not (v.is_contiguous() and g.is_contiguous() and norms.is_contiguous()):
        return  # CPU's own checks refuse it
    why = None
    if v.numel() == 0:
        why = f"of an empty saved_v {tuple(v.shape)} (CPU's kernel divides by zero there and kills the process)"
    elif not gw.is_contiguous():
        why = "takes a contiguous grad_w (CPU's kernel reads it as if it were: other values)"
    elif gw.shape != v.shape:
        why = f"needs grad_w of saved_v's shape {tuple(v.shape)}, got {tuple(gw.shape)} (CPU's kernel would read past it)"
    elif g.numel() < v.shape[dim] or norms.numel() < v.shape[dim]:
        why = (f"needs saved_g and saved_norms of v.size({dim}) = {v.shape[dim]} elements, got {g.numel()} and "
               f"{norms.numel()} (CPU's kernel would read past them: undefined values)")
    if why is not None:
        raise RuntimeError(f"neuron: aten::_weight_norm_interface_backward {why}")


def _slow_conv2d_lists(cargs: list[Any], ckwargs: dict[str, Any]) -> None:
    """_slow_conv2d_backward: CPU's kernel reads two values of kernel_size, stride and padding
    (``SymInt[2]``) without the check its forward makes, so a shorter list is read past its end
    (a crash, or a padding of whatever lies there; found by difftest --wide, seeds 9103 and 9111:
    the device crashed where CPU did). Refused in one line, in the forward's words."""
    for i, name in ((3, "kernel_size"), (4, "stride"), (5, "padding")):
        v = _arg(cargs, ckwargs, i, name)
        if isinstance(v, (list, tuple)) and len(v) != 2:
            raise RuntimeError(f"neuron: aten::_slow_conv2d_backward: 2D {name} expected, got {list(v)} (CPU's "
                               f"kernel reads two values unchecked)")


def _linear_combination(cargs: list[Any], ckwargs: dict[str, Any]) -> None:
    """_compute_linear_combination (matrix_exp's): CPU's kernel sums ``coefficients.size(1)``
    matrices of ``input`` per output row and reads coefficients as a matrix of input's dtype,
    unchecked: with more columns than input has matrices, coefficients of another rank or of
    another dtype (bool read as float16), it reads past its inputs' memory (found by difftest
    --wide: 7689060658771, 198780606277640). Refused in one line."""
    x = cargs[0] if cargs else ckwargs.get("input")
    c = cargs[1] if len(cargs) > 1 else ckwargs.get("coefficients")
    if not (isinstance(x, torch.Tensor) and isinstance(c, torch.Tensor) and x.dim()):
        return
    if c.dim() != 2 or c.shape[1] > x.shape[0] or c.dtype != x.dtype:
        raise RuntimeError(f"neuron: aten::_compute_linear_combination needs 2-d coefficients of input's dtype "
                           f"({x.dtype}) and at most input.size(0) = {x.shape[0]} columns, and got {tuple(c.shape)} "
                           f"{c.dtype} (CPU's kernel would read past its inputs' memory: undefined values)")


# CPU's flash attention kernels read the last dim of these operands (position, name) as contiguous:
# the forward's query/key/value, the backward's and its out (its grad_out is read by its strides)
_FLASH_ROWS = {"_scaled_dot_product_flash_attention_for_cpu": ((0, "query"), (1, "key"), (2, "value")),
               "_scaled_dot_product_flash_attention_for_cpu_backward": ((1, "query"), (2, "key"), (3, "value"),
                                                                        (4, "out"))}


def _flash_rows(name: str) -> Any:
    """_scaled_dot_product_flash_attention_for_cpu (and its backward): CPU's kernel reads the
    last dim of query, key and value (and the backward's out) as contiguous whatever its stride,
    so a last dim of stride 2 read past the operand (4e26 in a float32 result) and one of stride 0
    (an expanded tensor) read its neighbours' values (torch 2.13; found by difftest: seed 8802,
    111498464434879: other values on each call). Those operands get a dense copy, so the device
    gives what CPU gives for the same values laid out densely, the same on every call.
    ``F.scaled_dot_product_attention`` itself never sends such operands to this kernel on CPU."""
    operands = _FLASH_ROWS[name]

    def screen(cargs: list[Any], ckwargs: dict[str, Any]) -> None:
        for i, arg in operands:
            in_args = i < len(cargs)
            t = cargs[i] if in_args else ckwargs.get(arg)
            if isinstance(t, torch.Tensor) and t.dim() and t.shape[-1] > 1 and t.stride(-1) != 1:
                if in_args:
                    cargs[i] = t.contiguous()
                else:
                    ckwargs[arg] = t.contiguous()
    return screen


_BN_ARGS = ("input", "weight", "bias", "running_mean", "running_var")


def _batch_norm_args(cargs: list[Any], ckwargs: dict[str, Any]) -> None:
    """_batch_norm_no_update: its composite calls CPU's batch_norm_cpu without the checks
    ``batch_norm`` makes first. Without running statistics it dereferences them (SIGSEGV), and
    a weight, bias or statistic of another size than the input's channels, or not floating point,
    is read past its memory (found by difftest: 8601). Refused in one line."""
    x, *rest = (cargs[i] if len(cargs) > i else ckwargs.get(n) for i, n in enumerate(_BN_ARGS))
    if not isinstance(x, torch.Tensor) or (rest[2] is None) != (rest[3] is None):
        return  # (CPU's own check refuses one statistic without the other)
    why = None
    if rest[2] is None:
        why = "needs running_mean and running_var (CPU's kernel reads them: it crashes without)"
    elif x.dim() < 2:
        why = f"needs an input of at least 2 dims (N, C, ...), got {tuple(x.shape)}"
    else:
        for name, t in zip(_BN_ARGS[1:], rest):
            if isinstance(t, torch.Tensor) and (t.numel() != x.shape[1] or not t.is_floating_point()):
                why = (f"needs a floating-point {name} of input.size(1) = {x.shape[1]} elements, got "
                       f"{tuple(t.shape)} {t.dtype} (CPU's kernel would read past it: undefined values)")
                break
    if why is not None:
        raise RuntimeError(f"neuron: aten::_batch_norm_no_update {why}")


def _batch_norm_family(name: str) -> Callable[[list[Any], dict[str, Any]], None]:
    """The native batch norms and their backwards: CPU's kernels read each statistic and the
    weight at ``input.size(1)`` places without checking that they hold that many (the public
    ``batch_norm`` checks first), so a shorter one is read past its memory (found by difftest
    --wide, seed 9103: _native_batch_norm_legit.no_stats_out with a 0-dim bias, -1.3e23 on CPU,
    other values on the device); and they dereference the running statistics an evaluation uses
    and the saved ones a training backward uses without checking they were given (SIGSEGV: the
    device crashed where CPU crashes). Both are refused in one line; what CPU computes with
    defined values (longer statistics: their first elements) is served. CPU's kernels also read a
    strided weight, bias or statistic as if it were contiguous (torch 2.13: wrong values on CPU,
    its neighbours or memory past it): a 1-D one it only reads gets a dense copy of the same
    values; the others (running statistics a training forward updates, statistics of more dims)
    are refused. An empty input's backward (CPU's kernels crash) is refused too."""
    backward = name in ("native_batch_norm_backward", "batch_norm_backward")

    def screen(cargs: list[Any], ckwargs: dict[str, Any]) -> None:
        x = _arg(cargs, ckwargs, 1 if backward else 0, "input")
        if not isinstance(x, torch.Tensor) or x.dim() < 2:
            return  # (CPU's own checks refuse it)
        if backward and x.numel() == 0:
            raise RuntimeError(f"neuron: aten::{name} of an empty input {tuple(x.shape)} (CPU's kernel crashes there)")
        if backward:
            names = _BN_BACKWARD_ARGS if name == "native_batch_norm_backward" else (*_BN_BACKWARD_ARGS[:6], "save_var")
            stats = {n: _arg(cargs, ckwargs, i, n) for i, n in enumerate(names) if i >= 2}
            train = _arg(cargs, ckwargs, 7, "update" if name == "batch_norm_backward" else "train")
            used = ("weight", "save_mean", names[6]) if train else ("weight", "running_mean", "running_var")
            needed, read_only = used[1:], used
            mode = "a training backward" if train else "an evaluation backward"
        else:
            names = _BN_ARGS
            no_stats = name == "_native_batch_norm_legit" and len(cargs) > 3 and isinstance(cargs[3], bool)
            stats = {n: (None if no_stats and i > 2 else _arg(cargs, ckwargs, i, n)) for i, n in enumerate(_BN_ARGS) if i}
            if (stats["running_mean"] is None) != (stats["running_var"] is None):
                return  # (CPU's kernel refuses one statistic without the other, in its words)
            train = False if name == "_native_batch_norm_legit_no_training" else \
                _arg(cargs, ckwargs, 3 if no_stats else 5, "training")
            used = tuple(stats)
            needed, mode = () if train else ("running_mean", "running_var"), "evaluation"
            read_only = ("weight", "bias") if train else used  # (training updates the running statistics)
        why = None
        missing = [n for n in needed if stats.get(n) is None]
        if missing:
            why = f"needs {' and '.join(missing)} for {mode} (CPU's kernel reads them: it crashes without)"
        else:
            c = x.shape[1]
            for n in used:
                t = stats.get(n)
                if isinstance(t, torch.Tensor) and t.numel() < c:
                    why = (f"needs a {n} of input.size(1) = {c} elements, got {tuple(t.shape)} (CPU's kernel would "
                           f"read past it: undefined values)")
                    break
        if why is None:  # strided: read as if contiguous. Only a 1-D one it only reads gets a dense copy (below)
            bad = [n for n in used if isinstance(stats.get(n), torch.Tensor) and not stats[n].is_contiguous()
                   and (stats[n].dim() != 1 or n not in read_only)]
            if bad:
                why = (f"takes a contiguous {' and '.join(bad)}{' in training' if train and not backward else ''} "
                       f"(CPU's kernel reads a strided one as if it were contiguous: other values)")
        if why is not None:
            raise RuntimeError(f"neuron: aten::{name} {why}")
        # the rest are only read: a strided one is read as if it were contiguous (CPU's values are
        # its neighbours', or past it when expanded), so it gets a dense copy of the same values
        for i, n in enumerate(names if backward else _BN_ARGS):
            t = _arg(cargs, ckwargs, i, n) if i >= (2 if backward else 1) and n in read_only else None
            if isinstance(t, torch.Tensor) and t.dim() == 1 and not t.is_contiguous():
                if i < len(cargs):
                    cargs[i] = t.contiguous()
                else:
                    ckwargs[n] = t.contiguous()
    return screen


# native_batch_norm_backward's arguments (batch_norm_backward names its seventh save_var, its eighth update)
_BN_BACKWARD_ARGS = ("grad_out", "input", "weight", "running_mean", "running_var", "save_mean", "save_invstd")
# (_native_batch_norm_legit_functional is a composite for every device: it clones the running statistics
# and calls _native_batch_norm_legit, which is screened)
_BN_FAMILY = ("native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
              "native_batch_norm_backward", "batch_norm_backward")


def _logcumsumexp_out(cargs: list[Any], ckwargs: dict[str, Any]) -> None:
    """_logcumsumexp.out: CPU's kernel writes ``self``'s dtype into the out whatever the out's dtype
    (its public ``logcumsumexp.out`` checks first): a float32 out of a float16 input gets half-precision
    bit patterns in its float32 elements and keeps its old bytes in the rest (found by difftest:
    _logcumsumexp 223123473756641, 2.1e36 where CPU's own garbage was 2.2e-41). Refused in one line,
    with the public op's check's words."""
    x, out = _arg(cargs, ckwargs, 0, "self"), ckwargs.get("out")
    if not (isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor) and out.dtype != x.dtype):
        return
    try:  # the public op's check, on empty tensors of the two dtypes, says it in CPU's words
        torch.logcumsumexp(torch.empty(0, dtype=x.dtype), 0, out=torch.empty(0, dtype=out.dtype))
        why = f"expected an out of {x.dtype}, got {out.dtype}"
    except RuntimeError as e:
        why = str(e).splitlines()[0]
    raise RuntimeError(f"neuron: aten::_logcumsumexp.out: {why} (CPU's kernel writes the input's dtype into any out; "
                       f"give an out of the input's dtype)")


# ops whose CPU kernel reads outside its inputs (or leaves outputs unwritten) for some arguments ->
# what gives it arguments it computes right (in place on the host arguments) or refuses the call
# in one line; the native fast path leaves them to this path
_HOST_SCREENS = {"median": _dense_input, "nanmedian": _dense_input, "_weight_norm_interface": _weight_norm_g,
                 "_weight_norm_interface_backward": _weight_norm_grads, "_slow_conv2d_backward": _slow_conv2d_lists,
                 "_compute_linear_combination": _linear_combination, "_batch_norm_no_update": _batch_norm_args,
                 "_logcumsumexp": _logcumsumexp_out, **{name: _batch_norm_family(name) for name in _BN_FAMILY},
                 **{name: _flash_rows(name) for name in _FLASH_ROWS}}


def screened_overloads() -> list[str]:
    """Every overload of :data:`_REFUSED_ARGS`' ops whose arguments :func:`_run` screens, and of
    :data:`_HOST_SCREENS`', as "name.overload" (the default one "name."): the native fast path
    leaves these to this path. The native batch norms (:data:`_BN_FAMILY`) stay the fast path's:
    what their screen refuses never teaches it a cost (the signature's key tells those calls
    apart: shapes, None), and the one thing the key cannot tell, a strided weight or statistic, it
    leaves to this path itself (csrc/neuron.cpp ``params_from``)."""
    out = [f"{name}.{overload if overload != 'default' else ''}" for name in _HOST_SCREENS if name not in _BN_FAMILY
           for overload in getattr(torch.ops.aten, name).overloads()]
    for name in _REFUSED_ARGS:
        packet = getattr(torch.ops.aten, name)
        needs = _SCREENED_ARGUMENT.get(name)
        for overload in packet.overloads():
            schema = _torch.op_schema(getattr(packet, overload))
            if needs is None or any(a.name == needs for a in schema.arguments):
                out.append(f"{name}.{schema.overload_name}")
    return out


def _run(op: Any, info: _OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any], bump: bool = True) -> Any:
    if bump and info.bump_lists and _written_inference(info, args, kwargs) is not None:
        return _stop_at_inference(_run, op, info, args, kwargs)  # (_foreach_copy_, out= foreach ops)
    before = written_versions(info, args, kwargs) if bump and info.bump_lists else None
    refuses = _REFUSED_ARGS.get(info.name)
    if refuses is not None and len(args) >= 2:
        why = refuses(*memory.cpu_views(args[:2]), kwargs)
        if why is not None:
            raise RuntimeError(f"neuron: aten::{info.name} {why}")
    if info.is_view:  # metadata only: a host-side op, no device kernel
        runtime().host_op(info.name)
        if info.name == "record_stream":
            return None
        return op.redispatch(_CPU_KEYS, *args, **kwargs)
    index = _device_of(args, kwargs)
    conv = _ToCpu()
    cargs = [conv(a) for a in args]
    ckwargs = {k: conv(v) for k, v in kwargs.items()}
    if conv.other is not None and conv.device is not None and info.name not in MIXED_DEVICE_OPS:
        raise_devices(conv.device, conv.other)
    screen = _HOST_SCREENS.get(info.name)
    if screen is not None:
        screen(cargs, ckwargs)
    if info.out_names:
        refuse_overlapping_out([kwargs.get(n) for n in info.out_names], _read_args(args, kwargs, info.out_names))
    fresh: dict[str, torch.Tensor] = {}
    for name in info.out_names:  # device-aliased outs cannot be resized: compute into fresh ones
        out = kwargs.get(name)
        if isinstance(out, torch.Tensor) and out.device.type == NEURON and out.numel() == 0:
            # of the out's own sizes and strides: an op that checks its out against its inputs
            # instead of resizing it refused a (0,) stand-in for a (0, 5, 1, 3) out (difftest:
            # normal.Tensor_float_out, an empty mean), and one that keeps a fitting out's strides
            # keeps these. Over a storage of the out's own size at its offset: an op that restrides
            # its out (index_copy_ on an empty view) checks the bounds CPU would check, then raises
            # CPU's error (IndexError), not a setStorage error for a 0-byte storage
            fresh[name] = ckwargs[name] = torch.empty(0, dtype=out.dtype).set_(
                torch.UntypedStorage(out.untyped_storage().nbytes()), out.storage_offset(), out.shape, out.stride())
    draw = None
    if info.random:
        draw = _Draw(info, args, kwargs, cargs, ckwargs, index)
    call = _torch.cpp_op(op)  # the C++ callable (OpOverload.__call__ adds a Python frame)
    n = len(args)
    for i in info.tensor_positions:
        if i < n and not isinstance(args[i], torch.Tensor) and isinstance(args[i], numbers.Number):
            call = op.overloadpacket  # a C++ "wrapped number" arrives as a Python scalar
            break
    try:
        try:
            result = _cpu_call(call, cargs, ckwargs)
        except RuntimeError as e:
            outs = [n for n in info.out_names if is_neuron(kwargs.get(n)) and n not in fresh]
            if "not resizable" not in str(e) or not outs:
                raise
            _refuse_grown_input([kwargs[n] for n in outs], _read_args(args, kwargs, info.out_names))
            for name in outs:  # an out= of the wrong size: let the kernel allocate, then adopt it
                fresh[name] = ckwargs[name] = torch.empty(0, dtype=kwargs[name].dtype)
            result = call(*cargs, **ckwargs)
    except NotImplementedError as e:  # no CPU kernel for these arguments: say so for neuron, in one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise NotImplementedError(f"neuron: aten::{info.name} cannot run on the neuron device with these arguments "
                                  f"({first}); run this op on CPU (move its tensors with .cpu())") from None
    if draw is not None:
        draw.done(result)
    for t in flat_tensors(result, []):
        if t.layout != torch.strided or t.is_nested or t.is_quantized:
            kind = "nested" if t.is_nested else "quantized" if t.is_quantized else str(t.layout)
            hint = QUANTIZED_HINT if t.is_quantized else NESTED_HINTS.get(info.name, "run this op on CPU (.cpu())")
            holds = "unquantized" if t.is_quantized else "dense (strided)"
            raise NotImplementedError(f"neuron: aten::{info.name} returns a {kind} tensor, and the neuron device "
                                      f"holds {holds} tensors only; {hint}")
    grown = [kwargs[name] for name, cpu_out in fresh.items() if cpu_out.shape != kwargs[name].shape]
    if grown:  # (checked before any out is written: nothing half-written)
        _refuse_grown_input(grown, _read_args(args, kwargs, info.out_names))
    for name, cpu_out in fresh.items():
        dev_out = kwargs[name]
        if cpu_out.numel() and not dev_out.untyped_storage().nbytes():  # an out without memory: it adopts
            res = memory.relabel(cpu_out, index)  # the result's (part of the op: no host op of its own)
            torch.ops.aten.set_.source_Storage_storage_offset.redispatch(
                _CPU_KEYS, dev_out, res.untyped_storage(), res.storage_offset(), res.shape, res.stride())
        else:
            _write_out(dev_out, cpu_out)
        conv.views[id(cpu_out)] = dev_out
    for name in info.out_names:  # an out= kernel may restride its outputs in place (LAPACK's
        dev_out = kwargs.get(name)  # column-major results): the neuron tensor takes the new layout
        if name in fresh or not is_neuron(dev_out):
            continue
        view = ckwargs[name]
        if view.stride() != dev_out.stride() or view.shape != dev_out.shape or \
                view.storage_offset() != dev_out.storage_offset():
            torch.ops.aten.set_.source_Storage_storage_offset.redispatch(
                _CPU_KEYS, dev_out, dev_out.untyped_storage(), view.storage_offset(), view.shape, view.stride())
    out = _back(result, conv, index)
    if before:  # (_foreach_copy_ and out= foreach ops run here)
        bump_written(before)
    rt = runtime()
    key = (op, _signature(args), _signature(tuple(kwargs.items())), _signature(out),
           lowering.out_is_self(args, kwargs, info.out_names))
    cost = _costs.get(key)
    if cost is None:
        inputs = flat_tensors(list(args) + [v for k, v in kwargs.items() if k not in info.out_names], [])
        neuron_inputs = [t for t in inputs if t.device.type == NEURON]
        specs = lowering.fused_op_specs(info.name, args, kwargs, flat_tensors(out, []))
        if specs is None:
            cost = rt.cost(lowering.op_spec(info.name, args, kwargs, neuron_inputs, flat_tensors(out, [])))
        else:  # a fused op (the eval fast paths): its kernels, launched one after the other
            cost = tuple(rt.cost(sp) for sp in specs)
        _costs[key] = cost
    if type(cost) is tuple:
        for c in cost:
            rt.charge(index, info.name, c)
    else:
        if draw is None:  # the native fast path may serve this call's signature from now on
            fastpath.teach(info.qualified, info.name, cost)
        rt.charge(index, info.name, cost)
    if info.name == "_local_scalar_dense":  # item(): the host waits for the value
        rt.device.synchronize(index)
    return out


def _read_args(args: tuple[Any, ...], kwargs: dict[str, Any], out_names: Any) -> tuple[Any, Any]:
    """What an op reads: its arguments but its out= ones (for :func:`flat_tensors`)."""
    return args, [v for k, v in kwargs.items() if k not in out_names]


def _refuse_grown_input(grown: list[torch.Tensor], reads: Any) -> None:
    """An out= that must grow and is also read by the op (``addr_`` is ``addr.out(self, .., out=self)``;
    ``cat([a, a], out=a)``): CPU grows it under the input's own tensor, so its kernel then reads memory
    it writes (addr's rows after the first read the first row's results) or refuses the overlap
    (cat). The device's first try resized the shared host view before its storage refused, so a
    second try read that view past its memory (difftest: addr_ 246918285969438, 1.1e32 where CPU
    raised). Refused in CPU's overlap words: no value here is the one CPU's write order gives.
    An out of ``grown`` is read when a tensor of ``reads`` lies in its storage, or, for an empty
    out (no memory to share), when it is that very tensor (addr_ of empty vectors)."""
    ptrs = {o.untyped_storage().data_ptr() for o in grown if o.numel()}
    for t in flat_tensors(reads, []):
        if any(t is o for o in grown) or (is_neuron(t) and t.untyped_storage().data_ptr() in ptrs):
            raise RuntimeError(OVERLAP_ERROR)


def _write_out(dev: torch.Tensor, res: torch.Tensor) -> None:
    """Put a result computed into a fresh host tensor where CPU would have written it: the out
    resized in place (its storage grown under every view of it, its offset kept, as CPU's
    resize_output does), laid out as the kernel laid the result out, then the values."""
    if dev.shape != res.shape:
        dev.resize_(res.shape)
    if not res.numel():
        return
    if dev.stride() != res.stride():  # a kernel that lays its out out itself (LAPACK's column-major results)
        extent = sum((n - 1) * st for n, st in zip(res.shape, res.stride())) + 1
        need = (dev.storage_offset() + extent) * dev.element_size()
        if need > dev.untyped_storage().nbytes():
            dev.untyped_storage().resize_(need)
        torch.ops.aten.set_.source_Storage_storage_offset.redispatch(
            _CPU_KEYS, dev, dev.untyped_storage(), dev.storage_offset(), res.shape, res.stride())
    memory.cpu_view(dev).copy_(res)


# Where a nested tensor comes from without the user asking for one: what to do instead. (The
# relabelled result failed inside PyTorch with "NestedTensorImpl doesn't support sizes".)
_ENCODER_HINT = ("nn.TransformerEncoder builds one in eval mode from a src_key_padding_mask: construct it with "
                 "enable_nested_tensor=False")
NESTED_HINTS = {"_nested_tensor_from_mask": _ENCODER_HINT, "_nested_tensor_from_padded": _ENCODER_HINT}


SPARSE_HINT = "keep sparse tensors on CPU (nn.Embedding and nn.EmbeddingBag: sparse=False gives dense gradients)"


def sparse_fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    """The boxed kernel of the neuron device's sparse dispatch keys: making or using a sparse tensor
    on neuron (a COO tensor's ``.to("neuron")``, ``sparse_coo_tensor(device="neuron")``, the
    gradient of ``nn.Embedding(sparse=True)``, any op on a CSR tensor moved there) is refused in
    one line, where PyTorch said it in 51 (no kernel for the 'Sparseneuron' backend)."""
    raise NotImplementedError(f"neuron: aten::{op_info(op).name} with a sparse tensor on the neuron device, which "
                              f"holds dense (strided) tensors only; {SPARSE_HINT}")


QUANTIZED_HINT = "keep quantized tensors on CPU, or dequantize() them first"


def nested_fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    """The boxed kernel of the neuron device's nested-tensor dispatch key: a nested tensor of the
    strided layout moved to or made on neuron (``torch.nested.nested_tensor(..., device="neuron")``)
    gets no kernel there, and each op on it said so in ~60 lines (no kernel for the
    'NestedTensorneuron' backend) or as an "Internal error ... please file an issue" (found by a
    hardening hunt); refused in one line now. The jagged layout is a Python subclass over dense
    neuron tensors and never reaches this key."""
    raise NotImplementedError(f"neuron: aten::{op_info(op).name} with a nested tensor of the strided layout on the "
                              f"neuron device, which holds dense tensors and jagged nested tensors only; make it "
                              f"with layout=torch.jagged, or keep it on CPU")


def quantized_fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    """The boxed kernel of the neuron device's quantized dispatch key: a quantized tensor
    (``torch.quantize_per_tensor``'s qint8, quint8, qint32...) moved to or made on neuron is refused
    in one line, where PyTorch said it in 52 (no kernel for the 'Quantizedneuron' backend).
    (A dynamically quantized module's own ops run on CPU views: its packed weights stay on CPU.)"""
    raise NotImplementedError(f"neuron: aten::{op_info(op).name} with a quantized tensor on the neuron device, which "
                              f"holds unquantized tensors only; {QUANTIZED_HINT}")


# (op, argument signature) -> its OpCost: skips re-deriving the kernel spec of a repeated call
_costs: dict[tuple[Any, ...], Any] = {}


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


# Ops CUDA runs with host tensors beside device ones (index tensors that stay on the host).
MIXED_DEVICE_OPS = frozenset({"index", "_unsafe_index", "index_put", "index_put_", "_index_put_impl_",
                              "_unsafe_index_put", "tensor_split", "ctc_loss", "_ctc_loss", "_ctc_loss_backward",
                              "_local_scalar_dense", "_foreach_copy", "_foreach_copy_"})


def raise_devices(a: torch.device, b: torch.device) -> None:
    """CUDA's error for an op given tensors on two devices."""
    a, b = sorted((a, b), key=str)
    raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, {a} and {b}!")


def same_device(*ts: torch.Tensor | None) -> None:
    """The device check of an explicit kernel: every tensor given on one device."""
    first = ts[0].device
    for t in ts[1:]:
        if t is not None and t.device != first:
            raise_devices(first, t.device)


def check_one_device(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The device check a composite would have made (TensorIterator's): one device, except 0-dim
    CPU tensors, which act as scalars."""
    devices = {t.device for t in flat_tensors(list(args) + list(kwargs.values()), [])
               if t.device in NEURON_DEVICES or t.dim() > 0}
    if len(devices) > 1:
        a, b = sorted(devices, key=str)[:2]
        raise_devices(a, b)


def same_device_fallback(op: Any, *args: Any, **kwargs: Any) -> Any:
    """The fallback for a claimed elementwise op (its composite's device check is the fallback's
    own, made while converting the arguments)."""
    return fallback(op, *args, **kwargs)


def foreach(op: Any, *args: Any, **kwargs: Any) -> Any:
    """A ``_foreach_*`` op whole: the CPU foreach kernel over zero-copy views, charged as one
    launch of a generic kernel over all its tensors (bytes and elements summed over each list),
    as a fused multi-tensor kernel would run. PyTorch's slow path for a backend without foreach
    kernels would split it into one device op per tensor: an AdamW step plus gradient clipping
    on the demo's 28-tensor GPT-2 was ~330 launches, and is 12 this way."""
    check_one_device(args, kwargs)
    info = op_info(op)
    return call_traced(info.name, _run_foreach, op, info, args, kwargs)


def _written_lists(info: _OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The lists a ``_foreach_*`` op writes (:attr:`_OpInfo.bump_lists`), positional or keyword."""
    return [ts for ts in (args[i] if i < len(args) else kwargs.get(name) for i, name in info.bump_lists) if ts]


def written_versions(info: _OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[int, list[Any]]:
    """Before a ``_foreach_*`` op that writes lists runs: each written tensor (by id) with its
    version and how many times the lists name it (:func:`bump_written`)."""
    seen: dict[int, list[Any]] = {}
    for t in (t for ts in _written_lists(info, args, kwargs) for t in ts if isinstance(t, torch.Tensor)):
        if t.is_inference():
            continue  # (no version counter: nothing to bump)
        got = seen.get(id(t))
        if got is None:
            seen[id(t)] = [t, t._version, 1]
        else:
            got[2] += 1
    return seen


def bump_written(before: dict[int, list[Any]]) -> None:
    """After the op: each tensor it wrote bumped up to one version per time the lists name it, as
    CPU's per-tensor loop bumps them (``before``: :func:`written_versions`). A tensor autograd saved
    and a foreach op then changed (an optimizer step between a forward and its backward) makes the
    backward refuse, as on CPU, instead of computing from the new values. An out the call already
    bumped (resized and adopted) is bumped the rest of the way. An inference tensor has no version
    to bump inside inference mode; outside it, :func:`_stop_at_inference` takes the call."""
    for t, version, times in before.values():
        missing = version + times - t._version
        if missing > 0:
            torch.autograd.graph.increment_version([t] * missing)


def _written_inference(info: _OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, int] | None:
    """(written list, position) of the first inference tensor a ``_foreach_*`` op writes outside
    inference mode, else None. CPU's loop writes and bumps each tensor in turn, and bumping an
    inference tensor there raises: the tensors before it are written (and bumped), it is written,
    the rest are not."""
    if not info.bump_lists or torch.is_inference_mode_enabled():
        return None
    for ts in _written_lists(info, args, kwargs):
        for k, t in enumerate(ts):
            if isinstance(t, torch.Tensor) and t.is_inference():
                return ts, k
    return None


def _stop_at_inference(run: Any, op: Any, info: _OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The part of a ``_foreach_*`` call CPU's loop runs before it raises (:func:`_written_inference`),
    then CPU's error: the tensors before the inference tensor bumped, every list of the written
    list's length cut after it and the call ``run`` on those (the inference tensor written too;
    its view may raise the error itself), and the error raised."""
    written, k = _written_inference(info, args, kwargs)  # type: ignore[misc]
    n = len(written)

    def cut(a: Any) -> Any:
        return type(a)(a[:k + 1]) if isinstance(a, (list, tuple)) and len(a) == n else a

    torch.autograd.graph.increment_version([t for t in written[:k] if isinstance(t, torch.Tensor)])
    run(op, info, tuple(cut(a) for a in args), {key: cut(v) for key, v in kwargs.items()}, bump=False)
    with torch.inference_mode():
        t = torch.zeros(1)
    t.add_(0)  # CPU's own error (the version counter's): an inference tensor written outside inference mode
    raise AssertionError("an inference tensor written outside inference mode did not raise")


def _run_foreach(op: Any, info: _OpInfo, args: tuple[Any, ...], kwargs: dict[str, Any], bump: bool = True) -> Any:
    if bump and info.bump_lists and _written_inference(info, args, kwargs) is not None:
        return _stop_at_inference(_run_foreach, op, info, args, kwargs)
    index = _device_of(args, kwargs)
    before = written_versions(info, args, kwargs) if bump and info.bump_lists else None
    conv = _ToCpu()
    out = _back(_cpu_call(op, [conv(a) for a in args], {k: conv(v) for k, v in kwargs.items()}), conv, index)
    if before:
        bump_written(before)
    key = (op, _signature(args), _signature(tuple(kwargs.items())))
    rt = runtime()
    cost = _costs.get(key)
    if cost is None:
        lists = [list(a) for a in args if isinstance(a, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in a)]
        cost = _costs[key] = rt.cost(lowering.fused_spec(info.name, lists, [a for a in args if is_neuron(a)],
                                                         flat_tensors(out, [])))
    fastpath.teach(info.qualified, info.name, cost)  # an in-place one: the fast path serves it from now on
    rt.charge(index, info.name, cost)
    return out


def histc(self: torch.Tensor, bins: int = 100, min: Any = 0, max: Any = 0) -> torch.Tensor:
    """``torch.histc``; of an integer tensor too, which CPU lacks and CUDA counts (Hugging Face's
    MoE code bins expert ids as int32 on accelerators): the ids are binned as fp32 (exact for
    integers below 2**24) and the counts returned in the input's dtype, as CUDA does - a cast,
    the histogram and a cast back, each charged as its kernel."""
    op = torch.ops.aten.histc.default
    if self.dtype.is_floating_point:
        return fallback(op, self, bins, min, max)
    return fallback(op, self.float(), bins, min, max).to(self.dtype)


def scaled_mm(self: torch.Tensor, mat2: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              bias: torch.Tensor | None = None, scale_result: torch.Tensor | None = None,
              out_dtype: torch.dtype | None = None, use_fast_accum: bool = False, **out: Any) -> torch.Tensor:
    """``torch._scaled_mm`` (and its out= form) with the bias's values: CPU's kernel reads the bias
    as if it were contiguous whatever its strides, so an expanded bias (stride 0, one element of
    storage) added the memory past its storage (found by difftest's long run: other values on
    each process, the device's as wrong as CPU's). A bias that is not contiguous is made so first
    (one copy, charged as one)."""
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    op = _torch.scaled_mm.out if out else _torch.scaled_mm.default
    return fallback(op, self, mat2, scale_a, scale_b, bias, scale_result, out_dtype, use_fast_accum, **out)


def host_kernel(name: str, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An explicit neuron kernel whose values ``fn`` computes from CPU views of its arguments
    (tensors on one device); the results are relabelled and the call is charged as op ``name``."""
    conv = _ToCpu()
    cargs = [conv(a) for a in args]
    ckwargs = {k: conv(v) for k, v in kwargs.items()}
    if conv.other is not None and conv.device is not None:
        raise_devices(conv.device, conv.other)
    index = (conv.device.index or 0) if conv.device is not None else _current_device()
    out = _back(fn(*cargs, **ckwargs), conv, index)
    rt = runtime()
    inputs = [t for t in flat_tensors(list(args) + list(kwargs.values()), []) if t.device.type == NEURON]
    cost = rt.cost(lowering.op_spec(name, args, kwargs, inputs, flat_tensors(out, [])))
    fastpath.teach("aten::" + name, name, cost)  # the LSTM cells: the native fast path serves the signature next
    rt.charge(index, name, cost)
    return out


# ---- TensorE ops through the native datapath -----------------------------------------------
def _matmul_time(index: int, op: str, batch: int, m: int, k: int, n: int, dtype: torch.dtype,
                 a: torch.Tensor, b: torch.Tensor) -> None:
    """Charge a matmul; the operands' memory layouts pick the kernel's operand forms
    (:func:`torch_bridge.lowering.matmul_layout`)."""
    ta, tb = lowering.matmul_layout(a, b)
    key = (batch, m, k, n, dtype, ta, tb)
    rt = runtime()
    cost = _mm_costs.get(key)
    if cost is None:
        cost = _mm_costs[key] = rt.cost(lowering.matmul_spec(batch, m, k, n, dtype, ta, tb), "empty matmul (launch only)")
    fastpath.teach(_MM_QUALIFIED.get(op, ""), op, cost)  # the fast path's mm/addmm/bmm, when it asked
    rt.charge(index, op, cost)


_MM_QUALIFIED = {"mm": "aten::mm", "addmm": "aten::addmm", "bmm": "aten::bmm"}  # (their default overloads)


# (batch, m, k, n, dtype, transpose flags) -> the matmul's OpCost (a spec is slower to build than to look up)
_mm_costs: dict[tuple[Any, ...], Any] = {}


def _mm_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0] and a.dtype == b.dtype


def _bmm_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dim() == 3 and b.dim() == 3 and a.shape[0] == b.shape[0] and a.shape[2] == b.shape[1]
            and a.dtype == b.dtype)


def _bias_ok(c: torch.Tensor, rows: tuple[int, ...]) -> bool:
    """``c`` broadcasts to the product's shape ``rows`` the way addmm/baddbmm's self may."""
    if c.dim() > len(rows):
        return False
    return all(cs in (1, rs) for cs, rs in zip(reversed(c.shape), reversed(rows)))


def mm(self: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    same_device(self, mat2)
    index = self.device.index or 0
    a, b = memory.cpu_view(self), memory.cpu_view(mat2)
    if not _mm_ok(a, b):
        return torch.mm(a, b)  # CPU's error for these operands
    p = tensore.datapath_product(tensore.matmul_f32, a, b)
    if p is not None:
        res = p.to(self.dtype)
    else:  # (off the datapath, or a non-finite product of operands that may overflow: tensore.datapath_product)
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


def _bias_bounded(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, alpha: Any, beta: Any) -> bool:
    """addmm/baddbmm's ``alpha * a @ b + beta * c`` stays finite in every order (tensore.bounded)."""
    try:
        al, be = abs(complex(alpha)), abs(complex(beta))
    except (TypeError, ValueError):
        return False
    return tensore.bounded(a.shape[-1], a, b, al, be * tensore.magnitude(c) if be else 0.0)


def _scaled_product(product: Callable[..., torch.Tensor], a: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                    alpha: Any, beta: Any) -> torch.Tensor | None:
    """addmm/baddbmm's ``alpha * a @ b + beta * c`` in fp32 on the datapath (``product``:
    tensore.matmul_f32 or bmm_f32), or None where CPU's kernel gives the values: operands off
    the datapath, a bias of another dtype, or a result that is not finite from operands whose
    products may overflow (:func:`tensore.bounded`; the native fast path's rule: it scans the
    result after the bias too)."""
    if not (tensore.on_datapath(a, b) and c.dtype == a.dtype):
        return None
    try:
        complex(alpha), complex(beta)
    except (TypeError, ValueError):
        return None  # (not numbers: CPU's kernel, and its error)
    p = _add_scaled(product(a, b), c, alpha, beta)
    return p if tensore.all_finite(p) or _bias_bounded(a, b, c, alpha, beta) else None


def addmm(self: torch.Tensor, mat1: torch.Tensor, mat2: torch.Tensor, *, beta: Any = 1, alpha: Any = 1
          ) -> torch.Tensor:
    same_device(mat1, mat2, self)
    index = mat1.device.index or 0
    a, b, c = memory.cpu_view(mat1), memory.cpu_view(mat2), memory.cpu_view(self)
    if not (_mm_ok(a, b) and _bias_ok(c, (a.shape[0], b.shape[1]))):
        return torch.addmm(c, a, b, beta=beta, alpha=alpha)  # CPU's error for these operands
    if alpha == 0 and a.dtype == torch.float32 and c.dtype == a.dtype:
        # CPU's float32 addmm is BLAS's sgemm, which never reads mat1 and mat2 when alpha == 0: an
        # inf or NaN there does not reach the result (bfloat16/float16 and baddbmm multiply it by
        # 0 and do). The result is beta * self, or zeros when beta == 0 (found by difftest)
        rows = (a.shape[0], b.shape[1])
        # (a new contiguous result, as CPU's: a transposed self's strides are not kept; found by difftest)
        res = torch.zeros(rows, dtype=a.dtype) if beta == 0 else \
            torch.empty(rows, dtype=a.dtype).copy_((c if beta == 1 else c * beta).expand(rows))
    elif (p := _scaled_product(tensore.matmul_f32, a, b, c, alpha, beta)) is not None:
        res = p.to(mat1.dtype)
    else:
        res = torch.addmm(c, a, b, beta=beta, alpha=alpha)
    _matmul_time(index, "addmm", 1, mat1.shape[0], mat1.shape[1], mat2.shape[1], mat1.dtype, mat1, mat2)
    return memory.relabel(res, index)


def bmm(self: torch.Tensor, mat2: torch.Tensor) -> torch.Tensor:
    same_device(self, mat2)
    index = self.device.index or 0
    a, b = memory.cpu_view(self), memory.cpu_view(mat2)
    if not _bmm_ok(a, b):
        return torch.bmm(a, b)  # CPU's error for these operands
    p = tensore.datapath_product(tensore.bmm_f32, a, b)
    if p is not None:
        res = p.to(self.dtype)
    else:  # (see mm)
        res = torch.bmm(a, b)
    _matmul_time(index, "bmm", self.shape[0], self.shape[1], self.shape[2], mat2.shape[2], self.dtype, self, mat2)
    return memory.relabel(res, index)


def baddbmm(self: torch.Tensor, batch1: torch.Tensor, batch2: torch.Tensor, *, beta: Any = 1, alpha: Any = 1
            ) -> torch.Tensor:
    same_device(batch1, batch2, self)
    index = batch1.device.index or 0
    a, b, c = memory.cpu_view(batch1), memory.cpu_view(batch2), memory.cpu_view(self)
    if not (_bmm_ok(a, b) and _bias_ok(c, (a.shape[0], a.shape[1], b.shape[2]))):
        return torch.baddbmm(c, a, b, beta=beta, alpha=alpha)  # CPU's error for these operands
    if (p := _scaled_product(tensore.bmm_f32, a, b, c, alpha, beta)) is not None:
        res = p.to(batch1.dtype)
    else:
        res = torch.baddbmm(c, a, b, beta=beta, alpha=alpha)
    _matmul_time(index, "baddbmm", batch1.shape[0], batch1.shape[1], batch1.shape[2], batch2.shape[2], batch1.dtype,
                 batch1, batch2)
    return memory.relabel(res, index)


# ---- out= over an input's memory ----------------------------------------------------------------
# CPU's own words (TensorIterator's partial-overlap check) for an out= over part of an input.
OVERLAP_ERROR = ("unsupported operation: some elements of the input tensor and the written-to tensor refer to a "
                 "single memory location. Please clone() the tensor before performing the operation.")


def _byte_starts(t: torch.Tensor) -> Any:
    """The sorted byte offsets, in ``t``'s storage, of each of ``t``'s elements (numpy int64)."""
    offs = np.zeros((), dtype=np.int64)
    for n, st in zip(t.shape, t.stride()):
        offs = np.add.outer(offs, np.arange(n, dtype=np.int64) * st)
    return np.sort((offs.reshape(-1) + t.storage_offset()) * t.element_size())


def byte_extent(x: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a non-empty tensor's elements span: [first, end)."""
    lo = x.storage_offset() + sum((n - 1) * s for n, s in zip(x.shape, x.stride()) if s < 0)
    hi = x.storage_offset() + sum((n - 1) * s for n, s in zip(x.shape, x.stride()) if s > 0)
    return lo * x.element_size(), (hi + 1) * x.element_size()


def partial_overlap(out: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``out`` writes some element ``t`` reads without being ``t``'s very layout: CPU's
    values then depend on the order its kernel writes in, and on its threads (triu runs its rows
    in parallel: difftest found the device's run and CPU's differing). CPU refuses this where both
    are dense (TensorIterator's check), the device everywhere: a strided out that only interleaves
    with an input's elements, never sharing one, still runs."""
    if not out.numel() or not t.numel() or out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
        return False
    if out.dtype == t.dtype and out.storage_offset() == t.storage_offset() and out.shape == t.shape and \
            all(a == b for n, a, b in zip(out.shape, out.stride(), t.stride()) if n > 1):
        return False  # the same elements in the same places: CPU's in-place case
    (a0, a1), (b0, b1) = byte_extent(out), byte_extent(t)
    if a1 <= b0 or b1 <= a0:
        return False
    w, r = _byte_starts(out), _byte_starts(t)
    # the last element of out starting before each of t's elements ends, and whether it reaches into it
    i = np.searchsorted(w, r + t.element_size(), side="left") - 1
    hit = i >= 0
    return bool(np.any(w[i[hit]] + out.element_size() > r[hit]))


def refuse_overlapping_out(outs: Any, inputs: Any) -> None:
    """Raise CPU's partial-overlap error when an out= tensor of ``outs`` overlaps a neuron tensor
    of ``inputs`` (:func:`partial_overlap`)."""
    by_storage: dict[int, list[torch.Tensor]] = {}
    for o in flat_tensors(outs, []):
        if o.device.type == NEURON and o.numel():
            by_storage.setdefault(o.untyped_storage().data_ptr(), []).append(o)
    if not by_storage:
        return
    for t in flat_tensors(inputs, []):
        if t.device.type != NEURON:
            continue
        same = by_storage.get(t.untyped_storage().data_ptr())
        if same is not None and any(partial_overlap(o, t) for o in same):
            raise RuntimeError(OVERLAP_ERROR)


def _out_dtype_error(want: torch.dtype, got: torch.dtype) -> str:
    """CPU's message for a matmul's ``out`` of dtype ``got`` where the result is ``want`` (its
    dtype names are C++'s: float, c10::Half, ...), taken from CPU's own ``mm.out`` once a pair."""
    msg = _out_dtype_errors.get((want, got))
    if msg is None:
        try:
            torch.mm(torch.zeros(1, 1, dtype=want), torch.zeros(1, 1, dtype=want), out=torch.empty(1, 1, dtype=got))
            msg = f"Expected out tensor to have dtype {want}, but got {got} instead"
        except RuntimeError as e:
            msg = str(e).splitlines()[0]
        if not msg.startswith("Expected out tensor to have dtype"):
            msg = f"Expected out tensor to have dtype {want}, but got {got} instead"
        _out_dtype_errors[(want, got)] = msg
    return msg


_out_dtype_errors: dict[tuple[torch.dtype, torch.dtype], str] = {}


def out_variant(functional: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``op.out`` from its functional kernel (a matmul's): compute, then resize ``out`` and copy
    into it. An ``out`` of another dtype than the result's is refused with CPU's error, before
    anything runs, as CPU's structured kernels refuse it (``copy_`` would have cast the result
    into it: an int32 ``out`` got truncated values)."""
    def out_kernel(*args: Any, out: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        dtypes = {a.dtype for a in args if isinstance(a, torch.Tensor)}
        if len(dtypes) == 1 and out.dtype not in dtypes:  # (mixed operands: the functional's own error)
            raise RuntimeError(_out_dtype_error(next(iter(dtypes)), out.dtype))
        refuse_overlapping_out(out, (args, kwargs))
        res = functional(*args, **kwargs)
        if out.dtype != res.dtype:
            raise RuntimeError(_out_dtype_error(res.dtype, out.dtype))
        if out.shape != res.shape:
            out.resize_(res.shape)
        memory.cpu_view(out).copy_(memory.cpu_view(res))
        return out
    return out_kernel


# ---- convolution (aten sends non-CPU/CUDA convolutions to the *_overrideable ops) -------------
_conv_memo: dict[tuple[Any, ...], list[Any]] = {}  # a convolution's call signature -> its launches' costs
_conv_memo_device: list[Any] = [None]  # the device model those costs are of


def _conv_costs(key: tuple[Any, ...], specs: Callable[[], list[Any]]) -> list[Any] | None:
    """A convolution's launches' costs (of ``specs()``), worked out once per call signature
    ``key``: the lowering reads only shapes, dtypes and the convolution's parameters, and a model
    calls each of its convolutions with the same ones every step. None while torch.compile traces
    (runtime.charge's rule: nothing is launched then)."""
    rt = runtime()
    if _torch.tracing():
        return None
    if _conv_memo_device[0] is not rt.device:
        _conv_memo.clear()
        _conv_memo_device[0] = rt.device
    costs = _conv_memo.get(key)
    if costs is None:
        costs = [rt.cost(spec) for spec in specs()]
        _conv_memo[key] = costs
    return costs


def _conv_key(*items: Any) -> tuple[Any, ...]:
    return tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else
                 tuple(x) if isinstance(x, (list, tuple)) else x for x in items)


def _conv_time(index: int, op: str, inp: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, groups: int,
               stride: Any = None, padding: Any = None, dilation: Any = None, transposed: bool = True) -> None:
    costs = _conv_costs(_conv_key("forward", inp, weight, out, groups, stride, padding, dilation, transposed),
                        lambda: lowering.conv_specs(inp, weight, out, groups, stride, padding, dilation, transposed))
    if costs is None:
        return
    if len(costs) == 1:  # the native fast path serves the signature next (csrc/neuron.cpp's fast_conv)
        fastpath.teach("aten::convolution_overrideable", op, costs[0])
    rt = runtime()
    for cost in costs:
        rt.charge(index, op, cost)


# a convolution's metadata -> CPU's output strides (CPU takes it) or (exception type, message): CPU's
# checks and layout
_conv_checked: dict[tuple[Any, ...], tuple[int, ...] | tuple[type, str]] = {}


def _check_convolution(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, *params: Any) -> tuple[int, ...]:
    """Raise what CPU's convolution raises for these arguments (channels that do not match the
    weight, a bias of the wrong size, strides or paddings of the wrong length, ...), where the
    datapath's im2col would compute something; else return the strides of CPU's output. CPU's own
    checks are the reference and no meta kernel makes all of them, so the first call of each
    signature runs CPU's convolution on the same host views (its values are dropped); later calls
    look the verdict up. The output layout is CPU's too: which memory format it picks depends on
    the backend CPU's convolution selects (the slow 2-d kernel asks ``suggest_memory_format``,
    oneDNN also takes a tensor that is channels-last contiguous only through its size-1
    dimensions, 3-d inputs differ again), so it is read off CPU's result rather than re-derived."""
    key = (tuple((t.shape, t.stride(), t.dtype) for t in (x, w, b) if t is not None), b is None, _signature(params))
    verdict = _conv_checked.get(key)
    if verdict is None:
        try:
            verdict = tuple(torch.ops.aten.convolution.default(x, w, b, *params).stride())
        except (RuntimeError, ValueError, IndexError, TypeError) as e:
            verdict = (type(e), str(e))
        _conv_checked[key] = verdict
    if verdict and isinstance(verdict[0], type):
        raise verdict[0](verdict[1])
    return verdict  # type: ignore[return-value]


all_finite = tensore.all_finite


def _cpu_dilation(x: torch.Tensor, w: torch.Tensor, dilation: Any) -> Any:
    """The dilation handed to CPU's reduced-precision convolution: 1 in the kernel's size-1
    dimensions. A size-1 kernel's dilation moves no tap (the same convolution, the same output
    size), but CPU's fp16 oneDNN kernel segfaults for some such shapes (a torch bug: x (2,4,2,1),
    w (1,4,1,1), stride 2, padding 1, dilation 2; 152 of 5,568 probed fp16 shapes, every one with a
    dilated size-1 kernel dimension, none once it is undilated)."""
    if x.dtype not in (torch.float16, torch.bfloat16) or not isinstance(dilation, (list, tuple)) or \
            len(dilation) != w.dim() - 2:
        return dilation
    return [1 if k == 1 and isinstance(d, int) and d > 1 else d for k, d in zip(w.shape[2:], dilation)]


def convolution(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, stride: Any, padding: Any,
                 dilation: Any, transposed: bool, output_padding: Any, groups: int) -> torch.Tensor:
    same_device(input, weight, bias)
    index = input.device.index or 0
    x, w = memory.cpu_view(input), memory.cpu_view(weight)
    cb = memory.cpu_view(bias) if bias is not None else None
    cpu_dilation = _cpu_dilation(x, w, dilation)
    strides = _check_convolution(x, w, cb, stride, padding, cpu_dilation, transposed, output_padding, groups)
    # im2col multiplies the weights by the zeros of the padding too, so an infinite weight made
    # NaN at the border where CPU's convolution (which skips padding) gives a number: inputs that
    # are not all finite, or whose products may overflow (tensore.bounded), take CPU's convolution
    # for their values
    if tensore.conv_on_datapath(x, w, transposed) and (cb is None or cb.dtype == x.dtype) and \
            tensore.bounded(w.numel() // w.shape[0], x, w, 1.0, 0.0 if cb is None else tensore.magnitude(cb)):
        acc = tensore.conv_f32(x, w, stride, padding, dilation, groups)
        if cb is not None:
            acc += cb.float().view(1, -1, *([1] * (acc.dim() - 2)))
        res = acc.to(input.dtype)
    else:
        res = torch.ops.aten.convolution.default(x, w, cb, stride, padding, cpu_dilation, transposed, output_padding,
                                                 groups)
    if res.stride() != strides:  # (the datapath's result is contiguous; CPU's may be channels-last)
        res = torch.empty_strided(res.shape, strides, dtype=res.dtype).copy_(res)
    _conv_time(index, "convolution", input, weight, res, groups, stride, padding, dilation, transposed)
    return memory.relabel(res, index)


def convolution_backward(grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, stride: Any,
                          padding: Any, dilation: Any, transposed: bool, output_padding: Any, groups: int,
                          output_mask: Any) -> tuple[Any, Any, Any]:
    same_device(input, grad_output, weight)
    index = input.device.index or 0
    g, x, w = memory.cpu_view(grad_output), memory.cpu_view(input), memory.cpu_view(weight)
    bias_sizes = [weight.shape[1] * groups if transposed else weight.shape[0]]
    gi, gw, gb = torch.ops.aten.convolution_backward.default(g, x, w, bias_sizes, stride, padding,
                                                            _cpu_dilation(x, w, dilation), transposed,
                                                            output_padding, groups, output_mask)
    res = tuple(memory.relabel(t, index) if t is not None else None for t in (gi, gw, gb))

    def specs() -> list[Any]:  # the input and weight gradients' kernels, then the bias gradient's
        bias = [lowering.generic_spec("convolution_backward", [grad_output], [res[2]])] if res[2] is not None else []
        return lowering.conv_backward_specs(input, weight, grad_output, groups, stride, padding, dilation, transposed,
                                            output_mask) + bias
    costs = _conv_costs(_conv_key("backward", input, weight, grad_output, groups, stride, padding, dilation,
                                  transposed, output_mask, res[2] is not None), specs)
    if costs is not None:
        op = "convolution_backward"
        fastpath.teach_many("aten::convolution_backward_overrideable", [(op, c) for c in costs])
        rt = runtime()
        for cost in costs:
            rt.charge(index, op, cost)
    return res  # type: ignore[return-value]
