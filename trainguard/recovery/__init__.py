"""trainguard.recovery: the failure → action policy, the job-wide restart budget and eviction
with a blocklist (see docs/recovery.md)."""

from trainguard.recovery.ledger import BlockEntry, JobLedger
from trainguard.recovery.policy import RecoveryAction, RecoveryDecision, RecoveryPolicy, backoff_s

__all__ = [
    "BlockEntry",
    "JobLedger",
    "RecoveryAction",
    "RecoveryDecision",
    "RecoveryPolicy",
    "backoff_s",
]
