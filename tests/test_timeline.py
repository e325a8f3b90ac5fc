"""Tests for the PNG pictures (nanotron_ext.simulate.timeline)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from matplotlib.colors import to_hex

from nanotron_ext.simulate import StageTimes, loads_chart, simulate, timeline
from nanotron_ext.simulate.figure import INVALID_COLOR
from nanotron_ext.simulate.loads_chart import plot_stage_loads
from nanotron_ext.simulate.timeline import plot_timeline
from nanotron_ext.simulate.timeline_marks import MIN_WIDTH, boxes, hops, v_chunks

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


def _inside(fig, artist) -> bool:
    box, frame = artist.get_window_extent(), fig.bbox
    return frame.x0 <= box.x0 and box.x1 <= frame.x1 and frame.y0 <= box.y0 and box.y1 <= frame.y1


LONG = "tiny_llama_large_vocab, pp=2: forward + backward time per micro-batch on H100 SXM (analytic): " * 2


def test_the_loads_charts_title_stays_inside_the_frame():
    # The chart that cut its title on the left: a long title over axes a legend pushes aside.
    fig = loads_chart.loads_figure(
        ["stage 0", "stage 1"],
        {name: [1.0, 2.0] for name in ("nanotron", "uniform", "flops", "memory", "constrained")},
        title=LONG,
    )
    fig.canvas.draw()  # as saved: the layout runs again
    assert _inside(fig, fig.axes[0].title), fig.axes[0].title.get_window_extent()
    assert fig.axes[0].title.get_text().replace("\n", " ").split() == LONG.split()  # wrapped, never cut


def test_the_timelines_title_stays_inside_the_frame():
    result = simulate([StageTimes(1e-3, 2e-3)] * 2, 4, "1f1b")
    fig = timeline.timeline_figure(result, title=LONG, stage_labels=["stage 0: " + "decoder.1, " * 12 + "x"] * 2)
    fig.canvas.draw()
    assert _inside(fig, fig.axes[0].title)


def test_an_invalid_plan_is_marked_on_the_loads_chart_and_never_a_yardstick():
    # Nanotron's split has the lowest slowest stage and cannot train: it must not look like the winner.
    loads = {"nanotron": [0.78, 0.08], "flops": [0.01, 0.85], "constrained": [0.01, 0.85]}
    fig = loads_chart.loads_figure(["stage 0", "stage 1"], loads, invalid={"nanotron": "no-params@1"}, unit="µs")
    ax = fig.axes[0]
    bars = {c.get_label(): c for c in ax.containers}
    invalid = next(label for label in bars if label.startswith("nanotron"))
    assert invalid == "nanotron: INVALID (no-params@1), max 0.78 µs"
    assert all(p.get_hatch() == loads_chart.INVALID_HATCH for p in bars[invalid].patches)
    assert all(to_hex(p.get_edgecolor()) == INVALID_COLOR.lower() for p in bars[invalid].patches)
    assert [t.get_text() for t in ax.texts] == ["INVALID"] * 2  # one on each of its bars
    assert sorted(line.get_ydata()[0] for line in ax.lines) == [0.85, 0.85]  # dashed lines: the valid plans only
    assert any("INVALID" in t.get_text() for t in ax.get_legend().get_texts())
    # Unmarked, nothing says INVALID and every plan gets its line.
    plain = loads_chart.loads_figure(["stage 0", "stage 1"], loads).axes[0]
    assert not plain.texts and len(plain.lines) == 3 and not any(p.get_hatch() for p in plain.patches)
    with pytest.raises(ValueError, match=r"invalid names \['rule'\], which have no loads"):
        loads_chart.loads_figure(["0", "1"], loads, invalid={"rule": "x"})


def test_simulate_compare_marks_nanotrons_split_invalid_on_its_loads_chart(tmp_path, monkeypatch, capsys):
    from nanotron_ext.cli import main

    drawn: dict = {}
    monkeypatch.setattr(loads_chart, "plot_stage_loads", lambda *a, **k: drawn.update(k) or Path(a[2]))
    assert (
        main(["simulate", "--compare", "--out", str(tmp_path / "t.png"), "--loads-out", str(tmp_path / "l.png")]) == 0
    )
    capsys.readouterr()
    assert drawn["invalid"] == {"nanotron": "no-params@1"} and drawn["unit"] == "ns"


def _texts_by_gid(fig) -> dict[str, str]:
    return {t.get_gid(): t.get_text() for t in fig.axes[0].texts if t.get_gid()}


def test_every_row_numbers_its_ops_by_one_rule():
    # zb1p over 4 stages, 16 micro-batches: the middle stages' W is too narrow for "15", as on Llama-3-8B, where
    # they used to stop numbering after 9. A kind is numbered on every row, or on none.
    stages = [StageTimes(1.0, 2.0, weight=0.8), StageTimes(0.9, 1.8, weight=0.05)] * 2
    result = simulate(stages, 16, "zb1p")
    fig = timeline.timeline_figure(result)
    texts = _texts_by_gid(fig)
    drawn = boxes(result)
    for kind in "FBW":
        numbered = [f"n{b.gid}" in texts for b in drawn if b.kind == kind]
        assert all(numbered) or not any(numbered), kind
    assert {b.kind for b in drawn if f"n{b.gid}" in texts} == {"F", "B"}
    assert all(texts[f"n{b.gid}"] == str(b.micro_batch) for b in drawn if f"n{b.gid}" in texts)
    assert {b.row for b in drawn if b.micro_batch >= 10 and f"n{b.gid}" in texts} == {0, 1, 2, 3}


def test_a_vs_two_chunks_are_told_apart_and_a_sliver_of_work_is_drawn_with_its_time():
    from nanotron_ext.config import bundled_config, load_config
    from nanotron_ext.inventory import inventory_from_config
    from nanotron_ext.plan.v_plan import make_v_plan, v_plan_timeline

    cfg = load_config(bundled_config()).with_overrides(engine="zbv")
    blocks = inventory_from_config(cfg)
    plan = make_v_plan(blocks, cfg)
    result = v_plan_timeline(plan, blocks, cfg)
    chunks = v_chunks(result, plan.order)
    fig = timeline.timeline_figure(result, chunks=chunks)
    faces = {p.get_gid(): to_hex(p.get_facecolor()) for p in fig.axes[0].patches if p.get_gid()}
    drawn = boxes(result, chunks)
    assert len(faces) == len(drawn)
    for b in drawn:
        assert faces[b.gid] == to_hex(timeline.shade(timeline._OP_COLORS[b.kind], b.second))
    assert faces["F0@0"] != faces["F0@3"] and faces["B0@1"] != faces["B0@2"]  # rank 0's and rank 1's two chunks
    # Rank 1 (two decoder layers of hidden 16 and a norm) works 0.2 % of the step: not idle 100 %, and drawn.
    right = [t.get_text() for t in fig.axes[1].get_yticklabels()]
    assert right[1].startswith("idle 99.8%") and "drawn wider: F" in right[1]
    assert all(b.width >= MIN_WIDTH * result.step_time for b in drawn)


def test_a_frozen_prefix_is_drawn_without_the_gradients_it_never_receives(tmp_path, monkeypatch, capsys):
    from nanotron_ext.cli import main
    from nanotron_ext.config import bundled_config

    drawn: dict = {}
    monkeypatch.setattr(timeline, "plot_timeline", lambda result, path, **k: drawn.update(k, result=result) or path)
    config = str(bundled_config("last_layer_lm_head_pp4.yaml"))  # only the last stage trains
    assert main(["simulate", config, "--out", str(tmp_path / "t.png")]) in (0, 1)
    capsys.readouterr()
    assert drawn["grad_cuts"] == [False] * 3
    transfers = hops(drawn["result"], boxes(drawn["result"]), drawn["grad_cuts"])
    assert transfers and {h.what for h in transfers} == {"activation"}
