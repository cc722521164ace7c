"""Bounded YAML (trnsim.config.load_yaml): alias bombs, deep documents, duplicate keys, huge or
binary files and values the constructors choke on are one-line ConfigErrors in milliseconds and
kilobytes, in configs, sweep specs and --set values alike; quoted values are cut short."""

import textwrap
import tracemalloc
from pathlib import Path

import pytest

from trnsim.cli import main
from trnsim.config import MAX_YAML_BYTES, ConfigError, clip_text, format_value, load_config, load_yaml

ROOT = Path(__file__).resolve().parents[2]
TRN2 = (ROOT / "configs" / "trn2.yaml").read_text()


def bomb(levels: int) -> str:
    """The 4.8 KB shape of the issue: each level aliases the previous one 9 times."""
    out = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    out += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    return "\n".join(out) + "\n"


def bounded(fn):
    """Run ``fn``; return its ConfigError message and the peak memory it traced."""
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError) as e:
            fn()
        return str(e.value), tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("levels", [8, 9, 30])
def test_alias_bombs_stop_at_the_expansion_limit(tmp_path, levels):
    p = tmp_path / "bomb.yaml"
    p.write_text(bomb(levels) + TRN2.replace("  pe_rows: 128 ", "  pe_rows: *a5 "))
    msg, peak = bounded(lambda: load_config(p))
    # a5 is the first level over 100,000 values (9**6): refused where it is written
    assert msg == f"{p}: line 6: anchors and aliases expand to more than 100,000 values; write the values out or use " \
                  f"fewer aliases"
    assert peak < 20 * 2**20


def test_a_bounded_alias_quoted_in_an_error_is_cut_short(tmp_path):
    p = tmp_path / "alias.yaml"
    p.write_text(bomb(3) + TRN2.replace("  pe_rows: 128 ", "  pe_rows: *a3 "))  # 6,561 values: allowed
    msg, _ = bounded(lambda: load_config(p))
    assert msg.startswith(f"{p}: unknown key 'a0'")  # the anchors' own keys are not config keys
    p.write_text(TRN2.replace("  pe_rows: 128 ", "  pe_rows: &big [[[[[1, 2, 3, 4, 5, 6, 7, 8]]]]]"))
    msg, _ = bounded(lambda: load_config(p))
    assert msg == f"{p}: core.tensor.pe_rows = [[[[...]]]]: expected an integer"


