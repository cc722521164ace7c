"""Timing-only runs: the same simulated time as with values, no storage, HBM enforced, one-line
errors for ops that need values, models from configs without weights, layer replay."""

import collections
import gc
import re
import resource

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from torch_bridge import models
from torch_bridge.timing_only import TimingOnlyError, is_timing_only, replay_layers

CFG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=64)


def _rows(rep):
    c = collections.Counter()
    for r in rep.rows:
        c[(r.op, r.kernel)] += r.calls
    return c


def _train_step(model, ids):
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    return out


def test_a_small_llama_costs_the_same_with_and_without_values():
    """Forward and backward of a 2-layer Llama (the 'neuron' attention): every launch, its kernel
    and the simulated time are the same as the run that computes every value; so is the HBM in
    use afterwards."""
    models.register()
    cfg = LlamaConfig(**CFG)
    cfg._attn_implementation = "neuron"
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 16))
    gc.collect()
    base = torch.neuron.memory_allocated()
    model = LlamaForCausalLM(cfg).to("neuron")
    x = ids.to("neuron")
    torch.neuron.synchronize()
    with torch.neuron.report_scope() as scope:
        kept = _train_step(model, x)
        torch.neuron.synchronize()
    eager = scope.report
    eager_bytes = torch.neuron.memory_allocated() - base
    del model, x, kept
    gc.collect()
    base = torch.neuron.memory_allocated()
    with torch.neuron.timing_only() as run:
        fake = models.from_config(cfg, torch.float32)
        fx = ids.to("neuron")
        torch.neuron.synchronize()
        with torch.neuron.report_scope() as scope:
            kept = _train_step(fake, fx)
            torch.neuron.synchronize()
        run.sweep()
        fake_bytes = torch.neuron.memory_allocated() - base
    timed = scope.report
    assert timed.launches == eager.launches > 200
    assert _rows(timed) == _rows(eager)
    assert timed.elapsed_us == pytest.approx(eager.elapsed_us, rel=1e-12)
    assert timed.device_us == pytest.approx(eager.device_us, rel=1e-12)
    assert timed.hbm_bytes == eager.hbm_bytes and timed.matmul_flops == eager.matmul_flops
    assert fake_bytes == eager_bytes
    assert is_timing_only(kept.loss) and kept.loss.device == torch.device("neuron", 0)


def test_no_storage_is_allocated():
    """8 GiB of timing-only tensors (weights of a model built from a config, and an activation):
    counted against the device's HBM, every one on neuron with a meta (empty) storage behind it,
    while the process's memory barely moves."""
    gc.collect()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    with torch.neuron.timing_only():
        before = torch.neuron.memory_allocated()
        m = models.from_config("llama-3.1-8b", torch.float32, layers=6)  # 7.9 GB of fp32 weights
        x = torch.empty(64, 4096, 4096, device="neuron")  # 4 GiB
        y = x[:1, :128] * 2
        params = sum(p.numel() * 4 for p in [*m.parameters(), *m.buffers()])
        assert torch.neuron.memory_allocated() - before == params + x.numel() * 4 + y.numel() * 4
        for t in [x, y, *m.parameters()]:
            assert is_timing_only(t) and t.device.type == "neuron" and t.untyped_storage().device.type == "meta"
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss
    assert grown < 256 * 2**20, f"the host took {grown / 2**20:.0f} MiB for 12 GB of timing-only tensors"


def test_memory_is_released_when_tensors_die():
    with torch.neuron.timing_only() as run:
        before = torch.neuron.memory_allocated()
        a = torch.empty(1 << 20, device="neuron")
        b = a * 2
        assert torch.neuron.memory_allocated() - before == 2 * (4 << 20)
        view = b[10:]
        del b
        c = torch.empty(1, device="neuron")  # the next op sees the dead tensor's storage
        assert torch.neuron.memory_allocated() - before == 2 * (4 << 20) + 4  # a view keeps b's storage
        del view, a
        torch.empty(1, device="neuron")
        assert torch.neuron.memory_allocated() - before == 4 + 4
        del c
    assert torch.neuron.memory_allocated() - before == 0  # leaving the run releases what died


