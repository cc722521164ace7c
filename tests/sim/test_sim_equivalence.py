"""The native event loop (``simulate(..., timeline="native")``, trnsim/native/accel/sched.c) and the simpy
processes it replaces (``timeline="simpy"``, the reference) give the same simulation: total ticks,
every instruction's ready/end/trigger tick and owner, every trace segment in the same order, and
the engines, DMA systems and HBM pipes left in the same state. On every registered library
kernel (small ragged shapes, every dtype it takes) on trn1/trn2/trn3, on several cores sharing
HBM stacks, and with TensorE's overlap and power ramp switched to their other settings.
benchmarks/bench_kernels.py checks the bench's big kernels the same way."""

from __future__ import annotations

from typing import Any

import pytest

from trnsim import load_config
from trnsim.isa import KernelError
from trnsim.kernels import get_kernel
from trnsim.sim import native_available, simulate

from test_kernel_library import NEEDS_MX, SMALL  # one small ragged shape per kernel (partial tiles, loops)

pytestmark = pytest.mark.skipif(not native_available(), reason="trnsim.native.accel._sched is not built")


def fingerprint(timelines: list[Any]) -> list[Any]:
    """Everything a run leaves that a report, trace or later booking could read."""
    out = []
    for tl in timelines:
        engines = {name: {k: v for k, v in vars(e).items() if k not in ("config", "_exec", "_cycles")}
                   for name, e in tl.engines.items()}
        dma = tl.dma
        out.append({
            "total": tl.total_ticks, "ready": tl.ready, "end": tl.end, "trigger": tl.trigger, "owner": tl.owner,
            "segments": tl.segments, "engines": engines,
            "dma": (list(dma.engine_free) if dma._level is None else [dma._level] * len(dma.engine_free)),
            "hbm": (dma.hbm.free, dma.hbm.bytes, dma.hbm.busy_ticks),
        })
    return out


def assert_same(cfg: Any, kernels: list[Any]) -> None:
    ref = fingerprint(simulate(cfg, kernels, timeline="simpy"))
    native = simulate(cfg, kernels, timeline="native")
    assert all(type(t).__name__ == "_NativeTimeline" for t in native)  # not a fallback to simpy
    got = fingerprint(native)
    for core, (r, g) in enumerate(zip(ref, got)):
        for field in r:
            assert g[field] == r[field], f"core {core}: {field} differs"
    assert len(ref) == len(got)


def library_kernels(name: str, config: str) -> list[tuple[Any, Any]]:
    """(config, kernel) of library kernel ``name`` at its small shape in every dtype it builds
    on ``config``."""
    cfg = load_config(config)
    entry = get_kernel(name)
    out = []
    for dtype in entry.dtypes:
        try:
            out.append((cfg, entry.make(SMALL[name], dtype, cfg)))
        except KernelError:  # a dtype this generation lacks (fp8 on trn1, MX before trn3)
            continue
    assert out or config == "trn1" or (name in NEEDS_MX and not cfg.core.tensor.mx_quad), \
        f"{name}: no dtype built on {config}"
    return out


@pytest.mark.parametrize("config", ["trn1", "trn2", "trn3"])
@pytest.mark.parametrize("name", sorted(SMALL))
def test_library_kernel_same_cycles(name, config):
    for cfg, kern in library_kernels(name, config):
        assert_same(cfg, [kern])


@pytest.mark.parametrize("config", ["trn2", "trn3"])
def test_cores_sharing_hbm_stacks(config):
    """Four different kernels on cores 0-3: pairs of cores share a stack's bandwidth pipe, and
    their DMA bookings interleave at equal ticks, which only the event order decides."""
    cfg = load_config(config)
    mk = [("matmul", (256, 512, 384)), ("softmax", (256, 512)), ("attention", (1, 2, 200, 64)),
          ("matmul", (256, 512, 384))]
    kernels = [get_kernel(n).make(s, get_kernel(n).default_dtype, cfg) for n, s in mk][: cfg.chip.cores]
    assert_same(cfg, kernels)


def test_idle_cores_and_empty_kernel():
    """Chip.run puts idle kernels (no instructions) on the cores before the one it runs."""
    from trnsim.kernel import Kernel

    cfg = load_config("trn2")
    kern = get_kernel("matmul").make((130, 200, 300), "bf16", cfg)
    assert_same(cfg, [Kernel("idle", cfg), Kernel("idle", cfg), kern])
    assert_same(cfg, [Kernel("idle", cfg)])
    assert_same(cfg, [])


