"""The step times and limits of ``trnsim estimate serve``: the lowered model's steps on one
simulated rank (:class:`torch_bridge.estimate_kernels.StepCosts`, every shape simulated once, its
kernels from the cost cache), Neuron's buckets for the serving limits, and the KV cache's capacity
from the rank's HBM."""

from __future__ import annotations

from typing import Any, Sequence

from trnsim.workload.buckets import default_buckets
from trnsim.config import load_system
from trnsim.workload.plan import Plan
from trnsim.workload.models import load_model
from trnsim.workload.serve import HostLoop, Request, ServeConfig, ServeError

from . import nxdi
from .estimate_kernels import StepCosts

__all__ = ["serve_setup"]


def serve_setup(args: Any, requests: Sequence[Request]) -> tuple[StepCosts, ServeConfig, dict[str, Any]]:
    """(step costs, scheduler config, setup for the report) of a ``trnsim estimate serve`` run."""
    spec = load_model(args.model)
    system = load_system(args.system, list(args.set))
    tp, ep = args.tp, args.ep
    if tp % ep:
        raise ServeError(f"--ep {ep}: expert parallelism must divide --tp {tp}")
    sp = tp > 1
    if args.dtype not in nxdi.KERNEL_DTYPES:
        raise ServeError(f"--dtype {args.dtype}: the library's transformer kernels take "
                         f"{' or '.join(nxdi.KERNEL_DTYPES)}")
    shards = nxdi.Shards(tp, ep, sp, args.dtype, getattr(args, "moe_routing", "random"))
    longest = max(r.prompt + r.output for r in requests)
    mlen = args.max_model_len or longest
    limit = spec.fields.get("max_position_embeddings")
    if isinstance(limit, int) and mlen > limit:
        raise ServeError(f"a request of {mlen:,} tokens (prompt + output): more than {spec.name}'s "
                         f"max_position_embeddings {limit:,}")
    chunk = min(args.chunk, mlen)
    buckets = default_buckets(chunk, mlen, args.max_batch, tp=tp, sp=sp, context=args.context_buckets,
                              kv=args.kv_buckets, batch=args.batch_buckets)
    try:
        costs = StepCosts(spec, system, Plan(tp, 1, 1, sp), shards, cache_dir=None if args.no_cache else True)
    except nxdi.Unsupported as e:
        raise ServeError(str(e)) from None
    if ep > 1 and not any(layer.ffn.kind == "moe" for layer in costs.prog.layers):
        raise ServeError(f"--ep {ep}: {spec.name} has no MoE experts to split")
    weights, _ = costs.memory(1, 0)
    capacity = system.chip.chip.hbm.capacity // system.ranks_per_chip
    per_token = costs.kv_bytes_per_token()
    # the sliding-window layers' rolling caches: one per sequence slot, allocated with the model
    rolling = args.max_batch * costs.kv_bytes_per_sequence(buckets.kv[-1])
    free = capacity - weights - rolling
    fits = (free // per_token if per_token else args.max_batch * buckets.kv[-1]) if free > 0 else 0
    if fits < 1:
        raise ServeError(f"{spec.name} at --tp {tp}: its weights ({weights / 2**30:.1f} GiB per rank) leave no HBM for "
                         f"a KV cache on {system.name}; use a larger --tp")
    kv_tokens = args.kv_tokens if args.kv_tokens else min(fits, args.max_batch * buckets.kv[-1])
    if args.kv_tokens and args.kv_tokens > fits:
        raise ServeError(f"--kv-tokens {args.kv_tokens:,}: more than the {fits:,} tokens of KV cache one rank's HBM "
                         f"holds beside the weights")
    host = HostLoop.of(getattr(args, "serving", "vllm-neuron"), system.chip.host.serve_step * 1e-12)
    cfg = ServeConfig(max_batch=args.max_batch, chunk=chunk, buckets=buckets, kv_tokens=int(kv_tokens),
                      prefix_caching=args.prefix_caching, max_model_len=mlen, host=host)
    setup = {"model": spec.name, "system": system.name, "config": system.chip.name, "tp": tp, "ep": ep,
             "dp": getattr(args, "dp", 1),
             "dtype": args.dtype, "max_batch": args.max_batch, "chunk": chunk, "max_model_len": mlen,
             "buckets": buckets.to_dict(), "prefix_caching": args.prefix_caching, "serving": getattr(args, "serving", "vllm-neuron"),
             "host_step_ms": host.step_s * 1e3,
             "weights_bytes_per_rank": weights, "kv_bytes_per_token_per_rank": per_token,
             "rolling_kv_bytes_per_rank": rolling}
    return costs, cfg, setup
