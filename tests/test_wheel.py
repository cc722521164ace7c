"""The package as a user installs it: a wheel built from the source tree, installed into a fresh
virtual environment, away from the repository. Every package of the tree is in the wheel and
imports from it (trnsim.nki once went missing: the package list was kept by hand and an editable
install hides such a gap), the C sources and the data the code opens (configs, the ledger) are
there, and the installed ``trnsim`` command runs an NKI kernel file with the same report as the
checkout (the golden file).

Building compiles the C accelerators (a minute on a loaded machine): marked slow and subprocess.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import venv
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

_ANYWHERE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.egg-info", ".pytest_cache")
_AT_TOP = {".git", "build", "dist", "tests", "docs", "benchmarks"}  # torch_bridge/dist/ is a package


def _ignore(folder: str, names: list[str]) -> set[str]:
    return set(_ANYWHERE(folder, names)) | (_AT_TOP & set(names) if pathlib.Path(folder) == ROOT else set())


def _packages() -> set[str]:
    """Every package of the source tree (a folder of trnsim/ or torch_bridge/ with an __init__.py)."""
    return {".".join(p.parent.relative_to(ROOT).parts) for top in ("trnsim", "torch_bridge")
            for p in (ROOT / top).rglob("__init__.py") if "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[pathlib.Path, pathlib.Path]:
    """(the wheel, the python of a fresh venv it is installed in). The venv sees the machine's
    site-packages for the dependencies (numpy, torch, ...; nothing is downloaded) but trnsim itself
    comes from the wheel, never from the repository (checked below)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(ROOT, src, ignore=_ignore)  # a copy: building leaves build/ and egg-info behind
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp / "dist"), str(src)], capture_output=True, text=True, env=env, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("trnsim-*.whl")
    venv.create(tmp / "venv", system_site_packages=True, with_pip=False)
    python = tmp / "venv" / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
                        str(wheel)], capture_output=True, text=True, env=env, timeout=600)
    if r.returncode != 0 and "no such option: --python" in r.stderr:  # pip < 22.3
        r = subprocess.run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "-q", str(wheel)],
                           capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return wheel, python


def _run(python: pathlib.Path, code: str, cwd: pathlib.Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def test_the_wheel_holds_every_package_its_c_sources_and_data(installed):
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {n.rpartition("/")[0].replace("/", ".") for n in names if n.endswith("/__init__.py")}
    assert _packages() <= packages, sorted(_packages() - packages)
    assert "trnsim.nki" in packages
    for c in (ROOT / "trnsim" / "native").glob("*.[ch]"):
        if not c.name.startswith("_"):  # cffi's generated _datapath.c etc. are build products
            assert f"trnsim/native/{c.name}" in names, c.name
    assert "torch_bridge/csrc/neuron.cpp" in names and "trnsim/py.typed" in names
    for p in (ROOT / "configs").rglob("*.yaml"):
        assert f"trnsim/shipped/configs/{p.relative_to(ROOT / 'configs').as_posix()}" in names, p
    assert "trnsim/shipped/validation/expected.yaml" in names


def test_every_package_imports_from_the_installed_wheel(installed, tmp_path):
    _, python = installed
    code = ("import importlib, sys\n"
            f"names = {sorted(_packages())!r}\n"
            "for n in names:\n"
            "    m = importlib.import_module(n)\n"
            "    assert '/venv/' in m.__file__, (n, m.__file__)\n"
            "import trnsim, trnsim.kernel\n"  # an old module name, through trnsim.compat
            "from trnsim import Chip, load_config\n"
            "from trnsim.config import CONFIG_DIR\n"
            "assert '/venv/' in str(CONFIG_DIR), CONFIG_DIR\n"
            "print(Chip('trn3').config.name, len(names))\n")
    r = _run(python, code, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["trn3", str(len(_packages()))]


def test_the_installed_command_runs_an_nki_kernel_file(installed, tmp_path):
    """``trnsim kernel file.py:nki_kernel`` from the venv's own ``trnsim`` script, in a folder
    away from the repository: the report is the checkout's golden one."""
    _, python = installed
    (tmp_path / "examples").mkdir()
    shutil.copy(ROOT / "examples" / "nki_rmsnorm.py", tmp_path / "examples" / "nki_rmsnorm.py")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([str(python.parent / "trnsim"), "kernel", "examples/nki_rmsnorm.py:rmsnorm_kernel", "--shape",
                        "1024x2048,2048"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout == (ROOT / "tests" / "golden" / "kernel_nki_rmsnorm_trn2.txt").read_text()
