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

import pytest

from trnsim import load_config
from trnsim.isa import Instruction
from trnsim.kernel import (DependencyTracker, Kernel, NativeDependencyTracker, _deptrack, reference_build,
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
         "matmul_fused": (200, 300, 600), "moe": (64, 256, 512, 4), "reduce": (300, 700), "rmsnorm": (200, 1000),
         "rmsnorm_fp8": (200, 1000), "softmax": (200, 1000), "transpose": (300, 700), "unary": (300, 700),
         "bmm_packed": (20, 11, 16, 11)}


@pytest.mark.parametrize("name", sorted(kernel_names()))
def test_every_library_kernel_same_stream(name: str) -> None:
    entry = get_kernel(name)
    shape = SMALL.get(name, entry.default_shape if name not in ("matmul", "bmm", "attention") else None)
    if shape is None:
        shape = {"matmul": (384, 256, 1030), "bmm": (2, 128, 128, 512), "attention": (1, 1, 256, 128)}[name]
    for cfg in CONFIGS:
        _assert_same(*_both(name, shape, entry.default_dtype, cfg))


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
    path = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "bench_kernels.py"
    spec = importlib.util.spec_from_file_location("bench_kernels", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(mod)
        mod.main(["--quick"])
    finally:
        sys.path.remove(str(path.parent))
    out = capsys.readouterr().out
    assert "instruction streams identical" in out
    assert "DIFFERS" not in out


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
