"""Old names keep working (trnsim.compat): a moved module is the same module object under its
old dotted name, and a renamed class or constant is the same object under its old name."""

from __future__ import annotations

import importlib

import pytest

from trnsim.compat import ALIASES, RENAMED, renamed


@pytest.mark.parametrize("old", sorted(k for k in ALIASES if k.startswith("trnsim.")))
def test_a_moved_module_is_the_same_module_under_its_old_name(old):
    assert importlib.import_module(old) is importlib.import_module(ALIASES[old])


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_a_renamed_name_is_the_same_object_under_its_old_name(old):
    home, _, name = old.rpartition(".")
    new_home, _, new_name = RENAMED[old].rpartition(".")
    new = getattr(importlib.import_module(new_home), new_name)
    assert getattr(importlib.import_module(home), name) is new
    assert name not in getattr(importlib.import_module(home), "__all__", ())  # new code sees only the new name


def test_old_names_in_from_imports_and_keywords():
    from trnsim.collectives import CollectiveEngine, CollectiveRunner
    from trnsim.collectives.engine import CollectiveEngine as ViaOldModule
    from trnsim.nki import JitKernel, Kernel

    assert CollectiveEngine is CollectiveRunner is ViaOldModule and Kernel is JitKernel
    from trnsim import Kernel as Builder, load_config
    from trnsim.sim import simulate

    cfg = load_config("trn2")
    k = Builder("k", cfg)
    t = k.sbuf((128, 64), "float32")
    k.memset(t, 1.0)
    assert simulate(cfg, [k], engine="simpy")[0].total_ticks == simulate(cfg, [k], timeline="simpy")[0].total_ticks


def test_an_unknown_name_is_still_an_attribute_error():
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        renamed("trnsim.nki", "Nope")
    import trnsim.sim

    with pytest.raises(AttributeError):
        trnsim.sim.Nope  # noqa: B018
