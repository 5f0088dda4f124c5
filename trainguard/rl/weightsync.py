"""The rollout client's weight sync: a weight version pushed to every live engine in parallel
under a timeout derived from the measured sync times; an engine that does not confirm (its
answer parsed by the engine contract's one parser) leaves routing until its health reports the
new version (it refits itself from the weight store)."""

from __future__ import annotations

import logging
import statistics
import time
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Any

from trainguard.core.engine_contract import (
    WEIGHT_UPDATE_PATH,
    MalformedAnswer,
    parse_weight_update,
)
from trainguard.rl.rollout_types import EngineState, RolloutConfig, SyncResult
from trainguard.rl.routing import EngineRecord, EngineTable, RequestFailure

__all__ = ["WeightSync"]

logger = logging.getLogger(__name__)


class WeightSync:
    def __init__(self, table: EngineTable, pool: ThreadPoolExecutor, config: RolloutConfig) -> None:
        self.table = table
        self.pool = pool
        self.config = config
        self.times: list[float] = []

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

    def sync(self, version: int, path: str | None = None) -> SyncResult:
        table = self.table
        table.set_policy_version(version)
        timeout = self.timeout_s()
        with table.lock:
            targets = [
                e
                for e in table.engines.values()
                if e.state not in (EngineState.DEAD, EngineState.LOADING, EngineState.UNKNOWN)
            ]
        body: dict[str, Any] = {"version": version}
        if path is not None:
            body["path"] = path
        t0 = time.perf_counter()
        futs = {self.pool.submit(self._update, e, body, timeout): e for e in targets}
        done, _ = wait(list(futs), timeout=timeout)
        confirmed, missed = [], []
        with table.lock:
            for fut, eng in futs.items():
                ok = False
                if fut in done:
                    try:
                        ok = fut.result() == version
                    except (RequestFailure, MalformedAnswer):
                        ok = False
                    except Exception:  # any other failure: not confirmed, never raised
                        logger.exception("weight update of %s failed", eng.url)
                        ok = False
                if ok:
                    eng.version = version
                    if eng.state is EngineState.STALE:
                        eng.state = EngineState.SERVING
                    confirmed.append(eng.url)
                else:
                    if eng.state is EngineState.SERVING:
                        eng.state = EngineState.STALE
                    missed.append(eng.url)
            table.lock.notify_all()
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
