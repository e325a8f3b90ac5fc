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
