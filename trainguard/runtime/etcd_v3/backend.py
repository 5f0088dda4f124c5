"""The rendezvous backend: torch's state on one etcd key, compare-and-swap on its revision."""

from __future__ import annotations

import json
import logging
import random
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from trainguard.runtime._torch import NodeDesc, RendezvousState
from trainguard.runtime.etcd_v3._common import (
    BACKEND_NAME,
    DEFAULT_CAS_BACKOFF,
    DEFAULT_CAS_BACKOFF_MAX,
    DEFAULT_KEY_PREFIX,
    JOIN_BATCH,
    LeaseGoneError,
    _b64,
    _range_end,
    _unb64,
)
from trainguard.runtime.etcd_v3.admission_lock import AdmissionLock
from trainguard.runtime.etcd_v3.client import EtcdV3Client
from trainguard.runtime.etcd_v3.codec import (
    decode_state,
    key_suffix,
    parse_join,
    parse_lease,
)
from trainguard.runtime.etcd_v3.codec import pack as _pack
from trainguard.runtime.etcd_v3.codec import unpack as _codec_unpack

__all__ = ["HEARTBEAT_LEFT", "STATE_REFUSED_EVENT", "EtcdV3RendezvousBackend"]

logger = logging.getLogger(__name__)

HEARTBEAT_LEFT = "left"
"""A node's heartbeat key once it left the rendezvous (see :meth:`heartbeat_left`)."""

STATE_REFUSED_EVENT = "rdzv_state_refused"
"""The event an agent emits when it refuses the rendezvous state in etcd (key, revision,
reason); it then writes a fresh state over it."""


def _unpack(value: bytes) -> bytes:
    try:
        return _codec_unpack(value)
    except RendezvousStateError as e:
        raise RendezvousStateError(f"the rendezvous state in etcd is refused: {e}") from None