def test_a_tensor_that_outlives_its_run_frees_its_bytes_when_it_dies():
    """An ended run's tensor that dies later is no longer counted the next time the allocated
    bytes are read (it was counted until another run started: a run's fresh baseline read then
    included it, and the run's own bytes came out short by it)."""
    before = torch.neuron.memory_allocated()
    with torch.neuron.timing_only():
        kept = torch.empty(1000, device="neuron")
    assert torch.neuron.memory_allocated() - before == 4000
    del kept
    gc.collect()
    assert torch.neuron.memory_allocated() == before


def test_an_ended_run_s_dead_tensor_does_not_make_an_allocation_fail():
    """An allocation that fits once an ended run's dead tensors are released succeeds, without a
    read of the allocated bytes first (the refusal settles them and tries again; it raised
    OutOfMemoryError for the dead bytes before), and counts no OOM."""
    from torch_bridge import memory

    gc.collect()
    memory.settle()  # earlier tests' dead bytes released first: only this run's are pending below
    with torch.neuron.timing_only():
        kept = torch.empty(1000, device="neuron")
    del kept
    gc.collect()  # dead, not yet swept: the ledger still counts its 4000 bytes
    stats = memory.pool.devices[0]
    ooms, capacity = stats.ooms, stats.capacity
    stats.row[memory._CAPACITY] = stats.allocated - 4000 + 64  # room for 64 bytes once the dead ones are gone
    try:
        y = torch.empty(16, device="neuron")
        assert stats.ooms == ooms
        with pytest.raises(torch.OutOfMemoryError, match=r"^neuron:0 out of memory: tried to allocate 4 bytes"):
            torch.empty(1, device="neuron")
        assert stats.ooms == ooms + 1  # one refusal, one OOM (not one per try)
        del y
    finally:
        stats.row[memory._CAPACITY] = capacity


def test_hbm_capacity_is_enforced_with_a_hint_to_shard():
    cap = torch.neuron.mem_get_info()[1]
    with torch.neuron.timing_only():
        with pytest.raises(torch.OutOfMemoryError, match=r"^neuron:0 out of memory: tried to allocate \d+ bytes "
                           r"\(.+\); \d+ bytes in use of \d+ capacity \(.+ free\) - timing-only: the tensors do not fit "
                           r"one logical core's HBM; shard the model over more cores \(trnsim estimate --tp N / --pp N, "
                           r"or a parallelism plan\)$"):
            torch.empty(cap // 2 + 1, dtype=torch.uint8, device="neuron") + torch.empty(cap // 2 + 1,
                                                                                         dtype=torch.uint8,
                                                                                         device="neuron")


def test_a_70b_model_does_not_fit_one_core():
    gc.collect()
    with torch.neuron.timing_only():
        with pytest.raises(torch.OutOfMemoryError, match="shard the model"):
            models.from_config("llama-3.3-70b")


@pytest.mark.parametrize("code,message", [
    (lambda x: x.sum().item(), "timing-only: aten::_local_scalar_dense needs tensor values (.item(), bool(), int() "
                               "or float() of a tensor), and timing-only tensors have none; data-dependent code cannot "
                               "run timing-only: give it static shapes, or run it with values"),
    (lambda x: bool(x.max() > 0), "timing-only: aten::_local_scalar_dense needs tensor values"),
    (lambda x: torch.nonzero(x), "timing-only: aten::nonzero needs tensor values (its output's shape is the count "
                                 "of nonzero values)"),
    (lambda x: x[x > 0], "timing-only: aten::index needs tensor values (indexing with a boolean mask: its output's "
                         "shape is the count of True values)"),
    (lambda x: torch.equal(x, x), "timing-only: aten::equal needs tensor values (torch.equal)"),
])
def test_ops_that_need_values_fail_with_one_line(code, message):
    with torch.neuron.timing_only():
        x = torch.empty(16, 16, device="neuron")
        with pytest.raises(TimingOnlyError, match="^" + re.escape(message)) as info:
            code(x)
    assert "\n" not in str(info.value)


def test_cpu_ops_inside_cost_nothing():
    with torch.neuron.timing_only(), torch.neuron.report_scope() as scope:
        a = torch.ones(64, 64)
        (a @ a).sum()
    assert scope.report.launches == 0


