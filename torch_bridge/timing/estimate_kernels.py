"""``trnsim estimate inference`` as Neuron serves a model: each step is the NKI library kernels
NxD Inference lowers its layers to (:mod:`torch_bridge.nxdi`), at Neuron's bucketed shapes
(:mod:`trnsim.buckets`), charged on each simulated role's device model.

The model is built on ``meta`` (no weights) and its decoder layers matched into
:class:`~torch_bridge.nxdi.Layer` s; a step is the calls of the layers one rank holds plus the
embedding, the LM head and on-device sampling, issued after the step's one host dispatch (a
NEFF launch): kernels back to back on the compute stream, the TP collectives on the collective
stream (each waits for the compute before it, the compute after it waits for it). Kernel and
collective costs come from the cost cache (:mod:`trnsim.costcache`) or are simulated once per
shape. Weights and the KV cache (allocated for the largest batch and KV bucket, as Neuron
allocates it when the model loads) count against the rank's HBM.

:class:`StepCosts` times any step shape of a lowered model on one rank - what ``trnsim estimate
serve`` (:mod:`trnsim.serve`) builds its timeline from.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from trnsim.workload.buckets import Buckets, default_buckets
from trnsim.config import SystemConfig, load_system
from trnsim.device.costcache import CostCache, default_cache_dir
from trnsim.workload.plan import InferenceEstimate, Plan, Role, RoleMemory, check_batch, check_plan, check_sizes, summarise
from trnsim.workload.models import ModelConfig, load_model
from trnsim.workload.serve import HostLoop, ServeError
from trnsim.workload.speculation import Speculation, SpeculationError

from . import models, nxdi
from .nxdi import Call, Layer, Shards

__all__ = ["lowered", "estimate_inference_kernels", "StepCosts", "ASSUMPTIONS", "SPECULATION_ASSUMPTIONS",
           "speculative_tpot"]

ASSUMPTIONS = (
    "each step is one compiled graph (a NEFF at a bucketed shape): one host dispatch, kernels back to back",
    "decoder layers lowered to the NKI library kernels as NxD Inference runs them (qkv, attention_tkg / attention_cte, "
    "oproj, mlp; router_topk, moe_tkg / moe), TP collectives between them; prefill sequence-parallel by default",
    "on-device greedy sampling: each rank's max over its vocabulary shard, values and indices gathered",
    "KV cache allocated for the largest batch and KV bucket; a decode step attends over its KV bucket (a "
    "sliding-window layer keeps and reads a rolling cache of its window, rounded up to 128)",
    "MoE: the busiest expert-parallel rank bounds the step; its routed tokens by --moe-routing (default random: the "
    "expected maximum load when each token's picks land uniformly at random; balanced: the mean share)",
    "no speculative decoding; of the serving stack only the engine's host loop (--serving), no tokenizer or network",
)

#: what an estimate with --draft-model says in place of ASSUMPTIONS' last line
SPECULATION_ASSUMPTIONS = (
    "of the serving stack only the engine's host loop (--serving), no tokenizer or network",
    "fused speculation as NxDI runs it (enable_fused_speculation): the prefill is the target's then the draft's (no "
    "sequence parallelism for the draft) in one graph; a decode step is k single-token draft steps and one target step "
    "over k tokens with each position sampled, in one graph, over the KV bucket of the step's last position",
    "the draft at the target's TP (NxDI copies the target's neuron config), its query heads padded to a multiple of "
    "TP and its KV heads replicated (NxDI's get_shardable_head_counts); its weights and KV cache count against HBM",
    "a step yields sum_{i<k} a^i tokens on average (each draft token accepted with probability a until the first "
    "rejection); TPOT is the step's time over that, the engine's host loop paid once per step",
)


def speculative_tpot(steady: Sequence[tuple[int, float, int]], first: float, per_step: float) -> float:
    """TPOT of a speculative decode: ``steady`` (KV bucket, a fused step's wall ms, output
    positions in that bucket) each produce their positions in steps of ``per_step`` tokens; the
    first step after the prefill takes ``first`` instead of its bucket's time."""
    n = sum(c for _, _, c in steady)
    if not n:
        return 0.0
    return (sum(w * c / per_step for _, w, c in steady) - steady[0][1] + first) / n


