"""The host cache behind device tensors (csrc/neuron.cpp, "host memory"): the CPU kernels that
compute neuron results reuse freed blocks of the same size instead of faulting fresh pages in;
the virtual HBM's counters do not see it; CPU-only code never goes through it."""

import os
import subprocess
import sys
import textwrap

import torch

from torch_bridge import memory

BIG = (256, 256)  # 256 KiB of fp32: above the cache's 64 KiB floor


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
