"""The builder's rules: argument checks (shapes, dtypes, ints, engine names), the operand
sets each instruction takes, the instruction budget, and the hardware-rule checks op builders
share (partition alignment, equal shapes, per-partition data, the core generation)."""

from __future__ import annotations

import contextlib
import gc

import numpy as np
from typing import Any, Iterator, Sequence

from ..config import ChipConfig, env_int
from ..cores.base import canonical_engine, engines_running
from ..isa import BITWISE_OPS, KernelError, TileAP, alu_op, reduce_op
from ..native.dtypes import Dtype, get_dtype



TENSORE_DTYPES = frozenset({"bfloat16", "float16", "float32", "float8_e4m3", "float8_e4m3fn", "float8_e5m2"})
FP32_MIN = -3.4028234663852886e38  # the fill value range_select takes (float32 min)
MX_DTYPES = frozenset({"float8_e5m2_x4", "float8_e4m3fn_x4", "float4_e2m1fn_x4"})
_COMPARE_OPS = frozenset({"equal", "not_equal", "greater", "greater_equal", "less", "less_equal"})
#: Instructions one kernel may hold unless TRNSIM_MAX_INSTRUCTIONS says more. Each costs about a
#: kilobyte of host memory, so a mistyped shape (a 100000^3 matmul) stops with a one-line error
#: instead of filling the host; a 16384^3 bf16 matmul has ~0.7 million.
MAX_INSTRUCTIONS = 2_000_000


def max_instructions() -> int:
    """The per-kernel instruction limit: ``TRNSIM_MAX_INSTRUCTIONS`` or :data:`MAX_INSTRUCTIONS`."""
    return env_int("TRNSIM_MAX_INSTRUCTIONS", MAX_INSTRUCTIONS, 1, 10**12, "a whole number of instructions")


#: gc_paused hands what its block made to the oldest generation (below); False lets the next young
#: collection walk it, as before (a same-run A/B of what that costs)
_HANDOFF = True


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector while a kernel is built or simulated.

    Building and simulating allocate hundreds of thousands of small, acyclic objects
    (instructions, views, accesses, events); every 700 of them the collector walks the young
    generation and, regularly, all of them - about a fifth of the time on a 42,000-instruction
    matmul. Reference counting still frees everything; cycles made meanwhile are collected by
    the next full collection. Nested uses and a collector the caller disabled are left as they were."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        if _HANDOFF and gc.get_freeze_count() == 0:
            # hand the block's objects to the oldest generation unscanned (two list splices): the
            # first young collection after it would otherwise walk every one of them (~0.5 us
            # each, a fifth of building a matmul), to find no cycles - kernels, instructions and
            # timelines are acyclic (freed by reference counting). Whatever cycles the block made
            # are found by the next full collection, as for any long-lived object. Skipped when
            # the program froze objects itself (unfreeze would thaw them).
            gc.freeze()
            gc.unfreeze()
        gc.enable()


def checked_shape(shape: Any, what: str) -> tuple[int, ...]:
    """A shape given by a user: a non-empty sequence of positive ints."""
    if type(shape) is tuple and shape and all(type(n) is int and n > 0 for n in shape):
        return shape  # already a shape: the common case, checked without copying
    if isinstance(shape, (str, bytes)) or not hasattr(shape, "__iter__"):
        raise KernelError(f"{what}: shape must be a tuple of sizes like (128, 512), got {shape!r}")
    out = tuple(shape)
    if not out or any(isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1 for n in out):
        raise KernelError(f"{what}: shape {out} must be positive integers")
    return tuple(int(n) for n in out)


def checked_dtype(dtype: Any, what: str) -> Dtype:
    try:
        return get_dtype(dtype)
    except ValueError as e:
        raise KernelError(f"{what}: {e}") from None


def checked_int(x: Any, what: str, lo: int | None = None) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or (lo is not None and x < lo):
        bound = f" >= {lo}" if lo is not None else ""
        raise KernelError(f"{what} must be an integer{bound}, got {x!r}")
    return int(x)


def checked_number(x: Any, what: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise KernelError(f"{what} must be a number, got {x!r}")
    return float(x)


def engine_name(name: str, ins_type: type, what: str) -> str:
    """The engine ``name`` means (:func:`canonical_engine`), checked to run ``ins_type`` (the
    engine table: each engine's ``runs``)."""
    canon = canonical_engine(name)
    allowed = engines_running(ins_type)
    if canon not in allowed:
        raise KernelError(f"{what}: engine {name!r} cannot run this instruction; expected one of "
                          f"{', '.join(a.lower() for a in allowed)}")
    return canon

def arith_op(op: Any, what: str) -> str:
    n = alu_op(op)
    if n in BITWISE_OPS or n in _COMPARE_OPS:
        raise KernelError(f"{what}: {op!r} is not an arithmetic op")
    return n


def core_generation(config: ChipConfig) -> int:
    """2, 3, 4 for NeuronCore-v2, -v3, -v4 (from ``core.version``)."""
    digits = "".join(ch for ch in config.core.version.rsplit("v", 1)[-1] if ch.isdigit())
    return int(digits) if digits else 0


def reduce_op_checked(op: Any, allowed: Sequence[str], what: str) -> str:
    n = reduce_op(op)
    if n not in allowed:
        raise KernelError(f"{what}: reduce op {op!r} not supported here; expected one of {', '.join(allowed)}")
    return n


def check_alignment(ap: TileAP, what: str) -> None:
    """Partition start rules of datasheet §4.6: 65-128 partitions start at 0, 33-64 at 0/64,
    1-32 at a multiple of 32."""
    n, s = ap.p_count, ap.p_start
    if n > 64:
        ok, need = s == 0, "0"
    elif n > 32:
        ok, need = s in (0, 64), "0 or 64"
    else:
        ok, need = s % 32 == 0, "0, 32, 64 or 96"
    if not ok:
        raise KernelError(f"{what}: tile '{ap.name}' covers {n} partitions starting at {s}; "
                          f"an access of {n} partitions must start at partition {need}")


def check_same_shape(what: str, dst: TileAP, src: TileAP) -> None:
    if dst.p_count != src.p_count or dst.free_size != src.free_size:
        raise KernelError(f"{what}: shape mismatch: '{dst.name}' {dst.shape} vs '{src.name}' {src.shape}")
    if dst.p_start != src.p_start:
        n = dst.p_count
        if n > 64 or (n > 32 and {dst.p_start, src.p_start} != {0, 64}):
            raise KernelError(f"{what}: moving {n} partitions from partition {src.p_start} to {dst.p_start}; "
                              f"engines shift partitions only across halves (<=64) or quadrants (<=32)")


def check_per_partition(what: str, name: str, x: TileAP, data: TileAP) -> None:
    if x.p_count != data.p_count or x.free_size != 1:
        raise KernelError(f"{what}: {name} '{x.name}' must be a per-partition [{data.p_count}, 1] tile, got {x.shape}")
