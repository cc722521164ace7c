"""The kernel builder: hardware rules checked at build time with messages users can act on."""

import numpy as np
import pytest

from trnsim import Chip, Kernel, KernelError


@pytest.fixture
def k():
    return Kernel("t", "trn2")


def err(fn, *args, **kwargs):
    with pytest.raises(KernelError) as e:
        fn(*args, **kwargs)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_sbuf_capacity_is_enforced(k):
    k.sbuf((128, 100 * 1024), "uint8", name="big")
    msg = err(k.sbuf, (128, 200 * 1024), "uint8", name="more")
    assert msg == ("SBUF is full: tile 'more' needs 200 KiB per partition on partitions 0..127, but 100 KiB of "
                   "224 KiB are in use ('big' 100 KiB) on trn2 (224 KiB per partition)")
    assert err(k.sbuf, (128, 300 * 1024), "uint8", name="huge") == (
        "SBUF tile 'huge' needs 300 KiB per partition, more than the 224 KiB a partition holds on trn2 (224 KiB per partition)")
    assert err(k.sbuf, (129, 4), "fp32", name="tall") == (
        "SBUF tile 'tall' needs partitions 0..128, but the SBUF has 128 partitions (0..127)")


def test_freed_memory_is_reused(k):
    a = k.sbuf((128, 200 * 1024), "uint8")
    k.free(a)
    b = k.sbuf((128, 200 * 1024), "uint8")
    assert b.alloc.addr == 0
    with k.scope():
        k.sbuf((128, 16 * 1024), "uint8")
    k.sbuf((128, 16 * 1024), "uint8")  # fits again after the scope ended


def test_psum_holds_eight_banks(k):
    tiles = [k.psum((128, 512), "fp32") for _ in range(8)]
    assert [t.alloc.addr for t in tiles] == [i * 2048 for i in range(8)]
    msg = err(k.psum, (128, 512), "fp32", name="ninth")
    assert msg.startswith("PSUM is full: tile 'ninth' needs 2 KiB per partition")


def test_trn3_has_more_sbuf():
    k3 = Kernel("t", "trn3")
    k3.sbuf((128, 250 * 1024), "uint8")  # 256 KiB partitions on NC-v4
    with pytest.raises(KernelError):
        Kernel("t", "trn2").sbuf((128, 250 * 1024), "uint8")


def test_matmul_tile_limits(k):
    st = k.sbuf((128, 128), "bf16", name="st")
    mv = k.sbuf((128, 1024), "bf16", name="mv")
    acc = k.psum((128, 512), "fp32", name="acc")
    assert err(k.nc_matmul, acc, st, mv) == (
        "nc_matmul: moving free size 1024 exceeds 512 (core.tensor.moving_max_free on trn2)")
    wide = k.sbuf((128, 256), "bf16")
    assert err(k.nc_matmul, acc, wide, mv[:, 0:512]) == (
        "nc_matmul: stationary free size 256 exceeds 128 (core.tensor.stationary_max_free on trn2)")
    assert err(k.nc_matmul, acc, st[0:64, :], mv[:, 0:512]) == (
        "nc_matmul: contraction mismatch: stationary has 64 partitions, moving has 128")
    assert err(k.nc_matmul, acc[:, 0:256], st, mv[:, 0:512]) == (
        "nc_matmul: dst 'acc' has shape (128, 256), expected [128, 512] (stationary free x moving free)")
    sb = k.sbuf((128, 512), "fp32", name="sb")
    assert err(k.nc_matmul, sb, st, mv[:, 0:512]) == "nc_matmul: dst 'sb' is in SBUF; TensorE writes to PSUM only"
    assert err(k.nc_matmul, acc, acc[:, 0:128], mv[:, 0:512]).startswith(
        "nc_matmul: stationary 'acc' is in PSUM; TensorE reads operands from SBUF only")
    f32 = k.sbuf((128, 512), "fp32")
    assert err(k.nc_matmul, acc, st, f32) == (
        "nc_matmul: if one operand is fp32 the other must be too (got bfloat16 x float32)")


