"""Constants, errors and encoding helpers shared by the etcd-v3 modules."""

from __future__ import annotations

import base64

from torch.distributed.elastic.rendezvous import RendezvousConnectionError

from trainguard.core.contracts import envvars

BACKEND_NAME = "etcd-v3"
PASSWORD_ENV = envvars.ETCD_PASSWORD
PASSWORD_FILE_ENV = envvars.ETCD_PASSWORD_FILE
DEFAULT_PORT = 2379
DEFAULT_KEY_PREFIX = "/trainguard/rdzv"
DEFAULT_LEASE_TTL = 3600
DEFAULT_REQUEST_TIMEOUT = 10.0
DEFAULT_RETRY_TIMEOUT = 60.0
DEFAULT_CAS_BACKOFF = 0.02
DEFAULT_CAS_BACKOFF_MAX = 2.0
JOIN_BATCH = 1024
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
    "accept_pickle_state",
)


class EtcdV3ConfigError(ValueError):
    """A bad etcd-v3 rendezvous option; the message says which and how to fix it."""


class EtcdUnavailableError(RendezvousConnectionError):
    """etcd did not answer within the retry deadline."""


class LeaseGoneError(RendezvousConnectionError):
    """A write named a lease of the caller's own (not the run's lease) that expired or was
    revoked: the caller grants a new one and writes again."""


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
