"""Silent data corruption: the ranks' replicated state compared, the odd rank named, the job
rolled back to the last agreed step (``[sdc]``).

Under DistributedDataParallel every rank holds a bitwise-equal replica of the parameters,
the buffers and the optimizer state after each optimizer step (the gradients are averaged
before the step, and the step is the same arithmetic on the same numbers). A device that
computes a wrong value without an error (a flipped bit in the reduced gradient, in the
optimizer's arithmetic, in a parameter) makes its rank's replica differ from the others'.

**The check.** At step boundaries (``tg.checkpoint.maybe_save``, which every rank calls) each
rank digests its replica: every tensor of the checkpointed state's DDP model and optimizer,
its bytes viewed as 32-bit integers and summed into a 64-bit integer (a flip of bit ``k``
changes the sum by ±2^k, never 0 modulo 2^64), and the tensors' sums combined twice, plainly
and weighted by an odd number per tensor. One all-gather of five integers per rank, on the
checkpoint's gloo control group, carries every rank's digest and its proposal for the next
check step (the largest proposal wins: the ranks always agree on it). A rank proposes the step
at which the time spent in checks stays within ``budget`` of the training time, at its
measured step time and check cost (``every_steps`` fixes the cadence instead). A persisting
save always checks first: a committed checkpoint is always of state that passed a check at
its own step.

**A disagreement** is an ``sdc_suspect`` event. With a strict majority of equal digests (three
ranks or more) the others are named at once. Without one (two ranks, or a tie), the job rolls
back and replays: every rank restores the last agreed state, redoes the steps from there with
its recorded batches, and is checked again at the suspect step. With two ranks each rank
digests its parameters at every boundary (:meth:`SdcGuard.boundary`, local) and compares the
redo's with its first run's, bitwise, and its state at the suspect step with its first one: a
corruption on rank b in step f changes b's parameters from the boundary f + 1 on and another
rank's only through b's gradients in a later all-reduce, from f + 2 on, so the rank that
diverged first is named (where no digests are recorded, a tie of three ranks or more, the
logged metric is compared instead). After a verdict, in a job of several nodes, every rank
leaves and the named one with :data:`SDC_EXIT_CODE`: its agent evicts the node. When the replay leaves it
open (a tie, or the same wrong result again: a deterministic fault), each rank multiplies two
fixed matrices whose exact product is known: a rank whose product is wrong is named. The verdict
is an ``sdc_verdict`` event, and a fleet-database record (cause ``sdc``) of the named rank's node
and device, written by that rank.

**The rollback** restores the newest checkpoint at or before the last step whose check
passed (memory tier first, else disk), drops the memory-tier snapshots after it, and the loop
redoes the steps since (no data is skipped: the data was not the fault). A disagreement at the
first check (no agreed state yet) or more than ``max_verdicts`` verdicts stop the job with the
"do not requeue" exit code.

Not seen: a corruption that is the same on every rank (a bad input, a bug, a flip before the
gradient all-reduce: it is averaged into every rank's gradient alike); state that is not
replicated (a model outside DDP, parameters DDP ignores: the checks are off, with one line).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from trainguard.core.config.sdc import SdcConfig
from trainguard.core.failures import DO_NOT_REQUEUE_EXIT_CODE, SDC_EXIT_CODE

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

__all__ = ["SdcGuard", "digest", "known_answer_gemm_ok", "replicated_tensors"]

logger = logging.getLogger(__name__)

_SHARE = 0.7
"""Share of ``budget`` the regular cadence keeps to (the check under way is not foreseen, and
a check on a loaded machine can take longer than the last one)."""
_RECORD_PROBE_STEPS = 200
"""Boundaries after which the two-rank per-step records are weighed against the budget."""
_GEMM_N = 256
_NEVER = 1 << 62


class NotReplicated(ValueError):
    """The checkpointed state is not meant to be bitwise equal on every rank."""


def _module_tensors(name: str, module: Any) -> Iterator[torch.Tensor]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not isinstance(module, DDP):
        raise NotReplicated(
            f"state[{name!r}] is a {type(module).__name__}, not a DistributedDataParallel model: "
            "its replicas are not known to be equal on every rank"
        )
    ignored = sorted(getattr(module, "parameters_to_ignore", ()) or ())
    if ignored:
        shown = ", ".join(ignored[:3]) + (f" (+{len(ignored) - 3})" if len(ignored) > 3 else "")
        raise NotReplicated(
            f"state[{name!r}] excludes {shown} from DDP: those replicas are not meant to be equal"
        )
    for _, p in module.named_parameters():
        yield p
    for _, b in module.named_buffers():
        yield b


def _walk(name: str, obj: Any, seen: set[int]) -> Iterator[torch.Tensor]:
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, torch.nn.Module):
        yield from _module_tensors(name, obj)
    elif isinstance(obj, torch.optim.Optimizer):
        for group in obj.param_groups:
            for p in group["params"]:
                st = obj.state.get(p) or {}
                for k in sorted(st, key=str):
                    if isinstance(st[k], torch.Tensor):
                        yield st[k]
    elif isinstance(obj, Mapping):
        for k in sorted(obj, key=str):
            yield from _walk(f"{name}.{k}", obj[k], seen)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _walk(f"{name}[{i}]", v, seen)


def replicated_tensors(state: Mapping[str, Any]) -> list[torch.Tensor]:
    """The tensors of ``state`` that every rank holds bitwise equal: the DDP models' parameters
    and buffers, the optimizers' state, plain tensors; in a fixed order. Raises
    :class:`NotReplicated` for a model that is not DDP or whose DDP ignores parameters."""
    seen: set[int] = set()
    out = []
    for key in sorted(state, key=str):
        for t in _walk(str(key), state[key], seen):
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    if not any(True for _ in out):
        raise NotReplicated("the checkpointed state holds no tensor to compare")
    return out


def parameter_tensors(state: Mapping[str, Any]) -> list[torch.Tensor]:
    """The parameters of the DDP models in ``state`` (in a fixed order): what a rank's own
    computation changes first, the per-step record of a two-rank replay."""
    import torch

    out: list[torch.Tensor] = []
    for key in sorted(state, key=str):
        obj = state[key]
        if isinstance(obj, torch.nn.Module):
            out.extend(p for _, p in obj.named_parameters())
    return out


def tensor_sums(tensors: list[torch.Tensor]) -> torch.Tensor:
    """Each tensor's bytes as 32-bit words (16 or 8 where its size is odd) summed into an int64,
    modulo 2^64: one flipped bit changes its tensor's sum by ±2^k, never by 0 (on the CPU)."""
    import torch

    sums = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        nbytes = flat.numel() * flat.element_size()
        if nbytes == 0:
            sums.append(torch.zeros(1, dtype=torch.int64, device=flat.device))
            continue
        if flat.dtype == torch.bool:
            flat = flat.view(torch.uint8)
        word = torch.int32 if nbytes % 4 == 0 else torch.int16 if nbytes % 2 == 0 else torch.uint8
        sums.append(flat.view(word).sum(dtype=torch.int64).reshape(1))
    if not sums:
        return torch.zeros(0, dtype=torch.int64)
    return torch.cat([x.to("cpu") for x in sums])


