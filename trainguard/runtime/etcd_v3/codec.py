"""torch's rendezvous state in a compact JSON form, decoded once per revision per process.

torch's own backends store the state pickled. Unpickling a 1000-node state (a ``NodeDesc``
dataclass and a ``datetime`` per node and heartbeat) costs ~12 ms of CPU and every agent
reads the state several times per round; this JSON form (a node table plus indices) decodes
in a fraction of that. A state written by torch's stock holder (pickled) is still read.

A state at a given etcd revision never changes, so the decoded form is kept per
``(key, revision)`` for the process (a few entries): agents that read the same revision (a
restarted handler, or many simulated agents in one benchmark process) decode it once. Each
reader gets its own copy of the containers, since torch's handler edits the state in place.
"""

from __future__ import annotations

import json
import pickle
import threading
from collections import OrderedDict
from datetime import datetime, timezone
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousStateError

from trainguard.runtime._torch import NodeDesc, RendezvousState

__all__ = ["copy_state", "decode_state", "encode_state"]

_MAGIC = b"TGJ1"
_CACHE_SIZE = 4
_cache: OrderedDict[tuple[str, int], RendezvousState] = OrderedDict()
_cache_lock = threading.Lock()


def encode_state(st: RendezvousState) -> bytes:
    index: dict[NodeDesc, int] = {}
    nodes: list[list[Any]] = []

    def ix(n: NodeDesc) -> int:
        i = index.get(n)
        if i is None:
            i = index[n] = len(nodes)
            nodes.append([n.addr, n.pid, n.local_id])
        return i

    doc = {
        "round": st.round,
        "complete": st.complete,
        "closed": st.closed,
        "deadline": st.deadline.timestamp() if st.deadline else None,
        "participants": [[ix(n), r] for n, r in st.participants.items()],
        "wait": [ix(n) for n in st.wait_list],
        "redundancy": [ix(n) for n in st.redundancy_list],
        "beats": [[ix(n), t.timestamp()] for n, t in st.last_heartbeats.items()],
        "nodes": nodes,
    }
    return _MAGIC + json.dumps(doc, separators=(",", ":")).encode()


def _decode(bits: bytes) -> RendezvousState:
    if not bits.startswith(_MAGIC):
        try:
            return pickle.loads(bits)  # torch's own format (the stock state holder)
        except (pickle.PickleError, EOFError, AttributeError, ValueError) as exc:
            raise RendezvousStateError(
                "The rendezvous state is corrupt. See inner exception for details."
            ) from exc
    try:
        doc = json.loads(bits[len(_MAGIC) :])
        nodes = [NodeDesc(str(a), int(p), int(i)) for a, p, i in doc["nodes"]]
        st = RendezvousState()
        st.round = int(doc["round"])
        st.complete = bool(doc["complete"])
        st.closed = bool(doc["closed"])
        d = doc["deadline"]
        st.deadline = datetime.fromtimestamp(d, timezone.utc) if d is not None else None
        st.participants = {nodes[i]: int(r) for i, r in doc["participants"]}
        st.wait_list = {nodes[i] for i in doc["wait"]}
        st.redundancy_list = {nodes[i] for i in doc["redundancy"]}
        fromts = datetime.fromtimestamp
        utc = timezone.utc
        st.last_heartbeats = {nodes[i]: fromts(t, utc) for i, t in doc["beats"]}
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise RendezvousStateError(f"The rendezvous state in etcd is corrupt: {exc}") from None
    return st


def copy_state(st: RendezvousState) -> RendezvousState:
    """A copy whose containers the caller may edit (nodes and datetimes are immutable)."""
    out = RendezvousState()
    out.round, out.complete, out.closed, out.deadline = (
        st.round,
        st.complete,
        st.closed,
        st.deadline,
    )
    out.participants = dict(st.participants)
    out.wait_list = set(st.wait_list)
    out.redundancy_list = set(st.redundancy_list)
    out.last_heartbeats = dict(st.last_heartbeats)
    return out


def decode_state(bits: bytes, *, key: str = "", revision: int = 0) -> RendezvousState:
    """The state in ``bits`` (JSON or torch's pickle); cached per ``(key, revision)``."""
    if not revision:
        return _decode(bits)
    ck = (key, revision)
    with _cache_lock:
        st = _cache.get(ck)
        if st is not None:
            _cache.move_to_end(ck)
    if st is None:
        st = _decode(bits)
        with _cache_lock:
            _cache[ck] = st
            while len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
    return copy_state(st)


def remember(st: RendezvousState, *, key: str, revision: int) -> None:
    """Cache a state this process wrote at ``revision`` (its readers need not decode it)."""
    with _cache_lock:
        _cache[(key, revision)] = copy_state(st)
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
