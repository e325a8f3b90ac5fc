"""Documentation that the code reads from, or that mirrors records in the code, stays equal to them."""

from __future__ import annotations

import argparse
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
        f"| `{f.name}` | {f.why} |" for f in UPSTREAM_FIXES
    )


def _defined_columns() -> list[str]:
    """The names in the first cell of each row of docs/cli.md's Columns section (a row may define several)."""
    body = re.search(r"<!-- columns:begin -->\n(.*?)<!-- columns:end -->", (DOCS / "cli.md").read_text(), re.S)
    assert body, "markers <!-- columns:begin/end --> not found in docs/cli.md"
    firsts = [line.strip().strip("|").split(" | ")[0] for line in body.group(1).splitlines() if line.startswith("| `")]
    return [name for cell in firsts for name in re.findall(r"`([^`]+)`", cell)]


def _table_headers(text: str) -> list[str]:
    """The column names of every table in ``text``: a header line over a line of dashes, cut where the dashes
    are (cells are padded to their column, columns joined by two spaces)."""
    lines = text.splitlines()
    names = []
    for head, rule in zip(lines, lines[1:]):
        if rule.strip() and set(rule) <= {"-", " "} and "--" in rule:
            for m in re.finditer(r"-+", rule):
                name = head[m.start() : m.end()].strip()
                names.append(re.sub(r"^share \(.*\)$", "share (UNIT)", name))
    return [n for n in names if n]


def test_every_column_of_every_table_is_defined_once_in_the_docs(tmp_path, capsys):
    from nanotron_ext.cli import main
    from nanotron_ext.config import bundled_config

    defined = _defined_columns()
    assert len(defined) == len(set(defined)), f"a column defined twice: {sorted(defined)}"
    out = str(tmp_path / "t.png")
    runs = [
        ["plan"],
        ["plan", "--engine", "zb1p"],
        ["plan", "--compare"],
        ["plan", "--compare-engines"],
        ["plan", str(bundled_config("last_layer_lm_head_pp4.yaml"))],
        ["simulate", "--out", out],
        ["simulate", "--engine", "zb1p", "--out", out],
        ["simulate", "--compare", "--out", out, "--loads-out", str(tmp_path / "l.png")],
    ]
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
    assert {"spread", "vs best valid", "vs best", "vs nanotron", "bubble", "W state/mb", "of which W/mb"} <= set(seen)


def test_the_readme_shows_plan_output_as_it_prints(capsys):
    from nanotron_ext.cli import main
    from nanotron_ext.config import bundled_config

    shown = re.search(
        r"```\n\$ nanotron-ext plan --cost-strategy nanotron\n(.*?)```", (DOCS.parent / "README.md").read_text(), re.S
    )
    assert shown, "README.md: the `$ nanotron-ext plan --cost-strategy nanotron` block is gone"
    assert main(["plan", "--cost-strategy", "nanotron"]) == 1
    printed = capsys.readouterr().out.replace(str(bundled_config().parent), "…/nanotron_ext/configs")
    assert shown.group(1) == printed, "regenerate README.md's block from `nanotron-ext plan --cost-strategy nanotron`"


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    from nanotron_ext.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _documented_usages() -> dict[str, str]:
    """Per subcommand, the usage cells of docs/cli.md's command table (``nanotron-ext plan [CONFIG] ...``, and
    ``torchrun ... -m nanotron_ext.cli train ...``), joined, their escaped ``\\|`` unescaped."""
    cells = re.findall(r"^\| `([^`]+)` \|", (DOCS / "cli.md").read_text(), re.M)
    out: dict[str, str] = {}
    for cell in cells:
        m = re.search(r"(?:^nanotron-ext|-m nanotron_ext\.cli) (\w+)", cell)
        if m:
            out[m[1]] = out.get(m[1], "") + " " + cell.replace("\\|", "|")
    return out


def test_every_flag_of_every_subcommand_is_in_the_docs_with_its_choices():
    documented = _documented_usages()
    for name, parser in _subcommands().items():
        assert name in documented, f"docs/cli.md's command table has no row for `nanotron-ext {name}`"
        usage = documented[name]
        flags = {s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
        shown = set(re.findall(r"(--[a-z0-9][a-z0-9-]*)", usage))
        assert flags == shown, (
            f"`nanotron-ext {name} --help` and docs/cli.md differ: only in --help "
            f"{sorted(flags - shown)}, only in the docs {sorted(shown - flags)}"
        )
        for action in parser._actions:
            if action.choices is None or not action.option_strings:
                continue
            flag = action.option_strings[-1]
            written = re.findall(rf"{flag} ([\w.]+(?:\|[\w.]+)+)", usage)
            assert written, f"docs/cli.md: `nanotron-ext {name}` shows {flag} without its choices"
            for choices in written:
                assert sorted(choices.split("|")) == sorted(map(str, action.choices)), (name, flag, choices)


def test_the_docs_name_the_engines_and_strategies_the_command_line_takes():
    from nanotron_ext.plan import AUTO_ENGINES
    from nanotron_ext.strategies import available_strategies, get_strategy

    text = (DOCS / "cli.md").read_text()
    row = re.search(r"^\| `nanotron-ext plan \[CONFIG\] --compare-engines.*$", text, re.M)
    assert row, "docs/cli.md: the --compare-engines row is gone"
    compared = re.search(r"planned under each of (.*?), side by side", row[0])
    assert compared and re.findall(r"`(\w+)`", compared[1]) == list(AUTO_ENGINES), row[0]
    help_text = next(a.help for a in _subcommands()["plan"]._actions if "--compare-engines" in a.option_strings)
    assert f"each of {', '.join(AUTO_ENGINES)}," in help_text
    strategies = re.search(r"`--cost-strategy` overrides the YAML's strategy: one of\s+(.*?), or `package", text, re.S)
    ours = [n for n in available_strategies() if type(get_strategy(n)).__module__.startswith("nanotron_ext.")]
    assert strategies and re.findall(r"`(\w+)`", strategies[1]) == ours  # not those other tests register
