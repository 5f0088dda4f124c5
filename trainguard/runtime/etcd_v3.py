"""An etcd v3 backend for torch's dynamic rendezvous: ``--rdzv-backend etcd-v3``.

torch ships etcd backends for etcd's v2 API only (``etcd``, ``etcd-v2``, through python-etcd),
which etcd 3.4 serves only with ``--enable-v2`` and newer releases dropped. This module speaks
etcd's v3 API through its HTTP/JSON gateway (``/v3/...``) with ``etcd3gw``: no gRPC or protobuf
in the agent (the gRPC client ``etcd3`` 0.12 does not import with protobuf >= 4).

What lives in etcd, under ``<key_prefix>/<run id>/``:

- ``state``: torch's rendezvous state, written with a compare-and-swap on the key's
  ``mod_revision`` (the v3 counterpart of v2's ``prevIndex``), one round trip per write;
- ``store/<key>``: the agents' key-value store (:class:`EtcdV3Store`, a
  ``torch.distributed.Store``): round membership, the worker store's address, trainguard's own
  keys (straggler medians, memory-tier peers, ...). No GPU node hosts anything the job needs
  after that node is gone;
- ``lease``: the run's lease id. Every key of the run is attached to one lease that every live
  agent keeps alive; when no agent is left, the run's keys expire after ``lease_ttl`` seconds;
- ``heartbeat/<node>``, ``join/<round>/<node>``, ``state.meta``: what
  :class:`ScalableStateHolder` adds so that hundreds of agents can rendezvous (keep-alives
  off the shared state, join requests admitted in batches, a small summary to poll).

Every etcd call is retried with exponential backoff and jitter until ``retry_timeout`` (default
60 s), failing over between the ``--rdzv-endpoint`` members, so an etcd restart or a leader
change pauses the agents instead of killing them; only then does a call raise
``RendezvousConnectionError``. A failed compare-and-swap backs off with jitter before the handler
retries, which keeps hundreds of agents joining at once from starving each other.

Options (``--rdzv-conf key=value,...``, or the ``[rendezvous]`` config section):

=====================  ==========================================================================
``protocol``           ``http`` (default) or ``https`` (default when a certificate is given)
``ca_cert``            CA bundle to verify etcd's server certificate
``ssl_cert``           client certificate (mutual TLS), with ``ssl_cert_key``
``ssl_cert_key``       the client certificate's private key
``user``               etcd user (auth enabled); the password comes from ``TRAINGUARD_ETCD_PASSWORD``
                       or the file named by ``password_file`` / ``TRAINGUARD_ETCD_PASSWORD_FILE``,
                       never from the command line
``key_prefix``         root of the run's keys (default ``/trainguard/rdzv``)
``lease_ttl``          seconds the run's keys outlive its last agent (default 3600)
``request_timeout``    seconds per HTTP request (default 10)
``retry_timeout``      seconds an etcd call keeps retrying before it fails (default 60)
=====================  ==========================================================================
"""

from __future__ import annotations

import base64
import json
import logging
import os
import pickle
import random
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta, timezone
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousConnectionError,
    RendezvousHandler,
    RendezvousParameters,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousBackend,
    RendezvousSettings,
    Token,
    _BackendRendezvousStateHolder,
    _NodeDesc,
    _RendezvousState,
    create_handler,
)

__all__ = [
    "BACKEND_NAME",
    "EtcdV3Client",
    "EtcdV3ConfigError",
    "EtcdV3RendezvousBackend",
    "EtcdV3Store",
    "EtcdUnavailableError",
    "ScalableStateHolder",
    "create_backend",
    "create_rdzv_handler",
    "register",
]

logger = logging.getLogger(__name__)

BACKEND_NAME = "etcd-v3"
PASSWORD_ENV = "TRAINGUARD_ETCD_PASSWORD"
PASSWORD_FILE_ENV = "TRAINGUARD_ETCD_PASSWORD_FILE"
DEFAULT_PORT = 2379
DEFAULT_KEY_PREFIX = "/trainguard/rdzv"
DEFAULT_LEASE_TTL = 3600
DEFAULT_REQUEST_TIMEOUT = 10.0
DEFAULT_RETRY_TIMEOUT = 60.0
DEFAULT_CAS_BACKOFF = 0.02
DEFAULT_CAS_BACKOFF_MAX = 2.0
JOIN_BATCH = 256
"""Join requests one state write admits at most (each load reads this many)."""
OPTIONS = (
    "protocol",
    "ca_cert",
    "ssl_cert",
    "ssl_cert_key",
    "user",
    "password_file",
    "key_prefix",
    "lease_ttl",
    "request_timeout",
    "retry_timeout",
    "cas_backoff",
    "cas_backoff_max",
)


