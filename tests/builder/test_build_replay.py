"""The matmul kernel's row-block replay (``_Mm.block_or_replay``, :meth:`Kernel.replay`): a
resident column block's row blocks that start in the same builder state are emitted by cloning
an earlier block's instructions with their own HBM views, the tracker recording their accesses
in one call. The stream must be exactly the reference build's (one instruction at a time) where
the replay runs and where it must not (ragged blocks, transposed operands, fp8 double-row, a
streaming plan, pools in another state, the instruction limit), and ``kernel.replays`` counts
the blocks replayed so the tests know the fast path ran."""

from __future__ import annotations

import pytest

from trnsim import load_config
from trnsim.isa import KernelError
from trnsim.builder.deps import _deptrack
from trnsim.kernel import reference_build, stream_fingerprint
from trnsim.kernels import get_kernel
from trnsim.kernels import matmul as mm_mod

needs_native = pytest.mark.skipif(_deptrack is None, reason="the C dependency tracker is not built")


def _both(name: str, shape: tuple[int, ...], dtype: str = "bf16", cfg: str = "trn2", **params: object):
    entry = get_kernel(name)
    config = load_config(cfg)
    with reference_build():
        ref = entry.make(shape, dtype, config, params)
    fast = entry.make(shape, dtype, config, params)
    assert ref.replays == 0
    assert stream_fingerprint(ref) == stream_fingerprint(fast)
    assert (ref.sbuf_peak_bytes, ref.psum_peak_bytes, ref.queues) == \
        (fast.sbuf_peak_bytes, fast.psum_peak_bytes, fast.queues)
    return ref, fast


@needs_native
@pytest.mark.parametrize("cfg", ["trn1", "trn2", "trn3"])
def test_replayed_blocks_same_stream(cfg: str) -> None:
    assert hasattr(_deptrack.lib, "dt_record_many"), \
        "trnsim/native/_deptrack is older than deptrack.c: rebuild it (python3 setup.py build_ext --inplace)"
    # 8 row blocks x 3 column blocks: all but the first two blocks can replay, the blocks that
    # roll the next rhs in included
    _, fast = _both("matmul", (2048, 512, 3072), cfg=cfg)
    assert fast.replays >= 16


@needs_native
def test_ragged_blocks_same_stream() -> None:
    # ragged last row block (mw differs) and ragged last column block (nw differs, new rhs views)
    _, fast = _both("matmul", (2000, 700, 2500))
    assert fast.replays > 0
    _both("matmul", (300, 200, 700))


@needs_native
@pytest.mark.parametrize("ta,tb", [(True, False), (False, True), (True, True)])
def test_transposed_operands_same_stream(ta: bool, tb: bool) -> None:
    _, fast = _both("matmul", (1280, 384, 2100), transpose_a=ta, transpose_b=tb)
    if not ta:  # B transposed: its loads are outside the replayed blocks
        assert fast.replays > 0


@needs_native
def test_fp8_double_row_and_streaming_plan_never_replay() -> None:
    _, fast = _both("matmul", (1280, 600, 2100), dtype="fp8_e4m3")
    assert load_config("trn2").core.tensor.fp8_double_row and fast.replays == 0
    _, fast = _both("matmul", (1024, 48 * 1024 + 77, 640))  # rhs cannot stay resident
    assert fast.replays == 0


@needs_native
def test_bmm_replays_across_batches() -> None:
    _, fast = _both("bmm", (3, 1024, 256, 1500))
    assert fast.replays > 0


@needs_native
@pytest.mark.parametrize("pattern", ["mm_bias_gelu", "mm_residual"])
def test_matmul_epilogue_never_replays(pattern: str) -> None:
    _, fast = _both("matmul_fused", (1024, 256, 1024), pattern=pattern)
    assert fast.replays == 0


def _manual(ref: bool, perturb) -> object:
    """A matmul built through _Mm by hand, ``perturb(mm)`` run on its pools first."""
    def build():
        kern, mm = mm_mod._setup("mm", 2048, 512, 2048, "bf16", "trn2", False, False, "auto")
        a = kern.input("lhsT", (512, 2048), mm.dt).full()
        b = kern.input("rhs", (512, 2048), mm.dt).full()
        out = kern.output("out", (2048, 2048), mm.odt)
        perturb(mm)
        mm.emit([mm_mod._Job(a, b, out.full(), 2048, 2048)])
        return kern
    if ref:
        with reference_build():
            return build()
    return build()


