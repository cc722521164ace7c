"""The neuron process-group backend on 2 ranks under ``trnsim run --nproc`` (torchrun's launcher):
values through gloo, simulated time from the NeuronLink model, overlap, and ranks that disagree
failing with one line instead of hanging. Multi-process runs are few: one probe run
(tests/torch/dist_probe.py) checks most things at once."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
PROBE = HERE / "dist_probe.py"
TIMEOUT = 300  # seconds: a hang fails the test, it does not stall the suite


def _trnsim(*argv: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trnsim.cli", *argv], capture_output=True, text=True, timeout=TIMEOUT,
                          cwd=cwd)


def _json(stdout: str) -> dict:
    return json.loads(stdout[stdout.index("\n{") + 1:] if not stdout.startswith("{") else stdout)


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    out = tmp_path_factory.mktemp("probe")
    run = _trnsim("run", "--nproc", "2", "--json", str(PROBE), str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    return ranks, _json(run.stdout)


def test_init_process_group_picks_the_neuron_backend(probe):
    ranks, _ = probe
    assert [r["group"] for r in ranks] == ["NeuronProcessGroup"] * 2


def test_values_of_every_collective(probe):
    (a, b), _ = probe
    va, vb = a["values"], b["values"]
    for v in (va, vb):
        assert v["all_reduce"] == [3.0] * 4 and v["all_reduce_avg"] == [1.5] * 4 and v["all_reduce_max"] == [1.0] * 2
        assert v["broadcast"] == [0.0, 2.0, 4.0]
        assert v["all_gather_into_tensor"] == [0.0, 0.0, 1.0, 1.0] and v["all_gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert v["all_reduce_coalesced"] == [[3.0, 3.0], [1.0, 1.0, 1.0]]
        assert v["all_gather_object"] == [{"rank": 0}, {"rank": 1}] and v["future"] == [[2.0, 2.0]]
        assert v["funcol_all_reduce"] == [3.0, 3.0]
        assert v["dtensor_full"] == [[0.0, 1.0], [2.0, 3.0], [4.0, 5.0], [6.0, 7.0]]
        assert v["after_errors"] == [2.0, 2.0]  # the group goes on after ranks disagreed
    assert (va["reduce_scatter_tensor_avg"], vb["reduce_scatter_tensor_avg"]) == ([0.0, 1.5], [3.0, 4.5])
    assert (va["reduce_scatter"], vb["reduce_scatter"]) == ([1.0, 1.0], [3.0, 3.0])
    assert (va["all_to_all_single_uneven"], vb["all_to_all_single_uneven"]) == ([0.0, 100.0, 101.0], [1.0, 102.0, 103.0])
    assert (va["all_to_all"], vb["all_to_all"]) == ([[0.0], [10.0]], [[1.0], [11.0]])
    assert (va["scatter"], vb["scatter"]) == ([0.0, 0.0], [1.0, 1.0])
    assert va["gather"] == [[0.0, 0.0], [1.0, 1.0]] and va["reduce_root"] == [3.0, 3.0]
    assert (va["batch_isend_irecv"], vb["batch_isend_irecv"]) == ([1.0, 1.0], [0.0, 0.0])


def test_a_collectives_time_is_what_trnsim_collective_reports(probe):
    """2 MiB fp32 all-reduce on ranks 0 and 1 of trn2.48xlarge: both ranks start together and
    their time on the timeline equals `trnsim collective`'s for the same group, size, algorithm."""
    from trnsim.collectives import simulate_collective

    (a, b), _ = probe
    (op, stream, s0, e0), = a["events"]["alone"]
    assert (op, stream) == ("all_reduce", -1) and b["events"]["alone"] == a["events"]["alone"]
    rep = simulate_collective("trn2.48xlarge", "all-reduce", 2 << 20, ranks=2, dtype="fp32")
    assert rep.algorithm == "ring" and e0 - s0 == rep.end_of(0) == rep.end_of(1)  # 2 MiB per 2 ranks: past rdh
    cli = json.loads(_trnsim("collective", "all-reduce", "--ranks", "2", "--bytes", "2MiB", "--dtype", "fp32",
                             "--json").stdout)["results"][0]
    assert cli["algorithm"] == "ring" and (e0 - s0) / rep.tick_hz * 1e6 == pytest.approx(cli["time:avg(us)"], rel=1e-12)
    assert a["alone_row"] == [["all_reduce", "all-reduce:ring", 2 << 20, pytest.approx(cli["time:avg(us)"])]]


