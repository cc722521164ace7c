"""The fast kernel build (C dependency tracker, batched emission in the library kernels) makes
exactly the instruction stream of the reference build (:func:`trnsim.kernel.reference_build`:
the Python tracker, one instruction at a time): every instruction's opcode, engine, operands,
deps, first_deps, load_stationary and DMA plan, on small and ragged shapes, every dtype and
transpose (fp8 double-row included), trn1/trn2/trn3."""

from __future__ import annotations

import importlib.util
import itertools
import pathlib
import pickle
import sys
from typing import Any

import pytest

from trnsim import load_config
from trnsim.isa import Instruction, KernelError
from trnsim.builder.deps import _deptrack
from trnsim.kernel import (DependencyTracker, Kernel, NativeDependencyTracker, reference_build,
                            stream_fingerprint)
from trnsim.kernels import get_kernel, kernel_names

CONFIGS = ("trn1", "trn2", "trn3")


def _slots(cls: type) -> list[str]:
    return [s for c in reversed(cls.__mro__) for s in getattr(c, "__slots__", ()) if s != "__weakref__"]


def _both(name: str, shape: tuple[int, ...], dtype: str, cfg: str, **params: object) -> tuple[Kernel, Kernel]:
    entry = get_kernel(name)
    config = load_config(cfg)
    with reference_build():
        ref = entry.make(shape, dtype, config, params)
    fast = entry.make(shape, dtype, config, params)
    return ref, fast


def _assert_same(ref: Kernel, fast: Kernel) -> None:
    assert ref.reference and not fast.reference
    assert isinstance(ref._deps, DependencyTracker)
    if _deptrack is not None:
        assert isinstance(fast._deps, NativeDependencyTracker)
    a, b = stream_fingerprint(ref), stream_fingerprint(fast)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x == y
    assert (ref.sbuf_peak_bytes, ref.psum_peak_bytes, ref.sbuf_high_water, ref.queues) == \
        (fast.sbuf_peak_bytes, fast.psum_peak_bytes, fast.sbuf_high_water, fast.queues)


MATMUL_SHAPES = [(128, 128, 128), (300, 200, 700), (257, 1100, 130), (1, 3, 1)]


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32", "fp8_e4m3"])
@pytest.mark.parametrize("ta,tb", list(itertools.product([False, True], repeat=2)))
def test_matmul_same_stream(cfg: str, dtype: str, ta: bool, tb: bool) -> None:
    for shape in MATMUL_SHAPES:
        _assert_same(*_both("matmul", shape, dtype, cfg, transpose_a=ta, transpose_b=tb))


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("dtype", ["bf16", "fp8_e4m3"])
def test_bmm_and_long_k_same_stream(cfg: str, dtype: str) -> None:
    _assert_same(*_both("bmm", (3, 130, 260, 600), dtype, cfg))
    _assert_same(*_both("bmm", (2, 64, 384, 200), dtype, cfg, transpose_a=True, transpose_b=True))
    # K long enough that the rhs block cannot stay resident: both operands stream
    _assert_same(*_both("matmul", (256, 48 * 1024 + 77, 640), dtype, cfg))


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("causal", [False, True])
def test_attention_same_stream(cfg: str, causal: bool) -> None:
    _assert_same(*_both("attention", (1, 2, 384, 64), "bf16", cfg, causal=causal))
    _assert_same(*_both("attention", (2, 1, 200, 128), "fp32", cfg, causal=causal))


SMALL = {"activation": (256, 1000), "binary": (300, 700), "conv2d": (1, 64, 10, 10, 64, 3), "dwconv2d": (1, 32, 12, 12, 3),
         "embedding": (130, 1000, 256), "foreach_fused": (3, 5000), "fused": (200, 300), "layernorm": (200, 1000),
         "matmul_fused": (200, 300, 600), "moe": (64, 256, 512, 4), "moe_backward": (64, 256, 512, 4), "reduce": (300, 700), "rmsnorm": (200, 1000),
         "rmsnorm_fp8": (200, 1000), "softmax": (200, 1000), "transpose": (300, 700), "unary": (300, 700),
         "bmm_packed": (20, 11, 16, 11),
         # the transformer kernels: a decode shape (or one 128-token block and a ragged one)
         "qkv": (1, 130, 256, 4, 1, 64), "mlp": (2, 1, 256, 384), "oproj": (1, 130, 2, 64, 256),
         "attention_tkg": (2, 4, 1, 2, 256, 64), "attention_cte": (1, 2, 1, 300, 64), "rope": (1, 2, 130, 64),
         "router_topk": (130, 256, 16), "moe_tkg": (2, 256, 256, 8),
         "mla_tkg": (2, 2, 256, 256, 64, 128)}


