"""Mixtral-style MoE blocks on neuron as one op (torch_bridge.moe): a tiny Mixtral (no downloads)
forward and backward against CPU, each layer's block charged as one launch of the library ``moe``
kernel, its values the block's ops run one by one on neuron bit for bit, one graph node under
torch.compile, router logits for the auxiliary loss, and the blocks that keep running op by op."""

from __future__ import annotations

import copy
import subprocess
import sys
import tempfile

import pytest
import torch

from torch_bridge import _native, moe
from torch_bridge.runtime import runtime

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()
from transformers.models.mixtral import modeling_mixtral  # noqa: E402

VOCAB, SEQ, LAYERS, EXPERTS = 128, 16, 2, 4


def _config(**kw) -> "transformers.MixtralConfig":
    base = dict(num_hidden_layers=LAYERS, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ, num_local_experts=EXPERTS,
                num_experts_per_tok=2, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    base.update(kw)
    return transformers.MixtralConfig(**base)


def _model(**kw) -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.MixtralForCausalLM(_config(**kw))


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal up to a few fp32 ulps of the tensor's scale (neuron's matmuls run on the TensorE
    datapath, CPU's on BLAS; see tests/torch/test_models.py)."""
    assert actual.device.type == "neuron", what
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.cpu(), expected, rtol=1e-4, atol=1e-5 * max(scale, 1e-3), msg=what)


def _block_weights(block: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    return block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj


def test_the_block_is_patched_and_cpu_models_are_untouched():
    cls = modeling_mixtral.MixtralSparseMoeBlock
    assert moe.original_forward(cls) is not cls.forward  # the patch is in place (imported transformers)
    block = _model(experts_implementation="eager").model.layers[0].mlp
    h = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(2))
    with torch.neuron.report_scope() as scope:
        got = block(h)
    assert scope.report.launches == 0  # CPU tensors: the block's own forward
    assert torch.equal(got, moe.original_forward(cls)(block, h))


def test_importing_the_mixtral_module_before_torch_loads_and_patches_the_block():
    """transformers' Mixtral module imports torch on its first lines, which loads the bridge while
    the module is still running: the bridge waits for it to finish (``import torch`` failed here,
    the block not yet defined), and patches it at the next import or when the device starts."""
    code = (
        "from transformers.models.mixtral import modeling_mixtral as m\n"
        "cls = m.MixtralSparseMoeBlock\n"
        "import torch\n"
        "x = torch.ones(2, device='neuron')\n"
        "print(hasattr(cls.forward, '_trnsim_original'), torch.nn.Linear(2, 2)(torch.ones(2)).shape)\n")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=tempfile.gettempdir())
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.split() == ["True", "torch.Size([2])"], got.stdout


def test_op_on_cpu_tensors_is_the_blocks_own_values():
    block = _model(experts_implementation="eager").model.layers[0].mlp
    h = torch.randn(SEQ * 2, 64, generator=torch.Generator().manual_seed(3))
    out, logits = torch.ops.trnsim.moe_block(h, *_block_weights(block), 2, True)
    want = moe.original_forward(type(block))(block, h.view(2, SEQ, 64)).view(-1, 64)
    assert torch.equal(out, want)
    assert torch.equal(logits, torch.nn.functional.linear(h, block.gate.weight))


def test_on_neuron_values_are_the_blocks_ops_bit_for_bit_and_one_moe_launch():
    cpu_block = _model(experts_implementation="eager").model.layers[0].mlp
    block = copy.deepcopy(cpu_block).to("neuron")
    h = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(4)).to("neuron")
    with torch.neuron.report_scope() as op_by_op:
        want = moe.original_forward(type(block))(block, h)  # the block's ops, each a neuron kernel
    with torch.neuron.report_scope() as fused:
        got = block(h)
    assert torch.equal(got.cpu(), want.cpu())
    _close(got, cpu_block(h.cpu()), "MoE block")
    rep = fused.report
    assert [(r.op, r.kernel, r.calls) for r in rep.rows] == [("moe_block", "moe", 1)]
    spec = moe.moe_spec(h.view(-1, 64), block.experts.gate_up_proj, 2, True)
    assert spec.shape == (2 * SEQ, 64, 96, EXPERTS) and dict(spec.params) == {"top_k": 2, "normalize": True}
    assert rep.row("moe_block").time_us == pytest.approx(runtime().cost(spec).ticks / runtime().config.tick_hz * 1e6,
                                                         rel=1e-9)
    # both simulated: the one kernel against the ~12 + 9 x experts launches of the op loop
    assert op_by_op.report.launches > 10 * rep.launches
    assert rep.device_us < op_by_op.report.device_us