def test_an_async_all_reduce_overlaps_the_compute_issued_after_it(probe):
    (a, b), _ = probe
    for r in (a, b):
        (ar, mm, add) = r["events"]["overlap"]
        assert ar[0] == "all_reduce" and mm[0] == "mm" and add[0] == "add"
        assert ar[2] < mm[2] < mm[3] < ar[3]  # the matmul runs inside the collective's interval
        assert add[2] == ar[3]  # after wait(): the stream waits for the collective's end


def test_the_collective_starts_when_the_last_rank_arrives(probe):
    (a, b), _ = probe
    coll_a = [e for e in a["events"]["skew"] if e[1] == -1]
    coll_b = [e for e in b["events"]["skew"] if e[1] == -1]
    last_mm = max(e[3] for e in b["events"]["skew"] if e[0] == "mm")
    assert coll_a == coll_b and coll_a[0][2] == last_mm  # rank 1's matmuls end, then it starts on both
    assert a["skew_peer_wait_us"][0] > 200 and b["skew_peer_wait_us"] == [0.0]


def test_ranks_that_disagree_get_the_same_one_line_error(probe):
    (a, b), _ = probe
    where = "neuron backend: {op} #{n} on ranks [0, 1]: "
    assert a["errors"]["shapes"] == b["errors"]["shapes"] == where.format(op="all_reduce", n=25) + (
        "the tensors differ across ranks: rank 0 has float32[4], rank 1 has float32[5]; every rank must pass "
        "tensors of the same shapes and dtypes")
    assert a["errors"]["ops"] == where.format(op="all_reduce", n=26) + (
        "the ranks made different calls: rank 0 all_reduce, rank 1 broadcast; every rank of a group must make the "
        "same collectives in the same order")
    assert a["errors"]["roots"] == where.format(op="broadcast", n=27) + (
        "the ranks name different roots: rank 0 names 0, rank 1 names 1")
    assert "rank 0 has float32[4], rank 1 has bfloat16[4]" in a["errors"]["dtypes"]
    assert a["errors"]["splits"] == b["errors"]["splits"] == where.format(op="all_to_all_single", n=29) + (
        "rank 0 sends 2 rows to rank 1, which expects 1; each rank's output_split_sizes must be what the others' "
        "input_split_sizes send it")
    assert a["errors"]["split_count"] == b["errors"]["split_count"] == where.format(op="all_to_all_single", n=30) + (
        "rank 0 gives 3 input splits and 2 output splits; each rank gives one of each per rank of the group (2)")
    assert a["errors"]["bad_root"] == b["errors"]["bad_root"] == (
        "ProcessGroupGloo::broadcast: invalid root rank: 5 (the group's ranks are 0..1)")
    assert a["errors"]["send_recv"] == b["errors"]["send_recv"] == (
        "neuron backend: send from rank 0 to rank 1: rank 0 sends float32[3] (12 bytes) but rank 1 receives into "
        "float32[4] (16 bytes); both must name tensors of the same shapes and dtypes")


def test_the_merged_report_has_collective_rows_ranks_and_steps(probe):
    _, rep = probe
    assert rep["world"] == 2 and rep["system"] == "trn2.48xlarge" and set(rep["ranks"]) == {"0", "1"}
    rows = {(r["op"], r["kernel"]): r for r in rep["total"]["rows"]}
    ar = rows[("all_reduce", "all-reduce:ring")]
    assert ar["calls"] == 6 and ar["collective"]["bytes"] == 2 * (2 * (2 << 20) + (32 << 20))
    assert ar["collective"]["algorithm"] == "ring" and ar["collective"]["busbw"] > 0
    assert ("mm", "matmul") in rows  # compute rows beside the collective rows
    s0 = rep["ranks"]["0"]["summary"]
    assert s0["collective_us"] > 0 and 0 < s0["beside_compute_us"] <= s0["collective_us"]
    assert s0["overlapped_us"] + s0["exposed_us"] == pytest.approx(s0["collective_us"])


DDP = """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("neuron")
torch.manual_seed(dist.get_rank())
model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).to("neuron"))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    model(torch.randn(64, 256, device="neuron")).square().mean().backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
"""