@pytest.mark.parametrize("name", sorted(kernel_names()))
def test_every_library_kernel_same_stream(name: str) -> None:
    entry = get_kernel(name)
    shape = SMALL.get(name, entry.default_shape if name not in ("matmul", "bmm", "attention") else None)
    if shape is None:
        shape = {"matmul": (384, 256, 1030), "bmm": (2, 128, 128, 512), "attention": (1, 1, 256, 128)}[name]
    for cfg in CONFIGS:
        try:
            pair = _both(name, shape, entry.default_dtype, cfg)
        except KernelError as e:
            # only an older generation may refuse a kernel, lacking a feature or the room it needs
            # (trn1's DMA transpose and smaller SBUF, MX matmul before NeuronCore-v4), in one line
            # naming the generation
            assert cfg != CONFIGS[-1] and cfg in str(e) and "\n" not in str(e), (cfg, str(e))
            continue
        _assert_same(*pair)


def test_user_kernel_same_stream() -> None:
    """The public builder (what users and the NKI front end call) through both trackers:
    views of every kind, a freed tile reused at the same address (the graveyard), HBM writes."""

    def build() -> Kernel:
        k = Kernel("user", "trn2")
        a = k.input("a", (256, 512), "bf16")
        out = k.output("out", (256, 512), "bf16")
        for r in range(2):
            t = k.sbuf((128, 512), "bf16")
            k.dma_copy(t, a[r * 128:(r + 1) * 128])
            k.tensor_scalar(t[:64, 100:300], t[:64, 100:300], "multiply", 2.0)
            k.activation(t[64:], "exp", t[64:])
            k.dma_copy(out[r * 128:(r + 1) * 128, :256], t[:, :256], queue=1)
            k.dma_copy(out.ap(r * 128 * 512 + 256, [[512, 128], [1, 256]]), t[:, 256:], queue=2)
            k.free(t)
        return k

    with reference_build():
        ref = build()
    _assert_same(ref, build())


def test_fingerprint_sees_every_field() -> None:
    """The fingerprint reads every slot an instruction type declares (a new field is compared
    without editing this file), and one changed edge makes two builds differ."""
    assert {"deps", "first_deps", "reads", "writes"} <= set(_slots(Instruction))
    ref, fast = _both("matmul", (300, 200, 700), "bf16", "trn2")
    assert stream_fingerprint(ref) == stream_fingerprint(fast)
    fast.instructions[20].deps = fast.instructions[20].deps[:-1]
    assert stream_fingerprint(ref) != stream_fingerprint(fast)
    fast.instructions[20].deps, fast.instructions[21].load_stationary = ref.instructions[20].deps, \
        not fast.instructions[21].load_stationary
    assert stream_fingerprint(ref) != stream_fingerprint(fast)


