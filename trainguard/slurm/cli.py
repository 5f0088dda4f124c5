"""Slurm behind a narrow interface: :class:`SlurmCli` (faked in unit tests) and its default,
:class:`CommandSlurm`, which runs Slurm's own commands (``sbatch``, ``scontrol``, ``sinfo``,
``squeue``, ``scancel``).

Why the commands and not a binding: their output formats (``-o``, ``--parsable``, ``scontrol
show -o``) are stable across Slurm versions, they need no compiler or ``libslurm`` headers at
install time, and they work wherever the user can type ``sbatch``. ``pyslurm`` has no release
for Slurm 22.05 on PyPI, and its 25.11 release refuses to build against 22.05 (see docs/slurm.md).
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "CommandSlurm",
    "SlurmCli",
    "SlurmError",
    "NodeInfo",
    "parse_scontrol_record",
]


class SlurmError(RuntimeError):
    """A Slurm command failed; the message is its first error line."""


@dataclass(frozen=True, slots=True)
class NodeInfo:
    name: str
    state: str
    """Slurm's state, lower case, flags joined by '+' (``idle``, ``down+drain``, ...)."""
    addr: str
    reason: str = ""

    @property
    def unusable(self) -> bool:
        s = self.state
        return any(k in s for k in ("down", "drain", "fail", "not_responding", "maint"))


