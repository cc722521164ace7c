"""The layers of trnsim and torch_bridge, read from the code's own imports (every import
statement, lazy ones inside functions included; ``if TYPE_CHECKING:`` blocks aside).

* A module imports only from its own layer or the layers below it, in this order (top first)::

      cli/ sweep/ validate/          the apps (the only trnsim folders that import torch_bridge)
      torch_bridge                   the neuron device
      nki/                           the NKI front end
      device/ workload/              the device model; what an estimate runs (data)
      kernels/ collectives/          built-in kernels; NeuronLink collectives
      sim/ outputs/                  the scheduler, chip, reports and their metrics tables; traces, plots
      builder/                       the Kernel builder
      cores/ memory/                 one module per engine; hbm, sbuf, psum, dma, bandwidth
      isa/                           instructions and access patterns
      native/ config/ compat         numerics (native/accel/: the C accelerators); typed configs, files read and
                                     written with care; old names

* No cycle of imports between modules (files), lazy imports included.
* No module imports another module's private name (``from x import _y``); a private submodule
  (``_torch``, ``nki._core``) is imported only from inside its own package.

A new module lands in a folder; a new folder must be given a layer here.
"""

from __future__ import annotations

import ast
import functools
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("trnsim", "torch_bridge")

LAYERS = [  # top first; a module may import from its own layer and those after it
    ("trnsim.__main__", "trnsim.cli", "trnsim.sweep", "trnsim.validate"),  # (__main__: python -m trnsim)
    ("torch_bridge",),
    ("trnsim.nki",),
    ("trnsim.device", "trnsim.workload"),
    ("trnsim.kernels", "trnsim.collectives"),
    ("trnsim.sim", "trnsim.outputs"),
    ("trnsim.builder",),
    ("trnsim.cores", "trnsim.memory"),
    ("trnsim.isa",),
    ("trnsim.native", "trnsim.config", "trnsim.compat"),
]


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in PACKAGES:
        for p in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(p.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = p
    return out


MODULES = _modules()


def layer_of(module: str) -> int:
    for i, group in enumerate(LAYERS):
        for prefix in group:
            if module == prefix or module.startswith(prefix + "."):
                return i
    raise AssertionError(f"{module}: in no layer; give its folder a layer in tests/test_layers.py")


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or \
        (isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    out: list[ast.Import | ast.ImportFrom] = []

    def walk(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for c in child.orelse:
                    walk(c)
                continue
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                out.append(child)
            walk(child)

    walk(tree)
    return out


def _home(module: str) -> str:
    """The module that defines ``module``: itself, or the nearest package that exists."""
    from trnsim.compat import resolve

    module = resolve(module)
    while module not in MODULES and "." in module:
        module = module.rpartition(".")[0]
    return module


def edges() -> dict[str, dict[str, list[tuple[int, tuple[str, ...]]]]]:
    """module -> imported module -> [(line, names imported)] over both packages."""
    import trnsim

    public = {n: f"trnsim.{m}" for n, m in trnsim._HOME.items()}  # noqa: SLF001 - the public face's table
    graph: dict[str, dict[str, list[tuple[int, tuple[str, ...]]]]] = {}
    for mod, path in MODULES.items():
        is_pkg = path.name == "__init__.py"
        package = mod if is_pkg else mod.rpartition(".")[0]
        found = graph.setdefault(mod, {})
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [(a.name, ()) for a in node.names]
            else:
                if node.level:
                    base = package.split(".")
                    base = base[: len(base) - node.level + 1]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                targets = []
                for a in node.names:
                    sub = f"{src}.{a.name}"
                    if _home(sub) == sub or sub in MODULES:
                        targets.append((sub, ()))  # a submodule
                    elif src == "trnsim" and a.name in public:
                        targets.append((public[a.name], (a.name,)))  # the public face: its defining module
                    else:
                        targets.append((src, (a.name,)))
            for target, names in targets:
                if not target.startswith(PACKAGES) or target.split(".")[0] not in PACKAGES:
                    continue
                home = _home(target)
                if home == mod or home in ("trnsim", "torch_bridge") and mod.startswith(home):
                    continue
                found.setdefault(home, []).append((node.lineno, names))
    return graph


GRAPH = edges()

# Exceptions in flight (the lists only shrink: the tests fail on anything not listed and on a
# listed entry that is gone). The last ones - the timing/ estimates' shared helpers, host
# profiling's hook into values - were untangled in issue 23 (timing/roles.py, values.host_profile).
KNOWN_CYCLES: list[list[str]] = []  # none left: a new cycle fails
KNOWN_PRIVATE: set[str] = set()  # none left: a new private import fails


def test_every_module_has_a_layer():
    for mod in MODULES:
        if mod not in PACKAGES:
            layer_of(mod)


def test_no_module_imports_from_a_layer_above_it():
    up = []
    for mod, targets in GRAPH.items():
        if mod in PACKAGES:
            continue
        for target, uses in targets.items():
            if target in PACKAGES:
                continue
            if layer_of(target) < layer_of(mod):
                up.append(f"{MODULES[mod].relative_to(ROOT)}:{uses[0][0]} imports {target} "
                          f"(layer {LAYERS[layer_of(target)]} is above {LAYERS[layer_of(mod)]})")
    assert up == []


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    import sys

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return out


def test_no_import_cycles():
    # a package's __init__ that re-exports its modules is the package's face, not a module of it:
    # edges into a package from its own modules ("from . import X") are left out
    graph = {m: {t for t in ts if not (m.startswith(t + ".") and MODULES[t].name == "__init__.py")}
             for m, ts in GRAPH.items()}
    assert _cycles(graph) == KNOWN_CYCLES


@functools.cache
def _extension(module: str) -> bool:
    """A compiled extension module (trnsim.native.accel._deptrack): CPython's convention names it with
    an underscore, and the Python class that wraps it (the builder's C tracker, the scheduler's C
    loop) imports it; it has no Python names of its own to keep private."""
    import importlib.machinery
    import importlib.util

    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return False
    return spec is not None and isinstance(spec.loader, importlib.machinery.ExtensionFileLoader)


def test_no_module_imports_another_modules_private_name():
    bad = []
    for mod, targets in GRAPH.items():
        for target, uses in targets.items():
            for line, names in uses:
                for n in names:
                    if n.startswith("_") and not n.startswith("__") and not _extension(f"{target}.{n}"):
                        bad.append(f"{MODULES[mod].relative_to(ROOT)} imports {target}.{n}")
            # a private submodule from outside its own package
            last = target.rpartition(".")[2]
            parent = target.rpartition(".")[0]
            if last.startswith("_") and not last.startswith("__") and not mod.startswith(parent + ".") \
                    and mod != parent:
                bad.append(f"{MODULES[mod].relative_to(ROOT)} imports the private module {target}")
    assert sorted(set(bad) - KNOWN_PRIVATE) == []  # a new one: make the name public where it is defined
    assert sorted(KNOWN_PRIVATE - set(bad)) == []  # fixed: take it off the list


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_layer_order_refuses_an_upward_import():
    assert layer_of("trnsim.builder.kernel") > layer_of("trnsim.sim.chip") > layer_of("trnsim.kernels.matmul")
    assert layer_of("torch_bridge.eager.values") < layer_of("trnsim.nki.language")
    with pytest.raises(AssertionError, match="in no layer"):
        layer_of("trnsim.nowhere")


@functools.cache
def _top_names(path: pathlib.Path) -> tuple[set[str], bool]:
    """Names a module defines at its top level (also under if/try/with), and whether it has a
    module ``__getattr__`` (then any name may exist)."""
    names: set[str] = set()
    dynamic = False

    def visit(body: list[ast.stmt]) -> None:
        nonlocal dynamic
        for n in body:
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(n.name)
                dynamic |= n.name == "__getattr__"
            elif isinstance(n, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                for tg in (n.targets if isinstance(n, ast.Assign) else [n.target]):
                    names.update(x.id for x in ast.walk(tg) if isinstance(x, ast.Name))
            elif isinstance(n, (ast.Import, ast.ImportFrom)):
                names.update(a.asname or a.name.split(".")[0] for a in n.names)
            elif isinstance(n, (ast.If, ast.Try, ast.With, ast.For)):
                for part in ("body", "orelse", "finalbody"):
                    visit(getattr(n, part, []) or [])
                for h in getattr(n, "handlers", []):
                    visit(h.body)

    visit(ast.parse(path.read_text()).body)
    return names, dynamic


def test_every_import_names_a_module_and_a_name_that_exist():
    """Lazy imports included: a relative import written for a module's old place (``from .config``
    in a file that moved into a folder) fails here, not when its function first runs."""
    from trnsim.compat import resolve

    bad = []
    for mod, path in MODULES.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")
                src = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            if src.split(".")[0] not in PACKAGES:
                continue
            src = resolve(src)
            if src not in MODULES:
                if not _extension(src):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: no module {src}")
                continue
            names, dynamic = _top_names(MODULES[src])
            for a in node.names:
                sub = resolve(f"{src}.{a.name}")
                if not (dynamic or a.name in names or sub in MODULES or _extension(sub)):
                    bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {src} has no {a.name}")
    assert bad == []
