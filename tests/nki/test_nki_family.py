"""trnsim.nki.family: an NKI kernel as a kernel family of the device model - outputs traced from
shapes alone, values bit-identical to nki.run, the cost the kernel's own cycle report through
Device.cost (cached per signature), an LNC=2 launch (kernel[2]) split one program per physical
core, and the registry's rules for family names. No torch here: trnsim imports without it."""

import numpy as np
import pytest

import nki_kernels as K
import trnsim.nki as nki
import trnsim.nki.language as nl
from trnsim import load_config
from trnsim.device import Device
from trnsim.kernels.registry import FAMILIES, build_spec, register_family, split_spec
from trnsim.nki import NkiError, TensorSpec, tensor_spec

RNG = np.random.default_rng(3)


@nki.jit
def half_add(a, b):
    """out = a + b, each of the grid's programs adding its share of the rows, 128 at a time."""
    out = nl.ndarray(a.shape, dtype=a.dtype, buffer=nl.shared_hbm)
    per = a.shape[0] // nl.num_programs(0)
    for t in nl.affine_range(per // 128):
        r = nl.program_id(0) * per + t * 128
        nl.store(out[r:r + 128, :], value=nl.add(nl.load(a[r:r + 128, :]), nl.load(b[r:r + 128, :])))
    return out


@pytest.fixture(scope="module")
def softmax():
    return nki.family(K.fused_softmax, "test_family::softmax")


def test_outputs_come_from_shapes_alone(softmax):
    got = softmax.outputs([tensor_spec((384, 200), "bfloat16")])
    assert isinstance(got, TensorSpec) and got.shape == (384, 200) and got.dtype == "bfloat16"
    pair = nki.family(K.gelu_chain, "test_family::gelu").outputs([tensor_spec((128, 700), "float32"),
                                                                 tensor_spec((128, 1), "float32")], {"scale": 0.25})
    assert pair.shape == (128, 700)


def test_values_are_nki_runs_bit_for_bit(softmax):
    x = RNG.standard_normal((256, 300), dtype=np.float32)
    outs, written = softmax.values([x])
    assert written == {}
    np.testing.assert_array_equal(outs, nki.run(K.fused_softmax, x).outputs)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    np.testing.assert_allclose(outs, e / e.sum(axis=1, keepdims=True), rtol=2e-6, atol=1e-7)


def test_cost_is_the_kernels_own_cycle_report_cached_per_signature(softmax):
    x = RNG.standard_normal((256, 512), dtype=np.float32)
    spec = softmax.spec([x])
    assert spec.kernel == "nki:test_family::softmax" and spec.dtype == "fp32" and spec.label == "nki:fused_softmax"
    assert spec == softmax.spec([tensor_spec((256, 512), "float32")])  # values do not enter the spec
    dev = Device(load_config("trn2"))
    cost = dev.cost(spec)
    own = nki.run(K.fused_softmax, x).report
    assert cost.cores == 1 and len(cost.reports) == 1  # not on an LNC grid: one physical core
    assert cost.reports[0].total_ticks == own.total_ticks
    assert cost.ticks >= own.total_ticks  # plus what a launch adds on the logical core, never less
    assert dev.cost(spec) is cost  # simulated once per signature
    bigger = dev.cost(softmax.spec([tensor_spec((512, 512), "float32")]))
    assert bigger.ticks > cost.ticks


def test_lnc2_launch_runs_one_program_per_physical_core():
    cfg = load_config("trn2")
    assert cfg.chip.lnc == 2
    pair = nki.family(half_add[2], "test_family::half_add_lnc")
    a = RNG.standard_normal((1024, 1024), dtype=np.float32)
    b = RNG.standard_normal((1024, 1024), dtype=np.float32)
    np.testing.assert_array_equal(pair.values([a, b])[0], a + b)
    spec = pair.spec([a, b])
    assert spec.shape == (0, 2)
    assert split_spec(spec.kernel, spec.shape, dict(spec.params), 2) == [(0, 1), (1, 2)]
    cost = Device(cfg).cost(spec)
    assert cost.cores == 2
    # each physical core ran one program (half the rows): about half the grid run on one core
    whole = nki.run(half_add[2], a, b).report.total_ticks
    assert all(r.total_ticks < 0.6 * whole for r in cost.reports)
    # a grid of another size is not an LNC launch: it runs whole on one physical core
    four = nki.family(half_add[1], "test_family::half_add_one")
    assert split_spec(four.family, (0, 1), {}, 2) == [(0, 1)]


def test_written_inputs_and_unhashable_arguments():
    @nki.jit
    def double_(x):
        t = nl.load(x[0:128, :])
        nl.store(x[0:128, :], value=nl.multiply(t, 2.0))

    fam = nki.family(double_, "test_family::double_")
    x = RNG.standard_normal((128, 64), dtype=np.float32)
    assert fam.written([x]) == ["x"]
    outs, written = fam.values([x])
    assert outs is None and set(written) == {"x"}
    np.testing.assert_array_equal(written["x"].reshape(x.shape), x * 2)
    with pytest.raises(NkiError, match=r"^test_family::double_: argument 1 = list: a compile-time argument of an "
                                       r"NKI op must be hashable \(a number, string, bool, None or a tuple of them\)$"):
        fam.spec([x, [1, 2]])


def test_family_names_are_checked():
    f = nki.family(K.fused_softmax, "test_family::named")
    assert FAMILIES["nki:test_family::named"].build == f._build
    with pytest.raises(ValueError, match=r"^kernel family 'nki:test_family::named' is already registered with "
                                         r"another kernel$"):
        nki.family(K.layer_norm, "test_family::named")
    with pytest.raises(ValueError, match=r"^kernel family 'matmul': the name is a library kernel's$"):
        register_family("matmul", f._build)
    kern = build_spec(f.family, (0, 1), "fp32", load_config("trn2"),
                      {"args": (("T", (128, 64), "float32"),), "kwargs": ()})
    assert set(kern.tensors) >= {"x"}  # the traced kernel for that shape, built by the registry
