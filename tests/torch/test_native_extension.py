"""The native extension (csrc/neuron.cpp): what a pure-Python PrivateUse1 backend cannot provide.

Pinned host memory, storage resize, a stateful device guard (more than one device in a process:
autograd's per-device queues, ``set_device`` steering ``.to("neuron")``), and exceptions raised
inside a neuron backward reaching Python. Fresh-process checks run in a subprocess so an abort
fails the test instead of ending the run.
"""

import os
import subprocess
import sys
import tempfile

import pytest
import torch
from torch import nn

from torch_bridge import _native


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=300,
                          cwd=tempfile.gettempdir())


# ---- pinned memory -------------------------------------------------------------------------------
def test_pin_memory_on_cpu_only_code_with_trnsim_installed():
    # the DataLoader pins batches once an accelerator is registered; it used to raise
    # NotImplementedError (getPinnedMemoryAllocator) for every program, CPU-only ones included
    code = ("import torch\n"
            "ds = torch.utils.data.TensorDataset(torch.arange(8.).view(4, 2))\n"
            "b = next(iter(torch.utils.data.DataLoader(ds, batch_size=2, pin_memory=True)))[0]\n"
            "p = torch.ones(3).pin_memory()\n"
            "print(b.tolist(), b.is_pinned(), p.is_pinned(), torch.ones(3).is_pinned())")
    out = _python(code)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "[[0.0, 1.0], [2.0, 3.0]] True True False"


def test_pinned_memory_is_host_memory_the_device_copies_from():
    p = torch.arange(6.0).pin_memory()
    assert p.is_pinned() and p.device.type == "cpu" and p[2:].is_pinned()
    d = p.to("neuron", non_blocking=True)
    assert d.device.type == "neuron" and d.cpu().tolist() == p.tolist()
    back = d.to("cpu", non_blocking=True)
    torch.neuron.synchronize()
    assert back.is_pinned() and back.tolist() == p.tolist()


# ---- more than one device in a process -----------------------------------------------------------
def test_training_on_neuron_1():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    dev = torch.device("neuron", 1)
    m = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).to(dev)
    m.load_state_dict(model.state_dict())
    for net, xs, ys in ((model, x, y), (m, x.to(dev), y.to(dev))):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for _ in range(3):
            opt.zero_grad()
            nn.functional.mse_loss(net(xs), ys).backward()
            opt.step()
    assert all(p.device == dev and p.grad.device == dev for p in m.parameters())
    for a, b in zip(m.parameters(), model.parameters()):
        torch.testing.assert_close(a.cpu(), b.detach(), rtol=1e-5, atol=1e-6)


def test_set_device_steers_to_and_accelerator():
    try:
        torch.neuron.set_device(1)
        assert torch.ones(2).to("neuron").device == torch.device("neuron", 1)
        assert torch.empty(1, device="neuron").device.index == 1
        assert torch.accelerator.current_device_index() == 1
        torch.accelerator.set_device_index(2)
        assert torch.neuron.current_device() == 2
    finally:
        torch.neuron.set_device(0)
    with torch.neuron.device(3):
        assert torch.tensor([1.0]).to("neuron").device.index == 3
    assert torch.neuron.current_device() == 0


def test_guard_reports_every_device():
    assert torch.accelerator.device_count() == torch.neuron.device_count() == _native.lib.trnsim_device_count()
    with pytest.raises(RuntimeError, match=r"neuron:9 does not exist"):
        torch.neuron.set_device(9)


def test_cross_device_copy_is_charged():
    a = torch.ones(256, device="neuron:0")
    with torch.neuron.report_scope() as scope:
        b = a.to("neuron:1")
    assert b.device.index == 1 and b.cpu().eq(1).all()
    assert any(r.op == "_copy_from" and r.hbm_bytes > 0 for r in scope.report.rows)


# ---- storage resize ------------------------------------------------------------------------------
def test_untyped_storage_resize_frees_and_reallocates_like_fsdp2():
    p = torch.arange(16.0, device="neuron")
    before = torch.neuron.memory_allocated()
    storage = p.untyped_storage()
    storage.resize_(0)  # FSDP2 frees the unsharded parameter this way ...
    assert storage.nbytes() == 0 and torch.neuron.memory_allocated() == before - 64
    storage.resize_(64)  # ... and re-allocates it before the all-gather writes it
    assert storage.nbytes() == 64 and torch.neuron.memory_allocated() == before
    p.copy_(torch.arange(16.0) * 2)
    assert p.cpu().tolist() == (torch.arange(16.0) * 2).tolist() and p.device.type == "neuron"


def test_storage_resize_keeps_the_bytes_it_keeps():
    t = torch.arange(4, dtype=torch.int32, device="neuron")
    t.untyped_storage().resize_(32)
    assert t.untyped_storage().nbytes() == 32 and t.cpu().tolist() == [0, 1, 2, 3]


_FREED = r"^neuron: a tensor of \d+ elements over \d+ bytes of memory \(it needs \d+\): its storage was freed"


