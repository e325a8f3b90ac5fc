"""Documentation that the code reads from, or that mirrors records in the code, stays equal to them."""

from __future__ import annotations

import re
from pathlib import Path

from nanotron_ext.integration.upstream_fixes import UPSTREAM_FIXES

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _table_between(text: str, marker: str) -> list[list[str]]:
    """Rows (cells stripped) of the markdown table between ``<!-- marker:begin -->`` and ``<!-- marker:end -->``."""
    body = re.search(rf"<!-- {marker}:begin -->\n(.*?)<!-- {marker}:end -->", text, re.S)
    assert body, f"markers <!-- {marker}:begin/end --> not found"
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in body.group(1).splitlines() if line]
    return rows[2:]  # header and separator


def test_the_upstream_fix_table_is_the_launchers_records():
    rows = _table_between((DOCS / "launcher.md").read_text(), "upstream-fixes")
    expected = [[f"`{fix.name}`", fix.why] for fix in UPSTREAM_FIXES]
    assert rows == expected, "docs/launcher.md's table must list UPSTREAM_FIXES: " + "\n".join(
        f"| `{f.name}` | {f.why} |" for f in UPSTREAM_FIXES)


def _defined_columns() -> list[str]:
    """The names in the first cell of each row of docs/cli.md's Columns section (a row may define several)."""
    body = re.search(r"<!-- columns:begin -->\n(.*?)<!-- columns:end -->", (DOCS / "cli.md").read_text(), re.S)
    assert body, "markers <!-- columns:begin/end --> not found in docs/cli.md"
    firsts = [line.strip().strip("|").split(" | ")[0] for line in body.group(1).splitlines()
              if line.startswith("| `")]
    return [name for cell in firsts for name in re.findall(r"`([^`]+)`", cell)]


def _table_headers(text: str) -> list[str]:
    """The column names of every table in ``text``: a header line over a line of dashes, cut where the dashes
    are (cells are padded to their column, columns joined by two spaces)."""
    lines = text.splitlines()
    names = []
    for head, rule in zip(lines, lines[1:]):
        if rule.strip() and set(rule) <= {"-", " "} and "--" in rule:
            for m in re.finditer(r"-+", rule):
                name = head[m.start():m.end()].strip()
                names.append(re.sub(r"^share \(.*\)$", "share (UNIT)", name))
    return [n for n in names if n]


def test_every_column_of_every_table_is_defined_once_in_the_docs(tmp_path, capsys):
    from nanotron_ext.cli import main
    from nanotron_ext.config import bundled_config

    defined = _defined_columns()
    assert len(defined) == len(set(defined)), f"a column defined twice: {sorted(defined)}"
    out = str(tmp_path / "t.png")
    runs = [["plan"], ["plan", "--engine", "zb1p"], ["plan", "--compare"], ["plan", "--compare-engines"],
            ["plan", str(bundled_config("last_layer_lm_head_pp4.yaml"))],
            ["simulate", "--out", out], ["simulate", "--engine", "zb1p", "--out", out],
            ["simulate", "--compare", "--out", out, "--loads-out", str(tmp_path / "l.png")]]
    seen: dict[str, list[str]] = {}
    for argv in runs:
        main(argv)
        text = capsys.readouterr().out
        assert "columns: docs/cli.md#columns" in text, f"{argv}: no pointer to the Columns section"
        for name in _table_headers(text):
            seen.setdefault(name, argv)
    from nanotron_ext.cli.calibrate import summary
    from nanotron_ext.config import load_config
    from nanotron_ext.machine import machine_for

    cfg = load_config(bundled_config())
    text = summary(cfg, machine_for(cfg))  # calibrate's tables, on the analytic machine (no process needed)
    assert "columns: docs/cli.md#columns" in text, "calibrate: no pointer to the Columns section"
    for name in _table_headers(text):
        seen.setdefault(name, ["calibrate"])
    missing = {name: argv for name, argv in seen.items() if name not in defined}
    assert not missing, f"columns printed but not defined in docs/cli.md#columns: {missing}"
    assert {"spread", "vs optimum", "vs best", "vs nanotron", "bubble", "W state/mb", "of which W ms/mb"} <= set(seen)


def test_the_readme_shows_plan_output_as_it_prints(capsys):
    from nanotron_ext.cli import main
    from nanotron_ext.config import bundled_config

    shown = re.search(r"```\n\$ nanotron-ext plan --cost-strategy nanotron\n(.*?)```",
                      (DOCS.parent / "README.md").read_text(), re.S)
    assert shown, "README.md: the `$ nanotron-ext plan --cost-strategy nanotron` block is gone"
    assert main(["plan", "--cost-strategy", "nanotron"]) == 1
    printed = capsys.readouterr().out.replace(str(bundled_config().parent), "…/nanotron_ext/configs")
    assert shown.group(1) == printed, "regenerate README.md's block from `nanotron-ext plan --cost-strategy nanotron`"
