"""Hugging Face ``generate(cache_implementation="static")`` compiles its decode step with
``backend="neuron"`` on a neuron model (transformers picks that backend for the device) and must
give the tokens the CPU gives."""

from __future__ import annotations

import copy

import pytest
import torch

import torch_bridge.compile as neuron_compile

transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()
neuron_compile.register()


def test_static_cache_generate_gives_cpu_tokens():
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    cpu = transformers.LlamaForCausalLM(cfg).eval()
    dev = copy.deepcopy(cpu).to("neuron")
    ids = torch.randint(1, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    kw = dict(max_new_tokens=10, do_sample=False, cache_implementation="static")
    want = cpu.generate(ids, **kw)
    torch._dynamo.reset()
    with torch.neuron.report_scope() as scope:
        got = dev.generate(ids.to("neuron"), **kw)
    assert got.cpu().tolist() == want.tolist()
    rep = scope.report
    assert rep.compiled_graphs >= 1 and rep.graph_launches >= 9  # the decode steps ran compiled
    assert rep.regions


def _llama_pair() -> tuple[object, object, object]:
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                                   bos_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    cpu = transformers.LlamaForCausalLM(cfg).eval()

    def on_neuron():
        dev = transformers.LlamaForCausalLM(cfg).eval()
        dev.load_state_dict(cpu.state_dict())
        return dev.to("neuron")
    return cfg, cpu, on_neuron


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_left_padded_generate_gives_cpu_tokens(cache, compiled):
    """Issue 24: with left padding every decode step attends with a boolean padding mask over
    more keys than queries; the mask was added as 0/1 and the tokens parted from CPU's (static
    cache), the logits of every decode step too (both caches)."""
    _, cpu, on_neuron = _llama_pair()
    ids = torch.randint(2, 128, (3, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 8, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, :5] = 0
    ids = ids * mask
    kw = dict(max_new_tokens=12, do_sample=False, attention_mask=mask, output_logits=True,
              return_dict_in_generate=True)
    if cache == "static":
        kw["cache_implementation"] = "static"  # compiles its decode step with backend="neuron"
    want = cpu.generate(ids, **kw)
    dev = on_neuron()
    if compiled and cache == "dynamic":
        dev.forward = torch.compile(dev.forward, backend="neuron")
    elif not compiled and cache == "static":
        kw["disable_compile"] = True
    torch._dynamo.reset()
    got = dev.generate(ids.to("neuron"), **dict(kw, attention_mask=mask.to("neuron")))
    assert got.sequences.cpu().tolist() == want.sequences.tolist()
    for step, (a, b) in enumerate(zip(got.logits, want.logits)):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-4, atol=1e-4, msg=f"decode step {step}")
