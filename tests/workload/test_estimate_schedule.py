"""The torch-free parts of estimates: the 1F1B pipeline schedule, the mean of interpolated decode
steps, model configs by name or path (one-line errors), and the on-disk kernel-cost cache."""

import dataclasses
import json
import pickle
from pathlib import Path

import pytest

from trnsim import load_config
from trnsim.config import ConfigError
from trnsim.costcache import CachedDevice, CostCache, fingerprint
from trnsim.device import KernelSpec
from trnsim.estimate import mean_decode, pipeline_1f1b
from trnsim.models import load_model, model_names


# ---- the pipeline schedule ----------------------------------------------------------------------------
@pytest.mark.parametrize("p,m", [(1, 1), (1, 8), (2, 1), (4, 4), (4, 16), (8, 3)])
def test_uniform_1f1b_is_the_textbook_time(p, m):
    """Equal stages, no transfer time: (m + p - 1) (F + B), the 1F1B (and GPipe) step time."""
    total, busy = pipeline_1f1b([3] * p, [7] * p, [0] * (p - 1), [0] * (p - 1), m)
    assert total == (m + p - 1) * (3 + 7)
    assert busy == [m * 10] * p


def test_transfers_and_the_slowest_stage_set_the_pace():
    total, _ = pipeline_1f1b([2, 5], [4, 10], [1], [1], 6)
    # stage 1 (5 + 10 per micro-batch) is the bottleneck: its 6 micro-batches back to back, after the first
    # activation arrives (2 + 1) and before the last gradient goes back (1) and stage 0's last backward (4)
    assert total == 3 + 6 * 15 + 1 + 4


def test_one_stage_runs_forward_backward_in_turn():
    total, _ = pipeline_1f1b([5], [6], [], [], 3)
    assert total == 33


# ---- decode steps ---------------------------------------------------------------------------------------
def test_mean_decode_is_exact_for_a_line():
    samples = [(100, 10.0), (200, 20.0)]
    assert mean_decode(samples, 100, 200) == pytest.approx(15.0)
    assert mean_decode([(100, 10.0), (150, 15.0), (200, 20.0)], 100, 200) == pytest.approx(15.0)
    assert mean_decode([(5, 3.0)], 5, 5) == 3.0 and mean_decode([], 1, 2) == 0.0


# ---- model configs --------------------------------------------------------------------------------------
def test_shipped_models():
    assert {"llama-3.1-8b", "llama-3.3-70b", "llama-3.1-405b", "mixtral-8x7b"} <= set(model_names())
    m = load_model("llama-3.3-70b")
    assert (m.layers, m.heads, m.kv_heads, m.hidden, m.head_dim) == (80, 64, 8, 8192, 128)
    assert "meta-llama/Llama-3.3-70B-Instruct" in m.source
    assert load_model("mixtral-8x7b").fields["num_local_experts"] == 8


