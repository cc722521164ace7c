"""Collective points in sweeps: a spec names a system, its grid varies links (or the chip), and
each collective point's row holds what a direct run gives."""

import csv
import textwrap

import pytest

from trnsim.cli import main
from trnsim.collectives import simulate_collective
from trnsim.config import ConfigError, load_system
from trnsim.sweep import load_spec, run_sweep

SPEC = """\
    system: trn2.48xlarge
    grid:
      topology.x.bandwidth: [32GB/s, 256GB/s]
    kernels:
      - {name: matmul, shape: 128x256x512}
    collectives:
      - {name: all-reduce, bytes: 1MiB:64MiB, factor: 64, ranks: [16, 64]}
      - {name: allg, bytes: [8MiB], ranks: 16, algo: ring}
"""


def write(tmp_path, text):
    p = tmp_path / "spec.yaml"
    p.write_text(textwrap.dedent(text))
    return p


def test_collective_rows_match_direct_runs(tmp_path, capsys):
    spec = load_spec(write(tmp_path, SPEC))
    assert len(spec.points) == 2 * (1 + 2 * 2 + 1)
    assert spec.columns[-5:] == ["algorithm", "algbw_gib_s", "busbw_gib_s", "estimate_us", "error"]
    res = run_sweep(spec, jobs=1)
    rows = {(r["topology.x.bandwidth"], r["kernel"], r["shape"], r["params"]): r for r in res.rows}
    r = rows[("32GB/s", "all-reduce", "64 ranks, 67108864 B", "")]
    direct = simulate_collective(load_system("trn2.48xlarge", ["topology.x.bandwidth=32GB/s"]), "all-reduce",
                                 64 << 20, ranks=64)
    assert float(r["us"]) == pytest.approx(direct.time_us, abs=1e-3) and r["algorithm"] == direct.algorithm
    assert float(r["busbw_gib_s"]) == pytest.approx(direct.busbw / 2**30, abs=1e-3) and r["error"] == ""
    ring = rows[("256GB/s", "all-gather", "16 ranks, 8388608 B", "algo=ring")]
    assert ring["algorithm"] == "ring"
    mm = rows[("32GB/s", "matmul", "128x256x512", "")]
    assert float(mm["cycles"]) > 0 and mm["algorithm"] == ""
    # the link bandwidth moves the big collective, not the kernel
    assert float(rows[("256GB/s", "all-reduce", "64 ranks, 67108864 B", "")]["us"]) < float(r["us"])
    assert mm["cycles"] == rows[("256GB/s", "matmul", "128x256x512", "")]["cycles"]
    with open(spec.out, newline="") as f:
        assert len(list(csv.DictReader(f))) == len(spec.points)
    assert main(["sweep", str(tmp_path / "spec.yaml"), "--jobs", "1"]) == 0  # resumes: nothing left to run
    assert f"0 points run, {len(spec.points)} from a previous run" in capsys.readouterr()[0]


