"""Configuration of the rendezvous backends (section [rendezvous], env TRAINGUARD_RENDEZVOUS_*).

These fill in ``--rdzv-conf`` keys of ``--rdzv-backend etcd-v3`` that the command line does not
set. The etcd password is deliberately not a field (the effective config is written to the run
directory): it comes from ``TRAINGUARD_ETCD_PASSWORD`` or the file named by
``etcd_password_file``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class RendezvousConfig:
    etcd_user: str | None = None
    """etcd user name when etcd has authentication on (``--rdzv-conf user=``)."""
    etcd_password_file: str | None = None
    """File holding the etcd password (``--rdzv-conf password_file=``)."""
    etcd_ca_cert: str | None = None
    """CA bundle that signed etcd's server certificate (``--rdzv-conf ca_cert=``)."""
    etcd_ssl_cert: str | None = None
    """Client certificate for mutual TLS (``--rdzv-conf ssl_cert=``)."""
    etcd_ssl_cert_key: str | None = None
    """The client certificate's private key (``--rdzv-conf ssl_cert_key=``)."""
    etcd_key_prefix: str | None = None
    """Root of the run's keys in etcd (default ``/trainguard/rdzv``)."""
    etcd_lease_ttl_s: int | None = None
    """Seconds a run's keys outlive its last agent (default 3600)."""
    etcd_retry_timeout_s: float | None = None
    """Seconds an etcd call keeps retrying (etcd restart, leader change) before failing (60);
    inside a rendezvous, until its join timeout when that is later."""
    etcd_accept_pickle_state: bool = False
    """Read a rendezvous state in torch's pickle format (``--rdzv-conf accept_pickle_state=1``,
    as torch's stock state holder writes it). Off: unpickling runs whatever code the writer of
    the key put in it, and anyone who may write the key prefix in etcd can write it; such a
    state is refused (one log line, event ``rdzv_state_refused``) and written over."""

    def rdzv_conf(self) -> dict[str, str]:
        """The set fields as etcd-v3 ``--rdzv-conf`` keys."""
        names = {
            "etcd_user": "user",
            "etcd_password_file": "password_file",
            "etcd_ca_cert": "ca_cert",
            "etcd_ssl_cert": "ssl_cert",
            "etcd_ssl_cert_key": "ssl_cert_key",
            "etcd_key_prefix": "key_prefix",
            "etcd_lease_ttl_s": "lease_ttl",
            "etcd_retry_timeout_s": "retry_timeout",
            "etcd_accept_pickle_state": "accept_pickle_state",
        }
        return {conf: str(getattr(self, f)) for f, conf in names.items() if getattr(self, f)}