def test_psum_bank_boundary(k):
    st = k.sbuf((128, 128), "bf16")
    mv = k.sbuf((128, 512), "bf16")
    acc = k.psum((128, 1024), "fp32", name="acc")
    msg = err(k.nc_matmul, acc[:, 256:768], st, mv)
    assert msg == ("nc_matmul: PSUM destination 'acc' spans bytes 1024..3071, crossing a 2048-byte bank boundary; "
                   "a trn2 matmul writes one PSUM bank (at most 512 fp32 per partition)")
    k.nc_matmul(acc[:, 512:1024], st, mv)  # the second bank is fine


def test_partition_alignment(k):
    t = k.sbuf((128, 64), "fp32", name="t")
    u = k.sbuf((128, 64), "fp32", name="u")
    k.tensor_copy(u[64:128], t[64:128])
    k.tensor_copy(u[96:128], t[96:128])
    assert err(k.tensor_copy, u[16:48], t[16:48]) == (
        "tensor_copy: tile 'u' covers 32 partitions starting at 16; an access of 32 partitions must start at "
        "partition 0, 32, 64 or 96")
    assert err(k.tensor_copy, u[32:100], t[32:100]).endswith("must start at partition 0")
    assert err(k.tensor_copy, u[0:128], t[0:64]) == (
        "tensor_copy: shape mismatch: 'u' (128, 64) vs 't' (64, 64)")


def test_engines_reach_only_their_memories(k):
    t = k.sbuf((128, 512), "fp32", name="t")
    p = k.psum((128, 512), "fp32", name="p")
    assert err(k.tensor_copy, t, p, engine="gpsimd") == (
        "tensor_copy: GpSimd cannot access PSUM (tile 'p'); use the vector or scalar engine")
    assert err(k.tensor_tensor, t, t, t, "add", engine="tensor") == (
        "tensor_tensor(add): engine 'tensor' cannot run this instruction; expected one of vector, gpsimd")
    x = k.input("x", (128, 512), "fp32")
    assert err(k.dma_copy, p, x) == (
        "dma_copy: DMA engines cannot access PSUM; evacuate PSUM with tensor_copy or activation first")
    assert err(k.tensor_copy, t, x[:, :]).startswith("tensor_copy: operands must be SBUF/PSUM tiles, got HBM view")


def test_dma_shapes_and_bounds(k):
    x = k.input("x", (256, 512), "bf16")
    t = k.sbuf((128, 256), "bf16", name="t")
    assert err(k.dma_copy, t, x[0:128, :]) == (
        "dma_copy: source x@0[(512, 128), (1, 512)] has shape (128, 512) but destination sbuf:t[0:128]@0[(1, 256)] "
        "has shape (128, 256); shapes must match (size-1 dims aside): reshape one side to the other")
    assert err(k.dma_copy, t, x[0:256, 0:128]).startswith("dma_copy: source")  # same size, other shape
    k.dma_copy(t[0:1, :], x[5, 0:256])        # a row into one partition: size-1 dims aside, shapes match
    assert err(lambda: x[0:300, :]) == "slice end 300 out of range for dim 0 of 'x' of size 256"
    assert err(lambda: t[:, 300]) == "index 300 out of range for free dim 1 of 't' of size 256"
    assert err(lambda: t[0:128:2, :]) == "partition slices must be contiguous (step 1), got step 2 on 't'"


def test_activation_and_ops_are_named(k):
    t = k.sbuf((128, 64), "fp32", name="t")
    assert err(k.activation, t, "swish2", t).startswith("unknown activation 'swish2': expected one of")
    assert err(k.tensor_tensor, t, t, t, "xor_add").startswith("unknown ALU op 'xor_add': expected one of")
    assert err(k.tensor_reduce, t[:, 0:1], "add", t, axis=0) == (
        "tensor_reduce(add): axis 0 is not a free axis of 't' (1..1); cross-partition reductions need "
        "nc_matmul with a ones vector")


