"""The attention kernel's group replay (``attention_groups.Groups``, :meth:`Kernel.replay` with tile
operands replaced): a group of query tiles that starts in the builder state an earlier group
started in is emitted by cloning that group's instructions with its own HBM views and, when its
head's K/V block sits in other buffers, that block's slices. The stream must be exactly the
reference build's (one instruction at a time, no replay) where the replay runs and where it
must not (ragged groups, causal masking, key blocks, score functions, list-scheduled short
sequences, pools or the evacuation parity off phase, the instruction limit); ``kernel.replays``
counts the groups replayed so the tests know the fast path ran."""

from __future__ import annotations

import pytest

from trnsim import load_config
from trnsim.isa import KernelError
from trnsim.builder.deps import _deptrack
from trnsim.kernel import Kernel, reference_build, stream_fingerprint
from trnsim.kernels import attention_groups as attn_groups
from trnsim.kernels import get_kernel

from test_build_replay import _both as _both_kernels  # the reference build and this one, compared

needs_native = pytest.mark.skipif(_deptrack is None or not hasattr(_deptrack.lib, "dt_record_many"),
                                  reason="the C dependency tracker (with dt_record_many) is not built")


def _both(shape: tuple[int, ...], dtype: str = "bf16", cfg: str = "trn2", **params: object):
    return _both_kernels("attention", shape, dtype, cfg, **params)


@needs_native
def test_default_shape_replays_most_groups() -> None:
    # 8 heads x 8 groups: head 0's first seven (pool phases not seen before) and the first
    # group of heads 1-3 (K/V loaded into buffers in a state not seen before) are built; the
    # other 54 replay, heads 1-7's with their own K/V block in place of the template's
    _, fast = _both((1, 8, 2048, 128))
    assert fast.replays == 54


@needs_native
@pytest.mark.parametrize("cfg", ["trn1", "trn2", "trn3"])
def test_replayed_groups_same_stream(cfg: str) -> None:
    _, fast = _both((1, 6, 1536, 64), cfg=cfg)
    assert fast.replays > 0


@needs_native
def test_causal_fp32_and_several_batches_replay() -> None:
    _, fast = _both((1, 6, 1536, 64), causal=True)
    assert fast.replays > 0
    _, fast = _both((2, 4, 1536, 64), "fp32")
    assert fast.replays > 0


@needs_native
@pytest.mark.parametrize("shape,dtype,params", [
    ((1, 8, 1000, 64), "bf16", {}),                        # ragged last group and key tile
    ((2, 3, 1000, 128), "bf16", {}),
    ((1, 4, 700, 64), "bf16", {"causal": True}),
    ((1, 2, 2048, 128), "bf16", {"kv_block": 512}),       # key blocks outer: not replayed
    ((1, 2, 1300, 64), "bf16", {"kv_block": 512, "causal": True}),
    ((1, 2, 5120, 128), "fp32", {}),                       # blocks reloaded per group
    ((2, 4, 256, 64), "bf16", {}),                         # short: list-scheduled
    ((1, 4, 640, 128), "fp16", {}),
])
def test_variants_same_stream(shape: tuple[int, ...], dtype: str, params: dict) -> None:
    _both(shape, dtype, **params)


@needs_native
def test_score_function_never_replays() -> None:
    from trnsim.kernels.fused import FULL, Program

    prog = Program(((FULL, "fp32"),) * 3, (("tt", "subtract", 1, 2), ("ts", 3, "multiply", 0.05, None, None, False),
                                           ("tt", "add", 0, 4)), ((5, "fp32"),))
    _, fast = _both((1, 3, 1536, 64), score_mod=prog)
    assert fast.replays == 0