def _write(tmp_path, text, name="config.json"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


@pytest.mark.parametrize("text,message", [
    ("{", "not valid JSON (line 1 column 2: Expecting property name enclosed in double quotes)"),
    ("[1]", "expected a JSON object (a Hugging Face config.json)"),
    ('{"model_type": "llama"}', "missing 'hidden_size'; a Hugging Face config.json of a decoder has model_type, "
                                "hidden_size, num_hidden_layers, num_attention_heads, vocab_size"),
    ('{"model_type": "llama", "hidden_size": "4096", "num_hidden_layers": 2, "num_attention_heads": 2, '
     '"vocab_size": 8}', "hidden_size: expected a positive integer, got '4096'"),
    ('{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, '
     '"num_key_value_heads": 3, "vocab_size": 8}', "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    ('{"model_type": "llama", "model_type": "x"}', "key 'model_type' appears twice; a key may appear once"),
])
def test_bad_configs_are_one_line(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_model(path)
    assert str(info.value) == f"{path}: {message}"


def test_unknown_names_and_paths(tmp_path):
    with pytest.raises(ConfigError, match=r"^unknown model 'gpt-5': expected one of bert-large, deepseek-v3, .*mixtral-8x7b, qwen3-30b-a3b, qwen3-32b, qwen3-8b, or a "
                                          r"path to a Hugging Face config.json$"):
        load_model("gpt-5")
    with pytest.raises(ConfigError, match="^model config '/nonexistent/config.json' not found$"):
        load_model("/nonexistent/config.json")
    with pytest.raises(ConfigError, match=r"^model config '/no\\nsuch\.json' not found$"):  # one line, escaped
        load_model("/no\nsuch.json")
    d = tmp_path / "my-model"
    d.mkdir()
    _write(d, json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "vocab_size": 8}))
    assert load_model(str(d)).name == "my-model"  # a checkpoint directory holding config.json


# ---- the cost cache ----------------------------------------------------------------------------------------
SPEC = KernelSpec.of("matmul", (128, 256, 512), "bf16", {"transpose_a": True, "transpose_b": False})


def test_a_cached_cost_is_the_simulated_one(tmp_path):
    cfg = load_config("trn2")
    cold = CachedDevice(cfg, CostCache(tmp_path))
    a = cold.cost(SPEC)
    assert cold.simulated == 2 and cold.cache.misses == 1 and len(list(tmp_path.rglob("*.json"))) == 1
    warm = CachedDevice(cfg, CostCache(tmp_path))
    b = warm.cost(SPEC)
    assert warm.simulated == 0 and warm.cache.hits == 1
    figures = ("kernel", "generic", "ticks", "busy", "demand", "hbm_bytes", "matmul_flops", "cores", "engine_flops",
               "hbm_read_bytes", "hbm_write_bytes", "dma_bytes")
    assert [getattr(b, f) for f in figures] == [getattr(a, f) for f in figures]
    assert a.hbm_read_bytes > 0 and a.hbm_write_bytes > 0 and a.dma_bytes > 0  # (the split kept, not zeros)
    assert b.reports == ()  # an estimate's device reads no kernel reports


def test_a_cached_cost_can_simulate_its_reports_when_read(tmp_path):
    """The neuron device's cache (lazy_reports): a cost read back simulates its kernels' reports
    when something reads them (a trace's engine lanes), the reports the cold run had."""
    cfg = load_config("trn2")
    a = CachedDevice(cfg, CostCache(tmp_path), lazy_reports=True).cost(SPEC)
    warm = CachedDevice(cfg, CostCache(tmp_path), lazy_reports=True)
    b = warm.cost(SPEC)
    assert warm.simulated == 0 and len(a.reports) == 2
    assert len(b.reports) == 2 and b.reports and warm.simulated == 0  # (counted without simulating)
    assert [r.total_cycles for r in b.reports] == [r.total_cycles for r in a.reports]
    assert warm.simulated == 2 and b.reports == a.reports
    assert pickle.loads(pickle.dumps(b.reports)) == tuple(b.reports)  # sent as the reports themselves


def test_an_entry_without_a_figure_is_simulated_again(tmp_path):
    """An entry written before the cache kept the read/write split is a miss, not zeros."""
    cfg = load_config("trn2")
    CachedDevice(cfg, CostCache(tmp_path)).cost(SPEC)
    (entry,) = tmp_path.rglob("*.json")
    old = json.loads(entry.read_text())
    for k in ("engine_flops", "hbm_read_bytes", "hbm_write_bytes", "dma_bytes"):
        del old[k]
    entry.write_text(json.dumps(old))
    dev = CachedDevice(cfg, CostCache(tmp_path))
    assert dev.cost(SPEC).hbm_read_bytes > 0 and dev.simulated == 2
    assert "dma_bytes" in json.loads(entry.read_text())  # rewritten whole


def test_the_code_digest_covers_the_c_loops(tmp_path, monkeypatch):
    """The simulator's C loops (the scheduler, the dependency tracker) make the ticks too: a
    changed .c file is another key."""
    from trnsim.device import costcache

    root = Path(costcache.__file__).resolve().parents[1]
    assert list(root.rglob("sched.c"))
    monkeypatch.setattr(costcache, "_CODE", [])
    before = costcache.code_version()
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: real(self) + (b"//" if self.name == "sched.c" else b""))
    monkeypatch.setattr(costcache, "_CODE", [])
    assert costcache.code_version() != before


def test_the_device_cache_is_asked_for(tmp_path, monkeypatch):
    """$TRNSIM_COST_CACHE: off unless set; on/1 the estimates' directory; else a directory."""
    from trnsim.device.costcache import default_cache_dir, device_cache_dir

    for off in (None, "", "off", "OFF", "0"):
        if off is None:
            monkeypatch.delenv("TRNSIM_COST_CACHE", raising=False)
        else:
            monkeypatch.setenv("TRNSIM_COST_CACHE", off)
        assert device_cache_dir() is None
    monkeypatch.setenv("TRNSIM_CACHE_DIR", str(tmp_path / "shared"))
    for on in ("on", "1"):
        monkeypatch.setenv("TRNSIM_COST_CACHE", on)
        assert device_cache_dir() == default_cache_dir() == tmp_path / "shared"
    monkeypatch.setenv("TRNSIM_COST_CACHE", str(tmp_path / "mine"))
    assert device_cache_dir() == tmp_path / "mine"
    for word, want in (("true", tmp_path / "shared"), ("YES", tmp_path / "shared"), ("false", None), ("no", None)):
        monkeypatch.setenv("TRNSIM_COST_CACHE", word)
        assert device_cache_dir() == want
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("TRNSIM_COST_CACHE", str(tmp_path / "file"))
    with pytest.raises(ValueError, match=r"^TRNSIM_COST_CACHE=.*file is not a directory; expected a directory "):
        device_cache_dir()


def test_the_key_holds_the_figures_not_the_name(tmp_path):
    cache = CostCache(tmp_path)
    base, faster = load_config("trn2"), load_config("trn2", {"chip.hbm.bandwidth": "4TB/s"})
    assert fingerprint(base) != fingerprint(faster)
    CachedDevice(base, cache).cost(SPEC)
    dev = CachedDevice(faster, cache)
    dev.cost(SPEC)
    assert dev.simulated == 2  # another chip: simulated again
    other = KernelSpec.of("matmul", (128, 256, 512), "bf16", {"transpose_a": False, "transpose_b": False})
    dev.cost(other)
    assert dev.simulated == 4


