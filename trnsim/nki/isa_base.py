"""What every ``nki.isa`` instruction shares: the API's enums (``engine``, ``dge_mode``, ...), the
binding of positional and keyword arguments in both spellings, engines, masks, operand views,
destination boxes, and running an instruction now or deferring its result (:class:`Instruction`).
:mod:`trnsim.nki.isa` is the instructions themselves."""

from __future__ import annotations

import enum
from typing import Any, Callable, Sequence

import numpy as np

from ._core import NkiError, NkiTensor, Predicate, Pending, current, nki_dtype, resolve


class engine(enum.Enum):
    """Neuron device engines (``engine=`` of the instructions that may run on several)."""

    tensor = 1
    vector = 5
    scalar = 2
    gpsimd = 3
    dma = 4
    sync = 6
    unknown = 0


tensor_engine, vector_engine, scalar_engine = engine.tensor, engine.vector, engine.scalar
gpsimd_engine, unknown_engine = engine.gpsimd, engine.unknown


class dge_mode(enum.Enum):
    unknown = 0
    swdge = 1
    hwdge = 2
    none = 3


class oob_mode(enum.Enum):
    error = 0
    skip = 1


class reduce_cmd(enum.Enum):
    idle = 0
    reset = 1
    reduce = 2
    reset_reduce = 3
    load_reduce = 4


class matmul_perf_mode(enum.Enum):
    none = "none"
    double_row = "double_row"


class nc_version(enum.Enum):
    gen2 = 2
    gen3 = 3
    gen4 = 4


def get_nc_version() -> nc_version:
    """The NeuronCore generation of the chip the kernel is traced for."""
    from ..builder.kernel import core_generation

    return nc_version(core_generation(current().config))


# ---------------------------------------------------------------------------------------------
# argument handling shared by every instruction
# ---------------------------------------------------------------------------------------------

ENGINES = {engine.tensor: "tensor", engine.vector: "vector", engine.scalar: "scalar", engine.gpsimd: "gpsimd",
            engine.sync: "sync", engine.dma: "sync"}


def split_dst(args: tuple[Any, ...], kwargs: dict[str, Any], lead: int) -> tuple[NkiTensor | None, tuple[Any, ...]]:
    """(dst, the other positional args): ``dst=`` by keyword, or a first positional tensor when
    more tensors lead the call than the legacy signature starts with (``lead``)."""
    if "dst" in kwargs:
        return kwargs.pop("dst"), args
    n = 0
    while n < len(args) and isinstance(args[n], NkiTensor):
        n += 1
    if n > lead:
        return args[0], args[1:]
    return None, args


def bind(what: str, args: tuple[Any, ...], kwargs: dict[str, Any], required: Sequence[str],
          optional: dict[str, Any]) -> dict[str, Any]:
    names = list(required) + list(optional)
    if len(args) > len(names):
        raise NkiError(f"{what}: takes at most {len(names)} positional arguments, got {len(args)}")
    out = dict(optional)
    for nm, v in zip(names, args):
        out[nm] = v
    for nm, v in kwargs.items():
        if nm not in names:
            raise NkiError(f"{what}: unexpected argument '{nm}'")
        if nm in names[:len(args)]:
            raise NkiError(f"{what}: argument '{nm}' given twice")
        out[nm] = v
    missing = [nm for nm in required if nm not in out]
    if missing:
        raise NkiError(f"{what}: missing argument '{missing[0]}'")
    return out


def engine_of(x: Any, default: str, what: str) -> str:
    if x is None or x is engine.unknown:
        return default
    if isinstance(x, engine):
        if x not in ENGINES:
            raise NkiError(f"{what}: engine {x.name} cannot run this instruction")
        return ENGINES[x]
    return str(x)


def mask_box(m: Any, what: str) -> dict | None | bool:
    """The box a mask keeps ({} without a mask); False when it keeps nothing."""
    if m is None:
        return {}
    if not isinstance(m, Predicate):
        raise NkiError(f"{what}: mask must be a condition on nl.arange/nl.mgrid indices, e.g. (i_p < 64)")
    box = m.box()
    return False if box is None else box


