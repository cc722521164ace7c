"""torch_bridge.imports.after_import: functions run on a module right after the program imports it."""

import importlib
import sys

from torch_bridge import imports


def _module(tmp_path, monkeypatch, name):
    (tmp_path / f"{name}.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    sys.modules.pop(name, None)
    monkeypatch.delitem(sys.modules, name, raising=False)


def test_two_functions_for_a_module_not_yet_imported_both_run_once_in_order(tmp_path, monkeypatch):
    name = "trnsim_after_import_probe_a"
    _module(tmp_path, monkeypatch, name)
    calls = []

    def first(m):
        calls.append(("first", m.VALUE))

    def second(m):
        calls.append(("second", m.VALUE))
    imports.after_import(name, first)
    imports.after_import(name, second)
    imports.after_import(name, first)  # asked twice: runs once
    try:
        importlib.import_module(name)
        assert calls == [("first", 1), ("second", 1)]
        importlib.import_module(name)  # imported already: nothing runs again
        assert calls == [("first", 1), ("second", 1)]
        assert not any(isinstance(f, imports._AfterImport) and f.name == name for f in sys.meta_path)
    finally:
        sys.modules.pop(name, None)


def test_a_module_imported_already_runs_the_function_now(tmp_path, monkeypatch):
    name = "trnsim_after_import_probe_b"
    _module(tmp_path, monkeypatch, name)
    module = importlib.import_module(name)
    calls = []
    try:
        imports.after_import(name, lambda m: calls.append(m))
        assert calls == [module]
    finally:
        sys.modules.pop(name, None)


def test_a_module_still_running_gets_each_function_once_when_it_has_finished(tmp_path, monkeypatch):
    """A function asked for twice while its module runs its own code is run once, after it."""
    name = "trnsim_after_import_probe_c"
    calls = []

    def fn(m):
        calls.append(m.VALUE)
    (tmp_path / f"{name}.py").write_text(
        "from torch_bridge import imports\n"
        f"imports.after_import({name!r}, __import__('builtins').trnsim_probe_fn)\n"
        f"imports.after_import({name!r}, __import__('builtins').trnsim_probe_fn)\n"
        "VALUE = 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    import builtins
    monkeypatch.setattr(builtins, "trnsim_probe_fn", fn, raising=False)
    try:
        importlib.import_module(name)
        assert calls == []  # (the module was still running when asked)
        imports.run_pending()
        assert calls == [2]
        imports.run_pending()
        assert calls == [2]
    finally:
        sys.modules.pop(name, None)
