"""The trainguard agent: torch's LocalElasticAgent plus events, progress and plugins."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from trainguard.core import flight_recorder
from trainguard.core.atomicfile import open_append
from trainguard.core.config import TrainGuardConfig
from trainguard.core.contracts import envvars
from trainguard.core.contracts.rundir import RunDir
from trainguard.core.errorfile import exception_site
from trainguard.core.events import EventLog
from trainguard.core.failures import (
    DO_NOT_REQUEUE_EXIT_CODE,
    REQUEUE_EXIT_CODE,
    FailureKind,
    WorkerFailure,
    classify_exit,
    peer_failure_text,
)
from trainguard.core.plugin import AgentContext, AgentExit, AgentPlugin, NodeUnhealthyError
from trainguard.core.procs import kill_ranks
from trainguard.core.progress import ProgressReader, ProgressSnapshot
from trainguard.runtime import _torch, workerhook
from trainguard.runtime.inprocess import InProcessRestarter
from trainguard.runtime.rendezvous import AttemptRendezvousHandler

__all__ = ["NodeUnhealthyError", "TrainGuardAgent"]

logger = logging.getLogger(__name__)

HOOK_DIR = workerhook.HOOK_DIR
"""The workers' start-up hook (``sitecustomize.py`` → :mod:`trainguard.runtime.workerhook`)."""
PEER_FAILED_KEY = "trainguard/failed"
"""Rendezvous-store key (``/<attempt>``) where an agent whose workers failed names its node."""
PEER_FAILED_POLL_S = 0.25
"""How often a healthy agent looks for another node's failure."""
PEER_FAILED_WAIT_S = 3.0
"""How long an agent that exits after its workers failed waits for the other nodes to see it."""


def _output_tail(pcontext: Any, local_rank: int, lines: int = 12) -> str | None:
    """The last lines a worker wrote to stderr, when torch captured it to a file
    (``--redirects`` / ``--tee`` / ``--log-dir``)."""
    path = (getattr(pcontext, "stderrs", None) or {}).get(local_rank)
    if not path:
        return None
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    tail = "\n".join(text.splitlines()[-lines:]).strip()
    return tail or None


def _place(f: WorkerFailure) -> str | None:
    """``file:line`` in the user's code where a worker's exception was raised."""
    site = exception_site(f.message, f.callstack) if f.message else None
    return site.place if site is not None else None


def raise_swallowed_signal() -> None:
    """Raise torch's ``SignalException`` again for a signal the agent got whose exception
    never reached torch's ``run()`` (an ``except Exception`` on the main thread's path at that
    moment swallowed it): the workers are stopped and the agent ends as signalled, instead of
    watching on as if no signal had come. Called at each monitor pass, which a delivered
    ``SignalException`` ends for good."""
    sig = _torch.signal_raised()
    if sig is not None:
        logger.warning("%s reached the agent but was lost on its way; acting on it now", sig.name)
        raise SignalException(f"Process {os.getpid()} got signal: {sig}", sigval=sig)


