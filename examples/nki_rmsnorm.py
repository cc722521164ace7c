"""An NKI kernel run on trnsim with its imports changed and nothing else (see README, "NKI
kernels"): RMSNorm over rows of 128, written as a plain loop; the scheduling pass overlaps the
row tiles as the Neuron compiler would.

    python examples/nki_rmsnorm.py                 # values against numpy and the simulated time
    trnsim kernel examples/nki_rmsnorm.py:rmsnorm_kernel --shape 1024x2048,2048
"""

import numpy as np

import trnsim.nki as nki                  # was: import neuronxcc.nki as nki
import trnsim.nki.isa as nisa             # was: import neuronxcc.nki.isa as nisa
import trnsim.nki.language as nl          # was: import neuronxcc.nki.language as nl


@nki.jit
def rmsnorm_kernel(x, w, eps=1e-6):
    """y = x / sqrt(mean(x^2) + eps) * w over rows of 128."""
    R, H = x.shape
    out = nl.ndarray((R, H), dtype=x.dtype, buffer=nl.shared_hbm)
    i_p, i_h = nl.mgrid[0:128, 0:H]
    weight = nl.load(w.reshape((1, H))[i_p * 0, i_h])        # broadcast to every partition
    for t in nl.affine_range(R // 128):
        tile = nl.load(x[t * 128 + i_p, i_h])
        ss = nl.ndarray((128, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=nl.ndarray((128, H), dtype=nl.float32, buffer=nl.sbuf),
                        op=nl.square, data=tile, reduce_op=nl.add, reduce_res=ss)
        rstd = nl.rsqrt(nisa.tensor_scalar(ss, nl.multiply, 1.0 / H, op1=nl.add, operand1=eps))
        nl.store(out[t * 128 + i_p, i_h], value=nl.multiply(nl.multiply(tile, rstd), weight))
    return out


if __name__ == "__main__":
    x = np.random.default_rng(0).standard_normal((1024, 2048), dtype=np.float32)
    w = np.random.default_rng(1).standard_normal(2048, dtype=np.float32)
    run = nki.run(rmsnorm_kernel, x, w)
    ref = x / np.sqrt((x * x).mean(axis=1, keepdims=True) + 1e-6) * w
    print(f"rmsnorm 1024x2048 fp32 on {run.report.config}: max error {np.abs(run.outputs - ref).max():.1e}, "
          f"{run.report.total_us:.1f} us simulated")
