"""Hugging Face Transformers models on neuron against CPU: GPT-2, Llama and BERT built from small
configs (no downloads), forward and backward, tied weights, a few AdamW steps.

Each model is built once on CPU and deep-copied to neuron, so both start from the same weights.
The device computes fp32 matmuls on the TensorE datapath (fused fp32 multiply-adds, fp32
accumulation in 128-row chunks, in a fixed order) rather than with BLAS, so results differ from CPU in the
last bits: tolerances are a few ulps of fp32 relative to each tensor's scale."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()  # small configs trip token-id warnings

VOCAB, SEQ = 128, 16


def _gpt2(dropout: float = 0.0, attn: str = "sdpa") -> torch.nn.Module:
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                                  resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout,
                                  bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def _llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _bert() -> torch.nn.Module:
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, pad_token_id=0)
    torch.manual_seed(0)
    return transformers.BertForMaskedLM(cfg)


def _tokens(batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(1))


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal up to a few fp32 ulps of the tensor's scale (a gradient that is mathematically zero,
    such as an attention key bias's, is rounding noise on both devices)."""
    assert actual.device.type == "neuron", what
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.cpu(), expected, rtol=1e-4, atol=1e-5 * max(scale, 1e-3), msg=what)


def _forward_backward(model: torch.nn.Module, x: torch.Tensor, seed: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)  # seeds CPU and every neuron generator (their draws differ: see test_rng.py)
    device = next(model.parameters()).device
    out = model(x.to(device), labels=x.to(device))
    out.loss.backward()
    return out.logits, out.loss


@pytest.mark.parametrize("build", [
    pytest.param(_gpt2, id="gpt2-sdpa"),
    pytest.param(lambda: _gpt2(attn="eager"), id="gpt2-eager"),
    pytest.param(_llama, id="llama-gqa"),
    pytest.param(_bert, id="bert-mlm"),
])
def test_forward_and_backward_match_cpu(build):
    cpu = build()
    dev = copy.deepcopy(cpu).to("neuron")
    x = _tokens()
    logits_c, loss_c = _forward_backward(cpu, x)
    logits_n, loss_n = _forward_backward(dev, x)
    _close(logits_n, logits_c, "logits")
    _close(loss_n, loss_c, "loss")
    grads = dict(dev.named_parameters())
    for name, p in cpu.named_parameters():
        assert grads[name].grad is not None, name
        _close(grads[name].grad, p.grad, f"grad of {name}")


@pytest.mark.parametrize("build,tied", [
    (_gpt2, ("lm_head.weight", "transformer.wte.weight")),
    (_bert, ("cls.predictions.decoder.weight", "bert.embeddings.word_embeddings.weight")),
])
def test_tied_weights_stay_tied(build, tied):
    """``.to("neuron")`` keeps one Parameter for a tied pair (one copy in device memory, one
    gradient), and so does the way back with ``.cpu()``."""
    model = build()
    head, emb = (model.get_parameter(n) for n in tied)
    assert head is emb
    n_cpu = sum(p.numel() for p in model.parameters())
    before = torch.neuron.memory_allocated()
    model.to("neuron")
    head, emb = (model.get_parameter(n) for n in tied)
    assert head is emb and head.device.type == "neuron"
    assert sum(p.numel() for p in model.parameters()) == n_cpu
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert torch.neuron.memory_allocated() - before < param_bytes + emb.numel() * emb.element_size()
    _forward_backward(model, _tokens())
    assert head.grad is not None and head.grad.device.type == "neuron"
    model.cpu()
    head, emb = (model.get_parameter(n) for n in tied)
    assert head is emb and head.device.type == "cpu"


LR = 3e-3