class TrainGuardAgent(_torch.ElasticAgentBase):
    """A ``LocalElasticAgent`` that records lifecycle events, exposes each worker's progress
    and calls :class:`AgentPlugin` hooks with the node's :class:`AgentContext` (which it keeps
    current). Worker env, restarts, logs and failure reporting are torch's own."""

    def __init__(
        self,
        *args: Any,
        ctx: AgentContext,
        plugins: list[AgentPlugin] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.ctx = ctx
        self.tg_config: TrainGuardConfig = ctx.config
        self.run_dir: Path = ctx.run_dir
        self.events: EventLog = ctx.events
        self.plugins = list(plugins or [])
        ctx.worker_progress = self.worker_progress
        ctx.worker_pids = self.worker_pids
        self.num_plugin_errors = 0
        self.progress: ProgressReader | None = None
        self.requeue = False
        """Every failed worker exited with the requeue code after a preemption save: the agent
        does not restart them and ``trainguard run`` exits with that code."""
        self.do_not_requeue = False
        """A worker exited with the "do not requeue" code (e.g. loss rollbacks exhausted):
        no restart, and ``trainguard run`` exits with that code."""
        self._failed_reported = False
        self.inprocess = InProcessRestarter(self)
        """Replaces a dead worker in place when the workers run in ``trainguard.run``."""
        self._user_pythonpath = os.environ.get("PYTHONPATH")
        self._declared_env: set[str] = set()
        self._collective_ranks: set[int] = set()
        self._released = False
        self._next_peer_check = 0.0
        self._torn_down: set[int] = set()
        """PIDs of workers still running when torch ended their group (not failures)."""

    @property
    def warm_pool(self) -> Any:
        """Pre-started worker processes (runtime/warm, set up by its plugin); None: cold starts."""
        return self.ctx.warm_pool

    # -- requeue (the one place that decides it) ------------------------------------------------
    def _mark_requeue(self, **fields: object) -> None:
        if self.requeue:
            return
        self.requeue = True
        self.events.emit(
            "requeue",
            exitcode=REQUEUE_EXIT_CODE,
            message="workers saved a preemption checkpoint and asked to be requeued",
            **fields,
        )

    def requeue_after_signal(self, signal: str) -> bool:
        """The agent was signalled (a preemption notice reaches it too): True, and recorded,
        when every local worker saved and exited with the requeue code."""
        codes = self.worker_exitcodes()
        if codes and all(c == REQUEUE_EXIT_CODE for c in codes):
            self._mark_requeue(signal=signal)
        return self.requeue

    def worker_exitcodes(self) -> list[int | None]:
        """Exit codes of the local workers after the agent shut them down (script or function
        entrypoints); empty when none were started."""
        return _torch.worker_exitcodes(self.pcontext)

    def unhealthy_failures(self) -> dict[int, ProcessFailure]:
        """One failure per local worker of a group declared unhealthy (exit code 1)."""
        return {
            w.global_rank: ProcessFailure(
                local_rank=w.local_rank, pid=w.id or -1, exitcode=1, error_file=""
            )
            for w in self.worker_group.workers
        }

    # -- helpers -------------------------------------------------------------------------------
    @property
    def rdzv(self) -> AttemptRendezvousHandler | None:
        h = self.worker_group.spec.rdzv_handler
        return h if isinstance(h, AttemptRendezvousHandler) else None

    @property
    def attempt(self) -> int:
        """Job-wide worker-group attempt of the current round (0-based; -1 before the first)."""
        return self.ctx.attempt

    @property
    def agent_restarts(self) -> int:
        """This agent's restarts (torchrun's TORCHELASTIC_RESTART_COUNT)."""
        return self.worker_group.spec.max_restarts - self.remaining_restarts

    def event_context(self) -> dict[str, Any]:
        ctx = {"attempt": max(self.attempt, 0), "agent_restarts": self.agent_restarts}
        if self.inprocess.generation:
            ctx["generation"] = self.inprocess.generation
        return ctx

    def worker_progress(self) -> dict[int, ProgressSnapshot]:
        """Latest progress of every local worker, by global rank: its ``tg.step()`` record,
        else (no record, or no step yet) its collective progress record."""
        if self.progress is None:
            return {}
        ranks = [w.global_rank for w in self.worker_group.workers]
        out = {}
        for r in ranks:
            snap = self.progress.read(r)
            if snap is None or (snap.num_steps == 0 and not snap.in_step):
                coll = self.progress.read_path(
                    flight_recorder.collective_progress_path(self.progress.dir, r)
                )
                if coll is not None:
                    if snap is None:  # a script without tg.step(), not one before its first step
                        self._announce_collective_progress(r)
                    snap = coll
            if snap is not None:
                out[r] = snap
        return out

    def _announce_collective_progress(self, rank: int) -> None:
        if rank in self._collective_ranks:
            return
        if not self._collective_ranks:
            logger.warning(  # shown by default: the user learns which signal guards the job
                "hang detection: ranks without tg.step() progress are judged by their collectives "
                "(torch flight recorder, last completed sequence id)"
            )
        self._collective_ranks.add(rank)
        self.events.emit("collective_progress", rank=rank)

    def worker_pids(self) -> dict[int, int]:
        """Global rank → pid of this node's workers (torch's process context, else the pids
        the workers report in their progress files)."""
        local = {w.local_rank: w.global_rank for w in self.worker_group.workers}
        pcontext = self.pcontext
        try:
            by_local = pcontext.pids() if pcontext is not None else {}
        except Exception:
            by_local = {}
        if by_local:
            return {local.get(lr, lr): pid for lr, pid in by_local.items()}
        return {r: s.pid for r, s in self.worker_progress().items() if s.pid}

    def _call(self, hook: str, *args: object) -> list[Any]:
        """Every plugin's ``hook``; the first :class:`AgentExit` one raises is raised after the
        others ran (each plugin still sees a failure that ends the agent), except before a
        rendezvous: a node kept out does no more preflight work."""
        results = []
        leave: AgentExit | None = None
        for p in self.plugins:
            try:
                results.append(getattr(p, hook)(self.ctx, *args))
            except AgentExit as e:
                if hook == "before_rendezvous":
                    raise
                leave = leave or e
            except SignalException:  # the agent was signalled while the hook ran: stop
                raise
            except Exception:
                self.num_plugin_errors += 1
                logger.exception("plugin %s failed in %s", p.name, hook)
        if leave is not None:
            raise leave
        return results

    # -- lifecycle overrides -------------------------------------------------------------------
    def rendezvous_workers(self, worker_group: WorkerGroup) -> None:
        self._call("before_rendezvous")
        self.inprocess.reset()
        t0 = time.monotonic()
        super().rendezvous_workers(worker_group)
        rnd = self.rdzv.last_round if self.rdzv else None
        ctx = self.ctx
        ctx.attempt = rnd.attempt if rnd is not None else self.agent_restarts
        ctx.agent_restarts = self.agent_restarts
        ctx.store = worker_group.store
        ctx.group_rank = worker_group.group_rank or 0
        ctx.group_world_size = worker_group.group_world_size or 1
        ctx.members = list(rnd.members) if rnd is not None else []
        ctx.foreign_ranks = list(rnd.foreign_ranks) if rnd is not None else []
        ctx.master_addr = worker_group.master_addr
        ctx.master_port = worker_group.master_port
        self.events.emit(
            "rendezvous",
            group_rank=worker_group.group_rank,
            group_world_size=worker_group.group_world_size,
            members=rnd.members if rnd else None,
            master_addr=worker_group.master_addr,
            master_port=worker_group.master_port,
            duration_s=round(time.monotonic() - t0, 3),
        )
        self._call("after_rendezvous", worker_group)

    def _install_worker_hooks(self) -> None:
        """What the plugins declared their workers need: variables (``worker_env``, names from
        :mod:`trainguard.core.contracts.envvars`) and start-up hook entries (``worker_hooks``). The
        entries reach a worker started as ``python ...`` through trainguard's start-up hook,
        first on its ``PYTHONPATH`` (:mod:`trainguard.runtime.workerhook`, which takes itself off
        again): a ``--no-python`` program gets neither the hook nor the entries, so its
        environment (and that of every Python it starts) is torchrun's plus ``envvars.ALL``."""
        env: dict[str, str] = {}
        entries: list[str] = []
        for p in self.plugins:
            try:
                declared = dict(p.worker_env(self.ctx))
                unknown = sorted(set(declared) - set(envvars.ALL))
                if unknown:
                    raise ValueError(
                        f"worker_env names {unknown} not in trainguard.core.contracts.envvars"
                    )
                hooks = [workerhook.check_entry(e) for e in p.worker_hooks(self.ctx)]
            except Exception:
                self.num_plugin_errors += 1
                logger.exception("plugin %s failed declaring its workers' needs", p.name)
                continue
            env.update(declared)
            entries.extend(e for e in hooks if e not in entries)
        for name in self._declared_env - env.keys():
            os.environ.pop(name, None)
        os.environ.update(env)
        self._declared_env = set(env)
        argv = self.ctx.worker_argv
        python_worker = bool(argv) and argv[0] == sys.executable
        user = workerhook.without_hook_dir(self._user_pythonpath)
        if entries and python_worker:
            os.environ[envvars.WORKER_HOOKS] = ",".join(entries)
            os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [workerhook.HOOK_DIR, user]))
        else:
            os.environ.pop(envvars.WORKER_HOOKS, None)
            if self._user_pythonpath is not None:
                os.environ["PYTHONPATH"] = self._user_pythonpath
            else:
                os.environ.pop("PYTHONPATH", None)

    def start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        progress_dir = RunDir(self.run_dir).progress(self.attempt)
        progress_dir.mkdir(parents=True, exist_ok=True)
        self.progress = ProgressReader(progress_dir)
        # The worker env is torch's; ours is added through the inherited environment.
        os.environ[envvars.RUN_DIR] = str(self.run_dir)
        os.environ[envvars.PROGRESS_DIR] = str(progress_dir)
        os.environ[envvars.ATTEMPT] = str(self.attempt)
        os.environ[envvars.NODE] = self.events.node
        self._teardown_file = progress_dir / "teardown"
        os.environ[envvars.TEARDOWN_FILE] = str(self._teardown_file)
        self._collective_ranks.clear()
        self._install_worker_hooks()
        pool = self.warm_pool
        serving = pool.serving_torch_workers() if pool is not None else contextlib.nullcontext({})
        with serving as started_warm:
            pids = super().start_workers(worker_group)
        _torch.record_terminate_signals()  # torch's process context installed its handler
        self._mark_teardowns(self.pcontext)
        self._failed_reported = False
        self._released = False
        self.events.emit(
            "workers_started",
            workers=[
                {
                    "rank": w.global_rank,
                    "local_rank": w.local_rank,
                    "pid": pids.get(w.local_rank),
                    "warm": started_warm.get(w.local_rank, False),
                }
                for w in worker_group.workers
            ],
            world_size=worker_group.workers[0].world_size if worker_group.workers else 0,
        )
        if worker_group.workers:
            self.ctx.world_size = worker_group.workers[0].world_size
        self._call("on_workers_started", worker_group)
        return pids

    def monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        raise_swallowed_signal()
        self._repair_error_files()  # torch's poll and the in-process restart read them
        self.inprocess.check(worker_group)  # before torch's poll, which stops every worker
        while True:
            try:
                result = super().monitor_workers(worker_group)
                break
            except (ValueError, LookupError, TypeError, RecursionError):
                # a worker exited after the repair, before or while torch's poll stopped the
                # group, and left an error file torch's reader raised on: repair, poll again
                # (each pass replaces a file, which torch then reads: the loop ends)
                if not self._repair_error_files():
                    raise
        if result.state == WorkerState.HEALTHY:
            for override in self._call("on_monitor", worker_group, result):
                if override is not None:
                    result = override
                    break
        if result.state == WorkerState.HEALTHY and not self._released:
            failed_node, how = self._peer_failed(), "failed"
            if failed_node is None:
                failed_node, how = self._peer_lost(), "lost"
            if failed_node is not None:
                self._release_survivors(failed_node, how)
        if (
            result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY)
            and not self._failed_reported
        ):
            self._failed_reported = True
            raised = any(
                isinstance(getattr(f, "error_file_data", None), dict) and f.error_file_data
                for f in result.failures.values()
            )
            self._announce_failure(raised=raised)
            self.report_failures(worker_group, result)
        return result

    # -- survivors of a failed peer node ---------------------------------------------------------
    def _failure_key(self) -> str:
        return f"{PEER_FAILED_KEY}/{max(self.attempt, 0)}"

    def _announce_failure(
        self, *, wait: bool = True, node: str | None = None, raised: bool = False
    ) -> None:
        """This node's workers of the attempt failed: the other nodes' agents release theirs
        at once (:meth:`_peer_failed`) instead of leaving them in a collective that can no
        longer complete until the process-group timeout."""
        store = self.ctx.store
        if store is None or self.ctx.group_world_size <= 1:
            return
        key = self._failure_key()
        try:
            if raised:  # before the node: a survivor that sees the node sees this too
                store.set(f"{key}/raised", "1")
            store.set(key, node or self.events.node)
            seen = int(store.add(f"{key}/seen", 1))
            # an agent about to exit may host the store: it waits (bounded) until every node
            # saw the failure (failed itself or released its workers)
            deadline = time.monotonic() + PEER_FAILED_WAIT_S
            while (
                wait
                and self.remaining_restarts <= 0
                and seen < self.ctx.group_world_size
                and time.monotonic() < deadline
            ):
                time.sleep(0.05)
                seen = int(store.add(f"{key}/seen", 0))
        except Exception as e:
            logger.warning("cannot announce the failure in the rendezvous store: %s", e)

    def _peer_failed(self) -> str | None:
        """The node whose agent announced a failure of this attempt (checked at most every
        :data:`PEER_FAILED_POLL_S`); None while there is none."""
        store = self.ctx.store
        now = time.monotonic()
        if store is None or self.ctx.group_world_size <= 1 or now < self._next_peer_check:
            return None
        self._next_peer_check = now + PEER_FAILED_POLL_S
        key = self._failure_key()
        try:
            if not store.check([key]):
                return None
            node = store.get(key)
        except Exception as e:
            logger.debug("cannot read the rendezvous store: %s", e)
            return None
        name = node.decode() if isinstance(node, bytes) else str(node)
        return None if name == self.events.node or self._released else name

    def _peer_lost(self) -> str | None:
        """A node of the running round whose liveness beacon went silent (lost node, frozen
        agent: its workers may never close their connections): its rendezvous node id."""
        rdzv = self.rdzv
        spares = getattr(rdzv, "spares", None) if rdzv is not None else None
        if spares is None or self.ctx.group_world_size <= 1:
            return None
        dead = spares.dead_participants()
        if not dead:
            return None
        node = min(dead)
        logger.error("node %s silent for %.1f s (liveness beacon)", node, dead[node])
        # the other nodes may not watch it: they learn it from this node's announcement
        self._announce_failure(wait=False, node=node)
        return node

    def _await_own_exits_after_peer_exception(self, how: str) -> None:
        """The failed peer's workers raised an exception (not a kill): this node's workers
        get ``[recovery] failure_grace_s`` to end of their own (the same bug raises on every
        rank within moments; a survivor's collective fails at once when its peer's connection
        closes) before they are ended, so their exceptions are evidence for attribution."""
        grace = self.tg_config.recovery.failure_grace_s
        store = self.ctx.store
        if (
            how != "failed"
            or grace <= 0
            or store is None
            or not self.tg_config.recovery.attribution
        ):
            return
        try:
            if not store.check([f"{self._failure_key()}/raised"]):
                return
            deadline = time.monotonic() + grace
            while _torch.running_worker_pids(self.pcontext) and time.monotonic() < deadline:
                time.sleep(0.02)
        except Exception as e:
            logger.debug("cannot wait for the workers' own exits: %s", e)

    def _release_survivors(self, failed_node: str, how: str = "failed") -> None:
        """SIGKILL this node's workers: they wait in collectives a failed peer will never join
        (a peer that died without closing its connections leaves them there until the
        process-group timeout; a stuck collective answers no SIGTERM handler). The kills
        surface as the group's FAILED state on the next tick: torch's restart path."""
        self._released = True
        try:
            store = self.ctx.store
            # the failed node may wait for every node to see it
            if how == "failed" and store is not None:
                store.add(f"{self._failure_key()}/seen", 1)
        except Exception as e:
            logger.debug("cannot acknowledge the failure in the rendezvous store: %s", e)
        self._await_own_exits_after_peer_exception(how)
        pids = self.worker_pids()
        logger.error(
            "node %s %s: ending this node's workers (ranks %s) at once",
            failed_node,
            "lost" if how == "lost" else "had failed workers",
            ",".join(str(r) for r in sorted(pids)),
        )
        killed = kill_ranks(pids)
        self.events.emit(
            "peer_failed",
            failed_node=failed_node,
            how=how,
            ranks=killed,
            pids={str(r): pids[r] for r in killed},
        )

    def report_failures(self, worker_group: WorkerGroup, result: RunResult) -> None:
        """Events for ``result``'s failures (torch's root cause marked), the requeue and
        do-not-requeue decisions, and the plugins' ``on_failure``."""
        local = {w.global_rank: w.local_rank for w in worker_group.workers}
        failures: list[WorkerFailure] = []
        for rank, pf in sorted(result.failures.items()):
            lr = local.get(rank, pf.local_rank)
            failures.append(
                classify_exit(
                    rank=rank,
                    local_rank=lr,
                    exitcode=pf.exitcode,
                    error_file_data=pf.error_file_data,
                    pid=pf.pid,
                    output_tail=_output_tail(self.pcontext, lr),
                    torn_down=pf.pid in self._torn_down,
                )
            )

        # torch's report names the earliest failure the root cause; so do the events, but two
        # kinds of failure are consequences, since torch's timestamps are whole seconds and
        # both often fall in the same second as the failure they follow: a survivor's
        # collective error because a peer died (its error file says so, whatever ended it
        # afterwards), and a worker still running when torch ended the group
        def order(f: WorkerFailure) -> tuple[bool, int]:
            consequence = bool(f.message and peer_failure_text(f.message))
            consequence = consequence or f.pid in self._torn_down
            return consequence, result.failures[f.rank].timestamp

        root = min(failures, key=order).rank if failures else None
        for f in failures:
            self.events.emit(
                "worker_failed",
                rank=f.rank,
                local_rank=f.local_rank,
                exitcode=f.exitcode,
                signal=f.signal,
                cause=f.kind.value,
                message=f.message,
                place=_place(f),
                pid=f.pid,
                state=result.state.name,
                root_cause=f.rank == root,
            )
        if not failures:
            self.events.emit("worker_group_unhealthy", state=result.state.name)
        kinds = {f.kind for f in failures}
        stop = sorted(f.rank for f in failures if f.exitcode == DO_NOT_REQUEUE_EXIT_CODE)
        if stop and not self.do_not_requeue:  # running it again cannot help: no restart
            self.remaining_restarts = 0
            self.do_not_requeue = True
            self.events.emit("do_not_requeue", exitcode=DO_NOT_REQUEUE_EXIT_CODE, ranks=stop)
        if FailureKind.PREEMPTED in kinds and kinds <= {
            FailureKind.PREEMPTED,
            FailureKind.TERMINATED,  # torch's teardown SIGTERMs the ranks still exiting
        }:
            # The workers saved and asked to be requeued: restarting them here would only
            # train on until the scheduler's kill. Stop, and exit with their code.
            self.remaining_restarts = 0
            self._mark_requeue(ranks=sorted(f.rank for f in failures))
        self._call("on_failure", failures)

    def _mark_teardowns(self, pcontext: Any) -> None:
        """torch stops workers through their process context: when one failed (inside its
        poll), for a restart, at the end of a failed job, and when the agent itself was
        signalled (inside torch's ``except SignalException``). Only that last one is a
        preemption the workers must save on; before the others the teardown file tells them the
        SIGTERM means "stop now", so a survivor inside a long step does not hold the restart
        for the whole shutdown timeout."""
        close = getattr(pcontext, "close", None)
        if close is None:
            return

        def close_marking_teardown(*args: object, **kwargs: object) -> Any:
            if not isinstance(sys.exc_info()[1], SignalException):
                self._await_own_failures(pcontext)
                self._mark_teardown()
                # what torch ends now did not fail of its own: never the root cause
                try:
                    self._torn_down |= _torch.running_worker_pids(pcontext)
                except Exception as e:
                    logger.debug("cannot list the running workers: %s", e)
            try:
                return close(*args, **kwargs)
            finally:  # torch reads the error files of the workers it ended next
                self._repair_error_files(pcontext)

        pcontext.close = close_marking_teardown

    def _await_own_failures(self, pcontext: Any) -> None:
        """A worker raised (its error file is there) while others still run: give them
        ``[recovery] failure_grace_s`` to end of their own before torch's teardown SIGTERMs
        them. The same bug raises on every rank within moments (and a survivor's collective
        fails at once when its peer's connection closes): attribution then sees every rank's
        exception, not one exception and a teardown."""
        grace = self.tg_config.recovery.failure_grace_s
        if grace <= 0:
            return
        try:
            if not _torch.raised_workers(pcontext):
                return
            deadline = time.monotonic() + grace
            while _torch.running_worker_pids(pcontext) and time.monotonic() < deadline:
                time.sleep(0.02)
        except Exception as e:
            logger.debug("cannot wait for the workers' own exits: %s", e)

    def _repair_error_files(self, pcontext: Any = None) -> list[int]:
        """The local ranks whose error file was replaced."""
        try:
            ranks = _torch.repair_error_files(pcontext or self.pcontext)
        except Exception as e:
            logger.debug("cannot check the workers' error files: %s", e)
            return []
        if ranks:
            logger.warning(
                "local rank(s) %s left an error file torch cannot read (cut short, or not in its format); replaced",
                ",".join(map(str, ranks)),
            )
        return ranks

    def _mark_teardown(self) -> None:
        path = getattr(self, "_teardown_file", None)
        if path is None:
            return
        try:
            os.close(open_append(path))  # created, never through a planted symlink
        except OSError as e:
            logger.warning("cannot mark the teardown of attempt %s: %s", self.attempt, e)

    def restart_workers(self, worker_group: WorkerGroup) -> None:
        self.events.emit(
            "restart",
            remaining_restarts=self.remaining_restarts,
            max_restarts=worker_group.spec.max_restarts,
            reason="membership_change" if worker_group.state == WorkerState.HEALTHY else "failure",
        )
        super().restart_workers(worker_group)
