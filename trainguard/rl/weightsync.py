"""The rollout client's weight sync: a weight version pushed to every live engine in parallel
under a timeout derived from the measured sync times; an engine that does not confirm (its
answer parsed by the engine contract's one parser) leaves routing until its health reports the
new version (it refits itself from the weight store).

Verified refit (with ``fingerprints``, :mod:`trainguard.rl.verify`): an engine that confirmed
a version, or reports one it loaded by itself, is routed only once its prompt log-probs of the
trainer's fingerprint texts matched; a refit that failed (an update error, other log-probs)
quarantines it (out of routing, told so, an event naming it, the version and what differed)
and it is refit again."""

from __future__ import annotations

import logging
import statistics
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from trainguard.core.contracts.engine import (
    COMPLETIONS_PATH,
    QUARANTINE_PATH,
    VERIFIED_PATH,
    WEIGHT_UPDATE_PATH,
    MalformedAnswer,
    parse_weight_update,
)
from trainguard.core.contracts.event_kinds import ROLLOUT_ENGINE_QUARANTINED, ROLLOUT_REFIT_VERIFIED
from trainguard.rl.rollout_types import EngineState, RolloutConfig, SyncResult
from trainguard.rl.routing import EngineRecord, EngineTable, RequestFailure
from trainguard.rl.verify import compare, fingerprint_request

__all__ = ["WeightSync"]

logger = logging.getLogger(__name__)


def _settle_s(timeout: float) -> float:
    """Of a sync's timeout, the part kept for marking the engines and returning (5 %, between
    50 and 500 ms): the call returns within its timeout whatever the engines do (a dead or
    frozen one is waited for no longer). Measured on a loaded 2-core machine: the return
    after the wait took up to 90 ms."""
    return min(0.5, max(0.05, 0.05 * timeout))