def test_the_same_script_on_the_same_ranks_gives_the_same_cycles(tmp_path):
    """... twice, and twice more with the ranks sharing one on-disk cost cache (--cost-cache:
    the first of those stores the kernels' costs, from both ranks at once, the second reads them)."""
    import os

    script = tmp_path / "ddp.py"
    script.write_text(textwrap.dedent(DDP))
    reps = []
    cache = tmp_path / "costs"
    for flags, env in [((), None)] * 2 + [(("--cost-cache",), {**os.environ, "TRNSIM_COST_CACHE": str(cache)})] * 2:
        run = subprocess.run([sys.executable, "-m", "trnsim.cli", "run", "--nproc", "2", *flags, "--json", str(script)],
                             capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path, env=env)
        assert run.returncode == 0, run.stderr[-3000:]
        reps.append(_json(run.stdout))
    assert list(cache.rglob("*.json"))
    assert reps[1] == reps[0] and reps[2] == reps[0] and reps[3] == reps[0]
    rows = {r["op"]: r for r in reps[0]["total"]["rows"]}
    assert rows["all_reduce"]["calls"] == 6 and len(reps[0]["step_times_us"]) == 3  # a bucket per step per rank


SHAPES = """
import torch, torch.distributed as dist
dist.init_process_group("neuron")
x = torch.ones(4 if dist.get_rank() == 0 else 5, device="neuron")
dist.all_reduce(x)
"""

FINISHES_EARLY = """
import torch, torch.distributed as dist
dist.init_process_group("neuron")
if dist.get_rank() == 0:
    dist.all_reduce(torch.ones(4, device="neuron"))
"""

STUCK = """
import time, torch, torch.distributed as dist
dist.init_process_group("neuron")
if dist.get_rank() == 1:
    time.sleep(120)
dist.broadcast(torch.ones(4, device="neuron"), src=0)
"""

CONFIGS = """
import torch, torch.distributed as dist, os, pathlib
if os.environ["RANK"] == "1":
    torch.neuron.set_config("trn2", ["core.sbuf.partition_bytes=128KiB"])
try:
    dist.init_process_group("neuron")
except Exception as e:  # each rank keeps its own message: the ranks' tracebacks interleave on one stderr
    pathlib.Path(f"error{os.environ['RANK']}.txt").write_text(f"{type(e).__name__}: {e}")
    raise
"""


def _bad(tmp_path: Path, code: str, *flags: str) -> subprocess.CompletedProcess:
    script = tmp_path / "bad.py"
    script.write_text(textwrap.dedent(code))
    return _trnsim("run", "--nproc", "2", *flags, str(script), cwd=tmp_path)


def _error_line(run: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in run.stderr.splitlines() if ln.startswith("trnsim: ")]
    assert len(lines) == 1, run.stderr[-3000:]
    return lines[0]


def test_mismatched_shapes_fail_with_one_line(tmp_path):
    run = _bad(tmp_path, SHAPES)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert _error_line(run) == (
        "trnsim: error: neuron backend: all_reduce #1 on ranks [0, 1]: the tensors differ across ranks: rank 0 has "
        "float32[4], rank 1 has float32[5]; every rank must pass tensors of the same shapes and dtypes")


def test_a_rank_that_finishes_early_does_not_leave_its_peer_hanging(tmp_path):
    """The waiting rank fails at once (well before the 10-minute timeout), naming its peer."""
    run = _bad(tmp_path, FINISHES_EARLY, "--timeout", "600")
    assert run.returncode == 2
    assert _error_line(run).startswith("trnsim: error: neuron backend: rank 0 failed in all_reduce #1 on ranks "
                                       "[0, 1]; rank 1 finished its script (gloo: ")


def test_a_timeout_names_the_rank_and_the_collective(tmp_path):
    run = _bad(tmp_path, STUCK, "--timeout", "3")
    assert run.returncode == 2
    assert _error_line(run).startswith(
        "trnsim: error: neuron backend: rank 0 timed out after 3 s waiting for its peers in broadcast #1 on ranks "
        "[0, 1]; the other ranks did not arrive (stuck before this call, or in another one) (gloo: ")


