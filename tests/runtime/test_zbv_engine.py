"""``ZeroBubbleVPipelineEngine`` (``nanotron_ext.zero_bubble.v_engine``): ZB-V on a V against Nanotron's own 1F1B
on a contiguous split, in real gloo processes.

Same model, weights and data under both, two optimizer steps each: the losses and every parameter gradient of the
whole model (gathered from every PP rank, since the two place the blocks differently) must be bit-identical,
and W steps must have applied deferred products (an engine that deferred nothing could not pass by being 1F1B).
"""

from __future__ import annotations

import pytest

from . import zbv_workers
from .spawn import run_distributed

pytestmark = pytest.mark.slow  # tests/conftest.py: left out of the quick run

# embedding | decoder.0 | decoder.1 | final norm, lm_head, cast, loss: rank 0 holds the first chunk and the last.
V2 = [0, 1, 2, 3, 3, 3, 3]
PP2 = [0, 0, 1, 1, 1, 1, 1]
TWO_RANKS = {
    "pp2": {"pp": 2, "v_stages": V2, "ref_ranks": PP2},
    # decoder.0 and decoder.1 both on the V's bottom (rank 1): the two chunks meet on one rank.
    "bottom": {"pp": 2, "v_stages": [0, 0, 1, 2, 3, 3, 3], "ref_ranks": PP2},
    # The first chunk wholly frozen, the V's bottom half frozen: frozen weights get no W and no gradient.
    "frozen": {
        "pp": 2,
        "v_stages": V2,
        "ref_ranks": PP2,
        "freeze": "token_position_embeddings,decoder.0,decoder.1.pp_block.mlp",
    },
    # As "frozen", the sends held to their order (sends_wait): the gradients a frozen chunk never sends or takes
    # must not hold the sends after them.
    "frozen_held": {
        "pp": 2,
        "v_stages": V2,
        "ref_ranks": PP2,
        "sends_wait": True,
        "freeze": "token_position_embeddings,decoder.0,decoder.1.pp_block.mlp",
    },
    # Tied embeddings: in a V both ends are on rank 0, one tensor used by its two chunks.
    "tied": {
        "pp": 2,
        "v_stages": V2,
        "ref_ranks": PP2,
        "config": {"tie_word_embeddings": True},
        "aliases": {"model.lm_head.pp_block.weight": "model.token_position_embeddings.pp_block.token_embedding.weight"},
    },
    # Three vocabulary shards, all in rank 0's second chunk with the loss.
    "vocab_chain": {
        "pp": 2,
        "v_stages": V2,
        "ref_ranks": [0, 0, 0, 0, 0, 1, 1],
        "vocab_shards": 3,
        "config": {"vocab_size": 1009},
    },
    # A failed step's products left in the store: the next step starts with none of them.
    "after_failed_step": {"pp": 2, "v_stages": V2, "ref_ranks": PP2, "after_failed_step": True},
}
FIVE_LAYERS = {"num_hidden_layers": 5}
FOUR_RANKS = {
    "pp4": {
        "pp": 4,
        "v_stages": [0, 1, 2, 3, 4, 5, 6, 7, 7, 7],
        "ref_ranks": [0, 0, 1, 1, 2, 2, 3, 3, 3, 3],
        "config": FIVE_LAYERS,
        "n_micro": 8,
    },
    "dp2_pp2": {"pp": 2, "dp": 2, "v_stages": V2, "ref_ranks": PP2},
    "tp2_pp2": {"pp": 2, "tp": 2, "v_stages": V2, "ref_ranks": PP2, "config": {"vocab_size": 50278}},
}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    return run_distributed(zbv_workers.compare_v, 2, args=(TWO_RANKS,), timeout=180)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict]:
    return run_distributed(zbv_workers.compare_v, 4, args=(FOUR_RANKS,), timeout=270)


#: Where the V cannot be bit-identical: a tied weight's two ends on one rank add their parts micro-batch by
#: micro-batch, where a contiguous split sums each end's and then all-reduces the two (another order of fp32 sums).
ROUNDING = {"tied": 1e-5}


def _check(results: list[dict], name: str) -> None:
    for res in results:
        out = res[name]
        assert "error" not in out, (name, res["rank"], out.get("error"))
        assert out["steps"] == 2
        assert out["zb_losses"] == out["losses"], (name, res["rank"])  # bit-identical
        assert out["grad_rel"] <= ROUNDING.get(name, 0.0), (name, res["rank"], out["grad_rel"])
    assert any(sum(res[name]["popped"]) > 0 for res in results), name


@pytest.mark.parametrize("name", sorted(TWO_RANKS))
def test_zbv_equals_1f1b_two_ranks(two_ranks: list[dict], name: str) -> None:
    _check(two_ranks, name)


@pytest.mark.parametrize("name", sorted(FOUR_RANKS))
def test_zbv_equals_1f1b_four_ranks(four_ranks: list[dict], name: str) -> None:
    _check(four_ranks, name)


def test_each_chunk_defers_only_its_own_linears_even_where_both_meet_on_one_rank(two_ranks: list[dict]) -> None:
    """Each W pops the products of its own chunk's linears. At the V's bottom (rank 1 in ``bottom``: decoder.1, then
    the final norm) the up chunk's B stops where the down chunk's output entered it, so decoder.1's four linears land
    in the down chunk's W and the norm's W gets none; the loss chunk defers the lm_head (one), the first chunk
    decoder.0's four."""
    linears = {0: 4, 1: 4, 2: 0, 3: 1}
    for res in two_ranks:
        out = res["bottom"]
        weights = [op for op in out["trace"] if op.startswith("W")]
        expected = [linears[int(op.split("@")[1])] for op in weights]
        assert out["popped"] == expected * 2, res["rank"]  # two steps, the same order


