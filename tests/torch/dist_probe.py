"""A torchrun script for tests/torch/test_distributed.py: every rank makes the calls below on
the neuron backend and writes what it saw (values, timeline ticks, errors) to OUT_DIR/rank<r>.json.

    trnsim run --nproc 2 tests/torch/dist_probe.py OUT_DIR
"""

import json
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from torch_bridge.distributed import NeuronDistError

dist.init_process_group()  # no backend named: the device-to-backend table picks neuron
r, w = dist.get_rank(), dist.get_world_size()
out: dict = {"rank": r, "group": type(dist.group.WORLD).__name__, "values": {}, "errors": {}, "events": {}}
dev = "neuron"


def events(scope: torch.neuron.report_scope) -> list:
    return [(e.op, e.stream, e.start, e.end) for e in scope.report.events]


# ---- values ------------------------------------------------------------------------------------
v = out["values"]
x = torch.full((4,), float(r + 1), device=dev)
dist.all_reduce(x)
v["all_reduce"] = x.cpu().tolist()
y = torch.full((4,), float(r + 1), device=dev)
dist.all_reduce(y, op=dist.ReduceOp.AVG, async_op=True).wait()
v["all_reduce_avg"] = y.cpu().tolist()
m = torch.full((2,), float(r), device=dev)
dist.all_reduce(m, op=dist.ReduceOp.MAX)
v["all_reduce_max"] = m.cpu().tolist()
b = torch.arange(3.0, device=dev) * (r + 1)
dist.broadcast(b, src=1)
v["broadcast"] = b.cpu().tolist()
ag = torch.empty(2 * w, device=dev)
dist.all_gather_into_tensor(ag, torch.full((2,), float(r), device=dev))
v["all_gather_into_tensor"] = ag.cpu().tolist()
lst = [torch.empty(2, device=dev) for _ in range(w)]
dist.all_gather(lst, torch.full((2,), float(r), device=dev))
v["all_gather"] = [t.cpu().tolist() for t in lst]
rs = torch.empty(2, device=dev)
dist.reduce_scatter_tensor(rs, torch.arange(2.0 * w, device=dev) * (r + 1), op=dist.ReduceOp.AVG)
v["reduce_scatter_tensor_avg"] = rs.cpu().tolist()
rsl = torch.empty(2, device=dev)
dist.reduce_scatter(rsl, [torch.full((2,), float(r + k), device=dev) for k in range(w)])
v["reduce_scatter"] = rsl.cpu().tolist()
# uneven splits: rank r sends r + 1 elements to each peer
send = torch.arange(float((r + 1) * w), device=dev) + 100 * r
recv = torch.empty(sum(k + 1 for k in range(w)), device=dev)
dist.all_to_all_single(recv, send, output_split_sizes=[k + 1 for k in range(w)], input_split_sizes=[r + 1] * w)
v["all_to_all_single_uneven"] = recv.cpu().tolist()
a2a = [torch.empty(1, device=dev) for _ in range(w)]
dist.all_to_all(a2a, [torch.full((1,), float(10 * r + k), device=dev) for k in range(w)])
v["all_to_all"] = [t.cpu().tolist() for t in a2a]
sc = torch.empty(2, device=dev)
dist.scatter(sc, [torch.full((2,), float(k), device=dev) for k in range(w)] if r == 0 else None, src=0)
v["scatter"] = sc.cpu().tolist()
g = [torch.empty(2, device=dev) for _ in range(w)] if r == 0 else None
dist.gather(torch.full((2,), float(r), device=dev), g, dst=0)
v["gather"] = [t.cpu().tolist() for t in g] if g else None
rd = torch.full((2,), float(r + 1), device=dev)
dist.reduce(rd, dst=0)
v["reduce_root"] = rd.cpu().tolist() if r == 0 else None
coalesced = [torch.full((2,), float(r + 1), device=dev), torch.full((3,), float(r), device=dev)]
dist.all_reduce_coalesced(coalesced)
v["all_reduce_coalesced"] = [t.cpu().tolist() for t in coalesced]
ring_in, ring_out = torch.full((2,), float(r), device=dev), torch.empty(2, device=dev)
ops = [dist.P2POp(dist.irecv, ring_out, (r - 1) % w), dist.P2POp(dist.isend, ring_in, (r + 1) % w)]  # recv first
for work in dist.batch_isend_irecv(ops):
    work.wait()
