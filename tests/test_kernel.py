"""The kernel builder: hardware rules checked at build time with messages users can act on."""

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
        "dma_copy: source x@0[(512, 128), (1, 512)] has 65536 elements (shape (128, 512)) but destination "
        "sbuf:t[0:128]@0[(1, 256)] has 32768 (shape (128, 256))")
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
    assert err(k.dma_copy, t, x, queue=16).startswith("dma_copy: kernel uses more than 16 DMA queues")


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
