"""System configs (configs/systems/*.yaml): loading, derived figures, overrides routed to the
system or its chip, and the exact one-line errors users read."""

from pathlib import Path

import pytest

from trnsim.config import ConfigError, load_system, system_names


def test_builtin_systems_load_with_their_published_shapes():
    assert system_names() == ["trn1.32xlarge", "trn2-ultraserver", "trn2.48xlarge", "trn3-ultraserver-gen1",
                              "trn3-ultraserver-gen2"]
    trn2 = load_system("trn2.48xlarge")
    assert (trn2.chips, trn2.ranks_per_chip, trn2.ranks) == (16, 4, 64)  # 4x4 torus, LNC=2
    assert [(d.name, d.kind, d.size) for d in trn2.topology] == [("x", "ring", 4), ("y", "ring", 4),
                                                                 ("efa", "switch", 1)]
    assert trn2.dim("x").bandwidth == 256 * 10**9 and trn2.dim("x").latency == 200_000  # ps
    assert trn2.instance_chips == 16 and trn2.chip.name == "trn2"
    us = load_system("trn2-ultraserver")
    assert (us.chips, us.ranks, us.instance_chips) == (64, 256, 16)
    assert us.dim("z").bandwidth == 128 * 10**9 and us.dim("z").inter_instance
    assert load_system("trn3-ultraserver-gen1").chips == 64
    gen2 = load_system("trn3-ultraserver-gen2")
    assert (gen2.chips, gen2.ranks) == (144, 576) and gen2.chip.name == "trn3"
    trn1 = load_system("trn1.32xlarge")
    assert (trn1.chips, trn1.ranks_per_chip, trn1.ranks) == (16, 2, 32)
    assert trn2.collectives.cc_cores_per_core == 2 and trn2.collectives.packet_bytes == 64 * 1024
    assert trn2.collectives.mesh_below == 10**6 and trn2.collectives.rdh_below == 56 * 10**6


def test_overrides_go_to_the_system_or_to_its_chip():
    s = load_system("trn2.48xlarge", ["topology.x.bandwidth=128GB/s", "topology.efa.size=2",
                                      "core.dma.engine_bandwidth=40GB/s", "chip.lnc=1", "collectives.window=2"])
    assert s.dim("x").bandwidth == 128 * 10**9 and s.chips == 32
    assert s.chip.core.dma.engine_bandwidth == 40 * 10**9 and s.ranks_per_chip == 8 and s.ranks == 256
    assert s.collectives.window == 2
    assert s.chip.overrides == (("core.dma.engine_bandwidth", "40GB/s"), ("chip.lnc", "1"))
    assert load_system(s, {"topology.y.size": 2}).chips == 16  # overrides stack on a loaded system
    assert load_system("trn2.48xlarge", ["chip=trn3"]).chip.name == "trn3"