class SlurmCli(Protocol):
    """The few Slurm operations trainguard needs."""

    def submit(
        self,
        script: str,
        extra: Sequence[str] = (),
        *,
        test_only: bool = False,
        env: Mapping[str, str] | None = None,
    ) -> str:
        """``sbatch --parsable [extra] <script on stdin>``; the job id (or, with
        ``test_only``, Slurm's answer); raises SlurmError."""
        ...

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job -o JOB`` as key → value ({} when Slurm no longer knows it)."""
        ...

    def hostnames(self, nodelist: str) -> list[str]:
        """``scontrol show hostnames NODELIST``."""
        ...

    def nodes(self, names: Sequence[str] = ()) -> list[NodeInfo]:
        """State, address and reason of the given nodes (all when empty)."""
        ...

    def partitions(self) -> dict[str, int]:
        """Partition name → number of nodes; the default partition's name ends with ``*``
        (as ``sinfo`` shows it)."""
        ...

    def drain(self, node: str, reason: str) -> None:
        """``scontrol update nodename=NODE state=drain reason=REASON``; raises SlurmError."""
        ...

    def resume(self, node: str) -> None:
        """``scontrol update nodename=NODE state=resume``: a drained node takes jobs again;
        raises SlurmError."""
        ...

    def requeue(self, job_id: str) -> None:
        """``scontrol requeue JOB``; raises SlurmError. Slurm lets the job start again after
        ``AuthInfo`` ``cred_expire`` + 1 s (default 121 s)."""
        ...

    def cancel(self, job_id: str) -> None:
        """``scancel JOB``; raises SlurmError."""
        ...

    def down(self, node: str, reason: str) -> None:
        """``scontrol update nodename=NODE state=down reason=REASON``: Slurm ends the node's
        part in every job at once (it would wait ``SlurmdTimeout`` to find a dead node
        itself); raises SlurmError."""
        ...


def _first_error(text: str) -> str:
    for line in text.splitlines():
        line = line.strip()
        if line:
            return re.sub(r"^(sbatch|scontrol|sinfo|squeue|scancel): (error: )?", "", line)
    return "no output"


def parse_scontrol_record(line: str) -> dict[str, str]:
    """One ``scontrol show -o`` record (``Key=Value Key=Value ...``; values may hold spaces
    only in the last keys such as ``Reason``, which this keeps whole)."""
    out: dict[str, str] = {}
    matches = list(re.finditer(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=", line))
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
        out[m.group(1)] = line[m.end() : end].strip()
    return out


class CommandSlurm:
    """:class:`SlurmCli` through Slurm's commands (whatever ``SLURM_CONF`` the process has)."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        self.timeout_s = timeout_s

    def _run(
        self, argv: list[str], stdin: str | None = None, env: Mapping[str, str] | None = None
    ) -> str:
        try:
            p = subprocess.run(
                argv,
                input=stdin,
                env=None if env is None else dict(env),
                capture_output=True,
                text=True,
                timeout=self.timeout_s,
                stdin=None if stdin is not None else subprocess.DEVNULL,
            )
        except FileNotFoundError:
            raise SlurmError(f"{argv[0]} not found: is Slurm installed and on PATH?") from None
        except subprocess.TimeoutExpired:
            raise SlurmError(f"{argv[0]} did not answer in {self.timeout_s:.0f} s") from None
        if p.returncode != 0:
            raise SlurmError(_first_error(p.stderr or p.stdout))
        return p.stdout

    def submit(
        self,
        script: str,
        extra: Sequence[str] = (),
        *,
        test_only: bool = False,
        env: Mapping[str, str] | None = None,
    ) -> str:
        argv = ["sbatch", "--parsable", *extra]
        if test_only:
            argv = ["sbatch", "--test-only", *extra]
            try:
                p = subprocess.run(
                    argv,
                    input=script,
                    capture_output=True,
                    text=True,
                    timeout=self.timeout_s,
                    env=None if env is None else dict(env),
                )
            except FileNotFoundError:
                raise SlurmError("sbatch not found: is Slurm installed and on PATH?") from None
            if p.returncode != 0:
                raise SlurmError(_first_error(p.stderr or p.stdout))
            return (p.stderr + p.stdout).strip()
        return self._run(argv, stdin=script, env=env).strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        try:
            out = self._run(["scontrol", "show", "job", "-o", str(job_id)])
        except SlurmError as e:
            if "Invalid job id" in str(e):
                return {}
            raise
        line = next((ln for ln in out.splitlines() if ln.strip()), "")
        return parse_scontrol_record(line)

    def hostnames(self, nodelist: str) -> list[str]:
        if not nodelist or nodelist == "(null)":
            return []
        return self._run(["scontrol", "show", "hostnames", nodelist]).split()

    def nodes(self, names: Sequence[str] = ()) -> list[NodeInfo]:
        argv = ["scontrol", "show", "node", "-o"]
        if names:
            argv.append(",".join(names))
        out = []
        for line in self._run(argv).splitlines():
            if not line.strip() or "NodeName=" not in line:
                continue
            r = parse_scontrol_record(line)
            out.append(
                NodeInfo(
                    name=r.get("NodeName", ""),
                    state=r.get("State", "").lower(),
                    addr=r.get("NodeAddr", r.get("NodeName", "")),
                    reason=re.sub(r"\s*\[[^\]]*\]$", "", r.get("Reason", "")),
                )
            )
        return out

    def partitions(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for line in self._run(["sinfo", "-h", "-o", "%P %D"]).splitlines():
            parts = line.split()
            if len(parts) == 2:
                out[parts[0]] = out.get(parts[0], 0) + int(parts[1])
        return out

    def drain(self, node: str, reason: str) -> None:
        self._run(["scontrol", "update", f"nodename={node}", "state=drain", f"reason={reason}"])

    def resume(self, node: str) -> None:
        self._run(["scontrol", "update", f"nodename={node}", "state=resume"])

    def requeue(self, job_id: str) -> None:
        self._run(["scontrol", "requeue", str(job_id)])

    def cancel(self, job_id: str) -> None:
        self._run(["scancel", str(job_id)])

    def down(self, node: str, reason: str) -> None:
        self._run(["scontrol", "update", f"nodename={node}", "state=down", f"reason={reason}"])


def make_slurm() -> SlurmCli:
    """The way to Slurm: its commands. (pyslurm has no release for Slurm 22.05 on PyPI; 25.11
    refuses to build against it: see docs/slurm.md.)"""
    return CommandSlurm()