@pytest.mark.parametrize("kept", [0, 8])
def test_a_tensor_whose_storage_was_freed_or_shrunk_is_refused_not_read(kept):
    # After storage.resize_(0) (FSDP2's free) a tensor still has its sizes but no memory. The
    # Python path's CPU view got a fresh uninitialised storage (garbage from .cpu(), .tolist(),
    # clone, mm, copy_; writes into it lost) and the fast path read freed memory or crashed
    ops = {
        "cpu": lambda x: x.cpu(), "tolist": lambda x: x.tolist(), "clone": lambda x: x.clone(),
        "add": lambda x: x + 1, "sum": lambda x: x.sum(), "mm": lambda x: x.view(32, 32) @ x.view(32, 32),
        "copy_from": lambda x: torch.zeros(1024, device="neuron").copy_(x),
        "copy_into": lambda x: x.copy_(torch.zeros(1024)), "mul_": lambda x: x.mul_(2),
        "conv": lambda x: nn.functional.conv2d(x.view(1, 1, 32, 32), torch.ones(1, 1, 3, 3, device="neuron")),
    }
    for name, op in ops.items():
        for taught in (False, True):  # a signature's first call (Python's path), then the fast path's
            if taught:
                op(torch.ones(1024, device="neuron"))
            x = torch.ones(1024, device="neuron")
            x.untyped_storage().resize_(kept)
            with pytest.raises(RuntimeError, match=_FREED):
                op(x)
            assert x.untyped_storage().nbytes() == kept, name
    x = torch.arange(1024.0, device="neuron")
    x.untyped_storage().resize_(kept)
    assert x[:kept // 4].cpu().tolist() == list(range(kept // 4))  # the bytes it kept still read
    x.untyped_storage().resize_(4096)  # re-allocated: usable again
    x.copy_(torch.arange(1024.0))
    assert (x + 1).sum().item() == sum(range(1, 1025))


def test_storage_resize_past_hbm_is_out_of_memory():
    t = torch.ones(1, device="neuron")
    with pytest.raises(torch.OutOfMemoryError, match=r"^neuron:0 out of memory: tried to allocate"):
        t.untyped_storage().resize_(torch.neuron.mem_get_info()[1] + 1)
    assert t.cpu().item() == 1.0


# ---- errors inside backward ----------------------------------------------------------------------
_BOOM = """
import torch
class Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x): return x * 2
    @staticmethod
    def backward(ctx, g): raise ValueError("boom in backward")
for dev in ("neuron:0", "neuron:1"):
    x = torch.ones(3, device=dev, requires_grad=True)
    try:
        Boom.apply(x * 3).sum().backward()
    except ValueError as e:
        print("caught", dev, e)
x = torch.ones(4, 4, device="neuron:1", requires_grad=True)
class Bad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x): return x.clone()
    @staticmethod
    def backward(ctx, g): return torch.mm(g, torch.ones(3, 3, device="neuron:1"))
try:
    Bad.apply(x @ x).sum().backward()
except RuntimeError as e:
    print("caught", str(e).splitlines()[0])
(x * 2).sum().backward()
print("alive", x.grad.sum().item())
"""


def test_an_error_inside_a_neuron_backward_is_a_python_exception():
    out = _python(_BOOM)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == [
        "caught neuron:0 boom in backward", "caught neuron:1 boom in backward",
        "caught mat1 and mat2 shapes cannot be multiplied (4x4 and 3x3)", "alive 32.0"]


# ---- the build -----------------------------------------------------------------------------------
def test_without_a_compiler_import_torch_says_so_in_one_line_and_cpu_torch_works():
    with tempfile.TemporaryDirectory() as cache:
        out = _python("import torch; print(torch.ones(2).sum().item(), hasattr(torch, 'neuron'))",
                      CXX="/nonexistent/c++", TRNSIM_CACHE_DIR=cache)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2.0 False"
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert lines == ["trnsim: the neuron device needs a C++ compiler once, to build its native extension against "
                     f"torch {torch.__version__}, and '/nonexistent/c++' was not found: install one (apt-get "
                     "install g++) or set CXX (the neuron device is not registered; CPU-only torch is unaffected)"]


@pytest.mark.parametrize("where", ["file", "file/below"])
def test_a_cache_dir_that_is_a_file_is_one_line_and_cpu_torch_works(tmp_path, where):
    """Issue 25: TRNSIM_CACHE_DIR naming a file broke ``import torch`` itself (a FileExistsError
    inside the build, reported by torch as 'Failed to load the backend extension: neuron')."""
    (tmp_path / "file").write_text("")
    out = _python("import torch; print(torch.ones(2).sum().item(), hasattr(torch, 'neuron'))",
                  TRNSIM_CACHE_DIR=str(tmp_path / where))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2.0 False"
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert lines == [f"trnsim: cannot build the neuron device's native extension in {tmp_path / where} (it is not a "
                     f"directory); set TRNSIM_CACHE_DIR to a writable directory (the neuron device is not registered; "
                     f"CPU-only torch is unaffected)"]


def test_the_library_is_cached_per_source_and_torch():
    path = _native.library_path()
    assert path.is_file() and path.name.startswith("neuron_ext-")
    assert _native.library_path() == path


def test_a_failing_registration_is_one_line_and_import_torch_still_works(monkeypatch, capsys):
    """The entry point runs inside ``import torch``: whatever goes wrong in registering the device
    (a bug of ours included) is one line on stderr, once, never an exception out of it."""
    from torch_bridge import _native, backend

    def broken() -> None:
        raise AttributeError("module has no attribute 'X'")

    monkeypatch.setattr(backend, "register", broken)
    monkeypatch.setattr(backend, "_reported", [])
    assert backend.register_or_report() is False
    assert backend.register_or_report() is False
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["trnsim: registering the neuron device failed (AttributeError: module has no attribute 'X'); "
                   "the neuron device may not work in this process, CPU-only torch is unaffected"]

    def unbuilt() -> None:
        raise _native.NativeBuildError("trnsim: no C++ compiler")

    monkeypatch.setattr(backend, "register", unbuilt)
    monkeypatch.setattr(backend, "_reported", [])
    assert backend.register_or_report() is False
    assert capsys.readouterr().err.strip() == ("trnsim: no C++ compiler (the neuron device is not registered; "
                                               "CPU-only torch is unaffected)")
