"""trnsim.native.accel._clone: the builder's instruction copies and dependency tuples in C.

A replayed block's copies and a batched record's deps must be exactly what the Python paths
make (every slot, the tuples, the tracker's log), reference counts must balance, and bad
input must be refused before anything changes."""

from __future__ import annotations

import array
import gc
import sys

import pytest

from trnsim.builder import deps as deps_mod
from trnsim.isa import DmaCopy, Instruction, MatMul
from trnsim.builder.replay import _cloner
from trnsim.kernel import Kernel, slot_names, stream_fingerprint
from trnsim.kernels import get_kernel

_clone = pytest.importorskip("trnsim.native.accel._clone")


def _slots(x: object) -> dict[str, object]:
    return {n: getattr(x, n, "<unset>") for n in slot_names(type(x))}


def _instructions() -> list[Instruction]:
    """A few instructions of different classes from a real kernel (a matmul, a DMA, a copy)."""
    k = Kernel("t", "trn2")
    a = k.input("a", (128, 128), "bf16")
    o = k.output("o", (128, 128), "fp32")
    pool = k.tile_pool("sb", 2)
    ps = k.tile_pool("ps", 1, space="psum")
    t = pool.tile((128, 128), "bf16")
    k.dma_copy(t, a[:, :])
    acc = ps.tile((128, 128), "fp32")
    k.nc_matmul(acc, t, t)
    r = pool.tile((128, 128), "fp32")
    k.tensor_copy(r, acc)
    k.dma_copy(o[:, :], r)
    return list(k.instructions)


def _results(n: int, per: list[tuple[list[int], list[int]]]) -> array.array:
    """dt_record_many's layout: 2n+1 offsets, then each one's first deps and deps."""
    offs, vals = [0], []
    for first, deps in per:
        vals += first
        offs.append(len(vals))
        vals += deps
        offs.append(len(vals))
    return array.array("i", offs + vals)


def test_replay_copies_are_the_python_clones() -> None:
    tpl = _instructions()
    firsts = bytes(type(x) is MatMul for x in tpl)
    per = [([3, 4] if f else [], [i, 100000 + i]) for i, f in enumerate(firsts)]
    dlog: list[object] = []
    flog: list[object] = []
    out = _clone.replay(tpl, firsts, 50, _results(len(tpl), per), dlog, flog)
    for i, (x, y, (first, deps)) in enumerate(zip(tpl, out, per)):
        ref = _cloner(type(x), bool(firsts[i]))(x, 50 + i, tuple(deps), tuple(first))
        assert type(y) is type(x) and y is not x
        assert _slots(y) == _slots(ref)
        assert y.index == 50 + i and y.deps == tuple(deps)
        assert y.first_deps == (tuple(first) if firsts[i] else None)
        assert not gc.is_tracked(y.deps)  # ints only: untracked, as the collector would make them
    assert dlog == [y.deps for y in out] and all(a is y.deps for a, y in zip(dlog, out))
    assert all(a is y.first_deps for a, y in zip(flog, out))
    # the shared operands gained exactly one reference per copy
    # (counted outside the asserts: pytest's rewriting keeps the operands of an assert alive)
    src = tpl[-1].src
    before = sys.getrefcount(src)
    more = _clone.replay([tpl[-1]], b"\0", 0, _results(1, [([], [])]), [], [])
    with_copy = sys.getrefcount(src)
    del more
    after = sys.getrefcount(src)
    assert (with_copy, after) == (before + 1, before)


def test_spread_sets_deps_like_python() -> None:
    ins = [x for x in _instructions() if isinstance(x, (MatMul, DmaCopy))]
    raw = array.array("i")
    for i in range(len(ins)):
        raw.extend([1, 2, 7 + i, 1, 2])
    dlog: list[object] = []
    flog: list[object] = []
    _clone.spread(ins, raw, dlog, flog)
    for i, x in enumerate(ins):
        assert x.first_deps == (7 + i,) and x.deps == (1, 2)
    assert [id(x.deps) for x in ins] == list(map(id, dlog))
    assert [id(x.first_deps) for x in ins] == list(map(id, flog))


def test_bad_input_changes_nothing() -> None:
    ins = _instructions()
    before = [_slots(x) for x in ins]
    dlog: list[object] = []
    with pytest.raises(ValueError, match="results shorter than their counts"):
        _clone.spread(ins, array.array("i", [0, 1]), dlog, [])  # the first needs one dep more
    with pytest.raises(ValueError, match="results longer"):
        _clone.spread(ins[:1], array.array("i", [0, 0, 5]), dlog, [])
    with pytest.raises(ValueError, match="offsets out of order"):
        _clone.replay(ins[:1], b"\0", 0, array.array("i", [0, 2, 1, 9, 9]), dlog, [])
    with pytest.raises(ValueError, match="one first flag per template"):
        _clone.replay(ins[:1], b"", 0, array.array("i", [0, 0, 0]), dlog, [])

    class Loose:  # instances with a __dict__: not copied word by word
        index = deps = first_deps = None

    with pytest.raises(TypeError, match="Loose is not a class of __slots__ instructions"):
        _clone.layout(Loose)
    with pytest.raises(TypeError, match="Loose"):
        _clone.spread([Loose()], array.array("i", [0, 0]), dlog, [])
    assert dlog == [] and [_slots(x) for x in ins] == before


@pytest.mark.parametrize("name,shape", [("matmul", (1024, 2048, 2048)), ("matmul", (2000, 700, 2500)),
                                        ("attention", (1, 2, 1024, 128)), ("bmm", (3, 512, 256, 700))])
def test_streams_same_without_the_module(monkeypatch: pytest.MonkeyPatch, name: str, shape: tuple[int, ...]) -> None:
    """The C copies change nothing in the stream: the same kernel built with the Python paths."""
    entry = get_kernel(name)
    fast = entry.make(shape, entry.default_dtype, "trn2")
    monkeypatch.setattr(deps_mod, "native_clone", None)  # every builder module reads it there
    slow = entry.make(shape, entry.default_dtype, "trn2")
    assert stream_fingerprint(fast) == stream_fingerprint(slow)
    assert getattr(fast, "replays", 0) == getattr(slow, "replays", 0)
    if name == "matmul":
        assert fast.replays > 0
