"""What calibration's timings of the process group mean: the layout of ranks they are taken in (:class:`_World`), and
their fit into links and collectives (:func:`_fit_comm`, :func:`fit_line`), plain arithmetic on what
:mod:`nanotron_ext.machine.calibrate_comm` timed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nanotron_ext.config import PlannerConfig
from nanotron_ext.errors import ConfigError
from nanotron_ext.machine.profile import Collective, Link

__all__ = ["fit_line"]


@dataclass(frozen=True)
class _World:
    """This rank in Nanotron's layout: global rank ``(stage · dp + dp_rank) · tp + tp_rank``."""

    rank: int
    pp: int
    dp: int
    tp: int

    @classmethod
    def current(cls, cfg: PlannerConfig) -> _World | None:
        """The initialised process group as a layout of ``cfg``, or None without one.

        Raises:
            ConfigError: the world size is not ``pp × dp × tp``.
        """
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return None
        r, size = cfg.run, dist.get_world_size()
        need = r.pp * r.dp * r.tp
        if size != need:
            raise ConfigError(
                f"calibrate: torch.distributed's world size is {size}, but {cfg.source} needs pp*dp*tp = "
                f"{r.pp}*{r.dp}*{r.tp} = {need} ranks, so that every link and gradient sync is the run's own. "
                f"Launch {need} ranks (torchrun --nproc_per_node={need}), or run calibrate without torchrun to "
                f"measure the compute alone"
            )
        return cls(dist.get_rank(), r.pp, r.dp, r.tp)

    def rank_of(self, stage: int, dp_rank: int = 0, tp_rank: int = 0) -> int:
        return (stage * self.dp + dp_rank) * self.tp + tp_rank

    @property
    def coords(self) -> tuple[int, int, int]:
        """(stage, dp rank, tp rank) of this rank."""
        stage, rest = divmod(self.rank, self.dp * self.tp)
        return (stage, *divmod(rest, self.tp))


@dataclass(frozen=True)
class _Comm:
    """What the process group measured: links, the P2P protocol's extra seconds per transfer, the syncs."""

    links: tuple[Link, ...] = ()
    send_recv: float = 0.0
    dp_allreduce: Collective | None = None
    tied_allreduce: Collective | None = None


def _slowest(gathered: Sequence[Any], key: tuple[str, int, int]) -> dict[int, float]:
    """Per size, the largest median any rank timed for ``key``."""
    out: dict[int, float] = {}
    for mine, _ in gathered:
        for n, seconds in mine.get(key, {}).items():
            out[n] = max(out.get(n, 0.0), seconds)
    return out


def _fit_comm(gathered: Sequence[Any], world: _World, tied: bool) -> _Comm:
    """Every rank's ``(timings, P2P extra)`` fitted into links and collectives (the slowest rank per size)."""
    links = []
    for s in range(world.pp - 1):
        for src, dst in ((s, s + 1), (s + 1, s)):
            rtt = _slowest(gathered, ("link", src, dst))
            c, slope = fit_line(list(rtt), list(rtt.values()))
            spread = max(_slowest(gathered, ("link spread", src, dst)).values(), default=0.0)
            links.append(Link(src, dst, c / 2, 1.0 / slope, spread))

    def collective(name: str, n: int) -> Collective:
        t = _slowest(gathered, (name, 0, 0))
        c, slope = fit_line([2.0 * (n - 1) / n * b for b in t], list(t.values()))
        return Collective(c, 1.0 / slope)

    return _Comm(
        links=tuple(links),
        send_recv=max(extra for _, extra in gathered),
        dp_allreduce=collective("dp", world.dp) if world.dp > 1 else None,
        tied_allreduce=collective("tied", 2) if tied else None,
    )


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """``(intercept, slope)`` of ``y = a + b·x`` by least squares on relative error (each point weighted
    ``1 / y²``, so small messages fit their latency as well as large ones their bandwidth).

    The intercept is kept within ``[0, min(y)]``. Where time did not grow with size (no positive slope) the
    data shows no bandwidth: then ``(min(y), max(y) / max(x))``, a bandwidth no better than the largest message
    alone proves.
    """
    ys = [max(y, 1e-12) for y in ys]
    w = [1.0 / y**2 for y in ys]
    s, sx, sy = sum(w), sum(wi * x for wi, x in zip(w, xs)), sum(wi * y for wi, y in zip(w, ys))
    sxx = sum(wi * x * x for wi, x in zip(w, xs))
    sxy = sum(wi * x * y for wi, x, y in zip(w, xs, ys))
    det = s * sxx - sx * sx
    slope = (s * sxy - sx * sy) / det if det > 0 else 0.0
    intercept = (sy - slope * sx) / s
    if not slope > 0:
        return min(ys), max(ys) / max(xs)
    return min(max(intercept, 0.0), min(ys)), slope
