"""The etcd v3 client: the JSON gateway over http.client, with failover, retries, auth, watches
and the run's lease."""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import logging
import random
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from trainguard.runtime.etcd_v3._common import (
    DEFAULT_LEASE_TTL,
    DEFAULT_REQUEST_TIMEOUT,
    DEFAULT_RETRY_TIMEOUT,
    PASSWORD_ENV,
    EtcdUnavailableError,
    EtcdV3ConfigError,
    LeaseGoneError,
    _AuthError,
    _b64,
    _range_end,
    _text,
    _unb64,
)
from trainguard.runtime.etcd_v3.codec import gateway_json, parse_lease

__all__ = ["MAX_RESPONSE_BYTES", "EtcdV3Client"]

logger = logging.getLogger(__name__)

MAX_RESPONSE_BYTES = 64 << 20
"""The largest answer (or watch event line) the client reads from etcd; a longer one is refused
(a member, or whatever answers in its place over plain http, cannot make an agent read
without end)."""


RETRY_BACKOFF_MAX = 2.0
"""The longest random wait (seconds, full jitter) between two tries of a call."""

LONG_RETRY_BACKOFF_MAX = 5.0
"""The longest random wait between two tries of a call that retries past ``retry_timeout``
(inside a rendezvous, until its deadline): a thousand agents waiting out a stalled etcd send it
at most one request each per 2.5 s on average, spread over 5 s, not a burst when it answers
again."""


class _TooLarge(RendezvousConnectionError):
    """etcd's answer is over the client's size limit."""


