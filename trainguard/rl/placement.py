"""Where the engines run now: the placement the role supervisors publish.

Each replica's supervisor writes its state file (``RUN_DIR/roles/<role>/<i>.json``: its URL,
node and state). A restart keeps a replica's URL; a re-placement (its role node lost, a spare
node running it: :mod:`trainguard.roles.nodeloss`) moves it to the spare's address. The
fleet endpoint (:mod:`trainguard.rl.router`) and the trainer's rollout client
(:mod:`trainguard.rl.client`) both follow it with :class:`PlacementFollower`, without a
restart.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from urllib.parse import urlsplit

from trainguard.core.contracts.engine import ReplicaStatus
from trainguard.core.contracts.rundir import RunDir

__all__ = ["GONE", "PlacementFollower", "published_placement"]

logger = logging.getLogger(__name__)

GONE = frozenset({ReplicaStatus.FAILED, ReplicaStatus.STOPPED, ReplicaStatus.RETIRED})
"""Published replica states that are no longer part of the placement."""


def _loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    return host == "localhost" or host.startswith("127.") or host == "::1"


def published_states(
    run_dir: str | os.PathLike[str] | None, role: str = "rollout"
) -> list[dict[str, object]]:
    """The role's published replica states (never raises)."""
    if not run_dir:
        return []
    try:
        return RunDir(run_dir).role_states().get(role, [])
    except OSError:
        return []


def published_placement(
    base: Sequence[str], states: Sequence[Mapping[str, object]], node: str = ""
) -> list[str]:
    """The engines' URLs: ``base`` (replica ``i`` first), each replica's replaced by the URL its
    supervisor published, without the replicas published as failed, retired or stopped.
    ``node``: this node's name; a replica published on loopback by another node (beside
    another trainer node) is that node's, never followed here."""
    base = [u.rstrip("/") for u in base]
    by_index: dict[int, str] = dict(enumerate(base))
    for rep in states:
        idx, url, state = rep.get("replica"), rep.get("url"), rep.get("state")
        if not isinstance(idx, int) or not isinstance(url, str):
            continue
        url = url.rstrip("/")
        other = rep.get("node")
        if node and other and other != node and _loopback(url):
            continue  # another trainer node's own replica, on its own loopback
        if state in GONE:
            by_index.pop(idx, None)
        else:
            by_index[idx] = url
    return list(dict.fromkeys(by_index[i] for i in sorted(by_index)))


class PlacementFollower:
    """Calls ``apply(urls)`` with the published placement every ``interval_s`` (from a
    daemon thread) when it changed; ``apply`` raising ValueError (a bad URL published) keeps
    the last good placement."""

    def __init__(
        self,
        base: Sequence[str],
        run_dir: str | os.PathLike[str],
        apply: Callable[[list[str]], object],
        interval_s: float,
        *,
        node: str = "",
        role: str = "rollout",
    ) -> None:
        self.base = [u.rstrip("/") for u in base]
        self.run_dir = run_dir
        self.node = node
        self.role = role
        self._apply = apply
        self.interval_s = interval_s
        self._last: list[str] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def placement(self) -> list[str]:
        return published_placement(self.base, published_states(self.run_dir, self.role), self.node)

    def refresh(self) -> None:
        urls = self.placement()
        if urls == self._last:
            return
        try:
            self._apply(urls)
        except ValueError as e:
            logger.warning("engine placement not followed: %s", e)
            return
        self._last = urls

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="engine-placement", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.refresh()
            except Exception:  # never into the caller
                logger.exception("following the engine placement failed")

    def stop(self) -> None:
        self._stop.set()
