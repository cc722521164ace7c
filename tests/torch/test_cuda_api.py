"""``torch.neuron`` answers the ``torch.cuda`` calls training frameworks and scripts make."""

import os
import pickle
import subprocess
import sys

import pytest
import torch

from torch_bridge.memory import host_cache
from trnsim import load_config


def test_device_name_properties_and_capability():
    cfg = load_config("trn2")
    name = torch.neuron.get_device_name(0)
    assert name == f"trn2 {cfg.core.version} (neuron, LNC=2, simulated by trnsim)"
    props = torch.neuron.get_device_properties("neuron:1")
    assert props.name == "trn2" and props.description == name and props.simulated_by == "trnsim"
    assert props.total_memory == cfg.chip.hbm.capacity // cfg.logical_cores
    assert props.multi_processor_count == cfg.chip.lnc and (props.major, props.minor) == (3, 0)
    assert torch.neuron.get_device_capability() == (3, 0)
    assert "name='trn2'" in repr(props) and "trnsim" in repr(props)


# torchtitan's peak-FLOPs lookup (pytorch/torchtitan torchtitan/tools/utils.py ``get_peak_flops``, the
# Trainium branch of #2382, at b5bcd76c), restated: the GPU names it tries first are substrings of the
# name ``device_module.get_device_name()`` gives; a name with "neuron" in it then goes by
# ``get_device_properties().name``: trn1/trn1n/inf2 at 90 TFLOP/s x LNC=1, trn2/trn2n/trn2u/trn3/trn3u
# at 79 x LNC=2; anything else falls back to an A100 (312).
_TITAN_GPU_NAMES = ("A100", "A6000", "H100", "H200", "H20", "GB200", "GB300", "B300", "B200", "MI355X", "MI300X",
                    "MI325X", "MI250X", "Data Center GPU Max 1550", "l40s")


def _titan_peak_flops(device_module) -> float:
    name = device_module.get_device_name(torch.device("neuron:0"))
    if any(gpu in name for gpu in _TITAN_GPU_NAMES) or "neuron" not in name:
        return 312e12
    chip = device_module.get_device_properties().name
    if chip in ("trn1", "trn1n", "inf2"):
        return 90e12
    return 79e12 * 2  # trn2/trn3 by name, and its fallback for an unknown neuron device


def test_torchtitans_peak_flops_lookup_finds_the_chip():
    assert torch.neuron.get_device_properties().name == "trn2"
    assert _titan_peak_flops(torch.neuron) == 79e12 * 2
    # the table's figure is the config's own bf16 peak of a logical core (to the TFLOP/s it quotes)
    cfg = load_config("trn2")
    assert cfg.peak_flops_per_core("bf16") * cfg.chip.lnc == pytest.approx(79e12 * 2, rel=0.01)


def test_device_properties_name_the_trn3_chip():
    code = ("import torch; p = torch.neuron.get_device_properties(); "
            "print(p.name, '|', torch.neuron.get_device_name())")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRNSIM_CONFIG": "trn3"})
    assert run.returncode == 0, run.stderr[-2000:]
    chip, name = run.stdout.strip().split(" | ")
    assert chip == "trn3" and "neuron" in name and "simulated by trnsim" in name


def test_torch_accelerator_memory_answers_what_torch_neuron_answers():
    x = torch.ones(1 << 19, device="neuron")  # 2 MiB: the large pool
    y = torch.ones(4, device="neuron")
    acc, own = torch.accelerator.memory_stats(), torch.neuron.memory_stats()
    assert set(own) - set(acc) == {"capacity_bytes"} and set(acc) <= set(own)
    assert {k: own[k] for k in acc} == dict(acc)
    assert torch.accelerator.memory_allocated() == torch.neuron.memory_allocated() >= (1 << 21) + 16
    assert torch.accelerator.memory_reserved() == torch.neuron.memory_reserved()
    assert torch.accelerator.get_memory_info() == torch.neuron.mem_get_info()
    peak = torch.neuron.max_memory_allocated()
    assert torch.accelerator.max_memory_allocated() == peak and torch.accelerator.max_memory_reserved() == peak
    del x
    torch.accelerator.reset_peak_memory_stats()
    assert torch.accelerator.max_memory_allocated() == torch.neuron.max_memory_allocated() \
        == torch.neuron.memory_allocated() < peak
    torch.accelerator.reset_accumulated_memory_stats()
    assert torch.neuron.memory_stats()["allocated_bytes.all.allocated"] == 0
    del y
    torch.accelerator.empty_cache()  # gives the host memory kept for freed device blocks back, as torch.neuron's
    assert host_cache()["kept_bytes"] == 0


def test_untyped_storage_on_the_device_gets_counted_memory():
    before = torch.neuron.memory_allocated()
    st = torch.UntypedStorage(1000, device="neuron")  # it used to crash: the device had no allocator
    assert st.device == torch.device("neuron:0") and st.nbytes() == 1000
    assert torch.neuron.memory_allocated() == before + 1000
    t = torch.empty(0, dtype=torch.uint8, device="neuron").set_(st)
    t.fill_(7)
    assert st.clone().cpu().tolist() == [7] * 1000
    del t, st
    assert torch.neuron.memory_allocated() == before


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