def serving_times(host: HostLoop, prefill_ms: float, decode: Sequence[tuple[int, float, int]]
                  ) -> tuple[float, list[tuple[int, float, int]], float]:
    """(TTFT, decode steps as (KV, wall ms, count), the first decode step's wall ms) of one request
    batch under the engine's host loop: the prefill and the first decode step after it run with
    the flow broken (the batch changed), every later decode step keeps it."""
    ms = 1e-3
    ttft = host.step(prefill_ms * ms, False) / ms
    steady = [(kv, host.step(d * ms, True) / ms, n) for kv, d, n in decode]
    first = host.step(decode[0][1] * ms, False) / ms if decode else 0.0
    return ttft, steady, first


def mean_step(steady: Sequence[tuple[int, float, int]], first: float) -> float:
    """The mean decode step of ``steady`` with its first step taking ``first``."""
    steps = sum(n for _, _, n in steady)
    if not steps:
        return 0.0
    return (sum(w * n for _, w, n in steady) - steady[0][1] + first) / steps


@functools.lru_cache(maxsize=16)
def _matched(path: str, fields_key: str, layers: int | None) -> tuple[tuple[Layer, ...], int, int, float, bool]:
    import json

    from .. import _torch

    spec = ModelConfig(Path(path).stem, Path(path), json.loads(fields_key))
    models.register()
    cfg = models.hf_config(spec, layers)
    cfg._attn_implementation = models.ATTENTION
    from transformers import AutoModelForCausalLM

    with _torch.no_dispatch_modes(), torch.device("meta"), models._default_dtype(torch.bfloat16), models.quiet(), \
            models.refused_by_transformers(path):
        net = AutoModelForCausalLM.from_config(cfg, attn_implementation=models.ATTENTION)
    layers_ = tuple(nxdi.match_model(net))
    norm = getattr(getattr(net, net.base_model_prefix, net), "norm", None)
    eps = nxdi._eps(norm) if norm is not None else 1e-6
    return layers_, int(cfg.hidden_size), int(cfg.vocab_size), eps, bool(getattr(cfg, "tie_word_embeddings", False))


def lowered(spec: ModelConfig, shards: Shards) -> nxdi.Program:
    """``spec``'s decoder layers matched from its modules (built on meta; cached per config) for ``shards``."""
    import json

    layers, hidden, vocab, eps, tied = _matched(str(spec.path), json.dumps(spec.fields, sort_keys=True), None)
    prog = nxdi.Program(list(layers), shards, hidden, vocab, eps, tied)
    for layer in layers:  # the per-rank sizes: an impossible split is one line now, not mid-run
        nxdi.layer_weight_bytes(layer, shards)
    return prog


@functools.lru_cache(maxsize=4096)
def _layer_calls(layer: Layer, sh: Shards, batch: int, tokens: int, prior: int, cache: int, first: bool,
                 decode: bool) -> tuple[Call, ...]:
    return tuple(nxdi.lower_layer(layer, sh, batch=batch, tokens=tokens, prior=prior, cache=cache, first=first,
                                  decode=decode))


def step_calls(prog: nxdi.Program, role: Role, last: bool, *, batch: int, tokens: int, prior: int, cache: int,
               decode: bool, head_tokens: int = 1) -> list[Call]:
    """Every call of one rank's step: embedding, its layers, LM head and sampling (on the last
    ``head_tokens`` tokens of each sequence)."""
    before, after = nxdi.lower_step(prog.hidden, prog.vocab, prog.shards, batch=batch, tokens=tokens,
                                    first=role.first, last=last, eps=prog.eps, head_tokens=head_tokens)
    out = list(before)
    lo, hi = role.layers
    for i in range(lo, hi):
        out.extend(_layer_calls(prog.layers[i], prog.shards, batch, tokens, prior, cache, i == 0, decode))
    out.extend(after)
    return out