@needs_native
@pytest.mark.parametrize("what", ["lhs", "acc", "res", "evac", "limit"])
def test_pools_in_another_state_same_stream(what: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Pools rotated off their usual phase, an odd evacuation count, or an instruction limit
    that falls inside a replayable block: the same stream (or the same error) as the reference."""
    def perturb(mm) -> None:
        if what == "lhs":
            for _ in range(3):
                mm.ktile(mm.lhs_pool, mm.plan.bm)
        elif what == "acc":
            mm.acc_pool.tile((mm.plan.tm, mm.plan.tn), "float32")
        elif what == "res":
            mm.res_pool.tile((mm.plan.tm, mm.plan.bn), mm.odt)
        elif what == "evac":
            mm.evacs = 1
    if what == "limit":
        monkeypatch.setenv("TRNSIM_MAX_INSTRUCTIONS", "250")
        errs = []
        for ref in (True, False):
            with pytest.raises(KernelError) as e:
                _manual(ref, perturb)
            errs.append(str(e.value))
        assert errs[0] == errs[1] and "more than 250 instructions" in errs[0]
        return
    ref, fast = _manual(True, perturb), _manual(False, perturb)
    assert stream_fingerprint(ref) == stream_fingerprint(fast)
    assert fast.replays > 0


@needs_native
def test_replay_refuses_when_the_kernel_state_differs() -> None:
    """Kernel.replay changes nothing and returns False when a tile it would touch is freed, the
    loaded stationary differs or the limit would be passed."""
    kern, mm = mm_mod._setup("mm", 2048, 256, 1024, "bf16", "trn2", False, False, "auto")
    a = kern.input("lhsT", (256, 2048), mm.dt).full()
    b = kern.input("rhs", (256, 1024), mm.dt).full()
    out = kern.output("out", (2048, 1024), mm.odt).full()
    mm.emit([mm_mod._Job(a, b, out, 2048, 1024)])
    assert kern.replays > 0 and mm.templates
    tpl = next(iter(mm.templates.values()))
    views = mm.block_hbm(mm_mod._Job(a, b, out, 2048, 1024), 0, 256, 0, 1024, None)
    n = len(kern.instructions)
    saved = kern._loaded_stationary
    # the block's first matmul loads its stationary (its tile is loaded just before, which
    # unloads it whatever was loaded): a template whose first matmul did not is refused
    assert tpl.rep.first_loads and tpl.rep.first_key[0] in tpl.rep.unloads
    tpl.rep.first_loads = False
    assert not kern.replay(tpl.rep, views) and len(kern.instructions) == n
    tpl.rep.first_loads = True
    assert kern._loaded_stationary == saved
    kern._max_instructions = n + len(tpl.rep.ins) - 1
    assert not kern.replay(tpl.rep, views) and len(kern.instructions) == n
    kern._max_instructions = n + len(tpl.rep.ins)
    tile = mm.res_pool._slots[0]
    kern._release(tile)
    assert not kern.replay(tpl.rep, views) and len(kern.instructions) == n


@needs_native
def test_replayed_blocks_join_the_edge_log() -> None:
    """A replayed block's edges are in the tracker's log, so simulate() takes them as arrays
    (``trnsim.sim._logged_edges``), and the native loop still agrees with simpy."""
    from trnsim.sim import _logged_edges, simulate

    config = load_config("trn2")
    kern = get_kernel("matmul").make((1024, 512, 1536), "bf16", config)
    assert kern.replays > 0
    assert _logged_edges(kern, kern.instructions) is not None
    native, ref = simulate(config, [kern])[0], simulate(config, [kern], timeline="simpy")[0]
    assert (native.total_ticks, native.ready, native.end) == (ref.total_ticks, ref.ready, ref.end)


@needs_native
@pytest.mark.parametrize("cfg", ["trn1", "trn2", "trn3"])
def test_conv_bands_replayed_same_stream(cfg: str) -> None:
    # one band per image: a band whose tile() calls reuse the buffers an earlier band's calls
    # got (allocated or reused) replays it with its own x/out rows
    _, fast = _both("conv2d", (7, 64, 40, 40, 64, 3), cfg=cfg)
    assert fast.replays > 0


@needs_native
@pytest.mark.parametrize("shape,params", [((14, 64, 30, 30, 64, 3), {"padding": 1}),  # memsets and staging copies
                                          ((13, 3, 32, 32, 16, 3), {"padding": 1, "stride": 2}),
                                          ((6, 128, 57, 57, 64, 3), {"stride": 2}),
                                          ((10, 32, 70, 70, 32, 3), {}),              # ragged pixel tiles, acc pool period 3
                                          ((8, 512, 14, 14, 1024, 3), {}),            # several weight groups
                                          ((12, 16, 9, 9, 16, 2), {})])               # a band that allocated, replayed
def test_conv_bands_same_stream(shape: tuple[int, ...], params: dict[str, object]) -> None:
    _, fast = _both("conv2d", shape, **params)
    if params.get("padding"):
        assert fast.replays > 0
