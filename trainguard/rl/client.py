"""The trainer's rollout client: prompts in, real generations out, or an explicit error.

``RolloutClient`` talks to a fleet of engines that speak the engine contract
(:mod:`trainguard.rl.engine`). It

- routes each request to the least-loaded routable engine: one that last reported
  ``serving`` with a weight version within the staleness bound of the trainer's version
  (``policy_version - max_staleness <= version <= policy_version``);
- parses every answer with the engine contract's one guarded parser
  (:mod:`trainguard.core.contracts.engine`): any answer that does not meet the contract (not
  JSON, too large or too deep, a token id outside the vocabulary, a non-finite log-prob, an
  absurd field) is a ``malformed`` failure, never an exception out of :meth:`generate`; a
  health answer from another process than the one the role supervisor started on the port
  (its ``incarnation``) keeps the engine out of routing;
- retries a failed request on another engine (an error, a timeout, a refused connection,
  HTTP 5xx, a malformed or incomplete answer, a version outside the bound), at most
  ``max_attempts`` times per request; a batch is complete with real generations, or
  :class:`RolloutError` is raised: a failed generation is never replaced by a placeholder,
  an empty or a zero-reward completion;
- probes every engine's ``/health`` in the background: a refused connection takes an engine
  out of routing at once, a probe that times out ``dead_after_failures`` times in a row
  (``health_interval_s`` apart, ``health_timeout_s`` each: about 6 s by default, within 10 s)
  declares it dead, and requests in flight on it are retried elsewhere at once;
- follows the placement the role supervisors publish in the job's run directory
  (:mod:`trainguard.rl.placement`): a replica re-placed on a spare node (its role node lost)
  is routed to at its new URL without a restart;
- pushes weight versions (:meth:`sync_weights`) to every live engine in parallel under a
  timeout derived from the measured sync times; an engine that does not confirm leaves
  routing until its health reports the new version (it refits itself from the weight store).

Failures are counted by reason (:data:`FAILURE_REASONS`), retries counted, request latency
recorded; :meth:`take_metrics` returns the figures of the last interval for ``tg.log``, and
``events`` (e.g. ``tg.events.emit``) receives one ``rollout_failed`` event per failure.

Engine states as the client sees them (:class:`EngineState`, the engine contract's
:class:`~trainguard.core.contracts.engine.ReplicaStatus`)::

    UNKNOWN → LOADING → SERVING ⇄ SUSPECT → DEAD → (restarted) LOADING → SERVING
                         SERVING ⇄ STALE (version outside the bound; back after a refit)

The client is three parts: the engine table and routing (:mod:`trainguard.rl.routing`), batch
dispatch (:mod:`trainguard.rl.dispatch`) and weight sync (:mod:`trainguard.rl.weightsync`).
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from trainguard.core.contracts import envvars
from trainguard.core.contracts.engine import Identity
from trainguard.core.contracts.rundir import RunDir
from trainguard.core.fleetauth import token_from_env
from trainguard.rl.dispatch import Batch, BatchDispatcher, RolloutCounters, request_params
from trainguard.rl.placement import PlacementFollower
from trainguard.rl.rollout_types import (
    FAILURE_REASONS,
    REWARD_URLS_ENV,
    ROLLOUT_URLS_ENV,
    Completion,
    EngineState,
    RolloutConfig,
    RolloutError,
    SyncResult,
    urls_from_env,
)
from trainguard.rl.routing import EngineTable, IdentitySource
from trainguard.rl.weightsync import WeightSync

__all__ = [
    "FAILURE_REASONS",
    "REWARD_URLS_ENV",
    "ROLLOUT_URLS_ENV",
    "Completion",
    "EngineState",
    "RolloutClient",
    "RolloutConfig",
    "RolloutError",
    "SyncResult",
    "urls_from_env",
]

logger = logging.getLogger(__name__)


def published_identities(run_dir: str | os.PathLike[str]) -> dict[str, Identity]:
    """What the role supervisor published of its replicas (their state files): URL →
    the identity of the process it started there (``pid``, ``incarnation``); never raises."""
    out: dict[str, Identity] = {}
    try:
        for role in RunDir(run_dir).role_states().values():
            for rep in role:
                url, pid, inc = rep.get("url"), rep.get("pid"), rep.get("incarnation")
                if isinstance(url, str):
                    out[url.rstrip("/")] = Identity(
                        pid if isinstance(pid, int) and not isinstance(pid, bool) else None,
                        inc if isinstance(inc, str) else None,
                    )
    except OSError:  # no run dir: nothing published
        pass
    return out


def supervisor_identities() -> IdentitySource | None:
    """The incarnation the role supervisor published for each replica's URL, read from the
    run directory (:func:`trainguard.core.contracts.envvars.run_dir`); None outside
    a job."""
    run_dir = envvars.run_dir()
    if not run_dir:
        return None

    def read() -> Mapping[str, Identity]:
        # the nonce only: it passes through a wrapper process, the pid would not
        return {
            url: Identity(None, i.incarnation)
            for url, i in published_identities(run_dir).items()
            if i.incarnation is not None
        }

    return read


class RolloutClient:
    """See the module docstring. ``urls`` default to ``$TRAINGUARD_ROLLOUT_URLS``;
    ``identities`` (URL → the process expected there) default to what the role supervisor
    published in the job's run directory."""

    def __init__(
        self,
        urls: Sequence[str] | None = None,
        *,
        config: RolloutConfig | None = None,
        events: Callable[..., object] | None = None,
        start: bool = True,
        identities: IdentitySource | None = None,
        token: str | None = None,
        fingerprints: Callable[[int], dict[str, Any] | None] | None = None,
    ) -> None:
        """``token``: the job's ``rollout`` token (default: ``$TRAINGUARD_ROLLOUT_TOKEN``): every
        request is signed with it, every answer must be signed with it. ``fingerprints``: the
        trainer's fingerprint of a weight version (e.g. ``lambda v:
        store.meta(v).get("fingerprint")``); given, an engine is routed version ``v`` only once
        its answers matched it (:mod:`trainguard.rl.verify`), and one that does not match is
        quarantined and refit."""
        from_env = urls is None
        urls = list(urls) if urls is not None else urls_from_env()
        if not urls:
            raise ValueError(
                f"no rollout engines: pass urls or set {ROLLOUT_URLS_ENV} "
                "(trainguard run sets it for a job with a rollout role)"
            )
        self.config = config or RolloutConfig()
        self._events = events
        self.table = EngineTable(
            urls,
            self.config,
            identities=identities or supervisor_identities(),
            token=token or token_from_env("rollout"),
        )
        self._pool = ThreadPoolExecutor(
            max_workers=max(8, 4 * len(urls)), thread_name_prefix="rollout"
        )
        self.counters = RolloutCounters()
        self.dispatcher = BatchDispatcher(
            self.table, self._pool, self.config, self.counters, self._emit
        )
        self.weight_sync = WeightSync(
            self.table, self._pool, self.config, fingerprints=fingerprints, events=self._emit
        )
        run_dir = envvars.run_dir() if from_env else None
        self.placement = (
            PlacementFollower(
                urls,
                run_dir,
                self.table.set_urls,
                self.config.health_interval_s,
                node=os.environ.get(envvars.NODE, ""),
            )  # fmt: skip
            if run_dir
            else None
        )
        """Given no ``urls`` inside a job: follows the published placement."""
        if start:
            self.start()

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self.table.start()
        if self.placement is not None:
            self.placement.start()

    def close(self) -> None:
        if self.placement is not None:
            self.placement.stop()
        self.table.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _emit(self, kind: str, **fields: object) -> None:
        if self._events is not None:
            try:
                self._events(kind, **fields)
            except Exception:  # telemetry never stops the rollout
                logger.exception("could not record a %s event", kind)

    # -- the engine table --------------------------------------------------------------------
    @property
    def policy_version(self) -> int | None:
        return self.table.policy_version

    @property
    def failures(self) -> Counter[str]:
        """Failed requests by reason, since the client started."""
        return self.counters.failures

    @property
    def retries(self) -> int:
        return self.counters.retries

    def engines(self) -> dict[str, dict[str, Any]]:
        """Each engine's state as the client sees it."""
        return self.table.summary()

    def num_serving(self) -> int:
        return self.table.num_serving()

    def wait_serving(self, min_engines: int = 1, timeout: float = 120.0) -> int:
        """Block until ``min_engines`` are routable; their number. RolloutError at timeout."""
        return self.table.wait_serving(min_engines, timeout)

    # -- generation --------------------------------------------------------------------------
    def generate(
        self,
        prompts: Sequence[str],
        *,
        n: int = 1,
        max_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        logprobs: bool = False,
        seed: int | Sequence[int] | None = None,
    ) -> list[list[Completion]]:
        """``n`` real completions for each prompt (outer list in prompt order), or
        :class:`RolloutError` after ``max_attempts`` failed attempts of one request or
        ``batch_timeout_s``. An HTTP 4xx (the request itself is bad) raises at once. With
        ``drop_failed_groups``, the prompts of a request out of attempts get no completion
        (an empty group) and the batch goes on.

        ``seed``: reproducible sampling (:mod:`trainguard.rl.sampling`): one seed per prompt
        (e.g. :func:`~trainguard.rl.sampling.prompt_seed` of the run's seed, the epoch and
        the prompt's id), or an int ``s`` seeding prompt ``i`` with
        :func:`~trainguard.rl.sampling.request_seed` ``(s, i)``. Sample ``j`` of a prompt
        seeded ``t`` draws from the stream ``t + j``, whichever engine serves it and
        whatever else it generates at the same time."""
        if not prompts:
            return []
        if seed is not None and not isinstance(seed, int):
            seed = [int(x) for x in seed]
            if len(seed) != len(prompts):
                raise ValueError(f"{len(seed)} seeds for {len(prompts)} prompts: give one each")
        batch = Batch(
            prompts=list(prompts),
            params=request_params(n, max_tokens, temperature, top_p, logprobs),
            n=n,
            seed=seed,
            chunk_size=self.config.prompts_per_request,
            deadline=time.monotonic() + self.config.batch_timeout_s,
        )
        return self.dispatcher.run(batch)

    # -- weight sync -------------------------------------------------------------------------
    def sync_timeout_s(self) -> float:
        return self.weight_sync.timeout_s()

    def set_policy_version(self, version: int) -> None:
        """The trainer's current version (engines outside the bound leave routing)."""
        self.table.set_policy_version(version)

    def assume_version(self, urls: Sequence[str], version: int) -> None:
        """Another process (trainer rank 0) saw ``urls`` confirm ``version``: route to them
        without waiting for this client's next health probe."""
        self.table.assume_version(urls, version)

    def urls_at(self, version: int) -> list[str]:
        """Engines last seen serving ``version``."""
        return self.table.urls_at(version)

    def sync_weights(
        self, version: int, *, rewrite: Callable[[], object] | None = None
    ) -> SyncResult:
        """Make ``version`` the trainer's version and push it to every live engine in
        parallel (each loads it from the job's weight store: publish it there first). Returns
        after every engine confirmed or the timeout passed; an engine
        that did not confirm stays out of routing until it reports the version.

        With ``fingerprints``, each confirmation is checked; an engine whose refit failed
        (its update answered an error, or its answers did not match) is quarantined and
        refit again; ``rewrite`` (the trainer publishing ``version`` again) is called once
        first when an engine found the file not to be what was written."""
        return self.weight_sync.sync(version, rewrite=rewrite)

    @property
    def refits_verified(self) -> Counter[str]:
        """Verified refits per engine URL, since the client started."""
        return self.weight_sync.verified

    @property
    def refits_quarantined(self) -> Counter[str]:
        """Quarantines per engine URL, since the client started."""
        return self.weight_sync.quarantined

    # -- metrics -----------------------------------------------------------------------------
    def take_metrics(self) -> dict[str, float]:
        """The rollout figures since the last call, named for ``tg.log``."""
        c = self.counters
        with self.table.lock:
            lat = sorted(c.latencies)
            now = time.monotonic()
            out: dict[str, float] = {
                "rollout_requests": len(lat),
                "rollout_retries": c.interval_retries,
                "rollout_failed": sum(c.interval_failures.values()),
                "engines_serving": sum(
                    self.table.routable(e, now) for e in self.table.engines.values()
                ),
                "engines_total": len(self.table.engines),
            }
            if lat:
                out["rollout_latency_p50_s"] = lat[len(lat) // 2]
                out["rollout_latency_p99_s"] = lat[min(len(lat) - 1, int(0.99 * len(lat)))]
            if c.gen_s > 0:
                out["rollout_tokens_per_s"] = c.tokens / c.gen_s
            for reason, k in c.interval_failures.items():
                out[f"rollout_failed_{reason}"] = k
            c.latencies, c.interval_failures, c.interval_retries = [], Counter(), 0
            c.tokens, c.gen_s = 0, 0.0
            return out
