"""A rendezvous handler wrapper: job-wide attempt numbers, round membership, and a fresh
worker store per round.

torch's dynamic rendezvous shares one TCPStore server (hosted by the rank-0 agent) across every
worker-group attempt (``TORCHELASTIC_USE_AGENT_STORE=True``). Workers call
``init_process_group`` against it with the same keys every attempt, so a restarted worker can
read a dead worker's address and fail or hang forever in ``init_process_group``
(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` avoids it, at the price of a different env contract).
This wrapper keeps the agent-store contract but hosts a *new* store server for every round on
the rank-0 node, so each attempt starts from an empty key space. It also keeps torch from
caching that address across rounds, which left a replacement node joining a later round
waiting forever for it.

The fresh store listens on the port torch itself publishes for the round (the round's
``MASTER_ADDR``/``MASTER_PORT`` keys), so a plain torchrun agent in the same rendezvous (a
cluster moved over node by node) reads the same address and its workers join the same store.
trainguard agents announce themselves in the round's store; a member that does not within
``member_timeout_s`` is recorded as a foreign agent instead of being waited for forever.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch.distributed import Store, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
)

from trainguard.core.storeutil import gather, parse_json
from trainguard.runtime._torch import reserved_bootstrap_port, take_reserved_port

__all__ = ["AttemptRendezvousHandler", "RoundInfo"]

logger = logging.getLogger(__name__)

_NO_SHARED_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

_flip_lock = threading.Lock()
_flip_depth = 0
_flip_saved: str | None = None


@contextlib.contextmanager
def _uncached_store_path() -> Iterator[None]:
    """``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` while torch's ``next_rendezvous`` runs (its
    uncached path), restored after. Process-wide and counted: handlers in several threads of
    one process (spares' tests, an embedding) overlap, and the last one out restores the
    user's value (two plain save/restore pairs interleaved would leave it set for good, and
    every process started afterwards would inherit it)."""
    global _flip_depth, _flip_saved
    with _flip_lock:
        if _flip_depth == 0:
            _flip_saved = os.environ.get(_NO_SHARED_STORE)
            os.environ[_NO_SHARED_STORE] = "1"
        _flip_depth += 1
    try:
        yield
    finally:
        with _flip_lock:
            _flip_depth -= 1
            if _flip_depth == 0:
                if _flip_saved is None:
                    os.environ.pop(_NO_SHARED_STORE, None)
                else:
                    os.environ[_NO_SHARED_STORE] = _flip_saved


def _user_uses_agent_store() -> bool | None:
    """torch's ``use_agent_store`` from the user's value while the variable is flipped; None
    when it is not (ask torch)."""
    with _flip_lock:
        if _flip_depth == 0:
            return None
        return _flip_saved != "1"


@dataclass(frozen=True, slots=True)
class RoundInfo:
    """What this node learned in one rendezvous round."""

    attempt: int
    """Job-wide attempt number, the same on every node of the round."""
    rank: int
    """This node's group rank."""
    world_size: int
    """Number of nodes in the round."""
    members: list[dict[str, Any]] = field(default_factory=list)
    """One entry per group rank: node, host, pid; ``{"foreign": True}`` for a rank whose agent
    is not trainguard's (a torchrun agent in the same rendezvous)."""

    @property
    def foreign_ranks(self) -> list[int]:
        return [r for r, m in enumerate(self.members) if m.get("foreign")]


def parse_member(raw: bytes | str) -> dict[str, Any] | None:
    """A rank's announcement (``{"node", "host", "pid", "last_attempt"}``, as
    :meth:`AttemptRendezvousHandler.next_rendezvous` writes it), or None when it is not one:
    with an etcd rendezvous any writer of the key prefix can put the key."""
    m = parse_json(raw)
    if type(m) is not dict:
        return None
    node, host, pid, last = (m.get(k) for k in ("node", "host", "pid", "last_attempt"))
    if type(node) is not str or type(host) is not str or len(node) + len(host) > 2048:
        return None
    if type(pid) is not int or type(last) is not int or not (pid >= 0 and -1 <= last < 1 << 31):
        return None
    return {"node": node, "host": host, "pid": pid, "last_attempt": last}


class AttemptRendezvousHandler(RendezvousHandler):
    """Delegates to torch's handler; adds attempt numbering, membership and fresh stores."""

    def __init__(
        self, inner: RendezvousHandler, *, node: str, member_timeout_s: float = 10.0
    ) -> None:
        self._inner = inner
        self._node = node
        self._member_timeout_s = member_timeout_s
        self._num_rounds = 0
        self._last_attempt = -1
        self._worker_store: TCPStore | None = None
        self.last_round: RoundInfo | None = None
        self.spares: Any = None
        """The node's :class:`trainguard.runtime.spares.SpareController` once attached."""

    # -- delegation ----------------------------------------------------------------------------
    def get_backend(self) -> str:
        return self._inner.get_backend()

    @property
    def use_agent_store(self) -> bool:
        # torch's answer from the user's value of the variable next_rendezvous flips (another
        # thread may be inside one)
        user = _user_uses_agent_store()
        return self._inner.use_agent_store if user is None else user

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        # The agent asks this every monitor tick while its workers run; a rendezvous backend
        # that cannot be reached right now (an etcd restart) must not kill a healthy job.
        try:
            waiting = self._inner.num_nodes_waiting()
            return self.spares.num_nodes_waiting(waiting) if self.spares else waiting
        except RendezvousConnectionError as e:
            logger.warning("rendezvous backend unreachable, assuming no node waits: %s", e)
            return 0

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        self._worker_store = None
        if self.spares is not None:
            self.spares.close()
        try:
            return self._inner.shutdown()
        except RendezvousConnectionError as e:
            logger.warning("could not close the rendezvous: %s", e)
            return False

    # -- the additions -------------------------------------------------------------------------
    @property
    def job_store(self) -> Store | None:
        """The backend's store, which outlives the rounds (torch's dynamic handler keeps it as
        ``_store``: c10d's TCPStore at the endpoint, etcd-v3's key space); None for static."""
        from trainguard.runtime._torch import handler_store

        store = handler_store(self._inner)
        return store if isinstance(store, Store) else None

    def leave(self, timeout_s: float = 10.0) -> bool:
        """Take this node out of the rendezvous now (it leaves, the job goes on): the others
        need not wait for its keep-alive to expire before the next round. Never raises."""
        try:
            from trainguard.runtime._torch import leave_rendezvous

            leave_rendezvous(self._inner, time.monotonic() + timeout_s)
            return True
        except Exception as e:  # a static backend, a store already gone
            logger.warning("could not leave the rendezvous (the others time it out): %s", e)
            return False

    def next_rendezvous(self) -> RendezvousInfo:
        # torch caches the shared store's address after the first round, so a node that joins
        # a later round (a replacement) waits forever for keys the old rank 0 never publishes
        # again. We host our own store every round anyway: ask torch for its uncached path.
        watching = self.spares.watching() if self.spares else contextlib.nullcontext()
        with _uncached_store_path(), reserved_bootstrap_port():
            try:
                with watching:
                    info = self._inner.next_rendezvous()
            except BaseException:
                take_reserved_port(-1)  # closes a port reserved in a round that failed
                raise
            if self.spares:
                self.spares.joined()
        bootstrap = info.bootstrap_store_info
        reserved = take_reserved_port(bootstrap.master_port if bootstrap is not None else -1)
        self._num_rounds += 1
        store, rank, world_size = info.store, info.rank, info.world_size
        static = self.get_backend() == "static"
        # Dynamic backends hand out a store prefixed by the round; the static one reuses one
        # store for every round, so our keys carry this node's round count there.
        prefix = f"trainguard/{self._num_rounds}/" if static else "trainguard/"

        me = {
            "node": self._node,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "last_attempt": self._last_attempt,
        }
        # an etcd stall here (right after a round of many nodes) retries for as long as the
        # announcements may take, as torch's round itself does until its join deadline
        after = getattr(self._inner, "after_round", None)
        with after(2 * self._member_timeout_s) if after is not None else contextlib.nullcontext():
            store.set(f"{prefix}member/{rank}", json.dumps(me))
            members = self._members(store, prefix, world_size)
        attempt = max(m.pop("last_attempt", -1) for m in members) + 1
        self._last_attempt = attempt
        self.last_round = RoundInfo(
            attempt=attempt, rank=rank, world_size=world_size, members=members
        )

        if static or bootstrap is None or not self.use_agent_store:
            if reserved is not None:
                reserved.close()  # rank 0's worker binds it itself
            return info
        return RendezvousInfo(
            store,
            rank,
            world_size,
            self._fresh_worker_store(store, rank, prefix, bootstrap, reserved),
        )

    def _members(self, store: Store, prefix: str, world_size: int) -> list[dict[str, Any]]:
        """Every rank's announcement; a rank that makes none in time runs another launcher."""
        keys = [f"{prefix}member/{r}" for r in range(world_size)]
        got = gather(store, keys, timeout_s=self._member_timeout_s)
        members: list[dict[str, Any]] = []
        for r, key in enumerate(keys):
            member = parse_member(got[key]) if key in got else None
            if member is not None:
                members.append(member)
            elif key in got:
                logger.warning(
                    "group rank %d of this rendezvous announced something that is not a "
                    "trainguard announcement (%r): the node is treated as not trainguard's",
                    r,
                    bytes(got[key][:80]),
                )
                members.append({"foreign": True, "group_rank": r})
            else:
                logger.warning(
                    "group rank %d of this rendezvous made no trainguard announcement within "
                    "%.0f s: its agent is not trainguard's (torchrun?); the job runs on torchrun's "
                    "contract with it, without trainguard's features on that node",
                    r,
                    self._member_timeout_s,
                )
                members.append({"foreign": True, "group_rank": r})
        return members

    def _fresh_worker_store(
        self,
        store: Store,
        rank: int,
        prefix: str,
        bootstrap: RendezvousStoreInfo,
        reserved: socket.socket | None = None,
    ) -> RendezvousStoreInfo:
        # torch picked a free port on the rank-0 node and published it in the round's
        # MASTER_ADDR/MASTER_PORT keys, where every agent (a torchrun one too) reads it: the
        # fresh store listens there, on the socket that has held the port since it was picked
        # (reserved_bootstrap_port), so no other process can take it in between.
        if rank == 0:
            # Dropping the previous server closes it: its workers are gone.
            self._worker_store = None
            self._worker_store = TCPStore(
                host_name=bootstrap.master_addr,
                port=bootstrap.master_port,
                is_master=True,
                multi_tenant=True,
                wait_for_workers=False,
                master_listen_fd=reserved.detach() if reserved is not None else None,
            )
        elif reserved is not None:
            reserved.close()
        logger.debug(
            "attempt %s uses worker store %s:%s",
            self._last_attempt,
            bootstrap.master_addr,
            bootstrap.master_port,
        )
        return bootstrap
