"""Parameters, the handler factory and the registration of ``--rdzv-backend etcd-v3``."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousParameters,
)
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    create_handler,
)

from trainguard.runtime import _torch
from trainguard.runtime.etcd_v3._common import (
    BACKEND_NAME,
    DEFAULT_CAS_BACKOFF,
    DEFAULT_CAS_BACKOFF_MAX,
    DEFAULT_KEY_PREFIX,
    DEFAULT_LEASE_TTL,
    DEFAULT_PORT,
    DEFAULT_REQUEST_TIMEOUT,
    DEFAULT_RETRY_TIMEOUT,
    PASSWORD_ENV,
    PASSWORD_FILE_ENV,
    EtcdV3ConfigError,
)
from trainguard.runtime.etcd_v3.backend import EtcdV3RendezvousBackend
from trainguard.runtime.etcd_v3.client import EtcdV3Client
from trainguard.runtime.etcd_v3.codec import PICKLE_OPTION
from trainguard.runtime.etcd_v3.holder import ScalableStateHolder
from trainguard.runtime.etcd_v3.store import EtcdV3Store

__all__ = [
    "client_from_params",
    "create_backend",
    "create_rdzv_handler",
    "parse_endpoints",
    "register",
    "report_rdzv_events",
]

logger = logging.getLogger(__name__)


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
        accept_pickle=_accept_pickle(params),
    )
    store = EtcdV3Store(client, f"{prefix}/{params.run_id}/store/")
    if backend.accept_pickle:
        logger.warning(
            "etcd-v3: %s is on: a rendezvous state in torch's pickle format is unpickled, so "
            "whoever can write %s runs code in this agent; keep it off unless every writer of "
            "the key prefix is trusted",
            PICKLE_OPTION,
            backend.key,
        )
    return backend, store


def _accept_pickle(params: RendezvousParameters) -> bool:
    try:
        return bool(params.get_as_bool(PICKLE_OPTION, False))
    except ValueError:
        raise EtcdV3ConfigError(
            f"--rdzv-conf {PICKLE_OPTION}={params.get(PICKLE_OPTION)!r}: use 0 or 1"
        ) from None


def create_rdzv_handler(params: RendezvousParameters) -> RendezvousHandler:
    """The ``etcd-v3`` handler: torch's dynamic rendezvous on this backend, store and holder."""
    _torch.cheap_rendezvous_event_names()
    backend, store = create_backend(params)
    stock = create_handler(store, backend, params)  # torch's parsing of the rdzv options
    node = _torch.handler_node(stock)
    settings = _torch.handler_settings(stock)
    if node is None or settings is None:  # another torch: its own holder still works
        if not backend.accept_pickle:
            raise EtcdV3ConfigError(
                "etcd-v3: this torch's dynamic rendezvous has no _this_node/_settings, so only "
                "torch's stock state holder runs here, and it unpickles the state it reads from "
                f"etcd: --rdzv-conf {PICKLE_OPTION}=1 allows it where every writer of the key "
                "prefix is trusted (or use a torch >= 2.5)"
            )
        return stock
    holder = ScalableStateHolder(backend, settings, node)
    return _torch.QuietKeepAliveHandler(node, settings, backend.name, store, holder)


def report_rdzv_events(handler: Any, emit: Callable[..., object]) -> None:
    """Have the etcd-v3 backend under ``handler`` (torch's dynamic handler) report a refused
    rendezvous state as ``emit(STATE_REFUSED_EVENT, key=, revision=, reason=)`` and a round
    this node ended for every node (it left it first) as ``emit("rdzv_round_ended", round=,
    left=)``; a no-op for other backends."""
    try:
        backend = _torch.handler_backend(handler)
    except AttributeError:  # not torch's dynamic handler
        return
    if isinstance(backend, EtcdV3RendezvousBackend):
        backend.on_refused = lambda **fields: emit("rdzv_state_refused", **fields)
        backend.on_round_ended = lambda **fields: emit("rdzv_round_ended", **fields)


def register() -> None:
    """Register ``etcd-v3`` in torch's rendezvous handler registry (idempotent)."""
    rdzv_registry.handler_registry.register(BACKEND_NAME, create_rdzv_handler)
