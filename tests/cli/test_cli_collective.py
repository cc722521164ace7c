"""`trnsim collective`: golden tables, JSON, the trace, and one-line errors with exit status 2."""

import json
from pathlib import Path

import pytest

from trnsim.cli import main
from trnsim.collectives.runner import parse_sizes

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_all_reduce_table_golden(capsys):
    code, out, err = run(capsys, "collective", "all-reduce", "--bytes", "8B:1GiB", "--factor", "8")
    assert code == 0 and err == ""
    assert out == (GOLDEN / "collective_allreduce_trn2.txt").read_text()


def test_overrides_and_a_list_of_sizes_golden(capsys):
    code, out, _ = run(capsys, "collective", "allg", "--system", "trn3-ultraserver-gen1", "--ranks", "16",
                       "--bytes", "1MiB,256MiB", "--set", "topology.server.bandwidth=512GB/s")
    assert code == 0
    assert out == (GOLDEN / "collective_allgather_trn3.txt").read_text()


def test_json_has_nccom_test_fields_and_the_report(capsys):
    code, out, _ = run(capsys, "collective", "reduce-scatter", "--ranks", "8", "--bytes", "4KiB:16KiB", "--json")
    d = json.loads(out)
    assert code == 0 and d["units"] == {"time": "us", "algbw": "GiB/s", "busbw": "GiB/s"}
    assert [r["size(B)"] for r in d["results"]] == [4096, 8192, 16384]
    r = d["results"][0]
    assert r["count(elems)"] == 4096 // 2 // 8 and r["type"] == "bf16"
    assert r["busbw(GiB/s)"] == pytest.approx(r["algbw(GiB/s)"] * 7 / 8)
    assert r["report"]["algorithm"] == r["algorithm"] == "two-step-mesh"  # 4 ranks on each of 2 chips
    assert d["placement"] == r["report"]["placement"] == "8 ranks on 2 chips"
    assert r["report"]["estimate"]["time_s"] * 1e6 == pytest.approx(r["estimate(us)"])


def test_trace_is_written(tmp_path, capsys):
    path = tmp_path / "ar.json"
    code, out, _ = run(capsys, "collective", "all-reduce", "--ranks", "8", "--bytes", "1MiB", "--trace", str(path))
    assert code == 0 and f"Trace of the 1 MiB run written to {path}" in out
    assert json.loads(path.read_text())["otherData"]["collectives"] == ["all-reduce"]


def test_an_unwritable_trace_is_refused_before_any_size_is_simulated(tmp_path, capsys, monkeypatch):
    """It was refused after every size had run (seconds to minutes for the default 8B:4GiB)."""
    import trnsim.collectives as collectives

    def never(*a, **k):
        raise AssertionError("simulated before the --trace path was checked")

    monkeypatch.setattr(collectives, "simulate_collective", never)
    (tmp_path / "f").write_text("")
    code, out, err = run(capsys, "collective", "all-reduce", "--trace", str(tmp_path / "f" / "t.json"))
    assert (code, out) == (2, "") and err.startswith(f"trnsim: error: --trace {tmp_path / 'f' / 't.json'}: ")
    assert err.count("\n") == 1 and sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_bytes_specs():
    assert parse_sizes("8B:64B", 2) == [8, 16, 32, 64]
    assert parse_sizes("1KiB:1MiB", 32) == [1024, 32768, 1048576]
    assert parse_sizes("1MiB, 3MB", 2) == [1048576, 3000000]
    assert parse_sizes("0B", 2) == [0]


@pytest.mark.parametrize("argv,message", [
    (["bogus"], "unknown collective 'bogus': expected one of all-reduce, all-gather, reduce-scatter, all-to-all, "
                "broadcast, reduce, send-recv, permute"),
    (["all-reduce", "--ranks", "48"], "all-reduce: 48 ranks does not divide trn2.48xlarge's 64 ranks (16 chips x 4 "
                                      "logical cores); expected one of 1, 2, 4, 8, 16, 32, 64"),
    (["all-reduce", "--bytes", "9B"], "all-reduce: 9 bytes is not a whole number of bf16 elements (2 bytes each)"),
    (["all-reduce", "--ranks", "4", "--algo", "per-dim-ring"],
     "algorithm 'per-dim-ring' cannot run all-reduce on 4 ranks of trn2.48xlarge: it needs a group spanning at "
     "least 2 levels (chip cores, x, y, efa); this one spans chip"),
    (["all-reduce", "--ranks", "2", "--algo", "kangaring", "--bytes", "1MiB"],
     "algorithm 'kangaring' cannot run all-reduce on 2 ranks of trn2.48xlarge: it needs at least two pairs of ranks "
     "(4 ranks, 2 per chip)"),
    (["all-reduce", "--system", "trn1.32xlarge", "--ranks", "4", "--algo", "kangaring", "--bytes", "1MiB"],
     "algorithm 'kangaring' cannot run all-reduce on 4 ranks of trn1.32xlarge: it needs DMA duplication (one read, "
     "two writes), which trn1.32xlarge does not have (collectives.dma_duplication)"),
    (["all-reduce", "--system", "trn2-ultraserver", "--ranks", "64", "-N", "3"],
     "all-reduce: 64 ranks cannot spread evenly over 3 instance(s) of trn2-ultraserver (4 instance(s) of 64 ranks); "
     "expected one of 1, 2, 4"),
    (["all-reduce", "--bytes", "1GiB:8B"],
     "--bytes 1GiB:8B: the first size (1073741824 bytes) is larger than the second (8 bytes)"),
    (["all-reduce", "--bytes", "8:16"], "--bytes 8:16: '8': expected a bytes quantity like '224KiB' (unknown unit '')"),
    (["all-reduce", "--bytes", "1B:2B:4B"], "--bytes 1B:2B:4B: expected SIZE, MIN:MAX or SIZE,SIZE,..., e.g. 8B:4GiB"),
    (["all-reduce", "--bytes", "0B:1KiB"], "--bytes 0B:1KiB: a range starts at 1 byte or more"),
    (["all-reduce", "--bytes", "1B:1GiB", "--factor", "1"],
     "--factor 1: expected an integer >= 2 (each size is the previous times it)"),
    (["all-reduce", "--system", "trn9"],
     "unknown system 'trn9': expected one of trn1.32xlarge, trn2-ultraserver, trn2.48xlarge, trn3-ultraserver-gen1, "
     "trn3-ultraserver-gen2 or a path to a .yaml file"),
    (["all-reduce", "--set", "topology.q.size=2"],
     "trn2.48xlarge.yaml (--set topology.q.size=2): unknown key 'topology.q.size': 'q' is not a dimension of "
     "topology; expected one of x, y, efa"),
    (["all-to-all", "--algo", "kangaring"], "algorithm 'kangaring' does not run all-to-all; expected one of ring, mesh"),
])
def test_errors_are_one_line_and_exit_2(capsys, argv, message, tmp_path):
    code, out, err = run(capsys, "collective", *argv, "--trace", str(tmp_path / "t.json"))
    assert (code, out, err) == (2, "", f"trnsim: error: {message}\n")
    assert not (tmp_path / "t.json").exists()  # nothing half-written


