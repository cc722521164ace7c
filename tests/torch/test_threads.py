"""Ops from several threads keep the device's counters exact: allocation statistics and report
call counts are updated under locks (values were always right; the counters raced)."""

import sys
import threading

import torch


def test_counters_hold_under_threads():
    torch.neuron.synchronize()
    base = torch.neuron.memory_allocated()
    before = torch.neuron.memory_stats()  # (deltas: another test may have reset the accumulated counters)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    errors: list[BaseException] = []

    def work() -> None:
        try:
            x = torch.ones(16, device="neuron")
            for _ in range(1000):
                y = x + 1
                del y
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
    try:
        with torch.neuron.report_scope() as scope:
            threads = [threading.Thread(target=work) for _ in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    finally:
        sys.setswitchinterval(old)
    assert errors == []
    assert scope.report.row("add").calls == 4 * 1000
    assert torch.neuron.memory_allocated() == base
    stats = torch.neuron.memory_stats()
    delta = {k: stats[f"allocation.all.{k}"] - before[f"allocation.all.{k}"] for k in ("allocated", "freed", "current")}
    assert delta["allocated"] - delta["freed"] == delta["current"] == 0 and delta["allocated"] >= 4