def test_a_model_from_a_config_has_no_weights_and_the_rank_shapes():
    gc.collect()  # (earlier tests' garbage freed inside the window would come off the count)
    with torch.neuron.timing_only():
        before = torch.neuron.memory_allocated()
        m = models.from_config("llama-3.1-8b", layers=2)
        params = sum(p.numel() * p.element_size() for p in [*m.parameters(), *m.buffers()])
        assert torch.neuron.memory_allocated() - before == params
        assert all(is_timing_only(p) and p.dtype == torch.bfloat16 for p in m.parameters())
        assert m.model.layers[0].self_attn.k_proj.weight.shape == (1024, 4096)


def test_replayed_layers_charge_what_running_them_does():
    """Four identical layers: running the first and replaying its tape for the other three
    launches exactly what running all four does, in the same simulated time."""
    cfg = LlamaConfig(**{**CFG, "num_hidden_layers": 4})

    def decode(replay):
        with torch.neuron.timing_only():
            m = models.from_config(cfg, torch.float32)
            cache = models.kv_cache(64, 4, 1, 2, 16, torch.float32)
            if replay:
                assert replay_layers(m.model.layers, after=lambda i, n: setattr(cache.layers[i], "length",
                                                                                cache.layers[i].length + n))
            with torch.no_grad(), torch.neuron.report_scope() as scope:
                for n in (16, 1, 1):
                    m(input_ids=torch.empty((1, n), dtype=torch.long, device="neuron"), cache=cache, use_cache=True)
                torch.neuron.synchronize()
            assert [layer.length for layer in cache.layers] == [18] * 4
        return scope.report

    full, replayed = decode(False), decode(True)
    assert _rows(replayed) == _rows(full)
    assert replayed.elapsed_us == pytest.approx(full.elapsed_us, rel=1e-12)


def test_layers_that_differ_are_not_replayed():
    layers = torch.nn.ModuleList([torch.nn.Linear(4, 4), torch.nn.Linear(4, 8)])
    assert not replay_layers(layers)


# ---- trnsim run --timing-only -----------------------------------------------------------------------
def _trnsim(*argv, cwd):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "trnsim.cli", *argv], capture_output=True, text=True, timeout=300,
                          cwd=cwd)


def test_trnsim_run_timing_only(tmp_path):
    """The script's report is the one it gets with values; an op that needs values stops it
    with one line naming the script's line; one process only."""
    import json

    script = tmp_path / "s.py"
    script.write_text("import torch\nx = torch.randn(64, 128, device='neuron')\nw = torch.randn(128, 256, device='neuron')\n"
                      "y = (x @ w).relu().sum(0)\nprint('shape', tuple(y.shape))\n")
    runs = [_trnsim("run", str(script), "--json", *flag, cwd=tmp_path) for flag in ((), ("--timing-only",))]
    assert all(r.returncode == 0 and "shape (256,)" in r.stderr for r in runs), runs[1].stderr  # --json: stdout is data
    values, fake = (json.loads(r.stdout) for r in runs)
    assert fake["launches"] == values["launches"] > 0 and fake["elapsed_us"] == values["elapsed_us"]
    bad = tmp_path / "item.py"
    bad.write_text("import torch\nx = torch.ones(8, device='neuron')\nif x.sum().item() > 0:\n    pass\n")
    out = _trnsim("run", str(bad), "--timing-only", cwd=tmp_path)
    assert out.returncode == 1 and out.stderr.count("\n") == 1
    assert out.stderr.startswith(f"trnsim run: {bad}:3: timing-only: aten::_local_scalar_dense needs tensor values")
    for flag, msg in ((("--nproc", "2"), "--nproc"), (("--compare-eager",), "--compare-eager")):
        out = _trnsim("run", "--timing-only", *flag, str(script), cwd=tmp_path)
        assert out.returncode == 2 and out.stderr == (f"trnsim: error: run: --timing-only runs one process once; leave "
                                                      f"out {msg} (trnsim estimate simulates a whole system without "
                                                      f"values)\n")


