"""The differential tester (benchmarks/difftest.py): every op the bridge serves, argument
variants drawn from each op's schema, run on CPU and on neuron with the fast path, without it and
compiled; plus the findings it made, each pinned here as a regression test of its own.

The quick run is seeded and draws 20 samples of every op (each with its variants: the five
dtypes, broadcasting, masks, strides and offsets, in-place on views, out=, empty and 0-dim
tensors, extreme values); every 8th sample CPU accepts is also compiled (in graphs of 60), every
25th also run on timing-only tensors. The
long run is ``python benchmarks/difftest.py --samples 400`` (see its docstring).
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "difftest.py"
_spec = importlib.util.spec_from_file_location("difftest", _PATH)
dt = importlib.util.module_from_spec(_spec)
sys.modules["difftest"] = dt  # dataclasses look their module up here
_spec.loader.exec_module(dt)

QUICK_SAMPLES = 20
QUICK_COMPILE_EVERY = 8  # (every 4th: 76 s CPU for the run, every 8th: 67 s; the file under 2 min)
QUICK_TIMING_EVERY = 25


# ---- the quick run ------------------------------------------------------------------------------
def test_quick_run_every_op_agrees_with_cpu(capsys):
    ops = list(dt.served_ops())
    stats = dt.run(ops, QUICK_SAMPLES, dt.SEED, compile_every=QUICK_COMPILE_EVERY, echo=print,
                   timing_every=QUICK_TIMING_EVERY)
    lines = [m.line() for m in stats.mismatches]
    assert not lines, f"{len(lines)} mismatches:\n" + "\n".join(lines[:40])
    assert all(n >= QUICK_SAMPLES for n, _ in stats.by_op.values()), \
        {op: n for op, (n, _) in stats.by_op.items() if n < QUICK_SAMPLES}
    assert set(stats.by_op) == set(ops)  # every op drew its samples
    assert stats.compiled >= len(ops)  # (about one compiled sample in four of those CPU accepts)
    assert stats.fast_hits > 1000  # the fast path served its second calls
    assert stats.timing_only > 50
    for name in ("float32", "bfloat16", "float16", "int64", "bool"):
        assert stats.by_dtype[name] > 500


def test_the_tested_ops_are_the_ones_the_bridge_names():
    from torch_bridge import lowering

    ops = dt.served_ops()
    dead = set(dt.dead_table_names())
    assert set(lowering.OPS) - dead <= set(ops)
    # ops with a neuron kernel the table does not list are in too: the fast path's, TensorE's, attention
    for name in ("mm", "addmm", "bmm", "baddbmm", "scaled_dot_product_attention", "native_layer_norm", "where",
                 "_foreach_add_", "convolution_overrideable", "_thnn_fused_lstm_cell", "copy_"):
        assert name in ops, name
    assert not any(name.startswith("c10d") for name in ops)


_MX_ON_TRN3 = r"""
import json, math, sys, importlib.util
import torch
spec = importlib.util.spec_from_file_location("difftest", sys.argv[1])
dt = importlib.util.module_from_spec(spec); sys.modules["difftest"] = dt; spec.loader.exec_module(dt)
out = {"served": "mx_matmul" in dt.served_ops(), "dead": "mx_matmul" in dt.dead_table_names()}
stats = dt.run(["mx_matmul"], 20, dt.SEED, compile_every=1, echo=None, timing_every=5)
out.update(samples=stats.by_op["mx_matmul"], compiled=stats.compiled, timing_only=stats.timing_only,
           mismatches=[m.line() for m in stats.mismatches])
from torch_bridge import values
real = values.host_kernel
def skewed(name, fn, args, kwargs):  # the device's values one ulp up: every device way must see it
    r = real(name, fn, args, kwargs)
    return torch.nextafter(r, torch.full_like(r, math.inf)) if name == "mx_matmul" else r
values.host_kernel = skewed
stats = dt.run(["mx_matmul"], 4, 7, compile_every=1, echo=None)
out["skewed_modes"] = sorted({m.mode for m in stats.mismatches})
print(json.dumps(out))
"""


def test_mx_matmul_is_tested_where_the_device_serves_it():
    """The lowering table's one custom op, ``trnsim::mx_matmul`` (torch.neuron.mx_matmul), needs
    NeuronCore-v4's MX matmul: a trn2 device refuses it in one line by design, so there it is
    among the dead names; under TRNSIM_CONFIG=trn3 the tester serves it with its recipe (fp8
    operands, E8M0 scales per 32 values, each output dtype): 20 samples agree with CPU on the
    fast path, the Python path, compiled and timing-only, and a value one ulp off is seen."""
    import json
    import os
    import subprocess

    if not os.environ.get("TRNSIM_CONFIG"):
        assert "mx_matmul" in dt.dead_table_names() and "mx_matmul" not in dt.served_ops()
    env = {**os.environ, "TRNSIM_CONFIG": "trn3", "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", _MX_ON_TRN3, str(_PATH)], capture_output=True, text=True, env=env,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.splitlines()[-1])
    assert out["served"] and not out["dead"]
    assert out["samples"][0] == 20 and out["samples"][1] == 20 and not out["mismatches"], out
    assert out["compiled"] >= 10 and out["timing_only"] >= 2
    modes = {m.split(" (")[0] for m in out["skewed_modes"]}  # ('fast-path (first call)': its first call)
    assert {"fast-path", "python-path", "compiled"} <= modes, out["skewed_modes"]


# ---- the tester itself can fail ----------------------------------------------------------------
def _sample(packet: str = "add") -> "dt.Sample":
    return dt.Sample(packet, torch.ops.aten.add.Tensor, [torch.ones(3), torch.ones(3)], {}, ["float32"], 7)


def test_it_reports_a_wrong_value_in_one_line():
    s = _sample()
    cpu = dt.Run(result=torch.tensor([2.0, 2.0, 2.0]))
    dev = dt.Run(result=torch.tensor([2.0, 2.0, 2.5]).to("neuron"))
    why = dt.compare(s, cpu, dev, "fast-path", lambda: None)
    assert why == "result 0: values differ (1 of 3 elements, first at (2,): 2.5 vs CPU 2.0)"
    line = dt.Mismatch(s, "fast-path", why).line()
    assert "\n" not in line and line.endswith("python benchmarks/difftest.py --repro add 7")


def test_it_reports_what_cpu_refuses_and_the_device_computes():
    s = _sample()
    cpu = dt.Run(error=RuntimeError("shapes cannot be multiplied"))
    dev = dt.Run(result=torch.zeros(3).to("neuron"))
    assert dt.compare(s, cpu, dev, "python-path", lambda: None).startswith("CPU raised RuntimeError")
    dev = dt.Run(error=IndexError("out of range"))
    assert "device IndexError" in dt.compare(s, cpu, dev, "python-path", lambda: None)


def test_it_reports_strides_dtypes_aliasing_and_writes_outside_the_view():
    s = _sample()
    w = torch.zeros(2, 3)
    assert "strides" in dt.compare(s, dt.Run(result=w), dt.Run(result=torch.zeros(3, 2).t().to("neuron")), "m",
                                   lambda: None)
    assert "dtype" in dt.compare(s, dt.Run(result=w), dt.Run(result=w.double().to("neuron")), "m", lambda: None)
    a = dt.Run(result=w, aliases=[("is", 0)])
    b = dt.Run(result=w.to("neuron"), aliases=[None])
    assert dt.compare(s, a, b, "m", lambda: None).startswith("aliasing")
    a = dt.Run(result=w, storages=[torch.tensor([1, 2], dtype=torch.uint8)])
    b = dt.Run(result=w.to("neuron"), storages=[torch.tensor([1, 3], dtype=torch.uint8)])
    assert dt.compare(s, a, b, "m", lambda: None).startswith("input storage 0 differs")


def test_nan_payloads_are_one_value_and_signed_zeros_two():
    s = _sample()
    nan2 = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert dt.compare(s, dt.Run(result=torch.tensor([math.nan])), dt.Run(result=nan2.to("neuron")), "m",
                      lambda: None) is None
    assert dt.compare(s, dt.Run(result=torch.tensor([0.0])), dt.Run(result=torch.tensor([-0.0]).to("neuron")), "m",
                      lambda: None) is not None


def test_tensore_results_get_their_summation_order_and_no_more():
    s = _sample("mm")
    exact = torch.tensor([1.0, 1000.0], dtype=torch.float64)
    cpu = torch.tensor([1.0, 1000.0])
    near = dt.Run(result=torch.tensor([1.0, 1000.0 + 0.005]).to("neuron"))
    far = dt.Run(result=torch.tensor([1.0, 1000.5]).to("neuron"))
    assert dt.compare(s, dt.Run(result=cpu), near, "m", lambda: exact) is None
    assert "TensorE error" in dt.compare(s, dt.Run(result=cpu), far, "m", lambda: exact)


def test_it_finds_a_wrong_value_the_python_path_returns(monkeypatch):
    """End to end: a fallback that returns exp's values one ulp up is caught, on the Python path
    (the fast path, in C++, is not touched and agrees)."""
    from torch_bridge import values

    run = values._run

    def skewed(op, info, args, kwargs):
        out = run(op, info, args, kwargs)
        if info.name == "exp" and isinstance(out, torch.Tensor) and out.is_floating_point() and out.numel():
            out.copy_(torch.nextafter(out, torch.full_like(out, math.inf)))
        return out
    monkeypatch.setattr(values, "_run", skewed)
    stats = dt.run(["exp"], 6, seed=3, compile_every=0, echo=None)
    modes = {m.mode for m in stats.mismatches}
    assert "python-path" in modes and "fast-path" not in modes, [m.line() for m in stats.mismatches]


def test_a_sample_is_its_seed():
    a, b = dt.make_sample("gather", 12345), dt.make_sample("gather", 12345)
    assert a.describe() == b.describe()
    assert all(torch.equal(x, y) for x, y in zip(a.args, b.args) if isinstance(x, torch.Tensor))


def test_the_repro_line_reruns_one_sample(capsys):
    assert dt.main(["--repro", "mul", "99", "--no-compile"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == "ok" and out.startswith("mul")


# ---- findings, each kept as its regression test ------------------------------------------------


def test_a_compiled_batch_compares_a_grown_out_over_what_it_held_as_eager_runs_do():
    """Found by the long run (seed 20261206): nll_loss2d_backward with an empty grad_input, compiled
    in one graph with a nextafter.out, grew the out's storage (the device and CPU's aot_eager wrote
    the same bytes); the harness compared a compiled run's storages whole and eager CPU's over
    their size before the call, and reported the 64 grown bytes as a write outside the view."""
    t = dt.Tester(20261206, dt.DTYPES, 1)
    t._flushes = 0  # (the graph was traced with static sizes)
    for packet, seed in (("nextafter", 147974546940508), ("nll_loss2d_backward", 218721670307601)):
        t.run_sample(dt.make_sample(packet, seed))
    assert len(t._compile_queue) == 2
    t.flush_compiled()
    assert t.stats.compiled == 2 and [m.line() for m in t.stats.mismatches] == []


def test_an_in_place_result_beside_an_aliased_written_pair_is_eagers(monkeypatch):
    """Found by a values hunt (seed 7017, bf16/fp16, palette share 0.3): mish_ on an fp16 view
    (stride (7, 2), offset 1) compiled in one graph with a mul.Scalar_out whose out overlaps its
    self came back as its storage re-viewed at offset 0 (7 of 9 elements, 2.0 where CPU has 0.0).
    PyTorch's AOTAutograd does it on every device (CPU's aot_eager gives the same values): it merges
    the aliased, written pair into one base, which moves mish_'s input. The neuron backend now runs
    such a graph op by op (torch_bridge.compile.backend), so the device gives eager's values."""
    monkeypatch.setattr(dt, "PALETTE_SHARE", 0.3)
    dtypes = [torch.bfloat16, torch.float16]
    t = dt.Tester(7017, dtypes, 1, echo=None)
    t._flushes = 1  # (the graph was traced with symbolic sizes)
    for packet, seed in (("mish_", 209374328211299), ("mul", 73740386674766)):
        t.run_sample(dt.make_sample(packet, seed, dtypes))
    assert len(t._compile_queue) == 2
    t.flush_compiled()
    assert [m.line() for m in t.stats.mismatches] == [] and t.stats.torch_compile_differs == 0


