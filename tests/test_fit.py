"""A plan fits the memory it names (issue 30): the device's memory in the profile, the verdict at the boundary,
the split ``constrained`` gives up speed for, and fixes priced by planning them."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from nanotron_ext.cli import main
from nanotron_ext.config import bundled_config, load_config
from nanotron_ext.costs.analytic import GIB
from nanotron_ext.errors import ConfigError
from nanotron_ext.inventory import inventory_from_config
from nanotron_ext.machine import ANALYTIC_GPU, load_machine, memory_limit
from nanotron_ext.plan import make_plan, plan_with_ranks
from nanotron_ext.plan.fit import GPU_ACTIVATION_OVERCOUNT
from nanotron_ext.simulate import simulate_plan

TINY = load_config(bundled_config())
UPSTREAM_EXAMPLES = (
    Path(__file__).parent / "data" / "nanotron_examples"
)  # embedding, decoder.0-1, final_norm, lm_head, cast, loss; pp=2


def _gpu(tmp_path: Path, memory: float, name: str = "a GPU") -> str:
    path = tmp_path / "gpu.json"
    dataclasses.replace(ANALYTIC_GPU, name=name, device_memory_bytes=memory).save(path)
    return str(path)


def _memory_verdicts(plan) -> list[tuple[str, int]]:
    return [(f.severity, f.stage) for f in plan.findings if f.code == "memory"]


def test_the_analytic_h100_has_cudas_total_of_an_80gb_card_and_a_cpu_run_has_no_limit():
    assert ANALYTIC_GPU.device_memory_bytes == 81_082 * 2**20  # torch's total_memory on an H100 80GB HBM3
    limit = memory_limit(TINY)
    assert limit is not None and limit.kind == "device" and str(limit) == "79.18 GiB per GPU (H100 SXM (analytic))"
    assert memory_limit(TINY.with_overrides(memory_runtime="cpu")) is None  # the CPU runtime: not that GPU
    cap = memory_limit(TINY.with_overrides(memory_cap_gib=12.5))
    assert cap is not None and (cap.kind, cap.bytes, str(cap)) == ("cap", 12.5 * GIB, "memory_cap_gib=12.5")


def test_a_profile_without_device_memory_sets_no_limit_and_bad_memory_is_refused(tmp_path):
    path = tmp_path / "cpu.json"
    dataclasses.replace(ANALYTIC_GPU, device_memory_bytes=None).save(path)
    assert memory_limit(TINY.with_overrides(machine=str(path))) is None
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ConfigError, match=rf"device_memory_bytes={bad!r} must be a positive, finite number"):
            dataclasses.replace(ANALYTIC_GPU, device_memory_bytes=bad)
    assert load_machine(_gpu(tmp_path, 85e9)).device_memory_bytes == 85e9


@pytest.mark.parametrize("runtime", ["cpu", "gpu"])
def test_the_verdict_flips_one_percent_either_side_of_a_stages_peak(tmp_path, runtime):
    # Nanotron's rule does not plan under a limit, so its split stays put while the device's memory moves. A Llama
    # is counted for the code that runs it on either runtime: 1 % over is an error on both.
    cfg = TINY.with_overrides(memory_runtime=runtime)
    blocks = inventory_from_config(cfg)
    peak = max(s.memory_bytes for s in make_plan(blocks, cfg, "nanotron").stages)
    worst = max(make_plan(blocks, cfg, "nanotron").stages, key=lambda s: s.memory_bytes).stage
    fits = make_plan(blocks, cfg.with_overrides(machine=_gpu(tmp_path, peak * 1.01)), "nanotron")
    assert _memory_verdicts(fits) == []
    over = make_plan(blocks, cfg.with_overrides(machine=_gpu(tmp_path, peak * 0.99)), "nanotron")
    assert _memory_verdicts(over) == [("error", worst)] and not over.ok
    finding = next(f for f in over.findings if f.code == "memory")
    assert finding.message.startswith(f"stage {worst} needs about ") and "over" in finding.message
    assert "may still fit" not in finding.message


def test_a_llama_on_the_gpu_path_has_no_may_still_fit_band(tmp_path):
    # Llama-3-8B's stages are mostly activations: 3 % over the device is well inside the CPU count's 23 % band,
    # and still an error, since the GPU path is counted for the code that runs there.
    cfg = load_config(bundled_config("llama_3_8b.yaml"))
    blocks = inventory_from_config(cfg)
    worst = max(
        make_plan(blocks, cfg.with_overrides(memory_cap_gib=1000), "nanotron").stages, key=lambda s: s.memory_bytes
    )
    assert GPU_ACTIVATION_OVERCOUNT * worst.memory.pipeline_activations > 0.03 * worst.memory_bytes
    over = make_plan(blocks, cfg.with_overrides(machine=_gpu(tmp_path, worst.memory_bytes * 0.97)), "nanotron")
    assert ("error", worst.stage) in _memory_verdicts(over) and not over.ok


def test_a_family_counted_high_on_a_gpu_is_warned_within_the_overcount_and_refused_beyond(tmp_path):
    # LlaMoE keeps the CPU runtime's count under memory_runtime: gpu (more than flash-attn keeps): within
    # GPU_ACTIVATION_OVERCOUNT of its activations a stage over the device "may still fit"; beyond, an error.
    moe = load_config(UPSTREAM_EXAMPLES / "moe" / "config_llamoe.yaml", pp=2)
    blocks = inventory_from_config(moe)
    stages = make_plan(blocks, moe, "nanotron").stages
    worst = max(stages, key=lambda s: s.memory_bytes)
    assert worst.memory.peak_at == "pipeline"
    floor = worst.memory_bytes - GPU_ACTIVATION_OVERCOUNT * worst.memory.pipeline_activations
    warned = make_plan(blocks, moe.with_overrides(machine=_gpu(tmp_path, floor * 1.0001)), "nanotron")
    refused = make_plan(blocks, moe.with_overrides(machine=_gpu(tmp_path, floor * 0.9999)), "nanotron")
    # (Nanotron's rule leaves its stage 1 without parameters, an error of its own: the memory verdicts are read.)
    assert ("warning", worst.stage) in _memory_verdicts(warned)
    assert "may still fit" in next(f.message for f in warned.findings if f.code == "memory")
    assert ("error", worst.stage) in _memory_verdicts(refused)
    # The same stage counted as the CPU runtime runs it has no band: over is over.
    cpu = moe.with_overrides(memory_runtime="cpu", machine=_gpu(tmp_path, floor * 1.0001))
    assert ("error", worst.stage) in _memory_verdicts(make_plan(blocks, cpu, "nanotron"))


def test_constrained_gives_up_the_fastest_split_for_one_that_fits_and_says_what_it_cost(capsys):
    cfg = load_config(bundled_config("llama_3_8b.yaml"), pp=4)  # issue 30: 107 GiB on stage 0 before
    blocks = inventory_from_config(cfg)
    plan = make_plan(blocks, cfg)
    limit = 81_082 * 2**20
    assert plan.ok and max(s.memory_bytes for s in plan.stages) <= limit
    assert plan.over_memory_ranks is not None and plan.over_memory_ranks != plan.block_ranks
    faster = plan_with_ranks(blocks, cfg, plan.over_memory_ranks, "constrained")
    assert max(s.memory_bytes for s in faster.stages) > limit and not faster.ok
    fast, chosen = simulate_plan(faster, blocks, cfg).step_time, simulate_plan(plan, blocks, cfg).step_time
    assert fast < chosen
    # Without a limit (a cap far above), constrained takes the faster split itself.
    roomy = cfg.with_overrides(memory_cap_gib=1000)
    assert make_plan(blocks, roomy).block_ranks == plan.over_memory_ranks
    # Where the fastest split fits, nothing was given up (and no second search names one).
    smol = load_config(bundled_config("smollm_135m.yaml"))
    assert make_plan(inventory_from_config(smol), smol).over_memory_ranks is None
    assert main(["plan", str(bundled_config("llama_3_8b.yaml")), "--pp", "4"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("to fit 79.18 GiB per GPU (H100 SXM (analytic))"))
    assert (
        f"({faster.stage_map()}, " in line
        and f"needs {max(s.memory_bytes for s in faster.stages) / GIB:.3g} GiB" in line
    )


def test_a_plan_over_the_gpu_lists_fixes_planned_again_and_exits_1(capsys):
    config = str(bundled_config("llama_3_8b.yaml"))
    assert main(["plan", config, "--pp", "4", "--cost-strategy", "nanotron"]) == 1
    out = capsys.readouterr().out
    assert "ERROR [stage 0] stage 0 needs about" in out and "over 79.18 GiB per GPU (H100 SXM (analytic)) by" in out
    fix = next(x for x in out.splitlines() if x.startswith("  fix: "))
    # Each fix is the config changed and planned again: its largest stage is what that plan gives.
    cfg = load_config(config, pp=4)
    tp2 = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, tp=2))
    peak = max(s.memory_bytes for s in make_plan(inventory_from_config(tp2), tp2, "nanotron").stages)
    from nanotron_ext.report import human_bytes

    assert f"`parallelism.tp: 2` (largest stage {human_bytes(peak)})" in fix
    assert fix.rstrip().endswith(
        "`memory_cap_gib` under `nanotron_ext:` when you know the memory better than the estimate"
    )


def test_fit_search_plans_every_change_and_orders_those_that_fit_by_gpus_then_step():
    from nanotron_ext.simulate.fit_search import fit_search

    cfg = load_config(bundled_config("llama_3_8b.yaml"), pp=4, cost_strategy="nanotron")
    limit, rows = fit_search(cfg)
    assert limit is not None and limit.bytes == 81_082 * 2**20
    by_change = {r.change: r for r in rows}
    assert not by_change["as configured"].fits  # Nanotron's rule at pp=4: 107 GiB on stage 0
    # Every row is its config planned again by the strategy and simulated (three checked by hand here).
    for change, tp, pp in (("tp: 2", 2, 4), ("pp: 8", 1, 8), ("tp: 4, pp: 2", 4, 2)):
        changed = dataclasses.replace(cfg.with_overrides(pp=pp), run=dataclasses.replace(cfg.run, tp=tp, pp=pp))
        blocks = inventory_from_config(changed)
        plan = make_plan(blocks, changed, "nanotron")
        row = by_change[change]
        assert row.peak == max(s.memory_bytes for s in plan.stages)
        assert row.step_time == simulate_plan(plan, blocks, changed).step_time
        assert row.fits is (row.peak <= limit.bytes) and row.gpus == tp * pp
    fits = [r for r in rows if r.fits]
    assert fits and rows[: len(fits)] == fits  # those that fit come first...
    assert [(r.gpus, r.step_time) for r in fits] == sorted((r.gpus, r.step_time) for r in fits)  # ...cheapest first
    rest = [r.peak for r in rows[len(fits) :]]
    assert rest == sorted(rest)  # then the nearest to fitting
    assert all(32 % (r.tp) == 0 and 8 % r.tp == 0 for r in rows)  # tp divides Llama-3-8B's 32 and 8 heads


def test_plan_fit_prints_the_table_and_says_when_nothing_fits(capsys, tmp_path):
    config = str(bundled_config("llama_3_8b.yaml"))
    assert main(["plan", config, "--pp", "4", "--cost-strategy", "nanotron", "--fit"]) == 0
    out = capsys.readouterr().out
    head = next(x for x in out.splitlines() if x.startswith("change"))
    assert head.split() == [
        "change",
        "GPUs",
        "per",
        "replica",
        "largest",
        "stage",
        "of",
        "limit",
        "sim.",
        "step",
        "fits",
    ]
    assert "as configured" in out.splitlines()[out.splitlines().index(head) + 2]
    import yaml

    raw = yaml.safe_load(Path(config).read_text())
    raw.setdefault("nanotron_ext", {})["memory_cap_gib"] = 1
    capped = tmp_path / "capped.yaml"
    capped.write_text(yaml.safe_dump(raw))
    assert main(["plan", str(capped), "--pp", "4", "--cost-strategy", "nanotron", "--fit"]) == 1
    out = capsys.readouterr().out
    assert "under memory_cap_gib=1;" in out and "0 fit" in out and "nothing here fits" in out
    assert main(["plan", config, "--fit", "--compare"]) == 2
    assert "--compare, --compare-engines and --fit are three tables; pass one of them" in capsys.readouterr().err


def test_plan_fit_says_how_many_candidates_it_left_out_and_all_prints_every_one(capsys):
    from nanotron_ext.cli.plan_fit import FIT_ROWS
    from nanotron_ext.simulate.fit_search import fit_search

    config = str(bundled_config("llama_3_8b.yaml"))
    _, rows = fit_search(load_config(config, pp=4, cost_strategy="nanotron"))
    others = [r for r in rows if r.change != "as configured"]
    hidden = others[FIT_ROWS - 1 :]  # the config as it is, then the first rows of the others
    assert len(hidden) > 0 and 0 < sum(r.fits for r in hidden) < len(hidden)  # the count below is not trivial

    def printed(*extra: str) -> tuple[list[str], str]:
        assert main(["plan", config, "--pp", "4", "--cost-strategy", "nanotron", "--fit", *extra]) == 0
        out = capsys.readouterr().out
        lines = out.splitlines()
        start = next(i for i, x in enumerate(lines) if x.startswith("change")) + 2
        end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
        return lines[start:end], out

    table, out = printed()
    assert len(table) == FIT_ROWS
    assert (
        f"{len(hidden)} more candidates left out ({sum(r.fits for r in hidden)} of them fit): --all prints every one"
    ) in out
    table, out = printed("--all")
    assert len(table) == len(rows) and "left out" not in out
    assert sorted(x.split("  ")[0] for x in table) == sorted(r.change for r in rows)
    assert main(["plan", config, "--all"]) == 2
    assert "--all goes with --fit" in capsys.readouterr().err


def test_fixes_that_all_stay_over_point_to_plan_fit_and_one_that_fits_does_not():
    from nanotron_ext.plan.fit import FIT_POINTER

    big = load_config(bundled_config("llama_3_70b.yaml"))  # every single change is still over an H100
    plan = make_plan(inventory_from_config(big), big)
    fix = next(f.fix for f in plan.findings if f.code == "memory")
    assert fix.count("(largest stage") == fix.count(", still over)") and fix.endswith(f". {FIT_POINTER}")
    assert fix.count("(largest stage") + fix.count("(still over with any split: ") >= 3
    assert "a split chosen under the memory" not in fix  # no split of this config fits: not a fix
    blocks = inventory_from_config(TINY)
    need = make_plan(blocks, TINY, "nanotron").stages[0].memory_bytes
    capped = TINY.with_overrides(memory_cap_gib=need * 0.997 / GIB)  # tp 2 fits, pp 4 is still over
    fix = next(f.fix for f in make_plan(blocks, capped, "nanotron").findings if f.code == "memory")
    assert fix.count("(largest stage") > fix.count(", still over)") >= 1 and FIT_POINTER not in fix


@pytest.mark.parametrize("share", [0.97, 0.6])
def test_a_fit_candidate_no_split_can_fit_is_priced_by_the_least_any_split_needs_and_the_others_are_planned(
    capsys, share
):
    import itertools

    from nanotron_ext.cli.plan_fit import fit_table
    from nanotron_ext.simulate.fit_search import AS_CONFIGURED, fit_search
    from nanotron_ext.strategies.builtin import stage_memory_terms

    small, _ = _small_smollm()
    cfg = small.with_overrides(pp=2)
    as_is = max(s.memory_bytes for s in make_plan(inventory_from_config(cfg), cfg).stages)
    # 0.97: some changes fit, some cannot with any split; 0.6: none fits, and some that the additive part lets
    # fit are over by the full estimate with every split (planned without the cap: shown, not dropped).
    capped = cfg.with_overrides(memory_cap_gib=as_is * share / GIB)
    limit, rows = fit_search(capped)
    assert {r.least for r in rows} == {True, False} and any(r.fits for r in rows) is (share > 0.9)
    assert len(rows) == 6  # pp 1, 2 and 4, with and without recompute_layer: none left out
    for row in rows:
        changed = dataclasses.replace(
            capped.with_overrides(pp=row.pp, engine=row.engine),
            run=dataclasses.replace(
                capped.run, tp=row.tp, pp=row.pp, engine=row.engine, recompute_layer=row.recompute_layer
            ),
        )
        blocks = inventory_from_config(changed)
        n, pp = len(blocks), row.pp
        splits = [(0, *c, n) for c in itertools.combinations(range(1, n), pp - 1)]
        terms = stage_memory_terms(blocks, changed)  # the estimate's additive part, by brute force over splits
        additive = changed.ext.overhead_gib * GIB + min(
            max(terms.prefix(k)[e] - terms.prefix(k)[s] for k, (s, e) in enumerate(zip(b, b[1:]))) for b in splits
        )
        if row.least:  # no split fits, by the additive part (a lower bound of the full estimate): not planned
            assert row.change != AS_CONFIGURED and additive > limit.bytes
            assert row.step_time is None and not row.fits
            assert additive * 0.995 <= row.peak <= additive * 1.005
            continue
        assert additive <= limit.bytes * (1 + 1e-9) or row.change == AS_CONFIGURED
        if not row.fits:  # every split over the cap by the full estimate: the plan without it
            changed = dataclasses.replace(changed, ext=dataclasses.replace(changed.ext, memory_cap_gib=None))
        plan = make_plan(blocks, changed, "constrained", suggest_fixes=False)
        assert row.peak == max(s.memory_bytes for s in plan.stages) and row.fits is (row.peak <= limit.bytes)
        assert row.step_time == simulate_plan(plan, blocks, changed).step_time
    assert fit_table(capped, as_json=False, every=True) == (0 if share > 0.9 else 1)
    out = capsys.readouterr().out
    least = [r for r in rows if r.least]
    assert out.count("≥ ") == 2 * len(least) and "≥: no split of that change fits; the least memory" in out
    for row in least:
        line = next(x for x in out.splitlines() if x.startswith(row.change + "  "))
        assert "≥ " in line and line.split()[-2:] == ["-", "no"]


def test_fit_search_tries_only_a_tp_that_divides_the_heads():
    from nanotron_ext.plan.fit import heads_split
    from nanotron_ext.simulate.fit_search import fit_search

    smol = load_config(bundled_config("smollm_135m.yaml"))  # 9 query heads, 3 key/value heads
    assert heads_split(smol, 1) and not heads_split(smol, 2) and not heads_split(smol, 3 * 2)
    _, rows = fit_search(smol)
    assert rows and {r.tp for r in rows} == {1}


def _small_smollm(objective: str = "step_time"):
    """SmolLM-135M's shape with 6 layers at pp=3, m=6: 11 blocks, 45 splits, every one checked by brute force."""
    raw = load_config(bundled_config("smollm_135m.yaml"), pp=3).with_overrides(n_micro_batches=6, objective=objective)
    model = dataclasses.replace(raw.model, num_hidden_layers=6)
    cfg = dataclasses.replace(raw, model=model)
    return cfg, inventory_from_config(cfg)