@pytest.mark.parametrize("overrides,message", [
    (["topology.w.bandwidth=1GB/s"],
     "trn2.48xlarge.yaml (--set topology.w.bandwidth=1GB/s): unknown key 'topology.w.bandwidth': 'w' is not a "
     "dimension of topology; expected one of x, y, efa"),
    (["topology.x.bw=1GB/s"],
     "trn2.48xlarge.yaml (--set topology.x.bw=1GB/s): unknown key 'topology.x.bw': 'bw' is not in topology.x; "
     "expected one of kind, size, bandwidth, latency, inter_instance, proxy"),
    (["collectives.speed=1"],
     "trn2.48xlarge.yaml (--set collectives.speed=1): unknown key 'collectives.speed': 'speed' is not in "
     "collectives; expected one of cc_cores_per_core, packet_bytes, max_chunks, window, reduce_engine, "
     "dma_accumulate_rate, mesh_below, mesh_collectives, rdh_below, rule_ranks, pipeline_segments, dma_duplication, "
     "launch, graph_launch, step_sync, reduce_sync, issue, dma_rings, p2p_rings, efa_proxy, ranks_per_proxy, "
     "flat_ring_channels, multistream_mesh, sdk"),
    (["topology.x.bandwidth=fast"],
     "trn2.48xlarge.yaml (--set topology.x.bandwidth=fast): topology.x.bandwidth = 'fast': expected a bandwidth "
     "quantity like '2.9TB/s'"),
    (["topology.x.size=0"],
     "trn2.48xlarge.yaml (--set topology.x.size=0): topology.x.size = 0: out of range, expected 1..4096"),
    (["topology.x.kind=hypercube"],
     "trn2.48xlarge.yaml (--set topology.x.kind=hypercube): topology.x.kind = 'hypercube': expected one of ring, "
     "switch, full"),
    (["collectives.reduce_engine=gpsimd"],
     "trn2.48xlarge.yaml (--set collectives.reduce_engine=gpsimd): collectives.reduce_engine = 'gpsimd': "
     "expected one of dma, vector"),
    (["collectives.rdh_below=1KB"],
     "trn2.48xlarge.yaml: collectives.rdh_below = 1000 bytes: expected at least collectives.mesh_below "
     "(1000000 bytes)"),
    (["topology.x.inter_instance=true"],
     "trn2.48xlarge.yaml: topology.y.inter_instance = False: expected the dimensions inside an instance to come "
     "before the ones between instances ('x')"),
    (["core.dma.engines=0"], "trn2.yaml (--set core.dma.engines=0): core.dma.engines = 0: out of range, expected "
                             "1..1024"),
    (["chip=trn9"], "trn2.48xlarge.yaml (--set chip=trn9): chip: unknown config 'trn9': expected one of trn1, "
                    "trn2, trn3 or a path to a .yaml file"),
    (["topology.x.size=4096", "topology.y.size=4096"],
     "trn2.48xlarge.yaml: topology has 16,777,216 chips: expected at most 65,536"),
])
def test_bad_overrides_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError) as e:
        load_system("trn2.48xlarge", overrides)
    assert str(e.value) == message


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match=r"^unknown system 'trn5': expected one of trn1.32xlarge, "
                                          r"trn2-ultraserver, trn2.48xlarge, trn3-ultraserver-gen1, "
                                          r"trn3-ultraserver-gen2 or a path to a .yaml file$"):
        load_system("trn5")
    p = tmp_path / "mine.yaml"
    p.write_text("name: mine\ndescription: d\nchip: trn2\ntopology: {x: {kind: ring, size: 2, bandwidth: 1GB/s, "
                 "latency: 1ns, inter_instance: false}}\ncollectives: {}\nlinks: 3\n")
    with pytest.raises(ConfigError, match=rf"^{p}: unknown key 'links': expected one of name, description, chip, "
                                          r"topology, collectives, runtimes$"):
        load_system(p)
    p.write_text("name: mine\ndescription: d\nchip: trn2\ntopology: {}\ncollectives: {}\n")
    with pytest.raises(ConfigError, match=r"topology must be a mapping of dimension name"):
        load_system(p)
    p.write_text("name: [\n")
    with pytest.raises(ConfigError, match=rf"^{p}: line 2"):
        load_system(p)
    with pytest.raises(ConfigError, match=r"^nope.yaml: no such system file$"):
        load_system("nope.yaml")
    with pytest.raises(ConfigError, match=rf"^{tmp_path}: it is a directory, not a regular file$"):
        load_system(str(tmp_path))  # it was 'no such system file', of a path that exists
    # the file's own chip, unknown: named with the file and its key (the fuzz harness's long run,
    # seed 225, case 81: 'unknown config' alone did not say that the system file gave it)
    shipped = (Path(__file__).resolve().parents[2] / "configs" / "systems" / "trn2.48xlarge.yaml").read_text()
    p.write_text(shipped.replace("\nchip: trn2\n", "\nchip: 1B\n"))
    with pytest.raises(ConfigError, match=rf"^{p}: chip: unknown config '1B': expected one of trn1, trn2, trn3 or a "
                                          r"path to a .yaml file$"):
        load_system(p)


def test_an_sdk_release_selects_its_runtime_and_its_provenance(tmp_path):
    """collectives.sdk names the release whose runtime the costs describe; another release of the
    file's runtimes: puts its own values (and their calibration rows) in place of the file's; a
    --set of the same key still wins; a release the file does not describe is a one-line error."""
    base = load_system("trn2.48xlarge")
    assert base.collectives.sdk == "2.32" and base.collectives.reduce_sync == 0
    keys = {c.key for c in base.calibrations}
    assert {"collectives.launch", "runtimes.2.24.launch", "runtimes.2.28.reduce_sync"} <= keys
    old = load_system("trn2.48xlarge", ["collectives.sdk=2.24"])
    assert old.collectives.sdk == "2.24" and old.collectives.launch < base.collectives.launch
    assert old.collectives.step_sync == base.collectives.step_sync  # what 2.24 does not list stays
    assert "collectives.launch" not in {c.key for c in old.calibrations}  # the file's launch no longer holds
    r28 = load_system("trn2.48xlarge", ["collectives.sdk=2.28"])
    assert r28.collectives.reduce_sync > 0 and r28.collectives.launch == base.collectives.launch
    mine = load_system("trn2.48xlarge", ["collectives.sdk=2.28", "collectives.reduce_sync=1us"])
    assert mine.collectives.reduce_sync == 10**6
    with pytest.raises(ConfigError, match=r"^trn2.48xlarge.yaml \(--set collectives.sdk=2.26\): collectives.sdk = "
                                          r"'2.26': expected a release this file describes: '2.32', '2.24', '2.28'$"):
        load_system("trn2.48xlarge", ["collectives.sdk=2.26"])
    shipped = (Path(__file__).resolve().parents[2] / "configs" / "systems" / "trn2.48xlarge.yaml").read_text()
    p = tmp_path / "mine.yaml"
    p.write_text(shipped.replace("    reduce_sync:\n      value: 141.66us", "    speed:\n      value: 141.66us"))
    with pytest.raises(ConfigError, match=rf"^{p}: unknown key 'runtimes.2.28.speed': expected collectives keys"):
        load_system(p)


def test_a_system_name_too_long_for_a_file_is_one_line():
    """Found by the fuzz harness (issue 25): a 300-character system name reached the file system
    and raised OSError (File name too long)."""
    from trnsim.config import ConfigError, load_system

    with pytest.raises(ConfigError, match=r"^unknown system 'x{80}\.\.\. \(300 characters\)': expected one of "):
        load_system("x" * 300)
    with pytest.raises(ConfigError, match=r"^/x{79}\.\.\. \(3,006 characters\): cannot read it \(File name too long\)$"):
        load_system("/" + "x" * 3000 + ".yaml")
