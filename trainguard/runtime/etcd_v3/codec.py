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
import math
import pickle
import threading
import zlib
from collections import OrderedDict
from datetime import datetime, timezone
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousStateError

from trainguard.runtime._torch import NodeDesc, RendezvousState

__all__ = [
    "MAX_JSON_STATE_BYTES",
    "MAX_STATE_BYTES",
    "MAX_ENTRY_BYTES",
    "MAX_LOCK_HOLD_S",
    "key_suffix",
    "lock_until",
    "parse_join",
    "parse_json",
    "parse_lease",
    "PICKLE_OPTION",
    "cached_state",
    "copy_state",
    "decode_state",
    "encode_state",
    "gateway_json",
]

_MAGIC = b"TGJ1"
_PACKED = b"TGZ1"
MAX_STATE_BYTES = 64 << 20
"""The largest state (inflated) a reader accepts: a 10,000-node pickled state is ~10 MiB."""
MAX_JSON_STATE_BYTES = 16 << 20
"""The largest state in trainguard's JSON form a reader decodes: ~200,000 nodes (a 10,000-node
state is ~0.7 MiB)."""
MAX_NODE_RANK = 1 << 20
"""No node rank of a complete round is this large (a job of a million nodes)."""
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
    if len(bits) > MAX_JSON_STATE_BYTES:
        raise RendezvousStateError(f"its JSON form is over {MAX_JSON_STATE_BYTES} bytes")
    try:
        st = _from_doc(json.loads(bits[len(_MAGIC) :]))
    except RendezvousStateError:
        raise
    except Exception as e:  # whatever a hostile document makes the parser raise
        # OverflowError/OSError: a timestamp out of range; RecursionError: absurd nesting
        raise RendezvousStateError(f"it is corrupt JSON ({type(e).__name__}: {e})") from None
    return st, True


def _bad(what: str) -> RendezvousStateError:
    return RendezvousStateError(f"it is not a valid state ({what})")


def _index(i: Any, n: int) -> int:
    if type(i) is not int or not 0 <= i < n:
        raise _bad(f"node index {i!r} outside 0..{n - 1}")
    return i


def _time(t: Any) -> datetime:
    if type(t) not in (int, float) or not math.isfinite(t):
        raise _bad(f"time {t!r}")
    return datetime.fromtimestamp(t, timezone.utc)


def _from_doc(doc: Any) -> RendezvousState:
    """The state of a decoded JSON document, checked: every value of the expected type and
    range (node ids, pids, indices, the round: non-negative integers below 2**63), a node
    table of distinct nodes that are all referenced (no table larger than the state that uses
    it: its size is what decoding costs), and in a complete round distinct ranks. Raises
    RendezvousStateError (a missing field: KeyError, which the caller turns into one)."""
    if type(doc) is not dict:
        raise _bad("not an object")
    lists = _sized_lists(doc)
    nodes = _node_table(doc["nodes"])
    st = RendezvousState()
    _set_header(st, doc)
    used: set[int] = set()
    st.participants = _participants(lists["participants"], nodes, used)
    if st.complete:
        _check_complete_ranks(st.participants)
    st.wait_list = _node_set(lists["wait"], nodes, used, "wait")
    st.redundancy_list = _node_set(lists["redundancy"], nodes, used, "redundancy")
    st.last_heartbeats = _keep_alives(lists["beats"], nodes, used)
    if len(used) != len(nodes):
        raise _bad(f"{len(nodes) - len(used)} node(s) of its table referenced nowhere")
    return st


_LISTS = ("participants", "wait", "redundancy", "beats")


def _sized_lists(doc: dict[str, Any]) -> dict[str, list[Any]]:
    """The four lists that name nodes by index, checked against the node table's size before
    anything is decoded: no table larger than its references (its size is what decoding
    costs), no list longer than the table (each names a node at most once)."""
    table = doc["nodes"]
    lists = {k: doc[k] for k in _LISTS}
    if type(table) is not list or any(type(v) is not list for v in lists.values()):
        raise _bad("a table that is not a list")
    refs = sum(len(v) for v in lists.values())
    if len(table) > refs:
        raise _bad(f"{len(table)} nodes in its table, {refs} references")
    for name, v in lists.items():
        if len(v) > len(table):
            raise _bad(f"{len(v)} entries in {name}, {len(table)} nodes")
    return lists


def _node_table(table: list[Any]) -> list[NodeDesc]:
    """The node table: ``[addr, pid, local_id]`` each, an address of at most 1024 characters,
    pid and local id non-negative below 2**63, no node twice."""
    nodes: list[NodeDesc] = []
    for e in table:
        if type(e) is not list or len(e) != 3:
            raise _bad("a node that is not [addr, pid, local_id]")
        a, p, i = e
        if type(a) is not str or len(a) > 1024 or not all(_uint(x) for x in (p, i)):
            raise _bad(f"node {e!r}")
        nodes.append(NodeDesc(a, p, i))
    if len(set(nodes)) != len(nodes):
        raise _bad("a node listed twice in its table")
    return nodes


def _set_header(st: RendezvousState, doc: dict[str, Any]) -> None:
    """The round (non-negative), complete and closed (booleans) and the deadline (a finite
    time or null)."""
    rnd = doc["round"]
    if not _uint(rnd):
        raise _bad(f"round {rnd!r}")
    complete, closed = doc["complete"], doc["closed"]
    if type(complete) is not bool or type(closed) is not bool:
        raise _bad("complete/closed not true or false")
    d = doc["deadline"]
    st.round, st.complete, st.closed = rnd, complete, closed
    st.deadline = _time(d) if d is not None else None