def test_hbm_capacity_and_tensor_names():
    k = Kernel("t", "trn2")
    with pytest.raises(KernelError, match=r"^out of device memory: kernel 't' tensor 'w' needs 128 GiB, "
                                          r"but trn2 has 96 GiB of HBM \(chip\.hbm\.capacity\)$"):
        k.input("w", (2**16, 2**20), "fp16")
    k.input("a", (4,), "fp32")
    with pytest.raises(KernelError, match="tensor name 'a' is already used"):
        k.output("a", (4,), "fp32")


def test_queue_limit(k):
    x = k.input("x", (128, 64), "fp32")
    t = k.sbuf((128, 64), "fp32")
    for q in range(16):
        k.dma_copy(t, x, queue=q)
    assert err(k.dma_copy, t, x, engine="scalar", queue=0).startswith("dma_copy: kernel uses more than 16 DMA queues")
    for q in (16, 10**6):
        assert err(k.dma_copy, t, x, queue=q) == (f"dma_copy: queue {q} does not exist; trn2 has DMA queues 0..15 "
                                                  f"per engine (core.dma.queues)")


def test_another_kernels_tiles_and_tensors_are_refused(k):
    other = Kernel("other", "trn2")
    theirs = other.sbuf((128, 64), "fp32", name="theirs")  # uid 1, like the first tile of k
    mine = k.sbuf((128, 64), "fp32", name="mine")
    x = k.input("x", (128, 64), "fp32")
    assert err(k.free, theirs) == ("free: tile 'theirs' belongs to another kernel, not 't'; a kernel uses only its "
                                   "own tiles")
    assert theirs.alloc.live and other._sbuf.live == [theirs.alloc]  # not freed in its own kernel either
    assert err(k.dma_copy, theirs, x) == ("DmaCopy[qSyncIO0]: tile 'theirs' belongs to another kernel, not 't'; a kernel uses "
                                          "only its own tiles")
    assert err(k.tensor_copy, mine, theirs).startswith("TensorCopy: tile 'theirs' belongs to another kernel")
    y = other.input("y", (128, 64), "fp32")
    assert err(k.dma_copy, mine, y) == ("DmaCopy[qSyncIO0]: HBM tensor 'y' belongs to another kernel, not 't'; declare it with "
                                        "input/output/scratch on this kernel")
    assert err(k.dma_copy, mine[:, :32], y[:, :32]).startswith("DmaCopy[qSyncIO0]: HBM tensor 'y' belongs to another kernel")
    k.dma_copy(mine, x)
    assert len(k) == 1


def test_free_takes_the_whole_tile_not_a_slice(k):
    t = k.sbuf((128, 64), "fp32", name="t")
    for part in (t[:, :32], t[:64], t[:, 1:]):
        assert err(k.free, part) == (f"free: {list(part.shape)} at partition {part.p_start} is a slice of tile 't' "
                                     f"(128 partitions x 256 bytes); free the whole tile, as allocated")
    assert t.alloc.live
    k.free(t[:, :])  # the whole tile, however spelled
    assert not t.alloc.live
    assert err(k.free, t) == "SBUF tile 't' was already freed"
    pool = k.tile_pool("p", bufs=1)
    big = pool.tile((128, 64), "fp32")
    small = pool.tile((128, 16), "fp32")  # reuses big's buffer through a smaller view
    assert small.alloc is big.alloc
    pool.release()
    assert not big.alloc.live


def test_the_instruction_limit(monkeypatch):
    monkeypatch.setenv("TRNSIM_MAX_INSTRUCTIONS", "5")
    k = Kernel("loop", "trn2")
    t = k.sbuf((128, 64), "fp32")
    for _ in range(5):
        k.memset(t, 0.0)
    assert err(k.memset, t, 0.0) == ("kernel 'loop' has more than 5 instructions; check its shape, or raise the limit "
                                     "with TRNSIM_MAX_INSTRUCTIONS=N (about 1 KB of host memory each)")
    monkeypatch.setenv("TRNSIM_MAX_INSTRUCTIONS", "lots")
    with pytest.raises(ValueError, match=r"^TRNSIM_MAX_INSTRUCTIONS='lots': expected a whole number of instructions, "
                                         r"1\.\.1,000,000,000,000$"):
        Kernel("k", "trn2")