def test_nextafter_with_a_host_scalar_refused_by_torch_compile_is_torchs_rule(capsys):
    """Found by a --fresh long run (seed 20261207): torch.compile refuses nextafter(neuron tensor,
    host 0-dim tensor) while tracing (PyTorch's fake tensors do not take a CPU scalar for the ops
    CUDA's kernels refuse it for), which CPU's compiled reference cannot show; the eager device
    computes it as CPU does. Counted with torch's compile semantics, not as the device's mismatch."""
    assert dt.main(["--repro", "nextafter", "127748837082229"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "ok"


def test_out_into_a_view_writes_where_cpu_writes():
    """An out= of the wrong size (or empty) was given fresh memory on the device: a view of the
    out's storage kept its old values, where CPU resizes the out in place and writes there."""
    for device in ("cpu", "neuron"):
        base = torch.zeros(6, device=device)
        out = base[1:1]  # empty, over base's memory
        torch.sum(torch.ones(3, device=device), 0, out=out)
        assert base.cpu().tolist() == [0.0, 3.0, 0.0, 0.0, 0.0, 0.0], device
        base = torch.zeros(2, device=device)
        out = base[:2]
        torch.mul(torch.ones(4, device=device), 2, out=out)  # grows the storage base shares
        assert out.untyped_storage().data_ptr() == base.untyped_storage().data_ptr(), device
        assert base.untyped_storage().nbytes() == 16, device


def test_resize_grows_the_storage_every_view_shares():
    a = torch.zeros(2, device="neuron")
    b = a.view(2)
    a.resize_(10)
    a.fill_(1.0)
    assert b.cpu().tolist() == [1.0, 1.0]  # (was a new storage for a alone)


def test_resize_to_the_sizes_a_strided_view_has_keeps_its_strides():
    """Found by difftest's long run (resize_ 72760927155011): a strided view resized to its own
    sizes was made contiguous, so it read other elements of its storage afterwards; CPU does
    nothing (with memory_format given it restrides, as here)."""
    for device in ("cpu", "neuron"):
        base = torch.arange(10.0, device=device)
        v = base[1::2]
        assert v.resize_(5).stride() == (2,), device
        assert v.cpu().tolist() == [1.0, 3.0, 5.0, 7.0, 9.0], device
        assert v.resize_(5, memory_format=torch.contiguous_format).stride() == (1,), device
        assert v.cpu().tolist() == [1.0, 2.0, 3.0, 4.0, 5.0], device


def test_resize_and_empty_refuse_preserve_format_like_cpu():
    for device in ("cpu", "neuron"):
        with pytest.raises(RuntimeError, match="(?i)unsupported memory format ?preserve"):
            torch.empty(2, 3).to(device).resize_(4, memory_format=torch.preserve_format)
        with pytest.raises(RuntimeError, match="unsupported memory format Preserve"):
            torch.ops.aten.empty.memory_format([2], device=device, memory_format=torch.preserve_format)


def test_silu_and_mish_backward_run_whole_like_cpu():
    """silu_backward was decomposed (CompositeImplicitAutograd) into elementwise ops: an ulp off
    CPU's kernel, and it took int64/bool tensors CPU refuses."""
    g, x = torch.randn(64, generator=torch.Generator().manual_seed(0)), torch.randn(64)
    for op in (torch.ops.aten.silu_backward.default, torch.ops.aten.mish_backward.default):
        want = op(g, x)
        got = op(g.to("neuron"), x.to("neuron")).cpu()
        assert torch.equal(got, want), op
    with pytest.raises(NotImplementedError):
        torch.ops.aten.silu_backward(torch.ones(3, dtype=torch.long, device="neuron"),
                                     torch.ones(3, dtype=torch.long, device="neuron"))


def test_every_op_cpu_runs_whole_is_claimed_whole():
    """An op with a CPU kernel and a CompositeImplicitAutograd decomposition runs decomposed on any
    other device unless claimed (registration.WHOLE_OPS); a new one in a torch release shows here."""
    from torch_bridge.registration import WHOLE_OPS

    keys = torch._C.DispatchKey
    both = [n[len("aten::"):] for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")
            and torch._C._dispatch_has_kernel_for_dispatch_key(n, keys.CompositeImplicitAutograd)
            and torch._C._dispatch_has_kernel_for_dispatch_key(n, keys.CPU)]
    assert both and set(both) <= set(WHOLE_OPS)


def test_histc_counts_integers_in_every_form_and_refuses_bool():
    x = torch.tensor([0, 1, 1, 5, 9])
    want = torch.histc(x.float(), 5, 0, 10).long()
    assert torch.histc(x.to("neuron"), 5, 0, 10).cpu().tolist() == want.tolist()
    out = torch.empty(0, dtype=torch.long, device="neuron")
    torch.histc(x.to("neuron"), 5, 0, 10, out=out)  # the out= form took CPU's kernel, which refuses integers
    assert out.cpu().tolist() == want.tolist()
    with pytest.raises(NotImplementedError):
        torch.histc(torch.ones(3, dtype=torch.bool, device="neuron"))


def test_histc_of_integers_over_int64s_whole_range_does_not_wrap():
    """Long-run finding (histc 165531027294353): an int64 input holding int64's max, auto range:
    (x - min) * bins wrapped and the bin index went negative (bincount's error) where the values
    binned as numbers give [8, 0, 0, 0, 1]."""
    assert dt.main(["--repro", "histc", "165531027294353"]) == 0
    x = torch.tensor([-3, -2, -1, 4, -5, 0, 1, -3, 2 ** 63 - 1])
    assert torch.histc(x.to("neuron"), 5).cpu().tolist() == [8, 0, 0, 0, 1]
    # a range of 2**63 at 4 bins, binned exactly: the negatives below the midpoint 0 in bin 1, the rest in
    # bin 2 (float64 rounded -5 + 2**62 to 2**62 and put all eight in bin 2); int64's max is past the range
    assert torch.histc(x.to("neuron"), 4, -(2 ** 62), 2 ** 62).cpu().tolist() == [0, 5, 3, 0]


def test_convolution_refuses_what_cpu_refuses():
    """The datapath's im2col computed a convolution of mismatched channels, and a 0-dim or 3-d
    bias, where CPU raises."""
    x, w = torch.randn(1, 2, 5, 5), torch.randn(3, 1, 3, 3)
    with pytest.raises(RuntimeError) as cpu:
        F.conv2d(x, w)
    with pytest.raises(RuntimeError) as dev:
        F.conv2d(x.to("neuron"), w.to("neuron"))
    assert str(dev.value) == str(cpu.value)
    with pytest.raises(RuntimeError, match="expected bias to be 1-dimensional"):
        torch.ops.aten.convolution_overrideable(x.to("neuron"), torch.randn(3, 2, 3, 3, device="neuron"),
                                                torch.randn((), device="neuron"), [1, 1], [0, 0], [1, 1], False,
                                                [0, 0], 1)


def test_convolution_output_layout_is_cpus_for_ambiguous_strides():
    """Long-run finding (seed 120873051521927): an input (1, 2, 4, 1) with strides (2, 1, 2, 2) is
    channels-last contiguous only through its size-1 dims; CPU's slow 2-d kernel asks
    ``suggest_memory_format`` (contiguous here) and returns a contiguous output, the device made it
    channels-last. Its repro, then every stride order of a few shapes with size-1 dims (2-d and
    3-d, float32 and bfloat16, whose CPU backends differ) against CPU's output strides."""
    import itertools

    def strided(shape, order, gen):  # dense strides laid out in ``order`` (innermost first)
        strides, step = [0] * len(shape), 1
        for d in order:
            strides[d] = step
            step *= shape[d]
        return torch.randn(step, generator=gen).as_strided(shape, strides)

    def check(x, w, b, *params):
        want = torch.ops.aten.convolution(x, w, b, *params)
        got = torch.ops.aten.convolution_overrideable(
            *(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="neuron").copy_(t) for t in (x, w, b)),
            *params)
        assert got.stride() == want.stride(), (x.shape, x.stride(), w.shape, w.stride(), got.stride(), want.stride())
        torch.testing.assert_close(got.cpu(), want, rtol=2e-2, atol=1e-2)

    x = torch.arange(8.0).as_strided((1, 2, 4, 1), (2, 1, 2, 2))
    w = torch.tensor([1.0, -2.0, 0.5, 3.0]).as_strided((2, 2, 1, 1), (1, 2, 2, 2))
    check(x, w, torch.zeros(2), [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    gen = torch.Generator().manual_seed(3)
    cases = [((1, 2, 4, 1), (2, 2, 1, 1)), ((2, 3, 1, 1), (2, 3, 1, 1)), ((1, 1, 3, 3), (2, 1, 1, 1)),
             ((1, 2, 1, 3, 1), (2, 2, 1, 1, 1))]
    checked = 0
    for dtype in (torch.float32, torch.bfloat16):
        for xs, ws in cases:
            k = len(xs) - 2
            for xo, wo in zip(itertools.permutations(range(len(xs))), itertools.cycle(
                    itertools.permutations(range(len(ws))))):
                check(strided(xs, xo, gen).to(dtype), strided(ws, wo, gen).to(dtype), torch.zeros(ws[0], dtype=dtype),
                      [1] * k, [0] * k, [1] * k, False, [0] * k, 1)
                checked += 1
    assert checked == 2 * (3 * 24 + 120)


@pytest.mark.parametrize("seed", [188223455553162])
def test_causal_attention_repro_from_the_long_run(seed):
    """Long-run finding: attn_mask with is_causal=True, 5 queries over 4 keys, a NaN key above
    the diagonal: CPU's flash kernel gives row 0 numbers, the device NaN (every way)."""
    s = dt.make_sample("scaled_dot_product_attention", seed, dt.DTYPES)
    t = dt.Tester(dt.SEED, dt.DTYPES, 1, echo=None)
    t.run_sample(s)
    t.flush_compiled()
    assert not [m.line() for m in t.stats.mismatches]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_causal_attention_writes_its_mask_over_nan_and_inf_scores_as_cpus_flash_kernel(dtype):
    """CPU's flash kernel writes -inf over the scores above the diagonal before it scales them
    and adds the mask, so a NaN or inf key there changes nothing; a boolean mask is added as
    0/-inf, so a NaN score where it is False stays NaN. The device added the causal -inf (NaN
    stays NaN: whole rows NaN) and filled the boolean mask. Both of its paths: the fused kernel
    (L == S) and op by op (L != S), scale None, 0 and negative."""
    g = torch.Generator().manual_seed(0)
    checked = 0
    for l, s in ((4, 4), (5, 4), (3, 4), (1, 6)):
        for where in ("k_nan", "k_inf", "v_inf", "mask_inf"):
            for scale in (None, 0.0, -0.5):
                for mk in ("none", "bool", "float"):
                    q, k, v = (torch.randn(1, 2, n, 8, generator=g).to(dtype) for n in (l, s, s))
                    if where == "k_nan":
                        k[..., -1, 0] = math.nan
                    elif where == "k_inf":
                        k[..., s // 2, 1] = math.inf
                    elif where == "v_inf":
                        v[..., 1, 0] = math.inf
                    mask = None if mk == "none" else (torch.rand(l, s, generator=g) > 0.3) if mk == "bool" \
                        else torch.randn(l, s, generator=g).to(dtype)
                    if where == "mask_inf" and mk == "float":
                        mask[0, -1], mask[-1, 0] = math.inf, math.nan
                    for causal in (False, True):
                        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
                        got = F.scaled_dot_product_attention(
                            q.to("neuron"), k.to("neuron"), v.to("neuron"),
                            attn_mask=None if mask is None else mask.to("neuron"), is_causal=causal,
                            scale=scale).cpu()
                        what = (l, s, where, scale, mk, causal)
                        assert torch.equal(got.isnan(), want.isnan()), what
                        assert torch.equal(got.isinf(), want.isinf()), what
                        fin = want.isfinite()
                        tol = 1e-5 if dtype == torch.float32 else 2 ** -7
                        torch.testing.assert_close(got[fin].float(), want[fin].float(), rtol=tol, atol=tol,
                                                   msg=str(what))
                        checked += 1
    assert checked == 4 * 4 * 3 * 3 * 2


@pytest.mark.parametrize("seed", [167355199899617, 17573962839114])
def test_attention_whose_scores_overflow_or_are_not_finite_gives_cpus_values(seed):
    """Long-run findings, every way (fast path, Python path, compiled):
    167355199899617 (fp32, CPU's math path: k not unit-stride): Q Kᵀ sums 1e30 * 1e30 and
    -1e30 * 1e30; CPU's small bmm rounds each product to +-inf and gets NaN, the datapath's fused
    multiply-add -inf. 17573962839114 (fp16, causal, GQA, 4 queries over 5 keys, NaN and inf
    inputs): CPU's flash kernel's blocked online softmax and fp16 exponentials put NaNs elsewhere
    (88 NaNs, the device 118); a compiled graph traced the op-by-op decomposition, which cannot
    look at the values."""
    s = dt.make_sample("scaled_dot_product_attention", seed, dt.DTYPES)
    t = dt.Tester(dt.SEED, dt.DTYPES, 1, echo=None)
    t.run_sample(s)
    t.flush_compiled()
    assert t.stats.compiled == 1
    assert not [m.line() for m in t.stats.mismatches]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", ["mm", "bmm", "addmm", "baddbmm", "conv"])
def test_matmuls_whose_products_overflow_give_cpus_infinities_and_nans(op, dtype):
    """1e30 * 1e30 - 1e30 * 1e30: CPU's small bmm and its bf16 mm round each product to +-inf
    (NaN); the datapath's fused multiply-add kept the product exact and gave -inf. Operands whose
    products may overflow, or that hold a NaN or inf, take CPU's kernel (the fast path's float32
    matmuls step aside to it too); finite bounded ones stay on the datapath."""
    a = torch.zeros(1, 4, 8, dtype=dtype)
    a[0, 0, 0], a[0, 0, 1], a[0, 1, 2] = -1e30, 1e30, 1e30
    b = torch.full((1, 8, 4), 1e30, dtype=dtype)
    c = torch.ones(1, 4, 4, dtype=dtype)
    on = (lambda x: x.to("neuron"))
    if op == "conv":  # a 1x1 convolution is the same sum: channels are the contraction
        x, w = a[0].t().reshape(1, 8, 2, 2).contiguous(), b[0].t().reshape(4, 8, 1, 1).contiguous()
        want, got = F.conv2d(x, w), F.conv2d(on(x), on(w)).cpu()
    else:
        args = {"mm": (a[0], b[0]), "bmm": (a, b), "addmm": (c[0], a[0], b[0]), "baddbmm": (c, a, b)}[op]
        f = getattr(torch, op)
        dev = list(map(on, args))
        want, got = f(*args), f(*dev).cpu()
        from torch_bridge.eager import fastpath
        hits = fastpath.hits()
        again = f(*dev).cpu()  # the second call of a signature: the native fast path's, for float32
        assert fastpath.hits() == hits  # (it stepped aside to Python's path: CPU's kernel)
        assert torch.equal(again.isnan(), want.isnan()) and torch.equal(again.isinf(), want.isinf())
        if dtype == torch.float32:  # bounded operands of the same signature: the fast path's datapath
            small = [on(x.clamp(-1, 1)) for x in args]
            f(*small)
            f(*small)
            assert fastpath.hits() > hits
    assert want.isnan().any() or want.isinf().any()
    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf()), (got, want)
    torch.testing.assert_close(got, want, equal_nan=True)


def _unbounded_finite_operands():
    """float32 operands past tensore.bounded's bound (k * max|a| * max|b| ~ 3e39) whose products
    are all finite: 1e20 meets only 1e-21s, 1e17 only zeros; the rest random."""
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(2, 16, 300, generator=g), torch.randn(2, 300, 24, generator=g)
    a[:, 0, 0], b[:, 0, :], a[:, :, 1], b[:, 1, 0] = 1e20, 1e-21, 0.0, 1e17
    c = torch.randn(2, 16, 24, generator=g)
    return a, b, c


@pytest.mark.parametrize("op", ["mm", "addmm", "bmm", "baddbmm", "compiled"])
def test_a_finite_matmul_of_unbounded_operands_is_the_datapaths_on_every_path(op):
    """The operands' bound (tensore.bounded) is a worst case: past it, a finite result still
    differs from CPU's by rounding alone (an overflow would leave it non-finite). The native fast
    path took such results from the datapath while Python's path and a compiled region's matmul
    head took CPU's kernel: the same program gave other bits with the fast path off or compiled.
    Each now keeps a finite datapath result (scanned after the bias), whatever the path."""
    from torch_bridge.eager import fastpath, tensore

    a, b, c = _unbounded_finite_operands()
    assert not tensore.bounded(300, a, b)
    dp = tensore.bmm_f32(a, b)
    assert bool(dp.isfinite().all()) and not torch.equal(dp, torch.bmm(a, b))  # (the paths can differ)
    args = {"mm": (a[0], b[0]), "addmm": (c[0], a[0], b[0]), "bmm": (a, b), "baddbmm": (c, a, b),
            "compiled": (a[0], b[0], c[0, 0])}[op]
    want = {"mm": dp[0], "addmm": dp[0] + c[0], "bmm": dp, "baddbmm": dp + c,
            "compiled": torch.relu(dp[0] + c[0, 0])}[op]
    dev = [x.to("neuron") for x in args]
    if op == "compiled":
        f = torch.compile(lambda x, w, bias: torch.relu(torch.addmm(bias, x, w)), backend="neuron")
    else:
        f = getattr(torch, op)
    for on in (True, False):
        with fastpath.turned(on):
            for _ in range(2):  # (the second call of a float32 signature is the fast path's)
                assert torch.equal(f(*dev).cpu(), want), (op, on)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_causal_attention_over_512_keys_with_a_plus_inf_mask_gives_cpus_values(dtype):
    """CPU's flash kernel over more than 512 keys (its key block) runs an online softmax per
    block, rounding fp16/bf16 exponentials: a +inf in a float mask left 18,528 NaNs of 19,200
    where the device's one-pass softmax gave all 19,200; a non-positive scale and non-finite
    inputs took other routes too. Such calls take CPU's kernel's values."""
    g = torch.Generator().manual_seed(0)
    n = 600
    q, k, v = (torch.randn(1, 2, n, 16, generator=g).to(dtype) for _ in range(3))
    mask = torch.zeros(n, n, dtype=dtype).masked_fill_(torch.rand(n, n, generator=g) < 0.05, math.inf)
    on = (lambda x: x.to("neuron"))
    k_nan = k.index_fill(2, torch.tensor([3]), math.nan)
    for m, scale, kk in ((mask, None, k), (None, 0.0, k), (None, -0.5, k), (None, None, k_nan)):
        want = F.scaled_dot_product_attention(q, kk, v, attn_mask=m, is_causal=True, scale=scale)
        got = F.scaled_dot_product_attention(on(q), on(kk), on(v), attn_mask=None if m is None else on(m),
                                             is_causal=True, scale=scale).cpu()
        assert torch.equal(got.isnan(), want.isnan()), scale
        torch.testing.assert_close(got, want, equal_nan=True, rtol=2 ** -7, atol=2 ** -7)


def test_a_timing_only_composite_promotes_a_number_with_a_0_dim_tensor_as_cpu():
    """Long-run finding (timing-only; --repro now reruns that mode too): div.Scalar_mode of a
    0-dim fp16 tensor by -1.5 came out float32: the composite's number was made a default-dtype
    0-dim tensor, which outranks a 0-dim fp16 self where the wrapped number does not."""
    assert dt.main(["--repro", "div", "237960526044720"]) == 0
    with torch.neuron.timing_only():
        for shape in ((), (3,)):
            for dtype, num in ((torch.float16, -1.5), (torch.bfloat16, 2), (torch.int32, 3), (torch.int64, 2.5)):
                x = torch.empty(shape, dtype=dtype, device="neuron")
                want = torch.div(torch.ones(shape, dtype=dtype), num, rounding_mode="floor").dtype
                assert torch.div(x, num, rounding_mode="floor").dtype == want, (shape, dtype, num)


def test_a_sample_that_crashes_cpus_kernel_runs_in_a_child_and_the_device_must_refuse_it():
    """CPU's fp16 oneDNN convolution segfaults for some shapes (a torch bug; long run seed 2412307,
    convolution_overrideable 230417798230204): the shard died with it. Such samples (CRASHY ops in
    fp16/bf16) run on CPU in a forked child; where CPU crashes the device must raise."""
    import ctypes

    assert dt._in_child(lambda: ctypes.string_at(0)) == "crashed"
    assert dt._in_child(lambda: 1 / 0) == "raised"
    assert dt._in_child(lambda: dt.Run(error=RuntimeError("refused"))) == "raised"
    assert dt._in_child(lambda: dt.Run(result=1)) == "returned"
    assert dt._in_child(lambda: time.sleep(10), timeout=0.2) == "hung"  # killed, not waited for
    # the child runs one thread: a forked child has none of the parent's OpenMP workers (CI hung)
    assert dt._in_child(lambda: dt.Run(result=torch.get_num_threads())) == "returned"
    assert dt._in_child(lambda: 1 / (torch.get_num_threads() - 1)) == "raised"
    s = dt.make_sample("convolution_overrideable", 230417798230204, dt.DTYPES)
    assert dt._may_crash(s)
    assert dt._undilated(s).args[5] == [1, 1] and s.args[5] == [2, 2]


@pytest.mark.parametrize("seed", [230417798230204, 116800094049707])
def test_a_convolution_whose_cpu_kernel_crashes_dilated_over_a_size_1_kernel_gives_its_undilated_values(seed):
    """Long-run finding (seeds 2412307, 2412318): CPU's fp16 convolution segfaults for a dilated
    size-1 kernel dimension (x (2,4,2,1), w (1,4,1,1), stride 2, padding 1, dilation 2), and so did
    the device, which runs CPU's kernel for its checks. A size-1 kernel's dilation moves no tap: the
    device hands CPU the same convolution undilated, and gives its values."""
    assert dt.main(["--repro", "convolution_overrideable", str(seed)]) == 0
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 4, 2, 1, generator=g).half(), torch.randn(1, 4, 1, 1, generator=g).half()
    want = torch.ops.aten.convolution.default(x, w, None, [2, 2], [1, 1], [1, 1], False, [0, 0], 1)
    got = torch.ops.aten.convolution.default(x.to("neuron"), w.to("neuron"), None, [2, 2], [1, 1], [2, 2], False,
                                             [0, 0], 1)
    torch.testing.assert_close(got.cpu(), want)
    xg, wg = x.to("neuron").requires_grad_(), w.to("neuron").requires_grad_()
    torch.nn.functional.conv2d(xg, wg, stride=2, padding=1, dilation=2).sum().backward()
    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.nn.functional.conv2d(xc, wc, stride=2, padding=1, dilation=1).sum().backward()
    torch.testing.assert_close(xg.grad.cpu(), xc.grad)
    torch.testing.assert_close(wg.grad.cpu(), wc.grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_gradients_of_overflowing_scores_are_cpus(dtype):
    """The backward of a call whose forward took CPU's kernel's values (datapath_exact false:
    here Q Kᵀ sums 1e30 * 1e30 and -1e30 * 1e30) is CPU's kernel's backward too: the datapath's
    backward from P put NaNs in dK/dV where CPU's flash backward has 8 (32 here). The fused
    op's path (L == S); op by op (L != S) and compiled backwards are not covered yet."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 4, 8, generator=g).to(dtype) for _ in range(3))
    q[0, 1, 0, :2] = 1e30
    k[0, 1, :, 0], k[0, 1, :, 1] = 1e30, -1e30
    go = torch.randn(1, 2, 4, 8, generator=g).to(dtype)
    for causal in (False, True):
        cpu = [t.clone().requires_grad_() for t in (q, k, v)]
        F.scaled_dot_product_attention(*cpu, is_causal=causal).backward(go)
        dev = [t.to("neuron").requires_grad_() for t in (q, k, v)]
        F.scaled_dot_product_attention(*dev, is_causal=causal).backward(go.to("neuron"))
        for a, b in zip(cpu, dev):
            got = b.grad.cpu()
            assert torch.equal(got.isnan(), a.grad.isnan()) and torch.equal(got.isinf(), a.grad.isinf()), causal
            torch.testing.assert_close(got, a.grad, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_gradients_of_overflowing_scores_are_cpus_op_by_op(dtype):
    """The same for the op-by-op path (3 queries, 5 keys: not the fused op): its forward already
    took CPU's kernel's values, but its backward was autograd through the decomposed arithmetic,
    which put 40 NaNs in dK where CPU's flash backward has 8 (causal, float32)."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 3, 8, generator=g).to(dtype)
    k, v = (torch.randn(1, 2, 5, 8, generator=g).to(dtype) for _ in range(2))
    q[0, 1, 0, :2] = 1e30
    k[0, 1, :, 0], k[0, 1, :, 1] = 1e30, -1e30
    go = torch.randn(1, 2, 3, 8, generator=g).to(dtype)
    for causal in (False, True):
        cpu = [t.clone().requires_grad_() for t in (q, k, v)]
        want = F.scaled_dot_product_attention(*cpu, is_causal=causal)
        want.backward(go)
        dev = [t.to("neuron").requires_grad_() for t in (q, k, v)]
        got = F.scaled_dot_product_attention(*dev, is_causal=causal)
        got.backward(go.to("neuron"))
        torch.testing.assert_close(got.detach().cpu(), want.detach(), equal_nan=True)
        for a, b in zip(cpu, dev):
            torch.testing.assert_close(b.grad.cpu(), a.grad, equal_nan=True)


@pytest.mark.parametrize("seed", [74854108674711, 204197738243539, 91416097824352])
def test_scaled_mm_adds_an_expanded_bias_s_values(seed):
    """Long-run finding: CPU's _scaled_mm reads a bias as contiguous whatever its strides, so an
    expanded bias (stride 0) added memory past its one-element storage, on CPU and on the device
    alike; the device adds the bias's values (the tester's reference is CPU's kernel with the bias
    made contiguous)."""
    s = dt.make_sample("_scaled_mm", seed, dt.DTYPES)
    t = dt.Tester(dt.SEED, dt.DTYPES, 1, echo=None)
    t.run_sample(s)
    t.flush_compiled()
    assert not [m.line() for m in t.stats.mismatches]
    a = torch.randn(2, 32).to(torch.float8_e4m3fn)
    w = torch.randn(16, 32).to(torch.float8_e4m3fn).t()
    one = torch.tensor(1.0)
    bias = torch.tensor([3.0], dtype=torch.bfloat16).expand(16)
    want = torch._scaled_mm(a, w, one, one, bias=bias.contiguous(), out_dtype=torch.bfloat16)
    on = (lambda x: x.to("neuron"))
    got = torch._scaled_mm(on(a), on(w), on(one), on(one), bias=on(torch.tensor([3.0], dtype=torch.bfloat16)).expand(16),
                           out_dtype=torch.bfloat16)
    assert torch.equal(got.cpu(), want)


def test_convolution_with_infinities_gives_cpus_values():
    """im2col multiplied an infinite weight by the padding's zeros: NaN at the border where CPU's
    convolution gives numbers."""
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(2, 2, 5, 3, generator=g), torch.randn(2, 2, 3, 3, generator=g)
    w[0, 0, 0, 0] = -math.inf
    want = F.conv2d(x, w, padding=1, stride=2)  # (which skips the padding: no NaN at the border here)
    got = F.conv2d(x.to("neuron"), w.to("neuron"), padding=1, stride=2).cpu()
    assert torch.equal(got.isnan(), want.isnan())
    torch.testing.assert_close(got, want, equal_nan=True)


def test_attention_raises_cpus_error_for_a_one_dim_mask():
    """CPU's backend choice indexes the mask's last two dims (IndexError for a 1-d mask); the
    device computed the math path's broadcast instead."""
    q = torch.randn(1, 2, 4, 8)
    m = torch.zeros(4)
    with pytest.raises(IndexError):
        F.scaled_dot_product_attention(q, q, q, attn_mask=m)
    with pytest.raises(IndexError):
        F.scaled_dot_product_attention(q.to("neuron"), q.to("neuron"), q.to("neuron"), attn_mask=m.to("neuron"))


def test_dynamo_never_compiles_the_kernels_wrapper():
    """An op run eagerly at a graph break of a compiled function reaches its Python kernel with
    dynamo's callback installed: dynamo compiled the kernel's wrapper, broke at its first line and
    recompiled the rest per signature until its recompile limit (the tester's compiled runs warned)."""
    from torch_bridge import fastpath
    from torch_bridge.registration import _hidden

    def f(x: torch.Tensor) -> torch.Tensor:
        n = torch.nonzero(x > 0)  # data-dependent: a graph break that runs the op eagerly
        return x.sum() + n.shape[0]
    compiled = torch.compile(f, backend="neuron")
    before = fastpath.enabled()
    fastpath.set_enabled(False)  # every op through its Python kernel
    try:
        for n in (3, 4, 5):
            x = torch.randn(n, generator=torch.Generator().manual_seed(n))
            assert compiled(x.to("neuron")).item() == f(x).item()
    finally:
        fastpath.set_enabled(before)
    code = _hidden(lambda: None).__code__  # every kernel's wrapper shares it
    assert torch._C._dynamo.eval_frame._debug_get_cache_entry_list(code) == []


def test_a_tensor_passed_twice_is_one_tensor_to_cpus_kernel():
    """An empty tensor given as both self and values of index_put_ is its own source: CPU's
    overlap check refuses it (RuntimeError); each argument got its own empty view on the device,
    which then failed later with an IndexError."""
    for device in ("cpu", "neuron"):
        x = torch.empty(0, device=device)
        with pytest.raises(RuntimeError, match="refer to a single memory location"):
            torch.ops.aten._index_put_impl_(x, [torch.tensor([0], device=device)], x, False, False)


@pytest.mark.parametrize("seed", [95836739971173, 190442727921741, 31720329505174])
def test_addmm_with_alpha_zero_ignores_its_matrices_as_cpu_blas_does(seed):
    """Found by the long run: CPU's float32 addmm is BLAS's sgemm, which never reads mat1 and mat2
    when alpha == 0, so an inf or NaN there does not reach the result (beta * self, zeros when
    beta == 0); the device multiplied the product by 0 and returned NaN, on the fast path (its own
    addmm in C++), the Python path and compiled. bfloat16/float16 addmm and baddbmm multiply on
    CPU too (NaN), and still do. Each seed is a long-run sample; its repro runs every way."""
    assert dt.main(["--repro", "addmm", str(seed)]) == 0


def test_addmm_alpha_zero_of_a_transposed_self_is_contiguous_as_cpus():
    """Long-run finding (addmm 77569792224220): with alpha == 0 the result was a clone of self,
    keeping a transposed self's strides (1, 5) where CPU's addmm returns a new contiguous (4, 1)."""
    assert dt.main(["--repro", "addmm", "77569792224220"]) == 0
    c = torch.randn(4, 5).t()
    for beta in (1, 2, 0):
        want = torch.addmm(c, torch.randn(5, 3), torch.randn(3, 4), alpha=0, beta=beta)
        got = torch.addmm(c.to("neuron"), torch.randn(5, 3, device="neuron"), torch.randn(3, 4, device="neuron"),
                          alpha=0, beta=beta)
        assert got.stride() == want.stride() == (4, 1) and torch.equal(got.cpu(), want), beta


def test_addmm_alpha_zero_values_exactly():
    nan, inf = math.nan, math.inf
    cases = [(torch.tensor([[-0.0, nan]]), torch.tensor([[inf]]), torch.tensor([[1.0, 2.0]])),
             (torch.tensor([[-0.0], [nan]]), torch.tensor([[inf], [1.0]]), torch.tensor([[1.0, 2.0]])),
             (torch.tensor([3.0, -1.0]), torch.tensor([[nan, 1.0], [1.0, 1.0]]), torch.ones(2, 2))]
    for dtype in (torch.float32, torch.bfloat16):
        for c, a, b in cases:
            c, a, b = c.to(dtype), a.to(dtype), b.to(dtype)
            for beta in (1, 0, -1, 0.5):
                want = torch.addmm(c, a, b, alpha=0, beta=beta)
                for _ in range(3):  # the fast path learns the call, then serves it
                    got = torch.addmm(c.to("neuron"), a.to("neuron"), b.to("neuron"), alpha=0, beta=beta).cpu()
                    assert torch.equal(got.isnan(), want.isnan()) and torch.equal(
                        got.nan_to_num(7).view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                        want.nan_to_num(7).view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), \
                        (dtype, beta, c, a, got, want)


@pytest.mark.parametrize("seed", [156536206257829, 28160770053613])
def test_to_other_gets_a_device_tensor_as_other(seed):
    """The long run's to.other samples with a host 0-dim tensor as ``other`` were the tester's own
    error: ``other`` names the result's device, so the device call copied to the host where CPU's
    returned self (aliasing and strides 'differed'). ``other`` is never a host scalar now."""
    s = dt.make_sample("to", seed)
    assert "host-scalar" not in s.tags
    assert dt.main(["--repro", "to", str(seed)]) == 0


@pytest.mark.parametrize("seed", [270523570142181, 142041825015452])
def test_a_compiled_division_by_zero_gives_cpus_infinities(seed):
    """Found by the long run: a fused region divided by a scalar as a multiply by 1.0 / scalar,
    and 1.0 / 0 failed the compile (BackendCompilerFailed: ZeroDivisionError); the IEEE
    reciprocal (+-inf) gives x / +-0 exactly."""
    assert dt.main(["--repro", "div_", str(seed)]) == 0
    x = torch.tensor([1.0, -2.0, 0.0, math.inf, math.nan], dtype=torch.float16)
    f = torch.compile(lambda t, d: t / d, backend="neuron")
    for d in (0, 0.0):  # (-0.0 after 0.0 reuses its graph: dynamo's guard, as on CPU)
        assert torch.equal(f(x.to("neuron"), d).cpu().nan_to_num(7), (x / d).nan_to_num(7)), d


# ---- what the fast path may write, and first calls in fresh processes ----------------------------
_WRITE_GUARD = r"""
import json, sys, importlib.util
spec = importlib.util.spec_from_file_location("difftest", sys.argv[1])
dt = importlib.util.module_from_spec(spec); sys.modules["difftest"] = dt; spec.loader.exec_module(dt)
packets = dt.fast_served_packets()
ran, found, _ = dt.write_guard(packets, 3)
_, bn, _ = dt.write_guard(["native_batch_norm"], 20)
print(json.dumps({"packets": len(packets), "ran": ran, "found": {k: list(v) for k, v in found.items()},
                  "bn": {k: [v[0], list(v[1])] for k, v in bn.items()}}))
"""


def test_no_op_the_fast_path_serves_writes_an_argument_its_schema_does_not_annotate():
    """The native fast path runs an op's CPU kernel on its arguments' memory and, on the first call
    of a signature, once more in Python's path to learn the cost: an op that writes an argument
    without a `(a!)` annotation is written twice (BatchNorm's running statistics moved by 0.19
    instead of 0.1, 2e3c152). Every op it serves by its schema (over 1,300 aten packets) runs 3
    samples on CPU, every input's bytes compared before and after; the only writer found,
    native_batch_norm, must be served only by its own kernel, which learns before it runs (and the
    probe must see it).
    The probe forks a child per chunk of ops, so it runs in a fresh process: forked from this
    one, which other tests left with threads (Ray's driver), a child can deadlock on a lock
    another thread held at the fork (it did, in a full-suite run)."""
    import json
    import os
    import subprocess

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", _WRITE_GUARD, str(_PATH)], capture_output=True, text=True, env=env,
                         timeout=1200)
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["packets"] > 1000
    assert out["ran"] > 3000
    # native_batch_norm is served by its own kernel (csrc/neuron.cpp's fast_batch_norm), which looks
    # the cost up from the arguments before it runs CPU's kernel: an unlearnt signature runs only
    # Python's path (test_fastpath's first-batch-norm test checks the statistics move once)
    served = {k: v for k, v in out["found"].items() if v[0] not in ("python", None)
              and not (k == "native_batch_norm" and v[0] == "batch_norm")}
    assert not served, served
    assert out["bn"] == {"native_batch_norm": ["batch_norm", ["running_mean", "running_var"]]}


def test_cov_which_writes_a_0_dim_input_is_left_to_pythons_path():
    """The long run's write guard (--write-guard 5 --seed 2412397): CPU's cov centres a 0-dim
    input in place (cov 35713836657508: self becomes 0) though its schema annotates no write;
    the fast path served it as functional (its first call runs the kernel twice)."""
    s = dt.make_sample("cov", 35713836657508, dt.DTYPES)
    assert dt.unannotated_writes(s) == ["self"]
    from torch_bridge.eager import fastpath

    assert fastpath.kind(s.op) == "python"


def test_first_calls_in_fresh_processes_agree_with_cpu():
    """difftest --fresh: each op in a process of its own, so its first sample is the first call
    the process makes (the in-process run teaches every op before it compares, which hid the
    BatchNorm double update): a stateful op, an in-place one, out= variants and the fast path's
    own matmul."""
    import subprocess

    r = subprocess.run([sys.executable, str(_PATH), "--fresh", "--ops", "native_batch_norm,add_,addmm",
                        "--samples", "8", "--no-compile", "--timing-every", "0"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    summary = next(ln for ln in r.stdout.splitlines() if ln.startswith("difftest:"))
    assert "3 ops, 24 samples" in summary and "0 mismatches" in summary, summary


def test_pointwise_ops_of_two_dtypes_lay_out_their_result_as_cpu():
    """Long-run finding (ne 277120007080837): ``ne`` of an expanded int64 tensor and a permuted
    bfloat16 one came out with the bfloat16 operand's strides (1, 4, 4, 2) where CPU's are
    (6, 2, 2, 1), the values the same: its composite kernel ordered the dims on the operands as
    they are, where CPU's first casts the int64 one to the common dtype (a dense copy)."""
    assert dt.main(["--repro", "ne", "277120007080837"]) == 0

    def pair(device: str) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.arange(2, device=device).as_strided((2, 3, 1, 2), (0, 0, 2, 1))
        b = (torch.arange(24, device=device) % 5 + 1).to(torch.bfloat16).as_strided((2, 3, 1, 2), (1, 4, 4, 2))
        return a, b

    for op in (torch.ne, torch.lt, torch.ge, torch.maximum, torch.atan2, torch.pow, torch.xlogy, torch.fmod):
        want, got = op(*pair("cpu")), op(*pair("neuron"))
        assert got.stride() == want.stride(), op.__name__
        assert torch.equal(got.cpu(), want), op.__name__


def test_every_pointwise_op_of_several_tensors_is_claimed_from_its_composite_kernel():
    """Each functional pointwise op of two or more tensors with a CPU kernel and a
    CompositeExplicitAutogradNonFunctional one (registration.LAYOUT_OPS and the lists before it) has the bridge's kernel
    on the device: a new one in a torch release is claimed, or shows here."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    kind = []
    for n in torch._C._dispatch_get_all_op_names():
        if not (n.startswith("aten::") and has(n, "CompositeExplicitAutogradNonFunctional") and has(n, "CPU")):
            continue
        packet, _, overload = n[len("aten::"):].partition(".")
        op = getattr(getattr(torch.ops.aten, packet), overload or "default")
        schema = op._schema
        if (torch.Tag.pointwise in op.tags and len(schema.returns) == 1
                and all(a.alias_info is None for a in schema.arguments)
                and sum(str(a.type) in ("Tensor", "Optional[Tensor]") for a in schema.arguments) >= 2):
            kind.append(n)
    assert len(kind) > 40 and "aten::ne.Tensor" in kind and "aten::addcmul" in kind
    assert [n for n in kind if not has(n, "PrivateUse1")] == []


def test_an_empty_out_keeps_its_sizes_for_ops_that_check_them():
    """Long-run finding (normal.Tensor_float_out): an empty neuron out was handed to CPU's kernel
    as a (0,) stand-in, and ``normal`` with an empty (0, 5, 1, 3) mean, which checks its out
    against the mean instead of resizing it, raised on the first call where CPU computes."""
    for device in ("cpu", "neuron"):
        mean = torch.zeros(0, 5, 1, 3, dtype=torch.bool, device=device)
        out = torch.empty(0, 5, 1, 3, device=device)
        assert torch.normal(mean, 0.5, out=out).stride() == (15, 3, 3, 1)
        assert out.shape == (0, 5, 1, 3)


def test_an_empty_out_view_at_an_offset_raises_cpu_s_error():
    """An empty out's stand-in had a 0-byte storage: ``index_copy_`` into an empty view at an
    offset, which restrides its out before it checks the index, raised a RuntimeError (setStorage
    out of bounds) where CPU raises IndexError. The stand-in has the out's storage size and
    offset now; an in-range copy into a non-empty view is unchanged."""
    for device in ("cpu", "neuron"):
        x = torch.zeros(10, 4, device=device)
        src = torch.ones(1, 4, device=device)
        msg = r"^index_copy_\(\): index 0 is out of bounds for dimension 0 with size 0$"
        with pytest.raises(IndexError, match=msg):
            x[3:3].index_copy_(0, torch.tensor([0], device=device), src)
        x[5:5].index_add_(0, torch.tensor([0], device=device), src)  # CPU's: no check, nothing added
        assert x.sum().item() == 0
        x[3:5].index_copy_(0, torch.tensor([1], device=device), src)
        assert x.sum().item() == 4 and x[4].tolist() == [1.0] * 4


def test_all_and_any_over_several_dims_refuse_a_float_out_as_cpu_does():
    """Found by difftest (all 13945163706620): all/any over several dims reached the device through
    PyTorch's CompositeExplicitAutograd kernel, which reduces one dim at a time and copies into the
    out, so a float out= CPU refuses was filled with 1.0. Claimed, CPU's kernel checks it; the
    values over several dims are CPU's."""
    for device in ("cpu", "neuron"):
        x = torch.tensor([[1.0, 0.0, 2.0], [3.0, 4.0, 5.0]], device=device)
        for op in (torch.ops.aten.all.dims_out, torch.ops.aten.any.dims_out):
            with pytest.raises(RuntimeError, match=r"only supports bool tensor for result, got: Float"):
                op(x, [0, 1], False, out=torch.empty((), device=device))
        got = [torch.all(x, dim=(0, 1)), torch.any(x == 0, dim=(0, 1), keepdim=True), torch.all(x, dim=(1,)),
               torch.all(torch.empty(0, 3, device=device), dim=(0,))]
        assert [t.tolist() for t in got] == [False, [[True]], [False, True], [True, True, True]]
        assert all(t.dtype == torch.bool for t in got)


def test_every_op_with_a_cpu_kernel_and_a_composite_explicit_one_is_claimed():
    """An op with a CPU kernel and a CompositeExplicitAutograd one runs that composite on any other
    device unless claimed, and the composite may check, round or lay out otherwise than CPU's
    kernel (all/any over several dims, addr, linalg._powsum, _stack: registration.CPU_CHECKED_OPS);
    a new one in a torch release shows here."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    kind = [n for n in torch._C._dispatch_get_all_op_names() if n.startswith("aten::")
            and has(n, "CompositeExplicitAutograd") and has(n, "CPU")]
    assert "aten::addr" in kind and "aten::all.dims" in kind
    assert [n for n in kind if not has(n, "PrivateUse1")] == []


def test_addr_powsum_and_stack_are_cpu_s_kernels():
    """Found by scanning for that kind: addr's composite (outer, mul, add) rounded otherwise than
    CPU's kernel and took a float beta for integer tensors; linalg._powsum's (abs, pow, sum)
    summed otherwise; _stack's (cat of unsqueezed) took unequal sizes and kept an out= of another
    size. Claimed: CPU's values, dtypes and errors."""
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        s, a, b = (torch.randn(*shape, generator=g).to(dtype) for shape in ((5, 7), (5,), (7,)))
        want = torch.addr(s, a, b, beta=0.7, alpha=1.3)
        got = torch.addr(s.to("neuron"), a.to("neuron"), b.to("neuron"), beta=0.7, alpha=1.3)
        assert got.dtype == want.dtype and torch.equal(got.cpu(), want), dtype
        x = torch.randn(6, 7, generator=g).to(dtype)
        for ord_, kw in ((2, dict(dim=1)), (3, {}), (-1, dict(dim=1)), (1, dict(dtype=torch.float32))):
            want = torch.linalg._powsum(x, ord_, **kw)
            got = torch.linalg._powsum(x.to("neuron"), ord_, **kw)
            assert got.dtype == want.dtype and torch.equal(got.cpu(), want), (dtype, ord_, kw)
    for device in ("cpu", "neuron"):
        ints = torch.ones(3, 3, dtype=torch.int64, device=device)
        with pytest.raises(RuntimeError, match="argument beta must not be a floating point number"):
            torch.addr(ints, ints[0], ints[0], beta=0.5)
        with pytest.raises(RuntimeError, match="stack expects each tensor to be equal size"):
            torch._stack([torch.ones(4, 2, 3, device=device), torch.ones(0, device=device)])
        out = torch.empty(2, 3, device=device)
        torch._stack([torch.ones(2, 3, device=device)], -1, out=out)
        assert out.shape == (2, 3, 1)


def test_median_over_a_repeated_dim_is_the_median_on_every_call():
    """Found by difftest (nanmedian 36194534138583): CPU's median.dim / nanmedian.dim read outside
    an input that repeats elements along the reduced dim (an expanded tensor, stride 0), and the
    device ran that kernel on its memory: other values on each call. The device gives the median
    of the same values laid out densely, on every call, eagerly, into out= and compiled."""
    base = torch.tensor([[1.0], [2.0], [float("nan")]])
    for op in (torch.median, torch.nanmedian):
        want = op(base.expand(3, 4).contiguous(), 1)
        x = base.to("neuron").expand(3, 4)
        compiled = torch.compile(lambda t, op=op: op(t, 1), backend="neuron", fullgraph=True)
        values, indices = torch.empty(3, device="neuron"), torch.empty(3, dtype=torch.long, device="neuron")
        got = [tuple(op(x, 1)) for _ in range(3)] + [tuple(compiled(x)), op(x, 1, out=(values, indices))]
        for v, i in got:
            torch.testing.assert_close(v.cpu(), want.values, rtol=0, atol=0, equal_nan=True)
            assert torch.equal(i.cpu(), want.indices)


def test_flash_attention_kernels_read_a_strided_last_dim_as_its_dense_copy():
    """Found by difftest (seed 8802, 111498464434879): CPU's _scaled_dot_product_flash_attention_for_cpu
    and its backward read the last dim of query, key and value (and the backward's out) as
    contiguous whatever its stride: past the operand for stride 2, its neighbours for stride 0.
    Run on the device's memory that gave other values on each call. The device gives what CPU
    gives for the same values laid out densely, on every call, eagerly and compiled."""
    fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, 5, 4, generator=g) for _ in range(3))
    out, lse = fwd(q, k, v, 0.0, False)
    grad = torch.randn(2, 2, 5, 4, generator=g)
    want_bwd = bwd(grad, q, k, v, out, lse, 0.0, False)

    def strided(t: torch.Tensor) -> torch.Tensor:  # the same values, the last dim of stride 2
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], device="neuron")
        wide[..., ::2] = t.to("neuron")
        return wide[..., ::2]

    dev = [t.to("neuron") for t in (q, k, v)]
    compiled = torch.compile(lambda a, b, c: fwd(a, b, c, 0.0, False)[0], backend="neuron", fullgraph=True)
    for i in range(3):
        args = list(dev)
        args[i] = strided((q, k, v)[i])
        got = [fwd(*args, 0.0, False)[0] for _ in range(3)] + [compiled(*args)]
        assert all(torch.equal(o.cpu(), out) for o in got)
        grads = bwd(grad.to("neuron"), *args, strided(out), lse.to("neuron"), 0.0, False)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(grads, want_bwd))
    expanded = torch.randn(2, 2, 5, 1, generator=g).expand(2, 2, 5, 4)
    assert torch.equal(fwd(expanded.to("neuron"), dev[1], dev[2], 0.0, False)[0].cpu(),
                       fwd(expanded.contiguous(), k, v, 0.0, False)[0])


