"""One node's heartbeat key (``heartbeat/<node>``) and its lease: the node's liveness on etcd.

The key's lease has the TTL of torch's dead-node threshold; keeping it alive writes nothing
to etcd's log. Either the state holder renews it as torch's keep-alive comes due, or (a hot
spare's liveness) a thread of its own does, every period, whatever the rendezvous is doing
(:meth:`NodeLease.keep_alive`)."""

from __future__ import annotations

import logging
import math
import random
import threading
import time

from trainguard.runtime.etcd_v3.backend import EtcdV3RendezvousBackend

__all__ = ["NodeLease"]

logger = logging.getLogger(__name__)


class NodeLease:
    """This node's heartbeat key, its last renewal, and the thread that keeps it alive."""

    def __init__(self, backend: EtcdV3RendezvousBackend, key: str) -> None:
        self._etcd = backend
        self.key = key
        """The node's key (``repr`` of its ``NodeDesc``)."""
        self.renewed = -float("inf")
        """When (monotonic) this node last renewed its heartbeat lease or wrote its key."""
        self._period: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def put(self, t: float) -> None:
        """Write the key with the keep-alive time ``t`` (unix s), renewing its lease; raises
        what the backend raises (``RendezvousConnectionError``)."""
        self._etcd.put_heartbeat(self.key, t)
        self.renewed = time.monotonic()

    @property
    def own_thread(self) -> bool:
        """The lease is kept alive by its own thread (see :meth:`keep_alive`)."""
        return self._thread is not None and not self._stop.is_set()

    def keep_alive(self, period_s: float, ttl_s: float) -> None:
        """This node's liveness from now on: its heartbeat lease (TTL ``ttl_s``, whole seconds
        up) kept alive every ``period_s`` from a thread of its own, whatever the rendezvous is
        doing (the hot spares' liveness on etcd-v3, instead of a beacon written to the store).
        A keep-alive is no write to etcd's log and no new revision, so that the nodes watching
        others' keys see nothing while every node lives; a node is dead when its key is gone
        (its lease expired: ``ttl_s`` without a keep-alive). torch's own keep-alive then
        sends nothing (it would renew the same lease again)."""
        self._etcd.heartbeat_ttl = max(2, math.ceil(ttl_s))
        self._period = period_s
        if self._thread is None:
            self._renew()  # the key exists before this node is listed anywhere
            self._thread = threading.Thread(target=self._run, name="tg-rdzv-lease", daemon=True)
            self._thread.start()

    def _renew(self) -> None:
        try:
            self.put(time.time())
        except Exception as e:  # etcd unreachable: the next period tries again
            logger.debug("heartbeat lease not renewed: %s", e)

    def _run(self) -> None:
        # the first wait at random within a period: agents that started together (a job's
        # launch, a thousand at once) keep their leases alive spread over the period, not in
        # bursts of a thousand requests
        wait = random.uniform(0.0, self._period or 0.0)
        while self._period is not None and not self._stop.wait(wait):
            self._renew()
            wait = self._period

    def stop(self, *, left: bool) -> None:
        """Stop keeping the lease alive; ``left``: say at once that the node left (its key
        says so), else it expires after its TTL (a node that dies without a word)."""
        if self._thread is None or self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        if left:
            try:
                self._etcd.heartbeat_left(self.key)
            except Exception as e:
                logger.debug("heartbeat tombstone not written: %s", e)
