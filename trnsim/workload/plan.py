"""Estimates of LLM inference and training on a whole system, as data (torch-free).

The runs are in :mod:`torch_bridge.estimate` (they need PyTorch and transformers); this module
holds what they return, the pipeline schedule that combines the simulated stages, and how a
step's launches are summarised. The CLI renders these (``trnsim estimate``).

Conventions:

* **TTFT** is the prefill of the prompt: from the step's one host dispatch to its last kernel
  (and the sampling of the first token) on the slowest path through the pipeline stages.
* **TPOT** is the mean time of the decode steps that produce tokens 2..N, each one token per
  sequence of the batch over a KV cache of the prompt plus the tokens so far; the mean is over
  every step (decode steps are simulated at a few KV lengths and interpolated linearly between
  them, since a step's time grows with its KV cache).
* **tokens/s** per request is ``output / (TTFT + (output - 1) x TPOT)``; the system's is that
  times the batch and the data-parallel replicas.
* A **step breakdown** sorts the simulated rank's launches by kind (matmul, attention,
  collectives, copies, elementwise) and by what bounds them: a compute engine, HBM (the DMA
  queues), a collective, or the device waiting on the host.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from ..config import ConfigError, SystemConfig
from ..cores.base import datapath_engines

__all__ = ["Plan", "PlanError", "Role", "check_batch", "check_plan", "check_sizes", "position_limit", "weight_bytes_floor",
           "MAX_DECODE_SAMPLES", "MAX_MICRO_BATCHES", "OpKind", "StepReport", "RoleMemory", "InferenceEstimate", "TrainEstimate", "pipeline_1f1b",
           "mean_decode", "summarise", "KINDS", "COLLECTIVE_OPS"]

# ---- the parallelism plan ------------------------------------------------------------------------
class PlanError(ConfigError):
    """A parallelism plan that does not fit the system or the model (one line)."""


@dataclass(frozen=True)
class Role:
    """One distinct program of a plan: pipeline stage ``stage`` (its ``layers`` range), run by
    ``ranks`` ranks; ``rank`` is the one simulated."""

    stage: int
    layers: tuple[int, int]  # [first, last) decoder layers
    rank: int
    ranks: int

    @property
    def first(self) -> bool:
        return self.stage == 0


@dataclass(frozen=True)
class Plan:
    """``tp x pp x dp`` ranks on a system's logical NeuronCores, tensor-parallel ranks innermost (a
    TP group fills whole chips first, as Neuron's libraries place it): rank = ``(dp_i * pp +
    pp_i) * tp + tp_i``. ``sp`` turns on sequence parallelism over the TP group."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    sp: bool = False

    @property
    def size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, dp_i: int, pp_i: int, tp_i: int) -> int:
        return (dp_i * self.pp + pp_i) * self.tp + tp_i

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(dp_i, pp_i, tp_i) of ``rank``."""
        return rank // (self.pp * self.tp), (rank // self.tp) % self.pp, rank % self.tp

    def tp_group(self, rank: int) -> list[int]:
        d, p, _ = self.coords(rank)
        return [self.rank(d, p, t) for t in range(self.tp)]

    def dp_group(self, rank: int) -> list[int]:
        _, p, t = self.coords(rank)
        return [self.rank(d, p, t) for d in range(self.dp)]

    def stage_rank(self, rank: int, stage: int) -> int:
        """The rank of pipeline stage ``stage`` that ``rank``'s activations go to / come from."""
        d, _, t = self.coords(rank)
        return self.rank(d, stage, t)

    def stages(self, layers: int) -> list[tuple[int, int]]:
        """The decoder layers of each pipeline stage: as even as possible, earlier stages first."""
        base, extra = divmod(layers, self.pp)
        out, lo = [], 0
        for s in range(self.pp):
            n = base + (1 if s < extra else 0)
            out.append((lo, lo + n))
            lo += n
        return out

    def roles(self, layers: int) -> list[Role]:
        """One role per pipeline stage (each simulated by its first rank of DP replica 0)."""
        return [Role(s, rng, self.rank(0, s, 0), self.tp * self.dp) for s, rng in enumerate(self.stages(layers))]

    def check(self, system: SystemConfig, layers: int) -> None:
        for name, v in (("--tp", self.tp), ("--pp", self.pp), ("--dp", self.dp)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise PlanError(f"{name} {v!r}: expected a positive whole number of ranks")
        if self.size > system.ranks:
            raise PlanError(
                f"--tp {self.tp} x --pp {self.pp} x --dp {self.dp} = {self.size} ranks, but {system.name} has "
                f"{system.ranks} ({system.chips} chips x {system.ranks_per_chip} logical cores); use a bigger system "
                f"(e.g. --system trn2-ultraserver, or --set topology.efa.size=N for N instances)")
        if self.pp > layers:
            raise PlanError(f"--pp {self.pp}: the model has {layers} decoder layers, fewer than the pipeline stages")


#: bytes per element of the estimate's dtypes
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
#: decode steps simulated along the output at most: the steps between them are interpolated, and
#: each one simulated is a whole forward pass of the stage
MAX_DECODE_SAMPLES = 64
#: micro-batches per data-parallel replica and step at most: the 1F1B schedule is simulated task
#: by task (micro-batches x stages x 2), a few seconds at this many
MAX_MICRO_BATCHES = 4096


def weight_bytes_floor(model: Any, dtype: str = "bf16") -> int:
    """A lower bound of ``model``'s weights in bytes (the attention projections, two of the MLP's
    matrices and the embedding; biases, norms, a third MLP matrix and experts beyond the first
    left out), for refusing a model no system holds before any of it is built."""
    f = model.fields
    h, hd = model.hidden, model.head_dim
    inter = f.get("intermediate_size") if isinstance(f.get("intermediate_size"), int) else 0
    vocab = f.get("vocab_size") if isinstance(f.get("vocab_size"), int) else 0
    per_layer = 2 * h * model.heads * hd + 2 * h * model.kv_heads * hd + 2 * h * inter
    return (model.layers * per_layer + vocab * h) * DTYPE_BYTES.get(dtype, 2)


def check_plan(model: Any, system: SystemConfig, tp: int, pp: int, dp: int, dtype: str = "bf16") -> None:
    """The plan's checks against the system (:meth:`Plan.check`) and the model (a
    :class:`trnsim.models.ModelConfig`: heads split evenly, KV heads split or replicated, and its
    weights, at least :func:`weight_bytes_floor` over the TP x PP ranks that hold them, within a
    logical core's HBM)."""
    from ..config import format_quantity

    plan = Plan(tp, pp, dp)
    plan.check(system, model.layers)
    per_core = system.chip.chip.hbm.capacity // system.ranks_per_chip
    weights = weight_bytes_floor(model, dtype) // (tp * pp)
    if weights > per_core:
        raise PlanError(f"{model.name} ({model.layers:,} layers, hidden {model.hidden:,}, {dtype}): its weights need "
                        f"at least {format_quantity(weights, 'bytes')} on each of the --tp {tp} x --pp {pp} ranks "
                        f"holding them, more than a logical core's {format_quantity(per_core, 'bytes')} of HBM on "
                        f"{system.name}; shard it over more ranks (--tp, --pp) or run fewer --layers")
    if tp > 1:
        if model.heads % tp:
            raise PlanError(f"--tp {tp}: {model.name} has {model.heads} attention heads, not a multiple of {tp}")
        if model.kv_heads % tp and tp % model.kv_heads:
            raise PlanError(f"--tp {tp}: {model.name}'s {model.kv_heads} KV heads neither divide nor are divided "
                            f"by {tp}")


def check_batch(model: Any, system: SystemConfig, tp: int, pp: int, dtype: str = "bf16", *,
                batch: int | None = None, tokens: int | None = None, micro_batch: int | None = None,
                seq: int | None = None) -> None:
    """The batch options against a logical core's HBM, before anything is built: an inference's
    KV cache (``batch`` x ``tokens`` = input + output, K and V, the largest stage's layers and a
    rank's KV heads) or a training micro-batch's hidden state (``micro_batch`` x ``seq`` x
    hidden) must fit, each counted as a lower bound of what the run allocates. A batch beyond it
    was built first and failed later: out of memory, or (past 2^63 elements) an overflow in
    PyTorch with a traceback. Positive integers; one-line :class:`PlanError` naming the option."""
    from ..config import format_quantity

    per_core = system.chip.chip.hbm.capacity // system.ranks_per_chip
    width = DTYPE_BYTES.get(dtype, 2)
    if batch is not None and tokens is not None:
        layers = -(-model.layers // pp)
        need = 2 * batch * tokens * max(1, model.kv_heads // tp) * model.head_dim * layers * width
        if need > per_core:
            raise PlanError(f"--batch {batch:,}: the KV cache of {batch:,} x {tokens:,} tokens needs at least "
                            f"{format_quantity(need, 'bytes')} on each rank, more than a logical core's "
                            f"{format_quantity(per_core, 'bytes')} of HBM on {system.name}; a smaller --batch, "
                            f"or shard it (--tp, --pp)")
    if micro_batch is not None and seq is not None:
        need = micro_batch * seq * model.hidden * width
        if need > per_core:
            raise PlanError(f"--micro-batch {micro_batch:,}: one hidden state of {micro_batch:,} x {seq:,} tokens "
                            f"needs {format_quantity(need, 'bytes')}, more than a logical core's "
                            f"{format_quantity(per_core, 'bytes')} of HBM on {system.name}; a smaller --micro-batch "
                            f"(--global-batch accumulates micro-batches)")


def position_limit(model: Any, max_positions: int | None = None) -> tuple[int | None, str]:
    """(the most positions a sequence may take, what sets it): ``model``'s
    ``max_position_embeddings``, or ``max_positions`` - the serving framework's own limit where a
    published run set one (transformers-neuronx's ``n_positions``, NxDI's ``seq_len``). Rotary
    positions are computed, not looked up, so a RoPE model (``rope_theta`` in its config) runs
    past its config's figure at the same cost per token; a model without one (learned position
    embeddings: a table of that many rows) is refused beyond it. One-line :class:`PlanError`."""
    limit = model.fields.get("max_position_embeddings")
    limit = limit if isinstance(limit, int) and not isinstance(limit, bool) else None
    if max_positions is None:
        return limit, f"{model.name}'s max_position_embeddings {limit}"
    if isinstance(max_positions, bool) or not isinstance(max_positions, int) or max_positions < 1:
        raise PlanError(f"--max-positions {max_positions!r}: expected a positive whole number of positions")
    if limit is not None and max_positions > limit and "rope_theta" not in model.fields:
        raise PlanError(f"--max-positions {max_positions:,}: beyond {model.name}'s max_position_embeddings "
                        f"{limit:,}, and its config has no rotary positions (rope_theta) to run past a learned "
                        f"position table")
    return max_positions, f"--max-positions {max_positions}"


def check_sizes(model: Any, *, layers: int | None = None, input_tokens: int | None = None,
                output_tokens: int | None = None, samples: int | None = None, seq: int | None = None,
                micro_batches: int | None = None, max_positions: int | None = None) -> None:
    """The size-like options of an estimate against what ``model`` allows (its decoder layers,
    its ``max_position_embeddings`` or the serving framework's ``max_positions``,
    :func:`position_limit`) and what a run can simulate in reasonable time
    (:data:`MAX_DECODE_SAMPLES`, :data:`MAX_MICRO_BATCHES`); each given as a positive integer.
    One-line :class:`PlanError` naming the option as the CLI spells it."""
    if layers is not None and layers > model.layers:
        raise PlanError(f"--layers {layers:,}: {model.name} has {model.layers} decoder layers; expected 1.."
                        f"{model.layers} (--layers runs a shorter model)")
    limit, what = position_limit(model, max_positions)
    if input_tokens is not None and output_tokens is not None and limit is not None \
            and input_tokens + output_tokens > limit:
        hint = "" if max_positions is not None else " (a serving framework's larger position limit: --max-positions)"
        raise PlanError(f"--input {input_tokens} + --output {output_tokens} = {input_tokens + output_tokens} "
                        f"tokens, more than {what}{hint}")
    if seq is not None and limit is not None and seq > limit:
        raise PlanError(f"--seq {seq}: more tokens than {what}")
    if samples is not None and samples > MAX_DECODE_SAMPLES:
        raise PlanError(f"--samples {samples:,}: expected 1..{MAX_DECODE_SAMPLES} decode steps simulated (the "
                        f"others are interpolated between them)")
    if micro_batches is not None and micro_batches > MAX_MICRO_BATCHES:
        raise PlanError(f"--global-batch: {micro_batches:,} micro-batches per data-parallel replica and step; at most "
                        f"{MAX_MICRO_BATCHES:,} (the pipeline schedule is simulated task by task)")


#: what a launch's op is, for a step's breakdown
KINDS = ("matmul", "quantize", "attention", "collectives", "copies", "elementwise")
COLLECTIVE_OPS = frozenset({"all_reduce", "all_gather", "reduce_scatter", "send_recv", "all_to_all", "broadcast",
                            "permute"})
_MATMUL_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "convolution", "convolution_backward"})
#: library kernels a lowered layer launches (torch_bridge.nxdi), by kind
_KERNEL_KINDS = {"qkv": "matmul", "oproj": "matmul", "mlp": "matmul", "moe": "matmul", "moe_tkg": "matmul",
                 "router_topk": "matmul", "matmul": "matmul", "matmul_mx": "matmul", "mx_quantize": "quantize",
                 "attention_tkg": "attention",
                 "attention_cte": "attention"}


def kind_of(op: str) -> str:
    if op in COLLECTIVE_OPS:
        return "collectives"
    if op in _MATMUL_OPS:
        return "matmul"
    if op in _KERNEL_KINDS:
        return _KERNEL_KINDS[op]
    if op.startswith("scaled_dot_product_attention"):
        return "attention"
    if op in ("_copy_from", "copy_", "_to_copy", "cat", "index_copy", "index_copy_"):
        return "copies"
    return "elementwise"


@dataclass(frozen=True)
class OpKind:
    """One kind of launch in a step: its calls, time (device time of its kernels, ms), share of
    the step's device time, and the resource that bounds most of that time."""

    kind: str
    calls: int
    time_ms: float
    share_percent: float
    bound: str


@dataclass(frozen=True)
class StepReport:
    """One simulated step on one rank (a prefill, a decode step, a training micro-batch).

    ``time_ms`` is the step's elapsed simulated time on the rank; ``compute_ms``/``memory_ms``/
    ``collective_ms`` split its device time by what bounds each launch (an engine; the DMA queues
    and HBM; a collective's links and DMA), ``idle_ms`` is the rest of the step (the device
    waiting on the host or on nothing). ``ops`` are the busiest (op, kernel) rows."""

    time_ms: float
    launches: int
    compute_ms: float
    memory_ms: float
    collective_ms: float
    idle_ms: float
    bound: str
    kinds: tuple[OpKind, ...]
    ops: tuple[tuple[str, str, int, float, str], ...]  # (op, kernel, calls, time ms, bound)
    collectives: tuple[tuple[str, str, int, float], ...]  # (op, algorithm, calls, time ms)
    hbm_bytes: int
    matmul_flops: int

    @property
    def device_ms(self) -> float:
        return self.compute_ms + self.memory_ms + self.collective_ms


def summarise(report: Any, time_ticks: int, top: int = 12) -> StepReport:
    """A :class:`trnsim.report.RunReport` of one step (``time_ticks`` long) as a StepReport."""
    hz = report.tick_hz
    by_kind: dict[str, dict[str, Any]] = {}
    compute = memory = coll = 0.0
    colls: dict[tuple[str, str], list[float]] = {}
    for r in report.rows:
        k = kind_of(r.op)
        a = by_kind.setdefault(k, {"calls": 0, "us": 0.0, "bounds": {}})
        a["calls"] += r.calls
        a["us"] += r.time_us
        bound = "collective" if k == "collectives" else r.bound
        a["bounds"][bound] = a["bounds"].get(bound, 0.0) + r.time_us
        if k == "collectives":
            coll += r.time_us
            c = colls.setdefault((r.op, r.kernel.split(":")[-1]), [0, 0.0])
            c[0] += r.calls
            c[1] += r.time_us
        elif r.bound in datapath_engines():  # bound by an engine's compute, not memory
            compute += r.time_us
        else:
            memory += r.time_us
    device = sum(a["us"] for a in by_kind.values())
    kinds = tuple(OpKind(k, a["calls"], a["us"] / 1e3, 100.0 * a["us"] / device if device else 0.0,
                         max(a["bounds"], key=lambda b: a["bounds"][b]) if a["bounds"] else "")
                  for k in KINDS if (a := by_kind.get(k)) is not None)
    step_ms = time_ticks / hz * 1e3
    parts = {"compute": compute, "HBM": memory, "collectives": coll}
    bound = max(parts, key=lambda p: parts[p]) if device else "none"
    ops = tuple((r.op, r.kernel, r.calls, r.time_us / 1e3, r.bound) for r in report.rows[:top])
    return StepReport(step_ms, report.launches, compute / 1e3, memory / 1e3, coll / 1e3,
                      max(0.0, step_ms - device / 1e3), bound, kinds, ops,
                      tuple((op, algo, int(c), t / 1e3) for (op, algo), (c, t) in sorted(colls.items())),
                      report.hbm_bytes, report.matmul_flops)


@dataclass(frozen=True)
class RoleMemory:
    """HBM of one simulated rank (bytes): its weights, KV cache (inference) or gradients and
    optimizer state (training), the peak of everything live, and the logical core's capacity."""

    stage: int
    ranks: int
    weights_bytes: int
    kv_bytes: int
    state_bytes: int
    peak_bytes: int
    capacity_bytes: int


@dataclass(frozen=True)
class InferenceEstimate:
    model: str
    system: str
    config: str
    overrides: dict[str, str]
    plan: dict[str, Any]
    ranks: int
    batch: int
    input_tokens: int
    output_tokens: int
    dtype: str
    ttft_ms: float
    tpot_ms: float
    tpot_first_ms: float
    tpot_last_ms: float
    tokens_per_s: float  # per request
    system_tokens_per_s: float  # every sequence of the batch, every replica
    decode_samples: tuple[tuple[int, float], ...]  # (KV length, step ms)
    prefill: StepReport
    decode: StepReport  # the decode step at the middle sample's KV length
    memory: tuple[RoleMemory, ...]
    roles_simulated: int
    kernels_simulated: int
    cache_hits: int
    wall_s: float
    assumptions: tuple[str, ...] = field(default=())
    #: with the layers lowered to library kernels (not --eager): the calls a decode and a prefill
    #: layer became, the buckets, the padding they add, the KV bucket of the decode breakdown
    lowering: dict[str, tuple[str, ...]] = field(default_factory=dict)
    buckets: dict[str, list[int]] = field(default_factory=dict)
    padding: dict[str, Any] = field(default_factory=dict)
    decode_kv: int = 0
    #: the serving engine's host loop (trnsim.workload.serve.HostLoop) in TTFT and TPOT
    serving: str = "none"
    host_step_ms: float = 0.0
    #: fused speculative decoding (trnsim.workload.speculation): draft, k, acceptance, its source,
    #: tokens per step, the calls a draft decode layer became; empty without it
    speculation: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TrainEstimate:
    model: str
    system: str
    config: str
    overrides: dict[str, str]
    plan: dict[str, Any]
    ranks: int
    micro_batch: int
    seq: int
    global_batch: int
    micro_batches: int  # per data-parallel replica and step (gradient accumulation x pipeline)
    dtype: str
    step_ms: float
    tokens_per_s: float
    seq_per_s: float
    mfu_percent: float
    model_flops_per_token: float
    pipeline_ms: float
    bubble_percent: float
    dp_reduce_ms: float
    optimizer_ms: float
    forward: StepReport  # one micro-batch on stage 0's rank
    backward: StepReport
    stage_ms: tuple[tuple[float, float], ...]  # per stage: (forward, backward) of one micro-batch
    memory: tuple[RoleMemory, ...]
    roles_simulated: int
    kernels_simulated: int
    cache_hits: int
    wall_s: float
    assumptions: tuple[str, ...] = field(default=())
    recipe: dict[str, Any] = field(default_factory=dict)  # trnsim.training.Recipe's fields
    train_memory: tuple[Any, ...] = field(default=())  # trnsim.training.TrainMemory per simulated role

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def mean_decode(samples: Sequence[tuple[int, float]], first: int, last: int) -> float:
    """The mean over every integer KV length ``first..last`` of the piecewise-linear
    interpolation of ``samples`` ((length, time) pairs, sorted, spanning first..last)."""
    if last < first or not samples:
        return 0.0
    if len(samples) == 1 or last == first:
        return samples[0][1]
    total = 0.0
    for n in range(first, last + 1):
        for (x0, y0), (x1, y1) in zip(samples, samples[1:]):
            if x0 <= n <= x1:
                total += y0 + (y1 - y0) * (n - x0) / (x1 - x0) if x1 > x0 else y0
                break
    return total / (last - first + 1)


def pipeline_1f1b(forward: Sequence[int], backward: Sequence[int], p2p_forward: Sequence[int],
                  p2p_backward: Sequence[int], micro_batches: int) -> tuple[int, list[int]]:
    """The 1F1B pipeline schedule (PipeDream-flush, NxD's default) simulated over its tasks.

    Stage ``s`` runs each micro-batch's forward in ``forward[s]`` ticks and backward in
    ``backward[s]``; an activation reaches stage ``s + 1`` ``p2p_forward[s]`` ticks after stage
    ``s`` finished its forward, a gradient reaches stage ``s`` ``p2p_backward[s]`` ticks after
    stage ``s + 1`` finished its backward. Each stage runs its tasks in 1F1B order (``P - s - 1``
    warm-up forwards, then one forward and one backward in turn, then the remaining backwards),
    each starting when the stage is free and its input has arrived. Returns (the step's ticks,
    each stage's busy ticks)."""
    p, m = len(forward), micro_batches
    if p == 0 or m < 1:
        return 0, [0] * p
    order: list[list[tuple[str, int]]] = []
    for s in range(p):
        warm = min(p - s - 1, m)
        seq = [("F", i) for i in range(warm)]
        f, b = warm, 0
        while b < m:
            if f < m:
                seq.append(("F", f))
                f += 1
            seq.append(("B", b))
            b += 1
        order.append(seq)
    done: dict[tuple[str, int, int], int] = {}
    free = [0] * p
    pos = [0] * p
    remaining = sum(len(o) for o in order)
    while remaining:
        progressed = False
        for s in range(p):
            while pos[s] < len(order[s]):
                kind, i = order[s][pos[s]]
                if kind == "F":
                    dep = 0 if s == 0 else done.get(("F", s - 1, i))
                    if dep is None:
                        break
                    ready = dep + (p2p_forward[s - 1] if s > 0 else 0)
                    dur = forward[s]
                else:
                    dep = done.get(("F", s, i)) if s == p - 1 else done.get(("B", s + 1, i))
                    if dep is None:
                        break
                    ready = dep + (p2p_backward[s] if s < p - 1 else 0)
                    dur = backward[s]
                start = max(free[s], ready)
                free[s] = start + dur
                done[(kind, s, i)] = free[s]
                pos[s] += 1
                remaining -= 1
                progressed = True
        if not progressed:  # pragma: no cover - the 1F1B order has no cycles
            raise RuntimeError("pipeline schedule deadlocked")
    busy = [m * (forward[s] + backward[s]) for s in range(p)]
    return max(free), busy
