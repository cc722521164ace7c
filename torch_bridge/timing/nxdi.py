"""Decoder layers as NxD Inference runs them: the NKI library's kernels, not one kernel per aten op.

NxD Inference (and vLLM on Neuron, which runs NxDI's models) does not run a transformer layer op
by op: with its kernel flags on (``qkv_kernel_enabled``, ``attn_kernel_enabled``,
``mlp_kernel_enabled``, the trn2 tutorials' recipe) a layer is a handful of NKI library kernels
and the tensor-parallel collectives between them. This module lowers a model's decoder layers the
same way, by matching the modules of the Hugging Face model (built on ``meta``: no weights):

* :func:`match_model` reads each decoder layer's modules - its norms (RMSNorm), its attention
  (``q/k/v/o_proj``, optional per-head ``q_norm``/``k_norm``, attention ``sinks``, a sliding
  window; or DeepSeek's MLA ``q_a/q_b/kv_a/kv_b`` projections) and its feed-forward block (a
  gated MLP, or a router with experts, optionally with shared experts) - into a :class:`Layer`.
  A module it does not know is refused in one line (:class:`Unsupported`), never guessed at.
* :func:`lower_layer` turns a matched layer into the kernel calls one rank makes for a step
  (:class:`Call`: a library kernel's :class:`~trnsim.device.KernelSpec` or a collective), with
  NxD Inference's per-rank shapes (heads split over TP, KV heads replicated when TP exceeds them,
  experts split over EP and their intermediate over TP / EP) and its defaults:

  - **decode** (token generation): ``qkv`` (residual add + RMSNorm + QKV + RoPE) ->
    ``attention_tkg`` over the KV-cache bucket (the new token's K/V written into the cache) ->
    ``oproj`` -> all-reduce -> ``mlp`` (residual add + RMSNorm + gate/up/act/down) -> all-reduce;
    an MoE layer is ``rmsnorm`` -> ``router_topk`` -> ``moe_tkg`` (+ shared experts' ``mlp``) ->
    all-reduce;
  - **prefill** (context encoding) with sequence parallelism (vLLM Neuron's default, NxDI's
    ``sequence_parallel_enabled``: norms and residual adds on ``S / tp`` tokens, each block
    all-gathers its input and reduce-scatters its output): ``rmsnorm`` -> all-gather -> ``qkv``
    -> ``attention_cte`` (flash attention, causal; ``prior`` keys cached before a chunk) ->
    ``oproj`` -> reduce-scatter -> residual add -> ``rmsnorm`` -> all-gather -> ``mlp`` (or the
    ``moe`` kernel) -> reduce-scatter. Without SP (one rank, or a length TP does not divide) the
    decode layout's fused norms and all-reduces.

  Qwen3's q/k norm sits between the projection and RoPE, so its ``qkv`` runs without RoPE and
  the per-head ``rmsnorm`` and ``rope`` kernels follow (NxDI: the QKV kernel's fused RoPE is
  incompatible with it). MLA (DeepSeek-V3): its projections run as the library ``matmul``, its
  latent norms as ``rmsnorm``; decode attention (one new token, nope dim = v dim) is the
  ``mla_tkg`` kernel (absorbed W_uk/W_uv over the latent + rope-key cache); prefill (and decode
  otherwise) runs the absorbed form as ``bmm`` kernels (queries into the latent space, scores over
  the cached latents, ``softmax``, values, back through W_uv). A library kernel that
  refuses a shape refuses the estimate, in one line naming it: nothing stands in for it.
* :func:`lower_step` adds what surrounds the layers on the first and last pipeline stage: the
  embedding lookup (hidden-sharded, all-gathered), the final norm and the LM head on the last
  token of each sequence, and **on-device sampling** (NxDI's ``on_device_sampling``: each rank
  takes the greedy max over its vocabulary shard, only the values and indices are gathered).

A call list is data: ``trnsim estimate inference`` prints it (which kernels a decode and a
prefill layer became), and :mod:`torch_bridge.estimate` / :mod:`trnsim.serve` charge it on a
rank's device model, each kernel simulated once per shape and cached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from trnsim.config import ConfigError
from trnsim.device import KernelSpec

__all__ = ["Unsupported", "KERNEL_DTYPES", "Attention", "FeedForward", "Layer", "Call", "Shards", "match_model", "lower_layer",
           "lower_step", "layer_weight_bytes", "step_weight_bytes", "kv_bytes_per_token", "cache_positions", "describe"]


class Unsupported(ConfigError):
    """A model feature the kernel lowering does not cover (one line naming it)."""


@dataclass(frozen=True)
class Attention:
    """A decoder layer's attention as matched (whole-model sizes, before sharding)."""

    kind: str  # "gqa" (q/k/v/o projections) or "mla" (DeepSeek's multi-head latent attention)
    heads: int
    kv_heads: int
    head_dim: int  # query/key head dim (MLA: nope + rope)
    v_head_dim: int
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    sinks: bool = False
    window: int = 0
    q_lora_rank: int = 0  # MLA
    kv_lora_rank: int = 0
    rope_dim: int = 0


