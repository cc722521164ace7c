"""The simulator's one-pass C scan of a kernel's instructions (trnsim/native/accel/scan.c, used by
``trnsim.sim._type_column`` and the columns): numbering by the identity of each instruction's
type, engine and cost fields gives exactly the columns (costs, lanes, labels, owners, DMA plans,
edges) that the map() passes give instruction by instruction, and so the same simulation - on
every registered library kernel, every dtype, trn1/trn2/trn3, after edits to operands, engines
and queues, and with the same errors."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest

import trnsim.sim as sim
from trnsim import load_config
from trnsim.kernels import get_kernel
from trnsim.sim import native_available, simulate

from test_kernel_library import SMALL  # one small ragged shape per kernel (partial tiles, loops)
from test_sim_equivalence import assert_same, fingerprint, library_kernels

pytestmark = pytest.mark.skipif(not native_available() or sim._scan is None,
                                reason="trnsim.native.accel._sched or _scan is not built")

COLUMNS = ("engine", "kind", "busy", "lat", "ls", "owner", "plan", "dep_off", "deps", "has_first", "first_off",
           "first", "lanes", "labels", "owners")


def columns(cfg: Any, kern: Any, scan: bool, monkeypatch: Any) -> dict[str, Any]:
    """Every per-instruction column the C loop reads (costs per instruction included), with the
    scan or with the map() passes."""
    with monkeypatch.context() as m:
        if not scan:
            m.setattr(sim, "_scan", None)
        types = sim._type_column(kern, sim._ScanFields())
        assert (types[2] is not None) == scan
        tl = sim._NativeTimeline(None, cfg, kern, sim.BandwidthPipe(1e12, cfg.tick_hz), 0)
        col = sim._CoreColumns(tl, sim._Plans(), types)
    out = {name: getattr(col, name).tolist() for name in COLUMNS}
    out["queues"] = [(q, idx.tolist()) for q, idx in col.queues]
    out["hbm"] = (col.hbm_bytes, col.hbm_ticks)
    return out


def same_with_and_without_scan(cfg: Any, kern: Any, monkeypatch: Any) -> None:
    fast, slow = columns(cfg, kern, True, monkeypatch), columns(cfg, kern, False, monkeypatch)
    for name in slow:
        assert fast[name] == slow[name], f"column {name} differs"
    with monkeypatch.context() as m:
        m.setattr(sim, "_scan", None)
        ref = fingerprint(simulate(cfg, [kern], timeline="native"))
    assert fingerprint(simulate(cfg, [kern], timeline="native")) == ref
    assert_same(cfg, [kern])  # and both are the simpy reference's


@pytest.mark.parametrize("config", ["trn1", "trn2", "trn3"])
@pytest.mark.parametrize("name", sorted(SMALL))
def test_library_kernel_columns_same_with_the_scan(name, config, monkeypatch):
    for cfg, kern in library_kernels(name, config):
        same_with_and_without_scan(cfg, kern, monkeypatch)


def _edited(kind: str) -> tuple[Any, Any]:
    """A kernel edited after its build so that identity keys must tell instructions apart."""
    from trnsim.isa import DmaCopy, MatMul, TensorCopy

    cfg = load_config("trn2")
    kern = get_kernel("matmul").make((1024, 1024, 1024), "bf16", cfg)  # 128 matmuls on 64 operand pairs
    ins = kern.instructions
    mms = [i for i in ins if type(i) is MatMul]
    if kind == "equal_views":  # equal but distinct view objects: the same costs, more keys
        for i in mms[::2]:
            i.moving = copy.copy(i.moving)
    elif kind == "smaller_moving":  # one operand view replaced by a smaller one: its own cost
        m = mms[-1]
        assert any(i.stationary is m.stationary and i.moving is m.moving for i in mms[:-1])  # a known pair
        m.moving = m.moving[:, :100]
    elif kind == "flags":
        mms[1].load_stationary = not mms[1].load_stationary
        mms[2].load_stationary = 1  # equal to True, not the same object
    elif kind == "engine":  # a copy moved to another engine
        tc = [i for i in ins if type(i) is TensorCopy]
        tc[0].engine = "GpSimd"
        tc[-1].engine = "Scalar"
    elif kind == "queue":  # a DMA moved to another (new) queue
        d = [i for i in ins if isinstance(i, DmaCopy)]
        d[len(d) // 2].queue = "qEdited0"
    return cfg, kern


@pytest.mark.parametrize("kind", ["none", "equal_views", "smaller_moving", "flags", "engine", "queue"])
def test_edited_instructions_cost_as_edited(kind, monkeypatch):
    cfg, kern = _edited(kind)
    same_with_and_without_scan(cfg, kern, monkeypatch)
    if kind in ("smaller_moving", "queue"):  # the edit shows: a stale key would hide it
        _, plain = _edited("none")
        assert fingerprint(simulate(cfg, [kern]))[0]["segments"] != fingerprint(simulate(cfg, [plain]))[0]["segments"]


def test_an_unknown_engine_is_the_same_error(monkeypatch):
    cfg, kern = _edited("none")
    kern.instructions[7].engine = "Nope"
    with pytest.raises(KeyError, match="^'Nope'$"):
        simulate(cfg, [kern], timeline="native")
    monkeypatch.setattr(sim, "_scan", None)
    with pytest.raises(KeyError, match="^'Nope'$"):
        simulate(cfg, [kern], timeline="native")


def test_a_missing_operand_falls_back_to_the_map_passes(monkeypatch):
    """The scan meets an error (an operand attribute deleted): simulate() takes the map()
    passes, which meet the error where they always did."""
    from trnsim.isa import MatMul

    cfg, kern = _edited("none")
    m = next(i for i in kern.instructions if type(i) is MatMul)
    del m.moving
    assert sim._type_column(kern, sim._ScanFields())[2] is None
    with pytest.raises(AttributeError, match="moving"):
        simulate(cfg, [kern], timeline="native")


# ---- the C function itself -------------------------------------------------------------------
class Ins:
    __slots__ = ("engine", "deps", "first_deps", "a", "b")

    def __init__(self, a: Any, b: Any = None, engine: str = "E"):
        self.engine, self.deps, self.first_deps, self.a, self.b = engine, (), None, a, b


class Sub(Ins):
    __slots__ = ()


class Fresh(Ins):
    """A field that is a property returning a new object each time."""

    __slots__ = ()

    @property
    def c(self) -> list[int]:
        return [1]


class Hooked(Ins):
    """A class with its own attribute hook: the scan must not read slots behind its back."""

    __slots__ = ()

    def __getattribute__(self, name: str) -> Any:
        return "hooked" if name == "a" else object.__getattribute__(self, name)


def scan(objs: list[Any], fields: dict[type, tuple[str, ...]], dlog: Any = None, flog: Any = None
         ) -> tuple[list[int], list[int], int, int]:
    raw, first, ds, fs = sim._scan.instructions(objs, fields, dlog, flog)
    return np.frombuffer(raw, dtype=np.int32).tolist(), first, ds, fs


def test_numbered_by_identity_of_type_engine_and_fields():
    x, y = object(), object()
    objs = [Ins(x), Ins(x), Ins(y), Sub(x), Ins(x, engine="F"), Ins(x, 1), Ins(x)]
    keys, first, ds, fs = scan(objs, {Ins: ("a", "b"), Sub: ("a", "b")})
    assert keys == [0, 0, 1, 2, 3, 4, 0] and first == [0, 2, 3, 4, 5]
    assert (ds, fs) == (-1, -1)
    # a field not listed for the type is not read: Ins(x, 1) joins Ins(x)
    keys, _, _, _ = scan(objs, {Ins: ("a",), Sub: ()})
    assert keys == [0, 0, 1, 2, 3, 0, 0]
    assert scan([], {}) == ([], [], -1, -1)


def test_fields_from_a_mapping_with_missing():
    asked = []

    class Fields(dict):  # type: ignore[type-arg]
        def __missing__(self, t: type) -> tuple[str, ...]:
            asked.append(t)
            v = self[t] = ("a",)
            return v

    keys, _, _, _ = scan([Ins(1), Sub(1), Ins(1), Sub(2)], Fields())
    assert asked == [Ins, Sub] and keys == [0, 1, 0, 2]


def test_deps_checked_by_identity_up_to_the_first_difference():
    objs = [Ins(0) for _ in range(5)]
    deps = [(i,) for i in range(5)]
    for o, d in zip(objs, deps):
        o.deps = d
    objs[3].first_deps = (1,)
    _, _, ds, fs = scan(objs, {Ins: ()}, list(deps), [None, None, None, objs[3].first_deps, None])
    assert (ds, fs) == (5, 5)
    _, _, ds, fs = scan(objs, {Ins: ()}, deps[:2] + [(2,)] + deps[3:], [None] * 5)  # equal, not identical
    assert (ds, fs) == (2, 3)
    with pytest.raises(ValueError, match="a log of another length"):
        scan(objs, {Ins: ()}, deps[:4], None)


def test_fresh_objects_from_a_property_are_never_merged():
    """Each read of ``c`` makes a new list; the scan keeps each alive until it returns, so no
    two reads can share an address (and a number)."""
    objs = [Fresh(0) for _ in range(200)]
    keys, first, _, _ = scan(objs, {Fresh: ("c",)})
    assert keys == list(range(200)) and first == list(range(200))


class Borrowed:
    """A class holding another class's member descriptor: Python's lookup raises TypeError."""

    __slots__ = ("engine", "deps", "first_deps")
    a = Ins.__dict__["a"]


def test_attribute_hooks_and_errors_are_python_s():
    keys, _, _, _ = scan([Hooked(1), Hooked(2), Ins(1)], {Hooked: ("a",), Ins: ("a",)})
    assert keys == [0, 0, 1]  # both read "hooked" through the class's own __getattribute__
    empty = Ins(1)
    del empty.b
    with pytest.raises(AttributeError, match="'Ins' object has no attribute 'b'"):
        scan([Ins(1), empty], {Ins: ("a", "b")})
    b = Borrowed()
    b.engine, b.deps, b.first_deps = "E", (), None
    with pytest.raises(TypeError, match="descriptor 'a' for 'Ins' objects doesn't apply"):
        scan([b], {Borrowed: ("a",)})
    with pytest.raises(AttributeError, match="nothing"):
        scan([Ins(1)], {Ins: ("nothing",)})
    with pytest.raises(KeyError):
        scan([Ins(1)], {})
    with pytest.raises(ValueError, match="at most 8"):
        scan([Ins(1)], {Ins: ("a",) * 9})
    with pytest.raises(TypeError, match="must be lists"):
        scan((Ins(1),), {Ins: ()})  # type: ignore[arg-type]