def test_an_out_that_must_grow_under_its_own_input_is_refused():
    """Found by difftest (--wide, seed 9101: addr_ 246918285969438): ``addr_`` is ``addr.out(self,
    .., out=self)``. With a self of another shape than the outer product the out must grow, and
    the device's first try resized the shared host view before its storage refused: the second
    try read that view past its memory (1.1e32 where CPU raised). CPU grows the out under its own
    input, so its kernel reads rows it has written (addr) or refuses the overlap (cat). The device
    refuses all such calls in CPU's overlap words, and still serves the well-formed ones."""
    import warnings

    b, c = torch.arange(5.0), torch.arange(5.0) - 2
    for shape in ((5,), (5, 1), (1, 5), (1,)):
        a = (torch.arange(float(math.prod(shape))) + 1).reshape(shape)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (CPU's warning for a resized out)
            for call in (lambda x, y, z: x.addr_(y, z), lambda x, y, z: torch.addr(x, y, z, out=x),
                         lambda x, y, z: torch.cat([x, x], out=x)):
                da = a.to("neuron")
                with pytest.raises(RuntimeError, match="refer to a single memory location"):
                    call(da, b.to("neuron"), c.to("neuron"))
                assert da.shape == a.shape and torch.equal(da.cpu(), a)  # untouched
    square = torch.ones(5, 5)
    got = square.to("neuron").addr_(b.to("neuron"), c.to("neuron"))
    assert torch.equal(got.cpu(), square.clone().addr_(b, c))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = torch.empty(3, device="neuron")
        torch.addr(torch.ones(5, device="neuron"), b.to("neuron"), c.to("neuron"), out=out)  # an out of its own
    assert torch.equal(out.cpu(), torch.addr(torch.ones(5), b, c))


def test_native_batch_norms_refuse_statistics_their_kernels_read_past_or_lack():
    """Found by difftest (--wide, seeds 9101 and 9103): CPU's native batch norms read each statistic
    and the weight at input.size(1) places unchecked (a 0-dim bias: -1.3e23 on CPU, other values
    on the device), and dereference the running statistics of an evaluation or the saved ones of a
    training backward when they are missing (SIGSEGV, on CPU and on the device). Refused in one
    line; longer statistics (their first elements) and well-formed calls give CPU's values."""
    aten = torch.ops.aten
    g = torch.Generator().manual_seed(9)
    x, gy = torch.randn(4, 3, generator=g), torch.randn(4, 3, generator=g)
    w, b, rm, rv = torch.randn(3, generator=g), torch.randn(3, generator=g), torch.zeros(3), torch.ones(3)
    sm, si = torch.randn(3, generator=g), torch.rand(3, generator=g) + 0.5
    reserve = torch.empty(0, dtype=torch.uint8)
    d = lambda t: t.to("neuron") if isinstance(t, torch.Tensor) else t  # noqa: E731
    refused = [
        lambda f: aten.native_batch_norm(f(x), f(w), f(b), None, None, False, 0.1, 1e-5),
        lambda f: aten._native_batch_norm_legit.no_stats(f(x), f(w), f(b), False, 0.1, 1e-5),
        lambda f: aten._native_batch_norm_legit.no_stats(f(x), f(w), f(torch.tensor(0.5)), True, 0.1, 1e-5),
        lambda f: aten._native_batch_norm_legit(f(x), f(w[:2]), f(b), f(rm.clone()), f(rv.clone()), True, 0.1, 1e-5),
        lambda f: aten._native_batch_norm_legit_no_training(f(x), f(w), f(b), f(rm[:1]), f(rv), 0.1, 1e-5),
        lambda f: aten.native_batch_norm_backward(f(gy), f(x), f(w), f(rm), f(rv), None, None, True, 1e-5,
                                                  [True, True, True]),
        lambda f: aten.native_batch_norm_backward(f(gy), f(x), f(w), None, None, f(sm), f(si), False, 1e-5,
                                                  [True, True, True]),
        lambda f: aten.native_batch_norm_backward(f(gy), f(x), f(w), f(rm), f(rv), f(sm[:1]), f(si), True, 1e-5,
                                                  [True, True, True]),
        lambda f: aten.batch_norm_backward(f(gy), f(x), f(w), f(rm), f(rv), None, None, True, 1e-5,
                                           [True, True, True], f(reserve)),
    ]
    for call in refused:
        with pytest.raises(RuntimeError, match=r"^neuron: aten::\w+ needs "):
            call(d)
    served = [
        lambda f: aten.native_batch_norm(f(x), f(w), f(b), f(rm.clone()), f(rv.clone()), True, 0.1, 1e-5),
        lambda f: aten.native_batch_norm(f(x), f(w), f(b), f(rm), f(rv), False, 0.1, 1e-5),
        lambda f: aten.native_batch_norm(f(x), f(torch.randn(5, generator=torch.Generator().manual_seed(2))), f(b),
                                         None, None, True, 0.1, 1e-5),  # (a longer weight: its first 3)
        lambda f: aten._native_batch_norm_legit.no_stats(f(x), None, None, True, 0.1, 1e-5),
        lambda f: aten.native_batch_norm_backward(f(gy), f(x), f(w), None, None, f(sm), f(si), True, 1e-5,
                                                  [True, True, True]),
        lambda f: aten.native_batch_norm_backward(f(gy), f(x), None, f(rm), f(rv), None, None, False, 1e-5,
                                                  [True, True, True]),
    ]
    for call in served:
        want, got = call(lambda t: t), call(d)
        assert all(torch.equal(a.cpu(), e) for a, e in zip(got, want))


def test_weight_norm_backward_refuses_what_cpu_s_kernel_reads_wrong():
    """Found by difftest (--wide, seed 9111): CPU's _weight_norm_interface_backward checks its saved
    tensors are contiguous but reads grad_w as if it were too (4.7e30 on the device where CPU gave
    4.6e-41), reads v.size(dim) elements of saved_g and saved_norms unchecked, and divides by
    zero on an empty saved_v. Refused in one line; a well-formed call gives CPU's values, and
    weight norm's own backward runs."""
    op = torch.ops.aten._weight_norm_interface_backward
    g = torch.Generator().manual_seed(6)
    v, gain = torch.randn(3, 4, generator=g), torch.randn(3, 1, generator=g)
    _, norms = torch._weight_norm_interface(v, gain, 0)
    gw = torch.randn(3, 4, generator=g)
    d = [t.to("neuron") for t in (gw, v, gain, norms)]
    assert all(torch.equal(a.cpu(), b) for a, b in zip(op(*d, 0), op(gw, v, gain, norms, 0)))
    strided = torch.zeros(3, 8, device="neuron")[:, ::2]
    for args in ((strided, *d[1:]), (d[0][:2], *d[1:]), (d[0], d[1], d[2][:2].contiguous(), d[3]),
                 (torch.empty(0, device="neuron"),) * 4):
        with pytest.raises(RuntimeError, match=r"^neuron: aten::_weight_norm_interface_backward "):
            op(*args, 0)
    lin = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(4, 3))
    lin_d = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(4, 3))
    lin_d.load_state_dict(lin.state_dict())
    lin_d = lin_d.to("neuron")
    x = torch.randn(5, 4, generator=g)
    lin(x).square().sum().backward()
    lin_d(x.to("neuron")).square().sum().backward()
    for p, q in zip(lin.parameters(), lin_d.parameters()):  # (the linear's matmuls are TensorE's: fp32 order)
        torch.testing.assert_close(q.grad.cpu(), p.grad, rtol=1e-5, atol=1e-5)