@dataclass(frozen=True)
class FeedForward:
    """A decoder layer's feed-forward block as matched (whole-model sizes)."""

    kind: str  # "dense" or "moe"
    inter: int  # dense: intermediate size; moe: each expert's
    act: str = "silu"
    gated: bool = True
    experts: int = 0
    top_k: int = 0
    router_act: str = "softmax"
    router_bias: bool = False
    shared_inter: int = 0  # shared experts' intermediate size, summed (0: none)


@dataclass(frozen=True)
class Layer:
    """One decoder layer as matched from its modules."""

    hidden: int
    attention: Attention
    ffn: FeedForward
    eps: float = 1e-6


@dataclass(frozen=True)
class Call:
    """One thing a rank does in a step: a library kernel (``spec``) or a collective over the TP
    group (``collective`` of ``nbytes``, nccl-tests' S)."""

    op: str
    spec: KernelSpec | None = None
    collective: str = ""
    nbytes: int = 0

    def text(self) -> str:
        if self.spec is not None:
            s = self.spec
            params = ", ".join(f"{k}={v}" for k, v in s.params if k != "shard")
            return f"{self.op} {'x'.join(map(str, s.shape))}" + (f" ({params})" if params else "")
        return f"{self.collective} {self.nbytes:,} B"


@dataclass(frozen=True)
class Shards:
    """How a rank holds a model: ``tp`` ranks share each layer; MoE experts are split over ``ep``
    of them and each expert's intermediate over ``tp / ep`` (NxDI's moe_ep_degree x
    moe_tp_degree = tp); ``sp`` runs prefill sequence-parallel."""

    tp: int = 1
    ep: int = 1
    sp: bool = False
    dtype: str = "bf16"
    routing: str = "random"  # MoE token routing over the EP ranks (:data:`ROUTINGS`, :func:`routed_load`)
    pad_heads: bool = False  # query heads padded to a multiple of TP (:func:`rank_heads`; a fused draft model)

    @property
    def dtype_bytes(self) -> int:
        return 4 if self.dtype == "fp32" else 2


# ---- matching --------------------------------------------------------------------------------------
def _linear_dims(mod: Any) -> tuple[int, int, bool]:
    """(in, out, has bias) of an nn.Linear-like module (or a sharded one of torch_bridge.parallel)."""
    w = getattr(mod, "weight", None)
    if w is None or w.dim() != 2:
        raise Unsupported(f"{type(mod).__name__}: expected a linear projection with a 2-d weight")
    out, inp = (w.shape[0], w.shape[1]) if hasattr(mod, "in_features") and w.shape[1] == mod.in_features \
        else (w.shape[1], w.shape[0])
    return int(inp), int(out), getattr(mod, "bias", None) is not None


def _is_rmsnorm(mod: Any) -> bool:
    return mod is not None and "rmsnorm" in type(mod).__name__.lower()


def _eps(mod: Any) -> float:
    for name in ("variance_epsilon", "eps"):
        v = getattr(mod, name, None)
        if isinstance(v, float):
            return v
    return 1e-6