@pytest.mark.parametrize("code,message", [
    (lambda x: x.cpu().numpy(), "timing-only: Tensor.numpy() needs tensor values (a NumPy array of its values)"),
    (lambda x: __import__("numpy").asarray(x.cpu()), "timing-only: Tensor.__array__ needs tensor values (np.asarray of "
                                                      "a tensor)"),
    (lambda x: torch.save(x, __import__("io").BytesIO()), "timing-only: torch.save needs tensor values (pickling or "
                                                          "saving a tensor writes its values)"),
])
def test_host_copies_of_values_fail_with_one_line(code, message):
    """Issue 25: ``.numpy()`` and ``torch.save`` of a timing-only tensor raised torch's own errors
    (a tensor-subclass RuntimeError, a pickling AttributeError) instead of saying what is wrong."""
    with torch.neuron.timing_only():
        x = torch.empty(16, 16, device="neuron")
        with pytest.raises(TimingOnlyError, match="^" + re.escape(message)) as info:
            code(x)
    assert "\n" not in str(info.value)


def test_trnsim_run_names_the_line_of_a_numpy_call(tmp_path):
    bad = tmp_path / "np.py"
    bad.write_text("import torch\nx = torch.ones(8, device='neuron')\ntorch.save(x, 'x.pt')\n")
    out = _trnsim("run", str(bad), "--timing-only", cwd=tmp_path)
    assert out.returncode == 1 and out.stderr.count("\n") == 1, out.stderr
    assert out.stderr.startswith(f"trnsim run: {bad}:3: timing-only: torch.save needs tensor values")


@pytest.mark.parametrize("name", ["abs", "logical_not"])
def test_a_composite_result_keeps_a_transposed_inputs_layout_as_cpu(name):
    """Found by difftest's long run: abs and logical_not allocate an empty result and call their
    out= form, whose meta kernel resizes it contiguous, so timing-only gave (12, 6, 3, 1) where CPU
    (and eager neuron) keep the input's layout (12, 6, 1, 2); the charge is the eager one."""
    x = torch.randn(1, 2, 3, 2).to(torch.bfloat16).transpose(2, 3)
    want = getattr(torch, name)(x)
    with torch.neuron.report_scope() as eager:
        assert getattr(torch, name)(x.to("neuron")).stride() == want.stride()
    with torch.neuron.timing_only():
        y = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="neuron")
        with torch.neuron.report_scope() as fake:
            got = getattr(torch, name)(y)
        assert got.stride() == want.stride() == (12, 6, 1, 2)
        assert getattr(torch, name)(y).stride() == want.stride()  # (the signature's layout, remembered)
    pick = lambda rep: [(r.op, r.kernel, r.time_us) for r in rep.rows if r.op != "_copy_from"]  # noqa: E731
    assert pick(fake.report) == pick(eager.report) and pick(eager.report)


def test_a_composite_given_a_wrapped_scalar_runs_as_eager_does():
    """Found by difftest's long run: take_along_dim's remainder.Scalar wraps its scalar in a tensor
    that PyTorch hands to Python as a number; remainder.Tensor's composite refused it timing-only
    ('Expected a value of type Tensor ... found type int'). Same shape, dtype and charges as eager."""
    x, i = torch.randn(4), torch.tensor([3, 0, 1])
    with torch.neuron.report_scope() as eager:
        want = torch.take_along_dim(x.to("neuron"), i.to("neuron"), 0)
    with torch.neuron.timing_only():
        xx = torch.empty(4, device="neuron")
        ii = torch.zeros(3, dtype=torch.long, device="neuron")
        with torch.neuron.report_scope() as fake:
            got = torch.take_along_dim(xx, ii, 0)
        assert (got.shape, got.dtype) == (want.shape, want.dtype)
        for dtype, other in ((torch.int32, 4), (torch.bfloat16, 4.5), (torch.int32, 4.5)):
            cpu = torch.remainder(torch.empty(3, dtype=dtype), other)
            assert torch.remainder(torch.empty(3, dtype=dtype, device="neuron"), other).dtype == cpu.dtype
    pick = lambda rep: [(r.op, r.kernel, r.time_us) for r in rep.rows if r.op != "_copy_from"]  # noqa: E731
    assert pick(fake.report) == pick(eager.report) and pick(eager.report)