def test_slow_conv2d_backward_refuses_short_lists():
    """Found by difftest (--wide, seeds 9103 and 9111): CPU's _slow_conv2d_backward reads two values
    of kernel_size, stride and padding without the check its forward makes (a crash for an empty
    stride; a padding of whatever lies past a one-element list). Refused in one line; a well-formed
    call gives CPU's values."""
    op = torch.ops.aten._slow_conv2d_backward.output_mask
    g = torch.Generator().manual_seed(8)
    gy, x, w = torch.randn(1, 2, 3, 3, generator=g), torch.randn(1, 3, 5, 5, generator=g), torch.randn(2, 3, 3, 3, generator=g)
    mask = [True, True, True]
    d = [t.to("neuron") for t in (gy, x, w)]
    want = op(gy, x, w, [3, 3], [1, 1], [0, 0], mask)
    assert all(torch.equal(a.cpu(), b) for a, b in zip(op(*d, [3, 3], [1, 1], [0, 0], mask), want))
    for lists in (([3, 3], [], [0, 0]), ([3, 3], [1, 1], [0]), ([3], [1, 1], [0, 0])):
        with pytest.raises(RuntimeError, match=r"^neuron: aten::_slow_conv2d_backward: 2D \w+ expected"):
            op(*d, *lists, mask)