def spread(box: dict | bool, views: Sequence[Any]) -> dict | bool:
    """A mask's ranges for every operand of the instruction: an operand indexed by the masked
    indices (``x[i_p, i_f]``) carries them; an operand of the same shape without them (a whole
    tile) takes the same ranges axis by axis, as NKI applies a mask to the instruction."""
    if not box:
        return box
    views = [v for v in views if isinstance(v, NkiTensor)]
    carrier = next((v for v in views if any(a in box for a in v._axes)), None)
    if carrier is None:
        # no operand is indexed by the mask's indices: an index from nl.arange/nl.mgrid names
        # its axis of the instruction by its place in the grid
        out = dict(box)
        for it, rng in box.items():
            if it.pos is None:
                continue
            for v in views:
                if len(v._axes) > it.pos and v._axes[it.pos].size == it.size:
                    out[v._axes[it.pos]] = rng
        return out
    out = dict(box)
    for v in views:
        if v is carrier or any(a in box for a in v._axes) or len(v._axes) != len(carrier._axes):
            continue
        for a, c in zip(v._axes, carrier._axes):
            if c in box and a.size == c.size:
                out[a] = box[c]
    return out


def tensor_arg(x: Any, what: str, name: str) -> NkiTensor:
    if not isinstance(x, NkiTensor):
        raise NkiError(f"{what}: {name} must be a tensor, got {type(x).__name__}")
    x._store()  # a deferred result gets its tile now, before this instruction
    return x


def value_arg(x: Any, what: str, name: str) -> NkiTensor | float:
    """A scalar operand: a number or a [P, 1] tensor."""
    if isinstance(x, NkiTensor):
        return tensor_arg(x, what, name)
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise NkiError(f"{what}: {name} must be a number or a [P, 1] tensor, got {type(x).__name__}")
    return float(x)


def view_ap(t: Any, box: dict, what: str) -> Any:
    return resolve(t, box, what) if isinstance(t, NkiTensor) else t


def dtype_of(x: Any, dtype: Any, what: str) -> Any:
    if dtype is not None:
        return nki_dtype(dtype, what)
    return nki_dtype(x.dtype, what)


def op_name(op: Any) -> str:
    n = getattr(op, "__name__", getattr(op, "name", op))
    return {"bypass": "identity", "amax": "max", "amin": "min"}.get(n, n)


def dst_box(d: NkiTensor, box: dict, ref: NkiTensor | None) -> dict:
    """The mask of an instruction, for its destination: the masked indices where ``d`` uses
    them, and, axis by axis, the same ranges as the operand ``ref`` it is shaped like (a result
    tile has index axes of its own)."""
    if not box:
        return box
    if ref is None or not any(a in box for a in ref._axes):
        return spread(box, [d])
    out = dict(box)
    if len(d.shape) == len(ref.shape):
        for a, r in zip(d._axes, ref._axes):
            if a not in out and r in box and a.size == r.size:
                out[a] = box[r]
    return out


def run(what: str, dst: NkiTensor | None, shape: tuple[int, ...], dtype: Any, buffer: str,
         emit: Callable[..., None], box: dict | bool, matmul: bool = False, ref: NkiTensor | None = None) -> Any:
    """Emit into ``dst`` now, or return a deferred result of ``shape`` / ``dtype`` in ``buffer``.
    A non-matmul ``emit(d, dst_box)`` writes the destination ``d`` under ``dst_box``."""
    tr = current()
    if not matmul and box is not False:
        inner = emit

        def emit(d: NkiTensor) -> None:  # type: ignore[no-redef]
            inner(d, dst_box(d, box, ref))

    if box is False:  # the mask keeps nothing: no instruction
        if dst is not None:
            return None
        return NkiTensor.full(tr.new_tile(shape, nki_dtype(dtype, what), buffer, "masked"))
    if dst is not None:
        if not isinstance(dst, NkiTensor):
            raise NkiError(f"{what}: dst must be a tensor, got {type(dst).__name__}")
        tr.flush()
        if matmul:
            from ._core import matmul_accumulates

            auto = matmul_accumulates(tr, dst)  # also records the write (and settles a deferred nl.zeros)
            emit(dst, auto if emit.accumulate is None else emit.accumulate)  # type: ignore[attr-defined]
        else:
            emit(dst)
        return Instruction(len(tr.kernel.instructions) - 1)
    p = Pending(tuple(shape), nki_dtype(dtype, what), buffer, emit, matmul, what)
    return tr.defer(NkiTensor(None, (), (), p))


class Instruction:
    """What an ISA call with ``dst`` returns: a handle for ``depends_on``."""

    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def depends_on(self, *producers: "Instruction") -> "Instruction":
        """Order this instruction after ``producers`` even where no data says so (a semaphore
        the scheduling pass keeps)."""
        tr = current()
        for p in producers:
            if not isinstance(p, Instruction):
                raise NkiError(f"depends_on: expected instructions, got {type(p).__name__}")
            tr.extra_deps.setdefault(self.index, set()).add(p.index)
        return self


def emit(fn: Callable[[], Any]) -> None:
    current().emit(fn)