@pytest.mark.parametrize("name", ["_log_softmax_backward_data", "_softmax_backward_data"])
def test_softmax_backwards_give_the_devices_dtype(name):
    """Found by difftest's long run: _log_softmax_backward_data of an empty int64/bool gradient
    raised timing-only (PyTorch's out= decomposition casts to input_dtype and refused the integer
    out) where CPU returns it as it is; PyTorch's meta kernel also gives input_dtype where CPU and
    CUDA give the gradient's dtype (bf16 gradient, fp32 input_dtype). Timing-only follows the
    device: dtype, shape and contiguous strides as CPU's, the eager charge, CPU's refusal of a
    non-empty integer gradient."""
    op = getattr(torch.ops.aten, name).default
    for dt, idt, n in ((torch.int64, torch.float32, 0), (torch.bool, torch.float16, 0), (torch.bfloat16, torch.float32, 3),
                       (torch.float32, torch.int64, 3), (torch.float16, torch.float16, 3), (torch.float32, torch.float32, 0)):
        g = torch.ones(n, 5, dtype=dt).t()
        want = op(g, g, 0, idt)
        with torch.neuron.report_scope() as eager:
            op(g.to("neuron"), g.to("neuron"), 0, idt)
        with torch.neuron.timing_only():
            gg = torch.empty(n, 5, dtype=dt, device="neuron").t()
            with torch.neuron.report_scope() as fake:
                got = op(gg, gg, 0, idt)
            assert (got.dtype, got.shape, got.stride()) == (want.dtype, want.shape, want.stride()), (dt, idt, n)
        pick = lambda rep: [(r.op, r.kernel, r.time_us) for r in rep.rows if r.op != "_copy_from"]  # noqa: E731
        assert pick(fake.report) == pick(eager.report) and pick(eager.report), (dt, idt, n)
    with torch.neuron.timing_only(), pytest.raises(NotImplementedError, match="not implemented for 'Long'"):
        gg = torch.empty(2, 5, dtype=torch.int64, device="neuron")
        op(gg, gg, 1, torch.float32)


def test_a_tensor_made_outside_the_run_is_never_left_silently_wrong():
    """A write to a tensor that has values (made outside the block) would reach a timing-only copy
    and leave the tensor as it was; a real parameter read while autograd records would get a
    gradient without values, and later real steps would then change nothing (found by a values
    hunt). Both are refused in one line; a real model's forward under no_grad runs, and the model
    trains as before after the block."""
    torch.manual_seed(0)
    real_n, real_c = torch.ones(3, device="neuron"), torch.ones(3)
    model = torch.nn.Linear(3, 3).to("neuron")
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with torch.neuron.timing_only():
        for t in (real_n, real_c):
            with pytest.raises(TimingOnlyError, match=r"^timing-only: aten::add_ writes a tensor made outside"):
                t.add_(1)
        x = torch.randn(2, 3, device="neuron")
        with pytest.raises(TimingOnlyError, match=r"^timing-only: aten::\w+ reads a tensor made outside the "
                                                  r"timing-only block that requires grad"):
            model(x)
        with torch.no_grad():
            y = model(x)
        assert is_timing_only(y) and y.shape == (2, 3)
    assert real_n.cpu().tolist() == real_c.tolist() == [1.0, 1.0, 1.0]
    assert model.weight.grad is None
    w0 = model.weight.detach().cpu().clone()
    model(torch.randn(2, 3, device="neuron")).sum().backward()
    opt.step()
    assert not torch.equal(w0, model.weight.detach().cpu())