def charge(rank: Any, calls: Sequence[Call], dtype: str) -> None:
    """Launch ``calls`` on the rank (inside its timing-only run): kernels on the compute stream,
    collectives over its TP group on the collective stream."""
    from trnsim.isa import KernelError

    dev, run = rank.device, rank.run
    for c in calls:
        if c.spec is not None:
            try:
                cost = dev.cost(c.spec)
            except KernelError as e:
                raise nxdi.Unsupported(f"the library kernel {c.text()} refused its shape ({e}); a larger --tp or "
                                       f"--ep, or a shorter sequence, may give it one it takes") from None
            run.launch(0, c.op, cost)
        else:
            rank.comm.charge(c.collective, c.nbytes, rank.comm.tp_group, dtype)


def _memory(prog: nxdi.Program, role: Role, last: bool, batch: int, kv_tokens: int) -> tuple[int, int]:
    lo, hi = role.layers
    sh = prog.shards
    weights = sum(nxdi.layer_weight_bytes(prog.layers[i], sh) for i in range(lo, hi)) + \
        nxdi.step_weight_bytes(prog.hidden, prog.vocab, sh, role.first, last, prog.tied)
    kv = batch * sum(nxdi.cache_positions(prog.layers[i], kv_tokens) * nxdi.kv_bytes_per_token(prog.layers[i], sh)
                     for i in range(lo, hi))
    return weights, kv


def lowering_text(prog: nxdi.Program, *, batch: int, tokens: int, cache: int, decode: bool,
                  index: int | None = None) -> tuple[str, ...]:
    """The calls a layer became: the most common kind of layer (its first occurrence after layer 0,
    which has no residual to add, where there is one; ``index`` picks one)."""
    if index is None:
        kinds = [layer for layer in prog.layers]
        common = max(set(kinds), key=lambda k: (kinds.count(k), -kinds.index(k)))
        index = next((i for i, k in enumerate(kinds) if k == common and i > 0), kinds.index(common))
    i = index
    return nxdi.describe(_layer_calls(prog.layers[i], prog.shards, batch, tokens, 0, cache, i == 0, decode))


def layer_kinds(prog: nxdi.Program) -> tuple[str, ...]:
    """The distinct kinds of decoder layer, most common first, one line each: ``58 x MLA, MoE 256
    experts top 8 + shared MLP (layers 3-60)``."""
    groups: dict[Layer, list[int]] = {}
    for i, layer in enumerate(prog.layers):
        groups.setdefault(layer, []).append(i)
    out = []
    for layer, idx in sorted(groups.items(), key=lambda kv: (-len(kv[1]), kv[1][0])):
        a, f = layer.attention, layer.ffn
        extras = [x for x in ("q/k norm" if a.qk_norm else "", "sinks" if a.sinks else "",
                              f"window {a.window}" if a.window else "") if x]
        attn = ("MLA" if a.kind == "mla" else "GQA" if a.kv_heads < a.heads else "MHA") + \
            (f" ({', '.join(extras)})" if extras else "")
        ffn = f"MoE {f.experts} experts top {f.top_k}" + (" + shared MLP" if f.shared_inter else "") \
            if f.kind == "moe" else "dense MLP"
        span = f"layers {idx[0]}-{idx[-1]}" if idx == list(range(idx[0], idx[-1] + 1)) else \
            f"every other layer from {idx[0]}" if idx == list(range(idx[0], idx[-1] + 1, 2)) else f"{len(idx)} layers"
        out.append(f"{len(idx)} x {attn}, {ffn} ({span})")
    return tuple(out)


@dataclass
class _Step:
    ticks: int
    report: Any


