"""trnsim.nki.library: the transformer library kernels as nki kernels - the values of nki.run
against the kernels' references, the LNC launch costed per physical core by the device model,
and the one-line refusals."""

from __future__ import annotations

import numpy as np
import pytest

import trnsim.nki as nki
from trnsim.kernels import get_kernel
from trnsim.nki import NkiError
from trnsim.nki import library as nkilib


@pytest.mark.parametrize("name,shape,params,extra", [
    ("attention_tkg", (2, 4, 1, 1, 256, 64), {"window": 100}, {}),
    ("qkv", (3, 1, 256, 4, 1, 64), {"rope": True}, {"num_q_heads": 4, "num_kv_heads": 1, "seq_len": 1}),
    ("mlp", (1, 40, 256, 384), {"residual": True}, {"seq_len": 40}),
    ("router_topk", (40, 256, 16), {"top_k": 2}, {}),
])
def test_library_kernel_values(name, shape, params, extra):
    e = get_kernel(name)
    p = {**e.params, **params}
    inp = e.inputs(shape, "bf16", p, np.random.default_rng(0))
    k = nkilib.kernel(name, **params, **extra)
    ins, outs = nkilib.signature(k)
    r = nki.run(k, *[inp[n] for n in ins])
    got = r.outputs if isinstance(r.outputs, tuple) else (r.outputs,)
    ref = e.reference(inp, shape, "bf16", p)
    rtol, atol = e.tolerance("bf16")
    for nm, g in zip(outs, got):
        want = ref[nm]
        assert g.shape == want.shape
        assert np.abs(g.astype(np.float64) - want).max() <= atol * max(1.0, np.abs(want).max()), nm
    assert r.report.total_us > 0


def test_lnc_launch_is_costed_per_physical_core():
    from trnsim.config import load_config
    from trnsim.device import Device

    k = nkilib.kernel("attention_tkg")
    fam = nki.family(k[2], "test_nkilib_attention_tkg")
    specs = [nki.tensor_spec(s, d) for s, d in [((4, 4, 1, 64), "bfloat16"), ((4, 1, 1, 64), "bfloat16"),
                                                 ((4, 1, 1, 64), "bfloat16"), ((4, 1, 2048, 64), "bfloat16"),
                                                 ((4, 1, 2048, 64), "bfloat16"), ((4,), "int32")]]
    spec = fam.spec(specs)
    kernels = Device(load_config("trn2")).kernels_of(spec)
    assert len(kernels) == 2  # half the sequences on each physical core
    assert kernels[0].tensors["q"].shape == (2, 4, 1, 64)


def test_library_kernel_errors():
    with pytest.raises(NkiError, match=r"^nkilib: unknown kernel 'flash'"):
        nkilib.kernel("flash")
    with pytest.raises(NkiError, match=r"^nkilib.rope: unknown parameter 'theta'"):
        nkilib.kernel("rope", theta=1e4)
    k = nkilib.kernel("rope")
    with pytest.raises(NkiError, match=r"^nkilib.rope: missing a required argument: 'sin'"):
        k(np.zeros((1, 2, 4, 64), np.float32), np.zeros((4, 32), np.float32))