class EtcdV3RendezvousBackend(AdmissionLock, RendezvousBackend):
    """torch's ``RendezvousBackend`` on etcd v3: one key, compare-and-swap on its revision.

    A write is one transaction: ``mod_revision(key) == token`` (or ``create_revision == 0`` for
    the first write) → put. When it loses the race, the backend waits a random backoff that
    grows with this node's consecutive losses, then reads the newest state for the handler to
    decide again; a won race resets the backoff.
    """

    def __init__(
        self,
        client: EtcdV3Client,
        run_id: str,
        *,
        key_prefix: str = DEFAULT_KEY_PREFIX,
        backoff_base: float = DEFAULT_CAS_BACKOFF,
        backoff_cap: float = DEFAULT_CAS_BACKOFF_MAX,
        accept_pickle: bool = False,
    ) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self.accept_pickle = accept_pickle
        """Unpickle a state in torch's own format (an explicit opt-in: see the codec)."""
        self.on_refused: Callable[..., object] | None = None
        """Called as ``on_refused(key=, revision=, reason=)`` once per refused revision (the
        agent emits :data:`STATE_REFUSED_EVENT`); must not raise."""
        self.on_round_ended: Callable[..., object] | None = None
        """Called as ``on_round_ended(round=, left=)`` when this node, leaving a complete round
        first, ended it for every node (``left``: the other participants it took out of it,
        the lost node's among them after a node loss); must not raise."""
        self._refused_rev = -1
        self._client = client
        self._key = f"{key_prefix.rstrip('/')}/{run_id}/state"
        self._losses = 0
        self.joins_read_rev = 0
        """etcd's revision at the last :meth:`join_requests`."""
        self._backoff_base = backoff_base
        self._backoff_cap = backoff_cap
        self.writes = 0
        """Compare-and-swap attempts of this backend (won or lost)."""
        self.wins = 0
        """Compare-and-swap attempts that won."""
        self.heartbeat_ttl = 15
        """Seconds a node's heartbeat key lives without a keep-alive (the state holder sets
        torch's dead-node threshold: keep_alive_interval x keep_alive_max_attempt)."""
        self._hb_leases: dict[str, int] = {}
        self.lease_trouble = -float("inf")
        self._lock_seen: tuple[int, float] = (0, 0.0)
        """Monotonic time a heartbeat lease of this backend last failed to renew (etcd
        overloaded or unreachable, or the lease expired meanwhile)."""

    @property
    def name(self) -> str:
        return BACKEND_NAME

    @property
    def key(self) -> str:
        return self._key

    def decode(self, value: bytes, revision: int) -> RendezvousState | None:
        """The state stored at ``revision`` (``value`` as read, packed or not), or None when it
        is refused: not trainguard's JSON (a pickle without :attr:`accept_pickle`, garbage),
        corrupt, or too large. A refusal is logged in one line and reported to
        :attr:`on_refused` once per revision; the caller treats the key as holding an empty
        state at that revision, so its next write replaces it (a compare-and-swap on that
        revision) and the rendezvous goes on."""
        if revision and revision == self._refused_rev:
            return None
        try:
            return decode_state(
                value, key=self._key, revision=revision, accept_pickle=self.accept_pickle
            )
        except RendezvousStateError as e:
            self._refused_rev = revision
            reason = str(e)
        logger.warning(
            "etcd-v3: refused the rendezvous state at %s (revision %s): %s; this agent writes a "
            "fresh state over it",
            self._key,
            revision,
            reason,
        )
        if self.on_refused is not None:
            try:
                self.on_refused(key=self._key, revision=revision, reason=reason)
            except Exception:  # reporting must never break the rendezvous
                logger.debug("on_refused failed", exc_info=True)
        return None

    def get_state(self) -> tuple[bytes, Token] | None:
        found = self._client.get(self._key)
        if found is None:
            return None
        return _unpack(found[0]), found[1]

    def get_state_since(self, token: Token | None) -> tuple[bytes, Token] | None:
        """The state as stored (for :meth:`decode`) and its revision, but a state still at
        revision ``token`` is not sent again: ``(b"", token)`` then (a compare and a read in one
        transaction). For a reader that polls the state (the hot-spares reaper), so that an
        unchanged state costs a few bytes."""
        if not token:
            return self._client.get(self._key)
        key = _b64(self._key)
        out = self._client.txn(
            [{"key": key, "result": "EQUAL", "target": "MOD", "mod_revision": str(int(token))}],
            [],
            [{"request_range": {"key": key}}],
        )
        if out.get("succeeded"):
            return b"", token
        for r in out.get("responses") or []:
            for kv in (r.get("response_range") or {}).get("kvs") or []:
                return _unb64(kv.get("value")), int(kv.get("mod_revision", 0))
        return None

    def set_state(
        self,
        state: bytes,
        token: Token | None = None,
        *,
        meta: bytes | None = None,
        fetch: bool = True,
    ) -> tuple[bytes, Token, bool] | None:
        """See base class. ``meta`` is written with the state; ``fetch=False``: a lost race
        returns ``(b"", None, False)`` instead of reading the newest state."""
        key = _b64(self._key)
        if token is None:
            compare = {"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
        else:
            try:
                revision = int(token)
            except (TypeError, ValueError):
                raise RendezvousStateError(f"bad rendezvous token {token!r}") from None
            compare = {
                "key": key,
                "result": "EQUAL",
                "target": "MOD",
                "mod_revision": str(revision),
            }
        puts = [self._client.put_request(self._key, _pack(state))]
        if meta is not None:
            puts.append(self._client.put_request(self._meta_key, meta))
        out = self._client.txn([compare], puts, [])
        self.writes += 1
        if out.get("succeeded"):
            self.wins += 1
            self._losses = 0
            return state, int(out["header"]["revision"]), True
        self._losses += 1
        ceiling = min(self._backoff_cap, self._backoff_base * (2 ** min(self._losses, 16)))
        time.sleep(random.uniform(0, ceiling))
        if not fetch:
            return b"", None, False
        found = self.get_state()
        if found is None:
            return None
        return found[0], found[1], False

    # -- what the scalable state holder adds -------------------------------------------------
    @property
    def _meta_key(self) -> str:
        return self._key + ".meta"

    @property
    def _hb_prefix(self) -> str:
        return self._key.rsplit("/", 1)[0] + "/heartbeat/"

    def load(self) -> tuple[bytes, int, bytes | None, int] | None:
        """In one read: the state as stored (for :meth:`decode`) and its revision, the summary
        key, and the store's revision
        (from which a watch sees every later change). It also reads the run's lease key, so
        that a new agent joins the run's lease without a round trip of its own."""
        c = self._client
        ops = [
            {"request_range": {"key": _b64(self._key)}},
            {"request_range": {"key": _b64(self._meta_key)}},
        ]
        if c.lease_key and c.lease_known() is None:
            ops.append({"request_range": {"key": _b64(c.lease_key)}})
        out = c.txn([], ops, [])
        responses = (out.get("responses") or []) + [{}, {}, {}]
        if len(ops) == 3:
            lkvs = (responses[2].get("response_range") or {}).get("kvs") or []
            lease = parse_lease(_unb64(lkvs[0].get("value"))) if lkvs else None
            if lease is not None and c.is_run_lease(lease):
                c.adopt_lease(lease)  # anything else: the client's own read refuses it
        kvs = (responses[0].get("response_range") or {}).get("kvs") or []
        if not kvs:
            return None
        mkvs = (responses[1].get("response_range") or {}).get("kvs") or []
        meta = _unb64(mkvs[0].get("value")) if mkvs else None
        state = _unb64(kvs[0].get("value"))
        revision = int(out.get("header", {}).get("revision", 0))
        return state, int(kvs[0].get("mod_revision", 0)), meta, revision

    def join_requests(self) -> list[tuple[int, dict[str, Any]]]:
        """The oldest ``JOIN_BATCH`` join requests as ``(round, request)`` (only a node about
        to write the state reads them)."""
        jp = self._join_prefix
        out = self._client.call(
            "kv/range",
            {
                "key": _b64(jp),
                "range_end": _b64(_range_end(jp.encode())),
                "sort_order": "ASCEND",
                "sort_target": "CREATE",
                "limit": str(JOIN_BATCH),
            },
        )
        self.joins_read_rev = int(out.get("header", {}).get("revision", 0))
        found: list[tuple[int, dict[str, Any]]] = []
        for kv in out.get("kvs") or []:
            # anyone who can write the prefix can put anything here: a request that is not
            # one (key or value) is skipped, whatever it is
            rest = key_suffix(_unb64(kv.get("key")), jp)
            head = rest.split("/", 1)[0] if rest is not None else ""
            join = parse_join(_unb64(kv.get("value"))) if head.isdigit() else None
            if join is None or len(head) > 19:
                continue
            (node, t) = join
            value = {"addr": node.addr, "pid": node.pid, "local_id": node.local_id, "t": t}
            found.append((int(head), value))
        return found

    def live_nodes(self) -> set[str]:
        """The nodes whose heartbeat key exists: their lease is alive (one keys-only read)."""
        hb = self._hb_prefix
        out = self._client.range(hb, prefix=True, keys_only=True)
        found = (key_suffix(_unb64(kv.get("key")), hb) for kv in out.get("kvs") or [])
        return {k for k in found if k is not None}  # a key that is not UTF-8 is nobody's

    def wait_meta(
        self, after: int, timeout: float, wanted: Callable[[bytes], bool]
    ) -> tuple[bool, int]:
        """Block until the summary key is written, after revision ``after``, with a value
        ``wanted`` accepts (True), or ``timeout`` passes (False); also the revision of the
        last write of it seen (a later wait may start there: nothing before it was wanted).

        The watch starts at etcd's current revision and the key is read once it exists (a
        write before it is seen there): a watch from revision ``after`` would be "unsynced"
        and make etcd replay every change of every key since then (the liveness beacons
        alone are a thousand a second at 1000 nodes); a thousand of those at once, each
        node waiting on the summary after a node loss, kept a 2-core etcd busy for 30 s."""
        last = [after]

        def written() -> bool:
            found = self._client.get(self._meta_key)
            if found is None:
                return True  # gone: the caller reads again
            last[0] = max(last[0], found[1])
            return found[1] > after and wanted(found[0])

        def check(ev: dict[str, Any]) -> bool:
            kv = ev.get("kv") or {}
            if ev.get("type", "PUT") != "PUT":
                return True
            last[0] = max(last[0], int(kv.get("mod_revision", 0) or 0))
            return wanted(_unb64(kv.get("value")))

        changed = self._client.watch(self._meta_key, timeout=timeout, wanted=check, changed=written)
        return changed, last[0]

    def meta(self) -> bytes | None:
        found = self._client.get(self._meta_key)
        return None if found is None else found[0]

    def _heartbeat_put(self, node: str, when: float) -> dict[str, Any]:
        """The put of ``node``'s heartbeat key on the node's own lease (granted now when it
        has none; its TTL is ``heartbeat_ttl``)."""
        lease = self._hb_leases.get(node)
        if lease is None:
            out = self._client.call("lease/grant", {"TTL": str(self.heartbeat_ttl)})
            lease = self._hb_leases[node] = int(out["ID"])
        return {
            "request_put": {
                "key": _b64(self._hb_prefix + node),
                "value": _b64(repr(when)),
                "lease": str(lease),
            }
        }

    def put_heartbeat(self, node: str, when: float) -> None:
        """``node`` is alive: a keep-alive of its heartbeat key's lease (no write to etcd's
        log, no new revision); the key is written (on a new lease) only when there is none
        or the lease expired."""
        lease = self._hb_leases.get(node)
        if lease is not None:
            t0 = time.monotonic()
            try:
                out = self._client.call("lease/keepalive", {"ID": str(lease)})
                if int(out.get("result", out).get("TTL", 0)) > 0:
                    if time.monotonic() - t0 > 1.0:  # answered only after retries
                        self.lease_trouble = time.monotonic()
                    return
            except RendezvousConnectionError:
                pass  # lease not found: granted again below
            self.lease_trouble = time.monotonic()
            self._hb_leases.pop(node, None)
        try:
            self._client.txn([], [self._heartbeat_put(node, when)], [])
        except LeaseGoneError:  # expired between its grant and the put (etcd overloaded)
            self._hb_leases.pop(node, None)
            self._client.txn([], [self._heartbeat_put(node, when)], [])

    def trouble_at(self) -> float:
        """Monotonic time this node last had trouble with etcd: a request retried, or its
        heartbeat lease late or lost. Leases that expired around then prove nothing (an etcd
        too loaded to renew them: "waiting for the applied index took too long")."""
        return max(self.lease_trouble, getattr(self._client, "trouble_at", -float("inf")))

    def heartbeats(self, nodes: list[str] | None = None) -> dict[str, str]:
        """The heartbeat keys that exist (their lease is alive) of ``nodes`` (None: every
        node's, in one range read; else reads of those keys, 100 to a transaction) and their
        values: a time, or :data:`HEARTBEAT_LEFT` for a node that left."""
        hb = self._hb_prefix
        found: list[dict[str, Any]] = []
        if nodes is None:
            found = self._client.range(hb, prefix=True).get("kvs") or []
        for i in range(0, len(nodes or []), 100):
            ops = [{"request_range": {"key": _b64(hb + n)}} for n in (nodes or [])[i : i + 100]]
            for r in self._client.txn([], ops, []).get("responses") or []:
                found.extend((r.get("response_range") or {}).get("kvs") or [])
        out: dict[str, str] = {}
        for kv in found:  # a key that is not UTF-8 (anyone may put one under the prefix): skipped
            node = key_suffix(_unb64(kv.get("key")), hb)
            if node is not None:
                out[node] = _unb64(kv.get("value")).decode(errors="replace")
        return out

    def heartbeat_left(self, node: str) -> None:
        """``node`` leaves: its heartbeat key says so (:data:`HEARTBEAT_LEFT`), on the run's
        lease instead of its own (which then lapses), so that the nodes watching it remove it
        at once instead of after its lease's TTL."""
        self._hb_leases.pop(node, None)
        self._client.txn([], [self._client.put_request(self._hb_prefix + node, HEARTBEAT_LEFT)], [])

    def put_join(
        self,
        round_: int,
        node: NodeDesc,
        when: float,
        *,
        lock_owner: str | None = None,
        lock_ttl: float = 10.0,
    ) -> tuple[int, bool]:
        """This node asks to join ``round_`` as a participant (any writer may add it) and
        refreshes its heartbeat key; with ``lock_owner``, it also takes the admission lock if
        nobody holds it. One transaction; returns its revision and whether the lock is ours."""
        try:
            return self._put_join(round_, node, when, lock_owner, lock_ttl)
        except LeaseGoneError:  # this node's heartbeat lease expired: a new one, once
            self.lease_trouble = time.monotonic()
            self._hb_leases.pop(repr(node), None)
            return self._put_join(round_, node, when, lock_owner, lock_ttl)

    def _put_join(
        self,
        round_: int,
        node: NodeDesc,
        when: float,
        lock_owner: str | None,
        lock_ttl: float,
    ) -> tuple[int, bool]:
        value = {"addr": node.addr, "pid": node.pid, "local_id": node.local_id, "t": when}
        c = self._client
        puts = [
            c.put_request(f"{self._join_prefix}{round_}/{node!r}", json.dumps(value)),
            self._heartbeat_put(repr(node), when),
        ]
        compare: list[dict[str, Any]] = []
        success = puts
        if lock_owner is not None:
            lock = json.dumps({"owner": lock_owner, "until": time.time() + lock_ttl})
            key = _b64(self._lock_key)
            compare = [{"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": "0"}]
            success = [*puts, c.put_request(self._lock_key, lock)]
        out = c.txn(compare, success, puts if compare else [])
        locked = bool(compare) and bool(out.get("succeeded"))
        return int(out.get("header", {}).get("revision", 0)), locked

    def wait_join_admitted(self, round_: int, node: NodeDesc, after: int, timeout: float) -> bool:
        """Block until this node's join request (put at revision ``after``) is deleted (the
        writer admitted it, or the round completed), or ``timeout`` passes. The watch starts
        at etcd's current revision and the request is read once it exists (see
        :meth:`wait_meta`: a watch from an old revision makes etcd replay every change since)."""
        key = f"{self._join_prefix}{round_}/{node!r}"
        return self._client.watch(
            key,
            timeout=timeout,
            wanted=lambda ev: ev.get("type") == "DELETE",
            changed=lambda: self._client.get(key) is None,
        )

    def forget_joins(self, round_: int) -> None:
        self._client.delete(f"{self._join_prefix}{round_}/", prefix=True)

    def forget_join_requests(self, round_: int, nodes: list[NodeDesc]) -> None:
        """Drop the join requests of admitted nodes (in transactions of at most 100 deletes,
        below etcd's default limit of 128 operations)."""
        keys = [f"{self._join_prefix}{round_}/{n!r}" for n in nodes]
        for i in range(0, len(keys), 100):
            ops = [{"request_delete_range": {"key": _b64(k)}} for k in keys[i : i + 100]]
            self._client.txn([], ops, [])