def estimate_inference_kernels(model: str | ModelConfig, system: str | SystemConfig = "trn2.48xlarge", *, tp: int = 1,
                               pp: int = 1, dp: int = 1, ep: int = 1, sp: bool | None = None, batch: int = 1,
                               input_tokens: int = 1024, output_tokens: int = 128, dtype: str = "bf16",
                               overrides: Sequence[str] | None = None, cache_dir: str | Path | None | bool = True,
                               trace: bool = False, layers: int | None = None, max_context: int | None = None,
                               max_model_len: int | None = None, context_buckets: Sequence[int] | None = None,
                               kv_buckets: Sequence[int] | None = None, batch_buckets: Sequence[int] | None = None,
                               serving: str = "vllm-neuron", moe_routing: str = "random",
                               max_positions: int | None = None, draft_model: str | ModelConfig | None = None,
                               speculation_length: int | None = None, acceptance: Any = None
                               ) -> tuple[InferenceEstimate, list[Any]]:
    """TTFT, TPOT and tokens/s with the layers lowered to the library kernels (module docstring).

    ``sp`` None is Neuron's default (prefill sequence-parallel when ``tp > 1``); ``max_context``
    (default: the prompt) and ``max_model_len`` (default: prompt + output) set the default
    buckets, ``*_buckets`` replace them. ``draft_model``, ``speculation_length`` and
    ``acceptance`` run fused speculative decoding (:mod:`trnsim.workload.speculation`)."""
    from .roles import EstimateError, dtype_of, make_rank, positive, scope, send_recv_ticks, simulate_roles, with_layers

    t_wall = time.perf_counter()
    spec = with_layers(model if isinstance(model, ModelConfig) else load_model(model), layers)
    sysc = system if isinstance(system, SystemConfig) else load_system(system, list(overrides or []))
    for name, v in (("--batch", batch), ("--input", input_tokens), ("--output", output_tokens), ("--ep", ep)):
        positive(name, v)
    dt = dtype_of(dtype)
    try:
        host = HostLoop.of(serving, sysc.chip.host.serve_step * 1e-12)
    except ServeError as e:
        raise EstimateError(str(e)) from None
    if dtype not in nxdi.KERNEL_DTYPES:
        raise EstimateError(f"--dtype {dtype}: the library's transformer kernels take {' or '.join(nxdi.KERNEL_DTYPES)}; "
                            f"run --eager for {dtype}")
    sp_on = (tp > 1) if sp is None else bool(sp)
    plan = Plan(tp, pp, dp, sp_on)
    check_plan(spec, sysc, tp, pp, dp, dtype)
    check_sizes(spec, input_tokens=input_tokens, output_tokens=output_tokens, max_positions=max_positions)
    check_batch(spec, sysc, tp, pp, dtype, batch=batch, tokens=input_tokens + output_tokens)
    total = input_tokens + output_tokens
    mseq = total if max_model_len is None else positive("--max-model-len", max_model_len)
    mctx = mseq if max_context is None else positive("--max-context", max_context)  # NxDI: max_context_length = seq_len
    if total > mseq:
        raise EstimateError(f"--input {input_tokens:,} + --output {output_tokens:,} = {total:,} tokens, more than "
                            f"--max-model-len {mseq:,}")
    buckets = default_buckets(mctx, mseq, batch, tp=tp, sp=sp_on, context=context_buckets, kv=kv_buckets,
                              batch=batch_buckets, seq_default=max_model_len is None)
    if tp % ep:
        raise EstimateError(f"--ep {ep}: expert parallelism must divide --tp {tp} (NxDI: moe_ep_degree x "
                            f"moe_tp_degree = tp)")
    if moe_routing not in nxdi.ROUTINGS:
        raise EstimateError(f"--moe-routing {moe_routing!r}: expected one of {', '.join(nxdi.ROUTINGS)}")
    shards = Shards(tp, ep, sp_on, dtype, moe_routing)
    try:
        prog = lowered(spec, shards)
    except nxdi.Unsupported as e:
        raise EstimateError(str(e)) from None
    try:
        specu = Speculation.of(draft_model.name if isinstance(draft_model, ModelConfig) else draft_model,
                               speculation_length, acceptance)
    except SpeculationError as e:
        raise EstimateError(str(e)) from None
    dprog = None
    k = 1
    if specu is not None:
        if pp > 1:
            raise EstimateError(f"--draft-model with --pp {pp}: NxDI fuses the draft with a one-stage target")
        dspec = draft_model if isinstance(draft_model, ModelConfig) else load_model(str(draft_model))
        if dspec.fields.get("vocab_size") != spec.fields.get("vocab_size"):
            raise EstimateError(f"--draft-model {dspec.name}: vocabulary of {dspec.fields.get('vocab_size')} tokens, "
                                f"the target {spec.name}'s has {spec.fields.get('vocab_size')}; a draft shares the "
                                f"target's tokenizer")
        check_sizes(dspec, input_tokens=input_tokens, output_tokens=output_tokens, max_positions=max_positions)
        try:
            dprog = lowered(dspec, Shards(tp, 1, False, dtype, moe_routing, pad_heads=True))
        except nxdi.Unsupported as e:
            raise EstimateError(f"--draft-model {dspec.name}: {e}") from None
        k = specu.k
    if ep > 1 and not any(layer.ffn.kind == "moe" for layer in prog.layers):
        raise EstimateError(f"--ep {ep}: {spec.name} has no MoE experts to split")
    prompt = buckets.context_for(input_tokens)
    bb = buckets.batch_for(batch)
    if output_tokens > 1:  # the last decode step attends over total - 1 positions: a given --kv-buckets must hold it
        buckets.kv_for(total - 1)  # (the loop below clamps only a fused step's drafts past the sequence)
    # decode steps produce tokens 2..output: the one producing token k feeds token k - 1 and attends
    # over input + k - 1 positions (as trnsim.serve's decode steps)
    per_bucket: dict[int, list[int]] = {}
    for n in range(input_tokens + 1, total):  # speculation: the step's k tokens sit at n .. n + k - 1
        per_bucket.setdefault(buckets.kv_for(min(n + k - 1, buckets.kv[-1])), []).append(n)
    kv_alloc = buckets.kv[-1]
    cache = CostCache(default_cache_dir() if cache_dir is True else (cache_dir or None))
    reports: dict[tuple[Any, ...], Any] = {}
    refused: list[str] = []

    def run(rank: Any, last: bool) -> dict[str, Any]:
        role = rank.role
        draft_role = Role(0, (0, len(dprog.layers)), role.rank, role.ranks) if dprog is not None else role
        out: dict[str, Any] = {"traces": []}
        weights, kv = _memory(prog, role, last, bb, kv_alloc)
        if dprog is not None:
            dw, dkv = _memory(dprog, Role(0, (0, len(dprog.layers)), role.rank, role.ranks), True, bb, kv_alloc)
            weights, kv = weights + dw, kv + dkv
        with rank.run:
            rank.ledger.reserve(0, weights)
            rank.ledger.reserve(0, kv)
            with scope(rank.device, trace) as rep:
                start = rank.step_start()
                charge(rank, step_calls(prog, role, last, batch=bb, tokens=prompt, prior=0, cache=prompt,
                                        decode=False), dtype)
                if dprog is not None:
                    charge(rank, step_calls(dprog, draft_role, True, batch=bb, tokens=prompt, prior=0, cache=prompt,
                                            decode=False), dtype)
                out["prefill_ticks"] = rank.step_end(start)
            out["prefill_report"] = summarise(rep[0], out["prefill_ticks"])
            if trace:
                out["traces"].append(("prefill", role, rep[0]))
            out["decode"] = {}
            for i, kvb in enumerate(sorted(per_bucket)):
                with scope(rank.device, trace and i == 0) as rep:
                    start = rank.step_start()
                    if dprog is not None:
                        for _ in range(k):
                            charge(rank, step_calls(dprog, draft_role, True, batch=bb, tokens=1, prior=0, cache=kvb,
                                                    decode=True), dtype)
                    charge(rank, step_calls(prog, role, last, batch=bb, tokens=k, prior=0, cache=kvb, decode=True,
                                            head_tokens=k), dtype)
                    ticks = rank.step_end(start)
                out["decode"][kvb] = (ticks, summarise(rep[0], ticks))
                if trace and i == 0:
                    out["traces"].append(("decode", role, rep[0]))
        mem = rank.ledger.devices[0]
        out["memory"] = RoleMemory(role.stage, role.ranks, weights, kv, 0, mem.peak, mem.capacity)
        return out

    try:
        results, traces, memory, kernels = simulate_roles(spec, sysc, plan, cache, reports, run, refused)
    except nxdi.Unsupported as e:
        raise EstimateError(str(e)) from None
    hz = sysc.tick_hz
    hidden_bytes = spec.hidden * torch.empty((), dtype=dt).element_size()
    p2p_prefill = send_recv_ticks(sysc, plan, bb * prompt * hidden_bytes, reports, dtype)
    p2p_decode = send_recv_ticks(sysc, plan, bb * hidden_bytes, reports, dtype)
    stages = [results[r.stage] for r in plan.roles(spec.layers)]
    device_prefill = (sum(s["prefill_ticks"] for s in stages) + sum(p2p_prefill)) / hz * 1e3
    device_decode = [(min(ns), (sum(s["decode"][kvb][0] for s in stages) + sum(p2p_decode)) / hz * 1e3, len(ns))
                     for kvb, ns in sorted(per_bucket.items())]
    ttft, decode, first_step = serving_times(host, device_prefill, device_decode)
    tpot = mean_step(decode, first_step) if specu is None else \
        speculative_tpot(decode, first_step, specu.tokens_per_step)
    e2e_ms = ttft + (output_tokens - 1) * tpot
    per_request = output_tokens / (e2e_ms / 1e3) if e2e_ms else 0.0
    busiest = max(per_bucket, key=lambda k: len(per_bucket[k])) if per_bucket else None
    kv_read = sum(kvb * len(ns) for kvb, ns in per_bucket.items())
    kv_used = sum(sum(ns) for ns in per_bucket.values())
    padding = {"prefill_tokens": prompt, "prefill_padding_percent": 100.0 * (prompt - input_tokens) / prompt,
               "decode_kv_buckets": sorted(per_bucket), "decode_kv_padding_percent":
                   100.0 * (kv_read - kv_used) / kv_read if kv_read else 0.0,
               "batch_bucket": bb, "batch_padding_percent": 100.0 * (bb - batch) / bb}
    lowering = {"decode": lowering_text(prog, batch=bb, tokens=1, cache=busiest or kv_alloc, decode=True),
                "prefill": lowering_text(prog, batch=bb, tokens=prompt, cache=prompt, decode=False),
                "layers": layer_kinds(prog)}
    notes = []
    if prompt != input_tokens:
        notes.append(f"prompt of {input_tokens:,} tokens run in the context bucket of {prompt:,}")
    if bb != batch:
        notes.append(f"batch of {batch} run in the batch bucket of {bb}")
    speculation: dict[str, Any] = {}
    if specu is not None and dprog is not None:
        speculation = {"draft": specu.draft, "k": k, "acceptance": specu.acceptance, "source": specu.source,
                       "tokens_per_step": specu.tokens_per_step,
                       "draft_decode": lowering_text(dprog, batch=bb, tokens=1, cache=busiest or kv_alloc, decode=True)}
        notes.extend(SPECULATION_ASSUMPTIONS)
        notes.append(f"acceptance {specu.acceptance:g} per draft token: {specu.source}")
    est = InferenceEstimate(
        model=spec.name, system=sysc.name, config=sysc.chip.name, overrides=dict(sysc.overrides),
        plan={"tp": tp, "pp": pp, "dp": dp, "sp": sp_on and tp > 1, **({"ep": ep} if ep > 1 else {})}, ranks=plan.size,
        batch=batch, input_tokens=input_tokens, output_tokens=output_tokens, dtype=dtype, ttft_ms=ttft, tpot_ms=tpot,
        tpot_first_ms=first_step, tpot_last_ms=decode[-1][1] if decode else 0.0,
        tokens_per_s=per_request, system_tokens_per_s=per_request * batch * dp,
        decode_samples=tuple((n, ms) for n, ms, _ in decode),
        prefill=stages[0]["prefill_report"],
        decode=stages[0]["decode"][busiest][1] if busiest else stages[0]["prefill_report"],
        memory=tuple(memory), roles_simulated=len(memory), kernels_simulated=kernels, cache_hits=cache.hits,
        wall_s=time.perf_counter() - t_wall, assumptions=(ASSUMPTIONS if not speculation else ASSUMPTIONS[:-1]) + tuple(notes) + tuple(refused),
        lowering=lowering, buckets=buckets.to_dict(), padding=padding,
        decode_kv=busiest or 0, serving=serving, host_step_ms=host.step_s * 1e3, speculation=speculation)
    return est, traces


