"""The validation ledger (validation/*.yaml) and `trnsim validate`: the ledger's shape, the
calibration provenance of the configs, the drift guard CI runs, and the one-line errors."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from trnsim import load_config
from trnsim.cli import main
from trnsim.config import ConfigError, config_names, load_system, system_names
from trnsim.ledger import CATEGORIES, VALIDATION_DIR, LedgerError, load_ledger
from trnsim.validate import check_drift, load_expected, run_rows, summarize
from trnsim.validate.run import Result

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ledger():
    return load_ledger()


def test_ledger_has_the_rows_the_issue_asks_for(ledger):
    by_cat = {c: [r for r in ledger.rows if r.category == c] for c in CATEGORIES}
    assert len(ledger.rows) >= 60
    assert len(by_cat["kernels"]) >= 20 and len(by_cat["dma"]) >= 5 and len(by_cat["collectives"]) >= 15
    assert len(by_cat["inference"]) >= 8 and len(by_cat["training"]) >= 6
    assert {r.role for r in ledger.rows} == {"calibration", "validation"}
    for r in ledger.rows:
        assert r.source.cite() and r.where and r.conditions  # every row says where its number comes from
        assert r.predictable or r.reason  # a row trnsim cannot predict says why


def test_every_calibrated_parameter_names_calibration_rows_and_every_calibration_row_is_used(ledger):
    roles = {r.id: r.role for r in ledger.rows}
    used = set()
    from trnsim.workload.speculation import acceptance_calibrations

    cals = [c for cfg in [load_config(n) for n in config_names()] + [load_system(n) for n in system_names()]
            for c in cfg.calibrations] + acceptance_calibrations()  # configs/speculation: the draft's acceptance
    for cal in cals:
        assert cal.fit
        for rid in cal.rows:
            assert roles[rid] == "calibration"
            used.add(rid)
    assert used == {r.id for r in ledger.rows if r.role == "calibration"}


def test_the_quick_rows_have_not_drifted_from_the_recorded_predictions(capsys):
    """The drift guard: a change that moves a quick prediction by more than 1% updates
    validation/expected.yaml in the same commit (`trnsim validate --quick --record`)."""
    rc = main(["validate", "--quick", "--check-drift"])
    out = capsys.readouterr().out
    assert rc == 0, out[out.find("drift:"):]
    assert "drift: none" in out


def test_changing_a_calibrated_parameter_trips_the_guard(ledger):
    rows = [r for r in ledger.select(["dma"], quick=True)]
    expected = load_expected()
    ran = {r.id for r in rows}
    mine = {k: v for k, v in expected.items() if k in ran}
    assert not check_drift(run_rows(rows), mine)
    problems = check_drift(run_rows(rows, ["core.dma.engine_bandwidth=20GB/s"]), mine)
    assert any(p.startswith("dma.trn2.engine-rate: predicted") for p in problems), problems


def test_summary_counts_mape_median_and_worst(ledger):
    """MAPE, median and worst are over measured rows; bounds and vendor targets count only in
    'within'; a row without a prediction counts in 'rows' only."""
    base = ledger.by_id()["dma.trn2.one-engine-32kib"]  # a measured dma validation row
    cal = dataclasses.replace(base, id="c", role="calibration")
    rows = [dataclasses.replace(base, id=f"v{i}") for i in range(4)]
    target = dataclasses.replace(base, id="t", kind="target")
    res = [Result(cal, "ok", cal.value * 1.1, "", 0), Result(rows[0], "miss", base.value * 0.5, "", 0),
           Result(rows[1], "ok", base.value * 1.2, "", 0), Result(rows[2], "ok", base.value * 1.0, "", 0),
           Result(rows[3], "error", None, "refused", 0), Result(target, "miss", base.value * 3, "", 0)]
    s = {(x.category, x.role): x for x in summarize(res)}
    c, v = s[("dma", "calibration")], s[("dma", "validation")]
    assert (c.rows, c.predicted, c.within, c.measured) == (1, 1, 1, 1) and c.mape == pytest.approx(10)
    assert (v.rows, v.predicted, v.within, v.measured) == (5, 4, 2, 3)
    assert v.mape == pytest.approx((50 + 20 + 0) / 3) and v.median == pytest.approx(1.0)
    assert v.worst == pytest.approx(0.5)  # 0.5 is 2x off, 1.2 only 1.2x
    assert s[("all", "validation")].measured == 3


def test_list_json_out_and_a_row_run(tmp_path, capsys):
    assert main(["validate", "--list", "dma"]) == 0
    out = capsys.readouterr().out
    assert "dma.trn2.one-engine-32kib" in out and "nki-dma-overview.rst" in out
    csv = tmp_path / "rows.csv"
    assert main(["validate", "dma.trn2.one-engine-32kib", "--json", "--out", str(csv)]) == 0
    doc = json.loads(capsys.readouterr().out)
    (row,) = doc["rows"]
    assert row["measured"] == 1416 and 1300 < row["predicted"] < 1600 and row["status"] == "ok"
    assert csv.read_text().startswith("id,category,role")


def test_a_row_trnsim_cannot_predict_is_listed_with_its_reason(capsys):
    assert main(["validate", "inf.trn2.llama-3.1-405b.tp64.fused-spec.tpot"]) == 0
    out = capsys.readouterr().out
    assert "unsupported: the target's MLP weights are FP8" in out


def test_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "v.png"
    assert main(["validate", "dma.trn2.one-engine-32kib", "dma.trn2.engine-rate", "--plot", str(png)]) == 0
    assert png.stat().st_size > 1000


@pytest.mark.parametrize("args, message", [
    (["validate", "nope"], "trnsim: error: unknown row or category 'nope': expected a category (kernels, dma, "),
    (["validate", "--quick", "--record", "dma"], "trnsim: error: validate: --record and --check-drift take the "),
    (["validate", "dma", "--set", "core.nope=1"], "trnsim: error: trn2.yaml (--set core.nope=1): unknown key "),
    (["validate", "dma", "--out", "x.txt"], "trnsim: error: validate: --out x.txt: expected a .csv or .parquet"),
])
def test_bad_input_is_one_line_exit_2(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


def _ledger_copy(tmp_path, edit):
    d = tmp_path / "ledger"
    d.mkdir()
    text = (VALIDATION_DIR / "dma.yaml").read_text()
    (d / "dma.yaml").write_text(edit(text))
    return d


def test_a_row_without_a_source_is_refused_at_load(tmp_path):
    d = _ledger_copy(tmp_path, lambda t: t.replace("    source: S13\n", "", 1))
    with pytest.raises(LedgerError, match=r"^dma.yaml: row 'dma.trn2.one-engine-32kib': missing 'source': every row "
                                          r"cites the document its figure comes from$"):
        load_ledger(d)


def test_a_malformed_ledger_file_is_one_line(tmp_path):
    d = _ledger_copy(tmp_path, lambda t: t + "  - id: [unclosed\n")
    with pytest.raises(LedgerError) as e:
        load_ledger(d)
    assert str(e.value).startswith("dma.yaml: line ") and "\n" not in str(e.value)


def test_cli_refuses_a_bad_ledger_with_one_line(tmp_path):
    d = _ledger_copy(tmp_path, lambda t: t.replace("    source: S13\n", "", 1))
    r = subprocess.run([sys.executable, "-m", "trnsim.cli", "validate", "--list", "--ledger", str(d)],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == ("trnsim: error: dma.yaml: row 'dma.trn2.one-engine-32kib': missing 'source': every row cites "
                        "the document its figure comes from\n")


def test_a_config_may_not_calibrate_on_a_validation_row(tmp_path):
    text = (ROOT / "configs" / "trn2.yaml").read_text().replace("calibrated: [dma.trn2.engine-rate]",
                                                                "calibrated: [dma.trn2.one-engine-32kib]")
    p = tmp_path / "trn2-bad.yaml"
    p.write_text(text)
    with pytest.raises(ConfigError, match=r": core.dma.engine_bandwidth: calibrated row 'dma.trn2.one-engine-32kib' is a "
                                          r"validation row; only calibration rows may set a parameter$"):
        load_config(p)
    p.write_text(text.replace("[dma.trn2.one-engine-32kib]", "[no.such.row]"))
    with pytest.raises(ConfigError, match=r"calibrated row 'no.such.row' is not in the validation ledger"):
        load_config(p)
    p.write_text(text.replace("      calibrated: [dma.trn2.one-engine-32kib]\n", "      calibrated: [dma.trn2.one-engine-32kib]\n"
                              "      extra: 1\n"))
    with pytest.raises(ConfigError, match=r"unknown key 'extra' beside calibrated"):
        load_config(p)


def test_overriding_a_calibrated_parameter_drops_its_provenance():
    keys = {c.key for c in load_config("trn2").calibrations}
    assert "core.dma.engine_bandwidth" in keys
    assert "core.dma.engine_bandwidth" not in {c.key for c in load_config("trn2", ["core.dma.engine_bandwidth=20GB/s"])
                                               .calibrations}


def test_validate_package_imports_no_torch():
    code = "import sys, trnsim.validate, trnsim.cli.validate; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)


def _ledger_kernel(name):
    from trnsim.sweep import resolve_kernel

    return resolve_kernel(f"validation/kernels/{name}", ROOT).build


@pytest.mark.parametrize("fn, params", [("tiled", {}), ("hoisted", {}), ("blocked_free", {}),
                                        ("fully_optimized", dict(tiles_m=2, tiles_n=2, tiles_k=2))])
def test_ledger_matmul_kernels_compute_the_product(fn, params):
    """validation/kernels/matmul_tutorial.py's four versions give lhsT.T @ rhs (bf16 in, fp32
    PSUM; the fully optimized one keeps its partial sums in bf16 SBUF, as the tutorial does)."""
    import ml_dtypes
    import numpy as np

    from trnsim import Chip

    rng = np.random.default_rng(0)
    k, m, n = 512, 512, 2048
    a, b = rng.standard_normal((k, m)).astype(np.float32), rng.standard_normal((k, n)).astype(np.float32)
    ref = a.astype(ml_dtypes.bfloat16).astype(np.float32).T @ b.astype(ml_dtypes.bfloat16).astype(np.float32)
    chip = Chip("trn1")
    out = chip.run(_ledger_kernel(f"matmul_tutorial.py:{fn}")(m, k, n, dtype="bf16", config=chip.config, **params),
                   {"lhsT": a, "rhs": b})["result"]
    assert np.abs(np.asarray(out, np.float32) - ref).max() <= 0.01 * np.abs(ref).max()


@pytest.mark.parametrize("version", [1, 2, 3])
def test_ledger_mamba_kernel_matches_the_recurrence(version):
    """validation/kernels/mamba_tutorial.py against the layer's definition in numpy (float64)."""
    import numpy as np

    from trnsim import Chip

    rng = np.random.default_rng(1)
    bt, c, s, n = 1, 256, 1024, 3
    delta = rng.uniform(0.01, 0.1, (bt, c, s)).astype(np.float32)
    u = rng.standard_normal((bt, c, s)).astype(np.float32)
    a = -rng.uniform(0.5, 2, (c, n)).astype(np.float32)
    bm, cm = rng.standard_normal((bt, n, s)).astype(np.float32), rng.standard_normal((bt, n, s)).astype(np.float32)
    da = np.exp(delta[:, :, None, :].astype(np.float64) * a[None, :, :, None])
    dbu = delta[:, :, None, :].astype(np.float64) * bm[:, None, :, :] * u[:, :, None, :]
    scan, prev = np.zeros_like(da), 0.0
    for t in range(s):
        prev = da[..., t] * prev + dbu[..., t]
        scan[..., t] = prev
    ref = (cm[:, None, :, :] * scan).sum(axis=2)
    chip = Chip("trn1")
    kern = _ledger_kernel("mamba_tutorial.py:mamba")(bt, c, s, n, config=chip.config, version=version)
    out = chip.run(kern, {"delta": delta, "u": u, "A": a, "B": bm, "C": cm})["out"]
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()