def test_bench_kernels_quick_checks_the_streams(capsys: pytest.CaptureFixture[str]) -> None:
    """The benchmark builds each kernel both ways and says whether the streams are identical
    (its exit status also carries a wall-clock budget, which a unit test does not assert)."""
    path = pathlib.Path(__file__).resolve().parents[2] / "benchmarks" / "bench_kernels.py"
    spec = importlib.util.spec_from_file_location("bench_kernels", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(mod)
        mod.main(["--quick", "--rounds", "2"])
    finally:
        sys.path.remove(str(path.parent))
    out = capsys.readouterr().out
    assert "instruction streams identical" in out
    assert "DIFFERS" not in out
    assert "end to end over 2 rounds: " in out and "  median " in out  # the second round timed too


def test_pickled_kernel_keeps_building_the_same_stream() -> None:
    """A kernel pickles with its tracker's state (the C one as bytes): built on after a pickle
    round trip - a new tile over a freed one's bytes, stores to the same HBM rows - it makes the
    stream an unpickled build makes."""

    def first(k: Kernel) -> None:
        a = k.input("a", (256, 512), "bf16")
        out = k.output("out", (256, 512), "bf16")
        t = k.sbuf((128, 512), "bf16")
        k.dma_copy(t, a[:128])
        k.activation(t[:, :256], "exp", t[:, :256])
        k.dma_copy(out[:128], t, queue=1)
        k.free(t)

    def then(k: Kernel) -> None:
        a, out = k.tensors["a"], k.tensors["out"]
        t = k.sbuf((128, 512), "bf16")
        k.dma_copy(t[:, 128:], a[128:, 128:])
        k.tensor_scalar(t, t, "multiply", 3.0)
        k.dma_copy(out[100:228], t, queue=2)

    whole = Kernel("p", "trn2")
    first(whole)
    then(whole)
    half = Kernel("p", "trn2")
    first(half)
    again = pickle.loads(pickle.dumps(half))
    then(again)
    assert type(again._deps) is type(whole._deps)
    assert stream_fingerprint(again) == stream_fingerprint(whole)
    assert pickle.loads(pickle.dumps(whole.instructions))[-1].deps == whole.instructions[-1].deps


@pytest.mark.parametrize("cfg", CONFIGS)
def test_conv2d_and_attention_variants_same_stream(cfg: str) -> None:
    """conv2d's cached windows and row-of-banks matmuls with a stride, padding and several
    channel tiles; attention's cached slices with several key blocks."""
    _assert_same(*_both("conv2d", (1, 160, 9, 9, 96, 3), "bf16", cfg, stride=2, padding=1))
    _assert_same(*_both("conv2d", (1, 32, 8, 8, 40, 3), "bf16", cfg, padding="same"))
    _assert_same(*_both("conv2d", (2, 64, 6, 6, 32, 1), "fp32", cfg))
    _assert_same(*_both("attention", (1, 1, 1024, 64), "bf16", cfg, kv_block=512, causal=True))


def test_pool_views_reused_across_freed_allocations_same_stream() -> None:
    """A tile pool hands out a slot's view again for the same request, and a ViewCache keeps
    its slices: a pool released and asked again (a new allocation over the freed bytes, which
    must wait for the old one's readers), a slot asked for another shape and back, a freed
    tile's bytes taken by a plain tile: the same stream as the reference build."""
    from trnsim.kernel import ViewCache

    def build() -> Kernel:
        k = Kernel("pools", "trn2")
        a = k.input("a", (128, 1024), "bf16")
        out = k.output("out", (128, 1024), "bf16")
        view = ViewCache(k).get
        for rnd in range(3):
            pool = k.tile_pool("p", bufs=2)
            for j in range(4):
                t = pool.tile((128, 256), "bf16")
                k.dma_copy(t, a[:, j * 256:(j + 1) * 256])
                half = view((t, 0), lambda: t[:, :128])
                k.tensor_scalar(half, half, "multiply", float(j + 1))
                k.activation(t, "exp", t)
                if j == 2:  # the slot asked for another shape, then the first again
                    u = pool.tile((128, 64), "fp32")
                    k.memset(u, 0.0)
                    k.tensor_copy(view((t, 1), lambda: t[:, :64]), u)
                k.dma_copy(out[:, j * 256:(j + 1) * 256], t, queue=1)
            pool.release()
            if rnd == 1:  # a plain tile over the pool's freed bytes
                p = k.sbuf((128, 512), "bf16")
                k.memset(p, 1.0)
                k.dma_copy(out[:, :512], p, queue=2)
                k.free(p)
        return k

    with reference_build():
        ref = build()
    fast = build()
    _assert_same(ref, fast)
    # and the reuse happened: the pool handed out its slot's view again (the reference does not)
    assert len({id(i.dst) for i in fast.instructions if i.opcode == "Activation"}) < \
        len({id(i.dst) for i in ref.instructions if i.opcode == "Activation"})


def test_cached_op_checks_still_refuse() -> None:
    """An op whose checks passed once for a geometry skips them for that geometry: a freed
    tile, another kernel's tile and a bad geometry are still refused with their messages."""
    from trnsim.isa import KernelError

    k = Kernel("checks", "trn2")
    t = k.sbuf((128, 256), "fp32")
    c = k.sbuf((128, 1), "fp32")
    k.tensor_scalar(t, t, "multiply", c)
    k.tensor_scalar(t, t, "multiply", c)
    k.activation(t, "exp", t, bias=c)
    other = Kernel("other", "trn2").sbuf((128, 256), "fp32")
    with pytest.raises(KernelError, match="belongs to another kernel"):
        k.tensor_scalar(other, other, "multiply", c)
    with pytest.raises(KernelError, match=r"operand0 'sbuf\d+' must be a per-partition \[128, 1\] tile"):
        k.tensor_scalar(t, t, "multiply", t)
    with pytest.raises(KernelError, match="shape mismatch"):
        k.tensor_copy(t[:, :128], t)
    with pytest.raises(KernelError, match="must be a number or a"):
        k.activation(t, "exp", t, bias="x")  # type: ignore[arg-type]
    # ops given as callables (the NKI front end's nl.exp, numpy's ufuncs) are known by name
    import numpy as np

    assert k.tensor_tensor(t, t, t, np.add).op == "add"
    assert k.tensor_tensor(t, t, t, "add").op == "add"
    assert k.tensor_reduce(c, np.max, t, (1,)).op == "max"
    assert k.tensor_reduce(c, "max", t, 1).axes == (1,)

    def nope(a: object, b: object) -> None: ...

    for _ in range(2):
        with pytest.raises(KernelError, match="unknown ALU op"):
            k.tensor_tensor(t, t, t, nope)
    with pytest.raises(KernelError, match="must be an integer"):
        k.tensor_reduce(c, "max", t, (1.0,))  # type: ignore[arg-type]
    k.free(t)
    with pytest.raises(KernelError, match="was freed before this instruction"):
        k.tensor_scalar(t, t, "multiply", c)
    with pytest.raises(KernelError, match="was freed before this instruction"):
        k.activation(t, "exp", t, bias=c)
    assert len(k.instructions) == 7
    # a pickled kernel drops the geometry-keyed caches (another process numbers geometries anew)
    again = pickle.loads(pickle.dumps(k))
    assert again._op_ok == {} and again._compute_ok == set()


def test_dma_plans_are_shared_across_kernels_of_one_core_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels of one core config share their copies' plans (an eager first step builds
    hundreds of small kernels moving the same shapes); a reference build plans its own, a copy
    that plan_dma refuses is refused in every kernel, a plan_dma replaced at run time is called
    again, and another core config gets plans of its own."""
    import trnsim.builder.kernel as kmod

    trn2 = load_config("trn2")

    def build(config: Any = trn2) -> Kernel:
        k = Kernel("copy", config)
        x = k.input("x", (128, 512), "bf16")
        t = k.sbuf((128, 512), "bf16")
        k.dma_copy(t, x)
        return k

    a, b = build(), build()
    assert a.instructions[0].plan is b.instructions[0].plan
    with reference_build():
        ref = build()
    assert ref.instructions[0].plan is not a.instructions[0].plan and ref.instructions[0].plan == a.instructions[0].plan
    assert build("trn3").instructions[0].plan is not a.instructions[0].plan
    for _ in range(2):
        k = Kernel("bad", trn2)
        with pytest.raises(KernelError, match="shapes must match"):
            k.dma_copy(k.sbuf((128, 256), "bf16"), k.input("x", (128, 512), "bf16"))
    calls = []

    def counted(dst, src, config):  # type: ignore[no-untyped-def]
        calls.append(1)
        return kmod.plan_dma.__wrapped__(dst, src, config)

    import trnsim.memory.dma as dma_mod

    counted.__wrapped__ = dma_mod.plan_dma  # type: ignore[attr-defined]
    monkeypatch.setattr(kmod, "plan_dma", counted)
    c = build()
    assert calls == [1] and c.instructions[0].plan == a.instructions[0].plan


def test_a_plans_engine_ticks_follow_the_engine_figures(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shared plan's engine ticks are worked out once per process for the same DMA figures:
    a config with other figures (a faster engine, more descriptor overhead) gets its own, and
    an engine_ticks replaced at run time is called again."""
    from trnsim.memory.dma import BandwidthPipe, DmaSystem

    trn2 = load_config("trn2")
    k = Kernel("copy", trn2)
    x = k.input("x", (128, 4096), "bf16")
    t = k.sbuf((128, 4096), "bf16")
    plan = k.dma_copy(t, x).plan

    def ticks(cfg: Any) -> tuple[tuple[int, int], ...]:
        return DmaSystem(cfg, BandwidthPipe(10**12, cfg.tick_hz)).engine_ticks_of(plan)

    base = ticks(trn2)
    assert ticks(trn2) is base and [e for e, _ in base] == [e for e, _, _ in plan.engines]
    d = trn2.core.dma
    fast = ticks(load_config("trn2", [f"core.dma.engine_bandwidth={2 * d.engine_bandwidth}B/s"]))
    slow = ticks(load_config("trn2", [f"core.dma.descriptor_overhead={d.descriptor_overhead + 1000}ps"]))
    assert all(f < b < s for (_, f), (_, b), (_, s) in zip(fast, base, slow))
    monkeypatch.setattr(DmaSystem, "engine_ticks", lambda self, nbytes, chunks, plan=None: 7)
    assert {t for _, t in ticks(trn2)} == {7}