class StepCosts:
    """The time of any step shape of a lowered model on one simulated rank (stage 0 of a
    one-stage plan), each shape simulated once: ``prefill(batch, tokens, prior)`` and
    ``decode(batch, kv)`` in seconds. Kernel and collective costs come from the cost cache."""

    def __init__(self, spec: ModelConfig, system: SystemConfig, plan: Plan, shards: Shards,
                 cache_dir: str | Path | None | bool = True):
        from .roles import make_rank

        self.spec, self.system, self.plan, self.shards = spec, system, plan, shards
        self.prog = lowered(spec, shards)
        self.cache = CostCache(default_cache_dir() if cache_dir is True else (cache_dir or None))
        role = plan.roles(spec.layers)[0]
        self.role = Role(0, (0, spec.layers), role.rank, role.ranks)
        self.rank = make_rank(self.role, system, plan, self.cache, {})
        self._times: dict[tuple[Any, ...], float] = {}
        self.simulated_steps = 0

    def memory(self, batch: int, kv_tokens: int) -> tuple[int, int]:
        """(weights, KV-cache bytes) on the rank for a cache of ``batch x kv_tokens``."""
        return _memory(self.prog, self.role, True, batch, kv_tokens)

    def kv_bytes_per_token(self) -> int:
        """KV bytes per token of a sequence in the layers that cache every position (a
        sliding-window layer's rolling cache is :meth:`kv_bytes_per_sequence`)."""
        return sum(nxdi.kv_bytes_per_token(layer, self.shards) for layer in self.prog.layers
                   if not layer.attention.window)

    def kv_bytes_per_sequence(self, positions: int) -> int:
        """KV bytes of one sequence of ``positions`` in the sliding-window layers (their rolling
        caches, at most a window each)."""
        return sum(nxdi.cache_positions(layer, positions) * nxdi.kv_bytes_per_token(layer, self.shards)
                   for layer in self.prog.layers if layer.attention.window)

    def _time(self, key: tuple[Any, ...], **kw: Any) -> float:
        t = self._times.get(key)
        if t is None:
            rank = self.rank
            with rank.run:
                start = rank.step_start()
                charge(rank, step_calls(self.prog, self.role, True, **kw), self.shards.dtype)
                ticks = rank.step_end(start)
            t = self._times[key] = ticks / self.system.tick_hz
            self.simulated_steps += 1
        return t

    def prefill(self, batch: int, tokens: int, prior: int = 0) -> float:
        return self._time(("p", batch, tokens, prior), batch=batch, tokens=tokens, prior=prior, cache=tokens + prior,
                          decode=False)

    def decode(self, batch: int, kv: int) -> float:
        return self._time(("d", batch, kv), batch=batch, tokens=1, prior=0, cache=kv, decode=True)
