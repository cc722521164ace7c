"""softmax, layernorm, rmsnorm and rmsnorm_fp8 (trnsim/kernels/norm.py), and where the V7
shapes' simulated time sits against its floors (the V7 targets themselves are ledger rows:
validation/nki_library.yaml)."""

import numpy as np
import pytest

from trnsim.config import load_config

from trnsim import Chip, KernelError
from trnsim.kernels.norm import build_layernorm, build_rmsnorm, build_rmsnorm_fp8, build_softmax
from trnsim.kernels import get_kernel, split_spec
from trnsim.kernels.check import check_entry
from trnsim.kernels.reference import round_to

KERNELS = ("softmax", "layernorm", "rmsnorm", "rmsnorm_fp8")
SHAPES = ((1, 7), (129, 1000), (300, 4096))


@pytest.mark.parametrize("config", ("trn2", "trn3"))
@pytest.mark.parametrize("dtype", ("bf16", "fp32"))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("name", KERNELS)
def test_values_match_float64_reference(name, shape, dtype, config):
    res = check_entry(get_kernel(name), shape, dtype, config)
    assert res["ok"], res["errors"]


def test_hidden_wider_than_one_tile_takes_chunked_scalar_passes():
    # 9000 > the 4096-column scratch tile: sums and maxima are combined from per-chunk partials
    for name in ("layernorm", "rmsnorm", "rmsnorm_fp8"):
        res = check_entry(get_kernel(name), (130, 9000), "bf16", "trn2")
        assert res["ok"], (name, res["errors"])


def _run(kern, inputs, config="trn2"):
    return Chip(config).run(kern, inputs)


def test_softmax_is_stable_for_large_logits():
    x = (np.random.default_rng(1).standard_normal((128, 256)) * 1000).astype(np.float32)
    y = _run(build_softmax(128, 256, "fp32"), {"x": x})["y"].astype(np.float64)
    xd = x.astype(np.float64)
    ref = np.exp(xd - xd.max(axis=1, keepdims=True))
    ref /= ref.sum(axis=1, keepdims=True)
    assert np.all(np.isfinite(y))
    np.testing.assert_allclose(y, ref, atol=1e-6)


def test_fp8_quantization_uses_the_full_range_and_dequantizes_to_y():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((200, 512)).astype(np.float32)
    x[5] = 0.0  # an all-zero row must stay finite
    gamma = (1 + 0.25 * rng.standard_normal(512)).astype(np.float32)
    out = _run(build_rmsnorm_fp8(200, 512, "bf16"), {"x": x, "gamma": gamma})
    q = out["q"].astype(np.float64)
    scale = out["scale"].astype(np.float64)
    assert out["q"].dtype.name == "float8_e4m3" and scale.shape == (200, 1)
    assert np.all(np.isfinite(q)) and np.all(np.isfinite(scale))
    assert np.all(q[5] == 0)
    rows = np.arange(200) != 5
    # absmax scaling: each row's largest |q| is the format's largest finite value, 240
    assert np.all(np.abs(q[rows]).max(axis=1) == 240.0)
    xb, gb = round_to(x, "bf16"), round_to(gamma, "bf16")
    y = xb / np.sqrt((xb * xb).mean(axis=1, keepdims=True) + 1e-6) * gb
    err = np.abs(q * scale - y)[rows]
    # half an e4m3 step (2^-4 relative) plus bf16 rounding of x * gamma
    assert np.all(err <= (2.0**-4 + 2**-8) * np.abs(y[rows]) + 1e-3 * scale[rows])


def test_determinism_same_cycles_and_bits():
    rng = np.random.default_rng(3)
    inputs = {"x": rng.standard_normal((300, 1000)).astype(np.float32),
              "gamma": rng.standard_normal(1000).astype(np.float32),
              "beta": rng.standard_normal(1000).astype(np.float32)}
    a = _run(build_layernorm(300, 1000, "bf16"), inputs)
    b = _run(build_layernorm(300, 1000, "bf16"), inputs)
    assert a.report.total_ticks == b.report.total_ticks
    assert a["y"].tobytes() == b["y"].tobytes()


def test_written_like_an_nki_kernel():
    kern = build_rmsnorm_fp8(1024, 2048, "bf16")
    ins = kern.instructions
    dmas = [i for i in ins if type(i).__name__ == "DmaCopy"]
    gamma_loads = [i for i in dmas if getattr(i.src, "tensor", None) is kern.tensors["gamma"]]
    assert len(gamma_loads) == 1  # loaded once, broadcast across partitions
    load_q = {i.queue for i in dmas if getattr(i.src, "tensor", None) is kern.tensors["x"]}
    store_q = {i.queue for i in dmas if getattr(i.dst, "tensor", None) is kern.tensors["q"]}
    assert load_q.isdisjoint(store_q)
    acts = [i for i in ins if type(i).__name__ == "Activation"]
    assert acts and all(a.reduce_op is not None for a in acts)  # every ScalarE pass fuses its reduction
    rep = Chip("trn2").run(kern, timing_only=True).report
    busy = rep.engines["Scalar"].busy_ticks + rep.engines["Vector"].busy_ticks
    assert rep.total_ticks < 0.75 * busy  # ScalarE and VectorE overlap