def _act(fn: Any, where: str) -> str:
    name = type(fn).__name__.lower() if fn is not None else ""
    if "silu" in name or "swish" in name:
        return "silu"
    if "gelu" in name:
        return "gelu_tanh" if "tanh" in name or "new" in name or "fast" in name else "gelu"
    if "relu" in name:
        return "relu"
    raise Unsupported(f"{where}: activation {type(fn).__name__}: the library MLP kernels take silu, gelu or relu")


def _match_attention(attn: Any, cfg: Any, where: str) -> Attention:
    names = {n for n, _ in attn.named_children()}
    if {"q_proj", "k_proj", "v_proj", "o_proj"} <= names:
        d = int(getattr(attn, "head_dim", 0) or getattr(cfg, "head_dim", 0) or cfg.hidden_size // cfg.num_attention_heads)
        _, q_out, qb = _linear_dims(attn.q_proj)
        _, k_out, _ = _linear_dims(attn.k_proj)
        _, _, ob = _linear_dims(attn.o_proj)
        window = getattr(attn, "sliding_window", None)
        return Attention("gqa", q_out // d, k_out // d, d, d, qkv_bias=qb, o_bias=ob,
                         qk_norm=_is_rmsnorm(getattr(attn, "q_norm", None)) and _is_rmsnorm(getattr(attn, "k_norm", None)),
                         sinks=getattr(attn, "sinks", None) is not None,
                         window=int(window) if isinstance(window, int) and window > 0 else 0)
    if "kv_a_proj_with_mqa" in names and "kv_b_proj" in names and "o_proj" in names:
        heads = int(cfg.num_attention_heads)
        nope, rope = int(cfg.qk_nope_head_dim), int(cfg.qk_rope_head_dim)
        return Attention("mla", heads, heads, nope + rope, int(cfg.v_head_dim),
                         o_bias=_linear_dims(attn.o_proj)[2], q_lora_rank=int(getattr(cfg, "q_lora_rank", 0) or 0),
                         kv_lora_rank=int(cfg.kv_lora_rank), rope_dim=rope)
    raise Unsupported(f"{where}: attention {type(attn).__name__} ({', '.join(sorted(names)) or 'no submodules'}): "
                      f"neither q/k/v/o projections nor DeepSeek's MLA; run it with --eager")


def _experts_count(cfg: Any) -> int:
    for name in ("num_local_experts", "num_experts", "n_routed_experts"):
        v = getattr(cfg, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return 0


def _match_ffn(mlp: Any, cfg: Any, where: str) -> FeedForward:
    names = {n for n, _ in mlp.named_children()}
    if {"gate_proj", "up_proj", "down_proj"} <= names:
        _, inter, _ = _linear_dims(mlp.gate_proj)
        return FeedForward("dense", inter, _act(getattr(mlp, "act_fn", None), where))
    router = getattr(mlp, "gate", None) if "gate" in names else getattr(mlp, "router", None)
    experts = getattr(mlp, "experts", None)
    if router is not None and experts is not None:
        e = _experts_count(cfg)
        k = int(getattr(cfg, "num_experts_per_tok", 0) or 0)
        inter = int(getattr(cfg, "moe_intermediate_size", 0) or getattr(cfg, "intermediate_size", 0) or 0)
        if not (e and k and inter):
            raise Unsupported(f"{where}: MoE block {type(mlp).__name__}: the config gives no expert count, top-k or "
                              f"expert intermediate size")
        shared = 0
        sh = getattr(mlp, "shared_experts", None) or getattr(mlp, "shared_expert", None)
        if sh is not None:
            shared = _linear_dims(sh.gate_proj)[1]
        scoring = str(getattr(cfg, "scoring_func", "softmax") or "softmax")
        bias = getattr(router, "bias", None) is not None or getattr(router, "e_score_correction_bias", None) is not None
        fn = getattr(experts, "act_fn", None)  # gpt-oss's experts gate with their own clamped swish: as silu
        return FeedForward("moe", inter, _act(fn, where) if fn is not None else "silu", True, e, k,
                           "sigmoid" if scoring == "sigmoid" or cfg.model_type.startswith("deepseek") else "softmax",
                           bias, shared)
    raise Unsupported(f"{where}: feed-forward block {type(mlp).__name__} ({', '.join(sorted(names)) or 'none'}): "
                      f"neither a gated MLP nor a router with experts; run it with --eager")


#: config fields naming features the lowering refuses (the value decides): field -> why
_REFUSED_FIELDS = {
    "quantization_config": "a quantised checkpoint ({v}): trnsim estimates bf16, fp16 or fp32 weights; remove the "
                           "field to estimate the model unquantised",
    "num_nextn_predict_layers": None,  # DeepSeek's multi-token-prediction layer: not part of the decoder run
}


def match_model(net: Any) -> list[Layer]:
    """Each decoder layer of ``net`` (a transformers causal LM or base model, on meta) as a
    :class:`Layer`; a feature the kernels do not cover is one :class:`Unsupported` line."""
    cfg = net.config
    q = getattr(cfg, "quantization_config", None)
    if q:
        method = q.get("quant_method", "?") if isinstance(q, dict) else getattr(q, "quant_method", "?")
        raise Unsupported(_REFUSED_FIELDS["quantization_config"].format(v=f"quantization_config.quant_method={method}"))
    base = getattr(net, net.base_model_prefix, net)
    layers = getattr(base, "layers", None)
    if layers is None or not len(layers):
        raise Unsupported(f"model type '{cfg.model_type}' has no decoder layers (model.layers) to lower to kernels")
    out = []
    for i, layer in enumerate(layers):
        where = f"{cfg.model_type} layer {i}"
        n1, n2 = getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None)
        if not (_is_rmsnorm(n1) and _is_rmsnorm(n2)):
            kinds = {type(n1).__name__, type(n2).__name__}
            raise Unsupported(f"{where}: norms {', '.join(sorted(kinds))}: the library kernels fuse RMSNorm only; run "
                              f"it with --eager")
        attn = getattr(layer, "self_attn", None)
        mlp = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
        if attn is None or mlp is None:
            raise Unsupported(f"{where}: expected self_attn and mlp blocks; run it with --eager")
        a = _match_attention(attn, cfg, where)
        lt = getattr(cfg, "layer_types", None)
        if a.window == 0 and isinstance(lt, (list, tuple)) and i < len(lt) and lt[i] == "sliding_attention":
            w = getattr(cfg, "sliding_window", None)
            if isinstance(w, int) and w > 0:
                a = Attention(**{**a.__dict__, "window": w})
        out.append(Layer(int(cfg.hidden_size), a, _match_ffn(mlp, cfg, where), _eps(n1)))
    return out


# ---- per-rank sizes ----------------------------------------------------------------------------------
def _div(what: str, n: int, tp: int, flag: str = "--tp") -> int:
    if n % tp:
        raise Unsupported(f"{flag} {tp}: {what} {n} is not a multiple of {tp}")
    return n // tp


def rank_heads(a: Attention, tp: int, pad: bool = False) -> tuple[int, int]:
    """(query heads, kv heads) on one rank: heads split over TP; KV heads split when TP divides
    them, else replicated so each rank holds one (NxDI's REPLICATE_TO_TP_DEGREE). ``pad``: query
    heads TP does not divide are padded up to a multiple of it (NxDI's
    ``get_shardable_head_counts``: a Llama-3.2-1B draft's 32 heads at TP 64 are 64, one a rank)."""
    nq = -(-a.heads // tp) if pad and a.kind != "mla" else _div("num_attention_heads", a.heads, tp)
    if a.kind == "mla":
        return nq, nq
    if a.kv_heads % tp == 0:
        return nq, a.kv_heads // tp
    if tp % a.kv_heads:
        raise Unsupported(f"--tp {tp}: num_key_value_heads {a.kv_heads} neither divides nor is divided by {tp}")
    return nq, 1


def experts_on_rank(f: FeedForward, sh: Shards) -> tuple[int, int, int]:
    """(experts, intermediate per expert, routed picks per token) on one rank: experts over EP,
    each expert's intermediate over TP / EP; the most picks a token makes on this rank if its
    top-k spread evenly (:func:`routed_load` says what the busiest rank's kernel runs)."""
    if sh.tp % sh.ep:
        raise Unsupported(f"--ep {sh.ep}: expert parallelism must divide --tp {sh.tp} (NxDI: moe_ep_degree x "
                          f"moe_tp_degree = tp)")
    e = _div("the experts", f.experts, sh.ep, "--ep")
    inter = _div("the expert intermediate size", f.inter, sh.tp // sh.ep, "--tp / --ep")
    picks = max(1, -(-f.top_k * e // f.experts))
    return e, inter, min(picks, e, 8)


#: how a step's routed tokens spread over the expert-parallel ranks (the busiest rank bounds the step)
ROUTINGS = {
    "random": "each token's picks land on the ranks' experts uniformly at random: the busiest EP rank "
              "takes the expected maximum of the ranks' loads",
    "balanced": "every EP rank takes its mean share of the step's token-expert pairs (rounded up)",
}


def expected_max_binomial(n: int, p: float, ranks: int) -> float:
    """E[max of ``ranks`` independent Binomial(n, p)]: ``sum_j (1 - F(j)^ranks)``."""
    if n <= 0 or p <= 0.0:
        return 0.0
    if p >= 1.0 or ranks <= 1:
        return n * min(p, 1.0)
    j = np.arange(n + 1, dtype=np.float64)
    logpmf = (math.lgamma(n + 1) - np.array([math.lgamma(x + 1) for x in j]) -
              np.array([math.lgamma(n - x + 1) for x in j]) + j * math.log(p) + (n - j) * math.log1p(-p))
    cdf = np.minimum(np.cumsum(np.exp(logpmf)), 1.0)
    return float(np.sum(1.0 - np.exp(ranks * np.log(np.maximum(cdf[:-1], 1e-300)))))


def routed_load(f: FeedForward, sh: Shards, tokens: int) -> tuple[int, int]:
    """(tokens, picks per token) the busiest EP rank's expert kernel runs for a step of
    ``tokens`` routed tokens: the step's ``tokens x top_k`` token-expert pairs land on this rank's
    experts with probability ``experts_on_rank / experts``; the rank's load is the mean share
    (``balanced``) or the expected maximum over the EP ranks (``random``: independent picks,
    rounded to whole pairs, never below the mean share), laid out as that many pairs over as
    few tokens as the rank's experts allow (a token visits each expert at most once)."""
    e, _, _ = experts_on_rank(f, sh)
    k = min(f.top_k, f.experts)
    cap = min(k, e, 8)
    if sh.ep == 1:
        return tokens, cap
    if sh.routing not in ROUTINGS:
        raise Unsupported(f"--moe-routing {sh.routing!r}: expected one of {', '.join(ROUTINGS)}")
    pairs, p = tokens * k, e / f.experts
    mean = math.ceil(pairs * p - 1e-9)
    load = mean if sh.routing == "balanced" else max(mean, int(math.floor(expected_max_binomial(pairs, p, sh.ep) + 0.5)))
    load = max(1, min(load, tokens * cap))
    picks = min(cap, -(-load // tokens))
    return min(tokens, -(-load // picks)), picks


def cache_positions(layer: Layer, positions: int) -> int:
    """KV-cache positions ``layer`` keeps of a sequence of ``positions``: a sliding-window layer
    keeps a rolling cache of its window rounded up to a multiple of 128 (NxDI's
    ``get_kernel_cache_size_bucket``: the attention kernels take multiples of 128; gpt-oss's KV
    cache manager), never more than the sequence's."""
    w = layer.attention.window
    return min(positions, -(-w // 128) * 128) if w else positions


def kv_bytes_per_token(layer: Layer, sh: Shards) -> int:
    """KV-cache bytes one token takes in one layer on one rank (K and V of the rank's kv heads;
    MLA: the compressed latent and the rope key, replicated on every rank)."""
    a = layer.attention
    if a.kind == "mla":
        return (a.kv_lora_rank + a.rope_dim) * sh.dtype_bytes
    _, nkv = rank_heads(a, sh.tp, sh.pad_heads)
    return 2 * nkv * a.head_dim * sh.dtype_bytes


def layer_weight_bytes(layer: Layer, sh: Shards) -> int:
    """Bytes of one rank's weights of ``layer`` (the projections, norms, router and experts it holds)."""
    a, f, h, b = layer.attention, layer.ffn, layer.hidden, sh.dtype_bytes
    nq, nkv = rank_heads(a, sh.tp, sh.pad_heads)
    if a.kind == "gqa":
        attn = h * (nq + 2 * nkv) * a.head_dim + nq * a.v_head_dim * h
        attn += ((nq + 2 * nkv) * a.head_dim if a.qkv_bias else 0) + (h if a.o_bias else 0) + (nq if a.sinks else 0)
        attn += 2 * a.head_dim if a.qk_norm else 0
    else:
        q = h * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * nq * a.head_dim if a.q_lora_rank else h * nq * a.head_dim
        attn = q + h * (a.kv_lora_rank + a.rope_dim) + a.kv_lora_rank + \
            a.kv_lora_rank * nq * (a.head_dim - a.rope_dim + a.v_head_dim) + nq * a.v_head_dim * h
    if f.kind == "dense":
        ffn = (3 if f.gated else 2) * h * _div("intermediate_size", f.inter, sh.tp)
    else:
        e, inter, _ = experts_on_rank(f, sh)
        ffn = e * 3 * h * inter + h * f.experts + (f.experts if f.router_bias else 0)
        if f.shared_inter:
            ffn += 3 * h * _div("the shared experts' intermediate size", f.shared_inter, sh.tp)
    return (attn + ffn + 2 * h) * b


def step_weight_bytes(hidden: int, vocab: int, sh: Shards, first: bool, last: bool, tied: bool = False) -> int:
    """Bytes of one rank's weights outside the decoder layers: the embedding (hidden-sharded) on
    the first stage, the final norm and the LM head (vocabulary-sharded, padded to TP) on the last."""
    out = 0
    if first:
        out += vocab * (hidden // sh.tp) * sh.dtype_bytes
    if last:
        out += (hidden + (0 if tied and first else hidden * -(-vocab // sh.tp))) * sh.dtype_bytes
    return out


# ---- lowering --------------------------------------------------------------------------------------
def _k(op: str, shape: Sequence[int], dtype: str, params: dict[str, Any] | None = None) -> Call:
    """A library kernel's call; a kernel that refuses the shape is refused by the estimate (no
    stand-in: :func:`torch_bridge.estimate_kernels.charge` names it in one line)."""
    return Call(op, KernelSpec.of(op, shape, dtype, params or {}, label=op))


def _c(collective: str, nbytes: int) -> Call:
    return Call(collective.replace("-", "_"), collective=collective, nbytes=int(nbytes))


#: the dtypes every library kernel a lowered step launches takes (an estimate in another is refused)
KERNEL_DTYPES = ("bf16",)


def _kdt(dtype: str) -> str:
    if dtype not in KERNEL_DTYPES:
        raise Unsupported(f"--dtype {dtype}: the library's transformer kernels take {' or '.join(KERNEL_DTYPES)}")
    return dtype


def lower_layer(layer: Layer, sh: Shards, *, batch: int, tokens: int, prior: int, cache: int, first: bool,
                decode: bool) -> list[Call]:
    """The calls one rank makes for ``layer`` in a step of ``batch`` sequences of ``tokens`` new
    tokens each (decode: 1), ``prior`` tokens already cached per sequence (a prefill chunk's
    prefix), over a KV cache bucket of ``cache`` positions (decode; a multiple of 128).
    ``first``: the first layer (no residual add before its norm)."""
    a, h = layer.attention, layer.hidden
    dt = _kdt(sh.dtype)
    tp = sh.tp
    b2 = sh.dtype_bytes
    nq, nkv = rank_heads(a, tp, sh.pad_heads)
    t = batch * tokens
    sp = sh.sp and not decode and tp > 1 and tokens % tp == 0
    calls: list[Call] = []
    reduce = (lambda n: [_c("reduce-scatter", n)]) if sp else (lambda n: [_c("all-reduce", n)] if tp > 1 else [])
    act_bytes = t * h * b2

    def pre_block(norm_fused: bool) -> bool:
        """SP: residual add and RMSNorm on this rank's S / tp tokens, then the all-gather; returns
        whether the block's own kernel still fuses the norm (no SP)."""
        if not sp:
            return norm_fused
        rows = t // tp
        if not first or calls:
            calls.append(_k("binary", (rows, h), dt, {"op": "add"}))
        calls.append(_k("rmsnorm", (rows, h), dt, {"eps": layer.eps}))
        calls.append(_c("all-gather", act_bytes))
        return False

    # attention block
    fused_norm = pre_block(True)
    if a.kind == "gqa":
        rope_fused = not a.qk_norm
        calls.append(_k("qkv", (batch, tokens, h, nq, nkv, a.head_dim), dt,
                        {"residual": fused_norm and not first, "norm": "rmsnorm" if fused_norm else "none",
                         "rope": rope_fused, "bias": a.qkv_bias, "eps": layer.eps}))
        if a.qk_norm:
            calls.append(_k("rmsnorm", (t * (nq + nkv), a.head_dim), dt, {"eps": layer.eps}))
            calls.append(_k("rope", (batch, nq + nkv, tokens, a.head_dim), dt))
        qk_d, v_d, kv_heads = a.head_dim, a.v_head_dim, nkv
    else:  # MLA: no library kernel; its projections as matmuls, attention in the absorbed (latent) form
        if fused_norm:  # no fused norm for MLA: residual add and RMSNorm of their own
            if not first:
                calls.append(_k("binary", (t, h), dt, {"op": "add"}))
            calls.append(_k("rmsnorm", (t, h), dt, {"eps": layer.eps}))
        if a.q_lora_rank:
            calls.append(_k("matmul", (t, h, a.q_lora_rank), dt, {"transpose_a": True}))
            calls.append(_k("rmsnorm", (t, a.q_lora_rank), dt, {"eps": layer.eps}))
            calls.append(_k("matmul", (t, a.q_lora_rank, nq * a.head_dim), dt, {"transpose_a": True}))
        else:
            calls.append(_k("matmul", (t, h, nq * a.head_dim), dt, {"transpose_a": True}))
        latent = a.kv_lora_rank + a.rope_dim
        calls.append(_k("matmul", (t, h, latent), dt, {"transpose_a": True}))
        calls.append(_k("rmsnorm", (t, a.kv_lora_rank), dt, {"eps": layer.eps}))
        calls.append(_k("rope", (batch, nq + 1, tokens, a.rope_dim), dt))
        nope = a.head_dim - a.rope_dim
        if decode and tokens == 1 and nope == a.v_head_dim:
            # the MLA decode kernel: absorbed W_uk / W_uv, scores and values over the latent cache
            calls.append(_k("mla_tkg", (batch, nq, cache, a.kv_lora_rank, a.rope_dim, nope), dt))
        else:
            keys = cache if decode else prior + tokens
            rows = nq * tokens
            calls.append(_k("bmm", (nq, t, nope, a.kv_lora_rank), dt))  # q_nope . W_uk: queries into the latent space
            calls.append(_k("bmm", (batch, rows, latent, keys), dt))  # scores over the cached latents (+ rope keys)
            calls.append(_k("softmax", (batch * rows, keys), dt))
            calls.append(_k("bmm", (batch, rows, keys, a.kv_lora_rank), dt))  # . the latent values
            calls.append(_k("bmm", (nq, t, a.kv_lora_rank, a.v_head_dim), dt))  # W_uv: back to each head's values
        calls.append(_k("oproj", (batch, tokens, nq, a.v_head_dim, h), dt, {"bias": a.o_bias}))
        calls.extend(reduce(act_bytes))
        return _ffn(calls, layer, sh, batch, tokens, decode, pre_block, reduce, act_bytes)
    d_attn = max(qk_d, v_d)
    if decode:
        calls.append(_k("attention_tkg", (batch, nq, kv_heads, tokens, cache_positions(layer, cache), d_attn), dt,
                        {"window": a.window, "sinks": a.sinks, "cache_update": True}))
    else:
        calls.append(_k("attention_cte", (batch, nq, kv_heads, tokens, d_attn), dt,
                        {"causal": True, "window": a.window, "sinks": a.sinks, "prior": prior}))
    calls.append(_k("oproj", (batch, tokens, nq, v_d, h), dt, {"bias": a.o_bias}))
    calls.extend(reduce(act_bytes))
    return _ffn(calls, layer, sh, batch, tokens, decode, pre_block, reduce, act_bytes)


def _ffn(calls: list[Call], layer: Layer, sh: Shards, batch: int, tokens: int, decode: bool, pre_block: Any,
         reduce: Any, act_bytes: int) -> list[Call]:
    """The feed-forward block's calls, appended to ``calls`` (see :func:`lower_layer`)."""
    f, h, tp = layer.ffn, layer.hidden, sh.tp
    dt = _kdt(sh.dtype)
    t = batch * tokens
    fused_norm = pre_block(True)
    if f.kind == "dense":
        calls.append(_k("mlp", (batch, tokens, h, _div("intermediate_size", f.inter, tp)), dt,
                        {"residual": fused_norm, "norm": "rmsnorm" if fused_norm else "none",
                         "act": f.act, "gated": f.gated, "eps": layer.eps}))
    else:
        e, inter, _ = experts_on_rank(f, sh)
        t_rank, picks = routed_load(f, sh, t)  # the busiest EP rank's routed tokens
        if fused_norm:
            calls.append(_k("binary", (t, h), dt, {"op": "add"}))
            calls.append(_k("rmsnorm", (t, h), dt, {"eps": layer.eps}))
        if decode and t <= 128:
            calls.append(_k("router_topk", (t, h, f.experts), dt,
                            {"top_k": min(f.top_k, 8), "act": f.router_act, "bias": f.router_bias}))
            calls.append(_k("moe_tkg", (t_rank, h, inter, e), dt, {"top_k": picks, "act": f.act}))
        else:  # the library's blockwise MoE over the tokens routed to this rank's experts
            calls.append(_k("moe", (t_rank, h, inter, e), dt, {"top_k": picks}))
        if f.shared_inter:
            calls.append(_k("mlp", (batch, tokens, h, _div("the shared experts' intermediate size", f.shared_inter, tp)),
                            dt, {"residual": False, "norm": "none", "act": f.act}))
    calls.extend(reduce(act_bytes))
    return calls


def lower_step(hidden: int, vocab: int, sh: Shards, *, batch: int, tokens: int, first: bool, last: bool,
               eps: float = 1e-6, head_tokens: int = 1) -> tuple[list[Call], list[Call]]:
    """(calls before the layers, calls after them) of one rank's step: the embedding lookup of the
    step's tokens (hidden-sharded, all-gathered) on the first stage; on the last, the final norm
    and the LM head on each sequence's last token, and on-device greedy sampling (each rank's max
    over its vocabulary shard, the values and indices all-gathered: NxDI's on-device sampling).
    ``head_tokens``: the last tokens of each sequence the LM head and sampling run on (a fused
    speculation step's target verifies ``k`` tokens: each gets the target's own next token)."""
    dt = _kdt(sh.dtype)
    tp, b2 = sh.tp, sh.dtype_bytes
    t = batch * tokens
    before: list[Call] = []
    after: list[Call] = []
    if first:
        before.append(_k("embedding", (t, vocab, hidden // tp), dt))
        if tp > 1:
            before.append(_c("all-gather", t * hidden * b2))
    if last:
        rows = batch * head_tokens
        after.append(_k("rmsnorm", (rows, hidden), dt, {"eps": eps}))
        v = -(-vocab // tp)
        after.append(_k("matmul", (rows, hidden, v), dt, {"transpose_a": True}))
        after.append(_k("reduce", (rows, v), dt, {"op": "max"}))
        if tp > 1:
            after.append(_c("all-gather", rows * 8 * tp))
    return before, after


def describe(calls: Sequence[Call]) -> tuple[str, ...]:
    """Each call as one line: ``qkv 1x1x8192x1x1x128 (residual=True, ...)`` or ``all_reduce 16,384 B``."""
    return tuple(c.text() for c in calls)


@dataclass
class Program:
    """A model lowered for one rank: its decoder layers (matched), the shards, the sizes that
    surround the layers."""

    layers: list[Layer]
    shards: Shards
    hidden: int
    vocab: int
    eps: float = 1e-6
    tied: bool = False
    notes: list[str] = field(default_factory=list)
