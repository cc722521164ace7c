"""Merging the ranks' run reports (trnsim.ranks) and rendering the merged report, without torch:
reports built by the device model itself, as one process per rank would build them."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from trnsim import load_config
from trnsim.device import CollectiveLaunch, Device, OpCost
from trnsim.ranks import link_segments, merge_ranks, rank_trace_events, write_rank_trace

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "run_ranks_report.txt"


def _rank(skew: int) -> tuple[Device, list[int]]:
    """A rank's device: two steps of a matmul, an all-reduce issued after it (rank 1 arrives
    ``skew`` ticks later) and an add beside it, then waiting for the all-reduce, and a mul
    issued after the wait (held back by it: the exposed part)."""
    dev = Device(load_config("trn2", {"host.dispatch": "10ns"}))
    dev.reset(trace=True)
    k = 1000  # ticks per unit: hundreds of microseconds, so the rendered figures say something
    mm = OpCost("matmul", False, (1000 + skew) * k, {"Tensor": 990 * k}, 2, 1 << 20, 2 << 30, {"Tensor": 990 * k})
    add = OpCost("binary", False, 300 * k, {"Vector": 300 * k}, 2, 1 << 16, 0, {"Vector": 300 * k})
    coll = OpCost("all-reduce:ring", False, 800 * k, {"DMA": 400 * k}, 2, 1 << 20, 0, {"DMA": 400 * k},
                  collective=CollectiveLaunch("all-reduce", "ring", 2, 64 << 20, 800 * k, 1.0, "link"))
    steps = []
    for _ in range(2):
        dev.launch(0, "mm", mm)
        arrival = dev.issue_collective(0)
        dev.launch(0, "add", add)
        start = arrival if skew else arrival + 100 * k  # rank 0 waits for rank 1
        _, end = dev.place_collective(0, "all_reduce", coll, start, arrival)
        dev.stream_wait(0, 0, end)
        dev.launch(0, "mul", add)
        dev.synchronize(0)
        steps.append(dev.now())
    return dev, steps


@pytest.fixture(scope="module")
def merged():
    d0, s0 = _rank(0)
    d1, s1 = _rank(100)
    return merge_ranks("trn2.48xlarge", {1: d1.report(), 0: d0.report()}, {0: 0, 1: 0}, {0: s0, 1: s1})


def test_rows_sum_over_ranks_and_cores_are_ranks(merged):
    rep = merged.total
    assert merged.world == 2 and sorted(merged.ranks) == [0, 1] and sorted(rep.cores) == [0, 1]
    ar = rep.row("all_reduce")
    assert ar.calls == 4 and ar.kernel == "all-reduce:ring" and ar.bound == "link"
    assert ar.collective.bytes == 4 * (64 << 20) and ar.collective.network_us == pytest.approx(4 * 800e3 / 4.8e9 * 1e6)
    assert ar.collective.peer_wait_us == pytest.approx(2 * 100e3 / 4.8e9 * 1e6)  # rank 0's two waits
    assert rep.row("mm").calls == 4 and rep.matmul_flops == 4 * (2 << 30)
    assert {e.core for e in rep.events} == {0, 1}  # events relabelled with their rank
    assert rep.elapsed_us == max(r.elapsed_us for r in merged.ranks.values())


def test_summaries_split_collective_time_into_overlapped_and_exposed(merged):
    hz = 4.8e9
    s0 = merged.summaries[0]
    assert s0.collective_us == pytest.approx(2 * 800e3 / hz * 1e6)
    assert s0.beside_compute_us == pytest.approx(2 * 200e3 / hz * 1e6)  # the add runs into the collective's start
    # the add ends 300 into the collective's 800; then the mul, issued, waits for its end
    assert s0.exposed_us == pytest.approx(2 * (800e3 - 200e3) / hz * 1e6)
    assert s0.overlapped_us + s0.exposed_us == pytest.approx(s0.collective_us)
    assert s0.peer_wait_us == pytest.approx(2 * 100e3 / hz * 1e6) and s0.collectives == 2
    assert len(s0.step_ends_us) == 2


def test_step_time_is_the_slowest_ranks(merged):
    s0, s1 = merged.summaries[0].step_ends_us, merged.summaries[1].step_ends_us
    assert merged.step_times_us == (max(s0[0], s1[0]), max(s0[1] - s0[0], s1[1] - s1[0]))
    assert merged.step_us == merged.step_times_us[1]  # the steps after the first


def test_trace_has_a_process_per_rank_with_collective_and_neuronlink_lanes(merged, tmp_path):
    links = {0: [("link chip 0 -> chip 1 (x+)", "all_reduce: step 1 -> 4", 10, 20)]}
    events = rank_trace_events(merged, links)
    names = {(e["pid"], e["args"]["name"]) for e in events if e["name"] in ("process_name", "thread_name")}
    assert (0, "rank 0 (NeuronCore 0, chip 0, trn2, simulated)") in names
    assert {(0, "collectives (CC cores)"), (1, "default stream"), (0, "host"),
            (0, "NeuronLink chip 0 -> chip 1 (x+)")} <= names
    path = write_rank_trace(tmp_path / "t.json", merged, links)
    doc = json.loads(path.read_text())
    assert doc["otherData"]["world"] == 2 and any(e.get("cat") == "link" for e in doc["traceEvents"])


def test_link_segments_keep_a_ranks_own_lanes_and_its_chips_links_once():
    from trnsim.collectives import simulate_collective

    rep = simulate_collective("trn2.48xlarge", "all-reduce", 1 << 20, group=[0, 1, 4, 5], dtype="fp32", trace=True)
    placed = [("all_reduce", 1000, rep)]
    seg0, seg1 = link_segments(0, placed, 4), link_segments(1, placed, 4)
    assert any(lane.startswith("link chip 0") for lane, _, _, _ in seg0)  # rank 0: the lowest of the group on chip 0
    assert not any(lane.startswith("link") for lane, _, _, _ in seg1)
    assert all(lane.startswith("rank 1 ") for lane, _, _, _ in seg1) and seg1
    assert min(a for _, _, a, _ in seg0) >= 1000  # shifted by the call's start


def test_render_merged_report_golden(merged):
    from trnsim.cli import render_rank_report, run_report_width

    class Console:
        def __init__(self):
            from rich.console import Console as Rich

            self.buf = io.StringIO()
            self.rich = Rich(file=self.buf, width=run_report_width(merged.total), highlight=False, color_system=None)

        def print(self, *a, **k):
            self.rich.print(*a, **k)

    c = Console()
    render_rank_report(merged, "probe.py on 2 ranks of trn2.48xlarge", c)
    text = "".join(line.rstrip() + "\n" for line in c.buf.getvalue().splitlines())
    assert text == GOLDEN.read_text()