def _read_body(resp: http.client.HTTPResponse, limit: int, what: str) -> bytes:
    declared = resp.getheader("Content-Length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _TooLarge(f"etcd's answer to {what} is {declared} bytes, over the {limit}-byte limit")
    data = resp.read(limit + 1)
    if len(data) > limit:
        raise _TooLarge(f"etcd's answer to {what} is over the {limit}-byte limit")
    return data


class _LeaseGone(Exception):
    """A write named a lease that expired (or one adopted just as it expired)."""


def _with_lease(payload: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    """``payload`` with every put on lease ``old`` moved to lease ``new``."""
    out = dict(payload)
    for branch in ("success", "failure"):
        ops = []
        for op in payload.get(branch) or []:
            put = op.get("request_put")
            if put is not None and put.get("lease") == old:
                op = {"request_put": {**put, "lease": new}}
            ops.append(op)
        if branch in payload:
            out[branch] = ops
    return out


def _other_leases(payload: dict[str, Any], run_lease: str) -> bool:
    """Whether a put of ``payload`` names a lease other than the run's."""
    for branch in ("success", "failure"):
        for op in payload.get(branch) or []:
            lease = (op.get("request_put") or {}).get("lease")
            if lease and lease != run_lease:
                return True
    return False


class _Transient(Exception):
    """An answer that says: try again (a 5xx, no leader, a timeout inside etcd, an etcd too
    loaded to take more: "too many requests", HTTP 429)."""


_TRANSIENT = ("leader", "timed out", "unavailable", "too many requests", "took too long")
"""What an error answer of etcd says when it is worth trying again."""


class _Member:
    """One etcd member's JSON gateway: a pool of keep-alive HTTP connections.

    ``http.client`` sends a request's head and body in one segment (no Nagle / delayed-ACK
    stall) and costs about a fifth of the CPU of ``requests`` per call, which matters when
    hundreds of agents share a few cores (the rendezvous benchmark)."""

    def __init__(
        self,
        host: str,
        port: int,
        context: ssl.SSLContext | None,
        timeout: float,
        max_bytes: int = MAX_RESPONSE_BYTES,
    ) -> None:
        self.host, self.port, self.context, self.timeout = host, port, context, timeout
        self.max_bytes = max_bytes
        self._pool: list[http.client.HTTPConnection] = []
        self._lock = threading.Lock()

    def _connect(self, timeout: float) -> http.client.HTTPConnection:
        if self.context is not None:
            return http.client.HTTPSConnection(
                self.host, self.port, timeout=timeout, context=self.context
            )
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def post(self, path: str, payload: dict[str, Any], headers: dict[str, str]) -> tuple[int, str]:
        body = json.dumps(payload, separators=(",", ":")).encode()
        with self._lock:
            conn = self._pool.pop() if self._pool else None
        reused = conn is not None
        if conn is None:
            conn = self._connect(self.timeout)
        try:
            try:
                conn.request("POST", "/v3/" + path, body, headers)
                resp = conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                if not reused:
                    raise
                conn.close()  # a pooled connection the server closed meanwhile: once more
                conn = self._connect(self.timeout)
                conn.request("POST", "/v3/" + path, body, headers)
                resp = conn.getresponse()
            data = _read_body(resp, self.max_bytes, path).decode("utf-8", errors="replace")
        except BaseException:
            conn.close()
            raise
        if resp.will_close:
            conn.close()
        else:
            with self._lock:
                self._pool.append(conn)
        return resp.status, data

    def watch(
        self,
        payload: dict[str, Any],
        headers: dict[str, str],
        deadline: float,
        wanted: Callable[[dict[str, Any]], bool] | None,
        on_created: Callable[[], bool] | None = None,
    ) -> bool:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        conn = self._connect(min(left, self.timeout))
        try:
            conn.request("POST", "/v3/watch", json.dumps(payload).encode(), headers)
            resp = conn.getresponse()
            if resp.status != 200:
                raise http.client.HTTPException(f"watch: HTTP {resp.status}")
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                if conn.sock is not None:
                    conn.sock.settimeout(left)
                try:
                    line = resp.readline(self.max_bytes + 1)
                except TimeoutError:
                    return False
                if not line:
                    raise http.client.HTTPException("watch stream ended")
                if len(line) > self.max_bytes:
                    raise http.client.HTTPException(f"a watch event is over {self.max_bytes} bytes")
                if not line.strip():
                    continue
                result = gateway_json(line).get("result") or {}
                if result.get("canceled") or int(result.get("compact_revision", 0) or 0):
                    return True
                if result.get("created") and on_created is not None and on_created():
                    return True
                for ev in result.get("events") or []:
                    if wanted is None or wanted(ev):
                        return True
        finally:
            conn.close()


class EtcdV3Client:
    """A small etcd v3 client over the JSON gateway with retries, failover, auth and a lease.

    ``endpoints`` are ``(host, port)`` pairs of members of one cluster. Every call retries
    transient failures (connection refused or reset, timeouts, 5xx) with exponential backoff
    and full jitter until ``retry_timeout`` seconds have passed, switching member on each
    failure, then raises :class:`EtcdUnavailableError`; inside :meth:`retrying_until` (a
    rendezvous) until that deadline, when it is later.
    """

    def __init__(
        self,
        endpoints: Sequence[tuple[str, int]],
        *,
        protocol: str = "http",
        ca_cert: str | None = None,
        ssl_cert: str | None = None,
        ssl_cert_key: str | None = None,
        user: str | None = None,
        password: str | None = None,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        retry_timeout: float = DEFAULT_RETRY_TIMEOUT,
        lease_key: str | None = None,
        lease_ttl: int = DEFAULT_LEASE_TTL,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
    ) -> None:
        if not endpoints:
            raise EtcdV3ConfigError("etcd-v3 needs at least one endpoint in --rdzv-endpoint")
        context = None
        if protocol == "https":
            context = ssl.create_default_context(cafile=ca_cert)
            if ssl_cert:
                context.load_cert_chain(ssl_cert, ssl_cert_key)
        elif user:
            logger.warning(
                "etcd user %r over plain http to %s: the password and the auth token cross the "
                "network unencrypted; use TLS (--rdzv-conf ca_cert=..., [rendezvous] "
                "etcd_ca_cert) for etcd with authentication",
                user,
                ",".join(f"{h}:{p}" for h, p in endpoints),
            )
        self._members = [
            _Member(h, p, context, request_timeout, max_response_bytes) for h, p in endpoints
        ]
        self._current = 0
        self._user = user
        self._password = password
        self._token: str | None = None
        self._auth_lock = threading.Lock()
        self.request_timeout = request_timeout
        self.retry_timeout = retry_timeout
        self._lease_key = lease_key
        self._lease_ttl = max(int(lease_ttl), 2)
        self._lease_id: int | None = None
        self._lease_lock = threading.Lock()
        self.trouble_at = -float("inf")
        """Monotonic time a request last failed and was retried (etcd overloaded or
        unreachable): liveness judged on leases meanwhile proves nothing."""
        self._keeper: threading.Thread | None = None
        self._closed = threading.Event()
        self._tls = threading.local()

    # -- transport -----------------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self._token:
            h["Authorization"] = self._token
        return h

    def _post_once(self, index: int, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        status, text = self._members[index].post(path, payload, self._headers())
        if status == 200:
            return gateway_json(text)
        low = text.lower()
        if "lease not found" in low:
            raise _LeaseGone(text)
        if "permission denied" in low:
            raise RendezvousConnectionError(
                f"etcd user {self._user!r} may not use these keys ({text.strip()[:200]}): "
                "grant the user's role readwrite on the key prefix"
            )
        if "auth" in low or "user name" in low or "token" in low:
            raise _AuthError(text)
        if status >= 500 or status == 429 or any(t in low for t in _TRANSIENT):
            raise _Transient(f"HTTP {status}: {text.strip()[:300]}")
        raise RendezvousConnectionError(f"etcd refused {path}: HTTP {status}: {text.strip()[:300]}")

    def _authenticate(self, index: int) -> None:
        if not self._user:
            return
        body = {"name": self._user, "password": self._password or ""}
        status, text = self._members[index].post("auth/authenticate", body, {})
        if status != 200:
            if "authentication failed" in text or "invalid" in text:
                raise RendezvousConnectionError(
                    f"etcd rejected user {self._user!r}: check the password in "
                    f"{PASSWORD_ENV} or the password file"
                )
            raise _Transient(f"HTTP {status}: {text.strip()[:300]}")
        self._token = gateway_json(text).get("token")

    @contextlib.contextmanager
    def retrying_until(self, deadline: Callable[[], float]) -> Iterator[None]:
        """While this thread runs the block (a rendezvous), a call that etcd has not answered
        for ``retry_timeout`` goes on retrying until ``deadline()`` (monotonic; asked at each
        failure: a rendezvous' deadline moves) and raises :class:`EtcdUnavailableError` only
        then: a transient etcd stall must not end a round that may still complete. Calls with
        a deadline of their own (the lease keep-alives) and other threads are not affected."""
        before = getattr(self._tls, "until", None)
        self._tls.until = deadline
        try:
            yield
        finally:
            self._tls.until = before

    def call(self, path: str, payload: dict[str, Any], *, deadline: float | None = None) -> Any:
        """POST ``payload`` to ``/v3/<path>`` with retries; returns the decoded JSON answer."""
        start = time.monotonic()
        until: Callable[[], float] | None = None
        if deadline is None:
            deadline = start + self.retry_timeout
            until = getattr(self._tls, "until", None)
        delay = 0.05
        cap = RETRY_BACKOFF_MAX
        attempt = 0
        while True:
            index = self._current
            try:
                if self._user and self._token is None:
                    with self._auth_lock:
                        if self._token is None:
                            self._authenticate(index)
                return self._post_once(index, path, payload)
            except _AuthError as e:
                # An expired or missing token: authenticate again (once per failure).
                if not self._user:
                    raise RendezvousConnectionError(
                        f"etcd refused the request ({e}): set user= and the password "
                        f"({PASSWORD_ENV} or password_file=)"
                    ) from None
                with self._auth_lock:
                    self._token = None
                err: Exception = e
            except _LeaseGone as e:
                old = self._lease_id
                if (
                    old is None
                    or _with_lease(payload, str(old), "") == payload
                    or (_other_leases(payload, str(old)) and self._lease_alive(old))
                ):
                    # not the run's lease (a node's own, revoked or expired): the caller's
                    raise LeaseGoneError(f"etcd: {_text(e).strip()[:200]}") from None
                with self._lease_lock:
                    if self._lease_id == old:
                        self._lease_id = self._acquire_lease()
                        self._start_keeper()
                payload = _with_lease(payload, str(old), str(self._lease_id))
                err = e
            except (OSError, http.client.HTTPException, _Transient, ValueError) as e:
                err = e  # refused, reset, timed out, a restarting member, a torn answer
                self.trouble_at = time.monotonic()
            attempt += 1
            now = time.monotonic()
            if now >= deadline and until is not None:
                deadline, cap = self._retry_longer(until(), path, now - start, deadline, cap)
            if now >= deadline:
                raise EtcdUnavailableError(
                    f"etcd at {self.endpoints_text()} did not answer for {now - start:.0f} s"
                    f" ({type(err).__name__}: {_text(err)[:300]})"
                ) from None
            if attempt == 1 or attempt % 20 == 0:
                logger.warning(
                    "etcd call %s failed (%s: %s); retrying", path, type(err).__name__, _text(err)
                )
            self._current = (index + 1) % len(self._members)
            time.sleep(min(random.uniform(0, delay), max(deadline - now, 0)))
            delay = min(delay * 2, cap)

    def _retry_longer(
        self, later: float, path: str, waited: float, deadline: float, cap: float
    ) -> tuple[float, float]:
        """The deadline and backoff cap of a call past its ``retry_timeout`` inside
        :meth:`retrying_until`: ``later`` (the rendezvous' deadline) when still ahead."""
        if later <= time.monotonic():
            return deadline, cap
        if cap < LONG_RETRY_BACKOFF_MAX:
            left = later - time.monotonic()
            logger.warning(
                "etcd at %s has not answered %s for %.0f s (retry_timeout %.0f s); retrying "
                "until the rendezvous' deadline%s",
                self.endpoints_text(),
                path,
                waited,
                self.retry_timeout,
                f" in {left:.0f} s" if left < float("inf") else " (a spare: no deadline)",
            )
        return later, LONG_RETRY_BACKOFF_MAX

    def _lease_alive(self, lease: int) -> bool:
        """Whether etcd still knows ``lease`` (a failed check counts as alive: the write is
        then retried as is)."""
        try:
            out = self._post_once(self._current, "lease/timetolive", {"ID": str(lease)})
        except Exception:
            return True
        return int(out.get("TTL", -1)) > 0

    def endpoints_text(self) -> str:
        return ",".join(f"{m.host}:{m.port}" for m in self._members)

    def watch(
        self,
        key: str,
        *,
        timeout: float,
        start_revision: int | None = None,
        prefix: bool = False,
        wanted: Callable[[dict[str, Any]], bool] | None = None,
        changed: Callable[[], bool] | None = None,
    ) -> bool:
        """Block until a change of ``key`` (or of every key under it with ``prefix``) at or
        after ``start_revision`` that ``wanted(event)`` accepts (default: any), or until
        ``timeout`` seconds pass. True on a change (also when etcd compacted the revisions
        the watch asked for: the caller reads again); False on timeout or a failed watch
        (the caller polls instead). One streaming request on its own connection (etcd's
        gateway, ``/v3/watch``).

        Without ``start_revision`` the watch starts at etcd's current revision, and
        ``changed()`` (a cheap read) runs once the watch exists, to catch a change that came
        before it. A watch from an old revision is "unsynced" in etcd: it replays the history
        from there, and hundreds of those cost etcd far more than a read each."""
        req: dict[str, Any] = {"key": _b64(key)}
        if start_revision is not None:
            req["start_revision"] = str(max(start_revision, 1))
        if prefix:
            req["range_end"] = _b64(_range_end(key.encode()))
        deadline = time.monotonic() + timeout
        member = self._members[self._current]
        try:
            return member.watch({"create_request": req}, self._headers(), deadline, wanted, changed)
        except (OSError, http.client.HTTPException, ValueError):
            time.sleep(max(0.0, min(0.2, deadline - time.monotonic())))
            return False

    # -- key-value primitives ------------------------------------------------------------------
    def range(
        self, key: str, *, prefix: bool = False, keys_only: bool = False, count_only: bool = False
    ) -> dict[str, Any]:
        payload: dict[str, Any] = {"key": _b64(key)}
        if prefix:
            payload["range_end"] = _b64(_range_end(key.encode()))
        if keys_only:
            payload["keys_only"] = True
        if count_only:
            payload["count_only"] = True
        return self.call("kv/range", payload)

    def get(self, key: str) -> tuple[bytes, int] | None:
        """The value and mod_revision of ``key``, or None."""
        kvs = self.range(key).get("kvs") or []
        if not kvs:
            return None
        kv = kvs[0]
        return _unb64(kv.get("value")), int(kv.get("mod_revision", 0))

    def put_request(self, key: str, value: bytes | str) -> dict[str, Any]:
        req: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        lease = self.lease_id()
        if lease:
            req["lease"] = str(lease)
        return {"request_put": req}

    def put(self, key: str, value: bytes | str) -> int:
        out = self.txn([], [self.put_request(key, value)], [])
        return int(out["header"]["revision"])

    def txn(
        self,
        compare: list[dict[str, Any]],
        success: list[dict[str, Any]],
        failure: list[dict[str, Any]],
    ) -> dict[str, Any]:
        return self.call("kv/txn", {"compare": compare, "success": success, "failure": failure})

    def delete(self, key: str, *, prefix: bool = False) -> int:
        payload: dict[str, Any] = {"key": _b64(key)}
        if prefix:
            payload["range_end"] = _b64(_range_end(key.encode()))
        return int(self.call("kv/deleterange", payload).get("deleted", 0))

    # -- the run's lease -----------------------------------------------------------------------
    def lease_id(self) -> int | None:
        """The run's lease (created or joined on first use); None when leases are off."""
        if self._lease_key is None:
            return None
        if self._lease_id is not None:
            return self._lease_id
        with self._lease_lock:
            if self._lease_id is None:
                self._lease_id = self._acquire_lease()
                self._start_keeper()
        return self._lease_id

    @property
    def lease_key(self) -> str | None:
        return self._lease_key

    def lease_known(self) -> int | None:
        return self._lease_id

    def adopt_lease(self, lease: int) -> None:
        """Use the run's lease another agent created (read with other keys: its key lives
        exactly as long as the lease, and a write on a lease gone meanwhile fails and takes a
        fresh one)."""
        with self._lease_lock:
            if self._lease_id is None:
                self._lease_id = lease
                self._start_keeper()

    def _start_keeper(self) -> None:
        if self._keeper is None:
            self._keeper = threading.Thread(
                target=self._keep_lease, name="trainguard-etcd-lease", daemon=True
            )
            self._keeper.start()

    def is_run_lease(self, lease: int) -> bool:
        """Whether ``lease`` is the one this run's agents grant (:meth:`_run_lease_id`): a
        lease key naming another (put by any writer of the prefix) is not adopted."""
        return self._lease_key is not None and lease == self._run_lease_id()

    def _run_lease_id(self) -> int:
        """The lease id this run grants: derived from the run's lease key, so that agents that
        start together all grant the same lease (etcd answers "already exists" to all but one)
        instead of one lease each, of which all but one are revoked again."""
        assert self._lease_key is not None
        digest = hashlib.sha256(self._lease_key.encode()).digest()
        return (int.from_bytes(digest[:8], "big") & (2**62 - 1)) | 1

    def _acquire_lease(self) -> int:
        """The lease the run's lease key names; when there is none yet, the run's own lease,
        granted and named there (an older agent's lease, when one named its lease first).
        The key lives exactly as long as its lease: a key found names a live lease (a write
        on one that expired meanwhile fails and comes here again)."""
        assert self._lease_key is not None
        key = _b64(self._lease_key)
        mine = self._run_lease_id()
        while True:
            found = self.get(self._lease_key)
            compare = {"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": "0"}
            if found is not None:
                if parse_lease(found[0]) == mine:
                    return mine
                # not this run's lease (any writer of the prefix can put one: adopting it
                # would tie the run's keys to a lease someone else revokes): written over
                logger.warning(
                    "etcd-v3: the run's lease key %s names a lease %r that is not this run's; "
                    "this agent writes the run's own lease over it",
                    self._lease_key,
                    found[0][:32],
                )
                compare = {
                    "key": key,
                    "result": "EQUAL",
                    "target": "MOD",
                    "mod_revision": str(found[1]),
                }
            try:
                self.call("lease/grant", {"TTL": str(self._lease_ttl), "ID": str(mine)})
            except RendezvousConnectionError as e:
                if "already exists" not in str(e):
                    raise
            out = self.txn(
                [compare],
                [{"request_put": {"key": key, "value": _b64(str(mine)), "lease": str(mine)}}],
                [],
            )
            if out.get("succeeded"):
                return mine

    def _keep_lease(self) -> None:
        interval = max(self._lease_ttl / 3.0, 0.5)
        while not self._closed.wait(interval):
            lease = self._lease_id
            if lease is None:
                continue
            try:
                out = self.call(
                    "lease/keepalive",
                    {"ID": str(lease)},
                    deadline=time.monotonic() + interval,
                )
                result = out.get("result", out)
                if int(result.get("TTL", 0)) <= 0:
                    logger.warning("the run's etcd lease %s expired; creating a new one", lease)
                    with self._lease_lock:
                        if self._lease_id == lease:
                            self._lease_id = self._acquire_lease()
            except Exception as e:  # a keep-alive failure must never kill the agent
                logger.warning("etcd lease keep-alive failed: %s", e)

    def close(self) -> None:
        self._closed.set()
        for m in self._members:
            with m._lock:
                pool, m._pool = m._pool, []
            for conn in pool:
                conn.close()