def test_ranks_on_different_configs_fail_at_init(tmp_path):
    """Under plain torchrun (trnsim run fixes one config for every rank)."""
    script = tmp_path / "configs.py"
    script.write_text(textwrap.dedent(CONFIGS))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script)], capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path)
    assert run.returncode != 0, run.stderr[-3000:]
    # torchrun stops the other rank once one fails, so at least one rank has written its message; every
    # message written is the same line
    written = [(tmp_path / f"error{r}.txt").read_text() for r in (0, 1) if (tmp_path / f"error{r}.txt").exists()]
    assert written, run.stderr[-3000:]
    assert set(written) == {
        "NeuronDistError: neuron backend: ranks run different configs: rank 0 runs trn2 on trn2.48xlarge, rank 1 "
        "runs trn2 on trn2.48xlarge (core.sbuf.partition_bytes=128KiB); every rank must simulate the same chip and "
        "system (set TRNSIM_CONFIG and TRNSIM_SYSTEM alike)"}, run.stderr[-3000:]


def test_bad_nproc_and_a_world_the_system_cannot_hold(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    big = _trnsim("run", "--nproc", "65", str(script))
    assert big.returncode == 2 and big.stderr == (
        "trnsim: error: run: --nproc 65 does not fit trn2.48xlarge: it has 64 ranks (16 chips x 4 logical "
        "NeuronCores); use fewer ranks or a larger system (--system)\n")
    zero = _trnsim("run", "--nproc", "0", str(script))
    assert zero.returncode == 2 and zero.stderr == "trnsim: error: run: --nproc 0: expected a whole number of ranks >= 1\n"
    other = _trnsim("run", "--nproc", "2", "--config", "trn3", str(script))
    assert other.returncode == 2 and other.stderr == (
        "trnsim: error: run: --config trn3: the system trn2.48xlarge is built of trn2 chips; choose a trn3 system "
        "with --system, or leave --config out\n")


DEVICE_ID = """
import json, os, sys
import torch, torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
dist.init_process_group(backend="neuron", device_id=torch.device("neuron:0"))
r = dist.get_rank()
world = dist.group.WORLD
out = {"world": [type(world).__name__, str(world.bound_device_id)]}
x = torch.full((2,), float(r + 1), device="neuron")
dist.all_reduce(x)
sub = dist.new_group([0, 1])
y = torch.full((2,), float(r + 1), device="neuron")
dist.all_reduce(y, group=sub)
mesh = init_device_mesh("neuron", (1, 2), mesh_dim_names=("dp", "tp"))  # split from the bound group
z = torch.full((2,), float(r + 1), device="neuron")
dist.all_reduce(z, group=mesh.get_group("tp"))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4)).to("neuron")
fully_shard(model, mesh=init_device_mesh("neuron", (2,)))
model(torch.ones(2, 8, device="neuron")).sum().backward()
out["values"] = [x.cpu().tolist(), y.cpu().tolist(), z.cpu().tolist()]
out["groups"] = [[type(g).__name__, str(g.bound_device_id), g.size()] for g in (sub, mesh.get_group("tp"),
                                                                                 mesh.get_group("dp"))]
out["fsdp_grad"] = type(model[0].weight.grad).__name__
with open(os.path.join(sys.argv[1], f"rank{r}.json"), "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
"""


def test_init_process_group_with_device_id_binds_the_neuron_backend(tmp_path):
    """``init_process_group(backend="neuron", device_id=neuron:0)``, as scripts write it for cuda and
    nccl: the group is bound to the device, later groups and a 2-d mesh's dimensions are split from
    it (neuron groups, bound too), and collectives and an FSDP2 step run on them."""
    script = tmp_path / "device_id.py"
    script.write_text(textwrap.dedent(DEVICE_ID))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          str(script), str(tmp_path)], capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    for r in (0, 1):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["world"] == ["NeuronProcessGroup", "neuron:0"]
        assert got["values"] == [[3.0, 3.0], [3.0, 3.0], [3.0, 3.0]]
        assert got["groups"] == [["NeuronProcessGroup", "neuron:0", 2], ["NeuronProcessGroup", "neuron:0", 2],
                                 ["NeuronProcessGroup", "neuron:0", 1]]
        assert got["fsdp_grad"] == "DTensor"


