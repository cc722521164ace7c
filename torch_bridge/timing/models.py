"""Hugging Face models on the neuron device without weights, and the ``"neuron"`` attention and
experts implementations an estimate runs them with.

* :func:`from_config` builds a model from a config (a :class:`transformers.PretrainedConfig`,
  a shipped model name or a ``config.json`` path) on ``torch.device("meta")`` - nothing is
  allocated, no init kernel runs - and, inside a timing-only run, puts its parameters on the
  device as timing-only tensors (their HBM counts).
* ``attn_implementation="neuron"`` is causal attention as one fused op
  (``F.scaled_dot_product_attention`` with ``is_causal`` and grouped KV heads), the way Neuron's
  flash-attention kernels run it: no mask tensor is built, so no padding either (the estimate's
  batches are unpadded). Registered with transformers' AttentionInterface; without a mask
  function, transformers builds no mask for it.
* ``experts_implementation="neuron"`` (Mixtral-style MoE) routes tokens evenly: every expert
  gets ``tokens x top_k / experts`` of them (when there are fewer routed tokens than experts, as
  in a decode step, that many experts take one each), as a grouped matmul - the balanced-routing
  assumption of an estimate, which cannot see the router's values. On tensors with values it
  runs transformers' own loop (the real routing).
* :func:`kv_cache` preallocates each layer's keys and values for the whole sequence (as Neuron's
  inference libraries do) and updates them in place, so a decode step reads exactly the cache it
  attends over and a prefill copies its keys in once.
"""

from __future__ import annotations

import contextlib
import weakref
from pathlib import Path
from typing import Any, Iterator

import torch

from trnsim.workload.models import ModelConfig, load_model

from .. import _torch
from .fake import is_timing_only, materialize

__all__ = ["from_config", "hf_config", "kv_cache", "KVCache", "register", "neuron_attention", "neuron_experts",
           "quiet", "ATTENTION"]

ATTENTION = "neuron"
CORE_ATTENTION = "neuron-core"  # NxD's CoreAttention: the scores, softmax and probabilities op by op
_registered: list[bool] = []


def register() -> None:
    """Register the ``"neuron"`` attention and experts implementations with transformers (once)."""
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.integrations.moe import ExpertsInterface

    AttentionInterface.register(ATTENTION, neuron_attention)
    AttentionInterface.register(CORE_ATTENTION, core_attention)
    ExpertsInterface.register(ATTENTION, neuron_experts)
    _registered.append(True)


def neuron_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Causal attention as one fused op ([B, H, L, D] in; [B, L, H, D] out, as transformers'
    attention functions return it)."""
    if getattr(module, "_trnsim_recompute_core", False) and torch.is_grad_enabled():
        from .checkpointing import checkpointed  # recomputed in the backward (see core_attention)

        return checkpointed(_neuron_attention)(module, query, key, value, attention_mask, dropout, scaling, is_causal)
    return _neuron_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal)


def _neuron_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float, scaling: float | None,
                      is_causal: bool | None) -> tuple[torch.Tensor, None]:
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = attention_mask is None and q_len > 1 and (is_causal if is_causal is not None
                                                       else getattr(module, "is_causal", True))
    if causal and kv_len != q_len:
        raise ValueError(f"neuron attention: a causal query of {q_len} tokens over {kv_len} cached keys needs a mask; "
                         f"run the prefill in one piece (or a decode step of one token)")
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=causal,
        enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


def core_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Causal attention as NxD's training examples of 2023 ran it (``CoreAttention`` in
    neuronx-distributed's Llama-2 example, SDK 2.15-2.16): ``q k^T / sqrt(d)``, the causal mask
    filled in (-10000), the softmax in fp32 cast back, the probabilities times ``v`` - each its own
    op, the scores and probabilities in HBM. A module marked ``_trnsim_recompute_core`` runs it
    under non-reentrant checkpointing (NxD's ``activation_checkpoint_config=CoreAttention``): its
    backward recomputes it and nothing of it is kept but its inputs."""
    if getattr(module, "_trnsim_recompute_core", False) and torch.is_grad_enabled():
        from .checkpointing import checkpointed

        return checkpointed(_core_attention)(module, query, key, value, attention_mask, dropout, scaling, is_causal)
    return _core_attention(module, query, key, value, attention_mask, dropout, scaling, is_causal)


_MASKS: "weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], torch.Tensor]]" = weakref.WeakKeyDictionary()


