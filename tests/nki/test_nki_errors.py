"""What trnsim.nki does not support, and kernels that break a rule, fail with one line naming the
construct and the kernel's file and line (pinned messages)."""

import numpy as np
import pytest

import trnsim.nki as nki
import trnsim.nki.isa as nisa
import trnsim.nki.language as nl
from trnsim.nki import NkiError

X = np.zeros((128, 512), np.float32)


def line_of(fn, text):
    """``test_nki_errors.py:N`` of the line in ``fn`` containing ``text``."""
    import inspect

    src, start = inspect.getsourcelines(fn.fn)
    n = next(i for i, line in enumerate(src) if text in line)
    return f"test_nki_errors.py:{start + n}"


def test_an_unsupported_isa_call_names_itself_and_the_line():
    @nki.jit
    def k(x):
        t = nl.load(x)
        nisa.local_gather(t, t, t)
        return x

    with pytest.raises(NkiError) as e:
        k(X)
    assert str(e.value) == (f"{line_of(k, 'local_gather')}: nisa.local_gather is not supported by trnsim.nki: "
                            f"GpSimd gathers are not modelled")


@pytest.mark.parametrize("call, message", [
    (lambda t: nl.device_print("t", t), "nl.device_print is not supported by trnsim.nki: values are computed after "
                                        "the kernel is traced; print the outputs instead"),
    (lambda t: nisa.register_alloc(0), "nisa.register_alloc is not supported by trnsim.nki: registers and dynamic "
                                       "control flow are not modelled"),
    (lambda t: nl.fori_loop(0, 4, lambda i: None), "nl.fori_loop is not supported by trnsim.nki: dynamic loops are "
                                                   "not modelled"),
    (lambda t: nisa.nc_matmul(t[:, 0:128], t, tile_position=(0, 0), tile_size=(64, 128)),
     "nisa.nc_matmul: tile_position/tile_size (PE array tiling) is not supported by trnsim.nki"),
    (lambda t: t[t], "indexing a tensor with another tensor (dynamic or indirect access) is not supported by "
                     "trnsim.nki; for row gathers use nisa.dma_copy with a gather"),
    (lambda t: nl.square(t, mask=(nl.arange(128)[:, None] < nl.arange(512)[None, :])),
     "a mask that relates two indices (e.g. i_p < i_f) is not supported by trnsim.nki; use nisa.affine_select for "
     "triangular masks"),
    (lambda t: nl.ndarray((128, 64), nl.float32, address=(0, 0)),
     "nl.ndarray(address=...) (manual allocation) is not supported by trnsim.nki: the scheduling pass lays tiles "
     "out, as the compiler does"),
    (lambda t: bool(t), "the values of nl.load result are not known at trace time: a tensor has no truth value (control flow "
                        "on values needs dynamic loops, not supported by trnsim.nki)"),
])
def test_unsupported_constructs_are_one_line(call, message):
    @nki.jit
    def k(x):
        t = nl.load(x)
        t._store()
        call(t)
        return x

    with pytest.raises(NkiError) as e:
        k(X)
    assert str(e.value).split(": ", 1)[1] == message
    assert str(e.value).startswith("test_nki_errors.py:")
    assert "\n" not in str(e.value)


def test_hardware_rules_come_from_the_builder_with_the_line():
    @nki.jit
    def too_many_partitions(x):
        return nl.ndarray((256, 512), nl.float32, buffer=nl.sbuf)

    with pytest.raises(NkiError) as e:
        too_many_partitions(X)
    assert str(e.value) == (f"{line_of(too_many_partitions, 'ndarray')}: SBUF tile t0 has 256 partitions in dim 0 of "
                            f"(256, 512); at most 128 (nl.tile_size.pmax): tile the partition dim")

    @nki.jit
    def wide_moving(a, b):
        return nisa.nc_matmul(nl.load(a), nl.load(b))

    with pytest.raises(NkiError, match=r"^test_nki_errors.py:\d+: nc_matmul: moving free size 1024 exceeds 512 "
                                       r"\(core.tensor.moving_max_free on trn2\)$"):
        wide_moving(np.zeros((128, 128), np.float32), np.zeros((128, 1024), np.float32))


def test_a_kernels_own_python_error_keeps_its_line():
    @nki.jit
    def k(x):
        assert x.shape[0] == 64, f"expected 64 rows, got {x.shape[0]}"
        return x

    with pytest.raises(NkiError) as e:
        k(X)
    assert str(e.value) == f"{line_of(k, 'assert')}: AssertionError: expected 64 rows, got 128"


