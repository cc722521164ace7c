"""Chip configs: loading, units, overrides, and the exact errors users read."""

import pytest

from trnsim.config import ConfigError, config_names, load_config, parse_quantity


def test_builtin_configs_load():
    assert {"trn1", "trn2", "trn3"} <= set(config_names())
    trn2 = load_config("trn2")
    assert trn2.chip.cores == 8 and trn2.chip.lnc == 2 and trn2.logical_cores == 4
    assert trn2.core.tensor.clock == 2_400_000_000
    assert trn2.core.vector.clock == 960_000_000
    assert trn2.core.sbuf.partition_bytes == 224 * 1024
    assert trn2.core.sbuf.bytes == 28 * 2**20
    assert trn2.core.psum.bank_bytes == 2048
    assert trn2.chip.hbm.capacity == 96 * 2**30
    assert trn2.chip.hbm.bandwidth == 2_900_000_000_000
    assert trn2.core.dma.start_latency == 1_300_000  # ps


def test_derived_peaks_match_datasheet():
    # datasheet §1: 128*128*2*2.4 GHz = 78.6 TFLOPS bf16, 157.3 fp8, 19.7 fp32 per core
    trn2 = load_config("trn2")
    assert trn2.peak_flops_per_core("bf16") == pytest.approx(78.6432e12)
    assert trn2.peak_flops_per_core("fp8") == pytest.approx(157.2864e12)
    assert trn2.peak_flops_per_core("fp32") == pytest.approx(19.6608e12)
    trn3 = load_config("trn3")
    # MXFP8 x 8 cores = 2,517 TFLOPS, which S2 publishes exactly
    assert 8 * trn3.peak_flops_per_core("mxfp8") / 1e12 == pytest.approx(2516.6, abs=0.1)
    trn1 = load_config("trn1")
    assert trn1.peak_flops_per_core("bf16") / 1e12 == pytest.approx(91.75, abs=0.01)


def test_time_is_an_exact_integer_tick():
    trn2 = load_config("trn2")
    assert trn2.tick_hz == 4_800_000_000  # lcm of 2.4, 0.96, 1.2 GHz
    assert {e: trn2.ticks_per_cycle(e) for e in trn2.engine_clocks} == {
        "Tensor": 2, "Vector": 5, "Scalar": 4, "GpSimd": 4, "Sync": 4}
    assert trn2.ps_to_ticks(1_300_000) == 6240


@pytest.mark.parametrize("text,kind,value", [
    ("224KiB", "bytes", 229376), ("28MiB", "bytes", 29360128), ("96GiB", "bytes", 103079215104),
    ("512B", "bytes", 512), ("2.4GHz", "hz", 2400000000), ("960MHz", "hz", 960000000),
    ("2.9TB/s", "bandwidth", 2900000000000), ("27.2GB/s", "bandwidth", 27200000000),
    ("23B/ns", "bandwidth", 23000000000), ("1300ns", "time", 1300000), ("3us", "time", 3000000),
    ("1.3µs", "time", 1300000),
])
def test_units(text, kind, value):
    assert parse_quantity(text, kind) == value


def test_override_applies_and_is_recorded():
    cfg = load_config("trn2", ["core.sbuf.partition_bytes=256KiB", "core.tensor.overlap_load_stationary=false"])
    assert cfg.core.sbuf.partition_bytes == 262144
    assert cfg.core.tensor.overlap_load_stationary is False
    assert cfg.overrides == (("core.sbuf.partition_bytes", "256KiB"), ("core.tensor.overlap_load_stationary", "false"))
    # a mapping works too, and overrides stack on a loaded config
    cfg2 = load_config(cfg, {"core.vector.min_ii_cycles": 32})
    assert cfg2.core.vector.min_ii_cycles == 32 and cfg2.core.sbuf.partition_bytes == 262144


