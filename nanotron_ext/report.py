"""Plain-text and markdown tables that line up, and human-readable numbers."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "compact_names",
    "format_seconds",
    "human_bytes",
    "human_count",
    "int_ranges",
    "percent",
    "table",
    "time_unit",
]


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, markdown: bool = False) -> str:
    """Format rows under headers; numbers right-aligned, text left-aligned.

    Args:
        headers: column titles.
        rows: cells; anything with ``str()``.
        markdown: emit a GitHub markdown table instead of plain columns.

    Returns:
        The table, lines joined by newlines.
    """
    cells = [[str(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    numeric = [all(_looks_numeric(r[i]) for r in cells) and bool(cells) for i in range(len(headers))]

    def fmt(row: Sequence[str]) -> list[str]:
        return [c.rjust(w) if num else c.ljust(w) for c, w, num in zip(row, widths, numeric)]

    if markdown:
        rule = ["-" * (w - 1) + ":" if num else "-" * w for w, num in zip(widths, numeric)]
        lines = [fmt(list(headers)), rule] + [fmt(r) for r in cells]
        return "\n".join("| " + " | ".join(line) + " |" for line in lines)
    lines = [fmt(list(headers)), ["-" * w for w in widths]] + [fmt(r) for r in cells]
    return "\n".join("  ".join(line).rstrip() for line in lines)


def _looks_numeric(text: str) -> bool:
    t = text.strip().rstrip("%x×").replace(",", "")
    for suffix in ("KiB", "MiB", "GiB", "TiB", "B", "K", "M", "G", "T", "P", "ms", "µs", "ns", "s"):
        if t.endswith(suffix):
            t = t[: -len(suffix)].strip()
            break
    try:
        float(t)
    except ValueError:
        return t in ("-", "inf")
    return True


def human_count(n: float) -> str:
    """``1234567`` → ``1.23M``."""
    for unit, size in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


#: The units a time is written in, largest first: every table's times and every picture's time axis.
_TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9))


def time_unit(seconds: float) -> tuple[str, float]:
    """The unit ``seconds`` reads best in and its size in seconds: the largest of s, ms, µs and ns it is at least
    one of (``0.0123`` → ``("ms", 1e-3)``; ns below a nanosecond, s for 0). The one rule :func:`format_seconds` and
    the pictures' axes follow."""
    for unit, scale in _TIME_UNITS:
        if abs(seconds) >= scale:
            return unit, scale
    return ("ns", 1e-9) if seconds else ("s", 1.0)


def format_seconds(seconds: float) -> str:
    """``0.0123`` → ``12.3 ms``: three significant digits in the unit of :func:`time_unit` (``999.9 µs`` rounds
    up to ``1 ms``, never ``1e+03 µs``; above 999 s, whole seconds)."""
    if not seconds:
        return "0 s"
    unit, scale = time_unit(seconds)
    if abs(float(f"{seconds / scale:.3g}")) >= 1000:  # rounded up into the next unit
        if unit == "s":
            return f"{seconds:.0f} s"
        unit, scale = _TIME_UNITS[[u for u, _ in _TIME_UNITS].index(unit) - 1]
    return f"{seconds / scale:.3g} {unit}"


def percent(fraction: float, digits: int = 0) -> str:
    """``fraction`` as a percentage with ``digits`` decimals, more where that would round a share that is not
    exactly 0 or 1 to ``0%`` or ``100%`` (``0.998`` → ``99.8%``): a stage that works 0.2 % of the step is never
    called idle all of it."""
    for d in range(digits, digits + 4):
        text = f"{fraction:.{d}%}"
        if float(text.rstrip("%")) not in (0.0, 100.0) or fraction in (0.0, 1.0):
            return text
    return text


def human_bytes(n: float) -> str:
    """``3.5 · 2**30`` → ``3.5 GiB``."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            x = n / size
            # 1000-1023 of a unit: .3g would write 1e+03
            return f"{x:.0f} {unit}" if abs(x) >= 1000 else f"{x:.3g} {unit}"
    return f"{n:.0f} B"


def compact_names(shorts: Sequence[str], *, empty: str = "(empty)") -> str:
    """``["embedding", "decoder.0", "decoder.1", "decoder.2"]`` → ``"embedding, decoder.0-2"``; runs of
    vocabulary shards likewise (``vocab.0-3``). The one way every table and message lists blocks; ``empty`` when
    there are none."""
    parts: list[str] = []
    run: list[int] = []
    prefix = ""

    def flush() -> None:
        if run:
            parts.append(f"{prefix}{run[0]}" if len(run) == 1 else f"{prefix}{run[0]}-{run[-1]}")
            run.clear()

    for name in shorts:
        head, _, tail = name.rpartition(".")
        if head in ("decoder", "vocab") and tail.isdigit():
            i = int(tail)
            if run and (f"{head}." != prefix or i != run[-1] + 1):
                flush()
            prefix = f"{head}."
            run.append(i)
        else:
            flush()
            parts.append(name)
    flush()
    return ", ".join(parts) if parts else empty


def int_ranges(values: Sequence[int]) -> str:
    """``[1, 2, 3, 7, 9, 10]`` → ``"1-3,7,9-10"``: runs of consecutive integers as ranges, in the order given."""
    runs: list[list[int]] = []
    for v in values:
        if runs and v == runs[-1][-1] + 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    return ",".join(f"{r[0]}" if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)
