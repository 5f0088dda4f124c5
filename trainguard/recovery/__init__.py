"""trainguard.recovery: the failure → action policy, the job-wide restart budget and eviction
with a blocklist (see docs/recovery.md)."""

from trainguard.recovery.ledger import BlockEntry, JobLedger
from trainguard.recovery.policy import Action, Decision, RecoveryPolicy, backoff_s

__all__ = ["Action", "BlockEntry", "Decision", "JobLedger", "RecoveryPolicy", "backoff_s"]
