"""The device itself: registration, torch.neuron, torch.accelerator, indices, config choice."""

import os
import subprocess
import sys
import tempfile

import pytest
import torch

import torch_bridge
from torch_bridge import runtime


def test_import_torch_registers_the_device():
    assert torch._C._get_privateuse1_backend_name() == "neuron"
    assert torch.neuron.is_available()
    t = torch.ones(2).to("neuron")
    assert type(t) is torch.Tensor and t.device == torch.device("neuron", 0)
    assert t.is_neuron and t.cpu().neuron().device.type == "neuron"


def test_register_is_idempotent():
    torch_bridge.register()
    torch_bridge.register()
    assert torch.neuron.device_count() >= 1


def test_device_count_follows_logical_cores():
    cfg = torch.neuron.config()
    assert torch.neuron.device_count() == cfg.chip.cores // cfg.chip.lnc


def test_accelerator_reports_neuron_and_synchronizes():
    assert torch.accelerator.current_accelerator().type == "neuron"
    assert torch.accelerator.is_available()
    assert torch.accelerator.device_count() == torch.neuron.device_count()
    torch.ones(3, device="neuron").add_(1)
    torch.accelerator.synchronize()
    dev = runtime.runtime().device
    assert dev.host == dev.now()


def test_second_device_and_cross_device_error():
    a = torch.ones(2, device="neuron:1")
    assert a.device.index == 1 and (a * 2).device.index == 1
    assert torch.neuron.memory_allocated(1) >= 8
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch.ones(2, device="neuron:0") + a


def test_device_index_out_of_range():
    n = torch.neuron.device_count()
    with pytest.raises(RuntimeError, match=rf"^neuron:{n} does not exist: the trn2 config has {n} logical NeuronCores"):
        torch.empty(1, device=f"neuron:{n}")


def test_set_device_and_device_context():
    assert torch.neuron.current_device() == 0
    with torch.neuron.device(1):
        assert torch.neuron.current_device() == 1
    assert torch.neuron.current_device() == 0


def test_set_config_after_first_use_is_an_error():
    torch.ones(1, device="neuron")
    with pytest.raises(RuntimeError, match=r"^torch.neuron.set_config: the neuron device is already in use with "
                                           r"config 'trn2'; call set_config before"):
        torch.neuron.set_config("trn3")


def test_unsupported_op_names_itself():
    with pytest.raises(NotImplementedError, match=r"^neuron: aten::linalg_cholesky_ex cannot run on the neuron device "
                                                  r"with these arguments \(.*Half.*\); run this op on CPU"):
        torch.linalg.cholesky(torch.eye(2, dtype=torch.float16, device="neuron"))
    with pytest.raises(NotImplementedError, match=r"^neuron: aten::_to_sparse returns a torch.sparse_coo tensor, and "
                                                  r"the neuron device holds dense \(strided\) tensors only"):
        torch.ones(2, 2, device="neuron").to_sparse()


