"""torch's rendezvous state in a compact JSON form, decoded once per revision per process.

torch's own backends store the state pickled. Unpickling a 1000-node state (a ``NodeDesc``
dataclass and a ``datetime`` per node and heartbeat) costs ~12 ms of CPU and every agent
reads the state several times per round; this JSON form (a node table plus indices) decodes
in a fraction of that.

A state in torch's pickle format (written by torch's stock state holder) is refused unless
the reader opted in (``accept_pickle``, ``--rdzv-conf accept_pickle_state=1``): unpickling runs
whatever code its writer put in it, and anyone who can write the run's key in etcd can write
it. The stored value is zlib-packed (``TGZ1``); it is inflated to at most
:data:`MAX_STATE_BYTES`.

A state at a given etcd revision never changes, so the decoded form is kept per
``(key, revision)`` for the process (a few entries): agents that read the same revision (a
restarted handler, or many simulated agents in one benchmark process) decode it once. Each
reader gets its own copy of the containers, since torch's handler edits the state in place.
"""

from __future__ import annotations

import json
import pickle
import threading
import zlib
from collections import OrderedDict
from datetime import datetime, timezone
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousStateError

from trainguard.runtime._torch import NodeDesc, RendezvousState

__all__ = [
    "MAX_STATE_BYTES",
    "PICKLE_OPTION",
    "cached_state",
    "copy_state",
    "decode_state",
    "encode_state",
]

_MAGIC = b"TGJ1"
_PACKED = b"TGZ1"
MAX_STATE_BYTES = 64 << 20
"""The largest state (inflated) a reader accepts: a 10,000-node pickled state is ~10 MiB."""
PICKLE_OPTION = "accept_pickle_state"
"""The ``--rdzv-conf`` key that lets a reader unpickle a state in torch's own format."""
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


def pack(state: bytes) -> bytes:
    """A state as stored: compressed (it is mostly repeated node descriptors: a 1000-node state
    shrinks ~8x), so every write and read of it moves less through JSON, base64 and raft."""
    return _PACKED + zlib.compress(state, 1)


def unpack(value: bytes) -> bytes:
    """The state in a stored value (packed or not), inflated to at most MAX_STATE_BYTES;
    raises RendezvousStateError."""
    if not value.startswith(_PACKED):
        if len(value) > MAX_STATE_BYTES:
            raise RendezvousStateError(f"it is over {MAX_STATE_BYTES} bytes")
        return value
    inflate = zlib.decompressobj()
    try:
        out = inflate.decompress(value[len(_PACKED) :], MAX_STATE_BYTES + 1)
    except zlib.error as e:
        raise RendezvousStateError(f"it does not inflate ({e})") from None
    if len(out) > MAX_STATE_BYTES:
        raise RendezvousStateError(f"it inflates to over {MAX_STATE_BYTES} bytes")
    if not inflate.eof:
        raise RendezvousStateError("its compressed stream is truncated")
    return out


def _decode(value: bytes, accept_pickle: bool) -> tuple[RendezvousState, bool]:
    """The state and whether it was in the JSON form (only those are cached: an opted-in
    pickle must never reach another reader in this process that did not opt in)."""
    bits = unpack(value)
    if not bits.startswith(_MAGIC):
        if not accept_pickle:
            raise RendezvousStateError(
                "it is not trainguard's JSON form (a pickle, as torch's stock state holder "
                "writes, or garbage) and unpickling it would run whatever code its writer put "
                f"in it; where every writer of the key prefix is trusted, --rdzv-conf "
                f"{PICKLE_OPTION}=1 ([rendezvous] etcd_accept_pickle_state = true) reads it"
            )
        try:
            st = pickle.loads(bits)  # torch's own format (the stock state holder), opted in
        except Exception as exc:  # a corrupt pickle raises nearly anything
            raise RendezvousStateError(f"it does not unpickle ({exc!r})") from None
        if not isinstance(st, RendezvousState):
            raise RendezvousStateError(f"it unpickles to a {type(st).__name__}")
        return st, False
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
    except (
        ValueError,
        KeyError,
        TypeError,
        IndexError,
        OverflowError,
        OSError,
        RecursionError,
    ) as e:
        # OverflowError/OSError: a timestamp out of range; RecursionError: absurd nesting
        raise RendezvousStateError(f"it is corrupt JSON ({type(e).__name__}: {e})") from None
    return st, True


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


def decode_state(
    value: bytes, *, key: str = "", revision: int = 0, accept_pickle: bool = False
) -> RendezvousState:
    """The state in ``value`` (as stored, packed or not): trainguard's JSON, or torch's pickle
    with ``accept_pickle``; cached per ``(key, revision)``. Raises RendezvousStateError (one
    line: why it is refused) for anything else."""
    if not revision:
        return _decode(value, accept_pickle)[0]
    ck = (key, revision)
    with _cache_lock:
        st = _cache.get(ck)
        if st is not None:
            _cache.move_to_end(ck)
    if st is None:
        st, cacheable = _decode(value, accept_pickle)
        if not cacheable:
            return st
        with _cache_lock:
            _cache[ck] = st
            while len(_cache) > _CACHE_SIZE:
                _cache.popitem(last=False)
    return copy_state(st)


def cached_state(key: str, revision: int) -> RendezvousState | None:
    """A copy of the state of ``key`` at ``revision`` when this process decoded or wrote it
    lately (None: not cached)."""
    with _cache_lock:
        st = _cache.get((key, revision))
    return None if st is None else copy_state(st)


def remember(st: RendezvousState, *, key: str, revision: int) -> None:
    """Cache a state this process wrote at ``revision`` (its readers need not decode it)."""
    with _cache_lock:
        _cache[(key, revision)] = copy_state(st)
        while len(_cache) > _CACHE_SIZE:
            _cache.popitem(last=False)