def _every_split(cfg, blocks):
    """(bounds, largest full stage estimate, simulated step) of every split whose stages each train something."""
    import itertools

    from nanotron_ext.partition import ranks_from_bounds

    out = []
    n, pp = len(blocks), cfg.run.pp
    for cuts in itertools.combinations(range(1, n), pp - 1):
        bounds = (0, *cuts, n)
        if not all(any(b.trainable for b in blocks[s:e]) for s, e in zip(bounds, bounds[1:])):
            continue
        plan = plan_with_ranks(blocks, cfg, ranks_from_bounds(list(bounds)), "constrained", suggest_fixes=False)
        out.append((bounds, max(s.memory_bytes for s in plan.stages), simulate_plan(plan, blocks, cfg).step_time))
    return out


def test_the_least_memory_any_split_needs_is_the_full_estimates_minimum_by_brute_force():
    from nanotron_ext.errors import PlanningError

    cfg, blocks = _small_smollm()
    least = min(peak for _, peak, _ in _every_split(cfg, blocks))
    # Just under it (the additive part alone would fit: the full estimate decides), and far under it.
    for under in (0.999, 0.5):
        with pytest.raises(PlanningError, match=rf"the least memory any valid split needs is {least / GIB:.4g} GiB"):
            make_plan(blocks, cfg.with_overrides(memory_cap_gib=least * under / GIB))
    plan = make_plan(blocks, cfg.with_overrides(memory_cap_gib=least * 1.001 / GIB))  # just above: it is found
    assert plan.ok and max(s.memory_bytes for s in plan.stages) <= least * 1.001


