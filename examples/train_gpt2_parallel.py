"""Train a small GPT-2 across virtual NeuronCores with torch.distributed, unchanged.

One torchrun script, one ``--parallel`` choice per run; the model, data and AdamW steps are the
same in every mode, so each run's losses can be set beside the single-process run's
(``--parallel none``):

    ddp     DistributedDataParallel: each rank a slice of the batch, bucketed all-reduce
    fsdp2   fully_shard per block and at the root: all-gather and reduce-scatter
    zero    DDP with ZeroRedundancyOptimizer: optimizer state sharded, parameters broadcast
    tp      tensor parallel (DeviceMesh + DTensor): q/k/v and fc colwise, projections rowwise,
            and with --sequence-parallel the norms sequence-parallel
    pp      torch.distributed.pipelining: half the blocks per stage, GPipe over micro-batches
    2d      FSDP2 over "dp" x tensor parallel over "tp" (4 ranks: 2 x 2)
    simplefsdp  SimpleFSDP-style compiled FSDP: parameters sharded as DTensors, gathered by a
            parametrization in the forward, torch.compile(backend="neuron") over the model
    none    one process, no torch.distributed (the reference)

Run it with torchrun or with trnsim, which prints one merged report of every rank::

    torchrun --nproc-per-node 2 examples/train_gpt2_parallel.py --parallel ddp
    trnsim run --nproc 2 examples/train_gpt2_parallel.py --parallel fsdp2
    trnsim run --nproc 4 --system trn2.48xlarge examples/train_gpt2_parallel.py --parallel 2d

The GPT-2 is the one of examples/train_gpt2.py (2 blocks, width 64, 4 heads, byte vocabulary,
no dropout) written with plain ``nn.Linear`` layers and separate q/k/v projections, which tensor
parallelism shards head-wise, and an untied output head, which a pipeline stage owns alone.
Rank 0 prints ``step N loss X``; the loss is the global batch's mean in every mode.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt2 import VOCAB, batches  # noqa: E402  (the same corpus and batches)

MODES = ("none", "ddp", "fsdp2", "zero", "tp", "pp", "2d", "simplefsdp")


class Attention(nn.Module):
    def __init__(self, embd: int, heads: int):
        super().__init__()
        self.head_dim = embd // heads
        self.q, self.k, self.v = nn.Linear(embd, embd), nn.Linear(embd, embd), nn.Linear(embd, embd)
        self.proj = nn.Linear(embd, embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism a rank holds its share of the heads
        q, k, v = (m(x).view(b, t, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, embd: int):
        super().__init__()
        self.fc, self.proj = nn.Linear(embd, 4 * embd), nn.Linear(4 * embd, embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, embd: int, heads: int):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(embd), Attention(embd, heads)
        self.ln_2, self.mlp = nn.LayerNorm(embd), MLP(embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Embed(nn.Module):
    def __init__(self, seq: int, embd: int):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, embd), nn.Embedding(seq, embd)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        return self.wte(idx) + self.wpe(pos)


class Head(nn.Module):
    def __init__(self, embd: int):
        super().__init__()
        self.ln_f, self.lm_head = nn.LayerNorm(embd), nn.Linear(embd, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.ln_f(x))


def make_model(seq: int, layers: int = 2, embd: int = 64, heads: int = 4) -> nn.Sequential:
    """Embedding, ``layers`` blocks, final norm and output head, as one Sequential a pipeline
    can cut between blocks."""
    torch.manual_seed(0)
    model = nn.Sequential(Embed(seq, embd), *[Block(embd, heads) for _ in range(layers)], Head(embd))
    for name, p in model.named_parameters():  # GPT-2's init: N(0, 0.02), residual projections scaled
        if p.dim() == 2:
            std = 0.02 / math.sqrt(2 * layers) if name.endswith("proj.weight") else 0.02
            nn.init.normal_(p, 0.0, std)
        elif name.endswith("bias"):
            nn.init.zeros_(p)
    return model


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting each byte from the ones before it."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


# ---- the parallelisms ---------------------------------------------------------------------------


def tp_plan(sequence_parallel: bool) -> dict[str, object]:
    """A block's tensor-parallel plan: q/k/v and fc colwise, the projections rowwise; with
    sequence parallelism the norms run on sequence shards and the projections reduce-scatter."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel)

    col, row = ColwiseParallel(), RowwiseParallel(output_layouts=Shard(1) if sequence_parallel else Replicate())
    plan: dict[str, object] = {"attn.q": col, "attn.k": col, "attn.v": col, "attn.proj": row,
                               "mlp.fc": ColwiseParallel(), "mlp.proj": row}
    if sequence_parallel:
        prep = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        plan.update({"ln_1": SequenceParallel(), "ln_2": SequenceParallel(), "attn": prep, "mlp": prep})
    return plan


