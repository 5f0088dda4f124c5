"""Configuration of hot spares and fast dead-node detection (section [spares], env
TRAINGUARD_SPARES_*).

Example::

    [spares]
    dead_after_s = 2.5      # a node whose liveness beacon stood still this long is dead
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(kw_only=True, slots=True)
class SparesConfig:
    enabled: bool = True
    """Liveness beacons, dead-node removal from the rendezvous and spare bookkeeping (dynamic
    rendezvous backends: c10d, etcd-v3). Off: torch's keep-alive expiry alone finds dead nodes
    (~15 s with its defaults) and a spare surplus can keep a wait list (restart loop)."""
    beacon_interval_s: float = 0.5
    """How often each agent advances its liveness counter in the rendezvous store."""
    dead_after_s: float = 2.5
    """A node whose counter has not advanced for this long is removed from the rendezvous
    (torch's keep-alive expiry stays as the fallback for nodes without a beacon)."""
    poll_s: float = 0.25
    """How often an agent that waits in a rendezvous reads the state and the beacons."""
    beacon_writes_per_s: float = 150.0
    """The most liveness requests a second all the job's agents make together (beacon writes
    on c10d; on etcd-v3, keep-alives of the nodes' heartbeat leases, which write nothing). A
    job of more than ``beacon_writes_per_s x beacon_interval_s`` nodes (75 at the defaults)
    beats less often, its ``poll_s`` stretched by the same factor and ``dead_after_s`` at
    least three beats (see :meth:`for_nodes`): liveness costs the store the same at any size
    (1000 agents beating every 0.5 s saturated a 2-core etcd and the rendezvous round with it;
    at 1000 nodes: a beat every 6.7 s, dead after 20 s)."""

    def __post_init__(self) -> None:
        if self.beacon_interval_s <= 0 or self.poll_s <= 0 or self.beacon_writes_per_s <= 0:
            raise ValueError("beacon_interval_s, poll_s and beacon_writes_per_s must be > 0")
        if self.dead_after_s < 3 * self.beacon_interval_s:
            raise ValueError(
                f"dead_after_s ({self.dead_after_s}) must be at least 3 x beacon_interval_s "
                f"({self.beacon_interval_s}): a live node would be declared dead"
            )

    def for_nodes(self, nodes: int) -> SparesConfig:
        """These settings for a job of ``nodes`` agents: the beacon interval stretched so that
        the agents together make at most ``beacon_writes_per_s`` liveness requests a second,
        the reaper's poll by the same factor, ``dead_after_s`` at least three intervals
        (unchanged for a smaller job). Every agent derives the same values from the job's
        ``--nnodes`` maximum."""
        interval = max(self.beacon_interval_s, nodes / self.beacon_writes_per_s)
        if interval <= self.beacon_interval_s:
            return self
        f = interval / self.beacon_interval_s
        return replace(
            self,
            beacon_interval_s=interval,
            dead_after_s=max(self.dead_after_s, 3 * interval),
            poll_s=self.poll_s * f,
        )