def _adamw_steps(model: torch.nn.Module, steps: int) -> list[float]:
    # eps above the gradients' rounding noise: some gradients are analytically zero (attention's
    # key bias: softmax ignores a per-row shift), and with the default 1e-8 Adam turns their noise,
    # which depends on the order of fp32 sums, into full +-LR steps
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01, eps=1e-6)
    device = next(model.parameters()).device
    x = _tokens(batch=4).to(device)
    losses = []
    for _ in range(steps):
        loss = model(x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("build", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_adamw_steps_match_cpu(build):
    cpu = build()
    dev = copy.deepcopy(cpu).to("neuron")
    losses_c = _adamw_steps(cpu, 4)
    losses_n = _adamw_steps(dev, 4)
    assert losses_c[-1] < losses_c[0]  # it learns, so the comparison covers real updates
    assert losses_n == pytest.approx(losses_c, rel=1e-5)
    # Adam divides each gradient element by its own running RMS, so last-bit noise in a gradient
    # element near zero becomes an update of up to LR: parameters are compared against the
    # largest distance a step can move them (LR per step), not their own scale.
    params = dict(dev.named_parameters())
    for name, p in cpu.named_parameters():
        torch.testing.assert_close(params[name].detach().cpu(), p.detach(), rtol=0, atol=1e-3 * LR * 4,
                                   msg=f"{name} after AdamW")
    if build is _gpt2:
        assert dev.lm_head.weight is dev.transformer.wte.weight


def test_model_time_is_simulated_per_op():
    """A model's step is charged op by op to the simulated chip: its matmuls go to the matmul
    kernel on TensorE (GPT-2's Conv1D layers are addmm), attention to the flash-attention kernel."""
    model = _gpt2().to("neuron")
    with torch.neuron.report_scope() as scope:
        _forward_backward(model, _tokens())
    rep = scope.report
    assert rep.elapsed_us > 0 and rep.device_us > 0 and rep.matmul_flops > 0
    addmm = rep.row("addmm")
    assert addmm.kernel == "matmul" and addmm.calls == 2 * 4  # 4 Conv1D layers per block, 2 blocks
    attn = rep.row("scaled_dot_product_attention")
    assert attn.kernel == "attention" and attn.calls == 2  # one fused op per block


def test_train_gpt2_example_learns_and_reports(capsys):
    """examples/train_gpt2.py (the demo's training loop): the loss falls, the report follows."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "train_gpt2.py"
    spec = importlib.util.spec_from_file_location("train_gpt2", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    assert example.main(["--steps", "6", "--batch", "4", "--seq", "32"]) == 0
    out = capsys.readouterr().out
    losses = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("step")]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.5  # steps 1, 5 and 6
    assert f"neuron run report: train_gpt2.py on {torch.neuron.config().name}" in out and "elapsed:" in out


def test_optimizer_step_is_one_launch_per_foreach_op():
    """AdamW (foreach) and clip_grad_norm_ run each _foreach_* op whole, as one kernel over all
    parameters, instead of PyTorch's slow path of one device op per parameter."""
    model = _gpt2().to("neuron")
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    _forward_backward(model, _tokens())
    opt.step()  # the first step also creates the optimizer state, one zeros_like per parameter
    n_params = len(list(model.parameters()))
    with torch.neuron.report_scope() as scope:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    rep = scope.report
    assert rep.row("_foreach_addcdiv_").calls == 1 and rep.row("_foreach_norm").calls == 1
    kernels = sum(r.calls for r in rep.rows if r.kernel != "view (metadata only)")
    assert kernels < 20 < n_params  # clip_grad_norm_ still stacks one view of each norm
    lerp = rep.row("_foreach_lerp_")  # exp_avg += (1 - beta1) * (grad - exp_avg): 2 lists read, 1 written
    assert lerp.hbm_bytes == 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
        torch._foreach_add_([torch.ones(3, device="neuron"), torch.ones(3)], 1.0)


def test_training_benchmark_quick_runs():
    """benchmarks/bench_torch_train.py --quick: both devices train, the losses agree, and the
    ratio line is printed (its value is a wall-clock measurement, reported, not asserted)."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_torch_train.py"
    r = subprocess.run([sys.executable, str(script), "--quick", "--steps", "4"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "ratio neuron/CPU per steady-state step:" in r.stdout and "first step" in r.stdout