@pytest.mark.parametrize("op", ["relu", "cpu", "add", "sum"])
def test_a_strided_nested_tensor_s_ops_are_refused_in_one_line_and_jagged_ones_run(op):
    """A nested tensor of the strided layout made on neuron has no kernel there: each op said so in
    ~60 lines of PyTorch's dispatcher (found by a hardening hunt). One line now; the jagged layout,
    dense neuron tensors under a Python subclass, runs with CPU's values."""
    import warnings

    parts = [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (PyTorch's prototype warning for the strided layout)
        nt = torch.nested.nested_tensor(parts, device="neuron")
    fn = {"relu": lambda t: t.relu(), "cpu": lambda t: t.cpu(), "add": lambda t: t + t, "sum": lambda t: t.sum()}[op]
    with pytest.raises(NotImplementedError, match=r"^neuron: aten::\w+ with a nested tensor of the strided layout on "
                                                  r"the neuron device, which holds dense tensors and jagged nested "
                                                  r"tensors only; make it with layout=torch.jagged, or keep it on CPU$"):
        fn(nt)
    jagged = torch.nested.nested_tensor(parts, layout=torch.jagged, device="neuron")
    want = torch.nested.nested_tensor(parts, layout=torch.jagged).relu()
    assert torch.equal(jagged.relu().values().cpu(), want.values())


@pytest.mark.parametrize("make", ["to", "per_channel", "quantize", "dynamic"])
def test_quantized_tensors_on_neuron_are_refused_in_one_line(make):
    """A quantized tensor moved to neuron: PyTorch said it in 52 lines (no kernel for the
    'Quantizedneuron' backend); one quantized on neuron came back as a neuron tensor that failed
    later, at its first read. Fake quantization (QAT) and a dynamically quantized module, whose
    packed weights stay on CPU, still give CPU's values."""
    import warnings

    x = torch.randn(4, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (PyTorch's deprecation of quantized tensors)
        with pytest.raises(NotImplementedError, match=r"^neuron: aten::\w+ (with|returns) a quantized tensor.* "
                                                      r"holds unquantized tensors only; keep quantized tensors on "
                                                      r"CPU, or dequantize\(\) them first$"):
            if make == "to":
                torch.quantize_per_tensor(x, 0.1, 0, torch.qint8).to("neuron")
            elif make == "per_channel":
                torch.quantize_per_channel(x, torch.ones(4), torch.zeros(4, dtype=torch.long), 0, torch.quint8).to("neuron")
            elif make == "quantize":
                torch.quantize_per_tensor(x.to("neuron"), 0.1, 0, torch.qint8)
            else:
                torch.quantize_per_tensor_dynamic(x.to("neuron"), torch.quint8, False)
        assert torch.equal(torch.fake_quantize_per_tensor_affine(x.to("neuron"), 0.1, 0, -128, 127).cpu(),
                           torch.fake_quantize_per_tensor_affine(x, 0.1, 0, -128, 127))
        model = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(torch.nn.Linear(4, 4)), {torch.nn.Linear},
                                                       dtype=torch.qint8)
        want = model(x)
        assert torch.equal(model.to("neuron")(x.to("neuron")).cpu(), want)


@pytest.mark.parametrize("make", ["coo", "to", "embedding", "csr", "bsc", "csr_tensor"])
def test_sparse_tensors_on_neuron_are_refused_in_one_line(make):
    """PyTorch said it in 51 lines (no kernel for the 'Sparseneuron' backend). A compressed
    (CSR, CSC, BSR, BSC) tensor is refused when it would be made on neuron: one moved there had
    no op that worked, not even ``.cpu()``."""
    import warnings

    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (PyTorch's beta and invariant-check warnings)
            if make == "coo":
                torch.sparse_coo_tensor(torch.tensor([[0, 1]]), torch.tensor([1.0, 2.0]), (3,), device="neuron")
            elif make == "to":
                torch.eye(3).to_sparse().to("neuron")
            elif make == "embedding":
                emb = torch.nn.Embedding(10, 4, sparse=True).to("neuron")
                emb(torch.tensor([1, 2], device="neuron")).sum().backward()
            elif make == "csr":
                torch.eye(3).to_sparse_csr().to("neuron")
            elif make == "bsc":
                torch.eye(4).to_sparse_bsc((2, 2)).to("neuron")
            else:
                torch.sparse_csr_tensor(torch.tensor([0, 1, 2]), torch.tensor([1, 0]), torch.tensor([1.0, 2.0]),
                                        device="neuron")

    with pytest.raises(NotImplementedError, match=r"^neuron: aten::\w+ with a sparse tensor on the neuron device, which "
                                                  r"holds dense \(strided\) tensors only; keep sparse tensors on CPU") as e:
        run()
    assert "\n" not in str(e.value)


def _python(code: str, **env: str) -> str:
    """Run ``code`` in a fresh interpreter outside the source tree (an in-tree *.egg-info written by
    an older install would hide the package's current entry points)."""
    full = {**os.environ, **env}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120,
                         cwd=tempfile.gettempdir())
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_config_from_env_and_set_config_in_fresh_processes():
    code = ("import torch; print(torch.neuron.config().name, torch.neuron.device_count(), "
            "torch.neuron.mem_get_info()[1])")
    assert _python(code, TRNSIM_CONFIG="trn1").split()[:2] == ["trn1", str(_logical("trn1"))]
    code2 = ("import torch; torch.neuron.set_config('trn3', {'chip.lnc': 1}); "
             "print(torch.neuron.config().name, torch.neuron.device_count())")
    from trnsim import load_config

    assert _python(code2).split() == ["trn3", str(load_config("trn3").chip.cores)]


def _logical(name: str) -> int:
    from trnsim import load_config

    return load_config(name).logical_cores


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_lcm_that_would_trap_on_cpu_is_refused_in_one_line(dtype):
    """CPU's lcm computes a / gcd(a, b) * b; for the int32/int64 minimum and an odd b its gcd comes
    out -1 (abs of the minimum is the minimum) and the division traps: the process dies (SIGFPE), on
    CPU too (difftest --seed 20261214 died at lcm 136296707370916). The device refuses just those
    arguments; the minimum with 0, 2 or -1 does not trap, and gives CPU's values."""
    low = torch.iinfo(dtype).min
    a = torch.tensor([[-5, -4, low, 4]], dtype=dtype)
    b = torch.tensor([[7, 0, -5, -3]], dtype=dtype)
    with pytest.raises(RuntimeError, match=rf"^neuron: aten::lcm would compute {low} / gcd\({low}, -5\) = {low} / -1, "
                                           r"which overflows: CPU's kernel traps there \(SIGFPE"):
        torch.lcm(a.to("neuron"), b.to("neuron"))
    with pytest.raises(RuntimeError, match=r"^neuron: aten::lcm"):
        a.to("neuron").lcm_(b.to("neuron"))
    ok_a = torch.tensor([low, low, low, 6, -4, 9], dtype=dtype)
    ok_b = torch.tensor([2, 0, -1, 4, 6, -6], dtype=dtype)
    assert torch.equal(torch.lcm(ok_a.to("neuron"), ok_b.to("neuron")).cpu(), torch.lcm(ok_a, ok_b))


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_truncating_division_of_the_minimum_by_minus_one_is_refused_in_one_line(dtype):
    """CPU's div(..., rounding_mode="trunc") divides the int32/int64 minimum by -1 and the process
    dies (SIGFPE); floor division and the other integer divisions handle it. The device refuses
    just those arguments, tensor or scalar divisor, and keeps every other division CPU's."""
    low = torch.iinfo(dtype).min
    a = torch.tensor([low, 7, -7], dtype=dtype)
    for other in (torch.tensor([-1, 2, 2], dtype=dtype).to("neuron"), -1):
        with pytest.raises(RuntimeError, match=rf"^neuron: aten::div would compute {low} / -1, which overflows"):
            torch.div(a.to("neuron"), other, rounding_mode="trunc")
    b = torch.tensor([-1, 2, -2], dtype=dtype)
    for mode in ("floor", None):
        assert torch.equal(torch.div(a.to("neuron"), b.to("neuron"), rounding_mode=mode).cpu(),
                           torch.div(a, b, rounding_mode=mode))
    c = torch.tensor([low + 1, 7, -7], dtype=dtype)
    assert torch.equal(torch.div(c.to("neuron"), b.to("neuron"), rounding_mode="trunc").cpu(),
                       torch.div(c, b, rounding_mode="trunc"))


def test_polynomials_of_a_huge_degree_are_refused_in_one_line():
    """CPU's Legendre and Laguerre kernels loop once per degree for each element, stopping early
    only at a NaN: a degree of 2^62 runs for centuries, on CPU and on the device alike (difftest
    --seed 99 --dtypes int64 stalled at legendre_polynomial_p). The device refuses calls of more
    than 2^30 steps; where a closed form or an early overflow ends CPU's loop, it answers as CPU."""
    huge = torch.tensor([2 ** 62])
    legendre, laguerre = torch.special.legendre_polynomial_p, torch.special.laguerre_polynomial_l
    for fn, x in ((legendre, torch.tensor([0.3, 1.0])), (laguerre, torch.tensor([2.0, 0.0])),
                  (laguerre, torch.tensor([4], dtype=torch.int64))):
        with pytest.raises(RuntimeError, match=rf"^neuron: aten::special_{fn.__name__[8:]} would run its recurrence "
                                               r"4.61e\+18 times .*a call may run 2\^30 steps"):
            fn(x.to("neuron"), huge.to("neuron"))
    with pytest.raises(RuntimeError, match=r"would run its recurrence 1.1e\+12 times"):
        legendre(0.3, torch.tensor([2 ** 40]).to("neuron"))  # (a scalar x; the fast path leaves these to Python)
    with pytest.raises(RuntimeError, match=r"would run its recurrence"):
        laguerre(torch.tensor([2.0]).to("neuron"), 2 ** 40)
    # CPU's loop never starts (|x| = 1, x = 0, NaN, a degree past int64 cast to its minimum) or overflows
    # into a NaN within a few hundred steps (|x| = 3, x = -1e4): CPU's values, at once
    for fn, x, n in ((legendre, [1.0, -1.0, float("nan"), 3.0, -3.0], [2 ** 62] * 5),
                     (laguerre, [0.0, float("nan"), -1e4, 1e4], [2 ** 62] * 4),
                     (legendre, [0.5], [2.0 ** 70]),
                     (legendre, torch.linspace(-1, 1, 64).tolist(), list(range(64)))):
        a, b = torch.tensor(x, dtype=torch.float64), torch.tensor(n, dtype=torch.float64)
        assert torch.allclose(fn(a.to("neuron"), b.to("neuron")).cpu(), fn(a, b), rtol=0, atol=0, equal_nan=True)


class _OnDevice(torch.utils.data.Dataset):
    """Each item made on the neuron device, as a dataset that moves its samples there does."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": torch.arange(6.0, device="neuron").view(2, 3) * i, "i": torch.tensor(i)}


def test_a_dataloader_worker_sends_neuron_batches_and_other_sends_are_refused_in_one_line():
    """torch's reducer shares a tensor's memory with the receiving process (a file descriptor on
    CPU, CUDA IPC on a GPU); a neuron tensor's failed in the queue's feeder thread, and a
    DataLoader whose dataset returned neuron tensors waited for that batch for ever. A worker's
    batch now arrives as a neuron tensor (a copy: batches are fresh); anywhere else a neuron
    tensor is refused in one line, where a copy would silently stop sharing (a model shared for
    Hogwild training); CPU tensors keep torch's reducer."""
    from multiprocessing.reduction import ForkingPickler

    loader = torch.utils.data.DataLoader(_OnDevice(), batch_size=2, num_workers=2,
                                         multiprocessing_context="fork", timeout=60)
    batches = list(loader)
    assert [b["x"].device.type for b in batches] == ["neuron"] * 3
    assert [b["i"].device.type for b in batches] == ["cpu"] * 3
    want = torch.stack([torch.arange(6.0).view(2, 3) * i for i in range(6)])
    assert torch.equal(torch.cat([b["x"].cpu() for b in batches]), want)
    for t, what in ((torch.ones(3, device="neuron"), "a neuron tensor"),
                    (torch.nn.Linear(2, 2).to("neuron").weight, "a tensor that requires grad")):
        with pytest.raises(RuntimeError, match=rf"^neuron: {what} cannot be sent to another process: device memory "
                                               r"is not shared between processes here"):
            ForkingPickler.dumps(t)
    cpu = torch.arange(4.0)
    assert torch.equal(ForkingPickler.loads(ForkingPickler.dumps(cpu)), cpu)


@pytest.mark.parametrize("name,value,expected", [
    ("TRNSIM_FASTPATH", "false", "0 (every op through the Python path) or 1 (the native fast path), 0..1"),
    ("TRNSIM_ADAPTIVE_EAGER", "yes", "1 (adaptive eager on) or 0, 0..1"),
    ("TRNSIM_HOST_CACHE_MB", "2G", "the megabytes of freed host memory kept for reuse (0: none), 0..1,073,741,824"),
])
def test_a_device_switch_it_does_not_take_is_one_line_at_first_use(monkeypatch, name, value, expected):
    """These were read as their default when they held anything else (TRNSIM_FASTPATH=false left the
    fast path on; found by a hardening hunt). The runtime checks them when the device is first used
    (never at ``import torch``: a CPU program must not break)."""
    from trnsim.config import ConfigError
    from torch_bridge.runtime import check_env

    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as e:
        check_env()
    assert str(e.value) == f"{name}={value!r}: expected {expected}"
    monkeypatch.setenv(name, "0")
    check_env()
