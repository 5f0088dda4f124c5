"""Sniff tests inside the job: a fixed GEMM timed on each rank's device and a small all-reduce
over the default group, run from ``tg.step()`` within a time budget (``[fleet] sniff_*``).

Every rank must run the all-reduce at the same step, so the steps are agreed, never read off
each rank's clock: the first sniff, ``_FIRST_STEP`` steps after the first, warms the GEMM (its time sizes the
wait for the next one, so that the budget holds from the first measured sniff on) and agrees
the next sniff step; every sniff's all-reduce carries each rank's proposal for the next sniff
step (``MAX``-reduced: the most conservative rank wins). A rank proposes the step at which
``sniff_interval_s`` has passed and the time spent in sniffs stays within three quarters of
``sniff_budget`` of the time since its first step, at its current seconds per step. Without
``torch.distributed`` (or with one rank) the GEMM runs on the rank's own clock.

Confirming sniffs: the same all-reduce carries every rank's GEMM time (groups of up to
8192 ranks), so every rank sees at once whether one of them looked slow (its time over the
others' median, ``sniff_slow_factor`` times its usual standing among them) and all agree to
run ``sniff_window - 1`` more sniffs ``sniff_interval_s / 3`` apart, while the whole budget
allows: the agent's judge then has a full window of fresh sniffs within seconds rather than
``sniff_window`` intervals, and a noisy machine's one-off outlier costs a few cheap sniffs,
not a flag.

A sniff's cost is its wall time, the wait for the slowest rank included (everyone waits for
it). That wait is known only once the all-reduce ends, so the timed payload all-reduce that
follows carries the agreement again with it counted, and the next sniff is estimated to cost
the larger of the last one and this one: a sniff that waited long on a throttled peer
refuses the next confirming one. What no rank can foresee is the wait of the sniff under way,
so the share may pass the budget by at most that one sniff.

Each sniff appends a ``sniff`` record to the rank's metrics (``gemm_s``: one timed GEMM after a warm one
on the first sniff: the judge wants ``sniff_patience`` slow sniffs in a row, so a single
outlier is not a flag, and a sniff this cheap can run often within the budget), ``allreduce_s``, ``sniff_s``: the wall time of the whole sniff,
``overhead``: sniff time / time since the first step): the agent judges them
(:mod:`trainguard.fleet.sniff`).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from trainguard.core.config.fleet import FleetConfig

if TYPE_CHECKING:
    import torch

__all__ = ["SniffRunner"]

logger = logging.getLogger(__name__)

_FIRST_STEP = 3
"""Step of the first (agreement-only) sniff: after the first steps' start-up costs."""
_GEMM_RUNS = 1
_NORMAL_SHARE = 0.75
"""Share of ``sniff_budget`` the regular sniffs keep to; the rest pays for confirming ones."""
_MAX_GATHER = 8192
"""Largest group whose GEMM times every sniff's all-reduce carries (confirming sniffs)."""
_STANDING = 10
"""Sniffs of a rank's standing among the others a suspicion is judged against."""


def device_model(dev: torch.device) -> str:
    import torch

    if dev.type == "cuda":
        return str(torch.cuda.get_device_name(dev))
    return "cpu"


