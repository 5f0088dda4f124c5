"""The agents' key-value store on etcd v3 keys: a ``torch.distributed.Store``."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from trainguard.runtime.etcd_v3._common import _b64, _unb64
from trainguard.runtime.etcd_v3.client import EtcdV3Client
from trainguard.runtime.etcd_v3.codec import key_suffix

__all__ = ["EtcdV3Store"]


class EtcdV3Store(dist.Store):
    """A ``torch.distributed.Store`` on etcd v3 keys under ``prefix``.

    Values are bytes; ``add`` keeps an integer as a decimal string (as TCPStore does). ``get`` and
    ``wait`` block until the keys exist or the store's timeout (``set_timeout``) passes, polling
    with a backoff from 10 ms to 250 ms; a timeout raises ``torch.distributed.DistStoreError``.
    """

    timeout: timedelta
    """torch's ``Store.timeout`` property (``set_timeout`` sets it; torch's stub omits it)."""

    def __init__(
        self, client: EtcdV3Client, prefix: str, timeout: timedelta = timedelta(seconds=300)
    ) -> None:
        super().__init__()
        self._client = client
        self._prefix = prefix if prefix.endswith("/") else prefix + "/"
        self.set_timeout(timeout)

    def _k(self, key: str | bytes) -> str:
        return self._prefix + (key.decode() if isinstance(key, bytes) else key)

    @staticmethod
    def _v(value: str | bytes | Any) -> bytes:
        if isinstance(value, str):
            return value.encode()
        return bytes(value)

    def set(self, key: str, value: str | bytes) -> None:
        self._client.put(self._k(key), self._v(value))

    def get(self, key: str) -> bytes:
        """The key's value; a missing key is waited for with a watch on it, whose event
        carries the value."""
        k = self._k(key)
        limit = self.timeout.total_seconds()
        deadline = time.monotonic() + limit
        while True:
            out = self._client.range(k)  # usually there: one read
            kvs = out.get("kvs") or []
            if kvs:
                return _unb64(kvs[0].get("value"))
            now = time.monotonic()
            if now >= deadline:
                raise dist.DistStoreError(
                    f"timed out after {limit:.1f} s waiting for keys {[key]} in etcd "
                    f"({self._prefix})"
                )
            put: list[bytes] = []

            def written(ev: dict[str, Any], put: list[bytes] = put) -> bool:
                if ev.get("type", "PUT") != "PUT":
                    return False
                put.append(_unb64((ev.get("kv") or {}).get("value")))
                return True

            def there(put: list[bytes] = put) -> bool:
                kvs = self._client.range(k).get("kvs") or []
                if kvs:
                    put.append(_unb64(kvs[0].get("value")))
                return bool(kvs)

            # from etcd's current revision, the key read again once the watch exists: a watch
            # from the read's revision would make etcd replay every change since (a thousand
            # agents waiting for the same key right after a round completes)
            self._client.watch(k, timeout=min(deadline - now, 5.0), wanted=written, changed=there)
            if put:
                return put[0]

    def _cas_loop(self, key: str, update: Callable[[bytes | None], bytes]) -> bytes:
        """Read, ``update``, compare-and-swap until a write lands or the store's timeout
        passes (a key rewritten faster than this client can follow, by a flood of writers or
        a hostile one, raises ``DistStoreError`` instead of spinning forever)."""
        k = self._k(key)
        bk = _b64(k)
        delay = 0.005
        limit = self.timeout.total_seconds()
        deadline = time.monotonic() + limit
        while True:
            found = self._client.get(k)
            if found is None:
                compare = {"key": bk, "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
                new = update(None)
            else:
                compare = {
                    "key": bk,
                    "result": "EQUAL",
                    "target": "MOD",
                    "mod_revision": str(found[1]),
                }
                new = update(found[0])
            out = self._client.txn([compare], [self._client.put_request(k, new)], [])
            if out.get("succeeded"):
                return new
            left = deadline - time.monotonic()
            if left <= 0:
                raise dist.DistStoreError(
                    f"timed out after {limit:.1f} s updating key {key!r} in etcd "
                    f"({self._prefix}): every compare-and-swap lost to another writer"
                )
            time.sleep(min(random.uniform(0, delay), left))
            delay = min(delay * 2, 0.5)

    def add(self, key: str, value: int) -> int:
        new = self._cas_loop(key, lambda cur: str(int(cur or b"0") + int(value)).encode())
        return int(new)

    def append(self, key: str, value: str | bytes) -> None:
        v = self._v(value)
        self._cas_loop(key, lambda cur: (cur or b"") + v)

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        k = self._k(key)
        bk = _b64(k)
        expected, desired = self._v(expected_value), self._v(desired_value)
        if expected:
            compare = {"key": bk, "result": "EQUAL", "target": "VALUE", "value": _b64(expected)}
        else:
            compare = {"key": bk, "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
        out = self._client.txn(
            [compare], [self._client.put_request(k, desired)], [{"request_range": {"key": bk}}]
        )
        if out.get("succeeded"):
            return desired
        # TCPStore's answer: the current value, or the expected one when the key is missing.
        for r in out.get("responses") or []:
            kvs = (r.get("response_range") or {}).get("kvs") or []
            if kvs:
                return _unb64(kvs[0].get("value"))
        return expected

    def _missing(self, keys: Sequence[str]) -> tuple[list[str], int]:
        """The keys that do not exist, and the revision they were checked at (transactions of
        at most 100 reads: etcd refuses more than 128 operations in one)."""
        missing: list[str] = []
        revision = 0
        keys = list(keys)
        for i in range(0, len(keys), 100):
            chunk = keys[i : i + 100]
            ops = [{"request_range": {"key": _b64(self._k(k)), "keys_only": True}} for k in chunk]
            out = self._client.txn([], ops, [])
            if not revision:
                revision = int(out.get("header", {}).get("revision", 0))
            for k, r in zip(chunk, out.get("responses") or [], strict=False):
                if not (r.get("response_range") or {}).get("kvs"):
                    missing.append(k)
        return missing, revision

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        """Block until every key exists: one check, then a watch on the store's keys (woken
        by the first write of a missing key), no polling."""
        limit = (timeout if timeout is not None else self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        pending = list(keys)
        while True:
            pending, _ = self._missing(pending)
            if not pending:
                return
            now = time.monotonic()
            if now >= deadline:
                raise dist.DistStoreError(
                    f"timed out after {limit:.1f} s waiting for keys {pending} in etcd "
                    f"({self._prefix})"
                )
            wanted = {_b64(self._k(k)) for k in pending}
            self._client.watch(  # from the current revision, checked again once it exists
                self._prefix,
                prefix=True,
                timeout=min(deadline - now, 5.0),
                wanted=lambda ev, w=wanted: (ev.get("kv") or {}).get("key") in w,  # type: ignore[misc]
                changed=lambda p=pending: not self._missing(p)[0],  # type: ignore[misc]
            )

    def check(self, keys: Sequence[str]) -> bool:
        return not self._missing(list(keys))[0]

    def delete_key(self, key: str) -> bool:
        return self._client.delete(self._k(key)) > 0

    def num_keys(self) -> int:
        out = self._client.range(self._prefix, prefix=True, count_only=True)
        return int(out.get("count", 0))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        keys = list(keys)
        self.wait(keys)
        values = []
        for i in range(0, len(keys), 100):  # etcd allows 128 operations per transaction
            chunk = keys[i : i + 100]
            ops = [{"request_range": {"key": _b64(self._k(k))}} for k in chunk]
            out = self._client.txn([], ops, [])
            for k, r in zip(chunk, out.get("responses") or [], strict=True):
                kvs = (r.get("response_range") or {}).get("kvs") or []
                if not kvs:
                    raise dist.DistStoreError(f"key {k!r} was deleted while being read")
                values.append(_unb64(kvs[0].get("value")))
        return values

    def existing(self, keys: Sequence[str]) -> dict[str, bytes]:
        """The values of those of ``keys`` that exist, without waiting for the others: one
        read per 100 keys (``check`` then ``multi_get`` costs three)."""
        keys = list(keys)
        found: dict[str, bytes] = {}
        for i in range(0, len(keys), 100):  # etcd allows 128 operations per transaction
            chunk = keys[i : i + 100]
            ops = [{"request_range": {"key": _b64(self._k(k))}} for k in chunk]
            out = self._client.txn([], ops, [])
            for k, r in zip(chunk, out.get("responses") or [], strict=False):
                kvs = (r.get("response_range") or {}).get("kvs") or []
                if kvs:
                    found[k] = _unb64(kvs[0].get("value"))
        return found

    def under(self, prefix: str) -> dict[str, bytes]:
        """Every key of the store that starts with ``prefix`` and its value, in one read (a
        range: for many keys several times cheaper for etcd than reading each)."""
        out = self._client.range(self._k(prefix), prefix=True)
        found: dict[str, bytes] = {}
        for kv in out.get("kvs") or []:
            key = key_suffix(_unb64(kv.get("key")), self._prefix)
            if key is not None:  # a key that is not UTF-8 is no key of the store's users
                found[key] = _unb64(kv.get("value"))
        return found

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        ops = [
            self._client.put_request(self._k(k), self._v(v))
            for k, v in zip(keys, values, strict=True)
        ]
        for i in range(0, len(ops), 100):  # etcd allows 128 operations per transaction
            self._client.txn([], ops[i : i + 100], [])
