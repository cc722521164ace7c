"""``trnsim estimate serve``: a serving run (:mod:`trnsim.serve`) on the step times of the lowered
model's simulated kernels, printed as ``vllm bench serve`` prints it.

    trnsim estimate serve --model llama-3.1-8b [--system trn2.48xlarge] [--tp 8] [--ep 1] [--dp 1]
                   [--rate 4 | --trace requests.csv] [--requests 200] [--input 512] [--output 128] [--seed 0]
                   [--max-batch 32] [--chunk 2048] [--max-model-len N] [--kv-tokens N]
                   [--prefix-caching] [--prefix-len N] [--context-buckets ...] [--kv-buckets ...]
                   [--batch-buckets ...] [--sweep 1,2,4,8 --plot latency.png] [--serving vllm-neuron|vllm-v0|none]
                   [--json] [--no-cache]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

from .base import Out as _Out
from .base import UsageError, emit
from ..workload.buckets import add_bucket_flags, add_moe_routing_flag

__all__ = ["add_mode"]


def _rate(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not (v > 0) or (math.isinf(v) and text.strip().lower() not in ("inf", "+inf")):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a positive number of requests per second, or inf")
    return v


def _rates(text: str) -> list[float]:
    out = [_rate(t) for t in text.split(",") if t.strip()] if isinstance(text, str) else []
    if not out or len(out) > 32:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 1..32 comma-separated request rates, e.g. 1,2,4,8")
    return out


def _requests(args: argparse.Namespace, rate: float) -> list[Any]:
    from ..workload.serve import poisson_requests, read_trace

    if args.trace:
        return read_trace(args.trace)
    return poisson_requests(rate, args.requests, args.input, args.output, args.seed, args.prefix_len or 0)


def _check(args: argparse.Namespace) -> None:
    """Every option checked before PyTorch is imported (one line each)."""
    from ..workload.buckets import parse_bucket_flags
    from ..config import load_system
    from ..workload.plan import check_plan
    from ..workload.models import load_model
    from ..workload.serve import MAX_REQUESTS, ServeError

    for name, lo, hi in (("tp", 1, 4096), ("ep", 1, 4096), ("dp", 1, 4096), ("requests", 1, MAX_REQUESTS), ("input", 1, 1 << 20),
                         ("output", 1, 1 << 20), ("max_batch", 1, 1024), ("chunk", 1, 1 << 20),
                         ("max_model_len", 1, 1 << 22), ("kv_tokens", 1, 1 << 40), ("prefix_len", 0, 1 << 20),
                         ("seed", 0, 2 ** 63 - 1)):
        v = getattr(args, name)
        if v is not None and not lo <= v <= hi:
            raise ServeError(f"--{name.replace('_', '-')} {v}: expected a whole number in {lo}..{hi:,}")
    if args.trace and (args.rate is not None or args.sweep):
        raise UsageError("--trace gives the arrivals: not with --rate or --sweep")
    if args.sweep and args.rate is not None:  # else --rate was dropped without a word
        raise UsageError("--sweep gives the request rates: not with --rate")
    if args.plot and not args.sweep:
        raise UsageError("--plot draws a --sweep of request rates: give --sweep 1,2,4,8")
    if args.prefix_len and args.prefix_len > args.input:
        raise ServeError(f"--prefix-len {args.prefix_len}: longer than --input {args.input}")
    parse_bucket_flags(args)
    if args.dtype != "bf16":
        raise ServeError(f"--dtype {args.dtype}: expected bf16 (the dtype every library kernel of a lowered step takes)")
    if args.dp > 1 and args.ep > 1:
        raise ServeError(f"--dp {args.dp} with --ep {args.ep}: expert parallelism across replicas pads every replica's "
                         f"batch to the largest and runs dummy batches (vLLM Neuron's DP with EP): not modelled; "
                         f"give one of them")
    model = load_model(args.model)
    check_plan(model, load_system(args.system, args.set), args.tp, 1, args.dp, args.dtype)


def cmd_serve(args: argparse.Namespace) -> int:
    from ..config.files import AtomicOutput

    _check(args)
    plot = None
    if args.plot:
        from ..outputs.plot import reserve

        plot = reserve(args.plot, "--plot")
    requests = _requests(args, args.rate if args.rate is not None else float("inf")) if not args.sweep else None
    try:
        import torch

        from torch_bridge.timing.serve_costs import serve_setup
    except ImportError as e:
        raise UsageError(f"trnsim estimate serve needs PyTorch and transformers: pip install -e '.[demo]' ({e})") \
            from None
    from ..workload.serve import simulate

    t0 = time.perf_counter()
    try:
        first = requests if requests is not None else _requests(args, args.sweep[0])
        costs, cfg, setup = serve_setup(args, first)
        if args.sweep:
            points = []
            for r in args.sweep:
                res = simulate(_requests(args, r), costs, cfg, dp=args.dp)
                res.setup = {**setup, "rate": r}
                points.append((r, res))
        else:
            res = simulate(first, costs, cfg, dp=args.dp)
            res.setup = {**setup, "rate": args.rate if args.rate is not None else "trace" if args.trace else "inf"}
            points = [(args.rate, res)]
    except torch.OutOfMemoryError as e:
        raise UsageError(f"estimate serve: {e}") from None
    wall = time.perf_counter() - t0
    for _, res in points:
        res.setup.update(wall_s=wall, steps_simulated=costs.simulated_steps, cache_hits=costs.cache.hits)
    if plot is not None:
        from ..workload.serve import plot_sweep

        plot_sweep(points, plot, f"{args.model} on {args.system}, TP={args.tp}: {args.input} in / {args.output} out, "
                                 f"max batch {cfg.max_batch}")
    if args.json:
        out = [res.to_dict() for _, res in points]
        emit(json.dumps(out if args.sweep else out[0], indent=2))
        return 0
    console = _Out(width=120)
    for _, res in points:
        _render(res, console)
    if args.sweep:
        _sweep_table(points, console)
    if plot is not None:
        console.print(f"Plot written to {args.plot}", markup=False)
    return 0


def _render(res: Any, console: Any) -> None:
    s = res.setup
    head = (f"{s['model']} served on {s['system']} ({s['config']}): TP={s['tp']}"
            f"{' EP=' + str(s['ep']) if s.get('ep', 1) > 1 else ''}"
            f"{' x DP=' + str(s['dp']) + ' replicas' if s.get('dp', 1) > 1 else ''}, {s['dtype']}; "
            f"max batch {s['max_batch']}{' a replica' if s.get('dp', 1) > 1 else ''}, "
            f"chunk {s['chunk']:,} tokens, KV capacity {res.kv_capacity_tokens:,} tokens; rate {s['rate']} req/s"
            f"{', prefix caching' if s.get('prefix_caching') else ''}; engine {s.get('serving', 'none')}"
            f"{' (host %.2f ms per iteration)' % s['host_step_ms'] if s.get('host_step_ms') else ''}")
    console.print(head, markup=False, soft_wrap=True)
    lines = [("=" * 12 + " Serving Benchmark Result " + "=" * 12, None),
             ("Successful requests:", f"{res.requests}"),
             ("Benchmark duration (s):", f"{res.duration_s:.2f}"),
             ("Total input tokens:", f"{res.input_tokens}"),
             ("Total generated tokens:", f"{res.output_tokens}"),
             ("Request throughput (req/s):", f"{res.request_throughput:.2f}"),
             ("Output token throughput (tok/s):", f"{res.output_throughput:.2f}"),
             ("Total Token throughput (tok/s):", f"{res.total_token_throughput:.2f}")]
    for title, key, name in (("Time to First Token", "ttft", "TTFT"),
                             ("Time per Output Token (excl. 1st token)", "tpot", "TPOT"),
                             ("Inter-token Latency", "itl", "ITL"), ("End-to-end Latency", "e2e", "E2EL")):
        pad = max(0, 50 - len(title) - 2)
        lines.append(("-" * (pad // 2) + title + "-" * (pad - pad // 2), None))
        lat = getattr(res, key)
        lines += [(f"Mean {name} (ms):", f"{lat.mean_ms:.2f}"), (f"Median {name} (ms):", f"{lat.p50_ms:.2f}"),
                  (f"P90 {name} (ms):", f"{lat.p90_ms:.2f}"), (f"P99 {name} (ms):", f"{lat.p99_ms:.2f}")]
    lines.append(("=" * 50, None))
    for label, value in lines:
        console.print(label if value is None else f"{label:<40}{value:>10}", markup=False)
    console.print(f"Steps: {res.prefill_steps:,} prefill, {res.decode_steps:,} decode (mean batch "
                  f"{res.mean_decode_batch:.2f}, at most {res.max_running} running); padding: prefill "
                  f"{res.prefill_padding_percent:.1f}% of tokens, decode batch {res.decode_batch_padding_percent:.1f}%, "
                  f"decode KV {res.decode_kv_padding_percent:.1f}%; {res.waited_for_kv} request(s) waited for KV "
                  f"blocks; {res.cached_prefix_tokens:,} prompt tokens from the prefix cache", markup=False,
                  soft_wrap=True)
    console.print(f"Simulated {s['steps_simulated']} step shapes ({s['cache_hits']:,} kernel costs from the cache); "
                  f"{s['wall_s']:.1f} s", markup=False)
    console.print()


def _sweep_table(points: Any, console: Any) -> None:
    from rich.table import Table

    t = Table(box=None, padding=(0, 2), title="Latency against request rate", title_justify="left")
    for col in ("rate req/s", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "E2E p50 ms"):
        t.add_column(col, justify="right")
    for r, res in points:
        t.add_row(f"{r:g}", f"{res.request_throughput:.2f}", f"{res.output_throughput:,.1f}", f"{res.ttft.p50_ms:,.1f}",
                  f"{res.ttft.p99_ms:,.1f}", f"{res.tpot.p50_ms:,.2f}", f"{res.tpot.p99_ms:,.2f}",
                  f"{res.e2e.p50_ms:,.1f}")
    console.print(t)


def add_mode(modes: Any) -> None:
    """``trnsim estimate serve`` beside ``inference`` and ``train``."""
    from ..config import system_names
    from ..workload.models import model_names

    p = modes.add_parser("serve", help="a serving run: requests arriving, continuous batching, chunked prefill; "
                                       "what vllm bench serve prints")
    p.add_argument("--model", required=True, help=f"a model ({', '.join(model_names())}) or a config.json path")
    p.add_argument("--system", default="trn2.48xlarge", help=f"a system ({', '.join(system_names())}) or a YAML "
                                                             f"path; default trn2.48xlarge")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    p.add_argument("--ep", type=int, default=1, help="expert parallelism within the TP group (default 1)")
    add_moe_routing_flag(p)
    p.add_argument("--dp", type=int, default=1, help="data-parallel replicas of the TP group, each with its own "
                                                     "scheduler and KV cache; a request goes to the least loaded "
                                                     "(default 1)")
    p.add_argument("--dtype", default="bf16", help="bf16 (the library kernels' dtype; the default)")
    p.add_argument("--set", action="append", default=[], metavar="K=V", help="dotted override of the system")
    p.add_argument("--rate", type=_rate, default=None, help="Poisson request rate per second, or inf: all at once "
                                                            "(default inf)")
    p.add_argument("--trace", metavar="FILE", help="requests from a CSV (arrival,input,output[,prefix,prefix_id]) or "
                                                   "JSON Lines file instead of Poisson arrivals")
    p.add_argument("--requests", type=int, default=200, help="requests (default 200)")
    p.add_argument("--input", type=int, default=1024, help="prompt tokens per request (default 1024)")
    p.add_argument("--output", type=int, default=128, help="output tokens per request (default 128)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrivals (default 0)")
    p.add_argument("--max-batch", type=int, default=32, help="sequences decoding at once (vLLM max_num_seqs; "
                                                             "default 32)")
    p.add_argument("--chunk", type=int, default=2048, help="most prompt tokens per prefill step: longer prompts are "
                                                           "prefilled in chunks (default 2048)")
    p.add_argument("--max-model-len", type=int, help="longest sequence (default: the longest request)")
    p.add_argument("--kv-tokens", type=int, help="KV-cache capacity in tokens (default: what the rank's HBM holds "
                                                 "beside the weights, at most max batch x the largest KV bucket, "
                                                 "as Neuron allocates the cache)")
    p.add_argument("--prefix-caching", action="store_true", help="reuse the KV of a prefix an earlier request "
                                                                 "prefilled")
    p.add_argument("--prefix-len", type=int, default=0, help="leading prompt tokens every Poisson request shares "
                                                             "(default 0)")
    add_bucket_flags(p, context=("prefill", "--chunk"), kv=("KV", "the max model len"), batch="--max-batch")
    p.add_argument("--sweep", type=_rates, metavar="R,R,...", help="run each Poisson rate; print latency against "
                                                                   "rate")
    p.add_argument("--plot", metavar="OUT.png", help="with --sweep: plot TTFT and TPOT p50/p99 against the rate")
    p.add_argument("--serving", default="vllm-neuron", choices=("vllm-neuron", "vllm-v0", "none"),
                   help="the serving engine's host loop: vllm-neuron schedules a step ahead (a step takes max(host, "
                        "device) while the batch is unchanged; the default), vllm-v0 runs host and device in turn, "
                        "none charges no engine")
    p.add_argument("--json", action="store_true", help="print the result(s) as JSON")
    p.add_argument("--no-cache", action="store_true", help="simulate every kernel again (no on-disk cost cache)")
    p.set_defaults(fn=cmd_serve)