def test_a_fix_no_split_fits_is_priced_by_a_bound_under_every_splits_largest_stage():
    import itertools

    from nanotron_ext.strategies.builtin import stage_memory_terms

    cfg, blocks = _small_smollm()
    recomputed = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, recompute_layer=True))
    least = min(peak for _, peak, _ in _every_split(recomputed, blocks))
    terms = stage_memory_terms(blocks, recomputed)  # the estimate's additive part, by brute force over splits
    additive = recomputed.ext.overhead_gib * GIB + min(
        max(terms.prefix(k)[e] - terms.prefix(k)[s] for k, (s, e) in enumerate(zip(b, b[1:])))
        for b in ((0, *c, len(blocks)) for c in itertools.combinations(range(1, len(blocks)), 2))
    )
    capped = cfg.with_overrides(memory_cap_gib=additive * 0.5 / GIB)
    fix = next(f.fix for f in make_plan(blocks, capped, "nanotron").findings if f.code == "memory")
    prefix = "`parallelism.recompute_layer: true` (upstream Nanotron: each decoder layer keeps its input) (still "
    figure = fix.split(prefix + "over with any split: its largest stage needs at least ")[1].split(")")[0]
    value, unit = figure.split()
    bound = float(value) * {"MiB": 2**20, "GiB": GIB}[unit]
    # No split's largest stage is under it (the full estimate adds temporaries to the additive part it bounds).
    assert additive * 0.995 <= bound <= additive * 1.005 and bound <= least
    assert "`parallelism.pp: 6` (still over with any split: its largest stage needs at least " in fix