def _participants(entries: list[Any], nodes: list[NodeDesc], used: set[int]) -> dict[NodeDesc, int]:
    """``[node index, rank]`` each, ranks non-negative, no node twice."""
    participants: dict[NodeDesc, int] = {}
    for e in entries:
        if type(e) is not list or len(e) != 2:
            raise _bad("a participant that is not [node, rank]")
        i, r = _index(e[0], len(nodes)), e[1]
        if not _uint(r):
            raise _bad(f"rank {r!r}")
        used.add(i)
        participants[nodes[i]] = r
    if len(participants) != len(entries):
        raise _bad("a participant listed twice")
    return participants


def _check_complete_ranks(participants: dict[NodeDesc, int]) -> None:
    """A complete round's ranks are those torch assigned, 0..n-1 each once; torch keeps a round
    complete when a participant leaves it (a dead node dropped), so gaps are legitimate:
    duplicates and absurd ranks are not."""
    ranks = sorted(participants.values())
    if len(set(ranks)) != len(ranks) or (ranks and ranks[-1] >= MAX_NODE_RANK):
        raise _bad(f"a complete round whose ranks are not distinct below {MAX_NODE_RANK}")


def _node_set(
    entries: list[Any], nodes: list[NodeDesc], used: set[int], name: str
) -> set[NodeDesc]:
    """The wait or redundancy list: node indices, none twice."""
    indices = [_index(i, len(nodes)) for i in entries]
    if len(set(indices)) != len(indices):
        raise _bad(f"a node listed twice in the {name} list")
    used.update(indices)
    return {nodes[i] for i in indices}


def _keep_alives(
    entries: list[Any], nodes: list[NodeDesc], used: set[int]
) -> dict[NodeDesc, datetime]:
    """``[node index, time]`` each, finite times, no node twice."""
    beats: dict[NodeDesc, datetime] = {}
    for e in entries:
        if type(e) is not list or len(e) != 2:
            raise _bad("a keep-alive that is not [node, time]")
        i = _index(e[0], len(nodes))
        used.add(i)
        beats[nodes[i]] = _time(e[1])
    if len(beats) != len(entries):
        raise _bad("a keep-alive listed twice")
    return beats


def _uint(x: Any) -> bool:
    return type(x) is int and 0 <= x < 1 << 63


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


# -- the small values read under the run's prefix, as hostile as the state ------------------------
MAX_ENTRY_BYTES = 64 << 10
"""The largest join request or admission lock a reader parses (either is under 200 bytes)."""
MAX_LOCK_HOLD_S = 60.0
"""The longest an admission lock counts as held past the moment a reader first saw it, whatever
its ``until`` says (its holder extends it every few seconds, which makes a new revision)."""


def parse_json(raw: bytes, *, max_bytes: int = MAX_ENTRY_BYTES) -> Any:
    """A small JSON value read from etcd, or None for anything else: over ``max_bytes``, not
    UTF-8, not JSON, nested past the parser's limit: every exception the parser may raise ends
    here, so that one put under the prefix never ends an agent."""
    if len(raw) > max_bytes:
        return None
    try:
        return json.loads(raw)
    except Exception:  # ValueError, UnicodeDecodeError, RecursionError, MemoryError...
        return None


def gateway_json(text: str | bytes) -> dict[str, Any]:
    """An answer of etcd's JSON gateway (keys and values inside it are base64: what a writer
    of the prefix put there cannot change its structure), or ValueError, which the client
    retries like any other bad answer, for anything that is not a JSON object."""
    try:
        doc = json.loads(text)
    except Exception as e:  # ValueError, RecursionError...
        raise ValueError(f"etcd answered something that is not JSON ({type(e).__name__})") from None
    if type(doc) is not dict:
        raise ValueError(f"etcd answered a JSON {type(doc).__name__}, not an object")
    return doc


def key_suffix(raw_key: bytes, prefix: str) -> str | None:
    """The part of a key read under ``prefix`` after it, or None for a key that is not UTF-8
    or not under ``prefix`` (skipped: anyone who can write the prefix can put such a key)."""
    try:
        key = raw_key.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return key[len(prefix) :] if key.startswith(prefix) else None


def parse_join(raw: bytes) -> tuple[NodeDesc, float] | None:
    """The node and time of a join request (``{"addr", "pid", "local_id", "t"}``), or None
    when it is not one."""
    j = parse_json(raw)
    if type(j) is not dict:
        return None
    a: Any = j.get("addr")
    p: Any = j.get("pid")
    i: Any = j.get("local_id")
    t: Any = j.get("t")
    if type(a) is not str or len(a) > 1024 or not _uint(p) or not _uint(i):
        return None
    if type(t) not in (int, float) or not math.isfinite(t):
        return None
    return NodeDesc(a, p, i), float(t)


def parse_lease(raw: bytes) -> int | None:
    """A lease id as the run's lease key holds it (decimal digits), or None: only a positive
    integer below 2**63 is one."""
    if not 0 < len(raw) <= 19 or not raw.isdigit():
        return None
    v = int(raw)
    return v if 0 < v < 1 << 63 else None


def lock_until(raw: bytes) -> float:
    """The ``until`` of an admission lock's value; 0.0 (expired) for anything that is not a
    finite time, so that a garbage lock is taken over instead of holding every round."""
    j = parse_json(raw)
    until: Any = j.get("until") if type(j) is dict else None
    if type(until) not in (int, float) or not math.isfinite(until):
        return 0.0
    return float(until)