def test_a_damaged_entry_is_simulated_again(tmp_path):
    cfg = load_config("trn2")
    CachedDevice(cfg, CostCache(tmp_path)).cost(SPEC)
    (entry,) = tmp_path.rglob("*.json")
    entry.write_text("{not json")
    dev = CachedDevice(cfg, CostCache(tmp_path))
    assert dev.cost(SPEC).ticks > 0 and dev.simulated == 2
    assert json.loads(entry.read_text())["ticks"] > 0  # rewritten whole


def test_a_refused_kernel_is_remembered(tmp_path):
    cfg = load_config("trn2")
    bad = KernelSpec.of("matmul", (128, 256, 512), "int8", {},
                        fallback=KernelSpec.of("stream", (64, 64, 64), "fp32", {"engine": "vector", "binary": False,
                                                                               "fn": "exp"}))
    a = CachedDevice(cfg, CostCache(tmp_path)).cost(bad)
    dev = CachedDevice(cfg, CostCache(tmp_path))
    assert dev.refused() == []
    assert dev.cost(bad).ticks == a.ticks and dev.simulated == 0
    assert dev.refused() == [bad]  # what an estimate lists among its assumptions


def test_the_cache_can_be_off(tmp_path, monkeypatch):
    from trnsim.costcache import default_cache_dir

    monkeypatch.setenv("TRNSIM_CACHE_DIR", "off")
    assert default_cache_dir() is None
    monkeypatch.setenv("TRNSIM_CACHE_DIR", str(tmp_path))
    assert default_cache_dir() == tmp_path
    dev = CachedDevice(load_config("trn2"), CostCache(None))
    dev.cost(SPEC)
    assert dev.simulated == 2 and not list(tmp_path.iterdir())


def test_a_kernel_registered_at_run_time_is_never_cached(tmp_path, monkeypatch):
    """A user's NKI kernel (a kernel family) may change between runs under the same name: its
    cost is simulated every time and never written; a library kernel beside it is cached."""
    from trnsim import nki
    from trnsim.costcache import cacheable
    import nki_kernels as K

    fam = nki.family(K.fused_softmax, "test_costcache::softmax")
    spec = KernelSpec.of(fam.family, (0, 1), "fp32", {"args": (("T", (128, 64), "float32"),), "kwargs": ()})
    assert not cacheable(spec) and cacheable(SPEC)
    assert not cacheable(KernelSpec.of("matmul", (128, 128, 128), "bf16", {"x": object()}))
    assert not cacheable(KernelSpec.of("matmul", (128, 128, 128), "bf16", {}, fallback=spec))
    from trnsim.kernels import registry

    outside = dataclasses.replace(registry.KERNELS["matmul"], build=lambda *a, **k: None)
    outside.build.__module__ = "my_kernels"
    monkeypatch.setitem(registry.KERNELS, "my_matmul", outside)  # register_kernel from a user's module
    assert not cacheable(KernelSpec.of("my_matmul", (128, 128, 128), "bf16", {}))
    cfg = load_config("trn2")
    a = CachedDevice(cfg, CostCache(tmp_path)).cost(spec)
    assert not list(tmp_path.rglob("*.json"))
    again = CachedDevice(cfg, CostCache(tmp_path))
    assert again.cost(spec).ticks == a.ticks and again.simulated > 0 and again.cache.hits == again.cache.misses == 0


def test_an_entry_holds_every_figure_of_a_cost():
    """Every field of OpCost but the kernel reports (simulated again when read) and a compiled
    region's description (set by its caller) survives an entry, a collective's row included: a
    warm estimate's collective rows said DMA/HBM where the cold one said latency. A field added
    to OpCost and forgotten here fails this test."""
    import dataclasses

    from trnsim.device import CollectiveLaunch, OpCost
    from trnsim.device.costcache import _cost_data, _cost_of

    coll = CollectiveLaunch("all-reduce", "ring", 8, 1 << 20, 12345, 1.75, "latency", 11111)
    cost = OpCost("all-reduce:ring", False, 12345, {"DMA": 99}, 2, 4096, 0, {"DMA": 120}, engine_flops=7,
                  hbm_read_bytes=3000, hbm_write_bytes=1096, dma_bytes=5000, collective=coll)
    back = _cost_of(json.loads(json.dumps(_cost_data(cost))))
    skipped = {"reports", "region"}
    for f in dataclasses.fields(OpCost):
        if f.name not in skipped:
            assert getattr(back, f.name) == getattr(cost, f.name), f.name
    assert back.collective.bound == "latency" and isinstance(back.collective, CollectiveLaunch)
    kernel = dataclasses.replace(cost, collective=None)
    assert _cost_of(json.loads(json.dumps(_cost_data(kernel)))).collective is None