def test_a_finite_block_of_unbounded_operands_is_still_the_blocks_ops_bit_for_bit():
    """A hidden state of 1e37 that meets only zero weights: past tensore.bounded's worst case,
    every product finite. The block's own ops keep the datapath's finite results (values.mm),
    so the one op must too (it took CPU's linear for such operands). Hidden 256: contractions
    over two of the datapath's 128-row chunks, where its sums and CPU's part ways."""
    block = _model(experts_implementation="eager", hidden_size=256).model.layers[0].mlp
    with torch.no_grad():
        block.gate.weight[:, 0] = 0.0
        block.experts.gate_up_proj[:, :, 0] = 0.0
    block = block.to("neuron")
    h = torch.randn(2, SEQ, 256, generator=torch.Generator().manual_seed(6))
    h[0, 0, 0] = 1e37
    h = h.to("neuron")
    want = moe.original_forward(type(block))(block, h)  # the block's ops, each a neuron kernel
    got = block(h)
    assert torch.isfinite(want.cpu()).all()
    assert torch.equal(got.cpu(), want.cpu())


def test_tiny_mixtral_forward_and_backward_match_cpu():
    cpu = _model()
    dev = copy.deepcopy(cpu).to("neuron")
    x = _tokens()
    out_c = cpu(x, labels=x)
    out_c.loss.backward()
    with torch.neuron.report_scope() as scope:
        out_n = dev(x.to("neuron"), labels=x.to("neuron"))
        out_n.loss.backward()
    _close(out_n.logits, out_c.logits, "logits")
    _close(out_n.loss, out_c.loss, "loss")
    for (name, p), (_, q) in zip(cpu.named_parameters(), dev.named_parameters()):
        _close(q.grad, p.grad, name)
    rep = scope.report
    assert rep.row("moe_block").calls == LAYERS and rep.row("moe_block").kernel == "moe"
    backward = [r for r in rep.rows if r.op == "moe_block_backward"]
    # the experts' gradients: one launch of the library kernel per layer; the router's backward
    # (its linear's two matmuls and the ops before them) as eager kernels, named so
    assert sum(r.calls for r in backward if r.kernel == "moe_backward") == LAYERS
    assert sum(r.calls for r in backward if r.kernel == "matmul") == LAYERS * 2
    # the router's charges are recorded on a signature's first call and replayed after: the same
    # rows, host ops and simulated time as recording them again
    from torch_bridge.ops import moe

    def step():
        dev.zero_grad()
        with torch.neuron.report_scope() as again:
            dev(x.to("neuron"), labels=x.to("neuron")).loss.backward()
            torch.neuron.synchronize()
        return again.report
    replayed = step()
    moe._router_memo.clear()
    recorded = step()
    assert replayed.rows == recorded.rows and replayed.device_us == recorded.device_us
    assert replayed.host_ops == recorded.host_ops


def test_router_logits_reach_the_auxiliary_loss():
    cpu = _model(output_router_logits=True, router_aux_loss_coef=0.02)
    dev = copy.deepcopy(cpu).to("neuron")
    x = _tokens()
    out_c, out_n = cpu(x, labels=x), dev(x.to("neuron"), labels=x.to("neuron"))
    assert len(out_n.router_logits) == LAYERS
    _close(out_n.aux_loss, out_c.aux_loss, "aux loss")
    out_c.loss.backward()
    out_n.loss.backward()
    for (name, p), (_, q) in zip(cpu.named_parameters(), dev.named_parameters()):
        _close(q.grad, p.grad, name)  # the router's gradient includes the aux loss's, via the logits


