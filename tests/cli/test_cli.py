"""The trnsim command: golden output, JSON, and one-line errors with exit status 2."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from trnsim.cli import main

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_info_trn2_golden(capsys):
    code, out, err = run(capsys, "info", "trn2")
    assert code == 0 and err == ""
    assert out == (GOLDEN / "info_trn2.txt").read_text()


def test_info_defaults_to_trn2(capsys):
    assert run(capsys, "info")[1] == (GOLDEN / "info_trn2.txt").read_text()


def test_demo_golden(capsys):
    """The demo trains examples/train_gpt2.py on trn2: losses, run report and kernel report are
    the same on every run."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    code, out, _ = run(capsys, "demo")
    assert code == 0
    assert out == (GOLDEN / "demo_trn2.txt").read_text()


def test_demo_without_torch_runs_the_kernel_demo(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    code, out, _ = run(capsys, "demo")
    assert code == 0
    assert out == (GOLDEN / "demo_trn2_no_torch.txt").read_text()


def test_info_json_and_overrides(capsys):
    code, out, _ = run(capsys, "info", "trn3", "--set", "core.sbuf.partition_bytes=300KiB", "--json")
    d = json.loads(out)
    assert code == 0
    assert d["sbuf_partition_bytes"] == 300 * 1024
    assert d["overrides"] == {"core.sbuf.partition_bytes": "300KiB"}
    assert d["peak_flops_per_core"]["mxfp8"] == pytest.approx(314.5728e12)
    assert d["logical_cores"] == 4


@pytest.mark.parametrize("argv,message", [
    (["info", "trn9"], "trnsim: error: unknown config 'trn9': expected one of trn1, trn2, trn3 or a path to a .yaml file\n"),
    (["info", "--set", "core.sbuf.partition_bytes=lots"],
     "trnsim: error: trn2.yaml (--set core.sbuf.partition_bytes=lots): core.sbuf.partition_bytes = 'lots': "
     "expected a bytes quantity like '224KiB'\n"),
    (["info", "--set", "core.sbuf"], "trnsim: error: bad override 'core.sbuf': expected KEY=VALUE, e.g. "
                                     "core.sbuf.partition_bytes=256KiB\n"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    assert err == message


def test_bad_flags_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["info", "--frobnicate"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == "trnsim: error: unrecognized arguments: --frobnicate (see 'trnsim info --help')\n"
    with pytest.raises(SystemExit):
        main(["bogus"])
    assert capsys.readouterr().err.startswith("trnsim: error: argument COMMAND: invalid choice: 'bogus'")
    with pytest.raises(SystemExit):
        main(["x" * 100_000, "a\nb"])  # argparse quotes arguments whole; the line stays one short line
    err = capsys.readouterr().err
    assert err.startswith("trnsim: error: argument COMMAND: invalid choice: 'xxxxx") and err.count("\n") == 1
    assert err.endswith(" characters) (see 'trnsim --help')\n") and len(err) < 400


def test_a_bad_argument_names_the_whole_subcommand_for_help(capsys):
    """'trnsim serve --help' (the last word of 'trnsim estimate serve') is no command."""
    with pytest.raises(SystemExit):
        main(["estimate", "serve", "--model", "llama-3.1-8b", "--rate", "0"])
    assert capsys.readouterr().err.endswith(" (see 'trnsim estimate serve --help')\n")
    with pytest.raises(SystemExit):
        main(["collective", "all-reduce", "--factor", "x"])
    assert capsys.readouterr().err.endswith(" (see 'trnsim collective --help')\n")
    with pytest.raises(SystemExit):  # an option the subcommand does not have: its help, not trnsim's
        main(["estimate", "train", "--model", "llama-3.1-8b", "--bogus"])
    assert capsys.readouterr().err == ("trnsim: error: unrecognized arguments: --bogus "
                                       "(see 'trnsim estimate train --help')\n")


def test_console_script_runs():
    r = subprocess.run([sys.executable, "-m", "trnsim.cli", "info", "trn1"], capture_output=True, text=True)
    assert r.returncode == 0 and "trn1: AWS Trainium1" in r.stdout
    r = subprocess.run([sys.executable, "-m", "trnsim", "kernel", "nosuch"], capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.startswith("trnsim: error: unknown kernel 'nosuch'") and r.stdout == ""


def test_version(capsys):
    import trnsim

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out == f"trnsim {trnsim.__version__}\n"


@pytest.mark.parametrize("module", ["trnsim.isa", "trnsim.sweep", "argparse"])
def test_ctrl_c_while_the_command_loads_is_one_line(module, tmp_path):
    """Issue 25: Ctrl-C in the first second or two (the command importing the simulator) printed a
    23-line import traceback. A Ctrl-C is delivered exactly while ``module`` loads."""
    # (Python's own SIGINT handler, as a terminal's process has it: a test run started in the
    # background by a shell without job control inherits SIGINT ignored, and no Ctrl-C would come)
    code = ("import os, signal, sys\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "class Interrupt:\n"
            "    def find_spec(self, name, path, target=None):\n"
            f"        if name == {module!r}:\n"
            "            os.kill(os.getpid(), signal.SIGINT)\n"
            "sys.meta_path.insert(0, Interrupt())\n"
            "from trnsim.cli import main\n"
            "sys.exit(main(['info']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                       env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert (r.returncode, r.stdout, r.stderr) == (-2, "", "trnsim: interrupted\n")


def test_the_package_loads_its_public_names_on_first_use():
    code = ("import sys, trnsim\n"
            "assert 'trnsim.kernel' not in sys.modules and 'ml_dtypes' not in sys.modules\n"
            "from trnsim import Chip, Kernel, bfloat16\n"
            "assert trnsim.Chip is Chip and set(trnsim.__all__) <= set(dir(trnsim))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    assert r.returncode == 0, r.stderr


def test_every_pinned_report_fits_a_120_column_terminal():
    """Issue 25: the merged distributed report was 200 columns wide and the collective table 138;
    a name longer than its column ends in an ellipsis (--json and Parquet keep it whole)."""
    wide = {p.name: max(len(line) for line in p.read_text(encoding="utf-8").splitlines())
            for p in sorted(GOLDEN.glob("*.txt"))}
    assert wide and all(w <= 120 for w in wide.values()), wide


def test_json_reaches_a_non_blocking_pipe_whole(tmp_path):
    """Stop 51's CI: ``trnsim run --nproc 2 --json`` printed 80 KB into a pipe another process had
    made non-blocking, and ``print`` dropped all past the pipe's 64 KiB with exit status 0. Here
    stdout is made non-blocking and read only after the command has filled the pipe."""
    import os
    import time

    code = ("import os, sys\n"
            "os.set_blocking(1, False)\n"
            "from trnsim.cli import main\n"
            "sys.exit(main(['validate', '--list', '--json']))\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    first = os.read(p.stdout.fileno(), 1)  # the command is writing; let the pipe fill before reading on
    time.sleep(0.5)
    out, err = p.communicate(timeout=120)
    rows = json.loads(first + out)
    assert p.returncode == 0 and err == b"" and len(first + out) > 2 ** 17 and rows and all("id" in r for r in rows)


@pytest.mark.parametrize("argv,script,rest", [
    (["run", "s.py", "--", "--json"], "s.py", ["--", "--json"]),
    (["run", "s.py", "--", "a", "--config", "trn3"], "s.py", ["--", "a", "--config", "trn3"]),
    (["run", "--config", "trn3", "s.py", "--"], "s.py", ["--"]),
    (["run", "s.py", "a", "--", "--json"], "s.py", ["a", "--", "--json"]),
    (["run", "s.py", "--json"], "s.py", ["--json"]),
])
def test_run_keeps_the_separator_after_the_script(argv, script, rest):
    """`trnsim run s.py -- --json`: argparse took the `--` right after the script for its own, so
    --json became trnsim's and the script got [] (found by the hardening hunt); it is put back for
    split_args, which gives the script everything after it."""
    from trnsim.cli import _keep_script_separator, build_parser

    args = build_parser().parse_args(argv)
    _keep_script_separator(args, argv)
    assert args.script == script and args.args == rest
