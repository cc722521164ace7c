"""What every timing-only estimate shares (inference, serving with kernels, training): the ranks
it simulates (a cached device model, an HBM ledger, collectives, a timing-only run), the stage of
the model each one runs, the send/recv time between pipeline stages, and the loop that runs each
distinct role once. torch_bridge.timing.estimate, .estimate_kernels and .train_step build on it.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from trnsim.config import ConfigError, SystemConfig
from trnsim.device import no_work
from trnsim.device.costcache import CachedDevice, CostCache
from trnsim.workload.models import ModelConfig
from trnsim.workload.plan import Plan, Role, RoleMemory, check_sizes

from . import models
from .fake import Ledger, Target, TimingOnly
from .parallel import Comm, Shard

__all__ = ["DTYPES", "EstimateError", "dtype_of", "positive", "Rank", "make_rank", "stage_model", "scope",
           "send_recv_ticks", "stage_roles", "with_layers", "simulate_roles", "torch_dtype_name"]

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class EstimateError(ConfigError):
    """An estimate that cannot run as asked (one line)."""


def dtype_of(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise EstimateError(f"--dtype {name}: expected one of {', '.join(DTYPES)}")
    return DTYPES[name]


def positive(name: str, v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise EstimateError(f"{name} {v!r}: expected a positive whole number")
    return v


@dataclass
class Rank:
    """One simulated role: its device model, HBM ledger, collectives and timing-only run."""

    role: Role
    device: CachedDevice
    ledger: Ledger
    comm: Comm
    run: TimingOnly
    dispatch: int

    def step_start(self) -> int:
        """One graph launch: the host dispatches the step once; returns the step's start tick."""
        dev = self.device
        dev.synchronize(0)
        start = dev.now(0)
        dev.dispatch = self.dispatch
        dev.launch(0, "graph launch", no_work("one host dispatch per step"))
        dev.dispatch = 0
        return start

    def step_end(self, start: int) -> int:
        self.device.synchronize(0)
        return self.device.now(0) - start


def make_rank(role: Role, system: SystemConfig, plan: Plan, cache: CostCache,
               reports: dict[tuple[Any, ...], Any]) -> Rank:
    cfg = system.chip
    dev = CachedDevice(cfg, cache)
    dispatch, dev.dispatch = dev.dispatch, 0  # launches inside a step cost no dispatch (one graph)
    ledger = Ledger(cfg.logical_cores, cfg.chip.hbm.capacity // cfg.logical_cores)
    comm = Comm(system, dev, 0, role.rank, plan, reports)
    target = Target(dev, 0, ledger, attention_keeps_probabilities=False)  # flash attention's memory
    return Rank(role, dev, ledger, comm, TimingOnly(target), dispatch)


def stage_model(spec: ModelConfig, role: Role, plan: Plan, comm: Comm, dtype: torch.dtype, last: bool,
                 gather_logits: bool = True, then: Any = None, attention: str | None = None) -> nn.Module:
    """The stage's model: its decoder layers, the embedding on the first stage, the final norm
    and LM head on the last; sharded for the rank before its weights get storage (the LM head's
    logits all-gathered over the vocabulary unless ``gather_logits`` is False)."""
    lo, hi = role.layers
    shard = Shard(plan, comm, role)
    shard.gather_logits = gather_logits

    def trim(net: nn.Module) -> nn.Module:
        base = getattr(net, net.base_model_prefix, net)
        if not role.first:
            base.embed_tokens = nn.Identity()  # activations arrive from the previous stage
        if not last:
            base.norm = nn.Identity()
        net = shard(net)
        return then(net) if then is not None else net  # more sharding (expert parallelism), still on meta

    return models.from_config(spec, dtype, layers=hi - lo, head=last, shard=trim, attention=attention or models.ATTENTION)


@contextlib.contextmanager
def scope(dev: CachedDevice, trace: bool) -> Iterator[list[Any]]:
    rec = dev.open_scope(trace)
    out: list[Any] = []
    try:
        yield out
    finally:
        out.append(dev.close_scope(rec))


def send_recv_ticks(system: SystemConfig, plan: Plan, nbytes: int, reports: dict[tuple[Any, ...], Any],
                     dtype: str) -> list[int]:
    """Per stage boundary: the ticks to send ``nbytes`` of activations from the simulated rank
    of stage s to its peer on stage s + 1."""
    from trnsim.collectives import simulate_collective

    out = []
    for s in range(plan.pp - 1):
        a, b = plan.rank(0, s, 0), plan.rank(0, s + 1, 0)
        key = ("send-recv", nbytes, (a, b), dtype)
        rep = reports.get(key)
        if rep is None:
            rep = reports[key] = simulate_collective(system, "send-recv", nbytes, group=[a, b], dtype=dtype)
        out.append(rep.time_ticks)
    return out


def stage_roles(plan: Plan, layers: int) -> list[tuple[Role, bool, int]]:
    """(role, is last stage, index of the role it repeats) for each stage: stages with the same
    layers, neither first nor last, run the same program and are simulated once."""
    roles = plan.roles(layers)
    out: list[tuple[Role, bool, int]] = []
    seen: dict[tuple[bool, bool, int], int] = {}
    for i, r in enumerate(roles):
        last = i == len(roles) - 1
        key = (r.first, last, r.layers[1] - r.layers[0])
        out.append((r, last, seen.setdefault(key, i)))
    return out


def with_layers(spec: ModelConfig, layers: int | None) -> ModelConfig:
    if layers is None:
        return spec
    positive("--layers", layers)
    check_sizes(spec, layers=layers)
    return spec.with_layers(layers)


def simulate_roles(spec: ModelConfig, system: SystemConfig, plan: Plan, cache: CostCache,
                    reports: dict[tuple[Any, ...], Any], run: Any, refused: list[str]
                    ) -> tuple[dict[int, dict[str, Any]], list[Any], list[RoleMemory], int]:
    """``run(rank, is_last_stage)`` once per distinct role, on a rank of its own; returns the
    results per stage (repeated roles share theirs), the traces, each simulated role's memory
    and the kernels simulated. Library kernels that refused their shape (costed as the generic
    kernel instead) are added to ``refused`` as an assumption line each."""
    results: dict[int, dict[str, Any]] = {}
    traces: list[Any] = []
    memory: list[RoleMemory] = []
    kernels = 0
    for role, last, same in stage_roles(plan, spec.layers):
        if same in results:
            results[role.stage] = results[same]
            continue
        rank = make_rank(role, system, plan, cache, reports)
        res = run(rank, last)
        results[role.stage] = res
        traces.extend(res.pop("traces"))
        memory.append(res["memory"])
        kernels += rank.device.simulated
        for sp in rank.device.refused():
            line = (f"library kernel {sp.kernel} {sp.dtype} {'x'.join(map(str, sp.shape))} refused its shape: costed "
                    f"as the generic streaming kernel (an underestimate)")
            if line not in refused:
                refused.append(line)
    return results, traces, memory, kernels


def torch_dtype_name(dt: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dt]