def test_freed_tiles_cannot_be_used(k):
    t = k.sbuf((128, 64), "fp32", name="t")
    k.free(t)
    assert err(k.memset, t, 0.0) == "Memset: tile 't' was freed before this instruction"


def test_dependencies():
    k = Kernel("deps", "trn2")
    x = k.input("x", (128, 1024), "fp32")
    y = k.output("y", (128, 1024), "fp32")
    t = k.sbuf((128, 1024), "fp32")
    l0 = k.dma_copy(t[:, 0:512], x[:, 0:512])
    l1 = k.dma_copy(t[:, 512:1024], x[:, 512:1024], queue=1)
    c0 = k.activation(t[:, 0:512], "relu", t[:, 0:512])
    s0 = k.dma_copy(y[:, 0:512], t[:, 0:512], queue=2)
    s1 = k.dma_copy(y[:, 512:1024], t[:, 512:1024], queue=3)
    w = k.memset(t, 0.0)
    assert c0.deps == (l0.index,)                      # RAW on its own half only
    assert s0.deps == (c0.index,)
    assert s1.deps == (l1.index,)                      # disjoint columns of y: no false WAW
    assert set(w.deps) == {l1.index, c0.index, s0.index, s1.index}  # WAW on the last writers, WAR on readers


def test_kernel_for_another_chip_is_rejected():
    k = Kernel("t", "trn3")
    with pytest.raises(KernelError, match=r"^kernel 't' was built for trn3 cores but this chip is trn2; "
                                          r"build it with Kernel\(\.\.\., config=chip\.config\)$"):
        Chip("trn2").run(k, timing_only=True)


def test_dependencies_through_strided_views():
    k = Kernel("strided", "trn2")
    y = k.output("y", (8, 1024), "fp32")
    t = k.sbuf((8, 512), "fp32")
    even = y[:, ::2]                     # columns 0, 2, 4, ...
    w0 = k.dma_copy(even[:, 1:3], t[:, 0:2])      # logical columns 2 and 4
    w1 = k.dma_copy(y[:, 4:5], t[:, 2:3], queue=1)   # column 4 again: must wait (WAW)
    w2 = k.dma_copy(y[:, 5:6], t[:, 3:4], queue=2)   # column 5: independent
    assert w1.deps == (w0.index,)
    assert w2.deps == ()


def test_same_queue_dmas_still_order_hbm_reads_before_writes():
    """A DMA queue orders completions, not data movement: a later transfer on the same queue
    that overwrites HBM an earlier one reads must wait for it."""
    k = Kernel("war", "trn2")
    x = k.input("x", (128, 512), "fp32")
    t1 = k.sbuf((64, 512), "fp32")
    t2 = k.sbuf((128, 512), "fp32")
    r = k.dma_copy(t1, x[0:64, :])
    w = k.dma_copy(x[0:64, :], t2[64:128, :])
    assert r.index in w.deps


def test_hbm_to_hbm_copies_use_all_engines():
    k = Kernel("copy", "trn2")
    a = k.input("a", (1024, 1024), "fp32")
    b = k.output("b", (1024, 1024), "fp32")
    ins = k.dma_copy(b, a)
    assert [e for e, _, _ in ins.plan.engines] == list(range(16))
    assert sum(n for _, n, _ in ins.plan.engines) == 4 * 2**20


