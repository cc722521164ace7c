"""Every registered kernel, on every shipped Trainium generation it targets, computes the same
values as its numpy reference (the per-kernel test files go deeper; this one keeps the registry
honest: a kernel added without a reference, or that breaks on trn3, fails here)."""

from __future__ import annotations

import pytest

from trnsim import KernelError, load_config
from trnsim.kernels import kernel_names
from trnsim.kernels import get_kernel
from trnsim.kernels.check import check_entry

# Kernels only NeuronCore-v4 runs: elsewhere they refuse in one line.
NEEDS_MX = {"matmul_mx"}
# One small, ragged shape per kernel (dims in the registry's order).
SMALL = {
    "activation": (130, 70),
    "attention": (1, 2, 200, 64),
    "attention_cte": (1, 4, 2, 200, 64),
    "attention_tkg": (3, 4, 2, 2, 384, 64),
    "binary": (130, 70),
    "bmm": (2, 130, 70, 200),
    "bmm_packed": (5, 20, 30, 40),
    "conv2d": (1, 20, 9, 9, 24, 3),
    "dwconv2d": (2, 20, 9, 9, 3),
    "embedding": (130, 50, 96),
    "foreach_fused": (3, 1000),
    "fused": (130, 300),
    "matmul_fused": (130, 200, 300),
    "layernorm": (130, 300),
    "matmul": (130, 200, 300),
    "matmul_mx": (130, 640, 300),
    "mx_quantize": (130, 640),
    "mlp": (3, 50, 256, 384),
    "moe": (130, 160, 300, 4),
    "moe_backward": (130, 160, 300, 4),
    "moe_tkg": (3, 256, 384, 8),
    "mla_tkg": (3, 2, 256, 256, 64, 128),
    "oproj": (3, 50, 2, 64, 256),
    "qkv": (3, 50, 256, 4, 2, 64),
    "reduce": (130, 70),
    "rope": (2, 3, 130, 64),
    "router_topk": (130, 256, 64),
    "rmsnorm": (130, 300),
    "rmsnorm_fp8": (130, 300),
    "softmax": (130, 300),
    "transpose": (130, 70),
    "unary": (130, 70),
}


def test_every_kernel_has_a_small_shape_here():
    assert sorted(SMALL) == kernel_names()


@pytest.mark.parametrize("config", ["trn2", "trn3"])
def test_every_kernel_builds_at_the_default_shape_it_lists(config):
    """`trnsim kernel --list` shows each kernel's default shape, which `trnsim kernel NAME` builds:
    rope's failed at its own (1x32x2048x128: its token-per-partition choice counted two of its five
    SBUF pools, and the allocator ran out mid-build; found by a hardening hunt)."""
    cfg = load_config(config)
    for name in kernel_names():
        entry = get_kernel(name)
        if name in NEEDS_MX and not cfg.core.tensor.mx_quad:
            continue
        assert len(entry.make(entry.default_shape, entry.default_dtype, cfg)) > 0, name


@pytest.mark.parametrize("config", ["trn2", "trn3"])
@pytest.mark.parametrize("name", sorted(SMALL))
def test_kernel_matches_reference(name, config):
    entry = get_kernel(name)
    if name in NEEDS_MX and not load_config(config).core.tensor.mx_quad:
        with pytest.raises(KernelError, match=rf"^{name}: {config} has no MX matmul "):
            entry.make(SMALL[name], entry.dtypes[0], load_config(config))
        return
    for dtype in entry.dtypes:
        out = check_entry(entry, SMALL[name], dtype, config)
        assert out["ok"], f"{name} {dtype} on {config}: errors {out['errors']}"
        assert out["report"].total_cycles > 0


def test_moe_takes_more_experts_than_partitions():
    """The router's scan over experts multiplies by a row of ones E wide: with E > 128 (DeepSeek-V3's
    256 on one rank) it sliced a 128-wide tile ("slice end 256 out of range") and refused."""
    entry = get_kernel("moe")
    out = check_entry(entry, (130, 128, 64, 200), "bf16", "trn2", params={"top_k": 8})
    assert out["ok"], out["errors"]


@pytest.mark.parametrize("shape,dtype,params", [
    ((130, 160, 300, 4), "fp32", {}),                        # two token tiles, ragged dims
    ((200, 640, 600, 8), "bf16", {}),                        # hidden over a PSUM bank, three ffn chunks
    ((64, 128, 128, 8), "bf16", {"top_k": 8}),               # every expert chosen by every token
    ((17, 130, 129, 2), "fp16", {"top_k": 1, "normalize": False}),
])
def test_moe_backward_matches_reference(shape, dtype, params):
    """The block's backward (expert weight, input and routing-weight gradients) against numpy."""
    out = check_entry(get_kernel("moe_backward"), shape, dtype, "trn2", params=params)
    assert out["ok"], out["errors"]
    assert set(out["errors"]) == {"grad_x", "grad_weights", "grad_w_gate", "grad_w_up", "grad_w_down"}


def test_moe_backward_refuses_blocks_over_a_partition_per_token():
    with pytest.raises(KernelError, match=r"^moe_backward: block 256 gives 256-token blocks; .*use block <= 128$"):
        get_kernel("moe_backward").make((300, 64, 64, 4), "bf16", load_config("trn2"), {"block": 256})