def test_integer_indexing_runs_and_costs_what_eager_charges():
    """aten::index is tagged data-dependent for its boolean-mask form, and timing-only refused
    x[idx] with integer indices too, saying it was a mask (found by a hardening hunt): its output's
    shape is the indices'. It runs now, charged as eager charges it; a mask still needs values."""
    def step(x, i):
        return x[i], x[:, i], x[i, 1:]

    x, i = torch.randn(6, 5, device="neuron"), torch.tensor([0, 3, 3], device="neuron")
    torch.neuron.synchronize()
    with torch.neuron.report_scope() as scope:
        want = [t.shape for t in step(x, i)]
        torch.neuron.synchronize()
    eager = scope.report
    with torch.neuron.timing_only():
        fx, fi = torch.empty(6, 5, device="neuron"), torch.empty(3, dtype=torch.long, device="neuron")
        torch.neuron.synchronize()
        with torch.neuron.report_scope() as scope:
            got = [t.shape for t in step(fx, fi)]
            torch.neuron.synchronize()
        with pytest.raises(TimingOnlyError, match="indexing with a boolean mask"):
            fx[fx > 0]
    assert got == want and _rows(scope.report) == _rows(eager)
    assert scope.report.device_us == pytest.approx(eager.device_us, rel=1e-12)


def test_repeat_runs_and_costs_what_eager_charges():
    """Found by difftest (repeat 24210140990398): torch 2.13's repeat builds its permutation on the
    host (arange, stack) and reads it; timing-only made that temporary without values and every
    repeat failed ("its data is not allocated yet"). A composite's own host temporaries have values
    now; repeat and tile give eager's shapes, strides and charges."""
    def step(x):
        return x.repeat(2, 1), x.repeat(1, 2, 2), torch.tile(x, (3,)), x.unsqueeze(0).repeat(2, 1, 1)

    x = torch.randn(2, 3, device="neuron")
    want = [(t.shape, t.stride()) for t in step(x)]
    eager, timed = _same_run(lambda: step(x), lambda: step(torch.empty(2, 3, device="neuron")))
    with torch.neuron.timing_only():
        got = [(t.shape, t.stride()) for t in step(torch.empty(2, 3, device="neuron"))]
        assert torch.arange(3).dtype == torch.long  # a host tensor of the user's still has no values
        with pytest.raises(TimingOnlyError):
            torch.arange(3).tolist()
    assert got == want and _rows(timed) == _rows(eager) and _rows(eager)


def test_in_place_view_ops_apply_once_on_a_signature_s_first_call():
    """Found by difftest --wide (rot90 244818402208278): timing-only ran an in-place composite a
    second time to learn its functional layout, on the same tensor, so a signature's first
    unsqueeze_ or transpose_ applied twice (rot90 over dims [-3, -2] kept its input's shape).
    Shapes and strides now equal eager's on every call."""
    def step(x):
        a, b, c, d = torch.neg(x), torch.neg(x), torch.neg(x), torch.neg(x)
        a.unsqueeze_(0)
        b.transpose_(0, 1)
        c.swapdims_(0, 2)
        d.squeeze_(2)
        return [a, b, c, d, torch.rot90(x, 1, [-3, -2]), torch.rot90(x, 3, [0, 2])]

    want = [(t.shape, t.stride()) for t in step(torch.randn(1, 3, 1, device="neuron"))]
    for _ in range(2):  # (each block's first call of a signature, then a second one)
        with torch.neuron.timing_only():
            x = torch.empty(1, 3, 1, device="neuron")
            assert [(t.shape, t.stride()) for t in step(x)] == want
            assert [(t.shape, t.stride()) for t in step(x)] == want


def _same_run(program_eager, program_timed):
    """(eager report, timing-only report) of two runs of one program."""
    torch.neuron.synchronize()
    with torch.neuron.report_scope() as scope:
        program_eager()
        torch.neuron.synchronize()
    eager = scope.report
    with torch.neuron.timing_only():
        torch.neuron.synchronize()
        with torch.neuron.report_scope() as scope:
            program_timed()
            torch.neuron.synchronize()
    return eager, scope.report


