"""Output files (trnsim.config.files): regular files replaced atomically with the user's mode, symlinks
followed, FIFOs/directories refused in one line before any long run, nothing left behind.
Special files are FIFOs in a temporary directory, never real device nodes."""

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import trnsim.chip
import trnsim.config.files as files
from trnsim.cli import main
from trnsim.config.files import AtomicOutput, OutputError, check_output, lock_exclusive, write_atomic

ROOT = Path(__file__).resolve().parents[2]


def write_text(text):
    return lambda f: f.write(text)


@pytest.fixture
def umask():
    def set_(mask):
        old = os.umask(mask)
        saved.append(old)

    saved = []
    yield set_
    if saved:
        os.umask(saved[0])


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_a_new_file_gets_the_umask_mode_not_0600(tmp_path, umask, mask):
    umask(mask)
    out = write_atomic(tmp_path / "t.json", write_text("{}"))
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~mask
    assert out.read_text() == "{}" and [p.name for p in tmp_path.iterdir()] == ["t.json"]


def test_a_replaced_file_keeps_its_mode(tmp_path, umask):
    umask(0o022)
    path = tmp_path / "t.json"
    path.write_text("old")
    path.chmod(0o640)
    write_atomic(path, write_text("new"))
    assert path.read_text() == "new" and stat.S_IMODE(path.stat().st_mode) == 0o640


def test_a_symlink_is_followed_and_stays(tmp_path):
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert write_atomic(link, write_text("new")) == target
    assert link.is_symlink() and target.read_text() == "new"
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "later.json")
    write_atomic(dangling, write_text("x"))
    assert dangling.is_symlink() and (tmp_path / "later.json").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling.json", "later.json", "link.json", "real.json"]