def test_alias_bombs_in_sweep_specs_and_set_values(tmp_path, capsys):
    def flow(levels):
        return "[&a0 [x,x,x,x,x,x,x,x,x], " + ", ".join(f"&a{i} [{','.join([f'*a{i - 1}'] * 9)}]"
                                                       for i in range(1, levels + 1)) + "]"

    spec = tmp_path / "spec.yaml"  # the 390-byte spec of the issue
    spec.write_text(f"kernels: [{{name: matmul}}]\ngrid:\n  core.tensor.clock: {flow(9)}\n")
    assert main(["sweep", str(spec)]) == 2
    err = capsys.readouterr().err
    assert err == ("trnsim: error: spec.yaml: line 3: anchors and aliases expand to more than 100,000 values; write "
                   "the values out or use fewer aliases\n")
    spec.write_text(f"kernels: [{{name: matmul}}]\ngrid:\n  core.tensor.clock: {flow(3)}\n")
    assert main(["sweep", str(spec)]) == 2
    assert capsys.readouterr().err == ("trnsim: error: spec.yaml: grid.core.tensor.clock: expected a value, got "
                                       "['x', 'x', 'x', 'x', 'x', 'x', ...]\n")
    assert main(["info", "--set", f"core.tensor.pe_rows={flow(8)}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("trnsim: error: trn2.yaml (--set core.tensor.pe_rows=[&a0 [x,x,x,x,x,x,x,x,x], &a1")
    assert err.endswith("expected an integer\n") and err.count("\n") == 1 and len(err) < 400


@pytest.mark.parametrize("doc,line", [("[" * 10_000 + "]" * 10_000, 1), ("a:\n  b: " + "[1, " * 10_000, 2),
                                      ("- " * 10_000 + "1", 1), ("a: " + "{b: " * 100 + "1" + "}" * 100, 1)],
                         ids=["brackets", "lists", "block", "mappings"])
def test_deep_documents_are_refused_not_a_recursion_error(doc, line):
    msg, _ = bounded(lambda: load_yaml(doc, "deep.yaml"))
    assert msg == f"deep.yaml: line {line}: nested deeper than 64 levels"


def test_aliases_cannot_deepen_past_the_limit():
    doc = "a0: &a0 [1]\n" + "".join(f"a{i}: &a{i} {'[' * 40}*a{i - 1}{']' * 40}\n" for i in range(1, 4))
    msg, _ = bounded(lambda: load_yaml(doc, "d.yaml"))
    assert msg == "d.yaml: line 3: nested deeper than 64 levels once aliases are expanded"


def test_recursive_aliases_are_refused():
    for doc in ("&a [*a]", "a: &a {b: *a}"):
        msg, _ = bounded(lambda: load_yaml(doc, "r.yaml"))
        assert msg == "r.yaml: line 1: alias *a refers to a value that contains it (a recursive structure)"


def test_duplicate_keys_name_both_lines(tmp_path):
    p = tmp_path / "dup.yaml"
    p.write_text(TRN2.replace("    pe_rows: 128 ", "    pe_rows: 128\n    pe_rows: 64 "))
    first = TRN2.split("\n").index(next(ln for ln in TRN2.split("\n") if ln.startswith("    pe_rows:"))) + 1
    msg, _ = bounded(lambda: load_config(p))
    assert msg == f"{p}: line {first + 1}: duplicate key 'pe_rows' (first at line {first}); a key may appear once"
    spec = tmp_path / "spec.yaml"
    spec.write_text("kernels: [{name: matmul}]\ngrid: {}\nkernels: []\n")
    msg, _ = bounded(lambda: __import__("trnsim.sweep").sweep.load_spec(spec))
    assert msg == "spec.yaml: line 3: duplicate key 'kernels' (first at line 1); a key may appear once"
    # merge keys are the YAML way to override, not duplicates
    assert load_yaml("base: &b {x: 1, y: 2}\nnew: {<<: *b, y: 3}\n", "m.yaml")["new"] == {"x": 1, "y": 3}


@pytest.mark.parametrize("value,problem", ids=["digits", "date", "binary", "tag"], argvalues=[
    ("9" * 5000, "cannot read the value: Exceeds the limit (4300 digits) for integer string conversion: value has "
                 "5000 digits; use sys.set_int_max_str_digits() t... (140 characters)"),
    ("2001-13-45", "cannot read the value: month must be in 1..12"),
    ("!!binary AAA", "failed to decode base64 data: Incorrect padding"),
    ("!!python/object:os.system x", "could not determine a constructor for the tag "
                                    "'tag:yaml.org,2002:python/object:os.system'"),
])
def test_values_the_constructors_reject_are_yaml_errors_at_their_line(value, problem):
    msg, _ = bounded(lambda: load_yaml(f"a: 1\nb: {value}\n", "v.yaml"))
    assert msg == f"v.yaml: line 2: {problem}"


def test_big_binary_and_special_inputs(tmp_path):
    big = tmp_path / "big.yaml"
    big.write_bytes(b"# " + b"x" * MAX_YAML_BYTES + b"\n")
    msg, peak = bounded(lambda: load_config(big))
    assert msg == f"{big}: larger than 4 MiB; a config is at most that" and peak < 3 * MAX_YAML_BYTES
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"name: \xff\xfe\n")
    assert bounded(lambda: load_config(binary))[0] == f"{binary}: not UTF-8 text (byte 7)"
    nul = tmp_path / "nul.yaml"
    nul.write_bytes(b"name: a\x00b\n")
    assert bounded(lambda: load_config(nul))[0] == f"{nul}: character 8: #x0000 is not allowed in YAML"
    assert bounded(lambda: load_config(tmp_path))[0] == f"config '{tmp_path}': it is a directory, not a regular file"
    assert bounded(lambda: load_config("x" * 3000))[0].startswith("unknown config 'xxxxxxxx")
    long_path = tmp_path / ("x" * 300 + ".yaml")
    assert bounded(lambda: load_config(long_path))[0].endswith(": cannot read it (File name too long)")


def test_quantities_with_huge_exponents_or_digits_are_refused_quickly():
    for text in ("1e999999999GHz", "1e-999999999ps", "9" * 100 + "KiB"):
        msg, peak = bounded(lambda: load_config("trn2", [f"core.tensor.clock={text}"]))
        assert "expected a hz quantity like '2.4GHz'" in msg and peak < 16 * 2**20  # 10**999999999 is 400 MB


def test_an_override_of_an_aliased_section_does_not_leak_into_its_alias(tmp_path):
    text = TRN2.replace("  sync:\n", "  sync: &sync\n")
    lines = text.split("\n")
    i = lines.index("  sync: &sync")
    body = []
    while lines[i + 1 + len(body)].startswith("    "):
        body.append(lines[i + 1 + len(body)])
    p = tmp_path / "alias.yaml"
    p.write_text(text)
    cfg = load_config(p, ["core.sync.clock=1GHz"])
    assert cfg.core.sync.clock == 10**9


def test_clip_text_and_format_value_are_bounded_single_lines():
    assert clip_text("core.sbuf") == "core.sbuf"
    assert clip_text("a\nb") == "a\\nb"
    assert clip_text("x" * 100, 10) == "xxxxxxxxxx... (100 characters)"
    assert clip_text("it's", quoted=True) == '"it\'s"'
    assert format_value(10**5000) == "<an integer of about 5001 digits>"
    assert format_value("y" * 10**7) == "'yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy...yyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyyy'"
    nested = [[[[[1] * 100] * 100] * 100]]
    assert format_value(nested) == "[[[[...], [...], [...], [...], [...], [...], ...]]]"
    assert "\n" not in format_value({"a\nb": "c\nd"})


def test_sweep_spec_documents_of_the_wrong_kind(tmp_path, capsys):
    spec = tmp_path / "spec.yaml"
    for text, message in [
        ("- 1\n- 2\n", "spec.yaml: expected a mapping with keys config, system, grid, kernels, collectives, estimates, out"),
        ("kernels: [{name: [matmul]}]\n", "spec.yaml: kernels[0]: name: expected a kernel name or "
                                          "path/to/file.py:function, got ['matmul']"),
        (f"{'k' * 500}: 1\n", "spec.yaml: unknown key 'kkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkkk...kkkkkkkkkkkkkkkkkkkkkkkkkk"
                              "kkkkkkkkkkkk'; expected config, system, grid, kernels, collectives, estimates, out"),
        ("grid: {core.tensor.clock: [2.4GHz, [3GHz]]}\nkernels: [{name: matmul}]\n",
         "spec.yaml: grid.core.tensor.clock: expected a value, got ['3GHz']"),
        ("kernels: [{name: matmul, params: {transpose_a: [1]}}]\n",
         "spec.yaml: kernels[0] (matmul): params.transpose_a: expected a value, got [1]"),
    ]:
        spec.write_text(textwrap.dedent(text))
        assert main(["sweep", str(spec)]) == 2
        assert capsys.readouterr().err == f"trnsim: error: {message}\n"
