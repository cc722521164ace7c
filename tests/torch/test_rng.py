"""The device's random number generators: one per device, CUDA's shape, independent of CPU's."""

import pytest
import torch
import torch.nn.functional as F

from torch_bridge.values import host_seed


def test_manual_seed_reproduces_device_draws():
    torch.neuron.manual_seed(7)
    a = torch.randn(5, device="neuron").cpu()
    torch.neuron.manual_seed(7)
    assert torch.equal(a, torch.randn(5, device="neuron").cpu())


def test_seeding_neuron_leaves_cpu_random_numbers_alone():
    torch.default_generator.manual_seed(0)
    want = torch.rand(4)
    torch.default_generator.manual_seed(0)
    torch.neuron.manual_seed(123)
    torch.randn(1000, device="neuron")
    F.dropout(torch.ones(100, device="neuron"), 0.5)  # borrows the host generator and gives it back
    assert torch.equal(torch.rand(4), want)


def test_state_is_cuda_shaped_seed_and_offset():
    torch.neuron.manual_seed(42)
    state = torch.neuron.get_rng_state()
    assert state.dtype == torch.uint8 and state.shape == (16,)
    seed, offset = state[:8].view(torch.int64).item(), state[8:].view(torch.int64).item()
    assert (seed, offset) == (42, 0)
    torch.rand(10, device="neuron")  # 10 values: the offset moves in Philox rounds of 4
    assert torch.neuron.get_rng_state()[8:].view(torch.int64).item() == 12


def test_restoring_the_state_replays_the_draws():
    state = torch.neuron.get_rng_state()
    a = torch.rand(6, device="neuron").cpu()
    torch.neuron.set_rng_state(state)
    assert torch.equal(a, torch.rand(6, device="neuron").cpu())


def test_a_draw_is_the_host_draw_seeded_from_the_state():
    torch.neuron.manual_seed(3)
    torch.rand(2, device="neuron")  # offset 4
    got = torch.randn(5, device="neuron").cpu()
    assert torch.equal(got, torch.randn(5, generator=torch.Generator().manual_seed(host_seed(3, 4))))


def test_device_generator_object():
    g = torch.Generator("neuron").manual_seed(1)
    assert g.device == torch.device("neuron", 0)
    a = torch.randn(3, device="neuron", generator=g).cpu()
    g.manual_seed(1)
    assert torch.equal(a, torch.randn(3, device="neuron", generator=g).cpu())
    assert g.get_offset() == 4
    assert torch.Generator("neuron:1").device == torch.device("neuron", 1)


def test_each_device_has_its_own_default_generator():
    torch.neuron.manual_seed_all(5)
    torch.rand(8, device="neuron:1")
    assert torch.neuron.get_rng_state(0)[8:].view(torch.int64).item() == 0
    assert torch.neuron.get_rng_state(1)[8:].view(torch.int64).item() == 8
    assert torch.neuron.default_generator(1) is torch.neuron.default_generator("neuron:1")


def test_torch_manual_seed_seeds_the_device_too():
    torch.manual_seed(11)
    assert torch.neuron.initial_seed() == 11


def test_bad_state_is_refused():
    with pytest.raises(RuntimeError, match=r"neuron generator state must be a torch.ByteTensor of 16 bytes"):
        torch.neuron.set_rng_state(torch.zeros(5, dtype=torch.uint8))


def test_dropout_is_reproducible_and_drops_about_p():
    torch.neuron.manual_seed(0)
    a = F.dropout(torch.ones(4000, device="neuron"), 0.25).cpu()
    torch.neuron.manual_seed(0)
    assert torch.equal(a, F.dropout(torch.ones(4000, device="neuron"), 0.25).cpu())
    assert abs(a.eq(0).float().mean().item() - 0.25) < 0.03
    assert a.unique().tolist() == [0.0, torch.tensor(1 / 0.75).item()]


def test_checkpoint_replays_dropout_in_recompute():
    # torch.utils.checkpoint saves and restores the device's RNG state around the recompute
    lin = torch.nn.Linear(8, 8).to("neuron")
    x = torch.randn(4, 8, device="neuron", requires_grad=True)

    def block(t):
        return F.dropout(lin(t), 0.5, training=True)

    torch.neuron.manual_seed(9)
    ref = block(x)
    ref.sum().backward()
    want = x.grad.clone()
    x.grad = None
    torch.neuron.manual_seed(9)
    out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
    out.sum().backward()
    assert torch.equal(out.cpu(), ref.cpu()) and torch.equal(x.grad.cpu(), want.cpu())


def test_a_generator_of_another_device_is_refused_in_cuda_s_words():
    """A CPU generator on a neuron op read "CPU Generator does not use offset"; a neuron one on
    an op that makes host tensors (its key sends the op to the device) drew host values from it
    without a word, or failed in the allocator (found by a values hunt)."""
    cpu_gen, gen = torch.Generator(), torch.Generator(device="neuron")
    calls = [lambda g: torch.randn(3, device="neuron", generator=g),
             lambda g: torch.ones(3, device="neuron").normal_(generator=g),
             lambda g: torch.randperm(5, device="neuron", generator=g)]
    for call in calls:
        with pytest.raises(RuntimeError, match=r"^Expected a 'neuron' device type for generator but found 'cpu'$"):
            call(cpu_gen)
        assert call(gen).device.type == "neuron"
    offset = gen.get_offset()
    for host in (lambda: torch.rand(3, generator=gen), lambda: torch.randperm(4, generator=gen),
                 lambda: torch.empty(3).normal_(generator=gen)):
        with pytest.raises(RuntimeError, match=r"^Expected a 'cpu' device type for generator but found 'neuron'$"):
            host()
    assert gen.get_offset() == offset  # nothing drawn
