"""Tests for the PNG pictures (nanotron_ext.simulate.timeline)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nanotron_ext.simulate import StageTimes, simulate, timeline
from nanotron_ext.simulate.timeline import plot_stage_loads, plot_timeline

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _read_png(path: Path) -> np.ndarray:
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_MAGIC
    return imread(path)


def _has_colour(img: np.ndarray, hex_colour: str, tol: float = 0.02) -> bool:
    from matplotlib.colors import to_rgb

    rgb = np.asarray(to_rgb(hex_colour))
    return bool((np.abs(img[..., :3] - rgb).max(axis=-1) < tol).any())


def test_timeline_png_is_written_with_expected_size_and_colours(tmp_path):
    result = simulate([StageTimes(1e-3, 2e-3), StageTimes(3e-3, 1e-3), StageTimes(2e-3, 2e-3)], 4, "1f1b")
    out = plot_timeline(result, tmp_path / "sub" / "timeline.png")
    assert out == tmp_path / "sub" / "timeline.png"
    assert out.stat().st_size > 10_000
    img = _read_png(out)
    # 11 in wide, (1.6 + 0.5 * pp) in tall, at 150 dpi, RGBA.
    assert img.shape == (round((1.6 + 0.5 * 3) * 150), 11 * 150, 4)
    assert _has_colour(img, timeline.FORWARD_COLOR)
    assert _has_colour(img, timeline.BACKWARD_COLOR)
    assert _has_colour(img, timeline.IDLE_FACE, tol=0.005)


def test_timeline_without_idle_has_no_idle_background(tmp_path):
    # One stage never waits, so only the legend swatch may show the idle colour; it must be small.
    result = simulate([StageTimes(1e-3, 2e-3)], 3, "afab")
    img = _read_png(plot_timeline(result, tmp_path / "one.png", title="single stage"))
    from matplotlib.colors import to_rgb

    idle = (np.abs(img[..., :3] - np.asarray(to_rgb(timeline.IDLE_FACE))).max(axis=-1) < 0.005).mean()
    with_idle = simulate([StageTimes(1e-3, 2e-3)] * 3, 1, "afab")
    img2 = _read_png(plot_timeline(with_idle, tmp_path / "three.png"))
    idle2 = (np.abs(img2[..., :3] - np.asarray(to_rgb(timeline.IDLE_FACE))).max(axis=-1) < 0.005).mean()
    assert idle < 0.01 < idle2


def test_timeline_accepts_labels_and_rejects_wrong_count(tmp_path):
    result = simulate([StageTimes(1.0, 1.0)] * 2, 2, "afab")
    assert plot_timeline(result, tmp_path / "a.png", stage_labels=["embed + 0-3", "4-7 + head"]).exists()
    with pytest.raises(ValueError, match="stage_labels has 1 entries for 2 stages"):
        plot_timeline(result, tmp_path / "b.png", stage_labels=["only one"])
    assert not (tmp_path / "b.png").exists()


def test_stage_loads_png(tmp_path):
    out = plot_stage_loads(
        ["0", "1", "2", "3"],
        {"nanotron": [3.0, 1.0, 0.5, 0.2], "constrained": [1.2, 1.2, 1.1, 1.1]},
        str(tmp_path / "loads.png"),
        title="loads",
    )
    assert out == tmp_path / "loads.png"
    img = _read_png(out)
    assert img.shape == (round(4.8 * 150), 8 * 150, 4)
    assert _has_colour(img, "#1f77b4")  # first strategy, tab10 blue
    assert _has_colour(img, "#ff7f0e")  # second strategy, tab10 orange


@pytest.mark.parametrize(
    ("labels", "loads", "match"),
    [
        ([], {"a": []}, "labels is empty"),
        (["0", "1"], {}, "loads_by_strategy is empty"),
        (["0", "1"], {"a": [1.0, 2.0], "b": [1.0]}, r"strategy 'b' has 1 loads for 2 labels"),
        (["0"], {"a": [float("nan")]}, r"strategy 'a' has a non-finite load"),
    ],
)
def test_stage_loads_rejects_bad_input(tmp_path, labels, loads, match):
    with pytest.raises(ValueError, match=match):
        plot_stage_loads(labels, loads, tmp_path / "x.png")


def test_importing_timeline_does_not_import_matplotlib():
    # Load the file on its own so the check does not depend on what the package __init__ imports.
    code = (
        "import importlib.util, sys;"
        f"spec = importlib.util.spec_from_file_location('tl', {str(Path(timeline.__file__))!r});"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec));"
        "print('matplotlib' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_an_invalid_plan_says_so_and_its_stage_labels_are_whole(tmp_path, monkeypatch, capsys):
    from nanotron_ext.cli import main
    from nanotron_ext.config import bundled_config

    drawn: dict = {}

    def capture(result, path, **kwargs):
        drawn.update(kwargs, figure=timeline.timeline_figure(result, **kwargs))
        return Path(path)

    monkeypatch.setattr(timeline, "plot_timeline", capture)
    config = str(bundled_config("smollm_135m.yaml"))
    assert (
        main(
            [
                "simulate",
                config,
                "--pp",
                "8",
                "--micro-batches",
                "16",
                "--cost-strategy",
                "nanotron",
                "--out",
                str(tmp_path / "t.png"),
            ]
        )
        == 1
    )
    capsys.readouterr()
    fig = drawn["figure"]
    assert fig._suptitle.get_text() == "INVALID, cannot train: no-params@7"
    labels = [t.get_text().replace("\n", " ") for t in fig.axes[0].get_yticklabels()]
    assert labels[6] == "stage 6: decoder.28-29, final_norm, lm_head"  # wrapped onto two lines, not cut
    assert not any("…" in label for label in labels)
    # A valid plan's picture has no such line.
    assert main(["simulate", config, "--out", str(tmp_path / "t.png")]) == 0
    capsys.readouterr()
    assert drawn["verdict"] is None and drawn["figure"]._suptitle is None


@pytest.mark.parametrize(
    "label",
    [
        "stage 0: embedding",
        "stage 7: decoder.28-29, final_norm, lm_head, cast, loss",
        "stage 1: model.some.very.long.other.block.name.that.has.no.comma.at.all",
    ],
)
def test_a_wrapped_label_keeps_every_character(label):
    wrapped = timeline.wrap_label(label)
    assert wrapped.replace(",\n", ", ") == label
    assert all(len(line) <= timeline.LABEL_WIDTH + 1 for line in wrapped.splitlines() if ", " in line)
