"""``trnsim estimate``: LLM inference and training on a whole system, timing-only.

A model comes from its Hugging Face config (:func:`trnsim.models.load_model`) and is built without
weights (:func:`torch_bridge.models.from_config`); a :class:`~torch_bridge.parallel.Plan` places
it on the system's ranks. Each distinct role - a pipeline stage; every rank of a TP group and
every data-parallel replica runs the same program - is simulated once, on its own device model
(:class:`trnsim.costcache.CachedDevice`: kernel and collective costs shared through the on-disk
cost cache), with its collectives charged from the NeuronLink model for the real group and
placement (:class:`~torch_bridge.parallel.Comm`). The stages are then combined: in series for a
request's prefill and decode steps, by the 1F1B schedule for training
(:func:`trnsim.estimate.pipeline_1f1b`), with the activations' send/recv between stages.

How a step is charged: every aten op is lowered and costed as in eager (timing-only tensors),
with one difference that Neuron's inference and training libraries impose - the step is one
compiled graph (a NEFF): the host dispatches it once, and its kernels run back to back
(``host.dispatch`` is paid once per step, not per op). Kernels are not fused across ops, as
neuronx-cc would fuse them: each op is its own kernel (see the assumptions each estimate lists).

Decode steps of identical layers are run for the first layer and replayed for the others
(:func:`torch_bridge.timing_only.replay_layers`; ``replay=False`` runs every layer, with the same
result); the prefill too. Training runs every layer (its backward needs the graph).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from trnsim.config import SystemConfig, load_system
from trnsim.device.costcache import CostCache, default_cache_dir
from trnsim.workload.plan import InferenceEstimate, Plan, RoleMemory, TrainEstimate, check_batch, check_plan, \
    check_sizes, mean_decode, pipeline_1f1b, summarise
from trnsim.workload.models import ModelConfig, load_model
from trnsim.config import format_quantity
from trnsim.workload.training import Recipe

from . import models
from .roles import DTYPES, EstimateError, Rank, dtype_of, positive, scope, send_recv_ticks, simulate_roles, stage_model, \
    with_layers
from .fake import replay_layers
from .train_step import assumptions as train_assumptions
from .train_step import run_train_role

__all__ = ["estimate_inference", "estimate_train", "write_trace", "DTYPES", "EstimateError"]


INFERENCE_ASSUMPTIONS = (
    "each step is one compiled graph: one host dispatch, kernels back to back",
    "one kernel per aten op (no cross-op fusion by the compiler; fused attention and matmul library kernels)",
    "attention is one fused kernel per layer (causal flash attention in prefill; in decode the token-generation "
    "kernel, its cache read in 128-key tiles)",
    "KV cache preallocated for input + output tokens; a decode step attends over the tokens so far",
    "no speculative decoding; of the serving stack only the engine's host loop (--serving), no batching, tokenizer or "
    "network",
)


def _decoder_layers(net: nn.Module) -> nn.ModuleList:
    base = getattr(net, net.base_model_prefix, net)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise EstimateError(f"model type '{net.config.model_type}' has no decoder layers (model.layers) to estimate")
    return layers


def _kv_heads(spec: ModelConfig, plan: Plan) -> int:
    return max(1, spec.kv_heads // plan.tp)


def _check(spec: ModelConfig, system: SystemConfig, plan: Plan, dtype: str) -> None:
    check_plan(spec, system, plan.tp, plan.pp, plan.dp, dtype)


# ---- inference -----------------------------------------------------------------------------------
def estimate_inference(model: str | ModelConfig, system: str | SystemConfig = "trn2.48xlarge", *, tp: int = 1,
                       pp: int = 1, dp: int = 1, sp: bool | None = None, batch: int = 1, input_tokens: int = 1024,
                       output_tokens: int = 128, dtype: str = "bf16", overrides: Sequence[str] | None = None,
                       samples: int = 5, replay: bool = True, cache_dir: str | Path | None | bool = True,
                       trace: bool = False, layers: int | None = None, eager: bool = False, ep: int = 1,
                       serving: str = "vllm-neuron", moe_routing: str = "random", max_positions: int | None = None,
                       draft_model: Any = None, speculation_length: int | None = None, acceptance: Any = None,
                       **buckets: Any) -> tuple[InferenceEstimate, list[Any]]:
    """Estimate TTFT, TPOT and tokens/s of ``model`` on ``system`` (see the module docstring).

    By default the decoder layers run as NxD Inference runs them - the NKI library's kernels at
    Neuron's bucketed shapes (:func:`torch_bridge.estimate_kernels.estimate_inference_kernels`,
    which takes ``ep`` and the bucket options ``max_context``, ``max_model_len``,
    ``context_buckets``, ``kv_buckets``, ``batch_buckets``; ``sp`` None is Neuron's default,
    sequence-parallel prefill when ``tp > 1``). ``eager`` runs every aten op as its own kernel
    instead (``sp`` None: off), as follows.

    ``max_positions`` is the serving framework's position limit where the run set one
    (transformers-neuronx's ``n_positions``, NxDI's ``seq_len``), in place of the model config's
    ``max_position_embeddings`` (:func:`trnsim.workload.plan.position_limit`).

    ``draft_model``, ``speculation_length`` and ``acceptance``: fused speculative decoding as NxDI
    runs it (:mod:`trnsim.workload.speculation`; the kernel lowering only).

    ``serving`` is the serving engine whose host loop TTFT and TPOT include
    (:class:`trnsim.workload.serve.HostLoop`: ``vllm-neuron``, ``vllm-v0`` or ``none``).

    ``samples`` decode steps are simulated at evenly spaced KV lengths (the first and last
    included); ``cache_dir`` True uses the default cost cache, None or False none; ``layers``
    overrides the model's decoder layers (a shorter model, for quick runs and scaling studies).
    Returns the estimate and, with ``trace``, the simulated ranks' RunReports (with events) of
    the prefill and the first decode sample."""
    if not eager:
        from .estimate_kernels import estimate_inference_kernels

        positive("--samples", samples)  # decode steps are timed per KV bucket: samples is not used
        return estimate_inference_kernels(model, system, tp=tp, pp=pp, dp=dp, ep=ep, sp=sp, batch=batch,
                                          input_tokens=input_tokens, output_tokens=output_tokens, dtype=dtype,
                                          overrides=overrides, cache_dir=cache_dir, trace=trace, layers=layers,
                                          serving=serving, moe_routing=moe_routing, max_positions=max_positions,
                                          draft_model=draft_model, speculation_length=speculation_length,
                                          acceptance=acceptance, **buckets)
    if draft_model is not None or speculation_length is not None or acceptance is not None:
        raise EstimateError("--draft-model: fused speculation runs the NKI library kernels as NxDI does; --eager runs "
                            "one model op by op")
    if ep != 1:
        raise EstimateError(f"--ep {ep}: expert parallelism is a layout of the kernel lowering; --eager shards "
                            f"experts over --tp only")
    if buckets:
        raise EstimateError(f"--{next(iter(buckets)).replace('_', '-')}: buckets are the kernel lowering's; --eager "
                            f"runs the exact shapes")
    sp = bool(sp)
    t_wall = time.perf_counter()
    spec = with_layers(model if isinstance(model, ModelConfig) else load_model(model), layers)
    sysc = system if isinstance(system, SystemConfig) else load_system(system, list(overrides or []))
    plan = Plan(tp, pp, dp, sp)
    for name, v in (("--batch", batch), ("--input", input_tokens), ("--output", output_tokens),
                    ("--samples", samples)):
        positive(name, v)
    dt = dtype_of(dtype)
    from trnsim.workload.serve import HostLoop, ServeError
    try:
        host = HostLoop.of(serving, sysc.chip.host.serve_step * 1e-12)
    except ServeError as e:
        raise EstimateError(str(e)) from None
    _check(spec, sysc, plan, dtype)
    check_sizes(spec, input_tokens=input_tokens, output_tokens=output_tokens, samples=samples,
                max_positions=max_positions)
    check_batch(spec, sysc, plan.tp, plan.pp, dtype, batch=batch, tokens=input_tokens + output_tokens)
    total = input_tokens + output_tokens
    prompt = input_tokens
    if sp and plan.tp > 1 and prompt % plan.tp:
        prompt = -(-prompt // plan.tp) * plan.tp  # sequence parallel needs whole shards: pad, as a bucket does
    cache = CostCache(default_cache_dir() if cache_dir is True else (cache_dir or None))
    reports: dict[tuple[Any, ...], Any] = {}
    steps = sorted({round(1 + (output_tokens - 2) * i / max(1, samples - 1)) for i in range(samples)}) \
        if output_tokens > 1 else []
    lengths = [input_tokens + j for j in steps]  # KV length before the step's new token
    refused: list[str] = []
    results, traces, memory, kernels = simulate_roles(
        spec, sysc, plan, cache, reports,
        lambda rank, last: _run_inference_role(rank, spec, plan, dt, last, batch, prompt, total, lengths, replay, trace),
        refused)
    hz = sysc.tick_hz
    hidden_bytes = spec.hidden * torch.empty((), dtype=dt).element_size()
    p2p_prefill = send_recv_ticks(sysc, plan, batch * prompt * hidden_bytes, reports, dtype)
    p2p_decode = send_recv_ticks(sysc, plan, batch * hidden_bytes, reports, dtype)
    stages = [results[r.stage] for r in plan.roles(spec.layers)]
    ttft = (sum(s["prefill_ticks"] for s in stages) + sum(p2p_prefill)) / hz * 1e3
    decode = [(n, (sum(s["decode_ticks"][i] for s in stages) + sum(p2p_decode)) / hz * 1e3)
              for i, n in enumerate(lengths)]
    tpot = mean_decode(decode, input_tokens + 1, input_tokens + output_tokens - 1) if decode else 0.0
    # the engine's host loop (HostLoop): the prefill and the first decode step run with the flow
    # broken, the later steps keep it; the mean step stands for each steady one
    steps = output_tokens - 1
    if decode and steps:
        tpot = (host.step(tpot * 1e-3, True) * (steps - 1) + host.step(decode[0][1] * 1e-3, False)) / steps * 1e3
        decode = [(n, host.step(ms * 1e-3, True) * 1e3) for n, ms in decode]
    ttft = host.step(ttft * 1e-3, False) * 1e3
    e2e_ms = ttft + (output_tokens - 1) * tpot
    per_request = output_tokens / (e2e_ms / 1e3) if e2e_ms else 0.0
    middle = stages[0]["decode_reports"][len(lengths) // 2] if lengths else None
    est = InferenceEstimate(
        model=spec.name, system=sysc.name, config=sysc.chip.name, overrides=dict(sysc.overrides),
        plan={"tp": tp, "pp": pp, "dp": dp, "sp": sp and plan.tp > 1}, ranks=plan.size, batch=batch,
        input_tokens=input_tokens,
        output_tokens=output_tokens, dtype=dtype, ttft_ms=ttft, tpot_ms=tpot,
        tpot_first_ms=decode[0][1] if decode else 0.0, tpot_last_ms=decode[-1][1] if decode else 0.0,
        tokens_per_s=per_request, system_tokens_per_s=per_request * batch * dp, decode_samples=tuple(decode),
        prefill=stages[0]["prefill_report"], decode=middle or stages[0]["prefill_report"],
        memory=tuple(memory), roles_simulated=len(memory), kernels_simulated=kernels, cache_hits=cache.hits,
        wall_s=time.perf_counter() - t_wall, serving=serving, host_step_ms=host.step_s * 1e3,
        assumptions=INFERENCE_ASSUMPTIONS + ((f"prompt padded to {prompt} tokens for sequence parallelism",)
                                             if prompt != input_tokens else ()) + tuple(refused))
    return est, traces


def _run_inference_role(rank: Rank, spec: ModelConfig, plan: Plan, dt: torch.dtype, last: bool, batch: int,
                        prompt: int, total: int, lengths: list[int], replay: bool, trace: bool) -> dict[str, Any]:
    role = rank.role
    n_layers = role.layers[1] - role.layers[0]
    out: dict[str, Any] = {"traces": []}
    with rank.run, torch.no_grad(), models.quiet():
        net = stage_model(spec, role, plan, rank.comm, dt, last)
        weights = rank.ledger.devices[0].allocated
        cache = models.kv_cache(total, n_layers, batch, _kv_heads(spec, plan), spec.head_dim, dt)
        kv = rank.ledger.devices[0].allocated - weights
        layers = _decoder_layers(net)
        if replay:
            replay_layers(layers, after=lambda i, n: setattr(cache.layers[i], "length", cache.layers[i].length + n))

        def forward(tokens: int) -> None:
            if role.first:
                ids = torch.empty((batch, tokens), dtype=torch.long, device="neuron")
                res = net(input_ids=ids, cache=cache, use_cache=True, **({"logits_to_keep": 1} if last else {}))
            else:
                emb = torch.empty((batch, tokens, spec.hidden), dtype=dt, device="neuron")
                res = net(inputs_embeds=emb, cache=cache, use_cache=True, **({"logits_to_keep": 1} if last else {}))
            if last:
                torch.argmax(res.logits[:, -1], dim=-1)  # greedy sampling on the device

        with scope(rank.device, trace) as rep:
            start = rank.step_start()
            forward(prompt)
            out["prefill_ticks"] = rank.step_end(start)
        out["prefill_report"] = summarise(rep[0], out["prefill_ticks"])
        if trace:
            out["traces"].append(("prefill", role, rep[0]))
        out["decode_ticks"], out["decode_reports"] = [], []
        for i, n in enumerate(lengths):
            for layer in cache.layers:
                layer.length = n
            with scope(rank.device, trace and i == 0) as rep:
                start = rank.step_start()
                forward(1)
                ticks = rank.step_end(start)
            out["decode_ticks"].append(ticks)
            out["decode_reports"].append(summarise(rep[0], ticks))
            if trace and i == 0:
                out["traces"].append(("decode", role, rep[0]))
        mem = rank.ledger.devices[0]
        out["memory"] = RoleMemory(role.stage, role.ranks, weights, kv, 0, mem.peak, mem.capacity)
    return out


# ---- training ----------------------------------------------------------------------------------------
def model_flops_per_token(spec: ModelConfig, params: int, seq: int) -> float:
    """Training FLOPs per token, the MFU convention of PaLM / Megatron: ``6 N`` for the weights
    (forward and backward) plus ``12 L H S`` for attention's score and value matmuls, with N the
    parameters that multiply (all but the input embedding)."""
    return 6.0 * params + 12.0 * spec.layers * spec.hidden * seq


def estimate_train(model: str | ModelConfig, system: str | SystemConfig = "trn2.48xlarge", *, tp: int = 1,
                   pp: int = 1, dp: int = 1, sp: bool = False, micro_batch: int = 1, seq: int = 2048,
                   global_batch: int | None = None, dtype: str = "bf16", overrides: Sequence[str] | None = None,
                   cache_dir: str | Path | None | bool = True, trace: bool = False, layers: int | None = None,
                   recipe: Recipe | None = None, **recipe_fields: Any) -> tuple[TrainEstimate, list[Any]]:
    """Estimate a training step of ``model``: step time, tokens/s and MFU (see the module
    docstring). ``global_batch`` sequences per step (default ``micro_batch x dp``: no
    accumulation) are split into ``global_batch / (micro_batch x dp)`` micro-batches per replica;
    ``layers`` overrides the model's decoder layers; ``recipe`` (or its fields as keywords: ``loss``,
    ``recompute``, ``sharding``, ...) says how the frameworks run the step
    (:class:`trnsim.training.Recipe`, default NxD's)."""
    t_wall = time.perf_counter()
    recipe = (recipe or Recipe()).check() if not recipe_fields else Recipe.of({**(recipe or Recipe()).to_dict(),
                                                                               **recipe_fields})
    spec = with_layers(model if isinstance(model, ModelConfig) else load_model(model), layers)
    sysc = system if isinstance(system, SystemConfig) else load_system(system, list(overrides or []))
    plan = Plan(tp, pp, dp, sp)
    if recipe.mxfp8:
        if not sysc.chip.core.tensor.mx_quad:
            raise EstimateError(f"--mxfp8: {sysc.chip.name} has no MX matmul (nc_matmul_mx is NeuronCore-v4's: "
                                f"core.tensor.mx_quad is false); use a trn3 system")
        if dtype not in ("bf16", "bfloat16"):
            raise EstimateError(f"--mxfp8: --dtype {dtype}: MXFP8 training casts bf16 linears (TorchAO's recipe); "
                                f"use --dtype bf16")
    positive("--micro-batch", micro_batch)
    positive("--seq", seq)
    dt = dtype_of(dtype)
    _check(spec, sysc, plan, dtype)  # the plan first: --dp divides the global batch below
    if recipe.schedule == "interleaved" and plan.pp == 1:  # (Megatron refuses it too)
        raise EstimateError("--schedule interleaved: one pipeline stage (--pp 1) has no schedule to interleave; use "
                            "--pp 2 or more, or --schedule 1f1b")
    v = recipe.virtual_stages
    if recipe.schedule == "interleaved" and plan.pp > 1 and v > 1:  # else scheduled as chunks of fractional layers
        for role in plan.roles(spec.layers):
            n = role.layers[1] - role.layers[0]
            if n % v:
                raise EstimateError(f"--virtual-stages {v}: pipeline stage {role.stage}'s {n} decoder layers do not "
                                    f"split into {v} model chunks (Megatron and NxD need its layers a multiple of the "
                                    f"chunks)")
    cp = recipe.cp
    if cp > 1 and (dp % cp or seq % (2 * cp)):
        raise EstimateError(f"--cp {cp}: context parallelism splits the data-parallel ranks and each sequence in "
                            f"{2 * cp} load-balanced chunks; " + (f"--dp {dp} is not a multiple of {cp}" if dp % cp else
                                                                  f"--seq {seq} is not a multiple of {2 * cp}"))
    replicas = dp // cp  # the replicas that take different sequences (a CP group shares its sequences)
    gbs = micro_batch * replicas if global_batch is None else positive("--global-batch", global_batch)
    if gbs % (micro_batch * replicas):
        raise EstimateError(f"--global-batch {gbs} is not a multiple of --micro-batch {micro_batch} x --dp {dp}" +
                            (f" / --cp {cp}" if cp > 1 else ""))
    micro = gbs // (micro_batch * replicas)
    check_sizes(spec, seq=seq, micro_batches=micro)
    local = seq // cp  # the tokens of each sequence a rank holds
    check_batch(spec, sysc, plan.tp, plan.pp, dtype, micro_batch=micro_batch, seq=local)
    if sp and plan.tp > 1 and local % plan.tp:
        raise EstimateError(f"--sp: --seq {seq}" + (f" / --cp {cp}" if cp > 1 else "") +
                            f" is not a multiple of --tp {plan.tp}")
    cache = CostCache(default_cache_dir() if cache_dir is True else (cache_dir or None))
    reports: dict[tuple[Any, ...], Any] = {}
    refused: list[str] = []
    results, traces, memory, kernels = simulate_roles(
        spec, sysc, plan, cache, reports,
        lambda rank, last: run_train_role(rank, spec, plan, dt, last, micro_batch, local, trace, recipe, micro), refused)
    _check_fits(results, plan, spec)
    params_total = 0
    for role in plan.roles(spec.layers):
        params_total += results[role.stage]["params"] * plan.tp  # the stage's parameters over its TP group
    hz = sysc.tick_hz
    stages = [results[r.stage] for r in plan.roles(spec.layers)]
    act = micro_batch * local * spec.hidden * torch.empty((), dtype=dt).element_size()
    p2p = send_recv_ticks(sysc, plan, act, reports, dtype)
    if recipe.schedule == "interleaved" and plan.pp > 1:
        from trnsim.workload.training import pipeline_interleaved

        pipe, _ = pipeline_interleaved([s["forward_ticks"] for s in stages], [s["backward_ticks"] for s in stages],
                                       p2p, micro, recipe.virtual_stages)
    else:
        pipe, _ = pipeline_1f1b([s["forward_ticks"] for s in stages], [s["backward_ticks"] for s in stages], p2p, p2p,
                                micro)
    dp_ticks = max(s["dp_ticks"] for s in stages)
    opt_ticks = max(s["optimizer_ticks"] for s in stages)
    step = pipe + dp_ticks + opt_ticks
    ideal = micro * max(s["forward_ticks"] + s["backward_ticks"] for s in stages)
    step_s = step / hz
    tokens = gbs * seq
    flops = model_flops_per_token(spec, params_total, seq)
    peak = sysc.chip.peak_flops_per_core("bf16") * sysc.chip.chip.lnc * plan.size
    est = TrainEstimate(
        model=spec.name, system=sysc.name, config=sysc.chip.name, overrides=dict(sysc.overrides),
        plan={"tp": tp, "pp": pp, "dp": dp, "sp": sp and plan.tp > 1}, ranks=plan.size, micro_batch=micro_batch,
        seq=seq,
        global_batch=gbs, micro_batches=micro, dtype=dtype, step_ms=step_s * 1e3, tokens_per_s=tokens / step_s,
        seq_per_s=gbs / step_s, mfu_percent=100.0 * tokens * flops / step_s / peak, model_flops_per_token=flops,
        pipeline_ms=pipe / hz * 1e3, bubble_percent=100.0 * (pipe - ideal) / pipe if pipe else 0.0,
        dp_reduce_ms=dp_ticks / hz * 1e3, optimizer_ms=opt_ticks / hz * 1e3, forward=stages[0]["forward_report"],
        backward=stages[0]["backward_report"],
        stage_ms=tuple((s["forward_ticks"] / hz * 1e3, s["backward_ticks"] / hz * 1e3) for s in stages),
        memory=tuple(memory), roles_simulated=len(memory), kernels_simulated=kernels, cache_hits=cache.hits,
        wall_s=time.perf_counter() - t_wall, assumptions=train_assumptions(recipe) + tuple(refused),
        recipe=recipe.to_dict(), train_memory=_distinct(results[r.stage]["train_memory"] for r in plan.roles(spec.layers)))
    return est, traces


def _distinct(items: Any) -> tuple[Any, ...]:
    out: list[Any] = []
    for x in items:
        if not any(x is y for y in out):
            out.append(x)
    return tuple(out)


def _check_fits(results: dict[int, dict[str, Any]], plan: Plan, spec: ModelConfig) -> None:
    """A stage whose peak (one micro-batch measured, plus the activations of the others it holds
    in flight) passes the logical core's HBM does not fit: an OOM, as the run would have."""
    for r in plan.roles(spec.layers):
        m = results[r.stage]["train_memory"]
        if not m.fits:
            raise torch.OutOfMemoryError(
                f"neuron:0 out of memory: stage {m.stage} needs {m.peak} bytes ({format_quantity(m.peak, 'bytes')}) "
                f"at its peak, {m.in_flight} micro-batches' activations of {format_quantity(m.activations, 'bytes')} "
                f"each, of {m.capacity} capacity - timing-only: the tensors do not fit one logical core's HBM; "
                f"recompute (--recompute full), shard the optimizer (--sharding zero1/fsdp) or the model (--tp / --pp)")


def write_trace(path: Any, traces: list[Any]) -> None:
    """A Perfetto timeline of the simulated ranks' steps (``traces`` from an estimate run with
    ``trace=True``): one process per simulated rank (on its own device timeline), one lane per
    stream (compute, collectives), each step's launches in simulated microseconds."""
    import json as _json

    from trnsim.device import COLLECTIVE_STREAM
    from trnsim.config.files import AtomicOutput

    events: list[dict[str, Any]] = []
    named: set[tuple[int, int]] = set()
    for phase, role, rep in traces:
        if rep is None:
            continue
        pid = role.rank
        to_us = 1e6 / rep.tick_hz
        if (pid, -99) not in named:
            named.add((pid, -99))
            events.append({"ph": "M", "name": "process_name", "pid": pid,
                           "args": {"name": f"rank {pid}: stage {role.stage}, stands for {role.ranks} ranks"}})
        for e in rep.events:
            if (pid, e.stream) not in named:
                named.add((pid, e.stream))
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": e.stream,
                               "args": {"name": "collectives" if e.stream <= COLLECTIVE_STREAM else "compute"}})
            events.append({"ph": "X", "name": e.op, "cat": phase, "pid": pid, "tid": e.stream,
                           "ts": e.start * to_us, "dur": (e.end - e.start) * to_us,
                           "args": {"kernel": e.kernel, "phase": phase}})
    out = path if isinstance(path, AtomicOutput) else AtomicOutput(path, "trace")
    out.commit(lambda f: _json.dump({"traceEvents": events, "displayTimeUnit": "ns"}, f))