def test_op_checks_are_shared_by_the_kernels_of_one_core_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """Checks that passed for an operand geometry are shared by the kernels of one core config
    (an eager first step builds hundreds of small kernels with the same geometries); ownership
    and liveness are still checked in each kernel, a reference build checks on its own, and
    another core config or another engine table has tables of its own."""
    trn2 = load_config("trn2")
    a, b = Kernel("a", trn2), Kernel("b", trn2)
    assert a._op_ok is b._op_ok and a._compute_ok is b._compute_ok and a._matmul_ok is b._matmul_ok
    with reference_build():
        ref = Kernel("ref", trn2)
    assert ref._op_ok is not a._op_ok and Kernel("c", load_config("trn3"))._op_ok is not a._op_ok
    t, c = a.sbuf((128, 256), "fp32"), a.sbuf((128, 1), "fp32")
    a.tensor_scalar(t, t, "multiply", c)
    with pytest.raises(KernelError, match="belongs to another kernel"):
        b.tensor_scalar(t, t, "multiply", c)
    u, d = b.sbuf((128, 256), "fp32"), b.sbuf((128, 1), "fp32")
    b.free(u)
    with pytest.raises(KernelError, match="was freed before this instruction"):
        b.tensor_scalar(u, u, "multiply", d)
    with pytest.raises(KernelError, match="shape mismatch"):
        b.tensor_copy(d, b.sbuf((128, 256), "fp32"))
    assert len(b.instructions) == 0 and len(a.instructions) == 1
    from trnsim.cores.base import ENGINE_TYPES
    from trnsim.cores.vector import VectorEngine

    class Other(VectorEngine):
        pass

    monkeypatch.setitem(ENGINE_TYPES, "Vector", Other)
    assert Kernel("d", trn2)._op_ok is not a._op_ok
    # a pool's checked requests are the process's: a pickled pool carries none
    pool = a.tile_pool("p", bufs=2)
    pool.tile((128, 8), "fp32")
    assert pool._checked and pickle.loads(pickle.dumps(pool))._checked == {}


