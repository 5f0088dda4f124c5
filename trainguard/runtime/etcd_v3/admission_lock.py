"""The admission lock of the etcd-v3 rendezvous backend: the one key (``<prefix>/admit``) that
makes one node at a time the writer that admits every pending join request (see
:mod:`trainguard.runtime.etcd_v3.admission`). Its value names the owner and when it expires;
an expired lock (its holder died) is taken over, and no lock is held longer than its TTL plus
``MAX_LOCK_HOLD_S`` past the moment a node first saw it, whatever its value says."""

from __future__ import annotations

import json
import time

from trainguard.runtime.etcd_v3._common import _b64, _range_end, _unb64
from trainguard.runtime.etcd_v3.client import EtcdV3Client
from trainguard.runtime.etcd_v3.codec import MAX_LOCK_HOLD_S, lock_until

__all__ = ["AdmissionLock"]


class AdmissionLock:
    """The admission lock's operations, a part of :class:`EtcdV3RendezvousBackend` (which
    sets the client, the state's key and the last lock revision seen)."""

    _client: EtcdV3Client
    _key: str
    _lock_seen: tuple[int, float]
    """(revision of the lock as this node last saw it, when it first saw that revision)."""

    @property
    def _join_prefix(self) -> str:
        return self._key.rsplit("/", 1)[0] + "/join/"

    @property
    def _lock_key(self) -> str:
        return self._key.rsplit("/", 1)[0] + "/admit"

    def try_lock_admission(self, owner: str, ttl: float) -> int | None:
        """Become the one node that admits the pending join requests for ``ttl`` seconds
        (or until :meth:`unlock_admission`); returns the lock's revision, or None when another
        node holds it. An expired lock (its holder died) is taken over."""
        c = self._client
        key = _b64(self._lock_key)
        value = json.dumps({"owner": owner, "until": time.time() + ttl})
        out = c.txn(
            [{"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": "0"}],
            [c.put_request(self._lock_key, value)],
            [{"request_range": {"key": key}}],
        )
        if out.get("succeeded"):
            return int(out["header"]["revision"])
        for r in out.get("responses") or []:
            for kv in (r.get("response_range") or {}).get("kvs") or []:
                # held until its ``until``, but never longer than ttl + MAX_LOCK_HOLD_S past
                # the moment this node first saw that revision of it (a holder extends it
                # every few seconds, each time a new revision): an ``until`` of 1e308 or one
                # far ahead on a skewed clock does not hold every round forever
                rev = int(kv.get("mod_revision", 0) or 0)
                if self._lock_seen[0] != rev:
                    self._lock_seen = (rev, time.time())
                cap = self._lock_seen[1] + ttl + MAX_LOCK_HOLD_S
                until = min(lock_until(_unb64(kv.get("value"))), cap)
                if until >= time.time():
                    return None
                took = c.txn(
                    [
                        {
                            "key": key,
                            "result": "EQUAL",
                            "target": "MOD",
                            "mod_revision": str(kv.get("mod_revision", 0)),
                        }
                    ],
                    [c.put_request(self._lock_key, value)],
                    [],
                )
                if took.get("succeeded"):
                    return int(took["header"]["revision"])
        return None

    def unlock_admission(self, revision: int) -> None:
        key = _b64(self._lock_key)
        self._client.txn(
            [{"key": key, "result": "EQUAL", "target": "MOD", "mod_revision": str(revision)}],
            [{"request_delete_range": {"key": key}}],
            [],
        )

    def unlock_admission_if_idle(self, revision: int, round_: int, seen: int) -> bool | None:
        """Give up the admission lock (taken at ``revision``) unless a join request for
        ``round_`` came (or was renewed) after revision ``seen``, the one its holder last read
        them at: True when released, False when such a request is pending (the holder admits
        it: a node whose request came while the lock was held waits for the holder and would
        otherwise wait until its watch times out), None when the lock is no longer ours."""
        key = _b64(self._lock_key)
        jp = f"{self._join_prefix}{round_}/"
        out = self._client.txn(
            [
                {"key": key, "result": "EQUAL", "target": "MOD", "mod_revision": str(revision)},
                {
                    "key": _b64(jp),
                    "range_end": _b64(_range_end(jp.encode())),
                    "result": "LESS",
                    "target": "MOD",
                    "mod_revision": str(seen + 1),
                },
            ],
            [{"request_delete_range": {"key": key}}],
            [{"request_range": {"key": key}}],
        )
        if out.get("succeeded"):
            return True
        for r in out.get("responses") or []:
            for kv in (r.get("response_range") or {}).get("kvs") or []:
                if int(kv.get("mod_revision", 0)) == revision:
                    return False
        return None

    def extend_admission(self, revision: int, owner: str, ttl: float) -> int | None:
        """Hold the admission lock (taken at ``revision``) for ``ttl`` more seconds; its new
        revision, or None when it is no longer ours."""
        key = _b64(self._lock_key)
        value = json.dumps({"owner": owner, "until": time.time() + ttl})
        out = self._client.txn(
            [{"key": key, "result": "EQUAL", "target": "MOD", "mod_revision": str(revision)}],
            [self._client.put_request(self._lock_key, value)],
            [],
        )
        return int(out["header"]["revision"]) if out.get("succeeded") else None