@pytest.mark.parametrize("objective", ["step_time", "slowest_stage"])
def test_under_any_cap_constrained_finds_a_split_that_fits_and_the_fastest_one_by_brute_force(objective):
    cfg, blocks = _small_smollm(objective)
    splits = _every_split(cfg, blocks)
    peaks = sorted({peak for _, peak, _ in splits})
    for cap in (peaks[0], *peaks[1 : len(peaks) : max(1, len(peaks) // 8)], peaks[-1]):
        plan = make_plan(blocks, cfg.with_overrides(memory_cap_gib=cap * (1 + 1e-7) / GIB))
        assert plan.ok, (cap, plan.verdict)
        assert max(s.memory_bytes for s in plan.stages) <= cap * (1 + 1e-7)
        if objective == "step_time":  # the fastest of those that fit
            fastest = min(step for _, peak, step in splits if peak <= cap * (1 + 1e-7))
            assert simulate_plan(plan, blocks, cfg).step_time == pytest.approx(fastest, rel=1e-9)


def test_issue_30s_smollm_at_pp_8_fits_its_cap_and_names_the_least_memory_a_hand_layout_reaches():
    from nanotron_ext.errors import PlanningError

    cfg = load_config(bundled_config("smollm_135m.yaml"), pp=8).with_overrides(n_micro_batches=16)
    blocks = inventory_from_config(cfg)
    plan = make_plan(blocks, cfg.with_overrides(memory_cap_gib=5.5))  # was INVALID, stage 3 at 5.61 GiB
    assert plan.ok and max(s.memory_bytes for s in plan.stages) <= 5.5 * GIB
    hand = make_plan(blocks, cfg.with_overrides(layout="E,t*2|t*2|t*3|t*3|t*4|t*6|t*8|t*2,L"), "layout")
    by_hand = max(s.memory_bytes for s in hand.stages)
    with pytest.raises(PlanningError, match=r"the least memory any valid split needs is ([\d.]+) GiB") as err:
        make_plan(blocks, cfg.with_overrides(memory_cap_gib=4.5))
    least = float(err.value.args[0].split("needs is ")[1].split(" GiB")[0]) * GIB
    assert least <= by_hand * (1 + 5e-4)  # was 4.72 GiB, under what any split needs
    # Its last stage starts at the final norm; one that starts at the cast holds the logits, more than one that
    # starts at the final norm or the loss: a gap in the starts that fit, which the step-time search cannot see.
    assert make_plan(blocks, cfg.with_overrides(memory_cap_gib=least * 1.001 / GIB)).ok


def test_recompute_layer_is_read_strictly_and_offered_as_a_fix_with_its_peak():
    import yaml

    from nanotron_ext.config import config_from_dict

    raw = yaml.safe_load(bundled_config("llama_3_8b.yaml").read_text())
    raw["parallelism"]["recompute_layer"] = "yes"
    with pytest.raises(ConfigError, match=r"parallelism.recompute_layer='yes' must be true or false"):
        config_from_dict(raw)
    raw["parallelism"]["recompute_layer"] = True
    again = config_from_dict(raw)
    assert again.run.recompute_layer
    blocks = inventory_from_config(again)
    # Each decoder layer keeps its input: stage 0 of Nanotron's split (107 GiB without) falls well under 80 GB.
    stage = make_plan(blocks, again, "nanotron").stages[0]
    assert (
        stage.memory.activations
        < 0.2
        * make_plan(blocks, load_config(bundled_config("llama_3_8b.yaml")), "nanotron").stages[0].memory.activations
    )