RAISES_MID_RUN = """
import torch, torch.distributed as dist
dist.init_process_group("neuron")
x = torch.ones(4, device="neuron")
for i in range(6):
    if dist.get_rank() == 1 and i == 3:
        raise RuntimeError("boom on rank 1")
    dist.all_reduce(x)
"""

EXITS_7 = """
import sys, torch, torch.distributed as dist
dist.init_process_group("neuron")
if dist.get_rank() == 1:
    sys.exit(7)
dist.all_reduce(torch.ones(4, device="neuron"))
"""


def test_the_rank_that_raised_is_named_not_the_peer_left_waiting(tmp_path):
    """Issue 25: rank 0, left at all_reduce #4, was named ('rank 1 finished its script')
    although rank 1 raised; the summary names rank 1 and what it raised."""
    run = _bad(tmp_path, RAISES_MID_RUN)
    assert run.returncode == 1 and "RuntimeError: boom on rank 1" in run.stderr  # its traceback first
    assert _error_line(run) == "trnsim: rank 1 failed (RuntimeError: boom on rank 1); the other ranks were stopped"


def test_a_rank_that_exits_with_a_status_is_named_with_it(tmp_path):
    """Issue 25: sys.exit(7) on a rank printed 'rank 1 failed (To enable traceback see: ...)'."""
    run = _bad(tmp_path, EXITS_7)
    assert run.returncode == 7
    assert _error_line(run) == "trnsim: rank 1 exited with status 7; the other ranks were stopped"


STEPS_AND_PRINTS = """
import torch, torch.distributed as dist
dist.init_process_group("neuron")
r = dist.get_rank()
m, ref = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
m = m.to("neuron")
opt, ref_opt = torch.optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
for i in range(3):
    x = torch.randn(4, 8)
    m(x.to("neuron")).sum().backward()
    for p in m.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    ref(x).sum().backward()
    ref_opt.step()  # the CPU reference: not a device step
    for k in range(100):
        print(f"rank {r} step {i} line {k:03d} " + "x" * 60)
"""