#: A V of 2 pp chunks over the tiny model: pp = 2 on 2 layers, 3 on 4, 4 on 5 (the loss chunk ends on rank 0).
FAMILY = {
    2: ({}, V2),
    3: ({"num_hidden_layers": 4}, [0, 1, 2, 3, 4, 5, 5, 5, 5]),
    4: (FIVE_LAYERS, [0, 1, 2, 3, 4, 5, 6, 7, 7, 7]),
}


@pytest.mark.parametrize("pp", sorted(FAMILY))
def test_every_zbv_order_runs_to_completion_and_each_receive_gets_what_its_peer_sent(pp: int) -> None:
    """The V's order runs on Nanotron's machinery over gloo without a deadlock, op by op as ``zbv_order`` says;
    between two ranks the k-th receive of a tag gets the k-th send of that tag (its size). Where each send waits
    until its receive is done, as Nanotron's does on a GPU (``sends_wait``), the engine holds its sends to their
    order (``transfer_order``): at m = 1, 2, pp, pp + 1, 2·pp and 2·pp + 1 (one micro-batch, a short pipeline, a
    full one, a long one). Posted as soon as made (the CPU runtime's way; m = 1, 2 and 2·pp + 1 here, and every
    exactness test), the same transfers, replayed under that rule, deadlock from m = 2 (every m up to 3·pp without
    processes: ``tests/test_v_replay.py``)."""
    from nanotron_ext.schedule.zbv import zbv_order

    config, stages = FAMILY[pp]
    held = sorted({1, 2, pp, pp + 1, 2 * pp, 2 * pp + 1})
    cases = {
        f"m{m}{'_wait' * wait}": {"pp": pp, "config": config, "v_stages": stages, "n_micro": m, "sends_wait": wait}
        for wait, ms in ((False, (1, 2, 2 * pp + 1)), (True, held))
        for m in ms
    }
    ranks = sorted(run_distributed(zbv_workers.run_orders, pp, args=(cases,), timeout=240), key=lambda r: r["rank"])
    for name, case in cases.items():
        order = zbv_order(pp, case["n_micro"])
        for res in ranks:
            out = res[name]
            assert out["trace"] == [tuple(op) for op in order[out["pp_rank"]]], (name, out["pp_rank"])
        for a in ranks:
            for b in ranks:
                if a is b:
                    continue
                me, peer = a[name]["pp_rank"], b[name]["pp_rank"]
                for tag in (1, 2):
                    sends = [n for kind, t, to, n in a[name]["transfers"] if (kind, t, to) == ("send", tag, peer)]
                    recvs = [n for kind, t, frm, n in b[name]["transfers"] if (kind, t, frm) == ("recv", tag, me)]
                    assert sends == recvs, (name, me, peer, tag)
        assert any(t for res in ranks for t in res[name]["transfers"])
        by_rank = [r[name]["transfers"] for r in sorted(ranks, key=lambda r: r[name]["pp_rank"])]
        stuck = _stuck_when_sends_wait(by_rank)
        if case["sends_wait"]:
            assert stuck is None, (name, stuck)  # and it ran so: each send waited for its receipt
        else:  # why the engine holds its sends where they wait
            assert (stuck is None) == (case["n_micro"] == 1), (name, stuck)
            if stuck is not None:
                assert any(kind == "send" and tag == 1 for kind, tag, _ in stuck), (name, stuck)


def _stuck_when_sends_wait(transfers: list[list[tuple[str, int, int, int]]]) -> list[tuple[str, int, int]] | None:
    """Replay each PP rank's transfers (kind, tag, peer, size, in the order it made them) where a send waits until
    its receive is posted and a receive until its send is: None when every rank finishes, else what each waits on
    (kind, tag, peer). The k-th send of a tag from a to b is the k-th receive of that tag at b from a."""
    keys = []
    for me, ops in enumerate(transfers):
        seen: dict[tuple, int] = {}
        mine = []
        for kind, tag, peer, _ in ops:
            link = (tag, me, peer) if kind == "send" else (tag, peer, me)
            seen[kind, link] = seen.get((kind, link), 0) + 1
            mine.append((kind, (link, seen[kind, link]), tag, peer))
        keys.append(mine)
    pos, posted = [0] * len(keys), {"send": set(), "recv": set()}
    while any(p < len(k) for p, k in zip(pos, keys)):
        moved = False
        for r, mine in enumerate(keys):
            while pos[r] < len(mine):
                kind, key, _, _ = mine[pos[r]]
                posted[kind].add(key)
                if key not in posted["recv" if kind == "send" else "send"]:
                    break
                pos[r] += 1
                moved = True
        if not moved:
            return [(mine[p][0], mine[p][2], mine[p][3]) for p, mine in zip(pos, keys) if p < len(mine)]
    return None


def test_a_model_without_a_v_is_refused_on_every_rank_before_any_work() -> None:
    for message in run_distributed(zbv_workers.zbv_on_a_contiguous_split, 2, timeout=120):
        assert "pp_engine zbv runs a V: each block needs its virtual stage of a V over pp=2" in message
        assert "Plan a V split, or use pp_engine zb1p" in message