@pytest.mark.parametrize("overrides,message", [
    (["core.sbuf.partitoin_bytes=1KiB"],
     "trn2.yaml (--set core.sbuf.partitoin_bytes=1KiB): unknown key 'core.sbuf.partitoin_bytes': "
     "'partitoin_bytes' is not in core.sbuf; expected one of partitions, partition_bytes, allocation_granule"),
    (["core.sbuf.partition_bytes=224KB/s"],
     "trn2.yaml (--set core.sbuf.partition_bytes=224KB/s): core.sbuf.partition_bytes = '224KB/s': expected a bytes quantity like '224KiB' (unknown unit 'KB/s')"),
    (["core.sbuf.partition_bytes=224"],
     "trn2.yaml (--set core.sbuf.partition_bytes=224): core.sbuf.partition_bytes = '224': expected a bytes quantity like '224KiB' (unknown unit '')"),
    (["core.tensor.clock=0.5Hz"],
     "trn2.yaml (--set core.tensor.clock=0.5Hz): core.tensor.clock = '0.5Hz': expected a whole number of Hz, got 0.5 Hz"),
    (["core.tensor.clock=100kHz"],
     "trn2.yaml (--set core.tensor.clock=100kHz): core.tensor.clock = '100kHz': out of range, expected 1MHz..100GHz"),
    (["core.vector.min_ii_cycles=many"], "trn2.yaml (--set core.vector.min_ii_cycles=many): core.vector.min_ii_cycles = 'many': expected an integer"),
    (["core.tensor.fp8_double_row=maybe"], "trn2.yaml (--set core.tensor.fp8_double_row=maybe): core.tensor.fp8_double_row = 'maybe': expected true or false"),
    (["chip.lnc=3"], "trn2.yaml: chip.lnc = 3: expected a divisor of chip.cores (8)"),
    (["chip.neuronlink.version=v9"],
     "trn2.yaml (--set chip.neuronlink.version=v9): chip.neuronlink.version = 'v9': expected one of v2, v3, v4"),
    (["core.sbuf=1"], "trn2.yaml (--set core.sbuf=1): override 'core.sbuf' names a section, not a value"),
    (["nonsense"], "bad override 'nonsense': expected KEY=VALUE, e.g. core.sbuf.partition_bytes=256KiB"),
])
def test_bad_overrides_name_key_value_and_expectation(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_config("trn2", overrides)
    assert str(e.value) == message
    assert "\n" not in str(e.value)


def test_unknown_config_name():
    with pytest.raises(ConfigError, match=r"^unknown config 'trn9': expected one of trn1, trn2, trn3 or a path to a \.yaml file$"):
        load_config("trn9")


def test_bad_files(tmp_path):
    good = (load_config("trn2").source)
    text = open(good).read()
    p = tmp_path / "mine.yaml"
    p.write_text(text.replace("  lnc: 2", "  lnc: 2\n  speed: fast"))
    with pytest.raises(ConfigError, match=r"mine\.yaml: unknown key 'chip\.speed': expected one of cores, lnc, hbm, neuronlink$"):
        load_config(p)
    p.write_text(text.replace("    stacks: 4                    # each", "    # each"))
    with pytest.raises(ConfigError, match=r"mine\.yaml: missing key 'chip\.hbm\.stacks'$"):
        load_config(p)
    p.write_text("name: [unclosed\n")
    with pytest.raises(ConfigError, match=r"mine\.yaml: line \d+"):
        load_config(p)
    with pytest.raises(ConfigError, match=r"no such config file"):
        load_config(tmp_path / "absent.yaml")


def test_a_copied_config_with_overrides_is_a_new_chip(tmp_path):
    p = tmp_path / "big-sbuf.yaml"
    p.write_text(open(load_config("trn2").source).read().replace("224KiB", "448KiB"))
    cfg = load_config(str(p))
    assert cfg.core.sbuf.partition_bytes == 448 * 1024 and cfg.name == "trn2"


@pytest.mark.parametrize("overrides,message", [
    (["core.dma.start_latency=1e15s"],
     "trn2.yaml (--set core.dma.start_latency=1e15s): core.dma.start_latency = '1e15s': out of range, expected "
     "0ps..1s"),
    (["host.dispatch=2s"], "trn2.yaml (--set host.dispatch=2s): host.dispatch = '2s': out of range, expected 0ps..1s"),
    # (a capacity past 2^64 bytes wrapped in the device's 64-bit memory ledger: 65540PiB became
    # 1PiB a core, 40000PiB a negative capacity; found by the hardening hunt)
    (["chip.hbm.capacity=65540PiB"], "trn2.yaml (--set chip.hbm.capacity=65540PiB): chip.hbm.capacity = '65540PiB': "
                                     "out of range, expected 1B..1024PiB"),
    (["core.tensor.clock=2400000001Hz", "core.vector.clock=2399999999Hz"],
     "trn2.yaml: the engine clocks (tensor 2,400,000,001 Hz, vector 2,399,999,999 Hz, scalar 1,200,000,000 Hz, "
     "gpsimd 1,200,000,000 Hz, sync 1,200,000,000 Hz) have no common tick of at least 0.1 fs (their least common "
     "multiple is 6.91e+27 Hz); expected clocks with a larger common divisor, e.g. whole MHz"),
])
def test_times_and_the_tick_are_bounded_when_the_config_loads(overrides, message):
    """Issue 25: start_latency: 1e15s passed ``trnsim info`` and then overflowed the simulator's
    64-bit ticks in ``trnsim kernel``; clocks without a common tick did the same; so did an HBM
    capacity in the memory ledger."""
    with pytest.raises(ConfigError) as e:
        load_config("trn2", overrides)
    assert str(e.value) == message


def test_the_longest_time_and_an_odd_whole_mhz_clock_still_simulate():
    from trnsim.chip import Chip
    from trnsim.kernels.matmul import build_matmul

    cfg = load_config("trn2", ["core.dma.start_latency=1s", "core.tensor.clock=2401MHz", "core.vector.clock=961MHz"])
    report = Chip(cfg).run(build_matmul(128, 128, 512, "bf16", cfg), timing_only=True).report
    assert report.total_us > 1e6  # a second of DMA start latency, counted exactly


def test_a_config_loaded_again_is_the_same_object_until_its_file_changes(tmp_path):
    """Configs are frozen, so loading one again (the same file as it is now, the same
    overrides) gives the same object: what the builder shares tables by. Other overrides give
    another config, a file edited on disk is read again, and bad overrides fail as before."""
    import os

    assert load_config("trn2") is load_config("trn2")
    big = load_config("trn2", ["core.sbuf.partition_bytes=256KiB"])
    assert big is load_config("trn2", {"core.sbuf.partition_bytes": "256KiB"}) and big is not load_config("trn2")
    assert big.core.sbuf.partition_bytes == 256 * 1024 and load_config("trn2").core.sbuf.partition_bytes == 224 * 1024
    p = tmp_path / "mine.yaml"
    text = open(load_config("trn2").source).read()
    p.write_text(text)
    first = load_config(p)
    assert load_config(p) is first and first.core.sbuf.partition_bytes == 224 * 1024
    p.write_text(text.replace("partition_bytes: 224KiB", "partition_bytes: 192KiB"))
    st = os.stat(p)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # (a coarse clock could give it the old time)
    again = load_config(p)
    assert again is not first and again.core.sbuf.partition_bytes == 192 * 1024
    for _ in range(2):
        with pytest.raises(ConfigError, match="expected KEY=VALUE"):
            load_config("trn2", ["core.sbuf.partition_bytes"])