def test_logcumsumexp_out_of_another_dtype_is_refused():
    """Found by difftest (--wide, seed 9101: _logcumsumexp 223123473756641): CPU's private
    ``_logcumsumexp.out`` writes its input's dtype into the out whatever the out's dtype (2.1e36 in
    a float32 out of float16 values, each call another). Refused in the public op's words; an out
    of the input's dtype gives CPU's values."""
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(3)).half()
    for dtype in (torch.float32, torch.bfloat16):
        with pytest.raises(RuntimeError, match=r"neuron: aten::_logcumsumexp.out: expected scalar_type Half but found"):
            torch.ops.aten._logcumsumexp.out(x.to("neuron"), 1, out=torch.empty(2, 6, dtype=dtype, device="neuron"))
    out = torch.empty(2, 6, dtype=torch.half, device="neuron")
    torch.ops.aten._logcumsumexp.out(x.to("neuron"), 1, out=out)
    assert torch.equal(out.cpu(), torch.ops.aten._logcumsumexp(x, 1))


def test_weight_norm_interface_refuses_what_cpu_s_kernel_reads_wrong():
    """Found by difftest (_weight_norm_interface 141929214407897, 79453927807880, 70024408592883):
    CPU's kernel reads v.size(dim) elements of g and writes as many norms, unchecked, and reads v
    and g as contiguous; run on the device's memory it gave other values on each call. Such calls,
    and a v empty along dim (CPU's kernel divides by zero: SIGFPE), are refused in one line; a
    well-formed call, and torch.nn.utils' weight norm (which calls it), give CPU's values."""
    g = torch.Generator().manual_seed(4)
    v, gain = torch.randn(3, 4, generator=g), torch.randn(3, 1, generator=g)
    for dim, gg in ((0, gain), (1, torch.randn(1, 4, generator=g))):
        want = torch._weight_norm_interface(v, gg, dim)
        got = torch._weight_norm_interface(v.to("neuron"), gg.to("neuron"), dim)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want))
    dv, dg = v.to("neuron"), gain.to("neuron")
    bad = [(dv, torch.tensor(2.0, device="neuron"), 0, "needs g with v.size\\(0\\) = 3 elements and got 1"),
           (dv, torch.randn(2, 3, device="neuron"), 1, "needs g with v.size\\(1\\) = 4 elements and got 6"),
           (dv.t().contiguous().t(), dg, 0, "takes contiguous v and g"),
           (dv, torch.randn(6, 1, device="neuron")[::2], 0, "takes contiguous v and g"),
           (torch.randn(0, 4, device="neuron"), torch.randn(0, 1, device="neuron"), 0,
            "of a v \\(0, 4\\) empty along dim 0: CPU's kernel divides by zero")]
    for vv, gg, dim, msg in bad:
        with pytest.raises(RuntimeError, match="^neuron: aten::_weight_norm_interface " + msg):
            torch._weight_norm_interface(vv, gg, dim)
    normed = torch.nn.utils.parametrizations.weight_norm(torch.nn.Linear(4, 3))  # (its fused path: this op)
    want = normed.weight.detach().clone()
    assert torch.equal(normed.to("neuron").weight.detach().cpu(), want)