def test_device_steps_are_counted_and_each_ranks_line_is_whole(tmp_path):
    """Issue 25: the merged report counted 6 optimizer steps for 3 device steps (the script's
    CPU reference optimizer too), and the ranks' prints ran together on one line (each print
    reached the shared pipe as two writes)."""
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent(STEPS_AND_PRINTS))
    run = _trnsim("run", "--nproc", "2", str(script), "--json", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert len(_json(run.stdout)["step_times_us"]) == 3
    lines = [ln for ln in run.stdout.splitlines() + run.stderr.splitlines() if " step " in ln]
    assert len(lines) == 600 and all(re.fullmatch(r"rank [01] step [012] line \d{3} x{60}", ln) for ln in lines)


def test_an_empty_system_name_is_refused_not_taken_as_the_default(tmp_path):
    """Found by the fuzz harness (issue 25): --system '' launched the ranks on the default system."""
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    run = _trnsim("run", "--nproc", "2", "--system", "", str(script))
    assert run.returncode == 2 and run.stderr == ("trnsim: error: run: --system '': expected a system name or a YAML "
                                                  "path (leave --system out for $TRNSIM_SYSTEM or trn2.48xlarge)\n")


MESH = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
mesh = init_device_mesh("neuron", (2, 2), mesh_dim_names=("dp", "tp"))
x = torch.ones(4 << 20, device="neuron")  # 16 MiB of fp32
dist.all_reduce(x, group=mesh.get_group("dp"))
out = torch.empty(8 << 20, device="neuron")
dist.all_gather_into_tensor(out, x, group=mesh.get_group("tp"))
torch.neuron.synchronize()
"""


def test_a_dp_all_reduce_beside_its_sibling_group_is_slower_and_the_report_says_so(tmp_path):
    """On a trn1.32xlarge (two cores a chip) a 2x2 mesh's DP groups [0, 2] and [1, 3] both cross
    chip 0 -> chip 1 at once: each DP all-reduce is simulated beside the other and is slower
    than alone; the TP groups ([0, 1] on chip 0, [2, 3] on chip 1) share nothing."""
    script = tmp_path / "mesh.py"
    script.write_text(textwrap.dedent(MESH))
    run = _trnsim("run", "--nproc", "4", "--config", "trn1", "--system", "trn1.32xlarge", "--json", str(script), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {r["op"]: r["collective"] for r in _json(run.stdout)["total"]["rows"] if r["collective"]}
    dp = rows["all_reduce"]
    tp = next(c for op, c in rows.items() if op.startswith("all_gather"))
    assert dp["network_us"] > 1.1 * dp["alone_us"] > 0
    assert tp["network_us"] == pytest.approx(tp["alone_us"])
    table = _trnsim("run", "--nproc", "4", "--config", "trn1", "--system", "trn1.32xlarge", str(script), cwd=tmp_path)
    assert table.returncode == 0, table.stderr[-3000:]
    line = next(ln for ln in table.stdout.splitlines() if "all_r" in ln)
    assert re.search(r"1\.[1-9]\dx", line), line  # the shared column: the slowdown against the call alone


STREAMS = """
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
mesh = init_device_mesh("neuron", (2, 2), mesh_dim_names=("dp", "tp"))
g = torch.ones(4 << 20, device="neuron")  # 16 MiB of fp32 gradients
work = dist.all_reduce(g, group=mesh.get_group("dp"), async_op=True)  # DP: waited for later
x = torch.ones(1 << 20, device="neuron")
out = torch.empty(2 << 20, device="neuron")
dist.all_gather_into_tensor(out, x, group=mesh.get_group("tp"))  # TP, issued while the DP all-reduce runs
work.wait()
torch.neuron.synchronize()
"""


def test_tp_beside_a_running_dp_collective_on_another_cc_stream_is_slower_and_the_report_says_so(tmp_path,
                                                                                               monkeypatch):
    """One rank per chip (trn1, LNC=2): the TP groups [0, 1], [2, 3] and the DP groups [0, 2],
    [1, 3] share chip 0 -> chip 1 (DP's route to chip 2 passes chip 1). With NxD's multistream
    collectives (stream 0 TP, stream 1 FSDP/DP) the TP all-gather starts while the async DP
    all-reduce runs and is simulated beside it: its shared column is well above 1. On the
    runtime's default single CC stream it waits for the DP all-reduce and runs alone (1.00x)."""
    script = tmp_path / "streams.py"
    script.write_text(textwrap.dedent(STREAMS))
    args = ("run", "--nproc", "4", "--config", "trn1", "--set", "chip.lnc=2", "--system", "trn1.32xlarge", "--json",
            str(script))
    got = {}
    for on in ("1", "0"):
        monkeypatch.setenv("NEURON_NXD_FSDP_CC_MULTISTREAM", on)
        run = _trnsim(*args, cwd=tmp_path)
        assert run.returncode == 0, run.stderr[-3000:]
        total = _json(run.stdout)["total"]
        got[on] = ({r["op"]: r["collective"] for r in total["rows"] if r["collective"]}, total)
    tp_on = next(c for op, c in got["1"][0].items() if op.startswith("all_gather"))
    tp_off = next(c for op, c in got["0"][0].items() if op.startswith("all_gather"))
    assert tp_on["network_us"] > 1.5 * tp_on["alone_us"] > 0
    assert tp_off["network_us"] == pytest.approx(tp_off["alone_us"])
    assert got["1"][0]["all_reduce"]["network_us"] == pytest.approx(got["0"][0]["all_reduce"]["network_us"])


ENV_PROBE = """
import os, sys
import torch.distributed as dist
dist.init_process_group("neuron")
open(os.path.join(sys.argv[1], sys.argv[2] + str(dist.get_rank())), "w").write(
    f"{os.environ.get('TRNSIM_PROBE')} {os.getppid()}")
dist.destroy_process_group()
"""

LAUNCH_TWICE = """
import os, sys
from torch_bridge.dist.launch import run_ranks
if __name__ == "__main__":  # (a forkserver's workers import the launching script, as spawn's do)
    script, out = sys.argv[1:]
    os.environ["TRNSIM_PROBE"] = "first"
    run_ranks(script, [out, "a"], 2)
    os.environ["TRNSIM_PROBE"] = "second"
    run_ranks(script, [out, "b"], 2)
    print(os.getpid())
"""


def test_the_workers_are_not_forked_from_the_launcher_and_see_its_trnsim_variables(tmp_path):
    """A plain fork copied the launcher with its rendezvous threads, and a lock one held stayed
    held in a worker (a CI run hung in a rank's store client): the workers come from a
    forkserver. Its workers would see the server's environment, from when it started: a process
    that launches twice hands the second launch's TRNSIM_* variables on."""
    script, driver = tmp_path / "env_probe.py", tmp_path / "twice.py"
    script.write_text(textwrap.dedent(ENV_PROBE))
    driver.write_text(textwrap.dedent(LAUNCH_TWICE))
    run = subprocess.run([sys.executable, str(driver), str(script), str(tmp_path)], capture_output=True, text=True,
                         timeout=TIMEOUT, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    launcher = run.stdout.split()[-1]
    seen = {f"{w}{r}": (tmp_path / f"{w}{r}").read_text().split() for w in "ab" for r in range(2)}
    assert {k: v[0] for k, v in seen.items()} == {"a0": "first", "a1": "first", "b0": "second", "b1": "second"}
    assert all(ppid != launcher for _, ppid in seen.values())


THREE_RANKS = """
import json, os, sys
from datetime import timedelta
import torch, torch.distributed as dist
dist.init_process_group("neuron", timeout=timedelta(seconds=60), device_id=torch.device("neuron:0"))
r = dist.get_rank()
out = {}
# scatter from a root to two ranks (the network's permute took one send per rank: it was refused)
got = torch.zeros(2, device="neuron")
dist.scatter(got, [torch.full((2,), 10.0 * j + 1, device="neuron") for j in range(3)] if r == 0 else None, src=0)
out["scatter"] = got.cpu().tolist()
# list all_to_all of uneven sizes that agree: rank r sends rank j r + j + 1 elements
ins = [torch.full((r + j + 1,), 10.0 * r + j, device="neuron") for j in range(3)]
outs = [torch.zeros(j + r + 1, device="neuron") for j in range(3)]
dist.all_to_all(outs, ins)
out["a2a"] = [o.cpu().tolist() for o in outs]
# ... and that disagree: rank 0 sends rank 1 one element where rank 1 posts two (it got an
# uninitialised element back)
ins = [torch.full((1 if r == 0 and j == 1 else 2,), 1.0, device="neuron") for j in range(3)]
try:
    dist.all_to_all([torch.zeros(2, device="neuron") for _ in range(3)], ins)
    out["a2a_disagree"] = "no error"
except Exception as e:
    out["a2a_disagree"] = str(e)
# a split after a group that leaves rank 0 out (torch's names for it differ between the ranks)
dist.new_group([1, 2])
g01 = dist.split_group(split_ranks=[[0, 1], [2]])
if r in (0, 1):
    t = torch.full((2,), float(r + 1), device="neuron")
    dist.all_reduce(t, group=g01)
    out["split"] = t.cpu().tolist()
# a send and recv, then the group destroyed (the process aborted at exit)
if r == 0:
    dist.send(torch.arange(4.0, device="neuron"), 1)
elif r == 1:
    t = torch.zeros(4, device="neuron")
    dist.recv(t, 0)
    out["recv"] = t.cpu().tolist()
dist.barrier()
with open(os.path.join(sys.argv[1], f"rank{r}.json"), "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
"""


def test_scatter_uneven_all_to_all_splits_and_send_recv_on_three_ranks(tmp_path):
    """A distributed values hunt's findings, on 3 ranks: scatter runs; a list all_to_all whose
    sizes disagree is refused on every rank (it returned uninitialised memory); a split after a
    group that left a rank out returns (two members waited under different keys for ever); a
    process that sent and received exits 0 after destroy_process_group (it aborted)."""
    script = tmp_path / "three.py"
    script.write_text(textwrap.dedent(THREE_RANKS))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3",
                          str(script), str(tmp_path)], capture_output=True, text=True, timeout=TIMEOUT, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "terminate called" not in run.stderr
    for r in range(3):
        got = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert got["scatter"] == [10.0 * r + 1] * 2
        assert got["a2a"] == [[10.0 * j + r] * (j + r + 1) for j in range(3)]
        assert got["a2a_disagree"] == (
            "neuron backend: all_to_all #3 on ranks [0, 1, 2]: rank 0 sends 1 elements to rank 1, which expects 2; "
            "each rank's output_tensor_list[j] must hold as many elements as rank j's input_tensor_list sends it")
        if r < 2:
            assert got["split"] == [3.0, 3.0]
        if r == 1:
            assert got["recv"] == [0.0, 1.0, 2.0, 3.0]
