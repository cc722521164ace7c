"""Training as the frameworks run it: the recipe of a training step and its memory, as data.

A :class:`Recipe` says how a framework (NxD Training, TorchTitan on Neuron) runs a step beside the
parallelism plan: the loss (vocab-parallel cross-entropy: the logits are never gathered), the
activation recomputation (``none``, ``selective``: NxDT's module list, the norms and the MLP's
activation-multiply; ``attention``: NxD's selective checkpointing of SDK 2.15, the core attention and
the MLP's activation-multiply; ``full``: every decoder layer keeps only its input), the attention
(``flash``: the fused kernel; ``core``: NxD's 2023 ``CoreAttention``, op by op), the sharding of the
optimizer (``zero1``: fp32 master weights and AdamW's moments split over the data-parallel group;
``fsdp``: FSDP2, parameters and gradients split too, each layer's parameters all-gathered for its
forward and again for its backward), and the precision (``mixed``: bf16 parameters and compute,
fp32 master weights, fp32 gradient accumulation and fp32 optimizer state, NxD's
``mixed_precision``; ``bf16``: everything in bf16 with stochastic rounding, NxD's ``bf16SR``).

:class:`TrainMemory` is one simulated rank's HBM by what holds it (the runs are in
:mod:`torch_bridge.train_step`): the parts are the live tensors the timing-only run counted, so
their sum is what the ledger held; ``in_flight`` micro-batches' activations are held at once on a
pipeline stage (1F1B keeps ``pp - stage`` forwards before their backwards), so the stage's peak is
the measured peak of one micro-batch plus the activations of the others.

Torch-free: the CLI checks a recipe before PyTorch is imported.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Mapping

from ..config import ConfigError, format_quantity

__all__ = ["Recipe", "RecipeError", "TrainMemory", "LOSSES", "RECOMPUTE", "ATTENTIONS", "SHARDING", "PRECISIONS", "SCHEDULES",
           "in_flight", "add_recipe_arguments", "recipe_of_args", "gradient_buckets", "overlap_buckets", "load_plan",
           "plan_names", "PLAN_DIR", "apply_plan", "pipeline_interleaved"]

LOSSES = ("vocab-parallel", "gathered")
RECOMPUTE = ("none", "selective", "attention", "full")
ATTENTIONS = ("flash", "core")
SHARDING = ("none", "zero1", "fsdp")
PRECISIONS = ("mixed", "bf16")
SCHEDULES = ("1f1b", "interleaved")


class RecipeError(ConfigError):
    """A training recipe option that is not one trnsim runs (one line)."""


def _choice(flag: str, value: Any, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise RecipeError(f"{flag} {value!r}: expected one of {', '.join(allowed)}")
    return value


@dataclass(frozen=True)
class Recipe:
    """How a step is run beside the plan (see the module docstring)."""

    loss: str = "vocab-parallel"
    recompute: str = "none"
    sharding: str = "zero1"
    precision: str = "mixed"
    schedule: str = "1f1b"
    virtual_stages: int = 1  # interleaved 1F1B: model chunks per pipeline rank
    fused: bool = True  # the step lowered as the compiled path lowers it (fused regions, one optimizer kernel)
    overlap: bool = True  # data-parallel gradient buckets reduced while the backward runs
    bucket_mb: int = 512  # NxD's ALLREDUCE_BUCKET_CAP_MB default
    ep: int = 1  # expert parallelism: MoE experts split over this many data-parallel ranks (all-to-all dispatch)
    fused_projections: bool = True  # NxD's fused q/k/v and gate/up linears (TorchTitan keeps them apart)
    tp_overlap: bool = True  # the fused linears' backward overlaps its TP collectives with its matmuls (NxD's)
    attention: str = "flash"  # flash: the fused kernel; core: NxD's CoreAttention of 2023, op by op
    mxfp8: bool = False  # TorchAO's MXFP8 linears (trn3): the decoder layers' linears quantised and on nc_matmul_mx
    cp: int = 1  # context parallelism: each sequence split over this many data-parallel ranks (ring attention)

    def check(self) -> "Recipe":
        _choice("--loss", self.loss, LOSSES)
        _choice("--recompute", self.recompute, RECOMPUTE)
        _choice("--sharding", self.sharding, SHARDING)
        _choice("--precision", self.precision, PRECISIONS)
        _choice("--schedule", self.schedule, SCHEDULES)
        _choice("--attention", self.attention, ATTENTIONS)
        for flag, v, lo, hi in (("--virtual-stages", self.virtual_stages, 1, 64),
                                ("--bucket-mb", self.bucket_mb, 1, 1 << 20), ("--ep", self.ep, 1, 1 << 16),
                                ("--cp", self.cp, 1, 1 << 16)):
            if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
                raise RecipeError(f"{flag} {v!r}: expected a whole number {lo}..{hi:,}")
        for flag, v in (("fused", self.fused), ("overlap", self.overlap), ("fused_projections", self.fused_projections),
                        ("tp_overlap", self.tp_overlap), ("mxfp8", self.mxfp8)):
            if not isinstance(v, bool):
                raise RecipeError(f"{flag} {v!r}: expected true or false")
        if self.schedule == "1f1b" and self.virtual_stages != 1:
            raise RecipeError(f"--virtual-stages {self.virtual_stages}: only the interleaved schedule runs several "
                              f"model chunks per pipeline rank (--schedule interleaved)")
        return self

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> "Recipe":
        """A recipe from a mapping of its fields (a plan file's ``recipe:``); unknown keys refused."""
        known = {f for f in cls.__dataclass_fields__}
        bad = sorted(set(values) - known)
        if bad:
            raise RecipeError(f"recipe key {bad[0]!r}: expected one of {', '.join(sorted(known))}")
        return replace(cls(), **dict(values)).check()

    @property
    def master_bytes(self) -> int:
        """Bytes per parameter of the optimizer's master copy (0: the parameters are the master)."""
        return 4 if self.precision == "mixed" else 0

    @property
    def state_bytes(self) -> int:
        """Bytes per parameter of each AdamW moment."""
        return 4 if self.precision == "mixed" else 2

    @property
    def grad_bytes(self) -> int:
        """Bytes per parameter of the accumulated gradients."""
        return 4 if self.precision == "mixed" else 2

    def text(self) -> str:
        parts = [f"{self.loss} loss", f"recompute {self.recompute}",
                 {"none": "optimizer unsharded", "zero1": "ZeRO-1", "fsdp": "FSDP2"}[self.sharding],
                 {"mixed": "bf16 compute + fp32 master weights", "bf16": "bf16 + stochastic rounding"}[self.precision],
                 self.schedule + (f" x{self.virtual_stages}" if self.virtual_stages > 1 else ""),
                 *([f"EP={self.ep} (all-to-all dispatch and combine)"] if self.ep > 1 else []),
                 *([f"CP={self.cp} (ring attention)"] if self.cp > 1 else []),
                 "fused (compiled) lowering" if self.fused else "eager lowering (one kernel per aten op)",
                 ("fused q/k/v and gate/up" + (" (TP collectives of their backward beside its matmuls)"
                                               if self.tp_overlap else "")) if self.fused_projections
                 else "separate q/k/v and gate/up",
                 "flash attention" if self.attention == "flash" else "core attention (scores and softmax in HBM)",
                 *(["MXFP8 linears (mx_quantize kernels + nc_matmul_mx)"] if self.mxfp8 else []),
                 f"gradient buckets {self.bucket_mb} MB " + ("overlapped with the backward" if self.overlap else
                                                             "after the backward")]
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def in_flight(pp: int, stage: int, micro_batches: int, virtual: int = 1) -> int:
    """Micro-batches whose activations a pipeline stage holds at once: 1F1B runs ``pp - stage``
    forwards before the first backward (all of them with fewer micro-batches); interleaved with
    ``virtual`` chunks holds ``(pp - stage - 1) * 2 + (virtual - 1) * pp + 1`` chunk-forwards of
    ``1 / virtual`` of the stage's layers (Megatron's warm-up count), in units of whole stages."""
    if virtual <= 1:
        return max(1, min(pp - stage, micro_batches))
    chunks = min((pp - stage - 1) * 2 + (virtual - 1) * pp + 1, micro_batches * virtual)
    return max(1, -(-chunks // virtual))


@dataclass(frozen=True)
class TrainMemory:
    """HBM of one simulated rank of a training step, by what holds it (bytes; see the module
    docstring). ``activations`` is what one micro-batch's forward leaves for its backward
    (the loss's included); ``transient`` the rest of the measured peak (a backward's gradients
    and temporaries, the loss's logits before they are freed, a gathered layer under FSDP)."""

    stage: int
    ranks: int
    weights: int  # the parameters as the step computes with them (bf16), this rank's share
    master: int  # fp32 master weights (mixed precision), this rank's shard
    gradients: int  # accumulated gradients (fp32 with mixed precision), this rank's share
    optimizer: int  # AdamW's two moments, this rank's shard
    activations: int  # one micro-batch's, kept for the backward
    in_flight: int  # micro-batches whose activations are held at once
    transient: int  # the measured peak's rest (temporaries of the forward, backward and loss)
    peak: int  # the stage's peak: the measured one plus the other in-flight micro-batches' activations
    capacity: int

    @property
    def fits(self) -> bool:
        return self.peak <= self.capacity

    def lines(self) -> list[str]:
        def q(n: int) -> str:
            return format_quantity(n, "bytes")
        parts = [f"weights {q(self.weights)}"]
        if self.master:
            parts.append(f"fp32 master {q(self.master)}")
        parts += [f"gradients {q(self.gradients)}", f"AdamW moments {q(self.optimizer)}",
                  f"activations {q(self.activations)} x {self.in_flight} micro-batch{'es' if self.in_flight != 1 else ''}",
                  f"temporaries {q(self.transient)}"]
        return [f"stage {self.stage} ({self.ranks} ranks): " + ", ".join(parts) +
                f"; peak {q(self.peak)} of {q(self.capacity)} per logical core"]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)



# ---- the CLI's options -------------------------------------------------------------------------------
def add_recipe_arguments(p: Any) -> None:
    """``trnsim estimate train``'s recipe options (checked by :meth:`Recipe.check`, one line each)."""
    d = Recipe()
    p.add_argument("--loss", default=None, help=f"{' or '.join(LOSSES)} (default {d.loss}: the logits stay split "
                                                f"over the TP group)")
    p.add_argument("--recompute", default=None, help=f"activation recomputation: {', '.join(RECOMPUTE)} "
                                                     f"(default {d.recompute}; selective: NxDT's norms and "
                                                     f"activation-multiply; attention: NxD's CoreAttention and "
                                                     f"activation-multiply of SDK 2.15)")
    p.add_argument("--attention", default=None, help=f"{' or '.join(ATTENTIONS)} (default {d.attention}; core: the "
                                                     f"scores, softmax and probabilities op by op, NxD's CoreAttention)")
    p.add_argument("--sharding", default=None, help=f"optimizer/parameter sharding over DP: {', '.join(SHARDING)} "
                                                    f"(default {d.sharding})")
    p.add_argument("--precision", default=None, help="mixed (bf16 compute, fp32 master weights, gradients and AdamW "
                                                     "state) or bf16 (all bf16, stochastic rounding); default mixed")
    p.add_argument("--schedule", default=None, help=f"pipeline schedule: {', '.join(SCHEDULES)} (default 1f1b)")
    p.add_argument("--virtual-stages", type=int, default=None, help="model chunks per pipeline rank (interleaved)")
    p.add_argument("--bucket-mb", type=int, default=None, help="data-parallel gradient bucket in MB (default 512)")
    p.add_argument("--ep", type=int, default=None, help="expert parallelism: MoE experts split over this many "
                                                        "data-parallel ranks, tokens sent to them by all-to-all")
    p.add_argument("--cp", type=int, default=None, help="context parallelism: each sequence split over this many "
                                                        "data-parallel ranks, attention as ring attention (key/value "
                                                        "blocks passed around the group)")
    p.add_argument("--eager", action="store_true", help="lower the step op by op (no fused regions, AdamW op by op)")
    p.add_argument("--no-overlap", action="store_true", help="reduce the gradients after the backward, not during it")
    p.add_argument("--separate-projections", action="store_true", help="q/k/v and gate/up as separate linears "
                                                                      "(TorchTitan's; NxD fuses them)")
    p.add_argument("--no-tp-overlap", action="store_true", help="the fused linears' backward waits for each TP "
                                                               "collective (NxD overlaps them with its matmuls)")
    p.add_argument("--mxfp8", action="store_true", help="the decoder layers' linears in MXFP8 (TorchAO's MX linear "
                                                        "on trn3's nc_matmul_mx, each operand's quantisation charged "
                                                        "as its kernel); refused on trn1/trn2")
    p.add_argument("--plan", default=None, help=f"a published run as a plan ({', '.join(plan_names())}) or a plan YAML; "
                                                f"options given beside it change one axis")


#: ``trnsim estimate train``'s options a plan sets, with their defaults without one
PLAN_DEFAULTS = {"model": None, "system": "trn2.48xlarge", "tp": 1, "pp": 1, "dp": 1, "sp": False, "micro_batch": 1,
                 "seq": 2048, "global_batch": None, "dtype": "bf16"}


def apply_plan(args: Any) -> None:
    """Fill ``trnsim estimate train``'s options from ``--plan`` (those not given on the command
    line), then the defaults; ``--set`` adds to the plan's overrides; sets ``args.recipe``."""
    plan = load_plan(args.plan) if getattr(args, "plan", None) else {}
    for key, default in PLAN_DEFAULTS.items():
        if getattr(args, key, None) is None:
            setattr(args, key, plan.get(key, default))
    args.set = list(plan.get("overrides", [])) + list(args.set or [])
    if args.model is None:
        raise RecipeError("estimate train: give --model (or --plan, a published run)")
    args.recipe = recipe_of_args(args, plan.get("recipe"))


def recipe_of_args(args: Any, base: Recipe | None = None) -> Recipe:
    """The recipe of ``trnsim estimate train``'s options (unset options keep ``base``'s, a plan's,
    or the default)."""
    fields: dict[str, Any] = dict(base.to_dict()) if base is not None else {}
    for name in ("loss", "recompute", "sharding", "precision", "schedule", "virtual_stages", "bucket_mb", "ep",
                 "attention", "cp"):
        v = getattr(args, name, None)
        if v is not None:
            fields[name] = v
    if getattr(args, "eager", False):
        fields["fused"] = False
    if getattr(args, "no_overlap", False):
        fields["overlap"] = False
    if getattr(args, "separate_projections", False):
        fields["fused_projections"] = False
    if getattr(args, "no_tp_overlap", False):
        fields["tp_overlap"] = False
    if getattr(args, "mxfp8", False):
        fields["mxfp8"] = True
    return Recipe.of(fields)


# ---- the data-parallel gradient buckets -----------------------------------------------------------
def gradient_buckets(ready: list[tuple[int, int]], cap_bytes: int) -> list[tuple[int, int]]:
    """The buckets of a backward's gradients: ``ready`` is (tick, bytes) per gradient in the order
    the backward finishes them; a bucket closes when it holds ``cap_bytes`` (NxD's
    ``ALLREDUCE_BUCKET_CAP_MB``), the last at the last gradient. Returns (ready tick, bytes) per
    bucket."""
    out: list[tuple[int, int]] = []
    held = 0
    for i, (tick, nbytes) in enumerate(ready):
        held += nbytes
        if held >= cap_bytes or i == len(ready) - 1:
            out.append((tick, held))
            held = 0
    return out


def overlap_buckets(ready: list[int], durations: list[int], backward_end: int, overlap: bool = True
                    ) -> tuple[int, list[tuple[int, int]]]:
    """Each bucket's collective on the collective stream, in order: it starts when its gradients
    are ready (``overlap``; else when the backward ends) and the previous bucket's collective is
    done. Returns (the ticks the last one ends after ``backward_end``: the exposed reduction, each
    bucket's (start, end))."""
    t, spans = 0, []
    for r, d in zip(ready, durations):
        start = max(r if overlap else backward_end, t)
        t = start + d
        spans.append((start, t))
    return max(0, t - backward_end), spans


# ---- published runs as plans ------------------------------------------------------------------------
PLAN_DIR = Path(__file__).resolve().parents[2] / "configs" / "plans"
#: a plan file's keys: what the run is, and ``trnsim estimate train``'s options
PLAN_KEYS = ("about", "source", "model", "system", "set", "tp", "pp", "dp", "sp", "micro_batch", "seq",
             "global_batch", "dtype", "recipe")


def plan_names() -> list[str]:
    """The shipped plans (``configs/plans/*.yaml``), by name."""
    return sorted(p.stem for p in PLAN_DIR.glob("*.yaml"))


def load_plan(name_or_path: str) -> dict[str, Any]:
    """A shipped plan by name or a plan YAML path, as ``estimate_train``'s keyword arguments
    (``model``, ``system``, ``overrides``, ``tp``, ..., ``recipe``: a :class:`Recipe`); every
    problem is a one-line :class:`RecipeError`."""
    from ..config import clip_text, load_yaml_file

    text = str(name_or_path)
    shown = clip_text(text)
    if "/" not in text and not text.endswith((".yaml", ".yml")):
        if text not in plan_names():
            raise RecipeError(f"unknown plan '{shown}': expected one of {', '.join(plan_names())}, or a path to a "
                              f"plan YAML")
        path = PLAN_DIR / f"{text}.yaml"
    else:
        path = Path(text)
    where = clip_text(path.name if path.parent == PLAN_DIR else str(path))
    try:
        raw = load_yaml_file(path, where, "plan")
    except ConfigError as e:
        raise RecipeError(str(e)) from None
    if not isinstance(raw, dict):
        raise RecipeError(f"{where}: expected a mapping of {', '.join(PLAN_KEYS)}")
    bad = sorted(str(k) for k in raw if k not in PLAN_KEYS)
    if bad:
        raise RecipeError(f"{where}: unknown key '{clip_text(bad[0])}': expected one of {', '.join(PLAN_KEYS)}")
    if not isinstance(raw.get("model"), str):
        raise RecipeError(f"{where}: model: expected a model name or config.json path")
    out: dict[str, Any] = {"model": raw["model"]}
    if "system" in raw:
        if not isinstance(raw["system"], str):
            raise RecipeError(f"{where}: system: expected a system name or YAML path")
        out["system"] = raw["system"]
    sets = raw.get("set", [])
    if not isinstance(sets, list) or not all(isinstance(s, str) and "=" in s for s in sets):
        raise RecipeError(f"{where}: set: expected a list of K=V overrides")
    out["overrides"] = list(sets)
    for key in ("tp", "pp", "dp", "micro_batch", "seq", "global_batch"):
        if key in raw:
            v = raw[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise RecipeError(f"{where}: {key}: expected a positive whole number, got {clip_text(repr(v))}")
            out[key] = v
    if "sp" in raw:
        if not isinstance(raw["sp"], bool):
            raise RecipeError(f"{where}: sp: expected true or false")
        out["sp"] = raw["sp"]
    if "dtype" in raw:
        out["dtype"] = raw["dtype"]
    recipe = raw.get("recipe", {})
    if not isinstance(recipe, dict):
        raise RecipeError(f"{where}: recipe: expected a mapping of {', '.join(Recipe.__dataclass_fields__)}")
    try:
        out["recipe"] = Recipe.of(recipe)
    except RecipeError as e:
        raise RecipeError(f"{where}: recipe: {e}") from None
    return out


# ---- the interleaved pipeline schedule ----------------------------------------------------------------
def pipeline_interleaved(forward: list[int], backward: list[int], p2p: list[int], micro_batches: int,
                         virtual: int) -> tuple[int, list[int]]:
    """Interleaved 1F1B (Megatron's and NxD's ``TrainInterleavedSchedule``) simulated over its
    tasks: each of the ``p`` pipeline ranks holds ``virtual`` model chunks (chunk ``c`` of rank
    ``s`` is virtual stage ``c * p + s``), each chunk's forward and backward taking ``1 / virtual``
    of the rank's; a micro-batch crosses every virtual stage in order (``p2p[s]`` ticks from rank
    ``s`` to the next, the last rank's to rank 0's next chunk costing ``p2p[-1]`` or the first
    boundary's). Each rank runs, whenever it is free, its ready task that comes first in the
    schedule's order: a backward before a forward (1F1B's steady state), then Megatron's order
    (micro-batches in groups of ``p``, a group through one chunk before the next; backwards through
    the chunks in reverse). Returns (the step's ticks, each rank's busy ticks)."""
    p, m, v = len(forward), micro_batches, virtual
    if p == 0 or m < 1:
        return 0, [0] * p
    stages = p * v
    f = [max(1, forward[j % p] // v) for j in range(stages)]
    b = [max(1, backward[j % p] // v) for j in range(stages)]
    hop = [(p2p[j % p] if j % p < len(p2p) else (p2p[0] if p2p else 0)) for j in range(stages)]
    done: dict[tuple[str, int, int], int] = {}
    free = [0] * p
    left = {("F", i, j) for i in range(m) for j in range(stages)} | {("B", i, j) for i in range(m) for j in range(stages)}
    while left:
        best = None
        for task in left:
            kind, i, j = task
            if kind == "F":
                dep = 0 if j == 0 else done.get(("F", i, j - 1))
                ready = None if dep is None else dep + (hop[j - 1] if j > 0 and p > 1 else 0)
            else:
                dep = done.get(("F", i, j)) if j == stages - 1 else done.get(("B", i, j + 1))
                ready = None if dep is None else dep + (hop[j] if j < stages - 1 and p > 1 else 0)
            if ready is None:
                continue
            d = j % p
            start = max(free[d], ready)
            c = j // p  # Megatron's order: micro-batches in groups of p, each group through a chunk at a time
            order = i // p * stages + (c if kind == "F" else v - 1 - c) * p + i % p
            key = (start, 0 if kind == "B" else 1, order)
            if best is None or key < best[0]:
                best = (key, task, start, d)
        assert best is not None
        _, task, start, d = best
        kind, i, j = task
        free[d] = start + (f[j] if kind == "F" else b[j])
        done[task] = free[d]
        left.discard(task)
    busy = [m * (forward[s] + backward[s]) for s in range(p)]
    return max(free), busy