def test_batch_norm_without_update_runs_as_cpu_runs_it():
    """Found by difftest --wide: _batch_norm_no_update's composite kernel (an exported model's eval
    BatchNorm) calls CPU's batch_norm_cpu itself, so on neuron every call raised "Expected tensor
    to have CPU Backend". Claimed: CPU's values and errors; the calls CPU's kernel crashes on or
    reads past (it skips batch_norm's checks) are refused in one line."""
    g = torch.Generator().manual_seed(6)
    x, w, b, rm = (torch.randn(*shape, generator=g) for shape in ((2, 3, 4), (3,), (3,), (3,)))
    rv = torch.rand(3, generator=g) + 0.5
    want = torch.ops.aten._batch_norm_no_update(x, w, b, rm, rv, 0.1, 1e-5)
    got = torch.ops.aten._batch_norm_no_update(*(t.to("neuron") for t in (x, w, b, rm, rv)), 0.1, 1e-5)
    assert all(a.shape == c.shape and torch.equal(a.cpu(), c) for a, c in zip(got, want, strict=True))
    with pytest.raises(ValueError, match="running_mean and running_var must either both be None"):
        torch.ops.aten._batch_norm_no_update(x.to("neuron"), None, None, rm.to("neuron"), None, 0.1, 1e-5)
    # what CPU's kernel crashes on (no statistics: SIGSEGV) or reads past (other sizes), refused
    dx, drm, drv = x.to("neuron"), rm.to("neuron"), rv.to("neuron")
    for args, msg in (((dx, None, None, None, None), "needs running_mean and running_var"),
                      ((dx, torch.ones(2, device="neuron"), None, drm, drv), "needs a floating-point weight of"),
                      ((dx, None, None, drm.long(), drv), "needs a floating-point running_mean of")):
        with pytest.raises(RuntimeError, match="^neuron: aten::_batch_norm_no_update " + msg):
            torch.ops.aten._batch_norm_no_update(*args, 0.1, 1e-5)