@pytest.mark.parametrize("argv,message", [
    (["all-reduce", "--bytes", "1e30B"], "--bytes 1e30B: 1e+30 bytes per rank, more than a rank's share of its chip "
                                         "on trn2.48xlarge (24 GiB: 96 GiB of HBM over 4 ranks)"),
    (["all-to-all", "--bytes", "1e30B"], "--bytes 1e30B: 1e+30 bytes per rank, more than a rank's share of its chip "
                                         "on trn2.48xlarge (24 GiB: 96 GiB of HBM over 4 ranks)"),
    (["all-reduce", "--bytes", "1PiB"], "--bytes 1PiB: 1,125,899,906,842,624 bytes per rank, more than a rank's share "
                                        "of its chip on trn2.48xlarge (24 GiB: 96 GiB of HBM over 4 ranks)"),
    (["all-gather", "--ranks", "1", "--bytes", "97GiB"],
     "--bytes 97GiB: 104,152,956,928 bytes per rank, more than a rank's share of its chip on trn2.48xlarge "
     "(96 GiB of HBM)"),
    (["all-reduce", "--bytes", "0B"], "--bytes 0B: a collective moves at least 1 byte per rank, got 0"),
    (["all-reduce", "--bytes", "1KiB,0B"], "--bytes 1KiB,0B: a collective moves at least 1 byte per rank, got 0"),
])
def test_sizes_no_rank_can_hold_are_refused(capsys, argv, message):
    """Issue 25: 1e30B ran (a 31-digit size), 0B ran, 1PiB was an unknown unit."""
    code, out, err = run(capsys, "collective", *argv)
    assert (code, out, err) == (2, "", f"trnsim: error: {message}\n")


def test_binary_units_reach_pib_and_a_whole_chip_holds_its_hbm(capsys):
    from trnsim.config import format_quantity, parse_quantity

    assert parse_quantity("1PiB", "bytes") == 2**50 and parse_quantity("1PB", "bytes") == 10**15
    assert format_quantity(3 * 2**50, "bytes") == "3 PiB"
    code, out, err = run(capsys, "collective", "all-reduce", "--bytes", "24GiB", "--json")
    assert code == 0 and json.loads(out)["results"][0]["size(B)"] == 24 * 2**30


def test_a_group_too_large_to_simulate_is_refused_and_a_small_one_ignores_the_chips_declared(capsys):
    """Issue 25: at the chip limit (topology.efa.size=4096: 65,536 chips) the default group of
    every rank gave no output for 15 minutes. A group is bounded by what simulates; a group of a
    few ranks costs the same whatever the system declares beyond them."""
    big = ["--set", "topology.efa.size=4096"]
    code, out, err = run(capsys, "collective", "all-reduce", *big)
    assert (code, out) == (2, "")
    assert err == ("trnsim: error: all-reduce: 262,144 ranks of trn2.48xlarge (65,536 chips) in one collective; a "
                   "collective is simulated chunk by chunk, at most 1,024 ranks in one; give a group of its ranks\n")
    code, out, err = run(capsys, "collective", "all-reduce", "--ranks", "2048", "--bytes", "1MiB", *big)
    assert code == 2 and err.startswith("trnsim: error: --ranks: 2,048 ranks of trn2.48xlarge (65,536 chips)")
    small = ["collective", "all-reduce", "--ranks", "8", "--bytes", "1MiB", "--json"]
    code, out, _ = run(capsys, *small, *big)
    on_big = json.loads(out)["results"][0]
    code, out, _ = run(capsys, *small)
    on_one = json.loads(out)["results"][0]
    assert code == 0 and on_big["time:avg(us)"] == on_one["time:avg(us)"] and on_big["algorithm"] == on_one["algorithm"]
