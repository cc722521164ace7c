"""`trnsim run script.py`: the script runs on the neuron device and the report is printed."""

import json
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import sys
    import torch
    x = torch.randn(64, 128, device="neuron")
    w = torch.randn(128, 256, device="neuron")
    y = (x @ w).relu()
    print("args", sys.argv[1:], torch.neuron.config().name, y.device)
""")


def _trnsim(*argv: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trnsim.cli", *argv], capture_output=True, text=True, timeout=180,
                          cwd=cwd)


def test_run_prints_report_and_writes_trace(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    trace = tmp_path / "out.json"
    out = _trnsim("run", str(script), "a", "--b", "--config", "trn3", "--trace", str(trace), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "args ['a', '--b'] trn3 neuron:0" in out.stdout
    assert "neuron run report" in out.stdout and "matmul" in out.stdout and "unary" in out.stdout
    events = json.loads(trace.read_text())["traceEvents"]
    assert {e["name"] for e in events if e["ph"] == "X"} >= {"mm", "relu"}


def test_run_json_and_errors(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    out = _trnsim("run", "--json", str(script), cwd=tmp_path)
    rep = json.loads(out.stdout)  # stdout is the JSON alone: the script's print went to stderr
    assert out.returncode == 0 and rep["config"] == "trn2" and any(r["op"] == "mm" for r in rep["rows"])
    assert "args [] trn2 neuron:0" in out.stderr
    assert rep["elapsed_us"] > 0 and rep["device_us"] > 0 and "total_us" not in rep
    missing = _trnsim("run", str(tmp_path / "nope.py"), cwd=tmp_path)
    assert missing.returncode == 2
    assert missing.stderr.strip() == f"trnsim: error: run: no such script: {tmp_path / 'nope.py'}"
    a_dir = _trnsim("run", str(tmp_path), cwd=tmp_path)  # (it said "no such script" of a directory that exists)
    assert a_dir.returncode == 2 and a_dir.stderr.strip() == f"trnsim: error: run: {tmp_path}: a directory, not a Python script"
    bad = _trnsim("run", str(script), "--config", "trn9", cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr.startswith("trnsim: error: ") and len(bad.stderr.strip().splitlines()) == 1


def test_run_json_stdout_is_clean_even_for_output_below_python(tmp_path):
    script = tmp_path / "noisy.py"
    script.write_text("import os, subprocess, sys, torch\n"
                      "os.write(1, b'raw fd write\\n')\n"
                      "subprocess.run([sys.executable, '-c', 'print(\"child\")'])\n"
                      "print('from python')\n"
                      "torch.ones(4, device='neuron').sum().item()\n")
    out = _trnsim("run", str(script), "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["launches"] >= 1
    assert all(s in out.stderr for s in ("raw fd write", "child", "from python"))


def test_failing_script_exits_1_with_its_traceback(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text("import torch\ntorch.ones(2, device='neuron')\nraise ValueError('boom')\n")
    out = _trnsim("run", str(script), cwd=tmp_path)
    assert out.returncode == 1 and "ValueError: boom" in out.stderr and "neuron run report" in out.stdout


def test_sys_exit_with_a_message_prints_it_like_python(tmp_path):
    script = tmp_path / "quit.py"
    script.write_text("import sys, torch\ntorch.ones(2, device='neuron')\nsys.exit('no data in ./corpus')\n")
    out = _trnsim("run", str(script), cwd=tmp_path)
    assert out.returncode == 1 and out.stderr == "no data in ./corpus\n"
    assert "neuron run report" in out.stdout
    plain = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert (plain.returncode, plain.stderr) == (out.returncode, out.stderr)


def test_a_trace_that_cannot_be_written_is_refused_before_the_script_runs(tmp_path):
    import os

    script = tmp_path / "s.py"
    script.write_text("open('ran', 'w').close()\n")
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    out = _trnsim("run", str(script), "--trace", str(fifo), cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr == f"trnsim: error: --trace {fifo}: it is a FIFO, not a regular file; give a file path\n"
    assert not (tmp_path / "ran").exists()
    target = tmp_path / "real.json"
    target.write_text("old")
    (tmp_path / "link.json").symlink_to(target)
    script.write_text(SCRIPT)
    out = _trnsim("run", str(script), "--trace", "link.json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "link.json").is_symlink() and json.loads(target.read_text())["traceEvents"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo.json", "link.json", "real.json", "s.py"]


def test_host_profile_splits_the_wall_time_and_leaves_the_report_as_it_is(tmp_path):
    """`--host-profile` prints where the host's wall time went (the simulator's parts); the
    simulated report is the one the same run gives without it."""
    script = tmp_path / "s.py"
    script.write_text(SCRIPT)
    out = _trnsim("run", str(script), "--host-profile", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "neuron run report" in out.stdout and "Where the host's wall time went" in out.stdout
    table = out.stdout.split("Where the host's wall time went", 1)[1]
    assert all(p in table for p in ("build", "simulate", "python path (all ops)", "rest: fast path"))
    plain = json.loads(_trnsim("run", "--json", str(script), cwd=tmp_path).stdout)
    profiled = json.loads(_trnsim("run", str(script), "--json", "--host-profile", cwd=tmp_path).stdout)
    host = profiled.pop("host_profile")
    assert profiled == plain  # (each a fresh process: the same kernels simulated, the same report)
    assert host["wall_s"] > 0 and host["kernels_simulated"] >= 2
    parts = {p["part"]: p for p in host["parts"]}
    assert parts["build"]["seconds"] > 0 and parts["simulate"]["calls"] >= 1
    assert sum(p["seconds"] for p in host["parts"]) + host["rest_s"] + host["datapath_s"] == \
        pytest.approx(host["wall_s"])
    for extra in ("--nproc=2", "--compare-eager", f"--trace={tmp_path / 't.json'}"):
        bad = _trnsim("run", str(script), "--host-profile", extra, cwd=tmp_path)
        assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
        assert bad.stderr.startswith("trnsim: error: run: --host-profile ")
    assert not (tmp_path / "t.json").exists()


def test_cost_cache_keeps_the_kernels_costs_for_the_next_run(tmp_path):
    """``--cost-cache`` (before or after the script): the costs go to the estimates' cache
    ($XDG_CACHE_HOME/trnsim/costs here), the second run simulates no kernel and prints the same
    report as the first and as a run without the cache. Refused in one line before the script
    runs: a value given to the flag, a cache that is a file, the flag with the cost cache off."""
    import os

    from torch_bridge import _native

    script = tmp_path / "s.py"
    script.write_text(SCRIPT + "from torch_bridge.runtime import runtime\n"
                               "print('simulated', runtime().device.simulated, type(runtime().device).__name__)\n")
    home = tmp_path / "xdg"
    (home / "trnsim").mkdir(parents=True)
    built = _native.library_path()  # the native extension this machine built, where the moved cache looks for it
    (home / "trnsim" / built.name).symlink_to(built)
    env = {k: v for k, v in os.environ.items() if k not in ("TRNSIM_COST_CACHE", "TRNSIM_CACHE_DIR")}
    env["XDG_CACHE_HOME"] = str(home)

    def run(*argv: str, **more: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "trnsim.cli", "run", *argv], capture_output=True, text=True,
                              timeout=180, cwd=tmp_path, env={**env, **more})

    first = run(str(script), "--cost-cache", "--json")
    assert first.returncode == 0, first.stderr
    assert "CachedDevice" in first.stderr and "simulated 0 " not in first.stderr
    assert list((home / "trnsim" / "costs").rglob("*.json"))
    second = run("--cost-cache", "--json", str(script))
    assert second.returncode == 0, second.stderr
    assert "simulated 0 CachedDevice" in second.stderr
    assert json.loads(second.stdout) == json.loads(first.stdout)
    plain = run("--json", str(script))
    assert "simulated 0 " not in plain.stderr and " Device" in plain.stderr
    assert json.loads(plain.stdout) == json.loads(first.stdout)
    one_line = [
        (run(str(script), "--cost-cache=/elsewhere"), "run: --cost-cache takes no value (got '--cost-cache=/elsewhere')"),
        (run("--cost-cache", str(script), TRNSIM_COST_CACHE=str(script)),
         f"run: TRNSIM_COST_CACHE={script}: {script} is not a directory; expected a directory for the neuron "
         f"device's kernel costs, 'on' (the estimates' cache) or 'off'"),
        (run("--cost-cache", str(script), TRNSIM_CACHE_DIR="off"),
         "run: --cost-cache: the cost cache is off (TRNSIM_CACHE_DIR=off); set TRNSIM_COST_CACHE to a directory for it"),
    ]
    for out, message in one_line:
        assert out.returncode == 2 and "args" not in out.stdout + out.stderr
        assert out.stderr.strip() == f"trnsim: error: {message}"