@needs_native
@pytest.mark.parametrize("what", ["pool", "psum", "evac"])
def test_groups_off_phase_same_stream(what: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool rotated one buffer, or the evacuation parity flipped, before a group in the
    middle of the kernel (in both builds): the replay must notice, and the stream stays the
    reference build's."""
    run = attn_groups.Groups.run

    def perturbed(self, bi, hi, g0, specs, plan):
        if (bi, hi, g0) == (0, 3, 512):
            w = self.w
            if what == "pool":
                w.tile(w.p_pool, (specs[0][1], w.tk), w.dt)
            elif what == "psum":
                w.tile(w.tr_ps, (w.d, specs[0][1]), w.dt)
            else:
                w.evac += 1
        return run(self, bi, hi, g0, specs, plan)

    monkeypatch.setattr(attn_groups.Groups, "run", perturbed)
    _, fast = _both((1, 6, 1536, 64))
    assert fast.replays > 0


@needs_native
def test_instruction_limit_inside_a_replayed_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRNSIM_MAX_INSTRUCTIONS", "3500")  # of 3,918: past the first replays
    errs = []
    for ref in (True, False):
        entry = get_kernel("attention")
        with pytest.raises(KernelError) as e:
            if ref:
                with reference_build():
                    entry.make((1, 6, 1536, 64), "bf16", load_config("trn2"), {})
            else:
                entry.make((1, 6, 1536, 64), "bf16", load_config("trn2"), {})
        errs.append(str(e.value))
    assert errs[0] == errs[1] and "more than 3,500 instructions" in errs[0]


def _tiny(replace: bool):
    """A DMA, a matmul reading tile b1 (or b2), a PSUM copy: by hand, then (``replace``) the same
    three instructions again as a replay of the first with the HBM view and b1 replaced."""
    kern = Kernel("t", "trn2")
    x = kern.input("x", (2, 128, 128), "bf16")
    out = kern.output("out", (2, 128, 128), "bf16")
    a = kern.sbuf((128, 128), "bf16", name="a")
    b1, b2 = kern.sbuf((128, 128), "bf16", name="b1"), kern.sbuf((128, 128), "bf16", name="b2")
    ps = kern.psum((128, 128), "fp32")
    res = kern.sbuf((128, 128), "bf16", name="res")
    kern.dma_copy(b1, x[1])
    kern.dma_copy(b2, x[0])

    def group(i: int, b) -> None:
        kern.dma_copy(a, x[i])
        kern.nc_matmul(ps, a, b)
        kern.tensor_copy(res, ps)
        kern.dma_copy(out[i], res)

    i0 = len(kern.instructions)
    group(0, b1)
    if not replace:
        group(1, b2)
        return kern, None
    tpl = kern.replay_template(i0, [0, 3], [(1, b1)])
    assert tpl is not None
    return kern, (tpl, [x[1], out[1]], b1, b2, a, res)


@needs_native
def test_replay_replaces_tile_operands() -> None:
    """Kernel.replay's ``tiles``: the matmul of the replay reads b2, with the dependencies a
    matmul of b2 has (on the DMA that filled it), as building it would give."""
    want, _ = _tiny(False)
    kern, (tpl, views, b1, b2, a, res) = _tiny(True)
    assert kern.replay(tpl, views, [b2])
    assert kern.replays == 1 and kern.instructions[-3].moving is b2
    assert stream_fingerprint(kern) == stream_fingerprint(want)


@needs_native
def test_replay_template_and_replay_refuse_bad_tile_operands() -> None:
    kern, (tpl, views, b1, b2, a, res) = _tiny(True)
    i0 = len(kern.instructions) - 4
    assert kern.replay_template(i0, [0, 3], [(1, a)]) is None    # the matmul's stationary
    assert kern.replay_template(i0, [0, 3], [(2, res)]) is None  # written, not read
    assert kern.replay_template(i0, [0, 3], [(0, b1)]) is None   # not an operand of the DMA
    n = len(kern.instructions)
    assert not kern.replay(tpl, views, []) and len(kern.instructions) == n  # one tile per side
    kern.free(b2)
    assert not kern.replay(tpl, views, [b2]) and len(kern.instructions) == n  # a freed tile
    assert kern.replays == 0


@needs_native
def test_replayed_groups_join_the_edge_log() -> None:
    from trnsim.sim import _logged_edges, simulate

    config = load_config("trn2")
    kern = get_kernel("attention").make((1, 6, 1536, 64), "bf16", config)
    assert kern.replays > 0
    assert _logged_edges(kern, kern.instructions) is not None
    native, ref = simulate(config, [kern])[0], simulate(config, [kern], timeline="simpy")[0]
    assert (native.total_ticks, native.ready, native.end) == (ref.total_ticks, ref.ready, ref.end)
