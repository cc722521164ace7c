"""The examples run and their kernels are numerically right."""

import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def test_softmax_example_kernel():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        from softmax_kernel import build_softmax
    finally:
        sys.path.pop(0)
    import trnsim

    x = np.random.default_rng(1).standard_normal((256, 384), dtype=np.float32)
    y = trnsim.Chip("trn2").run(build_softmax(256, 384), {"x": x})["y"].astype(np.float64)
    xf = x.astype(trnsim.bfloat16.np_dtype).astype(np.float64)
    ref = np.exp(xf - xf.max(axis=1, keepdims=True))
    ref /= ref.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(y, ref, rtol=1e-2, atol=1e-4)
    np.testing.assert_allclose(y.sum(axis=1), 1.0, rtol=2e-2)


def test_softmax_example_script():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "softmax_kernel.py"), "--rows", "128", "--cols", "256"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "softmax 128x256 bf16 on trn2" in r.stdout
