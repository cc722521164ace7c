"""Activation checkpointing on neuron, selective (SAC) included: forward and recompute must issue
the same op sequence whatever the state of the device's CPU-view cache (``memory.cpu_view``)."""

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from torch_bridge import memory


def _block(x, w1, w2):
    h = torch.relu(x @ w1)
    h = torch.nn.functional.layer_norm(h, h.shape[-1:])
    return (torch.sigmoid(h) @ w2).square().sum()


def _inputs():
    g = torch.Generator().manual_seed(0)
    return [torch.randn(8, 16, generator=g), torch.randn(16, 16, generator=g), torch.randn(16, 4, generator=g)]


def test_selective_checkpointing_matches_plain_backward_whatever_the_view_cache():
    seen = {False: [], True: []}

    def policy(ctx, op, *args, **kwargs):
        seen[ctx.is_recompute].append(str(op))
        return CheckpointPolicy.MUST_SAVE if op == torch.ops.aten.mm.default else CheckpointPolicy.PREFER_RECOMPUTE

    ref = [t.to("neuron").requires_grad_() for t in _inputs()]
    _block(*ref).backward()
    dev = [t.to("neuron").requires_grad_() for t in _inputs()]
    out = checkpoint(_block, *dev, use_reentrant=False,
                     context_fn=functools.partial(create_selective_checkpoint_contexts, policy))
    memory._views.clear()  # the recompute finds no cached views where the forward found them
    out.backward()
    # the policy sees the program's ops and nothing of how the device computes them (views, copies)
    assert seen[False] == ["aten.mm.default", "aten.relu.default", "aten.native_layer_norm.default",
                           "aten.sigmoid.default", "aten.mm.default", "aten.pow.Tensor_Scalar", "aten.sum.default"]
    for a, b in zip(dev, ref):
        assert torch.equal(a.grad.cpu(), b.grad.cpu())


def test_plain_checkpointing_matches_and_cpu_agrees():
    cpu = [t.requires_grad_() for t in _inputs()]
    checkpoint(_block, *cpu, use_reentrant=False).backward()
    dev = [t.to("neuron").requires_grad_() for t in _inputs()]
    checkpoint(_block, *dev, use_reentrant=True).backward()
    for a, b in zip(dev, cpu):
        torch.testing.assert_close(a.grad.cpu(), b.grad, rtol=1e-5, atol=1e-5)
