"""The deadline of the rendezvous a node runs on etcd-v3, and the error of one that ends at it.

torch's handler gives a rendezvous its join timeout; on this backend an etcd call unanswered
for the client's ``retry_timeout`` retries on until that deadline instead of ending the
rendezvous, and a round that does not complete by then ends with one line saying what it
lacked (:meth:`RoundDeadline.incomplete`) and what etcd did (:meth:`RoundDeadline.unavailable`).
The handler (``trainguard.runtime._torch.QuietKeepAliveHandler``) reaches it as its state
holder's ``deadline``."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousSettings

from trainguard.runtime._torch import NodeDesc, RendezvousState
from trainguard.runtime.etcd_v3._common import EtcdUnavailableError
from trainguard.runtime.etcd_v3.backend import EtcdV3RendezvousBackend

__all__ = ["RoundDeadline"]


class RoundDeadline:
    """One node's rendezvous deadline: set by torch (:meth:`round_deadline`), applied to the
    etcd calls of the thread that runs the rendezvous (:meth:`in_rendezvous`)."""

    def __init__(
        self,
        backend: EtcdV3RendezvousBackend,
        settings: RendezvousSettings,
        node: NodeDesc,
        state: Callable[[], RendezvousState],
        lost: dict[str, str],
    ) -> None:
        self._etcd = backend
        self._settings = settings
        self._node = node
        self._state = state
        """The state the node holds now."""
        self._lost = lost
        """Nodes taken out of a round for their liveness (node -> what happened), as the state
        holder records them."""
        self._deadline: float | None = None
        """torch's deadline (monotonic) of the rendezvous this node runs (its join timeout from
        the start of ``next_rendezvous``, or from leaving the redundancy list)."""
        self._thread: int | None = None

    @contextlib.contextmanager
    def in_rendezvous(self) -> Iterator[None]:
        """While this thread runs torch's ``next_rendezvous``: an etcd call unanswered for the
        client's ``retry_timeout`` retries on (backoff with jitter) until the rendezvous'
        deadline (:meth:`retry_until`) instead of ending the rendezvous: a round whose etcd
        stalls for a while still completes, and one that etcd keeps from completing ends at
        its join timeout with :meth:`unavailable`'s error."""
        self._deadline = None
        self._thread = threading.get_ident()
        try:
            with self._etcd._client.retrying_until(self.retry_until):
                yield
        finally:
            self._thread = None

    @contextlib.contextmanager
    def retrying_for(self, seconds: float) -> Iterator[None]:
        """Like :meth:`in_rendezvous` for what a node does in its round's store right after
        torch's round (trainguard's member announcements): an unanswered etcd call retries
        for ``seconds`` from now, not only the client's ``retry_timeout``."""
        until = time.monotonic() + seconds
        with self._etcd._client.retrying_until(lambda: until):
            yield

    def round_deadline(self, deadline: float) -> None:
        """torch set the join deadline (monotonic) of the rendezvous this thread runs."""
        if threading.get_ident() == self._thread:
            self._deadline = deadline

    def retry_until(self) -> float:
        """Until when an etcd call of this node's rendezvous retries: torch's join deadline;
        for ever for a spare in the redundancy list of an open round (torch applies no
        timeout there: it waits for a free slot however long that takes)."""
        st = self._state()
        if self._node in st.redundancy_list and not st.closed:
            return float("inf")
        return -float("inf") if self._deadline is None else self._deadline

    def unavailable(self, timeout: timedelta, error: Exception) -> str | None:
        """The error of a rendezvous that ``error`` (etcd unanswered) ended at its join
        deadline: :meth:`incomplete`'s line, and what etcd did; None for any other error (an
        error before the deadline is raised as is)."""
        if not isinstance(error, EtcdUnavailableError) or self._deadline is None:
            return None
        if time.monotonic() < self._deadline:
            return None
        return self.incomplete(timeout, etcd=str(error))

    def incomplete(self, timeout: timedelta, etcd: str | None = None) -> str:
        """Why the round this node waits in did not complete in ``timeout``: the nodes there
        are (as this node last read them), the ones missing, and those taken out for their
        liveness (one line); ``etcd``: what etcd did meanwhile (it did not answer)."""
        st = self._state()
        s = self._settings
        have = len(set(st.participants) | {self._node})  # this node took itself out at the end
        text = (
            f"rendezvous '{s.run_id}': round {st.round} did not complete in "
            f"{timeout.total_seconds():.0f} s (join_timeout): {have} of {s.min_nodes} node(s) "
            f"joined (min {s.min_nodes}, max {s.max_nodes})"
        )
        there = {repr(p) for p in st.participants}
        gone = {n: why for n, why in self._lost.items() if n not in there}
        missing = [f"{n} ({why})" for n, why in sorted(gone.items())]
        never = s.min_nodes - have - len(gone)
        if never > 0:
            missing.append(f"{never} node(s) that never joined")
        if missing:
            text += "; missing: " + ", ".join(missing)
        if etcd is not None:
            return (
                f"{text}; {etcd}: bring etcd back (check its health and load) or raise "
                "--rdzv-conf join_timeout"
            )
        return text + "; start the missing agents or raise --rdzv-conf join_timeout"
