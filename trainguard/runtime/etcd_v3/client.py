"""The etcd v3 client: etcd3gw for transport, with failover, retries, auth and the run's lease."""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Sequence
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from trainguard.runtime.etcd_v3._common import (
    DEFAULT_LEASE_TTL,
    DEFAULT_REQUEST_TIMEOUT,
    DEFAULT_RETRY_TIMEOUT,
    PASSWORD_ENV,
    EtcdUnavailableError,
    EtcdV3ConfigError,
    _AuthError,
    _b64,
    _range_end,
    _text,
    _unb64,
)

__all__ = ["EtcdV3Client"]

logger = logging.getLogger(__name__)


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