def _causal_mask(q_len: int, kv_len: int, device: Any) -> torch.Tensor:
    """The causal mask NxD's CoreAttention fills: ``torch.triu(ones, 1 + kv - q)``, made once per
    run and shape (a constant of the compiled graph). Marked ``_trnsim_causal`` (its diagonal): a
    fused region computes it from the indices (GpSimd's affine_select) instead of reading it."""
    from .fake import active

    run = active()
    cache = _MASKS.setdefault(run, {}) if run is not None else {}
    key = (q_len, kv_len, str(device))
    mask = cache.get(key)
    if mask is None:
        diag = 1 + kv_len - q_len
        mask = torch.ones((1, 1, q_len, kv_len), dtype=torch.bool, device=device).triu(diag)
        mask._trnsim_causal = diag
        cache[key] = mask
    return mask


def _core_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float, scaling: float | None,
                    is_causal: bool | None) -> tuple[torch.Tensor, None]:
    q_len, kv_len, groups = query.shape[2], key.shape[2], query.shape[1] // key.shape[1]
    if groups > 1:  # grouped KV heads: repeated to the query's, as NxD's example did (repeat_kv)
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    if attention_mask is not None:
        scores = scores + attention_mask
    elif q_len > 1 and (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        scores = scores.masked_fill(_causal_mask(q_len, kv_len, query.device), -10000.0)
    probs = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if dropout:
        probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


def neuron_experts(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor) -> torch.Tensor:
    """A Mixtral-style experts block with every expert taking ``tokens x top_k / experts`` tokens
    (balanced routing; see the module docstring; with fewer routed tokens than experts only that
    many experts run, one token each, and only their weights are read): gather, one grouped gate/up matmul, the gate's
    activation, one grouped down matmul, the routing weights, scatter-add back."""
    if not is_timing_only(hidden_states):
        return type(self).forward.__wrapped__(self, hidden_states, top_k_index, top_k_weights)  # type: ignore[attr-defined]
    tokens, hidden = hidden_states.shape
    k = top_k_index.shape[-1]
    experts = min(self.gate_up_proj.shape[0], tokens * k)  # a decode step's token visits only top_k experts
    per = -(-tokens * k // experts)
    pad = per * experts - tokens * k
    order = torch.argsort(top_k_index.reshape(-1))  # the permutation grouping tokens by expert
    idx, w = order // k, top_k_weights.reshape(-1).index_select(0, order)
    if pad:
        idx, w = torch.cat([idx, idx.new_zeros(pad)]), torch.cat([w, w.new_zeros(pad)])
    x = hidden_states.index_select(0, idx).view(experts, per, hidden)
    ep = getattr(self, "_trnsim_ep", None)  # expert parallelism: the routed tokens to their experts' ranks and back
    if ep is not None:
        x = ep(x)
    gate, up = torch.bmm(x, self.gate_up_proj[:experts].transpose(1, 2)).chunk(2, dim=-1)
    y = torch.bmm(self.act_fn(gate) * up, self.down_proj[:experts].transpose(1, 2)).view(-1, hidden)
    if ep is not None:
        y = ep(y)
    y = y * w.unsqueeze(-1).to(y.dtype)
    out = torch.zeros_like(hidden_states)
    out.index_add_(0, idx, y.to(out.dtype))
    hook = getattr(self, "_trnsim_after", None)  # tensor parallelism: the row-parallel reduction
    return hook(out) if hook is not None else out


@contextlib.contextmanager
def refused_by_transformers(where: Any) -> Iterator[None]:
    """transformers refusing a model config (an activation it lacks, an odd rotary dim, a
    rope_scaling without its factor, a field of the wrong type: a KeyError, ValueError, TypeError,
    AttributeError or huggingface_hub's StrictDataclassError from deep in its code) as one line
    naming the config, a :class:`~trnsim.config.ConfigError` (the CLI's status 2), instead of a
    traceback. The exception's type and first line stay in the message."""
    from trnsim.config import ConfigError

    try:
        yield
    except (ConfigError, ImportError):  # (a transformers that does not import is said where it is caught)
        raise
    except Exception as e:  # noqa: BLE001  (what transformers raises for a bad field is not one type)
        text = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ConfigError(f"{where}: transformers cannot build a model from this config "
                          f"({type(e).__name__}: {text[:200]})") from None


def _where(model: Any) -> str:
    """What a model argument names in an error: a config's path, a shipped name, a config class."""
    if isinstance(model, ModelConfig):
        return str(model.path)
    return str(model) if isinstance(model, (str, Path)) else type(model).__name__


def hf_config(model: str | ModelConfig | Any, layers: int | None = None) -> Any:
    """A transformers config from a shipped name, a config.json path, a :class:`ModelConfig` or
    a ``PretrainedConfig`` (``layers`` overrides ``num_hidden_layers``)."""
    from transformers import CONFIG_MAPPING, PretrainedConfig

    if isinstance(model, PretrainedConfig):
        cfg = model.__class__.from_dict(model.to_dict())
    else:
        spec = model if isinstance(model, ModelConfig) else load_model(model)
        fields = {k: v for k, v in spec.fields.items() if not k.startswith("_")}
        if spec.model_type not in CONFIG_MAPPING:
            from trnsim.config import ConfigError

            raise ConfigError(f"{spec.path}: model_type '{spec.model_type}' is not a transformers model type")
        with refused_by_transformers(spec.path):
            cfg = CONFIG_MAPPING[spec.model_type].from_dict(fields)
    if layers is not None:
        cfg.num_hidden_layers = layers
    return cfg


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """transformers' warnings off (building a model from a config for timing, e.g. an encoder as a
    causal LM, is not the misuse they warn of); restored afterwards."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def from_config(model: str | ModelConfig | Any, dtype: torch.dtype = torch.bfloat16, *, layers: int | None = None,
                attention: str = ATTENTION, device: Any = "neuron", head: bool = True,
                shard: Any = None) -> torch.nn.Module:
    """A model from its config, its weights never allocated: built on meta, then (inside a
    timing-only run) given timing-only storage on ``device``. ``head=False`` builds the base
    model without the LM head; ``shard(model)`` (a :class:`torch_bridge.parallel.Shard`) runs
    on the meta model first, so only one rank's slices ever count against HBM."""
    from transformers import AutoModel, AutoModelForCausalLM

    register()
    cfg = hf_config(model, layers)
    cfg._attn_implementation = attention
    if hasattr(cfg, "num_local_experts"):
        cfg._experts_implementation = attention
    with _torch.no_dispatch_modes(), torch.device("meta"), _default_dtype(dtype), quiet(), \
            refused_by_transformers(_where(model)):  # (plain meta: ~10x faster)
        net = (AutoModelForCausalLM if head else AutoModel).from_config(cfg, attn_implementation=attention)
    net.eval()
    if shard is not None:
        shard(net)
    return materialize(net, device, dtype)


def kv_cache(max_tokens: int, layers: int | None = None, batch: int = 1, heads: int = 1, head_dim: int = 128,
             dtype: torch.dtype = torch.bfloat16, device: Any = "neuron") -> Any:
    """A :class:`KVCache` of ``max_tokens`` positions per layer; with ``layers`` its keys and
    values ([batch, heads, max_tokens, head_dim] each) are allocated now, for every layer (as
    Neuron's inference libraries allocate them when the model loads), else by each layer's first
    update."""
    from transformers.cache_utils import Cache

    cls = _layer_class(max_tokens)
    if layers is None:
        return Cache(layer_class_to_replicate=cls)
    made = []
    for _ in range(layers):
        layer = cls()
        layer.keys = torch.empty((batch, heads, max_tokens, head_dim), dtype=dtype, device=device)
        layer.values = torch.empty((batch, heads, max_tokens, head_dim), dtype=dtype, device=device)
        layer.is_initialized = True
        made.append(layer)
    return Cache(layers=made)


KVCache = kv_cache


def _layer_class(max_tokens: int) -> Any:
    from transformers.cache_utils import CacheLayerMixin

    class KVCacheLayer(CacheLayerMixin):
        """One layer of a :func:`kv_cache`: ``length`` positions hold keys and values."""

        is_compileable = False
        is_sliding = False

        def __init__(self) -> None:
            super().__init__()
            self.length = 0

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            b, h, _, d = key_states.shape
            self.keys = key_states.new_empty((b, h, max_tokens, d))
            self.values = value_states.new_empty((b, h, max_tokens, value_states.shape[-1]))
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
                   **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n = key_states.shape[-2]
            end = self.length + n
            if end > max_tokens:
                raise ValueError(f"KV cache: {end} tokens do not fit its {max_tokens} positions")
            self.keys[:, :, self.length:end].copy_(key_states)
            self.values[:, :, self.length:end].copy_(value_states)
            self.length = end
            return self.keys[:, :, :end], self.values[:, :, :end]

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.length + query_length, 0

        def get_seq_length(self) -> int:
            return self.length

        def get_max_length(self) -> int:
            return max_tokens

    return KVCacheLayer
