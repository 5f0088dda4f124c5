"""The nodes' keep-alive times overlaid on a state just read: a node's time in the shared state
is that of the state's last write (keep-alives renew leases on this backend, not the state),
so before torch's dead-node check every node whose heartbeat key exists (its lease is alive)
gets the read's time, and one whose lease expired keeps its old one."""

from __future__ import annotations

import logging
import time
from datetime import datetime, timezone

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousSettings

from trainguard.runtime._torch import NodeDesc, RendezvousState
from trainguard.runtime.etcd_v3.backend import EtcdV3RendezvousBackend

__all__ = ["HeartbeatOverlay"]

logger = logging.getLogger(__name__)


class HeartbeatOverlay:
    """The overlay of one node's reads, and how long most leases have been gone at once."""

    def __init__(
        self, backend: EtcdV3RendezvousBackend, settings: RendezvousSettings, node: NodeDesc
    ) -> None:
        self._etcd = backend
        self._settings = settings
        self._node = node
        self.mass_since: float | None = None
        """When a read first found most heartbeat leases expired at once (see
        :meth:`mass_expiry`)."""

    def _threshold(self) -> float:
        s = self._settings
        return (s.keep_alive_interval * s.keep_alive_max_attempt).total_seconds()

    def stale(self, st: RendezvousState, fraction: float) -> bool:
        """Some node's keep-alive time in ``st`` is older than ``fraction`` of torch's
        dead-node threshold (keep_alive_interval x keep_alive_max_attempt)."""
        oldest = time.time() - self._threshold() * fraction
        return any(t.timestamp() < oldest for t in st.last_heartbeats.values())

    def apply(self, st: RendezvousState, beat_at: datetime | None) -> None:
        """The read's time for every node of ``st`` whose heartbeat key exists (its lease is
        alive): one keys-only read of the heartbeat keys. ``beat_at``: this node's own last
        keep-alive (torch's timer)."""
        threshold = self._threshold()
        # etcd failed to renew this node's own lease within the threshold (overloaded or
        # unreachable): the leases it let expire meanwhile prove nothing, every node is alive
        trusted = time.monotonic() - self._etcd.trouble_at() > threshold
        live = self._etcd.live_nodes() if trusted else set()
        now = datetime.now(timezone.utc)
        hb = st.last_heartbeats
        # a participant of a complete round: its round is decided (a dead peer fails the
        # group; the spares' reapers free its slot). It is alive itself, and most leases gone
        # at once stay an overloaded etcd however long that lasts: after 15 s of 750 of 1000
        # leases lapsed together, one such read took those live nodes and this one out of the
        # round, and its next write (itself to the wait list) left 249 in it
        decided = st.complete and self._node in st.participants
        if trusted:
            trusted = not self.mass_expiry(hb, live, threshold, forever=decided)
        for node, when in hb.items():
            if node == self._node:  # this node's own: its last keep-alive (torch's timer)
                if decided:
                    hb[node] = now
                elif beat_at is not None and beat_at > when:
                    hb[node] = beat_at
            elif not trusted or repr(node) in live:
                hb[node] = now

    def mass_expiry(
        self, hb: dict[NodeDesc, datetime], live: set[str], threshold: float, forever: bool = False
    ) -> bool:
        """More than a twentieth of the nodes (and more than two) lost their heartbeat leases
        at once, for less than the dead-node threshold so far: an etcd too loaded to renew
        leases in time (at 1000 nodes on two cores, 621 live nodes' leases expired together
        and a reader's next write dropped them from the round; 159 of 871 at once in another
        run), not as many dead nodes. Their times are kept until the expiry has lasted the
        threshold (a live node renews its lease, or grants a new one, within that) or fewer
        are missing; ``forever``: however long it lasts (a participant of a complete round)."""
        missing = sum(1 for n in hb if n != self._node and repr(n) not in live)
        if missing <= max(2, len(hb) // 20):
            self.mass_since = None
            return False
        now = time.monotonic()
        if self.mass_since is None:
            self.mass_since = now
            logger.warning(
                "rendezvous %s: %d of %d nodes' heartbeat leases expired at once; taken for "
                "an overloaded etcd, not dead nodes, for up to %.0f s",
                self._settings.run_id,
                missing,
                len(hb),
                threshold,
            )
        return forever or now - self.mass_since < threshold
