"""The host cache behind device tensors (csrc/neuron.cpp, "host memory"): the CPU kernels that
compute neuron results reuse freed blocks of the same size instead of faulting fresh pages in;
the virtual HBM's counters do not see it; CPU-only code never goes through it."""

import os
import subprocess
import sys
import textwrap

import torch

from torch_bridge import memory

BIG = (256, 256)  # 256 KiB of fp32: above the cache's 4 KiB floor


def test_a_freed_result_is_reused_for_the_next_one_of_its_size():
    x = torch.randn(BIG, device="neuron")
    (x * 2).sum()  # every op of this size seen once
    torch.neuron.synchronize()
    y = x * 2
    addr = y.untyped_storage().data_ptr()
    before = memory.host_cache()
    del y
    assert memory.host_cache()["kept_bytes"] >= before["kept_bytes"] + x.nbytes
    z = x * 2  # (the same signature: the fast path, one allocation)
    after = memory.host_cache()
    assert after["installed"] == 1
    assert after["reused"] == before["reused"] + 1 and after["fresh"] == before["fresh"]
    assert z.untyped_storage().data_ptr() == addr
    torch.testing.assert_close(z.cpu(), x.cpu() * 2, rtol=0, atol=0)


def test_the_smallest_block_served_is_the_extensions_own():
    """The size below which host-side computations skip the cache (compiled regions decide it
    once per signature) is the extension's kCacheMin, read from it, not a copy of it: a block
    of that size is served from the cache, one byte less is not."""
    m = memory.host_cache_min()
    assert m == memory.host_cache()["min_bytes"] == 4 * 1024
    for n, served in ((m, 1), (m - 4, 0)):
        x = torch.ones(n // 4, device="neuron")
        (x * 2).sum()
        torch.neuron.synchronize()
        del x
        x = torch.ones(n // 4, device="neuron")
        before = memory.host_cache()["reused"]
        y = x * 2
        assert memory.host_cache()["reused"] - before == served, n
        del x, y


def test_the_virtual_hbm_counts_as_before():
    x = torch.randn(BIG, device="neuron")
    torch.neuron.synchronize()
    base = torch.neuron.memory_allocated()
    y = x + 1
    assert torch.neuron.memory_allocated() == base + x.nbytes
    del y
    assert torch.neuron.memory_allocated() == base  # freed on the device, kept on the host
    assert torch.neuron.memory_reserved() == torch.neuron.memory_allocated()


def test_cpu_tensors_do_not_go_through_it():
    x = torch.randn(BIG, device="neuron")
    (x + 1).sum()
    before = memory.host_cache()
    cpu = [torch.empty(1 << 20) for _ in range(4)]  # outside any neuron op: the CPU allocator's
    del cpu
    after = memory.host_cache()
    assert (after["fresh"], after["reused"], after["blocks"], after["kept_bytes"]) == \
        (before["fresh"], before["reused"], before["blocks"], before["kept_bytes"])


def test_empty_cache_gives_the_kept_blocks_back():
    x = torch.randn(BIG, device="neuron")
    del x
    assert memory.host_cache()["kept_bytes"] > 0
    torch.neuron.empty_cache()
    assert memory.host_cache()["kept_bytes"] == 0


def _child(code: str, **env: str) -> str:
    full = {**os.environ, **env}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_a_process_that_never_computes_on_neuron_keeps_its_cpu_allocator():
    out = _child("""
        import torch
        from torch_bridge import memory
        a = torch.randn(512, 512) @ torch.randn(512, 512)
        print(memory.host_cache()["installed"])
        torch.ones(4, device="neuron") + 1
        print(memory.host_cache()["installed"])
    """)
    assert out.split() == ["0", "1"]


def test_a_zero_limit_turns_it_off():
    out = _child("""
        import torch
        from torch_bridge import memory
        x = torch.randn(256, 256, device="neuron")
        y = x * 2
        print(memory.host_cache()["installed"], float((y.cpu() - x.cpu() * 2).abs().max()))
    """, TRNSIM_HOST_CACHE_MB="0")
    assert out.split() == ["0", "0.0"]


def _steady(fn, calls: int = 3) -> tuple[int, int]:
    """(fresh, reused) host-cache allocations of the last of ``calls`` calls of ``fn``."""
    for _ in range(calls - 1):
        fn()
    torch.neuron.synchronize()
    before = memory.host_cache()
    fn()
    torch.neuron.synchronize()
    after = memory.host_cache()
    return after["fresh"] - before["fresh"], after["reused"] - before["reused"]


def test_compiled_regions_and_foreach_steps_take_their_memory_from_it():
    """A compiled region's values are host-side ops on CPU views (their intermediates and
    results), a foreach kernel's are functional lists: in steady steps they reuse kept blocks,
    where fresh pages faulted in every step (16k page faults a step of the small GPT-2)."""
    x = torch.randn(BIG, device="neuron")
    fn = torch.compile(lambda t: torch.tanh(t * 2 + 1) * t, backend="neuron")  # one region: mul+add+tanh+mul
    fresh, reused = _steady(lambda: fn(x))
    # its first step's result from a kept block (none fresh), which the later steps write in
    # place (RegionKernel._reuse: before that each step's result took a block of its own)
    assert fresh == 0 and reused >= 1
    params = [torch.randn(BIG, device="neuron", requires_grad=True) for _ in range(2)]
    opt = torch.optim.AdamW(params, capturable=True)
    step = torch.compile(opt.step, backend="neuron")

    def train() -> None:
        for p in params:
            p.grad = torch.ones_like(p)
        step()
    fresh, reused = _steady(train, 4)
    assert fresh == 0 and reused >= 4  # AdamW's functional lists (2 before: the gradients alone)


def test_attention_and_datapath_results_take_their_memory_from_it():
    """SDPA's values (the datapath's [B, M, N] results, softmax, its backward) and a matmul's PSUM
    result come from kept blocks in steady steps, eager and compiled."""
    q, k, v = (torch.randn(2, 4, 128, 64, device="neuron", requires_grad=True) for _ in range(3))

    def eager() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    fresh, reused = _steady(eager)
    assert fresh == 0 and reused >= 3
    compiled = torch.compile(lambda a, b, c: torch.nn.functional.scaled_dot_product_attention(
        a, b, c, is_causal=True).sum(), backend="neuron")
    fresh, reused = _steady(lambda: compiled(q, k, v).backward())
    assert fresh == 0 and reused >= 3