@pytest.mark.parametrize("text,message", [
    ("config: trn2\ncollectives: [{name: all-reduce}]\n",
     "spec.yaml: collectives need a 'system' (e.g. system: trn2.48xlarge)"),
    ("config: trn2\nsystem: trn2.48xlarge\nkernels: [{name: matmul}]\n",
     "spec.yaml: give 'config' (a chip) or 'system' (chips and links), not both"),
    ("system: trn2.48xlarge\ncollectives: [{name: all-reduce, ranks: 48}]\n",
     "spec.yaml: collectives[0] (all-reduce): all-reduce: 48 ranks does not divide trn2.48xlarge's 64 ranks (16 "
     "chips x 4 logical cores); expected one of 1, 2, 4, 8, 16, 32, 64"),
    ("system: trn2.48xlarge\ncollectives: [{name: all-reduce, size: 1MiB}]\n",
     "spec.yaml: collectives[0]: unknown key 'size'; expected name, bytes, factor, ranks, algo, dtype"),
    ("system: trn2.48xlarge\ncollectives: [{name: all-reduce, bytes: 1KiB:1}]\n",
     "spec.yaml: collectives[0] (all-reduce): bytes 1KiB:1: '1': expected a bytes quantity like '224KiB' "
     "(unknown unit '')"),
    ("system: trn2.48xlarge\ngrid: {topology.z.size: [2]}\ncollectives: [{name: all-reduce}]\n",
     "spec.yaml: grid: trn2.48xlarge.yaml (--set topology.z.size=2): unknown key 'topology.z.size': 'z' is not a "
     "dimension of topology; expected one of x, y, efa"),
    ("system: trn2.48xlarge\ncollectives: [{name: all-reduce, ranks: 4, algo: per-dim-ring}]\n",
     "spec.yaml: collectives[0] (all-reduce): algorithm 'per-dim-ring' cannot run all-reduce on 4 ranks of "
     "trn2.48xlarge: it needs a group spanning at least 2 levels (chip cores, x, y, efa); this one spans chip"),
    # a traceback (AttributeError: 'list' object has no attribute 'strip')
    ("system: trn2.48xlarge\ncollectives: [{name: all-reduce, algo: [ring]}]\n",
     "spec.yaml: collectives[0] (all-reduce): algo: expected one algorithm's name, e.g. ring, got ['ring']"),
    # ran twice, two rows of one key in the results file (kernel points listed twice are refused)
    ("system: trn2.48xlarge\ncollectives: [{name: all-reduce, bytes: [1MiB, 1MiB], ranks: 8}]\n",
     "spec.yaml: collectives: all-reduce 8 ranks, 1048576 B bf16 is listed twice"),
    ("system: trn2.48xlarge\ncollectives: [{name: all-reduce, ranks: 8}, {name: allr, ranks: 8}]\n",
     "spec.yaml: collectives: all-reduce 8 ranks, 1048576 B bf16 is listed twice"),
])
def test_bad_collective_specs_fail_before_running(tmp_path, text, message):
    with pytest.raises(ConfigError) as e:
        load_spec(write(tmp_path, text))
    assert str(e.value) == message


@pytest.mark.parametrize("bytes_,message", [
    ("1e30B", "spec.yaml: collectives (all-reduce on 64 ranks): bytes: 1e+30 bytes per rank, more than a rank's share "
              "of its chip on trn2.48xlarge (24 GiB: 96 GiB of HBM over 4 ranks)"),
    ("0B", "spec.yaml: collectives (all-reduce on 64 ranks): bytes: a collective moves at least 1 byte per rank, got 0"),
])
def test_collective_sizes_are_bounded_by_hbm(tmp_path, bytes_, message):
    """Issue 25: a sweep spec took sizes no chip holds, and empty ones."""
    with pytest.raises(ConfigError) as e:
        load_spec(write(tmp_path, f"system: trn2.48xlarge\ncollectives: [{{name: all-reduce, bytes: {bytes_}}}]\n"))
    assert str(e.value) == message


def test_a_collective_group_too_large_to_simulate_is_refused_when_the_spec_loads(tmp_path):
    """Issue 25: a 16,384-chip system's collectives (all its 65,536 ranks by default) never finished."""
    from trnsim.config import CONFIG_DIR

    text = (CONFIG_DIR / "systems" / "trn2.48xlarge.yaml").read_text()
    efa = text.index("  efa:\n")
    (tmp_path / "big.yaml").write_text(text[:efa].replace("name: trn2.48xlarge", "name: big16k") +
                                       text[efa:].replace("size: 1\n", "size: 1024\n", 1))
    with pytest.raises(ConfigError) as e:
        load_spec(write(tmp_path, "system: big.yaml\ncollectives: [{name: all-reduce, bytes: 1MiB}]\n"))
    assert str(e.value) == ("spec.yaml: collectives (all-reduce): ranks: 65,536 ranks of big16k (16,384 chips) in one "
                            "collective; a collective is simulated chunk by chunk, at most 1,024 ranks in one; give a "
                            "group of its ranks")
