"""``nanotron-ext train`` end to end, as real processes (issue 3's "Must show").

The bundled tiny large-vocab example at pp=2: Nanotron's own split cannot train and every rank says so within
seconds; ``constrained`` trains with both engines at dp=1 and dp=2; pp=1 and pp=2 give the same losses; the
run's block→rank map is the one ``nanotron-ext plan --json`` prints; bad inputs fail on every rank with a
clear message. Each launch has a hard timeout (see ``train_workers``). The documented run (1f1b through torchrun)
is the quick run's end-to-end test of the CPU runtime: the quick run launches it alone; the other runs are slow.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import yaml

from nanotron_ext.cli import main

from . import train_workers as tw

STEPS = 20
ERROR_PREFIX = "nanotron-ext train: error on rank {rank}: "


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def assert_every_rank_failed(launch: tw.Launch, code: int, *needles: str) -> None:
    """Every rank exited with ``code`` (none hung) and printed our prefixed message containing ``needles``."""
    assert not any(r.timed_out for r in launch.ranks), launch.describe()
    for r in launch.ranks:
        assert r.returncode == code, launch.describe()
        assert ERROR_PREFIX.format(rank=r.rank) in r.stderr, launch.describe()
        for needle in needles:
            assert needle in r.stderr, f"{needle!r} missing on rank {r.rank}:\n{r.stderr}"
        assert "Traceback" not in r.stderr, "a user error must not print a stack trace"


@pytest.fixture(scope="module")
def configs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("configs")
    return {
        "1f1b": tw.TINY_YAML,
        "afab": tw.write_config(d / "afab.yaml", {"parallelism": {"pp_engine": "afab"}}),
        "1f1b_dp2": tw.write_config(d / "dp2.yaml", {"parallelism": {"dp": 2}}),
        "afab_dp2": tw.write_config(d / "afab_dp2.yaml", {"parallelism": {"dp": 2, "pp_engine": "afab"}}),
        "pp1": tw.write_config(d / "pp1.yaml", {"parallelism": {"pp": 1}}),
        "zbv": tw.write_config(d / "zbv.yaml", {"parallelism": {"pp_engine": "zbv"}}),
    }


#: How each successful training run of this module is launched.
_LAUNCHES = {
    # The documented command, through torchrun itself.
    "1f1b": lambda c: tw.torchrun(["--config-file", str(c["1f1b"]), "--steps", str(STEPS)], 2, timeout=120),
    "afab": lambda c: tw.launch_ranks(["--config-file", str(c["afab"]), "--steps", str(STEPS)], 2, timeout=120),
    "1f1b_dp2": lambda c: tw.launch_ranks(["--config-file", str(c["1f1b_dp2"]), "--steps", str(STEPS)], 4, timeout=150),
    "afab_dp2": lambda c: tw.launch_ranks(["--config-file", str(c["afab_dp2"]), "--steps", str(STEPS)], 4, timeout=150),
    # One process, no launcher at all (dp = pp = tp = 1 needs none). Same step count as the pp=2 run: the LR
    # schedule's decay spans the whole run.
    "pp1": lambda c: tw.launch_ranks(
        ["--config-file", str(c["pp1"]), "--steps", str(STEPS)], 1, timeout=90, torchrun_env=False
    ),
    "zbv": lambda c: tw.launch_ranks(["--config-file", str(c["zbv"]), "--steps", str(STEPS)], 2, timeout=120),
}


class _Runs(dict):
    """Every successful training run of this module, each launched once, when a test first asks for it (the quick
    run's tests ask for the documented one alone)."""

    def __init__(self, configs: dict[str, Path]) -> None:
        super().__init__()
        self.configs = configs

    def __missing__(self, name: str) -> tw.Launch:
        launch = _LAUNCHES[name](self.configs)
        assert launch.ok and launch.metrics is not None, f"{name}:\n{launch.describe()}"
        self[name] = launch
        return launch


@pytest.fixture(scope="module")
def runs(configs: dict[str, Path]) -> _Runs:
    return _Runs(configs)


# --- Nanotron's own split fails fast, everywhere ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("dp", [1, 2])
def test_nanotron_strategy_fails_on_every_rank(tmp_path: Path, dp: int) -> None:
    config = tw.write_config(tmp_path / "c.yaml", {"parallelism": {"dp": dp}})
    launch = tw.launch_ranks(
        ["--config-file", str(config), "--cost-strategy", "nanotron"], 2 * dp, timeout=60, outputs=False
    )
    assert_every_rank_failed(
        launch,
        1,
        "the 'nanotron' plan for pp=2 cannot train; nothing was allocated",
        "stage 1 holds no parameters (cast, loss)",
        "--cost-strategy constrained",
    )


@pytest.mark.slow
def test_nan_loss_stops_with_its_step(tmp_path: Path) -> None:
    """A learning rate of 1e30 in a 1-process run: the weights blow up, the loss turns NaN, the run stops."""
    c = tw.write_config(tmp_path / "nan.yaml", {"parallelism": {"pp": 1}, **tw.constant_lr(1e30)})
    launch = tw.launch_ranks(
        ["--config-file", str(c), "--steps", "6"], 1, timeout=90, torchrun_env=False, outputs=False
    )
    run = launch.ranks[0]
    assert not run.timed_out and run.returncode == 1, launch.describe()
    # The last line is the error; the step lines before it are finite until then.
    assert re.fullmatch(
        r"nanotron-ext train: error on rank 0: loss is nan at step [2-6]; lower the learning rate",
        run.stderr.strip().splitlines()[-1],
    ), run.stderr
    failed_at = int(run.stderr.strip().split("at step ")[-1].split(";")[0])
    steps = [line for line in run.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == failed_at - 1 and "loss nan" not in run.stdout


@pytest.mark.slow
def test_nanotron_strategy_fails_under_torchrun() -> None:
    launch = tw.torchrun(["--cost-strategy", "nanotron"], 2, timeout=60)
    run = launch.ranks[0]
    assert not run.timed_out and run.returncode != 0, launch.describe()
    # torchrun stops the other worker once one fails, so at least one rank's message is guaranteed.
    assert "nanotron-ext train: error on rank" in run.stderr and "stage 1 holds no parameters" in run.stderr
    assert launch.metrics is None


# --- constrained trains -------------------------------------------------------------------------------------


# The documented run (1f1b, through torchrun) is the quick run's end-to-end test of the CPU runtime.
@pytest.mark.parametrize(
    "name", ["1f1b", *(pytest.param(name, marks=pytest.mark.slow) for name in ("afab", "1f1b_dp2", "afab_dp2"))]
)
def test_constrained_trains_and_loss_falls(runs: dict[str, tw.Launch], name: str) -> None:
    m = runs[name].metrics
    engine, dp = name.split("_")[0], 2 if name.endswith("dp2") else 1
    assert (m["engine"], m["dp"], m["pp"], m["strategy"]) == (engine, dp, 2, "constrained")
    losses = m["losses"]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    assert losses[0] == pytest.approx(math.log(50277), rel=0.01)  # near-uniform start
    assert _mean(losses[-3:]) < _mean(losses[:3]) - 0.3, losses
    # Every rank logged the same loss and the same clipped gradient norm.
    for r in m["ranks"]:
        assert r["losses"] == losses and r["grad_norms"] == m["grad_norms"]
        assert r["trainable"] > 0 and r["has_optimizer"] and r["is_ddp"] == (dp > 1)
    assert len(m["step_times_s"]) == STEPS and all(t > 0 for t in m["tokens_per_s"])
    assert m["tokens_per_step"] == dp * 4 * 2 * 32


@pytest.mark.slow
def test_engines_agree(runs: dict[str, tw.Launch]) -> None:
    for dp in ("", "_dp2"):
        a, b = runs["1f1b" + dp].metrics["losses"], runs["afab" + dp].metrics["losses"]
        assert all(_rel(x, y) < 1e-5 for x, y in zip(a, b)), (a, b)


@pytest.mark.slow
def test_zbv_trains_its_v_plan_to_1f1bs_losses_and_weights_bit_for_bit(runs: dict[str, tw.Launch]) -> None:
    """``pp_engine: zbv``: the V plan's two chunks per rank, run in the plan's order, give 1F1B's run (on its own
    contiguous split) exactly: every loss, and every parameter after 20 steps."""
    v, ref = runs["zbv"].metrics, runs["1f1b"].metrics
    assert (v["engine"], v["strategy"], v["block_ranks"]) == ("zbv", "v-search", [0, 1, 1, 1, 0, 0, 0])
    assert ref["block_ranks"] != v["block_ranks"]
    assert v["losses"] == ref["losses"]

    def after(m: dict) -> dict[str, str]:
        return {name: c["sha256_after"] for r in m["ranks"] for name, c in r["checksums"].items()}

    assert after(v) == after(ref) and len(after(v)) == 15
    assert {name: c["sha256"] for r in v["ranks"] for name, c in r["checksums"].items()} != after(v)  # it trained
    out = runs["zbv"].ranks[0].stdout
    assert re.search(r"0  0: embedding\s+3: lm_head, cast, loss", out), out
    assert "block -> rank: [0, 1, 1, 1, 0, 0, 0]; virtual stage: [0, 1, 1, 2, 3, 3, 3]" in out


@pytest.mark.slow
def test_rank0_prints_progress_and_summary(runs: dict[str, tw.Launch]) -> None:
    out = runs["afab"].ranks[0].stdout
    assert "step 20/20  loss " in out and "tokens/s" in out and "grad-norm" in out
    assert "summary" in out and "loss, last 3 steps (mean)" in out
    assert "block -> stage: [0, 0, 0, 0, 1, 1, 1]" in out
    assert runs["afab"].ranks[1].stdout == "", "only rank 0 prints"


@pytest.mark.slow
def test_pp1_and_pp2_losses_are_equal(runs: dict[str, tw.Launch]) -> None:
    """Same config, seed and data: the pipeline split does not change the numbers (fp32 tolerance)."""
    pp1, pp2 = runs["pp1"].metrics["losses"][:5], runs["1f1b"].metrics["losses"][:5]
    assert runs["pp1"].metrics["pp"] == 1
    assert all(_rel(a, b) < 1e-5 for a, b in zip(pp2, pp1)), (pp1, pp2)


def test_block_map_matches_plan_json(runs: dict[str, tw.Launch], configs: dict[str, Path], capsys) -> None:
    assert main(["plan", str(configs["1f1b"]), "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    launch = runs["1f1b"]
    # plan --json adds the plan's simulated step and bubble and the best valid split's slowest stage, which the
    # run's --plan-out has no use for
    simulated = {k: planned.pop(k) for k in ("simulated_step_time", "bubble_fraction", "best_valid_flops")}
    assert all(v is not None for v in simulated.values())
    assert launch.plan == planned, "the plan the run built must be the one `plan --json` prints"
    m = launch.metrics
    assert m["block_names"] == planned["block_names"] and m["block_ranks"] == planned["block_ranks"]
    assert m["block_to_rank"] == dict(zip(planned["block_names"], planned["block_ranks"]))
    # Each rank holds exactly its planned blocks.
    for r in m["ranks"]:
        assert r["blocks"] == [n for n, k in m["block_to_rank"].items() if k == r["pp_rank"]]


# --- bad input: a clear error on every rank, non-zero exit, no hang ----------------------------------------


def _bad_yaml(tmp_path: Path, kind: str) -> tuple[list[str], int, tuple[str, ...]]:
    """(train arguments, world size, expected message parts) for one kind of bad input."""
    if kind == "world_size":
        return (
            ["--config-file", str(tw.TINY_YAML)],
            3,
            ("WORLD_SIZE=3 but", "dp×pp×tp = 1×2×1 = 2", "--nproc_per_node=2"),
        )
    if kind == "few_micro_batches":
        c = tw.write_config(
            tmp_path / "m.yaml", {"parallelism": {"pp": 4}, "tokens": {"batch_accumulation_per_replica": 2}}
        )
        return ["--config-file", str(c)], 4, ("needs at least pp - 1 = 3 micro-batches", "got 2", "pp_engine: afab")
    if kind == "unknown_strategy":
        return (
            ["--config-file", str(tw.TINY_YAML), "--cost-strategy", "bogus"],
            2,
            ("unknown cost strategy 'bogus'", "known strategies: nanotron"),
        )
    if kind == "missing_data":
        c = tw.write_config(
            tmp_path / "d.yaml", {"data": {"dataset": {"hf_dataset_or_datasets": "no/such/corpus.txt"}}}
        )
        return ["--config-file", str(c)], 2, ("data file 'no/such/corpus.txt'", "does not exist", "data.dataset: null")
    if kind == "malformed_yaml":
        c = tmp_path / "bad.yaml"
        c.write_text(tw.TINY_YAML.read_text().replace("  dp: 1\n", "  dp: [1\n", 1))
        return ["--config-file", str(c)], 2, ("malformed YAML", str(c))
    if kind == "no_torchrun":
        return ["--config-file", str(tw.TINY_YAML)], 1, ("launch them with torchrun", "--nproc_per_node=2")
    raise AssertionError(kind)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kind", ["world_size", "few_micro_batches", "unknown_strategy", "missing_data", "malformed_yaml", "no_torchrun"]
)
def test_bad_input_fails_on_every_rank(tmp_path: Path, kind: str) -> None:
    args, world, needles = _bad_yaml(tmp_path, kind)
    launch = tw.launch_ranks(args, world, timeout=60, outputs=False, torchrun_env=kind != "no_torchrun")
    assert_every_rank_failed(launch, 2, *needles)


@pytest.mark.slow
def test_one_f_one_b_with_pp_minus_one_micro_batches_warns_and_trains(tmp_path: Path) -> None:
    """m = pp - 1 under 1F1B: Nanotron's engine accepts it (it asserts m >= pp - 1), so the run trains, and
    rank 0 warns that the pipeline never fills."""
    c = tw.write_config(tmp_path / "m1.yaml", {"tokens": {"batch_accumulation_per_replica": 1}})
    launch = tw.launch_ranks(["--config-file", str(c), "--steps", "2"], 2, timeout=90)
    assert launch.ok, launch.describe()
    assert "WARNING [plan] 1F1B with 1 micro-batches on 2 stages" in launch.ranks[0].stdout
    assert "never fills" in launch.ranks[0].stdout
    assert len(launch.metrics["losses"]) == 2 and launch.metrics["n_micro_batches"] == 1


# --- data: byte tokenizer, local text files, packing, DP shards (in-process) -------------------------------


@pytest.fixture(scope="module")
def windows():
    from nanotron_ext.runtime.data import bundled_corpus, load_packed_windows

    return load_packed_windows([bundled_corpus()], 32)


def test_byte_tokenizer_round_trip() -> None:
    from nanotron_ext.errors import ConfigError
    from nanotron_ext.runtime.data import ByteTokenizer

    tok = ByteTokenizer()
    ids = tok.encode("pipeline → stage", add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and max(ids[1:-1]) < 256
    assert tok.decode(ids) == "pipeline → stage"
    assert tok.vocab_size == 259
    tok.check_model_vocab(50277)
    with pytest.raises(ConfigError, match="vocab_size=100 is smaller"):
        tok.check_model_vocab(100)


def test_packed_windows_are_deterministic_and_dp_shards_disjoint(windows) -> None:
    from nanotron_ext.runtime.data import PackedTextData

    assert windows.shape[1] == 33 and len(windows) > 1000
    shards = [PackedTextData(windows, 2, dp_rank=r, dp_size=2, seed=7) for r in range(2)]
    for epoch in (0, 1):
        a, b = (set(s.shard_indices(epoch).tolist()) for s in shards)
        assert not a & b and len(a) == len(b) == len(windows) // 2
    first = next(iter(PackedTextData(windows, 2, seed=7)))
    again = next(iter(PackedTextData(windows, 2, seed=7)))
    other = next(iter(PackedTextData(windows, 2, seed=8)))
    assert all((x == y).all() for x, y in zip(first, again))
    assert not (first[0] == other[0]).all()
    inputs, labels = first
    assert inputs.shape == labels.shape == (2, 32)
    assert (inputs[:, 1:] == labels[:, :-1]).all(), "labels are the inputs shifted by one token"


def test_data_files_from_config(tmp_path: Path) -> None:
    from nanotron_ext.errors import ConfigError
    from nanotron_ext.runtime.data import bundled_corpus, data_files_from_config

    assert data_files_from_config({"data": {"dataset": None}}) == [bundled_corpus()]
    assert data_files_from_config({}) == [bundled_corpus()]
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name in ("b.txt", "a.txt", "skip.md"):
        (folder / name).write_text("some text\n")
    config = tmp_path / "run.yaml"
    # Relative paths are found next to the YAML when not under the working directory.
    raw = {"data": {"dataset": {"hf_dataset_or_datasets": "corpus"}}}
    assert data_files_from_config(raw, config_path=config) == [folder / "a.txt", folder / "b.txt"]
    raw = {"data": {"dataset": {"hf_dataset_or_datasets": [str(folder / "b.txt")]}}}
    assert data_files_from_config(raw) == [folder / "b.txt"]
    with pytest.raises(ConfigError, match="data file 'missing.txt' .* does not exist"):
        data_files_from_config({"data": {"dataset": {"hf_dataset_or_datasets": "missing.txt"}}}, config_path=config)
    with pytest.raises(ConfigError, match="local text files only"):
        data_files_from_config({"data": {"dataset": {"hf_dataset_or_datasets": {"a": 0.5, "b": 0.5}}}})
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="holds no .txt file"):
        data_files_from_config({"data": {"dataset": {"hf_dataset_or_datasets": str(tmp_path / "empty")}}})


@pytest.mark.slow
def test_a_current_upstream_config_trains_on_the_cpu_runtime(tmp_path: Path) -> None:
    """Upstream main's config_tiny_llama.yaml, shrunk: its new sections and keys are read, not refused."""
    from upstream.harness import UPSTREAM_EXAMPLES

    raw = yaml.safe_load((UPSTREAM_EXAMPLES / "config_tiny_llama.yaml").read_text())
    raw["model"]["model_config"].update(
        hidden_size=16,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=300,
        tie_word_embeddings=False,
        attention_bias=False,
        z_loss_enabled=False,
    )
    raw["parallelism"].update(dp=1, pp=1, tp=1)
    raw["tokens"].update(sequence_length=32, micro_batch_size=2, batch_accumulation_per_replica=2)
    c = tmp_path / "upstream_tiny.yaml"
    c.write_text(yaml.safe_dump(raw))
    launch = tw.launch_ranks(["--config-file", str(c), "--steps", "2"], 1, timeout=90, torchrun_env=False)
    run = launch.ranks[0]
    assert run.returncode == 0, launch.describe()
    assert len(launch.metrics["losses"]) == 2 and all(math.isfinite(x) for x in launch.metrics["losses"])
    notes = [line for line in run.stdout.splitlines() if line.startswith("note: ")]
    # Keys only upstream's LlamaConfig has; upstream's tp_linear_async_communication: true; its data_stages.
    assert "note: model.model_config keys the CPU trainer does not use: attention_bias, z_loss_enabled" in notes
    assert any(line.startswith("note: parallelism.tp_linear_async_communication ignored") for line in notes)
    assert any("data_stages (upstream main's data section) is not read" in line for line in notes), run.stdout
