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
