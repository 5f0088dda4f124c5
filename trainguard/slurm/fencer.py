"""Node fencing on Slurm: drain a bad node with a reason that says trainguard did it."""

from __future__ import annotations

import re

from trainguard.core.fencing import FenceResult
from trainguard.slurm.cli import SlurmCli, SlurmError

__all__ = ["REASON_PREFIX", "SlurmFencer", "resume_node"]

REASON_PREFIX = "trainguard: "
"""Every drain reason trainguard sets starts with this (``sinfo -R`` shows who drained what)."""
_NOT_PERMITTED = re.compile(r"access|permission|denied|not authorized|invalid user", re.I)


class SlurmFencer:
    """:class:`~trainguard.core.fencing.NodeFencer` for Slurm:
    ``scontrol update nodename=X state=drain reason="trainguard: <cause>"``.

    ``record_only`` (``[slurm] drain = "record"``) changes nothing and says what it would have
    done; a drain that Slurm refuses for lack of rights is reported in one line, never raised.
    """

    name = "slurm"

    def __init__(self, slurm: SlurmCli, *, record_only: bool = False) -> None:
        self.slurm = slurm
        self.record_only = record_only

    @staticmethod
    def reason(cause: str) -> str:
        cause = " ".join(cause.split())  # one line: Slurm keeps the reason as given
        text = cause if cause.startswith(REASON_PREFIX) else REASON_PREFIX + cause
        return text[:200]

    def fence(self, node: str, reason: str) -> FenceResult:
        text = self.reason(reason)
        if self.record_only:
            return FenceResult(node, False, f"node {node} not drained (record only): {text}")
        try:
            self.slurm.drain(node, text)
        except SlurmError as e:
            if _NOT_PERMITTED.search(str(e)):
                return FenceResult(
                    node,
                    False,
                    f"not permitted to drain node {node} ({e}): recorded only; ask an operator "
                    f'to drain it, or set [slurm] drain = "record"',
                )
            return FenceResult(node, False, f"could not drain node {node}: {e}")
        except Exception as e:  # a fencer never raises
            return FenceResult(node, False, f"could not drain node {node}: {e}")
        return FenceResult(node, True, f"drained node {node}: {text}")


def resume_node(slurm: SlurmCli, node: str, *, force: bool = False) -> str:
    """Resume ``node`` (``scontrol update state=resume``) when trainguard drained it (its
    reason starts with :data:`REASON_PREFIX`; ``force``: whoever drained it). Returns one line
    saying what was done; raises :class:`SlurmError` with one line when it was not."""
    infos = [i for i in slurm.nodes([node]) if i.name == node]
    if not infos:
        raise SlurmError(f"Slurm knows no node {node}")
    info = infos[0]
    if "drain" not in info.state and "down" not in info.state and "fail" not in info.state:
        return f"node {node} is {info.state} in Slurm: nothing to resume"
    if not info.reason.startswith(REASON_PREFIX) and not force:
        raise SlurmError(
            f"node {node} was not drained by trainguard (reason: {info.reason or 'none'}): "
            "left as it is; resume it with scontrol, or pass --force"
        )
    try:
        slurm.resume(node)
    except SlurmError as e:
        if _NOT_PERMITTED.search(str(e)):
            raise SlurmError(
                f"not permitted to resume node {node} ({e}): resuming needs Slurm operator "
                "rights (sacctmgr modify user NAME set adminlevel=operator)"
            ) from None
        raise
    return f"resumed node {node} in Slurm (it was {info.state}: {info.reason})"
