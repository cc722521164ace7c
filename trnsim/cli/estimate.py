"""``trnsim estimate inference|train``: the command, its options and how it prints (part of the CLI,
with :mod:`trnsim.cli`; the runs are :mod:`torch_bridge.estimate`'s).

    trnsim estimate inference --model llama-3.3-70b [--system trn2.48xlarge] [--tp 64] [--pp 1] [--dp 1]
                   [--sp] [--batch 1] [--input 10000] [--output 1500] [--dtype bf16] [--samples 5]
                   [--set K=V ...] [--serving vllm-neuron|vllm-v0|none] [--max-positions N] [--json]
                   [--draft-model M --speculation-length K --acceptance A] [--trace out.json]
                   [--no-cache] [--no-replay]
    trnsim estimate train --model llama-3.1-8b [--system ...] [--tp 8] [--pp 1] [--dp 1] [--sp]
                   [--micro-batch 1] [--seq 2048] [--global-batch N] [--dtype bf16] [--set K=V ...]
                   [--json] [--trace out.json] [--no-cache]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from .base import Out as _Out, UsageError, emit
from ..config import format_quantity
from ..workload.buckets import BUCKET_FLAGS, add_bucket_flags, add_moe_routing_flag

__all__ = ["add_parser", "render_inference", "render_train"]


def _gib(n: int) -> str:
    return format_quantity(n, "bytes")


def _plan_text(plan: dict[str, Any], ranks: int) -> str:
    parts = [f"{k.upper()}={v}" for k, v in plan.items() if k != "sp" and v > 1] or ["TP=1"]
    if plan.get("sp"):
        parts.append("SP")
    return f"{' '.join(parts)}, {ranks} rank{'s' if ranks != 1 else ''}"


def _memory_lines(memory: Any) -> list[str]:
    out = []
    for m in memory:
        extra = f"KV cache {_gib(m.kv_bytes)}" if m.kv_bytes or not m.state_bytes else \
            f"gradients + optimizer state {_gib(m.state_bytes)}"
        out.append(f"stage {m.stage} ({m.ranks} ranks): weights {_gib(m.weights_bytes)}, {extra}, peak "
                   f"{_gib(m.peak_bytes)} of {_gib(m.capacity_bytes)} per logical core")
    return out


def _step_table(title: str, step: Any, console: Any) -> None:
    from rich.table import Table

    console.print(f"{title}: {step.time_ms:,.2f} ms, {step.launches:,} launches, bound by {step.bound}", markup=False)
    t = Table(box=None, padding=(0, 2))
    for col in ("kind", "calls", "time ms", "share", "bound"):
        t.add_column(col, justify="left" if col in ("kind", "bound") else "right")
    for k in step.kinds:
        t.add_row(k.kind, f"{k.calls:,}", f"{k.time_ms:,.2f}", f"{k.share_percent:.1f}%", k.bound)
    console.print(t)
    console.print(f"  compute {step.compute_ms:,.2f} ms | HBM {step.memory_ms:,.2f} ms | collectives "
                  f"{step.collective_ms:,.2f} ms | idle {step.idle_ms:,.2f} ms", markup=False)
    if step.collectives:
        colls = ", ".join(f"{op} {algo} x{calls} ({ms * 1e3 / calls:,.1f} us each)"
                          for op, algo, calls, ms in step.collectives)
        console.print(f"  collectives: {colls}", markup=False, soft_wrap=True)


def render_inference(est: Any, console: Any) -> None:
    """An :class:`trnsim.estimate.InferenceEstimate` as text."""
    head = (f"[bold]{est.model}[/bold] inference on {est.system} ({est.config}): {_plan_text(est.plan, est.ranks)}; "
            f"batch {est.batch}, {est.input_tokens:,} tokens in / {est.output_tokens:,} out, {est.dtype}")
    if est.overrides:
        head += " (" + ", ".join(f"{k}={v}" for k, v in est.overrides.items()) + ")"
    console.print(head, soft_wrap=True)
    console.print(f"  TTFT        {est.ttft_ms:,.2f} ms (prefill of {est.input_tokens:,} tokens and the first token)",
                  markup=False)
    spec_ = getattr(est, "speculation", None)
    if est.output_tokens > 1 and est.padding and spec_:
        per = ", ".join(f"{ms:,.2f} ms over KV {b:,}" for b, (_, ms) in zip(est.padding["decode_kv_buckets"],
                                                                          est.decode_samples))
        console.print(f"  TPOT        {est.tpot_ms:,.2f} ms (mean of {est.output_tokens - 1:,} tokens, fused steps of "
                      f"{spec_['tokens_per_step']:.2f} tokens on average: {per} per step)", markup=False,
                      soft_wrap=True)
    elif est.output_tokens > 1 and est.padding:
        per = ", ".join(f"{ms:,.2f} ms over KV {b:,}" for b, (_, ms) in zip(est.padding["decode_kv_buckets"],
                                                                          est.decode_samples))
        console.print(f"  TPOT        {est.tpot_ms:,.2f} ms (mean of {est.output_tokens - 1:,} decode steps: {per})",
                      markup=False, soft_wrap=True)
    elif est.output_tokens > 1:
        console.print(f"  TPOT        {est.tpot_ms:,.2f} ms (mean of {est.output_tokens - 1:,} decode steps: "
                      f"{est.tpot_first_ms:,.2f} ms at KV {est.decode_samples[0][0]:,} -> {est.tpot_last_ms:,.2f} ms "
                      f"at KV {est.decode_samples[-1][0]:,})", markup=False, soft_wrap=True)
    sp_ = getattr(est, "speculation", None)
    if sp_:
        console.print(f"  speculation fused, draft {sp_['draft']}: k={sp_['k']} (k draft steps + the target over k "
                      f"tokens per step), acceptance {sp_['acceptance']:g} -> {sp_['tokens_per_step']:.2f} tokens per "
                      f"step; acceptance from {sp_['source']}", markup=False, soft_wrap=True)
    if est.serving != "none":
        how = "a step ahead of the device: max(host, device) per decode step" if est.serving == "vllm-neuron" else \
            "between device steps: host + device per step"
        console.print(f"  engine      {est.serving}: host {est.host_step_ms:,.2f} ms per iteration, {how}",
                      markup=False)
    console.print(f"  tokens/s    {est.tokens_per_s:,.1f} per request; {est.system_tokens_per_s:,.1f} for the system "
                  f"(batch {est.batch} x DP {est.plan['dp']})", markup=False)
    for line in _memory_lines(est.memory):
        console.print(f"  HBM         {line}", markup=False, soft_wrap=True)
    if est.padding:
        p = est.padding
        console.print(f"  buckets     prefill {est.input_tokens:,} -> {p['prefill_tokens']:,} tokens "
                      f"({p['prefill_padding_percent']:.1f}% padding); decode KV bucket"
                      f"{'s' if len(p['decode_kv_buckets']) != 1 else ''} "
                      f"{', '.join(f'{b:,}' for b in p['decode_kv_buckets']) or '-'} "
                      f"({p['decode_kv_padding_percent']:.1f}% of the KV read is padding); batch {est.batch} -> "
                      f"{p['batch_bucket']} ({p['batch_padding_percent']:.1f}% padding)", markup=False)
    console.print()
    kinds = est.lowering.get("layers", ())
    if len(kinds) > 1:
        console.print(f"Decoder layers: {'; '.join(kinds)}; the most common is shown", markup=False)
    for phase in ("decode", "prefill"):
        if est.lowering.get(phase) and (phase == "prefill" or est.output_tokens > 1):
            console.print(f"A {phase} layer became: " + "; ".join(est.lowering[phase]), markup=False)
    if sp_ and est.output_tokens > 1:
        console.print("A draft decode layer became: " + "; ".join(sp_["draft_decode"]), markup=False)
    if est.lowering:
        console.print()
    if est.output_tokens > 1:
        if est.decode_kv:
            title = f"Decode step over the KV bucket of {est.decode_kv:,} (stage 0's rank)"
        else:
            title = f"Decode step at KV {est.decode_samples[len(est.decode_samples) // 2][0]:,} (stage 0's rank)"
        _step_table(title, est.decode, console)
        console.print()
    what = f"{est.input_tokens:,} tokens" + (f" (bucket {est.padding['prefill_tokens']:,})" if est.padding else "")
    _step_table(f"Prefill of {what} (stage 0's rank)", est.prefill, console)
    console.print()
    console.print(f"Simulated {est.roles_simulated} role(s) for {est.ranks} ranks; {est.kernels_simulated:,} kernels "
                  f"simulated, {est.cache_hits:,} costs from the cache; {est.wall_s:,.1f} s", markup=False)
    console.print("Assumptions: " + "; ".join(est.assumptions) + ".", markup=False)


def render_train(est: Any, console: Any) -> None:
    """A :class:`trnsim.estimate.TrainEstimate` as text."""
    head = (f"[bold]{est.model}[/bold] training on {est.system} ({est.config}): {_plan_text(est.plan, est.ranks)}; "
            f"micro-batch {est.micro_batch} x {est.seq:,} tokens, global batch {est.global_batch:,} "
            f"({est.micro_batches} micro-batches per replica), {est.dtype}")
    if est.overrides:
        head += " (" + ", ".join(f"{k}={v}" for k, v in est.overrides.items()) + ")"
    console.print(head, soft_wrap=True)
    console.print(f"  step        {est.step_ms:,.1f} ms: pipeline {est.pipeline_ms:,.1f} ms (bubble "
                  f"{est.bubble_percent:.1f}%), data-parallel gradient reduction {est.dp_reduce_ms:,.1f} ms (past the backward), "
                  f"optimizer {est.optimizer_ms:,.1f} ms", markup=False)
    console.print(f"  throughput  {est.tokens_per_s:,.0f} tokens/s, {est.seq_per_s:,.2f} sequences/s", markup=False)
    console.print(f"  MFU         {est.mfu_percent:.1f}% ({est.model_flops_per_token / 1e9:,.1f} GFLOP per token "
                  f"over the bf16 peak of {est.ranks} logical cores)", markup=False)
    for line in ([ln for m in est.train_memory for ln in m.lines()] if est.train_memory else
                 _memory_lines(est.memory)):
        console.print(f"  HBM         {line}", markup=False, soft_wrap=True)
    if est.recipe:
        from ..workload.training import Recipe

        console.print(f"  recipe      {Recipe(**est.recipe).text()}", markup=False, soft_wrap=True)
    stages = ", ".join(f"{f:,.1f} + {b:,.1f}" for f, b in est.stage_ms)
    console.print(f"  stages      forward + backward ms per micro-batch: {stages}", markup=False)
    console.print()
    _step_table("Forward of one micro-batch (stage 0's rank)", est.forward, console)
    console.print()
    _step_table("Backward of one micro-batch (stage 0's rank)", est.backward, console)
    console.print()
    console.print(f"Simulated {est.roles_simulated} role(s) for {est.ranks} ranks; {est.kernels_simulated:,} kernels "
                  f"simulated, {est.cache_hits:,} costs from the cache; {est.wall_s:,.1f} s", markup=False)
    console.print("Assumptions: " + "; ".join(est.assumptions) + ".", markup=False)


def _precheck(args: argparse.Namespace) -> None:
    """The model, system, plan and sizes checked before PyTorch is imported, so a bad option is
    one line at once rather than after the imports (the run checks them again,
    :mod:`torch_bridge.estimate`, and names what is left: a non-positive number, a dtype)."""
    from ..config import load_system
    from ..workload.plan import DTYPE_BYTES, check_batch, check_plan, check_sizes
    from ..workload.models import load_model

    model = load_model(args.model)
    inference = args.mode == "inference"
    counts = [args.tp, args.pp, args.dp, 1 if args.layers is None else args.layers] + (
        [args.batch, args.input, args.output, args.samples] if inference else
        [args.micro_batch, args.seq, 1 if args.global_batch is None else args.global_batch])
    if inference:
        _bucket_args(args)
        counts.append(args.ep)
    if min(counts) < 1 or args.dtype not in DTYPE_BYTES:
        return
    if args.layers is not None:
        check_sizes(model, layers=args.layers)
        model = model.with_layers(args.layers)
    system = load_system(args.system, args.set)
    check_plan(model, system, args.tp, args.pp, args.dp, args.dtype)
    if inference:
        check_sizes(model, input_tokens=args.input, output_tokens=args.output, samples=args.samples,
                    max_positions=args.max_positions)
        from ..workload.speculation import Speculation

        if Speculation.of(args.draft_model, args.speculation_length, args.acceptance) is not None:
            if args.eager:
                raise UsageError("--draft-model: fused speculation runs the NKI library kernels as NxDI does; --eager "
                                 "runs one model op by op")
            load_model(args.draft_model)
        check_batch(model, system, args.tp, args.pp, args.dtype, batch=args.batch, tokens=args.input + args.output)
    else:
        replica = args.micro_batch * args.dp
        gbs = replica if args.global_batch is None else args.global_batch
        check_sizes(model, seq=args.seq, micro_batches=gbs // replica if gbs % replica == 0 else None)
        check_batch(model, system, args.tp, args.pp, args.dtype, micro_batch=args.micro_batch, seq=args.seq)


def _bucket_args(args: argparse.Namespace) -> None:
    """The kernel lowering's options checked (and bucket lists parsed) before torch is imported."""
    from ..workload.buckets import BucketError, parse_bucket_flags

    parse_bucket_flags(args)
    for name in ("max_context", "max_model_len", "ep"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise BucketError(f"--{name.replace('_', '-')} {v}: expected a positive whole number")
    if args.eager:
        given = [n for n in ("max_context", "max_model_len", *BUCKET_FLAGS) if getattr(args, n) is not None] + (["ep"] if args.ep != 1 else [])
        if given:
            raise UsageError(f"--{given[0].replace('_', '-')}: a kernel-lowering option; --eager runs every aten op "
                             f"at its exact shape")
    if args.sp and args.no_sp:
        raise UsageError("--sp and --no-sp: give one of them")
    if args.no_replay and not args.eager:  # else ignored: the kernel lowering replays nothing
        raise UsageError("--no-replay: an --eager option (the kernel lowering runs every decoder layer's kernels, "
                         "none replayed)")


def _inference_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    sp = True if args.sp else False if args.no_sp else None
    kw: dict[str, Any] = {"sp": sp, "eager": args.eager, "samples": args.samples, "replay": not args.no_replay,
                          "serving": args.serving, "max_positions": args.max_positions}
    if args.draft_model is not None or args.speculation_length is not None or args.acceptance is not None:
        kw.update(draft_model=args.draft_model, speculation_length=args.speculation_length,
                  acceptance=args.acceptance)
    if not args.eager:
        kw["ep"] = args.ep
        kw["moe_routing"] = args.moe_routing
        for n in ("max_context", "max_model_len", *BUCKET_FLAGS):
            if getattr(args, n) is not None:
                kw[n] = getattr(args, n)
    return kw


def _failed_import(e: ImportError) -> str:
    """What did not import: the innermost import error's module (transformers re-raises a lazy
    import's failure under the class name) and its message."""
    inner: BaseException = e
    seen = {id(e)}
    while True:
        nxt = inner.__cause__ or inner.__context__
        if nxt is None or id(nxt) in seen:
            break
        seen.add(id(nxt))
        inner = nxt
    name = next((x.name for x in (inner, e) if isinstance(x, ImportError) and x.name), None)
    return f"importing {name} failed ({inner})" if name else f"an import failed ({e})"


def cmd_estimate(args: argparse.Namespace) -> int:
    from ..config.files import AtomicOutput

    if args.mode == "train":
        from ..workload.training import apply_plan

        apply_plan(args)
    _precheck(args)
    try:
        import torch

        from torch_bridge.timing import estimate as est_mod
    except ImportError as e:
        raise UsageError(f"trnsim estimate needs PyTorch and transformers: pip install -e '.[demo]' ({e})") from None
    cache = None if args.no_cache else True
    trace = AtomicOutput(args.trace, "--trace") if args.trace else None  # refused now, not after the run
    try:
        try:
            if args.mode == "inference":
                est, traces = est_mod.estimate_inference(
                    args.model, args.system, tp=args.tp, pp=args.pp, dp=args.dp, batch=args.batch,
                    input_tokens=args.input, output_tokens=args.output, dtype=args.dtype, overrides=args.set,
                    cache_dir=cache, trace=trace is not None, layers=args.layers, **_inference_kwargs(args))
            else:
                est, traces = est_mod.estimate_train(
                    args.model, args.system, tp=args.tp, pp=args.pp, dp=args.dp, sp=args.sp,
                    micro_batch=args.micro_batch, seq=args.seq, global_batch=args.global_batch, dtype=args.dtype,
                    overrides=args.set, cache_dir=cache, trace=trace is not None, layers=args.layers,
                    recipe=args.recipe)
        except torch.OutOfMemoryError as e:
            raise UsageError(f"estimate: {e}") from None
        except ImportError as e:  # the model's code (transformers imports it on demand) does not import
            raise UsageError(f"estimate: {args.model}: {_failed_import(e)}; check the transformers install "
                             f"(pip install -e '.[demo]')") from None
        if trace is not None:
            est_mod.write_trace(trace, traces)
    finally:
        if trace is not None:
            trace.discard()
    if args.json:
        emit(json.dumps(est.to_dict(), indent=2))
        return 0
    console = _Out(width=120)
    (render_inference if args.mode == "inference" else render_train)(est, console)
    if args.trace:
        console.print(f"Trace written to {args.trace} (open it in ui.perfetto.dev)", markup=False)
    return 0


def add_parser(sub: Any) -> None:
    """``trnsim estimate`` with its two modes."""
    from ..config import system_names
    from ..workload.models import model_names

    e = sub.add_parser("estimate", help="estimate LLM inference (TTFT, TPOT, tokens/s) or a training step (step time, "
                                        "tokens/s, MFU) on a whole system, timing-only")
    modes = e.add_subparsers(dest="mode", metavar="MODE", parser_class=type(e))
    modes.required = True
    inf = modes.add_parser("inference", help="prefill and decode of one request batch")
    tr = modes.add_parser("train", help="one training step: forward, backward, gradient reduction, optimizer")
    from .serve import add_mode

    add_mode(modes)
    for p in (inf, tr):
        p.add_argument("--model", required=p is inf, help=f"a model ({', '.join(model_names())}) or a Hugging Face "
                                                          f"config.json path" + ("" if p is inf else " (or --plan)"))
        p.add_argument("--system", default="trn2.48xlarge",
                       help=f"a system ({', '.join(system_names())}) or a YAML path; default trn2.48xlarge")
        p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
        p.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
        p.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default 1)")
        p.add_argument("--sp", action="store_true", help="sequence parallelism over the TP group (norms and "
                                                          "residuals on seq/tp tokens); inference: the default "
                                                          "with --tp > 1 unless --eager")
        p.add_argument("--dtype", default="bf16", help="weights and activations: bf16, fp16 or fp32 (default bf16)")
        p.add_argument("--set", action="append", default=[], metavar="K=V",
                       help="dotted override of the system or its chip, e.g. core.dma.engine_bandwidth=40GB/s")
        p.add_argument("--json", action="store_true", help="print the estimate as JSON")
        p.add_argument("--trace", metavar="OUT.json", help="write a Perfetto timeline of the simulated ranks' steps")
        p.add_argument("--no-cache", action="store_true", help="simulate every kernel again (no on-disk cost cache)")
        p.add_argument("--layers", type=int, help="override the model's decoder layers (a shorter model)")
        p.set_defaults(fn=cmd_estimate)
    inf.add_argument("--batch", type=int, default=1, help="sequences per request batch (default 1)")
    inf.add_argument("--input", type=int, default=1024, help="prompt tokens (default 1024)")
    inf.add_argument("--output", type=int, default=128, help="generated tokens (default 128)")
    inf.add_argument("--samples", type=int, default=5, help="decode steps simulated along the output, KV lengths "
                                                            "evenly spaced (default 5)")
    inf.add_argument("--no-replay", action="store_true", help="with --eager: run every decoder layer (default: run "
                                                               "the first, replay it for the identical others)")
    inf.add_argument("--serving", default="vllm-neuron", choices=("vllm-neuron", "vllm-v0", "none"),
                     help="the serving engine's host loop in TTFT and TPOT: vllm-neuron schedules a step ahead (a "
                          "decode step takes max(host, device); the default), vllm-v0 runs host and device in turn, "
                          "none charges no engine (a bare generation loop)")
    inf.add_argument("--max-positions", type=int, help="the serving framework's position limit where it differs from "
                                                       "the model config's max_position_embeddings (transformers-"
                                                       "neuronx's n_positions, NxDI's seq_len); RoPE models only")
    inf.add_argument("--draft-model", help="fused speculative decoding as NxD Inference runs it: the draft model (a "
                                           "name or config.json path), fused with the target in one graph")
    inf.add_argument("--speculation-length", type=int, help="with --draft-model: draft steps and target tokens per "
                                                            "fused step (NxDI's speculation_length)")
    inf.add_argument("--acceptance", help="with --draft-model: the rate at which the target accepts a draft token, in "
                                          "[0, 1], or a name from configs/speculation/acceptance.yaml (a property of "
                                          "the models and prompts; no default)")
    inf.add_argument("--no-sp", action="store_true", help="prefill without sequence parallelism (all-reduces)")
    inf.add_argument("--eager", action="store_true", help="every aten op its own kernel at its exact shape (default: "
                                                          "the layers lowered to the NKI library kernels as NxD "
                                                          "Inference runs them, at Neuron's buckets)")
    inf.add_argument("--ep", type=int, default=1, help="expert parallelism: MoE experts split over EP of the TP ranks "
                                                       "(default 1)")
    add_moe_routing_flag(inf)
    inf.add_argument("--max-context", type=int, help="largest prompt bucket (default: --max-model-len, as "
                                                           "NxDI's max_context_length)")
    inf.add_argument("--max-model-len", type=int, help="largest sequence: KV buckets up to it (default: --input + "
                                                       "--output)")
    add_bucket_flags(inf, context=("prompt", "--max-context"), kv=("decode KV", "--max-model-len"), batch="--batch")
    tr.add_argument("--micro-batch", type=int, default=None, help="sequences per micro-batch (default 1)")
    tr.add_argument("--seq", type=int, default=None, help="tokens per sequence (default 2048)")
    tr.add_argument("--global-batch", type=int, default=None,
                    help="sequences per step (default micro-batch x dp: no gradient accumulation)")
    from ..workload.training import add_recipe_arguments

    add_recipe_arguments(tr)
    tr.set_defaults(system=None, tp=None, pp=None, dp=None, sp=None, dtype=None)  # a --plan's, else the defaults