def test_the_kernel_must_return_hbm_tensors():
    @nki.jit
    def k(x):
        return nl.load(x)

    with pytest.raises(NkiError, match=r"^k returned nl.load result \(sbuf\); return whole HBM tensors \(store "
                                       r"on-chip tiles to one first\)$"):
        k(X)


def test_the_kernel_may_not_return_its_argument():
    """Returning an input (its memory the caller's) was a KeyError from deep in the run; on the
    neuron device such an output would have been a second, non-owning tensor over that memory."""
    @nki.jit
    def k(x):
        return x

    with pytest.raises(NkiError, match=r"^k returned its argument x; a kernel returns HBM tensors it allocates "
                                       r"\(nl.ndarray\(\.\.\., buffer=nl.shared_hbm\)\), and writes an argument it "
                                       r"changes in place$"):
        k(X)


def test_out_of_range_index_under_its_mask():
    @nki.jit
    def k(x):
        i_p, i_f = nl.mgrid[0:128, 0:512]
        return nl.load(x[i_p + 64, i_f])

    with pytest.raises(NkiError, match=r"^test_nki_errors.py:\d+: nl.load: index 64..191 out of range for dim 0 of x "
                                       r"\(size 128\); a mask can keep an index expression in range$"):
        k(X)


def test_apis_outside_a_kernel_and_bad_arguments():
    with pytest.raises(NkiError, match=r"^an NKI API was called outside a kernel: call it inside a function decorated "
                                       r"with @nki.jit, run through trnsim.nki$"):
        nl.zeros((128, 4), nl.float32)

    @nki.jit
    def k(x):
        return x

    with pytest.raises(NkiError, match=r"^argument 'x' is a float64 array; NKI tensors are float32, bfloat16, "
                                       r"float16, fp8, int8/16/32 or uint8/32: cast it$"):
        k(np.zeros((4, 4)))
    with pytest.raises(NkiError, match=r"^k: missing a required argument: 'x'$"):
        k()

    @nki.jit
    def bad_kwarg(x):
        nisa.tensor_copy(nl.load(x), colour="red")
        return x

    with pytest.raises(NkiError, match=r"^test_nki_errors.py:\d+: nisa.tensor_copy: unexpected argument 'colour'$"):
        bad_kwarg(X)


def test_sbuf_too_small_for_the_kernel_in_any_order():
    @nki.jit
    def k(x):
        tiles = [nl.load(x) for _ in range(4)]  # all four live at once: 4 x 64 KiB per partition
        out = nl.ndarray((128, 16384), nl.float32, buffer=nl.shared_hbm)
        acc = tiles[0]
        for t in tiles[1:]:
            acc = nl.add(acc, t)
        nl.store(out, value=acc)
        return out

    with pytest.raises(NkiError, match=r"^SBUF is full: tile '.*' needs 64 KiB per partition on partitions 0..127 for "
                                       r"instruction #\d+ \(DmaCopy\[qSyncIO0\], test_nki_errors.py:\d+\), but tiles still "
                                       r"to be used hold 192 KiB of 224 KiB$"):
        k(np.zeros((128, 16384), np.float32))


def test_a_slice_past_the_tensor_is_refused_with_the_line():
    """Issue 25: ``x[0:256, 0:512]`` of a 128-row tensor was clamped to its 128 rows (Python's
    slicing) while the same range as an index expression was refused."""
    @nki.jit
    def k(x):
        out = nl.ndarray((128, 512), nl.float32, buffer=nl.shared_hbm)
        nl.store(out, nl.load(x[0:256, 0:512]))
        return out

    with pytest.raises(NkiError) as e:
        k(X)
    assert str(e.value) == f"{line_of(k, 'nl.load')}: slice 0:256 reaches index 255, out of range for dim 0 of x (size 128)"


@pytest.mark.parametrize("index,message", [
    ((slice(None), slice(0, 513, 2)), "slice 0:513 reaches index 512, out of range for dim 1 of x (size 512)"),
    ((slice(-129, None), slice(None)), "slice -129:None reaches index -1, out of range for dim 0 of x (size 128)"),
    ((slice(None), slice(600, 700)), "slice 600:700 reaches index 699, out of range for dim 1 of x (size 512)"),
])
def test_slices_are_checked_against_the_tensor(index, message):
    @nki.jit
    def k(x):
        return nl.load(x[index])

    with pytest.raises(NkiError) as e:
        k(X)
    assert str(e.value).split(": ", 1)[1] == message


