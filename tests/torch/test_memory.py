"""HBM accounting per NeuronCore and out-of-memory errors that leave the device usable."""

import gc
import re

import pytest
import torch


def test_allocation_counted_and_freed():
    gc.collect()
    base = torch.neuron.memory_allocated()
    t = torch.empty(1024, 1024, device="neuron")  # 4 MiB
    assert torch.neuron.memory_allocated() == base + 4 * 2**20
    assert torch.neuron.max_memory_allocated() >= base + 4 * 2**20
    del t
    gc.collect()
    assert torch.neuron.memory_allocated() == base


def test_views_share_and_results_count():
    gc.collect()
    base = torch.neuron.memory_allocated()
    a = torch.ones(256, device="neuron")
    v = a.view(16, 16)
    assert torch.neuron.memory_allocated() == base + 1024
    b = v * 2
    assert torch.neuron.memory_allocated() == base + 2048
    del a, v, b
    gc.collect()
    assert torch.neuron.memory_allocated() == base


def test_peak_reset_and_stats():
    t = torch.empty(2**20, device="neuron")
    del t
    gc.collect()
    torch.neuron.reset_peak_memory_stats()
    assert torch.neuron.max_memory_allocated() == torch.neuron.memory_allocated()
    stats = torch.neuron.memory_stats()
    assert stats["allocated_bytes.all.current"] == torch.neuron.memory_allocated()
    torch.neuron.empty_cache()
    assert torch.neuron.memory_reserved() == torch.neuron.memory_allocated()
    free, total = torch.neuron.mem_get_info()
    cfg = torch.neuron.config()
    assert total == cfg.chip.hbm.capacity // torch.neuron.device_count() and free <= total


def test_oom_names_sizes_and_device_keeps_working():
    _, total = torch.neuron.mem_get_info()
    before = torch.neuron.memory_stats()["num_ooms"]
    in_use = torch.neuron.memory_allocated()
    with pytest.raises(torch.OutOfMemoryError) as err:
        torch.empty(total + 1, dtype=torch.uint8, device="neuron")
    msg = str(err.value)
    assert re.match(rf"^neuron:0 out of memory: tried to allocate {total + 1} bytes \(.*\); {in_use} bytes in use "
                    rf"of {total} capacity", msg), msg
    assert torch.neuron.memory_stats()["num_ooms"] == before + 1
    assert torch.neuron.memory_allocated() == in_use
    assert (torch.ones(4, device="neuron") + 1).sum().item() == 8.0


def test_oom_inside_an_op_and_per_device_capacity():
    _, total = torch.neuron.mem_get_info(1)
    big = torch.empty(total // 2 + 1, dtype=torch.uint8, device="neuron:1")
    with pytest.raises(torch.OutOfMemoryError, match="^neuron:1 out of memory"):
        big.clone()
    assert torch.empty(total // 4, dtype=torch.uint8, device="neuron:0").device.index == 0
    del big
