"""An etcd v3 backend for torch's dynamic rendezvous: ``--rdzv-backend etcd-v3``.

torch ships etcd backends for etcd's v2 API only (``etcd``, ``etcd-v2``, through python-etcd),
which etcd 3.4 serves only with ``--enable-v2`` and newer releases dropped. This module speaks
etcd's v3 API through its HTTP/JSON gateway (``/v3/...``) with the standard library's
``http.client`` (keep-alive connections, streaming watches): no gRPC or protobuf in the agent
(the gRPC client ``etcd3`` 0.12 does not import with protobuf >= 4), and about a fifth of the CPU
per call of ``requests``-based clients such as ``etcd3gw``.

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
  off the shared state, join requests admitted in batches, a small summary to poll; the
  first node to leave a complete round ends it for all, so a node loss costs one write, not
  one per survivor).

Every etcd call is retried with exponential backoff and jitter until ``retry_timeout`` (default
60 s), failing over between the ``--rdzv-endpoint`` members, so an etcd restart or a leader
change pauses the agents instead of killing them; only then does a call raise
``RendezvousConnectionError``. Inside a rendezvous a call retries on until the round's own
deadline (torch's ``join_timeout``), and a round that etcd's silence keeps from completing by
then ends with the error of any round that did not complete, naming what it lacked. A failed compare-and-swap backs off with jitter before the handler
retries, which keeps hundreds of agents joining at once from starving each other.

Options (``--rdzv-conf key=value,...``, or the ``[rendezvous]`` config section):

=======================  ========================================================================
``protocol``             ``http`` (default) or ``https`` (default when a certificate is given)
``ca_cert``              CA bundle to verify etcd's server certificate
``ssl_cert``             client certificate (mutual TLS), with ``ssl_cert_key``
``ssl_cert_key``         the client certificate's private key
``user``                 etcd user (auth enabled); the password comes from
                         ``TRAINGUARD_ETCD_PASSWORD`` or the file named by ``password_file`` /
                         ``TRAINGUARD_ETCD_PASSWORD_FILE``, never from the command line; over
                         plain ``http`` (no TLS) a warning says that both cross the network
                         unencrypted
``key_prefix``           root of the run's keys (default ``/trainguard/rdzv``)
``lease_ttl``            seconds the run's keys outlive its last agent (default 3600)
``request_timeout``      seconds per HTTP request (default 10)
``retry_timeout``        seconds an etcd call keeps retrying before it fails (default 60)
``accept_pickle_state``  ``1``: read a state in torch's pickle format (torch's stock state holder
                         writes it); off by default, since unpickling runs whatever code the
                         writer of the key put in it. A refused state is logged once, reported
                         as the event ``rdzv_state_refused``, and written over
=======================  ========================================================================
"""

from __future__ import annotations

from trainguard.runtime.etcd_v3._common import (
    BACKEND_NAME,
    DEFAULT_KEY_PREFIX,
    OPTIONS,
    PASSWORD_ENV,
    PASSWORD_FILE_ENV,
    EtcdUnavailableError,
    EtcdV3ConfigError,
    _b64,
    _unb64,
)
from trainguard.runtime.etcd_v3.backend import EtcdV3RendezvousBackend, _pack, _unpack
from trainguard.runtime.etcd_v3.client import EtcdV3Client
from trainguard.runtime.etcd_v3.handler import (
    client_from_params,
    create_backend,
    create_rdzv_handler,
    parse_endpoints,
    register,
    report_rdzv_events,
)
from trainguard.runtime.etcd_v3.holder import ScalableStateHolder
from trainguard.runtime.etcd_v3.store import EtcdV3Store

__all__ = [
    "BACKEND_NAME",
    "DEFAULT_KEY_PREFIX",
    "OPTIONS",
    "PASSWORD_ENV",
    "PASSWORD_FILE_ENV",
    "EtcdUnavailableError",
    "EtcdV3Client",
    "EtcdV3ConfigError",
    "EtcdV3RendezvousBackend",
    "EtcdV3Store",
    "ScalableStateHolder",
    "_b64",
    "_pack",
    "_unb64",
    "_unpack",
    "client_from_params",
    "create_backend",
    "create_rdzv_handler",
    "parse_endpoints",
    "register",
    "report_rdzv_events",
]