def test_linear_combination_refuses_what_cpu_s_kernel_reads_past():
    """Found by difftest --wide: _compute_linear_combination (matrix_exp's) reads
    coefficients.size(1) matrices of input and reads coefficients as a matrix of input's dtype,
    unchecked, so more columns than matrices, another rank or another dtype read past memory (other
    values on each call). Refused in one line; well-formed calls, strided ones included, and
    linalg.matrix_exp give CPU's values."""
    f = torch.ops.aten._compute_linear_combination
    g = torch.Generator().manual_seed(7)
    x, c = torch.randn(3, 5, 4, generator=g).transpose(1, 2), torch.randn(3, 2, generator=g).t()
    assert torch.equal(f(x.to("neuron"), c.to("neuron")).cpu(), f(x, c))
    m = torch.randn(2, 4, 4, generator=g) * 0.3
    assert torch.equal(torch.linalg.matrix_exp(m.to("neuron")).cpu(), torch.linalg.matrix_exp(m))
    dx = x.to("neuron")
    for coefficients in (torch.randn(2, 4), torch.randn(2, 3, 1), torch.ones(2, 3, dtype=torch.bool)):
        with pytest.raises(RuntimeError, match="^neuron: aten::_compute_linear_combination needs 2-d coefficients"):
            f(dx, coefficients.to("neuron"))