class EtcdV3ConfigError(ValueError):
    """A bad etcd-v3 rendezvous option; the message says which and how to fix it."""


class EtcdUnavailableError(RendezvousConnectionError):
    """etcd did not answer within the retry deadline."""


class _AuthError(Exception):
    pass


def _b64(data: bytes | str) -> str:
    if isinstance(data, str):
        data = data.encode()
    return base64.b64encode(data).decode()


def _unb64(data: str | None) -> bytes:
    return base64.b64decode(data) if data else b""


def _text(e: Exception) -> str:
    return str(getattr(e, "detail_text", None) or e)


def _range_end(prefix: bytes) -> bytes:
    """The end of the key range of every key starting with ``prefix``."""
    b = bytearray(prefix)
    while b:
        if b[-1] < 0xFF:
            b[-1] += 1
            return bytes(b)
        b.pop()
    return b"\0"


# --------------------------------------------------------------------------------------------
# The client: etcd3gw for transport, with failover, retries, auth and the run's lease
# --------------------------------------------------------------------------------------------
class EtcdV3Client:
    """A small etcd v3 client over the JSON gateway with retries, failover, auth and a lease.

    ``endpoints`` are ``(host, port)`` pairs of members of one cluster. Every call retries
    transient failures (connection refused or reset, timeouts, 5xx) with exponential backoff
    and full jitter until ``retry_timeout`` seconds have passed, switching member on each
    failure, then raises :class:`EtcdUnavailableError`.
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
    ) -> None:
        try:
            import etcd3gw
        except ModuleNotFoundError:
            raise EtcdV3ConfigError(
                "--rdzv-backend etcd-v3 needs the etcd3gw package: pip install 'trainguard[etcd]'"
            ) from None

        if not endpoints:
            raise EtcdV3ConfigError("etcd-v3 needs at least one endpoint in --rdzv-endpoint")
        self._exc = etcd3gw.exceptions
        self._clients = [
            etcd3gw.Etcd3Client(
                host=h,
                port=p,
                protocol=protocol,
                ca_cert=ca_cert,
                cert_cert=ssl_cert,
                cert_key=ssl_cert_key,
                timeout=request_timeout,
                api_path="/v3/",
            )
            for h, p in endpoints
        ]
        self._current = 0
        self._ca_cert = ca_cert
        self._user = user
        self._password = password
        self._token: str | None = None
        self._auth_lock = threading.Lock()
        self.retry_timeout = retry_timeout
        self._lease_key = lease_key
        self._lease_ttl = max(int(lease_ttl), 2)
        self._lease_id: int | None = None
        self._lease_lock = threading.Lock()
        self._keeper: threading.Thread | None = None
        self._closed = threading.Event()

    # -- transport -----------------------------------------------------------------------------
    def _post_once(self, index: int, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        c = self._clients[index]
        headers = {"Authorization": self._token} if self._token else None
        extra: dict[str, Any] = {}
        if self._ca_cert:
            # per request: requests lets REQUESTS_CA_BUNDLE override a session's CA bundle
            extra["verify"] = self._ca_cert
        try:
            return c.post(c.get_url(path), json=payload, headers=headers, **extra)
        except self._exc.Etcd3Exception as e:
            text = str(getattr(e, "detail_text", "") or e)
            if "permission denied" in text.lower():
                raise RendezvousConnectionError(
                    f"etcd user {self._user!r} may not use these keys ({text.strip()[:200]}): "
                    "grant the user's role readwrite on the key prefix"
                ) from None
            if "auth" in text.lower() or "user name" in text.lower():
                raise _AuthError(text) from e
            raise

    def _authenticate(self, index: int) -> None:
        if not self._user:
            return
        c = self._clients[index]
        try:
            out = c.post(
                c.get_url("/auth/authenticate"),
                json={"name": self._user, "password": self._password or ""},
            )
        except self._exc.Etcd3Exception as e:
            text = str(getattr(e, "detail_text", "") or e)
            if "authentication failed" in text or "invalid" in text:
                raise RendezvousConnectionError(
                    f"etcd rejected user {self._user!r}: check the password in "
                    f"{PASSWORD_ENV} or the password file"
                ) from None
            raise
        self._token = out.get("token")

    def call(self, path: str, payload: dict[str, Any], *, deadline: float | None = None) -> Any:
        """POST ``payload`` to ``/v3/<path>`` with retries; returns the decoded JSON answer."""
        if deadline is None:
            deadline = time.monotonic() + self.retry_timeout
        delay = 0.05
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
            except (
                self._exc.ConnectionFailedError,
                self._exc.ConnectionTimeoutError,
                self._exc.InternalServerError,
            ) as e:
                err = e
            attempt += 1
            now = time.monotonic()
            if now >= deadline:
                raise EtcdUnavailableError(
                    f"etcd at {self.endpoints_text()} did not answer for {self.retry_timeout:.0f} s"
                    f" ({type(err).__name__}: {_text(err)[:300]})"
                ) from None
            if attempt == 1 or attempt % 20 == 0:
                logger.warning(
                    "etcd call %s failed (%s: %s); retrying", path, type(err).__name__, _text(err)
                )
            self._current = (index + 1) % len(self._clients)
            time.sleep(min(random.uniform(0, delay), max(deadline - now, 0)))
            delay = min(delay * 2, 2.0)

    def endpoints_text(self) -> str:
        return ",".join(f"{c.host}:{c.port}" for c in self._clients)

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
                if self._keeper is None:
                    self._keeper = threading.Thread(
                        target=self._keep_lease, name="trainguard-etcd-lease", daemon=True
                    )
                    self._keeper.start()
        return self._lease_id

    def _acquire_lease(self) -> int:
        assert self._lease_key is not None
        key = _b64(self._lease_key)
        while True:
            found = self.get(self._lease_key)
            if found is not None:
                lease = int(found[0])
                ttl = self.call("kv/lease/timetolive", {"ID": str(lease)})
                if int(ttl.get("TTL", -1)) > 0:
                    return lease
                # The lease is gone but its key is not yet: expired this instant; retry.
                time.sleep(0.1)
                continue
            grant = self.call("lease/grant", {"TTL": str(self._lease_ttl), "ID": "0"})
            mine = int(grant["ID"])
            out = self.txn(
                [{"key": key, "result": "EQUAL", "target": "CREATE", "create_revision": "0"}],
                [
                    {
                        "request_put": {
                            "key": key,
                            "value": _b64(str(mine)),
                            "lease": str(mine),
                        }
                    }
                ],
                [],
            )
            if out.get("succeeded"):
                return mine
            self.call("kv/lease/revoke", {"ID": str(mine)})

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


# --------------------------------------------------------------------------------------------
# The rendezvous backend
# --------------------------------------------------------------------------------------------
_PACKED = b"TGZ1"


def _pack(state: bytes) -> bytes:
    """torch's pickled state compressed (it is mostly repeated node descriptors: a 1000-node
    state shrinks ~8x), so every write and read of it moves less through JSON, base64 and raft."""
    return _PACKED + zlib.compress(state, 1)


def _unpack(value: bytes) -> bytes:
    if not value.startswith(_PACKED):
        return value
    try:
        return zlib.decompress(value[len(_PACKED) :])
    except zlib.error as e:
        raise RendezvousStateError(f"the rendezvous state in etcd is corrupt: {e}") from None


class EtcdV3RendezvousBackend(RendezvousBackend):
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
    ) -> None:
        if not run_id:
            raise ValueError("The run id must be a non-empty string.")
        self._client = client
        self._key = f"{key_prefix.rstrip('/')}/{run_id}/state"
        self._losses = 0
        self._backoff_base = backoff_base
        self._backoff_cap = backoff_cap
        self.writes = 0
        """Compare-and-swap attempts of this backend (won or lost)."""
        self.wins = 0
        """Compare-and-swap attempts that won."""

    @property
    def name(self) -> str:
        return BACKEND_NAME

    @property
    def key(self) -> str:
        return self._key

    def get_state(self) -> tuple[bytes, Token] | None:
        found = self._client.get(self._key)
        if found is None:
            return None
        return _unpack(found[0]), found[1]

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

    @property
    def _join_prefix(self) -> str:
        return self._key.rsplit("/", 1)[0] + "/join/"

    def load(
        self, since: int = 0
    ) -> tuple[bytes, int, dict[str, float], list[tuple[int, dict[str, Any]]], int] | None:
        """In one read: the state, its revision, the heartbeat keys written after revision
        ``since`` (all when 0), the oldest ``JOIN_BATCH`` join requests, and the store's
        revision."""
        hb, jp = self._hb_prefix, self._join_prefix
        beats: dict[str, Any] = {"key": _b64(hb), "range_end": _b64(_range_end(hb.encode()))}
        if since > 0:
            beats["min_mod_revision"] = str(since + 1)
        out = self._client.txn(
            [],
            [
                {"request_range": {"key": _b64(self._key)}},
                {"request_range": beats},
                {
                    "request_range": {
                        "key": _b64(jp),
                        "range_end": _b64(_range_end(jp.encode())),
                        "sort_order": "ASCEND",
                        "sort_target": "CREATE",
                        "limit": str(JOIN_BATCH),
                    }
                },
            ],
            [],
        )
        responses = out.get("responses") or [{}, {}, {}]
        kvs = (responses[0].get("response_range") or {}).get("kvs") or []
        if not kvs:
            return None
        times: dict[str, float] = {}
        for kv in (responses[1].get("response_range") or {}).get("kvs") or []:
            try:
                times[_unb64(kv["key"]).decode()[len(hb) :]] = float(_unb64(kv.get("value")))
            except (KeyError, ValueError):
                continue
        joins: list[tuple[int, dict[str, Any]]] = []
        for kv in (responses[2].get("response_range") or {}).get("kvs") or []:
            try:
                rnd = int(_unb64(kv["key"]).decode()[len(jp) :].split("/", 1)[0])
                joins.append((rnd, json.loads(_unb64(kv.get("value")))))
            except (KeyError, ValueError):
                continue
        state = _unpack(_unb64(kvs[0].get("value")))
        revision = int(out.get("header", {}).get("revision", 0))
        return state, int(kvs[0].get("mod_revision", 0)), times, joins, revision

    def meta(self) -> bytes | None:
        found = self._client.get(self._meta_key)
        return None if found is None else found[0]

    def put_heartbeat(self, node: str, when: float) -> None:
        self._client.put(self._hb_prefix + node, repr(when))

    def put_join(self, round_: int, node: _NodeDesc, when: float) -> None:
        """This node asks to join ``round_`` as a participant (any writer may add it)."""
        value = {"addr": node.addr, "pid": node.pid, "local_id": node.local_id, "t": when}
        self._client.put(f"{self._join_prefix}{round_}/{node!r}", json.dumps(value))

    def forget_joins(self, round_: int) -> None:
        self._client.delete(f"{self._join_prefix}{round_}/", prefix=True)

    def forget_join_requests(self, round_: int, nodes: list[_NodeDesc]) -> None:
        """Drop the join requests of admitted nodes (in transactions of at most 100 deletes,
        below etcd's default limit of 128 operations)."""
        keys = [f"{self._join_prefix}{round_}/{n!r}" for n in nodes]
        for i in range(0, len(keys), 100):
            ops = [{"request_delete_range": {"key": _b64(k)}} for k in keys[i : i + 100]]
            self._client.txn([], ops, [])


# --------------------------------------------------------------------------------------------
# The state holder: heartbeats out of the shared state, cheap polls while a round fills
# --------------------------------------------------------------------------------------------
def _meta(state: _RendezvousState) -> bytes:
    """What a node waiting for a round to fill must not miss: round, completion, closing, the
    last-call deadline, and whether nodes wait for the next round."""
    deadline = state.deadline.isoformat() if state.deadline else ""
    return (
        f"{state.round}|{int(state.complete)}|{int(state.closed)}|{deadline}|{len(state.wait_list)}"
    ).encode()


class ScalableStateHolder(_BackendRendezvousStateHolder):
    """torch's state holder, made to scale on :class:`EtcdV3RendezvousBackend`.

    torch keeps every node's keep-alive time inside the one shared state, so each keep-alive is
    a compare-and-swap of the whole state that races every join: with a few hundred nodes the
    keep-alives alone outrun what one key can take, nodes that cannot land theirs are declared
    dead and removed, rejoin, and the round never completes. Here:

    - a write that changes nothing but this node's keep-alive time goes to the node's own key
      (``heartbeat/<node>``, no race); every full read overlays those times on the state before
      torch's dead-node check, so liveness means exactly what it means in torch;
    - a node waiting for an incomplete round to fill reads only a small summary key (round,
      complete, closed, deadline, wait-list size, written with every state write) and reads
      the full state only when it changes, or every ``max(keep_alive_interval, nodes/100 s)``
      to check liveness, instead of decoding the whole state every second;
    - a won write keeps the state it wrote instead of decoding it again.

    Every decision is still torch's (the same operations and the same compare-and-swap); a
    decision taken on a state that turns out stale simply loses its race and is retried.
    """

    def __init__(
        self,
        backend: EtcdV3RendezvousBackend,
        settings: RendezvousSettings,
        node: _NodeDesc,
        cache_duration: int = 1,
    ) -> None:
        super().__init__(backend, settings, cache_duration)
        self._etcd = backend
        self._node = node
        self._node_key = repr(node)
        self._last_full = -float("inf")
        self._meta_seen: bytes | None = None
        self._poll = 1.0
        self._next_poll = 0.0
        self._snapshot: tuple[Any, ...] | None = None
        self._joins: dict[_NodeDesc, float] = {}
        self._join_round: int | None = None
        self._join_beat = 0.0
        self._beats: dict[str, float] = {}
        self._beats_rev = 0
        self._admitted: list[_NodeDesc] = []
        self.batched = 0
        """Other nodes this node added to a round on their request (statistics)."""

    def _take_snapshot(self) -> tuple[Any, ...]:
        st = self._state
        return (
            st.round,
            st.complete,
            st.closed,
            st.deadline,
            dict(st.participants),
            set(st.wait_list),
            set(st.redundancy_list),
            set(st.last_heartbeats),
        )

    def _heartbeat_only(self) -> bool:
        return (
            self._token is not None
            and self._snapshot is not None
            and self._node in self._state.last_heartbeats
            and self._take_snapshot() == self._snapshot
        )

    def _joining(self) -> bool:
        """This write adds this node to the participants of an open round."""
        snap = self._snapshot
        st = self._state
        return (
            snap is not None
            and self._node not in snap[4]
            and self._node in st.participants
            and not st.closed
        )

    def _add_requested_joins(self, st: _RendezvousState) -> int:
        """Add the nodes that asked to join this round, as each would add itself (torch's
        ``_add_to_participants``: last-call deadline at ``min_nodes``, ranks at ``max_nodes``),
        so one write admits many nodes instead of each racing for its own."""
        settings = self._settings
        fresh = (
            time.time()
            - (settings.keep_alive_interval * settings.keep_alive_max_attempt).total_seconds()
        )
        added = 0
        self._admitted = []
        for node, t in sorted(self._joins.items(), key=lambda kv: kv[1]):
            if st.complete or len(st.participants) >= settings.max_nodes:
                break
            if node in st.participants or node in st.redundancy_list or t < fresh:
                continue
            st.wait_list.discard(node)
            st.participants[node] = 0
            self._admitted.append(node)
            # as of now: the node learns of its admission at its next read and keeps its
            # heartbeat key fresh meanwhile
            st.last_heartbeats[node] = datetime.now(timezone.utc)
            added += 1
            if len(st.participants) == settings.min_nodes:
                st.deadline = datetime.now(timezone.utc) + settings.timeout.last_call
            if len(st.participants) == settings.max_nodes:
                st.complete = True
                st.deadline = None
                for rank, member in enumerate(sorted(st.participants)):
                    st.participants[member] = rank
        return added

    def _load_full(self) -> None:
        loaded = self._etcd.load(self._beats_rev)
        if loaded is None:
            self._state, self._token = _RendezvousState(), None
        else:
            bits, self._token, beats, joins, self._beats_rev = loaded
            self._beats.update(beats)
            try:
                self._state = pickle.loads(bits)  # torch's own state format
            except pickle.PickleError as exc:
                raise RendezvousStateError(
                    "The rendezvous state is corrupt. See inner exception for details."
                ) from exc
            self._joins = {}
            for rnd, j in joins:
                if rnd == self._state.round:
                    try:
                        node = _NodeDesc(str(j["addr"]), int(j["pid"]), int(j["local_id"]))
                        self._joins[node] = float(j["t"])
                    except (KeyError, TypeError, ValueError):
                        continue
            hb = self._state.last_heartbeats
            for node, when in hb.items():
                t = self._beats.get(repr(node))
                if t is not None and t > when.timestamp():
                    hb[node] = datetime.fromtimestamp(t, timezone.utc)
        self._meta_seen = _meta(self._state)
        self._last_full = time.monotonic()
        self._done()

    def _done(self) -> None:
        self._dirty = False
        self._last_sync_time = time.monotonic()
        self._sanitize()
        self._snapshot = self._take_snapshot()

    def _may_skip_full_read(self, now: float) -> bool:
        st = self._state
        if self._token is None or st.complete or self._node not in st.participants:
            return False
        full_every = max(
            self._settings.keep_alive_interval.total_seconds(), len(st.last_heartbeats) / 100.0
        )
        if now - self._last_full >= full_every:
            return False
        if now < self._next_poll:
            return True
        if self._etcd.meta() != self._meta_seen:
            return False
        self._poll = min(self._poll * 1.5, 2.0)
        self._next_poll = now + self._poll * random.uniform(0.5, 1.0)
        return True

    def _refresh_pending_join(self) -> None:
        """A node that asked to join keeps its heartbeat key fresh until it sees itself in the
        state (another node may have admitted it already)."""
        if self._join_round is None or self._join_round != self._state.round:
            return
        if self._node in self._state.last_heartbeats:
            return
        now = time.time()
        if now - self._join_beat >= self._settings.keep_alive_interval.total_seconds():
            self._etcd.put_heartbeat(self._node_key, now)
            self._join_beat = now

    def sync(self) -> bool | None:
        self._refresh_pending_join()
        now = time.monotonic()
        if self._dirty:
            if self._heartbeat_only():
                when = self._state.last_heartbeats[self._node].timestamp()
                self._etcd.put_heartbeat(self._node_key, when)
                self._done()
                return True
            was_complete = self._snapshot is not None and self._snapshot[1]
            if self._joining():
                st = self._state
                if (
                    self._join_round != st.round
                    or time.time() - self._join_beat
                    >= self._settings.keep_alive_interval.total_seconds()
                ):
                    self._join_beat = time.time()
                    self._etcd.put_heartbeat(self._node_key, self._join_beat)
                    self._etcd.put_join(st.round, self._node, self._join_beat)
                    self._join_round = st.round
                added = self._add_requested_joins(st)
            else:
                added = 0
            bits = pickle.dumps(self._state)
            meta = _meta(self._state)
            out = self._etcd.set_state(bits, self._token, meta=meta, fetch=False)
            if out is not None and out[2]:
                self._token = out[1]
                self._meta_seen = meta
                self.batched += added
                try:
                    if self._state.complete and not was_complete:
                        self._etcd.forget_joins(self._state.round)
                    elif added:
                        self._etcd.forget_join_requests(self._state.round, self._admitted)
                except RendezvousConnectionError:
                    pass  # they expire with the run's lease
                self._done()
                return True
            self._load_full()
            self._poll, self._next_poll = 1.0, 0.0
            return False
        if self._cache_duration > 0 and self._last_sync_time >= max(now - self._cache_duration, 0):
            return None
        if self._may_skip_full_read(now):
            self._last_sync_time = now
            return None
        self._load_full()
        self._poll, self._next_poll = 1.0, 0.0
        return None


# --------------------------------------------------------------------------------------------
# The store
# --------------------------------------------------------------------------------------------
class EtcdV3Store(dist.Store):
    """A ``torch.distributed.Store`` on etcd v3 keys under ``prefix``.

    Values are bytes; ``add`` keeps an integer as a decimal string (as TCPStore does). ``get`` and
    ``wait`` block until the keys exist or the store's timeout (``set_timeout``) passes, polling
    with a backoff from 10 ms to 250 ms; a timeout raises ``torch.distributed.DistStoreError``.
    """

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
        self.wait([key])
        found = self._client.get(self._k(key))
        if found is None:  # deleted between wait and get
            raise dist.DistStoreError(f"key {key!r} was deleted while being read")
        return found[0]

    def _cas_loop(self, key: str, update: Callable[[bytes | None], bytes]) -> bytes:
        k = self._k(key)
        bk = _b64(k)
        delay = 0.005
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
            time.sleep(random.uniform(0, delay))
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

    def _missing(self, keys: Sequence[str]) -> list[str]:
        if not keys:
            return []
        ops = [{"request_range": {"key": _b64(self._k(k)), "keys_only": True}} for k in keys]
        out = self._client.txn([], ops, [])
        missing = []
        for k, r in zip(keys, out.get("responses") or [], strict=False):
            if not (r.get("response_range") or {}).get("kvs"):
                missing.append(k)
        return missing

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:  # type: ignore[override]
        limit = (timeout if timeout is not None else self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        delay = 0.01
        pending = list(keys)
        while True:
            pending = self._missing(pending)
            if not pending:
                return
            now = time.monotonic()
            if now >= deadline:
                raise dist.DistStoreError(
                    f"timed out after {limit:.1f} s waiting for keys {pending} in etcd "
                    f"({self._prefix})"
                )
            time.sleep(min(delay, deadline - now))
            delay = min(delay * 1.5, 0.25)

    def check(self, keys: Sequence[str]) -> bool:
        return not self._missing(list(keys))

    def delete_key(self, key: str) -> bool:
        return self._client.delete(self._k(key)) > 0

    def num_keys(self) -> int:
        out = self._client.range(self._prefix, prefix=True, count_only=True)
        return int(out.get("count", 0))

    def multi_get(self, keys: Sequence[str]) -> list[bytes]:
        keys = list(keys)
        self.wait(keys)
        ops = [{"request_range": {"key": _b64(self._k(k))}} for k in keys]
        out = self._client.txn([], ops, [])
        values = []
        for k, r in zip(keys, out.get("responses") or [], strict=True):
            kvs = (r.get("response_range") or {}).get("kvs") or []
            if not kvs:
                raise dist.DistStoreError(f"key {k!r} was deleted while being read")
            values.append(_unb64(kvs[0].get("value")))
        return values

    def multi_set(self, keys: Sequence[str], values: Sequence[str | bytes]) -> None:
        ops = [
            self._client.put_request(self._k(k), self._v(v))
            for k, v in zip(keys, values, strict=True)
        ]
        if ops:
            self._client.txn([], ops, [])


# --------------------------------------------------------------------------------------------
# Parameters, registration
# --------------------------------------------------------------------------------------------
def parse_endpoints(endpoint: str) -> list[tuple[str, int]]:
    """``host:port[,host:port...]`` (an ``http(s)://`` scheme is accepted and ignored)."""
    out = []
    for part in endpoint.split(","):
        part = part.strip()
        if not part:
            continue
        for scheme in ("http://", "https://"):
            if part.startswith(scheme):
                part = part[len(scheme) :]
        part = part.rstrip("/")
        if part.startswith("["):  # [v6addr]:port
            host, _, rest = part[1:].partition("]")
            port = rest[1:] if rest.startswith(":") else str(DEFAULT_PORT)
        elif part.count(":") == 1:
            host, _, port = part.partition(":")
        elif ":" not in part:
            host, port = part, str(DEFAULT_PORT)
        else:
            host, port = part, "?"
        try:
            out.append((host or "127.0.0.1", int(port)))
        except ValueError:
            raise EtcdV3ConfigError(
                f"--rdzv-endpoint {endpoint!r}: {part!r} is not host:port; "
                "use e.g. --rdzv-endpoint etcd1:2379,etcd2:2379"
            ) from None
    if not out:
        raise EtcdV3ConfigError(
            "--rdzv-backend etcd-v3 needs --rdzv-endpoint host:port[,host:port] of etcd"
        )
    return out


def _read_password(params: RendezvousParameters) -> str | None:
    if params.get("password") is not None:
        raise EtcdV3ConfigError(
            "--rdzv-conf password=... would put the etcd password on the command line: set "
            f"{PASSWORD_ENV} or password_file=/path (or {PASSWORD_FILE_ENV}) instead"
        )
    if os.environ.get(PASSWORD_ENV):
        return os.environ[PASSWORD_ENV]
    path = params.get("password_file") or os.environ.get(PASSWORD_FILE_ENV)
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError as e:
        raise EtcdV3ConfigError(
            f"etcd password file {path!r}: {e.strerror}; check password_file / {PASSWORD_FILE_ENV}"
        ) from None


def _number(params: RendezvousParameters, key: str, default: float) -> float:
    raw = params.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = -1.0
    if value <= 0:
        raise EtcdV3ConfigError(f"--rdzv-conf {key}={raw!r}: must be a positive number of seconds")
    return value


def client_from_params(params: RendezvousParameters) -> EtcdV3Client:
    """Build the client from ``--rdzv-endpoint`` and ``--rdzv-conf``; raises EtcdV3ConfigError."""
    endpoints = parse_endpoints(params.endpoint)
    for key in ("ca_cert", "ssl_cert", "ssl_cert_key", "password_file"):
        path = params.get(key)
        if path and key != "password_file" and not os.path.isfile(path):
            raise EtcdV3ConfigError(f"--rdzv-conf {key}={path!r}: no such file")
    ssl_cert, ssl_key = params.get("ssl_cert"), params.get("ssl_cert_key")
    if bool(ssl_cert) != bool(ssl_key):
        raise EtcdV3ConfigError(
            "--rdzv-conf ssl_cert and ssl_cert_key go together (client certificate and its key)"
        )
    tls = bool(params.get("ca_cert") or ssl_cert)
    protocol = str(params.get("protocol") or ("https" if tls else "http")).strip().lower()
    if protocol not in ("http", "https"):
        raise EtcdV3ConfigError(f"--rdzv-conf protocol={protocol!r}: use http or https")
    user = params.get("user") or None
    password = _read_password(params)
    if password and not user:
        raise EtcdV3ConfigError("an etcd password is set but no user: add --rdzv-conf user=NAME")
    prefix = str(params.get("key_prefix") or DEFAULT_KEY_PREFIX).rstrip("/")
    return EtcdV3Client(
        endpoints,
        protocol=protocol,
        ca_cert=params.get("ca_cert") or None,
        ssl_cert=ssl_cert or None,
        ssl_cert_key=ssl_key or None,
        user=user,
        password=password,
        request_timeout=_number(params, "request_timeout", DEFAULT_REQUEST_TIMEOUT),
        retry_timeout=_number(params, "retry_timeout", DEFAULT_RETRY_TIMEOUT),
        lease_key=f"{prefix}/{params.run_id}/lease",
        lease_ttl=int(_number(params, "lease_ttl", DEFAULT_LEASE_TTL)),
    )


def create_backend(
    params: RendezvousParameters,
) -> tuple[EtcdV3RendezvousBackend, EtcdV3Store]:
    """The backend and the store of one run, sharing one client (and lease)."""
    client = client_from_params(params)
    prefix = str(params.get("key_prefix") or DEFAULT_KEY_PREFIX).rstrip("/")
    backend = EtcdV3RendezvousBackend(
        client,
        params.run_id,
        key_prefix=prefix,
        backoff_base=_number(params, "cas_backoff", DEFAULT_CAS_BACKOFF),
        backoff_cap=_number(params, "cas_backoff_max", DEFAULT_CAS_BACKOFF_MAX),
    )
    store = EtcdV3Store(client, f"{prefix}/{params.run_id}/store/")
    return backend, store


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The ``etcd-v3`` handler: torch's dynamic rendezvous on this backend, store and holder."""
    backend, store = create_backend(params)
    stock = create_handler(store, backend, params)  # torch's parsing of the rdzv options
    node = getattr(stock, "_this_node", None)
    settings = getattr(stock, "_settings", None)
    if node is None or settings is None:  # another torch: its own holder still works
        return stock
    holder = ScalableStateHolder(backend, settings, node)
    return DynamicRendezvousHandler(node, settings, backend.name, store, holder)


def register() -> None:
    """Register ``etcd-v3`` in torch's rendezvous handler registry (idempotent)."""
    rdzv_registry.handler_registry.register(BACKEND_NAME, create_rdzv_handler)
