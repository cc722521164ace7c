"""The NKI library's transformer kernels as trnsim library kernels: real instruction streams with
numpy references (``trnsim kernel NAME --check``), each written after the tiling of its NKI
library counterpart (``aws-neuron/nki-library`` ``src/nkilib_src/nkilib/core``, commit d2ad3a57),
callable from NKI files and torch through :mod:`trnsim.nki.library`.

The contract: a transformer layer as a list of kernel calls
=========================================================

A call is ``KernelSpec.of(name, shape, dtype, params)`` (:mod:`trnsim.device`) for one rank (one
logical NeuronCore): the device model splits it over the rank's physical cores by the kernel's
own LNC rule, simulates it once per (name, shape, dtype, params) and caches the cost. Shapes are
per rank, after tensor parallelism. Per layer, with

* ``B`` sequences of ``S`` tokens in the step (decode: ``S`` = 1, or the speculation length;
  prefill: the padded bucket length), ``T = B*S`` tokens;
* ``H`` hidden, ``D`` head dim; ``NQ = heads / TP`` query heads and ``NKV = max(1, kv_heads / TP)``
  kv heads per rank (kv heads replicated when TP exceeds them, NxD Inference's default);
* ``I = intermediate / TP`` (dense) or the expert's intermediate per rank (MoE), ``E`` experts on
  the rank;
* ``SP`` the KV-cache bucket (a multiple of 128: decode reads all of it; the mask hides what is
  not written yet);

a layer is::

    qkv            (B, S, H, NQ, NKV, D)   residual=layer > 0, norm="rmsnorm", rope=True, bias=..., quant="none"|"fp8"
    attention_tkg  (B, NQ, NKV, S, SP, D)  decode: window=..., sinks=..., k_layout="bhsd"|"bhds", cache_update=True
      or
    attention_cte  (B, NQ, NKV, S, D)      prefill: causal=True, window=..., sinks=..., prior=... (keys cached before S)
    oproj          (B, S, NQ, D, H)        bias=...              -> the TP all-reduce (or reduce-scatter) follows
    mlp            (B, S, H, I)            residual=True, norm="rmsnorm", act="silu", gated=True
                                            -> the TP all-reduce follows
    # or, an MoE layer:
    router_topk    (T, H, E_total)         top_k=..., act="softmax"|"sigmoid", norm=..., bias=...
    moe_tkg        (T, H, I, E)            decode: top_k=..., mode="auto"  (selective or all-expert)
    moe            (T, H, I, E)            prefill: the library's blockwise MoE (router included)
    # DeepSeek's MLA at decode: the rank's heads over one shared latent cache, W_uk/W_uv absorbed
    mla_tkg        (B, NQ, SP, R, DR, D)   R = kv_lora_rank, DR = rope dim, D = nope = v head dim

``rope`` ``(B, heads, S, D)`` is the standalone rotation for a model whose q/k norm sits between the
projection and RoPE (Qwen3: ``qkv`` with ``rope=False``, then ``rope``).

Tensors and layouts (what one call hands the next): token rows ``[T, H]`` in (batch, position)
order; ``q``/``k``/``v`` and the attention output ``[B, heads, S, D]``; the KV cache per layer
``[B, NKV, SP, D]`` (``k_layout="bhds"``: K as ``[B, NKV, D, SP]``), positions ``pos [B]`` (tokens
already cached); RoPE angles ``cos``/``sin [T, D/2]`` per token; weights as the model stores them,
contraction dim first (``w_qkv [H, (NQ+2NKV)*D]`` q heads then k then v, ``w_o [NQ*D, H]``,
``w_gate``/``w_up [H, I]``, ``w_down [I, H]``, experts ``[E, H, I]``/``[E, I, H]``). The residual
stream enters ``qkv``/``mlp`` as ``res`` and leaves as ``h`` (NxD Inference's fused residual add);
``mlp``'s and ``oproj``'s outputs are this rank's partial sums, before the collective.

Dtypes: bf16 (fp16 where a kernel lists it); fp32 softmax statistics and router logits; the
``qkv`` FP8 path takes fp8 e4m3 weights with per-column scales and a static activation scale.

LNC=2 (trn2/trn3 ranks): ``qkv``/``mlp`` share H between the cores in decode (partial sums
exchanged by DMA, as the library's ``sendrecv``) and the tokens in prefill; ``oproj`` shares H;
attention shares sequences, kv heads or (one sequence, one kv head) the cached keys, merged at
the end; ``router_topk`` the tokens; ``moe_tkg`` the tokens (selective) or the experts.

How close each kernel gets to its HBM or TensorE bound (:func:`~.common.measure`) is pinned in
``tests/kernels/test_kernels_transformer.py``.
"""

from . import attention_cte, attention_tkg, mla_tkg, mlp, moe_tkg, oproj, qkv, rope, router  # noqa: F401
from .common import BOUNDS, Bound, Measured, measure

__all__ = ["BOUNDS", "Bound", "Measured", "measure"]
