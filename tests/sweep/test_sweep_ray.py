"""Sweeps on Ray (`--executor ray`) on a local Ray instance: the same rows as the process pool,
a sweep SIGKILLed mid-run resumes, a point whose worker dies is recorded with its error and
rerun by the next run, and the one-line errors (no Ray, a bad address, --address without Ray).
Skipped when Ray is not installed (`pip install -e '.[ray]'`; .ci/run installs it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from test_sweep_safety import data_lines, rows_of, start, wait_for
from trnsim.cli import main
from trnsim.config import ConfigError
from trnsim.sweep import WORKER_FAILED, load_spec, run_sweep

# a [128, cols] copy that takes TRNSIM_TEST_SLOW seconds to build, and whose worker process dies
# (os._exit) on the chip variant whose TensorE clock (in Hz) a file "die" beside it names: the spec
# is checked on the base config first, so only a worker ever builds that variant (a file, not an
# environment variable: the workers of a running Ray instance keep the environment they started with)
KERNEL = '''
import os, time
import trnsim

DIE = os.path.join(os.path.dirname(__file__), "die")

def build(rows, cols, config="trn2"):
    if os.path.exists(DIE) and config.core.tensor.clock == int(open(DIE).read()):
        os._exit(3)
    time.sleep(float(os.environ.get("TRNSIM_TEST_SLOW", "0")))
    k = trnsim.Kernel("copy", config)
    x, y = k.input("x", (rows, cols), "fp32"), k.output("y", (rows, cols), "fp32")
    t = k.sbuf((rows, cols), "fp32")
    k.dma_copy(t, x)
    k.dma_copy(y, t)
    return k
'''


def _spec(tmp_path: Path, clocks: int = 4) -> Path:
    (tmp_path / "copy.py").write_text(KERNEL)
    values = ", ".join(f"{1 + i}GHz" for i in range(clocks))
    spec = tmp_path / "spec.yaml"
    spec.write_text(f"grid:\n  core.tensor.clock: [{values}]\n  core.dma.engine_bandwidth: [27.2GB/s, 40GB/s]\n"
                    f"kernels:\n  - {{name: copy.py:build, shapes: [128x64, 128x512]}}\n  - {{name: matmul, shape: "
                    f"128x256x256, dtype: bf16}}\n")
    return spec


def test_an_address_needs_the_ray_executor(tmp_path):
    spec = load_spec(_spec(tmp_path, 1))
    with pytest.raises(ConfigError, match=r"^--address 127.0.0.1:6379: a cluster address needs --executor ray$"):
        run_sweep(spec, address="127.0.0.1:6379")


def test_without_ray_a_one_line_error(tmp_path):
    spec = _spec(tmp_path, 1)
    block = "import sys\nsys.modules['ray'] = None\nfrom trnsim.cli import main\nraise SystemExit(main(sys.argv[1:]))\n"
    out = subprocess.run([sys.executable, "-c", block, "sweep", str(spec), "--executor", "ray"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == ("trnsim: error: --executor ray needs ray (the 'ray' extra), which is not installed: "
                          "python3 -m pip install -e '.[ray]'\n")
    assert not (tmp_path / "spec.csv").exists()


ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance for the in-process sweeps of this module (run_sweep joins it)."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=256 << 20,
             logging_level="ERROR")
    yield
    ray.shutdown()


def test_ray_gives_the_same_rows_as_the_pool(tmp_path, local_ray):
    spec_path = _spec(tmp_path)
    pool = run_sweep(load_spec(spec_path, tmp_path / "pool.csv"), jobs=2)
    on_ray = run_sweep(load_spec(spec_path, tmp_path / "ray.csv"), executor="ray")
    assert on_ray.rows == pool.rows and on_ray.ran == len(pool.rows) == 24
    assert sorted(map(tuple, (r.values() for r in rows_of(tmp_path / "ray.csv")))) == \
        sorted(map(tuple, (r.values() for r in rows_of(tmp_path / "pool.csv"))))
    again = run_sweep(load_spec(spec_path, tmp_path / "ray.csv"), executor="ray")
    assert again.ran == 0


def test_a_point_whose_worker_dies_is_recorded_and_rerun(tmp_path, local_ray):
    spec = load_spec(_spec(tmp_path), tmp_path / "r.parquet" if _has_pyarrow() else tmp_path / "r.csv")
    (tmp_path / "die").write_text(str(3 * 10**9))  # the 3GHz variant's copy points
    result = run_sweep(spec, executor="ray")
    failed = [r for r in result.rows if r["error"]]
    assert len(failed) == 4 and {r["core.tensor.clock"] for r in failed} == {"3GHz"}
    assert all(r["error"].startswith(WORKER_FAILED) and r["cycles"] == "" for r in failed)
    assert all(r["cycles"] for r in result.rows if not r["error"])
    os.unlink(tmp_path / "die")
    rerun = run_sweep(spec, executor="ray")
    assert rerun.ran == 4 and not any(r["error"] for r in rerun.rows)


def _has_pyarrow() -> bool:
    try:
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        return False
    return True


def test_a_sigkilled_ray_sweep_resumes(tmp_path, capsys, local_ray):
    spec = _spec(tmp_path)
    proc = start(spec, "--executor", "ray", "--jobs", "2", TRNSIM_TEST_SLOW="0.5")
    try:
        wait_for(lambda: data_lines(tmp_path / "spec.csv") >= 2, timeout=120, what="two rows from Ray")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    kept = data_lines(tmp_path / "spec.csv")
    assert 2 <= kept < 24
    # the killed sweep's lock went with it: this one resumes on the fixture's Ray instance
    assert main(["sweep", str(spec), "--executor", "ray"]) == 0
    assert f"{24 - kept} points run, {kept} from a previous run" in capsys.readouterr().out
    rows = rows_of(tmp_path / "spec.csv")
    assert len(rows) == 24 and not any(r["error"] for r in rows)


@pytest.mark.parametrize("address,message", [
    ("127.0.0.1:1", "--address 127.0.0.1:1: cannot reach a Ray cluster there (Connection refused)"),
    ("head-node", "--address head-node: expected HOST:PORT of a Ray cluster's head (ray start --head), e.g. "
                  "10.0.0.1:6379"),
    ("10.0.0.1:99999", "--address 10.0.0.1:99999: expected HOST:PORT of a Ray cluster's head (ray start --head), e.g. "
                       "10.0.0.1:6379"),
])
def test_an_address_nothing_answers_at_is_one_line_and_leaves_nothing(tmp_path, capsys, address, message):
    """Issue 25: --address 127.0.0.1:1 looped Ray's 'Failed to connect to GCS' for ever, and a
    failed start left a header-only results file behind."""
    spec = _spec(tmp_path, 1)
    assert main(["sweep", str(spec), "--executor", "ray", "--address", address]) == 2
    assert capsys.readouterr() == ("", f"trnsim: error: {message}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.py", "spec.yaml"]


def test_an_address_that_does_not_answer_is_bounded_by_the_timeout(tmp_path, capsys, monkeypatch):
    """An unroutable address: the connection attempt gets --timeout seconds (Ray is never asked)."""
    import socket

    asked = []

    def silent(addr, timeout=None):
        asked.append((addr, timeout))
        raise socket.timeout("timed out")

    monkeypatch.setattr(socket, "create_connection", silent)
    spec = _spec(tmp_path, 1)
    assert main(["sweep", str(spec), "--executor", "ray", "--address", "192.0.2.1:6379", "--timeout", "7"]) == 2
    assert capsys.readouterr() == ("", "trnsim: error: --address 192.0.2.1:6379: no answer from a Ray cluster there "
                                       "within 7 s (is the head running and the port reachable? --timeout waits "
                                       "longer)\n")
    assert asked == [(("192.0.2.1", 6379), 7.0)]
    assert main(["sweep", str(spec), "--timeout", "7"]) == 2
    assert capsys.readouterr().err == "trnsim: error: --timeout: it bounds reaching --address; give one\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy.py", "spec.yaml"]