def parallelize_tp(model: nn.Sequential, mesh: object, sequence_parallel: bool) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import PrepareModuleInput, PrepareModuleOutput, parallelize_module

    for block in list(model)[1:-1]:
        parallelize_module(block, mesh, tp_plan(sequence_parallel))
    if sequence_parallel:  # the embedding's output enters the blocks sequence-sharded, the head gathers it
        parallelize_module(model[0], mesh, PrepareModuleOutput(output_layouts=(Replicate(),),
                                                                desired_output_layouts=(Shard(1),)))
        parallelize_module(model[-1], mesh, PrepareModuleInput(input_layouts=(Shard(1),),
                                                                desired_input_layouts=(Replicate(),),
                                                                use_local_output=True))


class ReplicateComputation(nn.Module):
    """SimpleFSDP's parametrization (torchtitan's ``simple_fsdp``): a parameter is stored as a
    DTensor sharded over the data-parallel mesh and all-gathered where the forward uses it; its
    gradient comes back through the same redistribution as a reduce-scatter (averaged). Under
    torch.compile the collectives are traced into the graph with the compute."""

    def __init__(self, mesh: object):
        super().__init__()
        self.mesh = mesh

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        from torch.distributed.tensor import Partial, Replicate

        return w.redistribute(self.mesh, [Replicate()]).to_local(grad_placements=[Partial("avg")])


def simple_fsdp(model: nn.Module, mesh: object) -> None:
    """Shard every parameter of ``model`` over ``mesh`` (dim 0) behind a ReplicateComputation."""
    import torch.nn.utils.parametrize as parametrize
    from torch.distributed.tensor import Shard, distribute_tensor

    for module in list(model.modules()):
        for name, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, nn.Parameter(distribute_tensor(p.data, mesh, [Shard(0)])))
            parametrize.register_parametrization(module, name, ReplicateComputation(mesh), unsafe=True)