v["batch_isend_irecv"] = ring_out.cpu().tolist()
objs = [None] * w
dist.all_gather_object(objs, {"rank": r})
v["all_gather_object"] = objs
fut = dist.all_reduce(torch.ones(2, device=dev), async_op=True).get_future()
v["future"] = [t.cpu().tolist() for t in fut.wait()]
v["funcol_all_reduce"] = funcol.all_reduce(torch.full((2,), float(r + 1), device=dev), "sum",
                                           dist.group.WORLD).cpu().tolist()
mesh = init_device_mesh("neuron", (w,))
d = distribute_tensor(torch.arange(4.0 * w).reshape(2 * w, 2), mesh, [Shard(0)])
v["dtensor_full"] = d.redistribute(mesh, [Replicate()]).to_local().cpu().tolist()
dist.barrier(device_ids=[0])

# ---- time: a collective alone, as trnsim collective simulates it -------------------------------
torch.neuron.synchronize()
big = torch.ones(1 << 19, device=dev)  # 2 MiB of fp32
with torch.neuron.report_scope(trace=True) as s:
    dist.all_reduce(big)
    torch.neuron.synchronize()
out["events"]["alone"] = events(s)
out["alone_row"] = [(row.op, row.kernel, row.collective.bytes, row.collective.network_us)
                    for row in s.report.rows if row.collective]

# ---- an async all-reduce overlaps the compute issued after it ----------------------------------
a = torch.randn(1024, 1024, device=dev)
huge = torch.ones(8 << 20, device=dev)  # 32 MiB: longer than the host takes to issue the matmul
torch.neuron.synchronize()
with torch.neuron.report_scope(trace=True) as s:
    work = dist.all_reduce(huge, async_op=True)
    c = a @ a  # issued after the collective: runs beside it
    work.wait()
    after = huge[:4] + 1  # after wait(): the stream waits for the collective
    torch.neuron.synchronize()
out["events"]["overlap"] = events(s)

# ---- skew: rank 1 arrives late, rank 0 waits for it --------------------------------------------
torch.neuron.synchronize()
with torch.neuron.report_scope(trace=True) as s:
    if r == 1:
        for _ in range(4):
            c = a @ a
    dist.all_reduce(big)
    torch.neuron.synchronize()
out["events"]["skew"] = events(s)
out["skew_peer_wait_us"] = [row.collective.peer_wait_us for row in s.report.rows if row.collective]

# ---- ranks that disagree: every rank raises the same one-line error, and the group goes on -----
for name, call in {
    "shapes": lambda: dist.all_reduce(torch.ones(4 if r == 0 else 5, device=dev)),
    "ops": lambda: dist.all_reduce(torch.ones(4, device=dev)) if r == 0 else dist.broadcast(torch.ones(4, device=dev), 0),
    "roots": lambda: dist.broadcast(torch.ones(4, device=dev), src=r),
    "dtypes": lambda: dist.all_reduce(torch.ones(4, device=dev, dtype=torch.float32 if r == 0 else torch.bfloat16)),
    "send_recv": lambda: (dist.send(torch.ones(3, device=dev), 1) if r == 0 else dist.recv(torch.empty(4, device=dev), 0)),
    # rank 0 sends 2 rows to rank 1, which expects 1 (gloo aborted the process in C++)
    "splits": lambda: dist.all_to_all_single(torch.empty(2, device=dev), torch.ones(3 - r, device=dev), [1, 1],
                                             [[1, 2], [1, 1]][r]),
    # rank 0 gives three input splits for two ranks (gloo refused it on rank 0 alone; rank 1 waited)
    "split_count": lambda: dist.all_to_all_single(torch.empty(2, device=dev), torch.ones(2, device=dev), [1, 1],
                                                  [1, 1, 0] if r == 0 else [1, 1]),
}.items():
    try:
        call()
        out["errors"][name] = None
    except NeuronDistError as e:
        out["errors"][name] = str(e)
try:  # a root past the group's ranks: gloo's own refusal, made before any rank exchanges (was an IndexError)
    dist.broadcast(torch.ones(4, device=dev), src=5)
except ValueError as e:
    out["errors"]["bad_root"] = str(e)
ok = torch.ones(2, device=dev)
dist.all_reduce(ok)
v["after_errors"] = ok.cpu().tolist()

with open(f"{sys.argv[1]}/rank{r}.json", "w") as f:
    json.dump(out, f)
dist.destroy_process_group()