class SniffRunner:
    """One rank's sniff tests (created by ``tg.step()`` when ``sniff_interval_s > 0``)."""

    def __init__(self, cfg: FleetConfig, *, rank: int, write: Callable[[dict[str, Any]], None],
                 base: dict[str, Any]) -> None:  # fmt: skip
        self.cfg = cfg
        self.rank = rank
        self._write = write
        self._base = base
        self.next_step = _FIRST_STEP
        self.generation = 0
        self.t_first: float | None = None
        self.steps_since_first = 0
        self.spent_s = 0.0
        self.last_cost_s = 0.0
        self.sniffs = 0
        self._next_time = 0.0  # without collectives
        self._mats: tuple[Any, Any] | None = None
        self._failed = False
        self._standing: dict[int, list[float]] = {}
        """Each rank's last GEMM times over the others' median (all ranks see the same)."""
        self.confirming = 0
        """Confirming sniffs still to run (a rank looked slow)."""
        self._next_confirms = False

    # -- scheduling ----------------------------------------------------------------------------
    def proposal(self, step: int, now: float, pending: float = 0.0) -> int:
        """The step this rank proposes for the next sniff (after ``step``, at ``now``;
        ``pending``: the time of the sniff under way so far)."""
        assert self.t_first is not None
        elapsed = max(now - self.t_first, 1e-9)
        per_step = elapsed / max(self.steps_since_first, 1)
        # the budget holds at the next sniff if (spent + its cost) <= budget * elapsed then;
        # regular sniffs keep to a share of it, the rest is for confirming sniffs
        spent = self.spent_s + pending + max(self.last_cost_s, pending)
        budget_at = spent / (self.cfg.sniff_budget * _NORMAL_SHARE)
        wait_s = max(self.cfg.sniff_interval_s, budget_at - elapsed)
        return step + max(1, math.ceil(wait_s / per_step - 1e-9))

    def confirm_proposal(self, step: int, now: float, pending: float = 0.0) -> tuple[int, bool]:
        """(the step of a confirming sniff after ``step``, whether the whole budget allows it
        then): ``sniff_interval_s / 3`` later."""
        assert self.t_first is not None
        elapsed = max(now - self.t_first, 1e-9)
        per_step = elapsed / max(self.steps_since_first, 1)
        wait_s = self.cfg.sniff_interval_s / 3
        spent = self.spent_s + pending + max(self.last_cost_s, pending)
        ok = spent <= self.cfg.sniff_budget * (elapsed + wait_s)
        return step + max(1, math.ceil(wait_s / per_step - 1e-9)), ok

    def suspect(self, gemms: list[float]) -> bool:
        """Whether some rank's GEMM looked slow at this sniff: its time over the median of the
        others' (``gemms``: every rank's, 0 where none) is ``sniff_slow_factor`` times its
        usual standing (the median of its last ones that were not suspect). Every rank decides
        the same from the same times; the agent's judge decides whether the rank is
        flagged."""
        valid = sorted(g for g in gemms if g > 0)
        if len(valid) < 2:
            return False
        found = False
        for r, g in enumerate(gemms):
            if g <= 0:
                continue
            if len(valid) <= 16:  # the others' median (large groups: everyone's)
                others = list(valid)
                others.remove(g)
                ref = statistics.median(others)
            else:
                ref = statistics.median(valid)
            rel = g / ref
            past = self._standing.setdefault(r, [])
            if len(past) >= 3 and rel >= self.cfg.sniff_slow_factor * statistics.median(past):
                found = True  # not its standing: a rank that stays slow stays suspect
            else:
                past.append(rel)
                del past[:-_STANDING]
        return found

    def after_step(self, step: int, generation: int = 0) -> None:
        """Called at the end of each successful step; runs a sniff when one is due. Never
        raises: a sniff that fails is logged and the sniff tests stop for this process.

        The first sniff is ``_FIRST_STEP`` steps after the first step this process (or
        in-process generation) ran: every rank of a (re)started group starts at the same
        step, restored or not, so they agree on it too."""
        if self._failed:
            return
        now = time.perf_counter()
        if generation != self.generation:  # an in-process restart: the group starts over
            self.generation, self.t_first = generation, None
            self.steps_since_first = self.sniffs = self.confirming = 0
            self.spent_s = self.last_cost_s = 0.0
            self._standing, self._next_confirms = {}, False
        if self.t_first is None:
            self.t_first = now
            self.next_step = step + _FIRST_STEP
        else:
            self.steps_since_first += 1
        dist = _dist()
        collective = dist is not None and dist.get_world_size() > 1
        if collective:
            if step < self.next_step:
                return
        elif now < self._next_time or self.steps_since_first < _FIRST_STEP:
            return
        try:
            self._sniff(step, now, dist if collective else None)
        except Exception as e:
            self._failed = True
            logger.warning("rank %d: sniff tests stopped: %s: %s", self.rank, type(e).__name__, e)

    def _agree(
        self, dist: Any, dev: Any, step: int, t0: float, gemm_s: float | None
    ) -> list[float]:
        """Gather every rank's GEMM time (suspicion) and agree the next sniff with every rank:
        [next regular sniff step, next confirming sniff step, refused]. A payload all-reduce
        that follows agrees it again, with this one's wait known (:meth:`_decide`)."""
        import torch

        # MAX-reduced: [next regular sniff, next confirming sniff, 1 where a rank's budget
        # refuses it, each rank's GEMM time in its own slot]
        world = dist.get_world_size()
        gather = world <= _MAX_GATHER
        agree = torch.zeros(3 + (world if gather else 0), dtype=torch.float64, device=dev)
        self._propose(agree, step, t0)
        if gather and gemm_s is not None:
            agree[3 + dist.get_rank()] = gemm_s
        dist.all_reduce(agree, op=dist.ReduceOp.MAX)  # also waits for every rank's GEMM
        got = agree.tolist()
        if gather and self.sniffs > 0 and self.suspect(got[3:]) and self.confirming == 0:
            self.confirming = self.cfg.sniff_window - 1  # enough for the judge's window
        return got[:3]

    def _propose(self, into: Any, step: int, t0: float) -> None:
        """This rank's proposals, in ``into[:3]``, counting the sniff under way so far."""
        t_now = time.perf_counter()
        confirm_at, ok = self.confirm_proposal(step, t_now, t_now - t0)
        into[0] = float(self.proposal(step, t_now, t_now - t0))
        into[1] = float(confirm_at)
        into[2] = 0.0 if ok else 1.0

    def _decide(self, agreed: list[float]) -> None:
        """Take the agreed next sniff: a confirming one while one is owed and every rank's
        budget allows it, else the regular one."""
        regular, confirm_at, refused = agreed
        self._next_confirms = self.confirming > 0 and refused == 0.0
        if self._next_confirms:
            self.confirming -= 1
            self.next_step = int(confirm_at)
        else:
            self.confirming = 0
            self.next_step = int(regular)

    # -- one sniff -----------------------------------------------------------------------------
    def _device(self, dist: Any) -> torch.device:
        import torch

        if (
            dist is not None
            and dist.get_backend() == "nccl"
            or (dist is None and torch.cuda.is_available() and torch.cuda.is_initialized())
        ):
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _gemm(self, dev: torch.device, runs: int = _GEMM_RUNS) -> tuple[float, int, str]:
        import torch

        cuda = dev.type == "cuda"
        n = self.cfg.sniff_gemm_size or (2048 if cuda else 512)
        if self._mats is None:
            dtype = torch.bfloat16 if cuda else torch.float32
            g = torch.Generator(device="cpu").manual_seed(1234)  # fixed work
            a = torch.randn(n, n, generator=g, dtype=torch.float32).to(dev, dtype)
            self._mats = (a, torch.randn(n, n, generator=g, dtype=torch.float32).to(dev, dtype))
            torch.matmul(*self._mats)  # warm, once
        a, b = self._mats

        def sync() -> None:
            if cuda:
                torch.cuda.synchronize(dev)

        sync()
        took = []
        for _ in range(runs):
            t0 = time.perf_counter()
            torch.matmul(a, b)
            sync()
            took.append(time.perf_counter() - t0)
        return statistics.median(took), n, str(a.dtype).removeprefix("torch.")

    def _sniff(self, step: int, now: float, dist: Any) -> None:
        import torch

        t0 = time.perf_counter()
        confirming = self._next_confirms
        dev = self._device(dist)
        first = self.sniffs == 0 and dist is not None
        gemm_s = allreduce_s = None
        n, dtype = 0, ""
        if first:  # warm the GEMM once: its time sizes the first wait (the budget holds then)
            one, _, _ = self._gemm(dev, runs=1)
            self.last_cost_s = 1.5 * _GEMM_RUNS * one  # with a margin for the all-reduce
        else:
            try:
                gemm_s, n, dtype = self._gemm(dev)
            except Exception as e:  # the all-reduce below still runs: the others wait for it
                logger.warning("rank %d: sniff GEMM failed: %s: %s", self.rank,
                               type(e).__name__, e)  # fmt: skip
        if dist is not None:
            agreed = self._agree(dist, dev, step, t0, None if first else gemm_s)
            if not first and self.cfg.sniff_allreduce_kib > 0:
                # the timed payload carries the agreement again, now that the wait for the
                # slowest rank is known: a sniff that waited long refuses the next confirming
                # one (MAX-reduced, the same bytes as a sum)
                payload = torch.ones(self.cfg.sniff_allreduce_kib * 128, dtype=torch.float64,
                                     device=dev)  # fmt: skip
                self._propose(payload, step, t0)
                t1 = time.perf_counter()
                dist.all_reduce(payload, op=dist.ReduceOp.MAX)
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                allreduce_s = time.perf_counter() - t1
                agreed = payload[:3].tolist()
            self._decide(agreed)
        cost = time.perf_counter() - t0
        self.spent_s += cost
        if not first:
            self.last_cost_s = cost
        self.sniffs += 1
        end = time.perf_counter()
        if dist is None:
            self._next_time = end + max(
                self.cfg.sniff_interval_s, self.spent_s / self.cfg.sniff_budget - (end - t0)
            )
        if first:
            return
        assert self.t_first is not None
        elapsed = end - self.t_first
        record: dict[str, Any] = {
            **self._base,
            "time": time.time(),
            "kind": "sniff",
            "rank": self.rank,
            "step": step,
            "device_model": device_model(dev),
            "gemm_size": n,
            "gemm_dtype": dtype,
            "gemm_s": gemm_s,
            "sniff_s": cost,
            "sniff_total_s": self.spent_s,
            "elapsed_s": elapsed,
            "overhead": self.spent_s / elapsed if elapsed > 0 else 0.0,
            "next_step": self.next_step,
            "confirming": confirming,
        }
        if allreduce_s is not None:
            record["allreduce_s"] = allreduce_s
            record["allreduce_kib"] = self.cfg.sniff_allreduce_kib
        self._write(record)


def _dist() -> Any:
    import sys

    if "torch.distributed" not in sys.modules:
        return None
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None