def test_scalar_tensor_tensor_checks_once_and_still_refuses() -> None:
    """scalar_tensor_tensor (a depthwise convolution's op for every tap) checks an operand
    geometry once: the same instruction as the checked path, and bad calls still refused."""
    k = Kernel("stt", "trn2")
    t, u, c = k.sbuf((128, 64), "fp32"), k.sbuf((128, 64), "fp32"), k.sbuf((128, 1), "fp32")
    for _ in range(2):
        k.scalar_tensor_tensor(t, u, "multiply", c, "add", t)
        k.scalar_tensor_tensor(t, u, "multiply", 2, "add", t)
    a, b = k.instructions[-2:]
    assert (a.op0, a.op1, a.operand0, a.reads) == ("multiply", "add", c, (u, t, c))
    assert b.operand0 == 2.0 and type(b.operand0) is float and b.reads == (u, t)
    for bad, match in ((dict(operand0=True), "must be a number"), (dict(operand0=u), r"must be a per-partition"),
                       (dict(op0="bitwise_and"), "not an arithmetic op"), (dict(operand1=k.sbuf((128, 32), "fp32")),
                                                                         "shape mismatch")):
        args = dict(dst=t, data=u, op0="multiply", operand0=c, op1="add", operand1=t) | bad
        with pytest.raises(KernelError, match=match):
            k.scalar_tensor_tensor(**args)
    k.free(u)
    with pytest.raises(KernelError, match="was freed before this instruction"):
        k.scalar_tensor_tensor(t, u, "multiply", c, "add", t)
    assert len(k.instructions) == 4