_KAISER = r"""
import torch, torch_bridge
w = torch.kaiser_window(6, True, 3.0, device="neuron")  # the process's first use of the device
assert w.device.type == "neuron" and torch.equal(w.cpu(), torch.kaiser_window(6, True, 3.0))
print("ok")
"""


def test_kaiser_window_is_made_on_the_device_as_cpu_makes_it():
    """Found by difftest --wide: kaiser_window's composite calls a kernel stub the device has no
    entry for, so torch.kaiser_window(..., device="neuron") failed an INTERNAL ASSERT. Claimed: CPU's
    values, dtypes and errors, also as a process's first call on the device."""
    for args in ((5,), (5, False, 2.0), (0,), (1,)):
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            want = torch.kaiser_window(*args, dtype=dtype)
            got = torch.kaiser_window(*args, dtype=dtype, device="neuron")
            assert got.dtype == want.dtype and torch.equal(got.cpu(), want), (args, dtype)
    out = torch.empty(2, device="neuron")
    torch.ops.aten.kaiser_window.beta_out(4, True, 1.0, out=out)
    assert torch.equal(out.cpu(), torch.kaiser_window(4, True, 1.0))
    with pytest.raises(RuntimeError, match="kaiser_window expects floating point dtypes"):
        torch.kaiser_window(5, dtype=torch.int64, device="neuron")
    run = subprocess.run([sys.executable, "-c", _KAISER], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_a_fused_layer_call_of_other_ranks_gets_cpu_s_outcome():
    """Found by difftest --wide (_transformer_encoder_layer_fwd 141759608960686): a 1-d src, which
    CPU's kernel takes or refuses itself, made the fused layer's cost lowering fail with our own
    IndexError (tuple index out of range). Other ranks are charged as the generic kernel now."""
    from torch_bridge.eager import lowering

    t = dt.Tester(dt.SEED, dt.DTYPES, 0, timing_every=1)
    t.run_sample(dt.make_sample("_transformer_encoder_layer_fwd", 141759608960686, dt.DTYPES))
    assert not t.stats.mismatches, [m.line() for m in t.stats.mismatches]
    one_d = torch.empty(0, device="meta")
    assert lowering.fused_op_specs("_transformer_encoder_layer_fwd", (one_d, 3, 1), {}, []) is None
    assert lowering.fused_op_specs("_native_multi_head_attention", (one_d, one_d, one_d, 4, 2), {}, []) is None


def test_a_compile_refusal_is_excused_only_where_pytorch_gives_it_for_any_device():
    """Found by difftest's long run (copysign 143426224335169): copysign of a neuron tensor and a
    host 0-dim tensor, compiled with symbolic sizes, fails tracing in ``torch._refs.copysign``'s
    own device check, while CPU's compiled reference (one device) runs. PyTorch fails so for any
    device but CPU: the meta device, without trnsim, gives the same error. The rule that excuses
    it asks exactly that, so an error of the device's own is still a mismatch."""
    bf = torch.bfloat16
    s = dt.Sample("copysign", torch.ops.aten.copysign.Tensor,
                  [torch.randn(1, 3, 1, dtype=bf), dt._Host(torch.tensor(-2.0, dtype=bf))], {}, ["host-scalar"], 0)
    dev = dt._compile_batch([(s, None)], dt.DEVICE, dynamic=True)[0]
    assert dev.error is not None and "to be on the same device" in str(dt._innermost(dev.error))
    assert dt._any_device_rule(s, None, dev, True)
    assert not dt._any_device_rule(s, None, dt.Run(error=RuntimeError("neuron: something of its own")), True)
    host_only = dt.Sample("copysign", torch.ops.aten.copysign.Tensor,
                          [torch.randn(1, 3, 1, dtype=bf), torch.tensor(-2.0, dtype=bf)], {}, [], 0)
    assert not dt._any_device_rule(host_only, None, dev, True)  # no host 0-dim argument: not this rule