def test_compiled_model_holds_each_block_as_one_node():
    cpu = _model(num_hidden_layers=1)
    dev = copy.deepcopy(cpu).to("neuron")
    x = _tokens()
    fn = torch.compile(dev, backend="neuron")
    fn(x.to("neuron"))
    with torch.neuron.report_scope() as scope:
        out = fn(x.to("neuron")).logits
    _close(out, cpu(x).logits, "compiled logits")
    assert scope.report.row("moe_block").calls == 1 and scope.report.compiled_graphs == 0

    xn = x.to("neuron")
    loss = torch.compile(lambda t: dev(t, labels=t).loss, backend="neuron")(xn)
    loss.backward()
    ref = copy.deepcopy(cpu)
    ref(x, labels=x).loss.backward()
    _close(dev.model.layers[0].mlp.experts.down_proj.grad, ref.model.layers[0].mlp.experts.down_proj.grad,
           "compiled down_proj grad")


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm", "eager"])
def test_under_autocast_the_op_is_the_blocks_ops_bit_for_bit(impl):
    """autocast runs the router's linear in bf16 and, but for grouped_mm's ``_grouped_mm``, the
    experts' linears too (as CPU's autocast does): the one op takes those dtypes, so its values
    are the block's own ops under autocast bit for bit (it ran every linear in float32)."""
    block = copy.deepcopy(_model(experts_implementation=impl).model.layers[0].mlp).to("neuron")
    h = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(7)).to("neuron")
    router = []
    block.gate.register_forward_hook(lambda m, a, o: router.append(o[0]))
    with torch.autocast("neuron", dtype=torch.bfloat16):
        with torch.neuron.report_scope() as scope:
            got = block(h)
        block.gate._forward_pre_hooks[0] = lambda *a: None  # something observes the router: op by op
        want = block(h)
        del block.gate._forward_pre_hooks[0]
    assert scope.report.row("moe_block").kernel == "moe"
    spec = moe.moe_spec(h.view(-1, 64), block.experts.gate_up_proj, 2, True,
                        None if impl == "grouped_mm" else torch.bfloat16)  # charged in the experts' dtype
    assert spec.dtype == ("fp32" if impl == "grouped_mm" else "bf16")
    assert scope.report.row("moe_block").time_us == pytest.approx(
        runtime().cost(spec).ticks / runtime().config.tick_hz * 1e6, rel=1e-9)
    assert router[0].dtype == router[1].dtype == torch.bfloat16 and torch.equal(router[0].cpu(), router[1].cpu())
    assert got.dtype == want.dtype == torch.float32 and torch.equal(got.cpu(), want.cpu())
    # the backward: the block's autograd under the same casts (CPU's, so a few ulps from the ops');
    # batched_mm's own gathers the experts' bf16 weights per token, so its weight gradients are
    # sums of bf16 terms, a bf16 step at their scale from the loop's
    tol = 8e-3 if impl == "batched_mm" else 1e-3
    with torch.autocast("neuron", dtype=torch.bfloat16):
        got_grads = torch.autograd.grad(block(h).square().sum(), list(block.parameters()))
    block.gate._forward_pre_hooks[0] = lambda *a: None
    with torch.autocast("neuron", dtype=torch.bfloat16):
        want_grads = torch.autograd.grad(block(h).square().sum(), list(block.parameters()))
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == w.dtype
        torch.testing.assert_close(g.cpu(), w.cpu(), rtol=2e-3, atol=tol * w.abs().max().item())


def test_blocks_the_op_does_not_take_run_op_by_op():
    cpu = _model(experts_implementation="eager", hidden_act="gelu")  # the kernel's experts are SwiGLU
    dev = copy.deepcopy(cpu).to("neuron")
    x = _tokens()
    with torch.neuron.report_scope() as scope:
        out = dev(x.to("neuron")).logits
    _close(out, cpu(x).logits, "gelu experts")
    assert all(r.op != "moe_block" for r in scope.report.rows)

    block = copy.deepcopy(_model(experts_implementation="eager").model.layers[0].mlp).to("neuron")
    seen = []
    block.experts.register_forward_hook(lambda m, a, o: seen.append(o.shape))
    with torch.neuron.report_scope() as scope:
        block(torch.randn(1, SEQ, 64).to("neuron"))
    assert seen == [torch.Size([SEQ, 64])] and all(r.op != "moe_block" for r in scope.report.rows)


