"""Asynchronous collectives in a timing-only run (issue 29): a collective issued with its result
tensor runs on the core's collective stream while the compute that does not read the result
goes on; the first op that reads it waits for its end. NxD's async linear (its backward) is
built on it.

The hand-worked timeline is one sequence-parallel column-parallel linear's backward on one
Trn1 NeuronCore (LNC=1: one DMA lane, so two transfers side by side share it), ticks:

* all-gather of the kept shard (AG): 300 ticks, 300 of them DMA, issued first on a free stream;
* input-gradient matmul (gi): 200 ticks on TensorE, no DMA;
* reduce-scatter of gi (RS): 400 ticks, 400 DMA, issued after gi;
* weight-gradient matmul (gw), reading AG's result: 250 ticks, 100 of them DMA;
* the next op, reading RS's result: 50 ticks.

Blocking (each collective waited on at once): AG 0-300, gi 300-500, RS 500-900, gw 900-1150,
next 1150-1200.

Asynchronous: AG 0-300 and gi 0-200 side by side; RS starts when gi is done and the stream is
free, 300-700; gw waits for AG (300) and runs beside RS: its 100 DMA ticks and RS's 400 share
the one lane, so gw takes the window in which both fit, 300-800 (RS, placed first, keeps its
time); the next op waits for RS (700) and the compute stream (800): 800-850. 350 ticks saved.
"""

import pytest
import torch

from trnsim import load_config
from trnsim.device import COLLECTIVE_STREAM, CollectiveLaunch, Device, OpCost

from torch_bridge.timing.fake import Ledger, Target, TimingOnly


def _cost(ticks: int, dma: int = 0, tensor: int = 0) -> OpCost:
    demand = {k: v for k, v in (("DMA", dma), ("Tensor", tensor)) if v}
    return OpCost("k", False, ticks, dict(demand), 1, 0, 0, demand)


def _coll(name: str, ticks: int) -> OpCost:
    return OpCost(f"{name}:ring", False, ticks, {"DMA": ticks}, 1, 0, 0, {"DMA": ticks},
                  collective=CollectiveLaunch(name, "ring", 2, 1 << 20, ticks, 0.5, "link"))


def _linear_backward(overlap: bool) -> list[tuple[str, int, int, int]]:
    cfg = load_config("trn1", {"host.dispatch": "0ns"})
    dev = Device(cfg)
    run = TimingOnly(Target(dev, 0, Ledger(cfg.logical_cores, 1 << 30)))
    with run:
        full = torch.empty(64, 64, dtype=torch.bfloat16, device="neuron")  # AG's result
        local = torch.empty(32, 64, dtype=torch.bfloat16, device="neuron")  # RS's result
        dev.reset(trace=True)
        run.collective(0, "all_gather", _coll("all-gather", 300), early=True, result=full if overlap else None)
        run.launch(0, "gi", _cost(200, tensor=200))
        run.collective(0, "reduce_scatter", _coll("reduce-scatter", 400), result=local if overlap else None)
        run.await_reads([full])
        run.launch(0, "gw", _cost(250, dma=100, tensor=250))
        run.await_reads([local])
        run.launch(0, "next", _cost(50, tensor=50))
    return [(e.op, e.stream, e.start, e.end) for e in dev.report().events]


def test_an_async_collective_runs_beside_the_matmul_that_does_not_read_it():
    c = COLLECTIVE_STREAM
    assert _linear_backward(False) == [("all_gather", c, 0, 300), ("gi", 0, 300, 500), ("reduce_scatter", c, 500, 900),
                                       ("gw", 0, 900, 1150), ("next", 0, 1150, 1200)]
    assert _linear_backward(True) == [("all_gather", c, 0, 300), ("gi", 0, 0, 200), ("reduce_scatter", c, 300, 700),
                                      ("gw", 0, 300, 800), ("next", 0, 800, 850)]


def test_nxd_async_linear_overlaps_the_sequence_parallel_collectives_in_a_step(tmp_path):
    """A tiny Llama layer at TP=2 with sequence parallelism: each fused linear's backward runs
    its input-gradient matmul beside the all-gather of its kept input and its weight-gradient
    matmul beside the input gradient's reduce-scatter, so the backward is shorter; the forward,
    the collectives' count and bytes and the HBM are the same."""
    from torch_bridge.estimate import estimate_train

    kw = dict(tp=2, sp=True, layers=1, micro_batch=1, seq=256, cache_dir=tmp_path, trace=True)
    (blocking, _), (overlapped, traces) = (estimate_train("tests/data/tiny-llama.json", tp_overlap=v, **kw)
                                           for v in (False, True))
    assert overlapped.forward.time_ms == blocking.forward.time_ms
    assert overlapped.backward.time_ms < blocking.backward.time_ms
    assert [c[:3] for c in overlapped.backward.collectives] == [c[:3] for c in blocking.backward.collectives]
    assert overlapped.train_memory == blocking.train_memory
    (rep,) = [r for phase, _, r in traces if phase == "backward"]
    rs = [e for e in rep.events if e.stream == COLLECTIVE_STREAM and e.op == "reduce_scatter"]
    mms = [e for e in rep.events if e.stream != COLLECTIVE_STREAM and e.op == "mm"]
    # a weight-gradient matmul starts with a reduce-scatter and runs while it does, in each block
    beside = [(r, m) for r in rs for m in mms if m.start == r.start and m.end > r.start]
    assert len(beside) == 2
