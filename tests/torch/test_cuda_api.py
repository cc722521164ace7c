"""``torch.neuron`` answers the ``torch.cuda`` calls training frameworks and scripts make."""

import pickle

import pytest
import torch

from trnsim import load_config


def test_device_name_properties_and_capability():
    cfg = load_config("trn2")
    name = torch.neuron.get_device_name(0)
    assert "trn2" in name and cfg.core.version in name
    props = torch.neuron.get_device_properties("neuron:1")
    assert props.name == name and props.total_memory == cfg.chip.hbm.capacity // cfg.logical_cores
    assert props.multi_processor_count == cfg.chip.lnc and (props.major, props.minor) == (3, 0)
    assert torch.neuron.get_device_capability() == (3, 0)
    assert "trn2" in repr(props)


def test_memory_stats_have_cudas_keys():
    x = torch.ones(1 << 19, device="neuron")  # 2 MiB: the large pool
    y = torch.ones(4, device="neuron")
    st = torch.neuron.memory_stats()
    for key in ("active_bytes.all.peak", "reserved_bytes.all.peak", "allocated_bytes.all.current",
                "allocated_bytes.large_pool.current", "allocation.small_pool.current", "num_alloc_retries",
                "num_ooms", "segment.all.current", "inactive_split_bytes.all.current", "requested_bytes.all.peak"):
        assert key in st, key
    assert st["allocated_bytes.all.current"] == torch.neuron.memory_allocated() >= (1 << 21) + 16
    assert st["allocated_bytes.large_pool.current"] >= 1 << 21 and st["allocated_bytes.small_pool.current"] >= 16
    assert st["reserved_bytes.all.current"] == st["allocated_bytes.all.current"] and st["num_alloc_retries"] == 0
    assert torch.neuron.memory_stats_as_nested_dict()["allocated_bytes"]["all"]["current"] == \
        st["allocated_bytes.all.current"]
    del x, y


def test_peaks_reset_and_ooms_count():
    torch.neuron.reset_peak_memory_stats()
    base = torch.neuron.max_memory_allocated()
    t = torch.empty(1000, device="neuron")
    del t
    assert torch.neuron.max_memory_allocated() == base + 4000 and torch.neuron.memory_allocated() == base
    before = torch.neuron.memory_stats()["num_ooms"]
    with pytest.raises(torch.OutOfMemoryError):
        torch.empty(torch.neuron.mem_get_info()[1] + 1, dtype=torch.uint8, device="neuron")
    assert torch.neuron.memory_stats()["num_ooms"] == before + 1
    free, total = torch.neuron.mem_get_info()
    assert total - free == torch.neuron.memory_allocated()
    torch.neuron.empty_cache()


def test_memory_summary_is_cudas_table():
    text = torch.neuron.memory_summary(abbreviated=True)
    lines = text.splitlines()
    assert "memory summary, device ID 0" in lines[1] and "Allocated memory" in text and "Reserved memory" in text
    assert all(len(ln) == 77 for ln in lines), [ln for ln in lines if len(ln) != 77]


def test_record_memory_history_and_snapshot(tmp_path):
    torch.neuron.memory._record_memory_history(max_entries=1000)
    try:
        x = torch.ones(10, device="neuron")
        del x
        snap = torch.neuron.memory._snapshot()
    finally:
        torch.neuron.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][0]
    assert [(e["action"], e["size"]) for e in trace[-2:]] == [("alloc", 40), ("free_completed", 40)]
    assert trace[-2]["frames"][0]["name"] == "test_record_memory_history_and_snapshot"
    assert all(seg["total_size"] == sum(b["size"] for b in seg["blocks"]) for seg in snap["segments"])
    path = tmp_path / "snap.pickle"
    torch.neuron.memory._dump_snapshot(str(path))
    assert set(pickle.loads(path.read_bytes())) >= {"segments", "device_traces"}
    from torch.neuron.memory import memory_stats  # noqa: F401  (importable as torch.cuda.memory is)


def test_rng_state_calls():
    states = torch.neuron.get_rng_state_all()
    assert len(states) == torch.neuron.device_count() and all(s.numel() == 16 for s in states)
    torch.neuron.set_rng_state_all(states)
    with torch.random.fork_rng(devices=[0], device_type="neuron"):
        torch.rand(3, device="neuron")
    assert torch.equal(torch.neuron.get_rng_state(), states[0])
