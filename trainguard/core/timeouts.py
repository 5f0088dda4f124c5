"""The chain of timeouts a job relies on, and where the user's settings contradict it.

From the inside out each layer must give up before the one around it, or the outer one acts on
a failure the inner one was about to report (or never sees it): the process group's collective
timeout < trainguard's hang timeout < the rendezvous join timeout < Slurm's preemption grace.
``trainguard run`` shows the effective chain in ``config.json`` and warns, one line each, where
two settings the user chose contradict it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainguard.core.config import TrainGuardConfig

__all__ = ["TORCH_PG_TIMEOUT_S", "TimeoutLink", "contradictions", "timeout_chain"]

TORCH_PG_TIMEOUT_S = 1800.0
"""torch's default process-group timeout (``init_process_group`` without ``timeout``)."""
RDZV_JOIN_TIMEOUT_S = 600.0
"""torch's default rendezvous join timeout."""


@dataclass(frozen=True, slots=True)
class TimeoutLink:
    name: str
    """collective, hang, rendezvous or slurm_grace (inside out)."""
    setting: str
    """Where the user sets it."""
    value_s: float | None
    """Effective value; None where it is derived at run time."""
    source: str
    """``set`` (by the user), ``default`` or ``automatic`` (measured at run time)."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def timeout_chain(
    cfg: TrainGuardConfig, *, rdzv_configs: dict[str, Any] | None = None, under_slurm: bool = False
) -> list[TimeoutLink]:
    """The chain of ``cfg`` (a TrainGuardConfig) and torchrun's ``--rdzv-conf`` values."""
    h = cfg.health
    coll = h.collective_timeout_s
    links = [
        TimeoutLink(
            "collective",
            "health.collective_timeout_s",
            coll if coll is not None else TORCH_PG_TIMEOUT_S,
            "set" if coll is not None else "default",
        ),
        TimeoutLink(
            "hang",
            "health.hang_timeout_s",
            h.hang_timeout_s,
            "set" if h.hang_timeout_s is not None else "automatic",
        ),
    ]
    join = (rdzv_configs or {}).get("join_timeout")
    links.append(
        TimeoutLink(
            "rendezvous",
            "--rdzv-conf join_timeout",
            float(join) if join is not None else RDZV_JOIN_TIMEOUT_S,
            "set" if join is not None else "default",
        )
    )
    if under_slurm or cfg.slurm.grace_s != 120:
        links.append(
            TimeoutLink(
                "slurm_grace",
                "slurm.grace_s",
                float(cfg.slurm.grace_s),
                "set" if cfg.slurm.grace_s != 120 else "default",
            )
        )
    return links


def contradictions(chain: list[TimeoutLink]) -> list[str]:
    """One line per pair of user-set timeouts in the wrong order (inner not below outer)."""
    out = []
    for i, inner in enumerate(chain):
        for outer in chain[i + 1 :]:
            if inner.source != "set" or outer.source != "set":
                continue
            assert inner.value_s is not None and outer.value_s is not None
            if inner.value_s >= outer.value_s:
                out.append(
                    f"timeouts contradict each other: {inner.setting} = {inner.value_s:g}s is not "
                    f"below {outer.setting} = {outer.value_s:g}s (the {inner.name} timeout must "
                    f"fire before the {outer.name} one: lower {inner.setting} or raise "
                    f"{outer.setting})"
                )
    return out