@pytest.mark.parametrize("build,hidden,dtype,limit", [
    (build_rmsnorm, 60000, "fp32", None),     # one fp32 input row alone exceeds SBUF: even the wide layout fails
    (build_layernorm, 60000, "fp32", None),
    (build_softmax, 40000, "fp32", None),
])
def test_hidden_over_sbuf_is_a_one_line_error_naming_the_limit(build, hidden, dtype, limit):
    with pytest.raises(KernelError, match=r"^\w+: hidden=\d+ \w+ does not fit SBUF on trn2 \(\d+ KiB per partition "
                                          r"needed, 224 KiB available\); hidden must be <= \d+$") as e:
        build(256, hidden, dtype)
    hmax = int(str(e.value).rsplit(" ", 1)[1])
    if limit is not None:
        assert hmax <= limit
    build(256, hmax, dtype)  # the stated limit builds
    with pytest.raises(KernelError):
        build(256, hmax + 1, dtype)


def test_hidden_over_an_access_pattern_dim_is_a_one_line_error():
    with pytest.raises(KernelError, match=r"^rmsnorm: hidden=70000 exceeds the 65535 elements one access-pattern dim "
                                          r"can address \(uint16 sizes, datasheet §4.6\); hidden must be <= 65535$"):
        build_rmsnorm(256, 70000, "bf16")


@pytest.mark.parametrize("name", ["rmsnorm", "layernorm", "rmsnorm_fp8"])
def test_hidden_32768_is_tiled_not_refused(name):
    """Rows too wide for the resident layout (32768 bf16 on trn2) run wide: in-place chunks, gamma
    (and beta) resident where they fit beside two input buffers, list-scheduled; a ragged last
    row tile too."""
    from trnsim.kernels import get_kernel
    from trnsim.kernels.check import check_entry

    res = check_entry(get_kernel(name), (130, 32768), "bf16", "trn2")
    assert res["ok"], res["errors"]
    assert res["report"].sbuf_peak_bytes <= 224 * 1024
    kern = get_kernel(name).make((256, 32768), "bf16", load_config("trn2"))
    assert kern.schedule_stats.policy != "as built" or kern.schedule_stats.moved == 0


def test_bad_params_are_clear_errors():
    with pytest.raises(KernelError, match=r"^layernorm: eps must be a positive number, got 0$"):
        build_layernorm(128, 64, eps=0)
    with pytest.raises(KernelError, match=r"^rmsnorm: fp8 must be one of fp8_e4m3, fp8_e4m3fn, got 'bf16'$"):
        build_rmsnorm(128, 64, quantize=True, fp8="bf16")
    with pytest.raises(KernelError, match=r"^rmsnorm: quantize must be true or false, got 1$"):
        build_rmsnorm(128, 64, quantize=1)
    with pytest.raises(KernelError, match=r"^softmax: rows must be a positive integer, got 0$"):
        build_softmax(0, 64)
    with pytest.raises(KernelError, match=r"dtype fp16 not supported"):
        get_kernel("rmsnorm").make((128, 64), "fp16", Chip("trn2").config)


def test_lnc_split_and_v7_shape_sits_above_its_floors():
    """V7's S=2K H=8192 at LNC=2: the rows split over the two physical cores (which share one HBM
    stack), and the simulated time sits above every floor - the HBM bytes over the stack's
    bandwidth, each core's bytes over its DMA engines, the busiest engine - and within 1.5x of
    the largest (the pipeline keeps the bound engine busy; the rest is the first load and the
    last store)."""
    chip = Chip("trn2")
    cfg = chip.config
    shapes = split_spec("rmsnorm_fp8", (2048, 8192), {}, cfg.chip.lnc)
    assert shapes == [(1024, 8192), (1024, 8192)]
    reports = [r.report for r in chip.run_spmd([build_rmsnorm_fp8(s, h, "bf16", cfg) for s, h in shapes],
                                               timing_only=True)]
    hbm = sum(r.hbm_read_bytes + r.hbm_write_bytes for r in reports)
    assert hbm >= 2048 * 8192 * 3  # read 2K x 8K bf16, write it as fp8 (+ scales and the broadcast gamma)
    floors = {"HBM": hbm / (cfg.chip.hbm.bandwidth / cfg.chip.hbm.stacks) * 1e6,
              "DMA": max(r.hbm_read_bytes + r.hbm_write_bytes for r in reports)
              / (cfg.core.dma.engines * cfg.core.dma.engine_bandwidth) * 1e6,
              "ScalarE": max(r.engines["Scalar"].busy_us for r in reports),
              "VectorE": max(r.engines["Vector"].busy_us for r in reports)}
    sim = max(r.total_us for r in reports)
    assert max(floors.values()) <= sim <= 1.5 * max(floors.values())


def test_the_check_fails_a_softmax_that_writes_zeros():
    """The check's absolute tolerance is relative to the largest reference value however small:
    floored at 1, it let an all-zero bf16 softmax of 4096 columns (every value under 0.005)
    pass (a library-kernel values hunt)."""
    import dataclasses

    from trnsim.builder.kernel import Kernel

    def zeros(rows, cols, dtype="bf16", config="trn2"):
        k = Kernel("softmax_zeros", config)
        k.input("x", (rows, cols), dtype)
        y = k.output("y", (rows, cols), dtype)
        t = k.sbuf((128, cols), dtype)
        k.memset(t, 0.0)
        for r in range(0, rows, 128):
            k.dma_copy(y[r:r + 128, :], t)
        return k

    entry = get_kernel("softmax")
    assert check_entry(entry, (128, 4096), "bf16")["ok"]
    assert not check_entry(dataclasses.replace(entry, build=zeros), (128, 4096), "bf16")["ok"]