def _int_view(t: torch.Tensor) -> torch.Tensor | None:
    """``t``'s bytes (shared, not copied) as 32-bit words (16 or 8 where its size is odd);
    None where ``t`` is not contiguous (no view of its bytes exists)."""
    import torch

    if not t.is_contiguous():
        return None
    flat = t.detach().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    nbytes = flat.numel() * flat.element_size()
    word = torch.int32 if nbytes % 4 == 0 else torch.int16 if nbytes % 2 == 0 else torch.uint8
    return flat.view(word)


def digest(tensors: list[torch.Tensor]) -> tuple[int, int]:
    """(the sum of every tensor's :func:`tensor_sums`, those sums weighted by odd numbers),
    modulo 2^64: one flipped bit anywhere changes both."""
    import torch

    per = tensor_sums(tensors)
    weights = torch.arange(1, 2 * per.numel(), 2, dtype=torch.int64)
    return int(per.sum()), int((per * weights).sum())


def known_answer_gemm_ok(device: torch.device) -> bool:
    """Multiply two fixed small-integer matrices on ``device`` (float32: every product and sum
    is exact) and compare with the product computed in int64 on the CPU."""
    import torch

    g = torch.Generator(device="cpu").manual_seed(4321)
    a = torch.randint(-4, 5, (_GEMM_N, _GEMM_N), generator=g, dtype=torch.int64)
    b = torch.randint(-4, 5, (_GEMM_N, _GEMM_N), generator=g, dtype=torch.int64)
    want = a @ b
    got = (a.to(device, torch.float32) @ b.to(device, torch.float32)).to("cpu")
    return bool(torch.equal(got.to(torch.int64), want))