@pytest.mark.parametrize("overrides", [
    {"core.tensor.overlap_load_stationary": "false"},
    {"core.tensor.throttle_initial_util": "0.3", "core.tensor.throttle_ramp": "2us",
     "core.tensor.throttle_idle_reset": "100ns"},
    {"core.tensor.throttle_ramp": "0ns"},
    {"core.dma.engines": "4", "core.dma.start_latency": "0ns"},
])
def test_tensor_and_dma_settings(overrides):
    """TensorE's LS gate without overlap, a ramp that resets within the kernel, no ramp; fewer
    DMA engines and no start latency (more ties at equal ticks)."""
    cfg = load_config("trn2", overrides)
    kernels = [get_kernel("matmul").make((300, 600, 700), "bf16", cfg),
               get_kernel("attention").make((1, 2, 200, 64), "bf16", cfg)]
    assert_same(cfg, kernels)


def test_the_timeline_choice_is_checked():
    cfg = load_config("trn2")
    with pytest.raises(ValueError, match="simulate: timeline must be one of auto, native, simpy, got 'fast'"):
        simulate(cfg, [], timeline="fast")
    with pytest.raises(ValueError, match="simulate: timeline must be one of"):
        simulate(cfg, [], engine="fast")  # its old name


# ---- the builder's edge log (deps / first_deps as arrays from the C tracker) -------------------
def _small(name: str = "attention", cfg: Any = None) -> Any:
    cfg = cfg or load_config("trn2")
    entry = get_kernel(name)
    return cfg, entry.make(SMALL[name], entry.default_dtype, cfg)


def _uses_log(kern: Any) -> bool:
    from trnsim.sim import _logged_edges

    return _logged_edges(kern, kern.instructions) is not None


def test_edge_log_is_taken_for_a_fresh_kernel():
    from trnsim.kernel import NativeDependencyTracker

    cfg, kern = _small()
    if not isinstance(kern._deps, NativeDependencyTracker):
        pytest.skip("the C dependency tracker is not built")
    assert _uses_log(kern)
    assert_same(cfg, [kern])