def test_slices_inside_the_tensor_still_load_what_numpy_slices():
    @nki.jit
    def k(x):
        out = nl.ndarray((128, 2), nl.float32, buffer=nl.shared_hbm)
        nl.store(out, nl.load(x[-128:, 1:129:64]))
        return out

    x = np.arange(128 * 512, dtype=np.float32).reshape(128, 512)
    np.testing.assert_array_equal(k(x), x[-128:, 1:129:64])


def test_a_psum_tile_is_one_bank():
    """Issue 25: a (128, 4096) fp32 PSUM tile (all eight banks) was accepted; an NKI PSUM tile
    is one 2 KiB bank per partition."""
    @nki.jit
    def k(x):
        acc = nl.zeros((128, 4096), nl.float32, buffer=nl.psum)
        return x

    with pytest.raises(NkiError) as e:
        k(X)
    assert str(e.value) == (f"{line_of(k, 'nl.zeros')}: PSUM tile t0 of (128, 4096) fp32 takes 16,384 bytes per "
                            f"partition; a PSUM tile is one bank, at most 2,048 bytes per partition "
                            f"(nl.tile_size.psum_fmax fp32 elements): tile the free dim")


@pytest.mark.parametrize("call,what", [(lambda t: nl.exp(t), "nl.exp"),
                                       (lambda t: nl.sigmoid(t), "nl.sigmoid"),
                                       (lambda t: nisa.activation(op=nl.exp, data=t), "nisa.activation")])
def test_a_fractional_activation_of_an_integer_tile_needs_a_dtype(call, what):
    """Issue 25: nl.exp of an int32 tile returned saturated integers without a word. NKI's
    result dtype defaults to the input's (nki.language.exp in the NKI API reference), so the
    fp32 values ScalarE computes come back as integers: refused unless a dtype is asked for."""
    @nki.jit
    def k(x):
        return call(nl.load(x))

    with pytest.raises(NkiError) as e:
        k(np.full((128, 512), 30, np.int32))
    op = what.split(".")[1] if what.startswith("nl.") else "exp"
    assert str(e.value).split(": ", 1)[1] == (
        f"{what}: {op} of an int32 tile would give int32 results (NKI's default dtype is the input's), the fp32 values "
        f"rounded and saturated to integers; pass dtype=nl.float32 for the values, or dtype=nl.int32 to keep integers")


def test_integer_activations_that_stay_integral_and_explicit_dtypes_run():
    @nki.jit
    def k(x):
        t = nl.load(x)
        a = nl.relu(t)
        b = nl.exp(t, dtype=nl.float32)
        out_a = nl.ndarray(a.shape, a.dtype, buffer=nl.shared_hbm)
        out_b = nl.ndarray(b.shape, b.dtype, buffer=nl.shared_hbm)
        nl.store(out_a, a)
        nl.store(out_b, b)
        return out_a, out_b

    x = np.full((128, 512), 3, np.int32)
    a, b = k(x)
    assert a.dtype == np.int32 and (a == 3).all()
    np.testing.assert_allclose(b, np.exp(3.0), rtol=1e-6)


def test_a_runaway_loop_is_refused_after_its_first_iteration(monkeypatch):
    """``nl.sequential_range(10**9)`` was traced at ~50 us an instruction for ~100 s before the
    builder's limit stopped it; a loop whose length would pass the limit stops after one."""
    @nki.jit
    def k(x, n):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        for _ in nl.sequential_range(n):
            nl.store(out, nl.load(x))
        return out

    with pytest.raises(NkiError) as e:
        k(X, 10**9)
    assert str(e.value) == (f"{line_of(k, 'sequential_range')}: a loop of 1,000,000,000 iterations emitted 2 "
                            f"instruction(s) in its first: the kernel would pass its 2,000,000-instruction limit; "
                            f"check the loop's bounds, or raise the limit with TRNSIM_MAX_INSTRUCTIONS=N")
    monkeypatch.setenv("TRNSIM_MAX_INSTRUCTIONS", "20000")
    assert k(X, 5000) is not None  # 10,000 instructions: within it
    monkeypatch.setenv("TRNSIM_MAX_INSTRUCTIONS", "9000")
    with pytest.raises(NkiError, match="a loop of 5,000 iterations emitted 2 instruction"):
        k(X, 5000)