def test_tied_embeddings_stay_one_weight_with_and_without_values():
    """GPT-2 ties its output projection to its token embedding. A model from a config gave each
    module's parameter its own timing-only tensor, which untied them (found by comparing model
    families with and without values): the tied matrix counted twice against HBM and a training
    step lost the gradient sum of its two uses. Shared parameters now stay one tensor."""
    from transformers import GPT2Config, GPT2LMHeadModel

    models.register()
    cfg = GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0)
    cfg._attn_implementation = "neuron"
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 16))
    real = GPT2LMHeadModel(cfg).to("neuron")
    real_bytes = sum(p.numel() * p.element_size() for p in real.parameters())
    with torch.neuron.timing_only():
        before = torch.neuron.memory_allocated()
        fake = models.from_config(cfg, torch.float32)
        fake_bytes = torch.neuron.memory_allocated() - before - sum(b.numel() * b.element_size()
                                                                    for b in fake.buffers())
        assert fake.lm_head.weight is fake.transformer.wte.weight
        assert len(list(fake.parameters())) == len(list(real.parameters()))
    assert fake_bytes == real_bytes
    fake.train()
    x = ids.to("neuron")
    with torch.neuron.timing_only():
        fx = ids.to("neuron")
    eager, timed = _same_run(lambda: _train_step(real, x), lambda: _train_step(fake, fx))
    assert _rows(timed) == _rows(eager)
    assert timed.elapsed_us == pytest.approx(eager.elapsed_us, rel=1e-12)


def test_attention_with_dropout_charges_the_softmax_kernel_as_eager():
    """Attention with dropout runs PyTorch's math path, whose _safe_softmax calls softmax from
    C++ below autograd: timing-only charged that implicit composite as one generic kernel, where
    eager takes it apart into _softmax and runs the library softmax kernel (found by comparing
    model families in training). Such a composite is now taken apart in timing-only too."""
    def program(make):
        q, k, v = (make((2, 4, 16, 16)) for _ in range(3))
        torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1).sum().backward()

    eager, timed = _same_run(lambda: program(lambda s: torch.zeros(s, device="neuron", requires_grad=True)),
                             lambda: program(lambda s: torch.zeros(s, device="neuron", requires_grad=True)))
    assert _rows(eager)[("_softmax", "softmax")] == 1  # the math path's softmax, as the library kernel
    assert _rows(timed) == _rows(eager)
    assert timed.elapsed_us == pytest.approx(eager.elapsed_us, rel=1e-12)


def test_host_index_tensors_run_as_eager_runs_them():
    """x[host_index] and x[host_index] = v with the index on the host (as CUDA allows) failed in
    timing-only with FakeTensor's device-mismatch error (found by the same comparison). Indexing
    copies each host index to the device, as eager does (charged); index_put reads it where it is."""
    def program(x):
        i = torch.tensor([0, 2, 2])
        y = x[i]
        x[torch.tensor([1, 3])] = 0.0
        return x[i, torch.tensor([1, 0, 1])], y

    eager, timed = _same_run(lambda: program(torch.empty(4, 5, device="neuron")),
                             lambda: program(torch.empty(4, 5, device="neuron")))
    assert _rows(eager)[("_copy_from", "generic:copy_h2d")] == 3  # x[i] once, x[i, j] twice
    assert _rows(timed) == _rows(eager)
    assert timed.elapsed_us == pytest.approx(eager.elapsed_us, rel=1e-12)


def test_tensors_from_data_cost_one_copy_to_the_device_as_in_eager():
    """torch.tensor(data, device="neuron"), a list index (x[[0, 2]]) and a host tensor made from
    data then moved: eager copies each from the host once. Timing-only charged nothing for the
    first two (fake mode made them on the device directly) and two copies for a number moved
    (fake mode ran the copy of its held value on the real device too); a Mistral decode step was
    13 us off. Each is one charged copy now, and the host tensor keeps its value (.item())."""
    def program():
        a = torch.tensor([1.0, 2.0], device="neuron")
        b = torch.tensor(3.0, device="neuron")
        n = torch.tensor(5)
        c = n.to("neuron")
        x = torch.empty(4, 4, device="neuron")
        d = x[[0, 2]]
        x[[1, 3]] = 0.0
        x[0].copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        return n, (a, b, c, d)

    eager, timed = _same_run(program, program)
    assert _rows(eager)[("_copy_from", "generic:copy_h2d")] == 6
    assert _rows(timed) == _rows(eager)
    assert timed.elapsed_us == pytest.approx(eager.elapsed_us, rel=1e-12)
    with torch.neuron.timing_only():
        n, _ = program()
        assert n.item() == 5