class WeightSync:
    def __init__(
        self,
        table: EngineTable,
        pool: ThreadPoolExecutor,
        config: RolloutConfig,
        *,
        fingerprints: Callable[[int], dict[str, Any] | None] | None = None,
        events: Callable[..., object] | None = None,
    ) -> None:
        self.table = table
        self.pool = pool
        self.config = config
        self.times: list[float] = []
        self.fingerprints = fingerprints
        self._emit = events or (lambda *a, **k: None)
        self.verified: Counter[str] = Counter()
        self.quarantined: Counter[str] = Counter()
        if fingerprints is not None:
            table.checker = self.check_refit

    def timeout_s(self) -> float:
        cfg = self.config
        if not self.times:
            return cfg.sync_timeout_initial_s
        return max(
            cfg.sync_timeout_min_s, cfg.sync_timeout_factor * statistics.median(self.times[-20:])
        )

    def _update(self, eng: EngineRecord, body: dict[str, Any], timeout: float) -> int:
        raw = self.table.call(eng, "POST", WEIGHT_UPDATE_PATH, body, timeout)
        return parse_weight_update(raw).version

    def sync(self, version: int, *, rewrite: Callable[[], object] | None = None) -> SyncResult:
        """Push ``version``; returns within :meth:`timeout_s` (the checks of a verified
        refit included: an engine not confirmed and checked by then is refit later)."""
        t_call = time.perf_counter()
        table = self.table
        table.set_policy_version(version)
        timeout = self.timeout_s()
        deadline = t_call + timeout - _settle_s(timeout)
        with table.lock:
            targets = [
                e
                for e in table.engines.values()
                if e.state not in (EngineState.DEAD, EngineState.LOADING, EngineState.UNKNOWN)
            ]
        body: dict[str, Any] = {"version": version}  # a version of the store, never a path
        t0 = time.perf_counter()
        futs = {self.pool.submit(self._update, e, body, timeout): e for e in targets}
        done, _ = wait(list(futs), timeout=max(0.0, deadline - time.perf_counter()))
        confirmed, missed = [], []
        failed: dict[str, str] = {}
        with table.lock:
            for fut, eng in futs.items():
                ok = False
                if fut in done:
                    try:
                        ok = fut.result() == version
                    except RequestFailure as f:
                        if f.reason == "http_5xx":  # the engine tried and failed to load it
                            failed[eng.url] = str(f)
                    except MalformedAnswer:
                        ok = False
                    except Exception:  # any other failure: not confirmed, never raised
                        logger.exception("weight update of %s failed", eng.url)
                        ok = False
                if ok:
                    eng.version = version
                    if self.fingerprints is not None:  # routed once checked (below)
                        eng.state = EngineState.LOADING
                    elif eng.state is EngineState.STALE:
                        eng.state = EngineState.SERVING
                    confirmed.append(eng.url)
                else:
                    if eng.state is EngineState.SERVING:
                        eng.state = EngineState.STALE
                    missed.append(eng.url)
            table.lock.notify_all()
        if self.fingerprints is not None:
            confirmed, missed = self._verify_refits(
                version, body, confirmed, missed, deadline, failed, rewrite
            )
        dt = time.perf_counter() - t0
        if confirmed and not missed:
            self.times.append(dt)
        if missed:
            logger.warning(
                "weight version %d: %s did not confirm in %.1f s; they refit later",
                version,
                missed,
                timeout,
            )
        return SyncResult(version, dt, timeout, confirmed, missed)

    # -- refit checks ------------------------------------------------------------------------
    def check_refit(
        self, eng: EngineRecord, version: int, timeout: float | None = None
    ) -> str | None:
        """Check that ``eng`` holds ``version`` (its answers against the trainer's
        fingerprint): verified → routable; otherwise quarantined. None when verified (or
        the version has no fingerprint: the engine's digest check only), else what differed
        or why it could not be checked (then it is checked again later). ``timeout``: for
        each of its requests (default: the request timeout)."""
        table = self.table
        with table.lock:
            if eng.checking:
                return "another check of it is under way"
            eng.checking = True
        try:
            why, worst = self._check(eng, version, timeout)
        finally:
            with table.lock:
                eng.checking = False
        if why is not None:
            if not why.startswith("not checked: "):
                self.quarantine(eng, version, why)
            return why
        try:
            table.call(eng, "POST", VERIFIED_PATH, {"version": version}, min(5.0, timeout or 5.0))
        except RequestFailure as f:
            return f"not checked: the engine did not take the verdict ({f})"
        with table.lock:
            eng.verified = (eng.pid, version)
            eng.version = version
            if eng.state is not EngineState.DEAD:
                eng.state = EngineState.SERVING if table.in_bound(version) else EngineState.STALE
            self.verified[eng.url] += 1
            table.lock.notify_all()
        if worst is not None:
            self._emit(ROLLOUT_REFIT_VERIFIED, engine=eng.url, version=version,
                         max_logprob_diff=worst, verified=self.verified[eng.url])  # fmt: skip
        return None

    def _check(
        self, eng: EngineRecord, version: int, timeout: float | None
    ) -> tuple[str | None, float | None]:
        assert self.fingerprints is not None
        try:
            fp = self.fingerprints(version)
        except (OSError, ValueError) as e:
            return f"not checked: no fingerprint of version {version} ({e})", None
        if fp is None:  # written without one: the engine's digest check only
            return None, None
        try:
            raw = self.table.call(
                eng, "POST", COMPLETIONS_PATH, fingerprint_request(fp),
                timeout or self.config.request_timeout_s,
            )  # fmt: skip
        except RequestFailure as f:
            return f"not checked: the check request failed ({f})", None
        return compare(fp, raw, version)

    def quarantine(self, eng: EngineRecord, version: int, why: str) -> None:
        """Take ``eng`` out of routing, tell it (it answers no completion until verified)
        and record it."""
        table = self.table
        with table.lock:
            eng.verified = None
            if eng.state is not EngineState.DEAD:
                eng.state = EngineState.QUARANTINED
            self.quarantined[eng.url] += 1
            table.lock.notify_all()
        try:
            table.call(eng, "POST", QUARANTINE_PATH, {"version": version, "reason": why[:500]}, 5.0)
        except RequestFailure:
            pass  # out of this client's routing anyway; its own health says the rest
        logger.warning("rollout engine %s quarantined at version %d: %s", eng.url, version, why)
        self._emit(ROLLOUT_ENGINE_QUARANTINED, engine=eng.url, version=version, reason=why,
                     quarantined=self.quarantined[eng.url])  # fmt: skip

    def _verify_refits(
        self,
        version: int,
        body: dict[str, Any],
        confirmed: list[str],
        missed: list[str],
        deadline: float,
        failed: dict[str, str],
        rewrite: Callable[[], object] | None,
    ) -> tuple[list[str], list[str]]:
        """Check every engine that confirmed ``version``; quarantine those whose update
        failed; refit again (up to ``refit_attempts`` in all) the quarantined ones: only
        checked engines are routed. Nothing waits past ``deadline`` (an engine not checked
        by then is checked by the health loop once it reports the version)."""
        engines = self.table.engines
        ok, todo = [], list(confirmed)
        for url, why in failed.items():
            self.quarantine(engines[url], version, f"the refit failed: {why}")
        redo = list(failed)

        def left() -> float:
            return deadline - time.perf_counter()

        for attempt in range(self.config.refit_attempts):
            if left() <= 0:
                break
            checked = [engines[u] for u in todo]
            futs = [self.pool.submit(self.check_refit, e, version, left()) for e in checked]
            done, _ = wait(futs, timeout=max(0.0, left()))
            verdicts = [
                f.result() if f in done else "not checked: the sync's timeout came first"
                for f in futs
            ]
            ok += [e.url for e, why in zip(checked, verdicts, strict=True) if why is None]
            redo += [e.url for e, why in zip(checked, verdicts, strict=True) if why is not None]
            if not redo or attempt + 1 == self.config.refit_attempts:
                break
            if rewrite is not None and any(
                "not what the trainer wrote" in failed.get(u, "") for u in redo
            ):
                rewrite()  # the file was changed after it was written: write it again
                rewrite = None
            if left() <= 0:
                break
            refits = [self.pool.submit(self._refit, engines[u], body, left()) for u in redo]
            done, _ = wait(refits, timeout=max(0.0, left()))
            again = [f.result() if f in done else "no answer within the sync's timeout"
                     for f in refits]  # fmt: skip
            failed = {u: why for u, why in zip(redo, again, strict=True) if why is not None}
            for url, why in failed.items():
                self.quarantine(engines[url], version, f"the refit failed again: {why}")
            todo, redo = [u for u in redo if u not in failed], list(failed)
        return ok, [u for u in [*missed, *confirmed, *failed] if u not in ok]

    def _refit(self, eng: EngineRecord, body: dict[str, Any], timeout: float) -> str | None:
        """Ask ``eng`` to load the version again; None when it confirmed, else why not."""
        try:
            got = self._update(eng, body, timeout)
        except (RequestFailure, MalformedAnswer) as f:
            return str(f)
        return None if got == body["version"] else f"it confirmed version {got}"