def test_special_files_and_directories_are_refused_untouched(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a FIFO"), (tmp_path, "a directory")):
        for attempt in (lambda: write_atomic(path, write_text("x"), "--trace"), lambda: check_output(path, "--trace"),
                        lambda: AtomicOutput(path, "--trace")):
            with pytest.raises(OutputError) as e:
                attempt()
            assert str(e.value) == f"--trace {path}: it is {kind}, not a regular file; give a file path"
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and [p.name for p in tmp_path.iterdir()] == ["fifo"]
    link = tmp_path / "to-fifo"
    link.symlink_to(fifo)
    with pytest.raises(OutputError, match=r"to-fifo: it is a FIFO, not a regular file"):
        write_atomic(link, write_text("x"))
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(OutputError, match=r"^out .*loop: cannot write it \(a symlink loop\)$"):
        write_atomic(loop, write_text("x"), "out")
    with pytest.raises(OutputError, match=r"^out .*/no/dir/t\.json: its directory .*/no/dir does not exist$"):
        check_output(tmp_path / "no" / "dir" / "t.json", "out")
    assert check_output(tmp_path / "no" / "dir" / "t.json", "out", missing_dirs=True) == tmp_path / "no/dir/t.json"
    assert not (tmp_path / "no").exists()


def test_an_unwritable_directory_names_the_users_path_not_the_temp_file(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:  # root writes anywhere: make creating the temporary file fail instead
        real_open = os.open

        def deny(path, flags, *a):
            if flags & os.O_CREAT:
                raise PermissionError(13, "Permission denied", str(path))
            return real_open(path, flags, *a)

        monkeypatch.setattr(files.os, "open", deny)
    else:
        ro.chmod(0o555)
    with pytest.raises(OutputError) as e:
        AtomicOutput(ro / "t.json", "--trace")
    assert str(e.value) == f"--trace {ro / 't.json'}: cannot write it (Permission denied)"
    with pytest.raises(OutputError, match=r"^--trace .*ro/t\.json: cannot write it \(Permission denied\)$"):
        check_output(ro / "t.json", "--trace")
    ro.chmod(0o755)
    assert list(ro.iterdir()) == []


def test_a_reservation_is_invisible_until_commit_and_leaves_nothing_when_dropped(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("old")
    out = AtomicOutput(path, "--trace")
    assert path.read_text() == "old" and len(list(tmp_path.iterdir())) == 2  # the temp waits beside it
    out.discard()
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"] and path.read_text() == "old"
    with AtomicOutput(path) as res:
        res.commit(write_text("new"))
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["t.json"]
    with pytest.raises(ZeroDivisionError):
        with AtomicOutput(path) as res:
            res.commit(lambda f: 1 / 0)
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["t.json"]


def test_a_file_that_became_a_fifo_during_the_run_is_not_replaced(tmp_path):
    path = tmp_path / "t.json"
    out = AtomicOutput(path, "--trace")
    os.mkfifo(path)
    with pytest.raises(OutputError, match=r"t\.json: it is a FIFO, not a regular file"):
        out.commit(write_text("x"))
    assert stat.S_ISFIFO(os.lstat(path).st_mode) and [p.name for p in tmp_path.iterdir()] == ["t.json"]


def test_a_second_lock_holder_is_refused_in_one_line(tmp_path):
    path = tmp_path / "r.csv"
    with open(path, "a+b") as a, open(path, "a+b") as b:
        lock_exclusive(a, str(path), "sweep results", "another trnsim sweep")
        with pytest.raises(OutputError) as e:
            lock_exclusive(b, str(path), "sweep results", "another trnsim sweep")
    assert str(e.value) == (f"sweep results {path}: another trnsim sweep is writing it; wait for it to finish or "
                            f"choose another file")


# ---- the CLI --------------------------------------------------------------------------------


def test_kernel_trace_to_a_fifo_is_refused_before_the_run(tmp_path, capsys, monkeypatch):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)

    def never(*a, **k):
        raise AssertionError("the kernel ran before the trace path was checked")

    monkeypatch.setattr(trnsim.chip.Chip, "run", never)
    assert main(["kernel", "matmul", "--shape", "128x128x512", "--trace", str(fifo)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"trnsim: error: --trace {fifo}: it is a FIFO, not a regular file; give a file path\n"
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and [p.name for p in tmp_path.iterdir()] == ["fifo"]


def test_kernel_trace_through_a_symlink_writes_the_target(tmp_path, capsys, umask):
    umask(0o022)
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "t.json"
    link.symlink_to(target)
    assert main(["kernel", "matmul", "--shape", "128x128x512", "--trace", str(link)]) == 0
    assert link.is_symlink() and json.loads(target.read_text())["traceEvents"]
    assert stat.S_IMODE(target.stat().st_mode) == 0o644
    assert f"Trace written to {link}" in capsys.readouterr().out


def _cli(*argv, cwd):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", "trnsim.cli", *argv], capture_output=True, text=True, timeout=120,
                          cwd=cwd, env=env)


def test_fifos_as_inputs_and_sweep_results_do_not_hang(tmp_path):
    """Opening a FIFO blocks until someone writes it: configs, specs and results are stat'ed
    first. (A subprocess with a timeout, so a regression fails instead of hanging the suite.)"""
    fifo = tmp_path / "f.yaml"
    os.mkfifo(fifo)
    r = _cli("info", str(fifo), cwd=tmp_path)
    assert r.returncode == 2 and r.stderr == f"trnsim: error: config '{fifo}': it is a FIFO, not a regular file\n"
    r = _cli("sweep", str(fifo), cwd=tmp_path)
    assert r.returncode == 2 and r.stderr == f"trnsim: error: sweep spec '{fifo}': it is a FIFO, not a regular file\n"
    spec = tmp_path / "s.yaml"
    spec.write_text("kernels: [{name: matmul, shape: 128x128x128}]\n")
    csv = tmp_path / "r.csv"
    os.mkfifo(csv)
    r = _cli("sweep", str(spec), "--out", str(csv), cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"trnsim: error: sweep results {csv}: it is a FIFO, not a regular file; give a file path\n"
