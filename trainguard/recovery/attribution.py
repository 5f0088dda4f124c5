"""Failure attribution: what ended a worker group, and what a restart can do about it.

Each failed round is classified from what is there: the workers' exit codes and signals, torch's
error file (the exception and its traceback: the workers' start-up hook writes it for an
uncaught exception, ``@record`` or not), the last lines of a worker's output when torch
captured it, the in-job health findings (DCGM/XID, probes) and the hang detector (flight
recorder). Causes and their verdicts:

=================  ==========  ================================================================
cause              verdict     evidence
=================  ==========  ================================================================
``user_code``      stop        the same exception at the same place in the user's code on every
                               rank of the job, or in two failed attempts in a row
                               (deterministic); one rank once: restart
``out_of_memory``  stop        ``torch.OutOfMemoryError`` / "CUDA out of memory" (with the
                               figure torch names) / ``MemoryError``
``hardware``       evict       an XID / DCGM / probe finding before the workers were killed, a
                               CUDA error of the device (ECC, fallen off the bus, NVLink)
``network``        restart     a collective timeout, a peer's connection lost (gloo / NCCL)
``data``           rollback    a NaN / Inf the script raised on (``FloatingPointError``, a
                               message naming NaN): restart from the last checkpoint
``control_plane``  retry       the rendezvous / store / etcd the job depends on failed
``transient``      restart     killed (SIGKILL), stopped and killed by the hang detector,
                               crashed (SIGSEGV...) or exited without saying why; the peers
                               that lost their connection to a killed rank are its consequence
``sdc``            evict       a worker exited with the silent-data-corruption code (95): the
                               replicas' check named its rank (``[sdc]``, several nodes)
=================  ==========  ================================================================

Only ``user_code`` and ``out_of_memory`` stop a job, and only on an exception the script raised
itself: a kill, a stop, a hang, a peer's loss or a health finding never reads as one.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from trainguard.core.contracts.actions import Cause, HealthAction, Verdict
from trainguard.core.errorfile import ExceptionSite, exception_site
from trainguard.core.failures import (
    SDC_EXIT_CODE,
    FailureKind,
    WorkerFailure,
    peer_failure_text,
)

__all__ = ["Attribution", "Cause", "Verdict", "attribute", "oom_figure"]


VERDICTS: dict[Cause, Verdict] = {
    Cause.USER_CODE: Verdict.STOP,
    Cause.OUT_OF_MEMORY: Verdict.STOP,
    Cause.HARDWARE: Verdict.EVICT,
    Cause.NETWORK: Verdict.RESTART,
    Cause.DATA: Verdict.ROLLBACK,
    Cause.CONTROL_PLANE: Verdict.RETRY,
    Cause.TRANSIENT: Verdict.RESTART,
    Cause.SDC: Verdict.EVICT,
}

_OOM_TYPES = {"OutOfMemoryError", "MemoryError"}
_OOM_TEXT = re.compile(r"out of memory", re.I)
_OOM_FIGURE = re.compile(r"Tried to allocate ([\d.]+ ?[KMGT]i?B)", re.I)
_HARDWARE_TEXT = re.compile(
    r"uncorrectable ECC|ECC error|fallen off the bus|NVLink|Xid|GPU is lost|"
    r"unspecified launch failure|hardware error|device-side assert.*ECC",
    re.I,
)
_NETWORK_TYPES = {"DistNetworkError", "DistBackendError"}
_NETWORK_TEXT = re.compile(
    r"timed out|timeout|Watchdog caught collective operation|NCCL error|ncclRemoteError|"
    r"ncclSystemError|connection refused|connection reset|network is unreachable|"
    r"Gloo .*(error|failure)|no route to host",
    re.I,
)
_CONTROL_TYPES = {"DistStoreError", "RendezvousError", "RendezvousConnectionError",
                  "RendezvousTimeoutError", "RendezvousClosedError"}  # fmt: skip
_CONTROL_TEXT = re.compile(r"TCPStore|etcd|rendezvous|store\b.*(connect|timeout)", re.I)
_DATA_TYPES = {"FloatingPointError"}
_DATA_TEXT = re.compile(r"\bnan\b|\binf\b|non-finite|not finite", re.I)
# exceptions of the environment more than of the code: a retry may well succeed
_ENVIRONMENT_TYPES = {"OSError", "IOError", "ConnectionError", "TimeoutError", "BrokenPipeError",
                      "ConnectionResetError", "ConnectionRefusedError", "InterruptedError",
                      "BlockingIOError", "ChildProcessError", "PermissionError"}  # fmt: skip


def oom_figure(text: str) -> str | None:
    """The allocation an out-of-memory error names ("Tried to allocate 2.00 GiB")."""
    m = _OOM_FIGURE.search(text)
    return m.group(1) if m else None


@dataclass(slots=True)
class Attribution:
    """The cause of one failed round on one node, its verdict and the evidence."""

    cause: Cause
    verdict: Verdict
    summary: str
    """One line: what happened, where, on which ranks."""
    deterministic: bool = False
    """``user_code`` only: decided safely (every rank, or two attempts in a row)."""
    signature: str | None = None
    """``<Type>@<file>:<line>`` of a user exception (compared across attempts)."""
    ranks: list[int] = field(default_factory=list)
    evidence: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cause"], d["verdict"] = self.cause.value, self.verdict.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Attribution:
        return cls(**{**d, "cause": Cause(d["cause"]), "verdict": Verdict(d["verdict"])})


def _site(f: WorkerFailure) -> ExceptionSite | None:
    if f.kind is not FailureKind.EXCEPTION:
        return None
    return exception_site(f.message, f.callstack)


def _exception_cause(f: WorkerFailure, site: ExceptionSite) -> Cause:
    text = "\n".join(filter(None, (f.message, site.text, f.output_tail)))
    if site.type in _OOM_TYPES or _OOM_TEXT.search(text):
        return Cause.OUT_OF_MEMORY
    if _HARDWARE_TEXT.search(text):
        return Cause.HARDWARE
    if peer_failure_text(text) or site.type in _NETWORK_TYPES:
        return Cause.NETWORK
    # a misreading here errs towards a restart: only user code and out of memory stop a job
    if site.type in _CONTROL_TYPES or _CONTROL_TEXT.search(site.text):
        return Cause.CONTROL_PLANE
    if _NETWORK_TEXT.search(site.text):
        return Cause.NETWORK
    if site.type in _DATA_TYPES or _DATA_TEXT.search(site.text):
        return Cause.DATA
    if site.type in _ENVIRONMENT_TYPES:
        return Cause.TRANSIENT
    return Cause.USER_CODE


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, sorted(ranks)))


def attribute(
    failures: list[WorkerFailure],
    *,
    world_size: int,
    health: list[dict[str, Any]] | None = None,
    hang: bool = False,
    previous_signature: str | None = None,
) -> Attribution:
    """Classify one node's failed round.

    ``world_size``: ranks in the job (a user exception on all of them, at one place, is
    deterministic at once); ``health``: the in-job health findings (``health_unhealthy``
    events) of this attempt; ``hang``: the hang detector killed the group;
    ``previous_signature``: the user-code signature of the previous failed attempt, if any.
    A worker the agent ended itself (``torn_down``) is a consequence, not evidence."""
    if health:
        reasons = [str(r) for h in health for r in h.get("reasons") or []]
        drain = any(h.get("action") == HealthAction.DRAIN for h in health)
        return Attribution(
            Cause.HARDWARE,
            Verdict.EVICT if drain else Verdict.RESTART,
            "health: " + "; ".join(reasons[:4]),
            ranks=sorted({int(r) for h in health for r in h.get("ranks") or []}),
            evidence={"health": reasons[:8], "action": "drain" if drain else "restart"},
        )
    named = sorted(f.rank for f in failures if f.exitcode == SDC_EXIT_CODE)
    if named:
        return Attribution(
            Cause.SDC,
            Verdict.EVICT,
            f"silent data corruption: the replicas' check named rank(s) {_ranks(named)} "
            "(a wrong result computed without an error)",
            ranks=named,
            evidence={"exits": {str(r): f"exit {SDC_EXIT_CODE}" for r in named}},
        )
    if hang:
        return Attribution(
            Cause.NETWORK,
            Verdict.RESTART,
            "hang: the workers stopped making progress (collective or step) and were killed",
            ranks=sorted(f.rank for f in failures),
            evidence={"hang": True},
        )
    own = [f for f in failures if not f.torn_down or f.kind is FailureKind.EXCEPTION]
    sites = {f.rank: s for f in own if (s := _site(f)) is not None}
    causes = {r: _exception_cause(f, sites[r]) for f in own if (r := f.rank) in sites}
    by_cause = Counter(causes.values())
    evidence: dict[str, Any] = {
        "exits": {
            str(f.rank): f.signal or f"exit {f.exitcode}" for f in sorted(failures, key=_rank)
        }
    }
    tails = {str(f.rank): f.output_tail for f in failures if f.output_tail}
    if tails:
        evidence["output_tail"] = tails
    for cause in (Cause.OUT_OF_MEMORY, Cause.HARDWARE):
        if by_cause.get(cause):
            ranks = sorted(r for r, c in causes.items() if c is cause)
            site = sites[ranks[0]]
            figure = oom_figure(next(f.message or "" for f in own if f.rank == ranks[0]))
            what = f"{site.type}: {site.text}"
            if figure:
                evidence["figure"] = figure
                what += f" (allocation {figure})"
            evidence.update(exception=site.type, message=site.text, place=site.place)
            return Attribution(
                cause, VERDICTS[cause], f"{what} at {site.place} on rank(s) {_ranks(ranks)}",
                ranks=ranks, evidence=evidence,
            )  # fmt: skip
    users = {r: sites[r] for r, c in causes.items() if c is Cause.USER_CODE}
    if users:
        sigs = Counter(s.signature() for s in users.values())
        sig, n = sigs.most_common(1)[0]
        ranks = sorted(r for r, s in users.items() if s.signature() == sig)
        site = users[ranks[0]]
        # nothing else ended a worker of its own: no signal but the agent's teardown
        killed = [
            f
            for f in failures
            if f.kind in (FailureKind.KILLED, FailureKind.CRASHED) and not f.torn_down
        ]
        everywhere = len(sigs) == 1 and n >= world_size and not killed
        # this node's ranks all agree and nothing else failed here: other nodes' ranks may
        # complete "every rank of the job" (counted in the job ledger)
        alone = len(sigs) == 1 and not killed
        again = previous_signature == sig
        deterministic = everywhere or again
        why = (
            f"on all {world_size} rank(s)"
            if everywhere
            else "in two failed attempts in a row"
            if again
            else f"on rank(s) {_ranks(ranks)} of {world_size} once: a restart decides"
        )
        evidence.update(
            exception=site.type,
            message=site.text,
            place=site.place,
            function=site.func,
            raised_in=site.raised_in,
            ranks=ranks,
            decided=why,
            alone=alone,
        )
        return Attribution(
            Cause.USER_CODE,
            Verdict.STOP if deterministic else Verdict.RESTART,
            f"{site.type}: {site.text} at {site.place} on rank(s) {_ranks(ranks)} ({why})",
            deterministic=deterministic,
            signature=sig,
            ranks=ranks,
            evidence=evidence,
        )
    killed = [
        f for f in own if f.kind in (FailureKind.KILLED, FailureKind.CRASHED) and not f.torn_down
    ]
    if killed and set(by_cause) == {Cause.NETWORK}:
        # a peer's lost connection next to a rank that was killed is that kill's consequence
        peers, ranks = sorted(causes), sorted(f.rank for f in killed)
        site = sites[peers[0]]
        how = sorted({f.signal or f"exit {f.exitcode}" for f in killed})
        evidence.update(peer_exception=site.type, peer_message=site.text, peers=peers)
        return Attribution(
            Cause.TRANSIENT,
            Verdict.RESTART,
            f"rank(s) {_ranks(ranks)} ended by {', '.join(how)}; "
            f"rank(s) {_ranks(peers)} lost the connection to it ({site.type})",
            ranks=ranks,
            evidence=evidence,
        )
    for cause in (Cause.DATA, Cause.CONTROL_PLANE, Cause.NETWORK, Cause.TRANSIENT):
        if by_cause.get(cause):
            ranks = sorted(r for r, c in causes.items() if c is cause)
            site = sites[ranks[0]]
            evidence.update(exception=site.type, message=site.text, place=site.place)
            return Attribution(
                cause, VERDICTS[cause],
                f"{site.type}: {site.text} on rank(s) {_ranks(ranks)}",
                ranks=ranks, evidence=evidence,
            )  # fmt: skip
    ranks = sorted(f.rank for f in own) or sorted(f.rank for f in failures)
    how = sorted({f.signal or f"exit {f.exitcode}" for f in own or failures})
    return Attribution(
        Cause.TRANSIENT,
        Verdict.RESTART,
        f"rank(s) {_ranks(ranks)} ended by {', '.join(how) or 'the agent'} without an exception",
        ranks=ranks,
        evidence=evidence,
    )


def _rank(f: WorkerFailure) -> int:
    return f.rank