def test_a_row_may_not_move_a_calibrated_parameter_for_its_own_prediction(tmp_path):
    """A row's ``predict: {set: [...]}`` moved any parameter, calibrated ones included, so a
    validation row could be fitted (core.dma.engine_bandwidth=21.9GB/s took dma.trn2.one-engine-32kib
    from 1.05 to 1.10) outside the configs' provenance. The setup a row was measured on stays
    allowed; the run's own --set (a what-if) too. A training row's plan's set is the row's."""
    from trnsim.validate import predict

    probe = {"probe": "dma_copy", "partitions": 4, "bytes_per_partition": 8192, "config": "trn2"}
    for key in ("core.dma.engine_bandwidth=21.9GB/s", "host.dispatch=1us"):
        with pytest.raises(LedgerError, match=rf"^predict: set {key}: {key.split('=')[0]} is a calibrated parameter "):
            predict("probe", {**probe, "set": [key]}, "trn2")
    with pytest.raises(LedgerError, match=r"^predict: set collectives.launch=1us: collectives.launch is a calibrated "):
        predict("collective", {"system": "trn2.48xlarge", "collective": "all-reduce", "bytes": 1024, "ranks": 8,
                               "set": ["collectives.launch=1us"]}, "trn2")
    plan = tmp_path / "plan.yaml"
    plan.write_text((ROOT / "configs" / "plans" / "nxd-llama3.1-8b-trn1-v9a.yaml").read_text().replace(
        "set: [topology.efa.size=32]", "set: [topology.efa.size=32, host.dispatch=1us]"))
    with pytest.raises(LedgerError, match=r"^predict: plan .*: set host.dispatch=1us: host.dispatch is a "
                                          r"calibrated parameter "):
        predict("estimate", {"mode": "train", "plan": str(plan)}, "trn1")
    assert predict("probe", {**probe, "set": ["chip.hbm.bandwidth=3TB/s"]}, "trn2")
    assert predict("probe", probe, "trn2", ["core.dma.engine_bandwidth=21.9GB/s"])


def test_predictors_run_an_nki_file_and_refuse_bad_arguments():
    from trnsim.validate import predict

    figs = predict("nki", {"file": "tests/nki/nki_kernels.py:tiled_matmul", "shapes": [[256, 128], [256, 512]],
                           "dtype": "bfloat16"}, "trn2")
    assert figs["latency"][0] == "time" and figs["latency"][1] > 0 and figs["tensor_active"][1] > 0
    with pytest.raises(LedgerError, match=r"^predict how: kernel: unknown argument 'shpe': expected kernel, shape"):
        predict("kernel", {"kernel": "matmul", "shpe": [1]}, "trn2")
    with pytest.raises(LedgerError, match=r"^predict how: 'nope': expected one of kernel, nki, probe, collective, "
                                          r"estimate or none$"):
        predict("nope", {}, "trn2")