def train(mode: str, steps: int, batch: int, seq: int, device: str, microbatches: int = 2,
          sequence_parallel: bool = False) -> list[float]:
    """``steps`` AdamW steps of the GPT-2 in ``mode``; returns the global batch's losses (every
    rank gets them)."""
    import torch.distributed as dist

    model = make_model(seq)
    rank, world = (dist.get_rank(), dist.get_world_size()) if mode != "none" else (0, 1)
    params: list[nn.Parameter]
    stage_model: nn.Module = model
    schedule = None
    dp = world if mode in ("ddp", "fsdp2", "zero", "simplefsdp") else 2 if mode == "2d" else 1
    dp_rank = rank % dp if mode != "2d" else rank // 2
    if batch % dp:
        raise SystemExit(f"train_gpt2_parallel.py: --batch {batch} does not split over {dp} data-parallel ranks")
    if mode == "none":
        stage_model = model.to(device)
    elif mode == "ddp" or mode == "zero":
        from torch.nn.parallel import DistributedDataParallel as DDP

        stage_model = DDP(model.to(device))
    elif mode == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("neuron", (world,))
        model.to(device)
        for block in list(model)[1:-1]:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif mode == "simplefsdp":
        from torch.distributed.device_mesh import init_device_mesh

        model.to(device)
        simple_fsdp(model, init_device_mesh("neuron", (world,)))
        stage_model = torch.compile(model, backend="neuron")
    elif mode == "tp":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("neuron", (world,))
        model.to(device)
        parallelize_tp(model, mesh, sequence_parallel)
    elif mode == "2d":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if world != 4:
            raise SystemExit(f"train_gpt2_parallel.py: --parallel 2d runs on 4 ranks (2 dp x 2 tp), got {world}")
        mesh = init_device_mesh("neuron", (2, 2), mesh_dim_names=("dp", "tp"))
        model.to(device)
        parallelize_tp(model, mesh["tp"], sequence_parallel)
        for block in list(model)[1:-1]:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif mode == "pp":
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        layers = list(model)
        cut = 1 + (len(layers) - 2) // 2 if world == 2 else None
        if cut is None:
            raise SystemExit(f"train_gpt2_parallel.py: --parallel pp runs on 2 ranks (2 stages), got {world}")
        stage_model = nn.Sequential(*(layers[:cut] if rank == 0 else layers[cut:])).to(device)
        stage = PipelineStage(stage_model, rank, world, torch.device(device))
        schedule = ScheduleGPipe(stage, microbatches, loss_fn=next_token_loss)
    params = list(stage_model.parameters())
    if mode == "zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer

        opt: torch.optim.Optimizer = ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=3e-3,
                                                             weight_decay=0.01)
    else:
        # tensor-parallel layers hold DTensors beside plain tensors: the multi-tensor (foreach)
        # AdamW cannot mix them, so those modes step each parameter alone (the same arithmetic)
        opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01, foreach=mode not in ("tp", "2d"))
    losses = []
    for step, x in enumerate(batches(batch, seq, steps), start=1):
        if mode == "pp":
            x = x.to(device)
            if rank == 0:
                schedule.step(x)  # type: ignore[union-attr]
                loss = torch.zeros((), device=device)
            else:
                mb: list[torch.Tensor] = []
                schedule.step(target=x, losses=mb)  # type: ignore[union-attr]
                loss = torch.stack(mb).mean().detach()
            dist.broadcast(loss, src=world - 1)
        else:
            part = x.chunk(dp)[dp_rank].to(device)
            loss = next_token_loss(stage_model(part), part)
            loss.backward()
            loss = loss.detach()
            if dp > 1:  # the global batch's mean: the data-parallel ranks' means, averaged
                group = mesh["dp"].get_group() if mode == "2d" else None
                dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.item()))
        if rank == 0:
            print(f"step {step:>3}  loss {losses[-1]:.6f}", flush=True)
    return losses


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parallel", choices=MODES, default="ddp", help="how to split the work (default ddp)")
    p.add_argument("--steps", type=int, default=8, help="AdamW steps (default 8)")
    p.add_argument("--batch", type=int, default=8, help="sequences per global batch (default 8)")
    p.add_argument("--seq", type=int, default=32, help="bytes per sequence (default 32)")
    p.add_argument("--microbatches", type=int, default=2, help="pipeline micro-batches (default 2)")
    p.add_argument("--sequence-parallel", action="store_true", help="tp/2d: run the norms sequence-parallel")
    args = p.parse_args(argv)
    for name in ("steps", "batch", "seq", "microbatches"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be a positive integer, got {getattr(args, name)}")
    if args.parallel != "none" and not all(v in os.environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        p.error(f"--parallel {args.parallel} runs one process per rank: start it with torchrun --nproc-per-node 2 "
                f"or trnsim run --nproc 2 (or use --parallel none)")
    if args.parallel != "none":
        import torch.distributed as dist

        dist.init_process_group("neuron")
    try:
        train(args.parallel, args.steps, args.batch, args.seq, "neuron", args.microbatches, args.sequence_parallel)
    finally:
        if args.parallel != "none":
            import torch.distributed as dist

            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