class SdcGuard:
    """One per worker handle (``tg._sdc``), called by the checkpoint manager at the step
    boundaries the ranks agreed on (see the module docstring)."""

    def __init__(self, tg: Any, config: SdcConfig) -> None:
        """``tg``: the worker handle (trainguard.worker.api.TrainGuard)."""
        self.tg = tg
        self.config = config
        self.next_check: int | None = None  # None: at the first boundary
        self.last_ok: int | None = None
        """The last step whose check passed (the newest state known good)."""
        self.off: str | None = None
        """Why the checks are off for this job (state not replicated)."""
        self.checks = 0
        self.spent_s = 0.0
        """Time in the checks this cadence (or a persisting save) asked for."""
        self.forced_s = 0.0
        """Time in the checks only a memory-tier snapshot asked for (charged to it)."""
        self.last_cost_s = 0.0
        self.t_first: float | None = None
        self.steps_run = 0
        self._prev_step: int | None = None
        self.every = config.every_steps or 1
        """The agreed distance to the next check at the last check (for reports)."""
        self._replay: tuple[int, tuple[int, int], dict[int, object]] | None = None
        """(the suspect step being replayed, this rank's digest there the first time, its
        first values of the watched metric since the last agreed step)."""
        self._values: dict[int, object] = {}
        """Per step since the last agreed one: the digest of the parameters at its boundary
        (two ranks, ``replay_digests``), else the watched metric (``tg.log``)."""
        self.record_steps = tg.world_size < 3 and config.replay_digests
        """Record each boundary's parameter digest (no majority possible: a replay names)."""
        self.record_s = 0.0
        """Time spent on those per-step records (charged to the budget with the checks')."""
        self.records = 0
        self._params: tuple[int, list[tuple[torch.Tensor, int, torch.Tensor | None]]] | None = None
        """(id of the state, per parameter: the tensor, its data pointer, its bytes viewed as
        integers): the per-step record's views, made once (a parameter replaced or moved to
        other storage remakes them)."""
        self._diverged: int | None = None
        """The first step of the redo whose metric differs from the first run's."""
        self.verdicts = 0
        self.generation = tg.generation

    # -- the recorded results --------------------------------------------------------------
    def observe(self, step: int, metrics: Mapping[str, Any]) -> None:
        """``tg.log`` values of the step ``step``: the watched metric (the loss, computed from
        the state at this step's boundary) is kept until the next agreed check; during a redo
        it is compared with the first run's, bitwise."""
        if self.record_steps:
            return
        v = metrics.get(self.config.metric)
        if v is None or isinstance(v, str):
            return
        x = float(v)
        self._compare(step, x)
        self._values[step] = x

    def boundary(self, step: int, state: Mapping[str, Any]) -> None:
        """Every step boundary (``maybe_save``, local): with two ranks, the digest of this
        rank's parameters there, kept until the next agreed check; during a redo compared with
        the first run's. A corruption on rank b in step f changes b's parameters from the
        boundary f + 1 on; the other rank's can change only through b's gradients in the
        all-reduce of step f + 1, from f + 2 on: the rank whose parameters diverged first is
        the one that computed wrongly (a rounded loss can miss a small corruption)."""
        if not self.record_steps or self.off is not None:
            return
        t0 = time.perf_counter()
        x = self._params_sum(state)
        self._compare(step, x)
        self._values[step] = x
        self.record_s += time.perf_counter() - t0
        self.records += 1
        if self.records == _RECORD_PROBE_STEPS and self._replay is None:
            self._weigh_records()

    def _params_sum(self, state: Mapping[str, Any]) -> int | None:
        """The sum of this rank's parameters' bytes as integers (one flipped bit changes it by
        ±2^k): a rank's own state against its own first run needs no more than this."""
        params = parameter_tensors(state)
        cached = self._params
        if (
            cached is None
            or len(cached[1]) != len(params)
            or any(
                t is not c[0] or t.data_ptr() != c[1]
                for t, c in zip(params, cached[1], strict=True)
            )
        ):
            cached = (id(state), [(t, t.data_ptr(), _int_view(t)) for t in params])
            self._params = cached
        if not cached[1]:
            return None
        import torch

        total = 0
        for t, _, v in cached[1]:
            view = v if v is not None else _int_view(t.contiguous())
            assert view is not None
            total += int(view.sum(dtype=torch.int64))
        return total

    def _weigh_records(self) -> None:
        """The per-step records are charged to the budget with the checks; where they alone
        would take more than half of it (a model so small that a step costs little more than a
        pass over its parameters), the two-rank localisation goes back to the logged metric
        (one line): the checks keep their budget and their verdicts."""
        assert self.t_first is not None
        elapsed = time.perf_counter() - self.t_first
        share = self.record_s / elapsed if elapsed > 0 else 0.0
        if share <= self.config.budget / 2:
            return
        self.record_steps = False
        self._values = {}
        if self.tg.rank == 0:
            logger.warning(
                "sdc: the per-step parameter digests take %.2f%% of the step time, over half "
                "the %.2f%% budget; two ranks are told apart by the logged %r from now on "
                "(set [sdc] replay_digests = false to skip this measurement)",
                100 * share,
                100 * self.config.budget,
                self.config.metric,
            )

    def _compare(self, step: int, x: object) -> None:
        """During a redo: ``x`` at ``step`` against the first run's, bitwise."""
        if self._replay is not None and step <= self._replay[0] and self._diverged is None:
            if step not in self._replay[2]:
                return
            first = self._replay[2][step]
            same = x == first or (isinstance(x, float) and x != x and first != first)
            if not same:
                self._diverged = step

    # -- schedule --------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        return self.off is None

    def marks(self, step: int) -> dict[str, str]:
        """The manifest's record of the check of the state saved at ``step``."""
        if self.off is not None:
            return {"sdc": "unverified", "sdc_reason": f"checks off: {self.off}"}
        if self.last_ok != step:
            return {"sdc": "unverified", "sdc_reason": f"not checked at step {step}"}
        return {"sdc": "verified"}

    def restored(self, step: int) -> None:
        """A restore (collective: every rank) loaded the state of ``step``: it was saved from
        state that passed a check, and the next boundary checks again."""
        self.last_ok, self.next_check, self._prev_step = step, None, step
        self.generation = self.tg.generation
        self._params = None  # the restore may have put new tensors into the state

    def due(self, step: int, *, persist: bool) -> bool:
        """Whether the boundary ``step`` is checked: the agreed cadence, a save (to disk or the
        memory tier), the step under replay. The same on every rank (from agreed values only)."""
        now = time.perf_counter()
        if self.generation != self.tg.generation:  # an in-process restart: the group starts over
            self.generation = self.tg.generation
            self.next_check, self.last_ok, self._replay = None, None, None
        if self.t_first is None:
            self.t_first = now
        elif self._prev_step is not None and step > self._prev_step:
            self.steps_run += step - self._prev_step
        self._prev_step = step
        return persist or self.next_check is None or step >= self.next_check

    def _proposal(self, step: int, pending_s: float) -> int:
        if self.config.every_steps is not None:
            return step + self.config.every_steps
        assert self.t_first is not None
        if self.steps_run == 0:
            return step + 1  # the first check measures its cost; the next one the step time
        elapsed = max(time.perf_counter() - self.t_first, 1e-9)
        per_step = elapsed / self.steps_run
        spent = self.spent_s + self.record_s + pending_s + max(self.last_cost_s, pending_s)
        wait_s = spent / (self.config.budget * _SHARE) - elapsed
        return step + max(1, math.ceil(wait_s / per_step - 1e-9))

    # -- the check (collective: every rank, the same step) ---------------------------------
    def check(
        self,
        step: int,
        state: MutableMapping[str, Any],
        group: ProcessGroup | None,
        *,
        forced: bool = False,
    ) -> bool:
        """Compare the ranks' replicas at ``step``. True: they agree (or the checks are off),
        the caller goes on (and may save); False: a corruption was found and ``state`` rolled
        back to the last agreed step (``tg.step_num`` moved there). ``forced``: only a
        memory-tier snapshot asked for this one: its cost is the snapshot's (the memory tier's
        cadence counts it), not this budget's."""
        import torch
        import torch.distributed as dist

        t0 = time.perf_counter()
        try:
            tensors = replicated_tensors(state)
        except NotReplicated as e:
            self._switch_off(str(e))
            return True
        mine = digest(tensors)
        replaying = self._replay is not None and self._replay[0] == step
        row = torch.tensor(
            [mine[0], mine[1], self._proposal(step, time.perf_counter() - t0), replaying,
             self._divergence(mine) if replaying else _NEVER],
            dtype=torch.int64,
        )  # fmt: skip
        rows = [torch.empty_like(row) for _ in range(self.tg.world_size)]
        dist.all_gather(rows, row, group=group)
        got = [r.tolist() for r in rows]
        nxt = max(r[2] for r in got)
        self.every, self.next_check = nxt - step, nxt
        cost = time.perf_counter() - t0
        if forced:
            self.forced_s += cost
        else:
            self.spent_s += cost
            self.last_cost_s = cost
        self.checks += 1
        self._record(step, cost)
        digests = [(r[0], r[1]) for r in got]
        if len(set(digests)) == 1:
            if replaying:
                self._after_replay(step, [r[4] for r in got], group)
            self.last_ok = step
            self._values = {t: v for t, v in self._values.items() if t >= step}
            return True
        return self._disagree(step, state, tensors, digests, replaying, group)

    def _record(self, step: int, cost: float) -> None:
        assert self.t_first is not None
        elapsed = time.perf_counter() - self.t_first
        self.tg._write_record(
            {
                "time": time.time(),
                "kind": "sdc_check",
                "rank": self.tg.rank,
                "attempt": self.tg.attempt,
                "step": step,
                "check_s": cost,
                "checks": self.checks,
                "sdc_total_s": self.spent_s,
                "elapsed_s": elapsed,
                "overhead": (self.spent_s + self.record_s) / elapsed if elapsed > 0 else 0.0,
                "forced_s": self.forced_s,
                "forced_overhead": self.forced_s / elapsed if elapsed > 0 else 0.0,
                "record_s": self.record_s,
                "record_overhead": self.record_s / elapsed if elapsed > 0 else 0.0,
                "next_step": self.next_check,
            }
        )

    def _disagree(
        self,
        step: int,
        state: MutableMapping[str, Any],
        tensors: list[torch.Tensor],
        digests: list[tuple[int, int]],
        replaying: bool,
        group: ProcessGroup | None,
    ) -> bool:
        world = len(digests)
        top, n = Counter(digests).most_common(1)[0]
        odd = [r for r, d in enumerate(digests) if d != top]
        majority = 2 * n > world
        if self.tg.rank == 0:
            self.tg.events.emit(
                "sdc_suspect",
                step=step,
                ranks=odd if majority else list(range(world)),
                last_agreed_step=self.last_ok,
                localise="majority" if majority else "gemm" if replaying else "replay",
                digests=[f"{a & (2**64 - 1):016x}:{b & (2**64 - 1):016x}" for a, b in digests],
            )
        if majority:
            self._replay = None
            self._verdict(step, odd, "majority", group)
        elif replaying:  # the redo disagrees again: the same wrong result, a deterministic fault
            self._replay = None
            self._tie_break(step, list(range(world)), group)
        else:
            self._remember(step, digests[self.tg.rank])
        self._rollback(step, state)
        return False

    def _remember(self, step: int, mine: tuple[int, int]) -> None:
        """Before a replay: keep this rank's first result at ``step`` and its metric values."""
        self._replay = (step, mine, dict(self._values))
        self._diverged = None

    def _divergence(self, mine: tuple[int, int]) -> int:
        """The first boundary at which this rank's redo differs from its first run: the first
        step whose metric differs (computed from the state at that boundary), else the suspect
        step itself where its state there differs, else never."""
        assert self._replay is not None
        step, first, _ = self._replay
        if self._diverged is not None:
            return self._diverged
        return step if first != mine else _NEVER

    def _after_replay(self, step: int, divergence: list[int], group: ProcessGroup | None) -> None:
        """The redo of ``step`` agreed (the fault did not come back). ``divergence``: each
        rank's first boundary at which its first run differs from the redo. A corruption on
        rank b in step f makes b's state differ from the boundary f + 1 on; the all-reduce of
        step f + 1 carries it into every other rank's, whose states differ from f + 2 on. So
        the rank(s) that diverged first are named; a tie goes to the GEMM."""
        self._replay, self._diverged = None, None
        first = min(divergence)
        named = [r for r, d in enumerate(divergence) if d == first]
        if self.tg.rank == 0:
            logger.info("replay of step %d: first divergence per rank %s", step, divergence)
        if first < _NEVER and len(named) < len(divergence):
            self._verdict(step, named, "replay", group)
        else:
            self._tie_break(step, list(range(self.tg.world_size)), group)

    def _tie_break(self, step: int, suspects: list[int], group: ProcessGroup | None) -> None:
        import torch
        import torch.distributed as dist

        ok = known_answer_gemm_ok(self._device())
        flag = torch.tensor([0 if ok else 1], dtype=torch.int64)
        flags = [torch.empty_like(flag) for _ in range(self.tg.world_size)]
        dist.all_gather(flags, flag, group=group)
        wrong = [r for r in suspects if int(flags[r]) == 1]
        if wrong:
            self._verdict(step, wrong, "gemm", group)
            return
        if self.tg.rank == 0:
            self.tg.events.emit("sdc_verdict", step=step, ranks=[], localise="none",
                                verdicts=self.verdicts, action="rollback")  # fmt: skip
            print(f"trainguard: replicas disagreed at step {step} and no rank could be named "
                  "(replay and a known-answer GEMM on every rank agreed)", file=sys.stderr,
                  flush=True)  # fmt: skip

    def _device(self) -> torch.device:
        import torch
        import torch.distributed as dist

        if dist.is_initialized() and dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _verdict(self, step: int, ranks: list[int], how: str, group: ProcessGroup | None) -> None:
        tg = self.tg
        self.verdicts += 1
        stop = self.verdicts > self.config.max_verdicts
        device = _device_name(self._device())
        if tg.rank in ranks:
            self._fleet_record(step, how, device)
        if tg.rank == 0:
            tg.events.emit(
                "sdc_verdict",
                step=step,
                ranks=ranks,
                localise=how,
                verdicts=self.verdicts,
                action="stop" if stop else "rollback",
            )
            print(
                f"trainguard: silent data corruption at step {step}: rank(s) "
                f"{', '.join(map(str, ranks))} computed a wrong result (found by {how})",
                file=sys.stderr,
                flush=True,
            )
        if tg.rank in ranks:
            tg.events.emit("sdc_rank_named", step=step, localise=how, device=device)
        if stop:
            self._stop(step, f"{self.verdicts} corruption verdicts (max_verdicts = "
                       f"{self.config.max_verdicts})", emit=False)  # fmt: skip
        if self.config.evict and tg.world_size > tg.local_world_size:
            self._evict(step, ranks)

    def _evict(self, step: int, ranks: list[int]) -> None:
        """A job of several nodes: every rank leaves (the verdict is the same on all of them),
        a named one with :data:`SDC_EXIT_CODE`, so that its node's agent evicts the node as for
        a health drain; the others with 1 (a consequence: the round restarts without it, from
        the last agreed checkpoint, where a spare or the nodes left take over)."""
        from trainguard.worker.rollback import _leave_together

        tg = self.tg
        named = tg.rank in ranks
        if named or tg.rank == 0:
            print(f"trainguard: rank {tg.rank}: silent data corruption at step {step} on rank(s) "
                  f"{', '.join(map(str, ranks))}: "
                  + (f"node {tg.node} leaves the job (exit {SDC_EXIT_CODE}: evicted)" if named
                     else "the named node leaves the job; restarting from the last agreed "
                     "checkpoint"), file=sys.stderr, flush=True)  # fmt: skip
        try:
            tg.close()
        except Exception:
            logger.exception("closing the worker handle before leaving failed")
        _leave_together()
        os._exit(SDC_EXIT_CODE if named else 1)

    def _fleet_record(self, step: int, how: str, device: str) -> None:
        """This rank was named: its node's record in the fleet database (counts toward the lemon
        policy with ``sdc`` in ``[fleet] lemon_causes``). Never raises."""
        from trainguard.core.config import worker_section_or_default

        tg = self.tg
        try:
            cfg = worker_section_or_default(tg.run_dir, "fleet")
            if not cfg.enabled:
                return
            from trainguard.fleet.db import Record, safe_node_name
            from trainguard.fleet.plugin import fleet_db

            runs_root = worker_section_or_default(tg.run_dir, "runtime").runs_root
            node, _ = safe_node_name(tg.node)
            with fleet_db(cfg, runs_root, node=node) as db:
                # the job as its agents record it (one incident with their eviction record)
                job = os.environ.get("TORCHELASTIC_RUN_ID") or tg.run_dir.name
                db.write([Record(node=node, kind="sdc", cause="sdc", verdict="rollback",
                                 job=job, attempt=tg.attempt,
                                 detail={"rank": tg.rank, "step": step, "device": device,
                                         "localise": how})])  # fmt: skip
        except Exception as e:
            logger.warning("rank %d: the corruption verdict is not in the fleet database: %s",
                           tg.rank, e)  # fmt: skip

    def _rollback(self, step: int, state: MutableMapping[str, Any]) -> None:
        tg = self.tg
        if self.last_ok is None:
            self._stop(step, "no state agreed before it to roll back to (the first check)")
        assert self.last_ok is not None
        mgr = tg.checkpoint
        t0 = time.perf_counter()
        restored = mgr.restore(state, max_step=self.last_ok)
        if restored is None:
            self._stop(step, f"no checkpoint at or before step {self.last_ok} to roll back to")
        assert restored is not None
        mgr.discard_snapshots_after(restored)
        if tg._rollback is not None:
            tg._rollback.monitor.forget_from(restored)
        self.next_check = step  # the redo is checked at the suspect step
        self._prev_step = restored
        if tg.rank == 0:
            tg.events.emit(
                "sdc_rollback",
                bad_step=step,
                restored_step=restored,
                resume_step=tg.step_num,
                duration_s=round(time.perf_counter() - t0, 4),
            )
            print(f"trainguard: rank 0: replicas disagreed at step {step}: rolled back to step "
                  f"{restored}, redoing the steps since", file=sys.stderr, flush=True)  # fmt: skip

    def _switch_off(self, why: str) -> None:
        self.off = why
        if self.tg.rank == 0:
            line = (f"trainguard: sdc checks off: {why}; wrap the model in "
                    "DistributedDataParallel with every parameter, or set [sdc] enabled = "
                    "false")  # fmt: skip
            print(line, file=sys.stderr, flush=True)
            self.tg.events.emit("sdc_checks_off", reason=why)

    def _stop(self, step: int, why: str, *, emit: bool = True) -> None:
        from trainguard.worker.rollback import _leave_together

        tg = self.tg
        if tg.rank == 0:
            line = (f"trainguard: silent data corruption at step {step}: {why}; stopping the "
                    f"job with exit code {DO_NOT_REQUEUE_EXIT_CODE} (do not requeue): take the "
                    "named node out of the pool and resume")  # fmt: skip
            if emit:
                tg.events.emit("sdc_verdict", step=step, ranks=[], localise="none",
                               verdicts=self.verdicts, action="stop", reason=why)  # fmt: skip
            print(line, file=sys.stderr, flush=True)
        try:
            tg.close()
        except Exception:
            logger.exception("closing the worker handle before the stop failed")
        _leave_together()
        os._exit(DO_NOT_REQUEUE_EXIT_CODE)


def _device_name(dev: torch.device) -> str:
    import torch

    if dev.type == "cuda":
        return f"cuda:{dev.index} {torch.cuda.get_device_name(dev)}"
    return "cpu"