@pytest.mark.parametrize("edit", ["drop_deps", "add_dep", "first_deps", "equal_copy", "list"])
def test_edited_deps_simulate_as_edited(edit):
    """Instructions are mutable: after the build, whatever their deps / first_deps say now is
    what both simulators must run (the log is not taken unless it is provably the same)."""
    cfg, kern = _small("matmul")
    ins = kern.instructions
    before = simulate(cfg, [kern])[0].ready
    if edit == "drop_deps":
        for i in ins[len(ins) // 2:]:
            i.deps = ()
    elif edit == "add_dep":
        last = ins[-1]
        last.deps = tuple(sorted(set(last.deps) | {len(ins) - 2}))
        ins[5].deps = ins[5].deps + (0,)
    elif edit == "first_deps":
        for i in ins:
            if i.first_deps is not None:
                i.first_deps = ()  # LoadStationary waits for nothing now
    elif edit == "equal_copy":
        for i in ins:
            i.deps = tuple(list(i.deps))
    else:
        ins[3].deps = list(ins[3].deps)
    assert _uses_log(kern) == (edit == "equal_copy")
    assert_same(cfg, [kern])
    after = simulate(cfg, [kern])[0].ready
    if edit in ("drop_deps", "first_deps"):
        assert after != before  # the edit changed the schedule: the test would see a stale log


def test_spliced_and_unpickled_kernels_read_their_instructions():
    import copy
    import pickle

    cfg, kern = _small("softmax")
    k2 = copy.copy(kern)
    k2.instructions = list(kern.instructions[:-1])  # one fewer than the log has
    assert not _uses_log(k2)
    assert_same(cfg, [k2])
    k3 = pickle.loads(pickle.dumps(kern))
    assert not _uses_log(k3)
    assert fingerprint(simulate(cfg, [k3]))[0]["ready"] == fingerprint(simulate(cfg, [kern]))[0]["ready"]


# ---- costs once per cost key (Engine.cost_fields), ScalarE's table in program order ------------
def _activation_kernel() -> Any:
    from trnsim import Kernel

    k = Kernel("tables", "trn2")
    x = k.input("x", (128, 1024), "bf16")
    y = k.output("y", (128, 1024), "bf16")
    t = k.sbuf((128, 1024), "bf16")
    u = k.sbuf((128, 1024), "fp32")
    k.dma_copy(t, x)
    # the same cost key (exp on the same geometry) before and after other tables, identical
    # views repeated, a table-less function in between, and the same ops on three engines
    for fn in ("exp", "exp", "relu", "tanh", "exp", "sin", "sin", "exp", "identity", "gelu", "exp"):
        k.activation(t[:, :512], fn, t[:, :512])
        k.tensor_scalar(t[:, 512:], t[:, 512:], "multiply", 2.0)
        k.tensor_scalar(t[:, 512:], t[:, 512:], "multiply", 2.0, engine="gpsimd")
        k.tensor_copy(u[:, :256], t[:, :256], engine="scalar")
        k.tensor_copy(u[:, :256], t[:, :256])
    k.activation(t[:64, :100], "exp", t[:64, :100], reduce_op="add", reduce_res=u[:64, 0:1])
    k.dma_copy(y, t)
    return k


def test_cost_keys_keep_scalar_table_order():
    cfg = load_config("trn2")
    kern = _activation_kernel()
    assert_same(cfg, [kern])  # busy ticks, labels, lanes and ScalarE's final table
    tl = simulate(cfg, [kern])[0]
    acts = [s for s in tl.segments if s[1].startswith("Activation")]
    dur = [e - s for _, _, s, e, _ in acts]
    # exp at the same geometry costs a table switch after tanh/sin/gelu, not after exp/relu/identity
    assert dur[0] > dur[1] and dur[4] > dur[1] and dur[7] > dur[1] and dur[10] > dur[1]
    assert simulate(cfg, [kern])[0].engines["Scalar"].table == "exp_and_others"


def test_cost_key_fields_are_read_by_the_engine():
    """Every listed field exists on its type, and a subclass that overrides a cost method
    without listing its own fields gets no cache."""
    from trnsim.cores.base import ENGINE_TYPES
    from trnsim.cores.vector import VectorEngine

    for cls in ENGINE_TYPES.values():
        for t, fields in cls.cost_fields.items():
            for f in fields:
                assert f.split(".")[0] in {s for c in t.__mro__ for s in getattr(c, "__slots__", ())}, (t, f)

    class Custom(VectorEngine):
        def cycles(self, ins: Any) -> int:
            return 1

    from trnsim.isa import TensorCopy

    assert Custom.cost_key(TensorCopy) is None and VectorEngine.cost_key(TensorCopy) is not None


def test_tensor_cycles_by_operand_views_match_per_instruction():
    """A big matmul batch is numbered by its operand views first (cycles_by_shape's fast path,
    taken from 4096 instructions on): the same (LS, MM) cycles as each instruction's own."""
    from trnsim.cores.tensor import TensorEngine
    from trnsim.isa import MatMul

    cfg = load_config("trn2")
    kern = get_kernel("matmul").make((4096, 4096, 4096), "bf16", cfg)
    mm = [i for i in kern.instructions if type(i) is MatMul]
    assert len(mm) >= 4096
    te = TensorEngine(cfg)
    ids, cycles = te.cycles_by_shape(mm, False)
    assert [cycles[j] for j in ids.tolist()] == [te.shape_cycles(i) for i in mm]


def test_a_failing_cost_raises_the_first_error_in_program_order():
    """Costs are worked out per engine; when one fails, the error is still the first one in
    program order (as instruction-by-instruction costing meets it), whichever engine it is on."""
    cfg = load_config("trn2")
    kern = _activation_kernel()
    ins = kern.instructions
    early = next(i for i in ins if type(i).__name__ == "TensorScalar")
    late = [i for i in ins if type(i).__name__ == "Activation"][-1]
    early.engine = "Sync"   # no cost for a TensorScalar
    late.engine = "Vector"  # no cost for an Activation; an engine costed before Sync's
    assert early.index < late.index
    with pytest.raises(NotImplementedError, match="^Sync engine has no cost for TensorScalar$"):
        simulate(cfg, [kern], timeline="native")