@pytest.mark.parametrize("build,message", [
    (lambda k, t, x: x.ap(0, [[1, -5]]), "access pattern on 'x': sizes must be >= 1, got [[1, -5]]"),
    (lambda k, t, x: t[:, 0:1].broadcast_to(128, -3), "broadcast_to: shape (128, -3) must be positive integers"),
    (lambda k, t, x: k.tensor_reduce(t[:, 0:1], "add", t, axis=(1, 1)), "tensor_reduce(add): axis (1, 1) names an axis twice"),
    (lambda k, t, x: k.sbuf(128, "bf16"), "SBUF tile 'sbuf3': shape must be a tuple of sizes like (128, 512), got 128"),
    (lambda k, t, x: k.sbuf((128, 4), "bogus", name="b"),
     "SBUF tile 'b': unknown dtype 'bogus': expected one of bf16, fp16, fp32, fp8_e4m3, fp8_e4m3fn, fp8_e5m2, "
     "int8, uint8, int16, int32, uint32"),
    (lambda k, t, x: k.tile_pool("p", bufs=2.5), "tile pool 'p': bufs must be an integer >= 1, got 2.5"),
    (lambda k, t, x: k.tensor_reduce(t[:, 0:1], "add", t, axis="1"), "tensor_reduce(add): axis must be an integer, got '1'"),
    (lambda k, t, x: k.memset(t, "zero"), "memset: value must be a number, got 'zero'"),
    (lambda k, t, x: k.dma_copy(t, [1, 2]), "dma_copy: src must be an HBM tensor or view or an SBUF tile, got list"),
    (lambda k, t, x: k.free(x), "free: expected an SBUF/PSUM tile, got HbmTensor (HBM tensors live as long as the kernel)"),
    (lambda k, t, x: k.tensor_copy(t, 3.0), "tensor_copy: operands must be SBUF/PSUM tiles, got float"),
    (lambda k, t, x: k.dma_copy(t, x, queue=-1), "dma_copy: queue must be an integer >= 0, got -1"),
])
def test_bad_builder_input_is_a_kernel_error(build, message):
    k = Kernel("bad", "trn2")
    x = k.input("x", (128, 64), "fp32")
    t = k.sbuf((128, 64), "fp32", name="t")
    assert err(build, k, t, x) == message


def test_transpose_keeps_the_dtype():
    k = Kernel("tr", "trn2")
    t = k.sbuf((128, 64), "bf16")
    p16 = k.psum((64, 128), "fp16")
    assert err(k.nc_transpose, p16, t) == "nc_transpose: dst dtype float16 must be fp32 or the input dtype bfloat16"
    k.nc_transpose(k.psum((64, 128), "fp32"), t)


def test_double_row_is_for_fp8_only():
    k = Kernel("dr", "trn2")
    st = k.sbuf((128, 2, 128), "bf16")
    mv = k.sbuf((128, 2, 256), "bf16")
    acc = k.psum((128, 512), "fp32")
    assert err(k.nc_matmul, acc, st, mv) == (
        "nc_matmul: stationary free size 256 exceeds 128 (core.tensor.stationary_max_free on trn2)")


def test_access_pattern_limits():
    k = Kernel("ap", "trn2")
    t = k.sbuf((128, 2, 40000), "bf16", name="t")
    u = k.sbuf((128, 2), "bf16", name="u")
    assert err(k.tensor_copy, u, t[:, :, 0]) == (
        "tensor_copy: tile 't' access pattern [(40000, 2)] needs sizes <= 65535 and strides within "
        "-32768..32767 elements")


def test_bad_chip_input_is_an_error():
    from trnsim import ConfigError

    with pytest.raises(ConfigError, match=r"^a config is a name \(trn1, trn2, trn3\), a path to a \.yaml file or a "
                                          r"ChipConfig, got NoneType$"):
        Chip(None)
    assert Chip("trn2", "core.sbuf.partition_bytes=256KiB").config.core.sbuf.partition_bytes == 262144
    chip = Chip("trn2")
    k = chip.kernel("k")
    k.input("x", (4,), "fp32")
    with pytest.raises(KernelError, match=r"^inputs must map input names to arrays"):
        chip.run(k, [("x", [1, 2, 3, 4])])
    with pytest.raises(KernelError, match=r"^core 1.5 out of range: trn2 has cores 0..7$"):
        chip.run(k, timing_only=True, core=1.5)
    with pytest.raises(KernelError, match=r"^input 'x' has dtype <U1; expected numbers"):
        chip.run(k, {"x": np.array(["a", "b", "c", "d"])})
    with pytest.raises(KernelError, match=r"^run_spmd: 2 kernels but 1 input mappings; give one per kernel$"):
        chip.run_spmd([k, k], [{}])