def test_a_dtype_the_kernel_lacks_is_charged_as_the_blocks_eager_kernels():
    block = _model(experts_implementation="eager").model.layers[0].mlp.double()
    dev = copy.deepcopy(block).to("neuron")
    h = torch.randn(1, SEQ, 64, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    with torch.neuron.report_scope() as scope:
        got = dev(h.to("neuron"))
    torch.testing.assert_close(got.cpu(), block(h), rtol=1e-12, atol=1e-12)
    rows = [r for r in scope.report.rows if r.op == "moe_block"]
    assert rows and all(r.kernel != "moe" for r in rows) and sum(r.calls for r in rows) > 10


def test_integer_histc_counts_as_cuda_does():
    """Hugging Face's MoE code (the aux loss, grouped_mm experts) bins int32 expert ids off CPU."""
    ids = torch.tensor([0, 1, 1, 3, 2, 3, 3], dtype=torch.int32)
    got = torch.histc(ids.to("neuron"), bins=4, min=0, max=3)
    assert got.dtype == torch.int32 and got.cpu().tolist() == [1, 2, 1, 3]
    assert torch.histc(ids.float().to("neuron"), bins=4, min=0, max=3).cpu().equal(torch.histc(ids.float(), 4, 0, 3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_backward_recomputes_the_forward_the_device_computed(dtype):
    """The backward recomputes the block from its inputs. With CPU's linears there, its router
    logits were CPU's (a summation order apart from the datapath's), so a logit a rounding apart
    could send a token to other experts than the forward did (1 token in ~400k in bf16) and its
    gradient to experts it never reached. The recomputation now takes the forward's values."""
    torch.manual_seed(5)
    x = torch.randn(2048, 256).to(dtype)
    w = (torch.randn(8, 256) * 0.05).to(dtype)
    gate_up = (torch.randn(8, 2 * 32, 256) * 0.05).to(dtype)
    down = (torch.randn(8, 256, 32) * 0.05).to(dtype)
    out, logits = torch.ops.trnsim.moe_block(x.to("neuron"), w.to("neuron"), gate_up.to("neuron"),
                                             down.to("neuron"), 2, True)
    again = moe._routing(x, w, 2, True, moe._recompute_linear)[0]
    cpu = moe._routing(x, w, 2, True, moe._cpu_linear)[0]
    assert torch.equal(again, logits.cpu())
    if dtype == torch.float32:  # (in bf16 a logit differs rarely: 8 of 65k at [8192, 256] x [256, 8])
        assert not torch.equal(cpu, logits.cpu())  # what the backward recomputed before


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["plain", "autocast", "signed zeros", "one token", "one token, -0 grads",
                                  "tied router", "logits too"])
def test_the_written_out_backward_is_autograd_of_the_block_bit_for_bit(dtype, case):
    """The kernel path's gradients are the block's derivative written out (no graph built or
    walked): the same bits as autograd of the recomputed block, the input's gradient summed in
    autograd's order and -0 where autograd keeps it, for both normalisations and top-k 1 and 2.
    ("one token, -0 grads": a one-row contraction gives -0 in an expert's weight gradient, which
    autograd's sum over the experts makes +0, as the written-out path's add of 0.0 does.)"""
    g = torch.Generator().manual_seed(7)
    tokens, hidden, ffn, experts = (1 if case.startswith("one token") else 40), 32, 24, 4
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    w = (torch.randn(experts, hidden, generator=g) * 0.3).to(dtype)
    gate_up = (torch.randn(experts, 2 * ffn, hidden, generator=g) * 0.2).to(dtype)
    down = (torch.randn(experts, hidden, ffn, generator=g) * 0.2).to(dtype)
    grad_out = torch.randn(tokens, hidden, generator=g).to(dtype)
    other = torch.bfloat16 if dtype == torch.float32 else torch.float32
    dtypes = (other, other) if case == "autocast" else (None, None)
    grad_logits = torch.randn(tokens, experts, generator=g).to(dtypes[0] or dtype) if case == "logits too" else None
    if case == "signed zeros":
        x[::3] = -0.0
        grad_out[1::2] = -0.0
        down[1] = -0.0
    if case == "one token, -0 grads":
        grad_out.fill_(-0.0)
    if case == "tied router":
        w.zero_()
    for top_k, normalize in ((1, True), (2, True), (2, False)):
        want = moe._backward_values(x, w, gate_up, down, grad_out, grad_logits, top_k, normalize, dtypes, None,
                                    moe._recompute_linear)
        got = moe._direct_backward(x, w, gate_up, down, grad_out, grad_logits, top_k, normalize, dtypes)
        runs = [got]
        if dtypes == (None, None):  # (computed by the native op, trnsim::moe_backward_values)
            assert _native.op("moe_backward_values")(x, w, gate_up, down, grad_out, grad_logits, top_k, normalize)
            with pytest.MonkeyPatch.context() as mp:  # and the Python path it stands in for
                mp.setattr(moe._native, "op", lambda name: None)
                runs.append(moe._direct_backward(x, w, gate_up, down, grad_out, grad_logits, top_k, normalize, dtypes))
        for got in runs:
            for name, a, b in zip(("x", "router", "gate_up", "down"), want, got):
                assert a.dtype == b.dtype and a.shape == b.shape, name
                assert torch.equal(_bits(a), _bits(b)), (name, top_k, normalize)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["plain", "signed zeros", "one token", "tied router", "unbounded", "float64"])
def test_the_native_forward_is_the_blocks_ops_with_datapath_linears_bit_for_bit(dtype, case, monkeypatch):
    """The forward's values come from one native call (trnsim::moe_forward_values) where it takes
    them: the same bits as block_values with the datapath's linears, for both normalisations and
    top-k 1 and 2; operands off the datapath (float64) take CPU's mm there too."""
    g = torch.Generator().manual_seed(8)
    tokens, hidden, ffn, experts = (1 if case == "one token" else 40), 32, 24, 4
    x = torch.randn(tokens, hidden, generator=g)
    w = torch.randn(experts, hidden, generator=g) * 0.3
    gate_up = torch.randn(experts, 2 * ffn, hidden, generator=g) * 0.2
    down = torch.randn(experts, hidden, ffn, generator=g) * 0.2
    if case == "signed zeros":
        x[::3] = -0.0
        down[1] = -0.0
    if case == "tied router":
        w.zero_()
    if case == "unbounded":  # past tensore.bounded's worst case, every product finite
        x[0, 0] = 1e37 if dtype != torch.float16 else 6e4
        w[:, 0] = 0.0
        gate_up[:, :, 0] = 0.0
    x, w, gate_up, down = (t.to(dtype) for t in (x, w, gate_up, down))
    if case == "float64":
        x, w, gate_up, down = (t.double() for t in (x, w, gate_up, down))
    op = _native.op("moe_forward_values")
    for top_k, normalize in ((1, True), (2, True), (2, False)):
        # (the Python path first: its first datapath call registers the datapath the native op calls)
        want = moe.block_values(x, w, gate_up, down, top_k, normalize, moe._datapath_linear)
        got = op(x, w, gate_up, down, top_k, normalize)
        assert got
        for name, a, b in zip(("out", "logits"), want, got):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(a.view(torch.int64) if a.dtype == torch.float64 else _bits(a),
                               b.view(torch.int64) if b.dtype == torch.float64 else _bits(b)), (name, top_k, normalize)


def test_a_gradient_penalty_through_the_block_is_cpus():
    """A backward with create_graph (a gradient penalty) through the block: the op's derivative
    has none of its own, so the second backward was refused in one line where CPU computes it
    (found by a hunt). It now recomputes the block's ops on the device and differentiates them."""
    cpu = _model()
    dev = copy.deepcopy(cpu).to("neuron")

    def penalty(block, device):
        x = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(3)).to(device).requires_grad_()
        out = block(x)
        out = out[0] if isinstance(out, tuple) else out
        g, = torch.autograd.grad(out.square().sum(), x, create_graph=True)
        loss = g.square().sum()
        loss.backward()
        return loss, x.grad, [p.grad for p in block.parameters()]

    loss_c, x_c, grads_c = penalty(cpu.model.layers[0].mlp, "cpu")
    loss_n, x_n, grads_n = penalty(dev.model.layers[0].mlp, "neuron")
    _close(loss_n, loss_c, "penalty")
    _close(x_n, x_c, "input gradient")
    for g_n, g_c in zip(grads_n, grads_c):
        assert g_c is not None
        _close(g_n, g_c, "weight gradient")
