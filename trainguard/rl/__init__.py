"""RL post-training with an inference engine in the loop: the engine server
(``python -m trainguard.rl.engine``), the trainer's rollout client, the weight store and
the prompt ledger. Importing this package imports neither torch nor transformers."""

from trainguard.rl.client import (
    FAILURE_REASONS,
    Completion,
    EngineState,
    RolloutClient,
    RolloutConfig,
    RolloutError,
    SyncResult,
    urls_from_env,
)
from trainguard.rl.ledger import Audit, ConsumedLog, PromptLedger, audit
from trainguard.rl.weights import PublishedVersion, WeightStore, default_weight_dir

__all__ = [
    "FAILURE_REASONS",
    "Audit",
    "Completion",
    "ConsumedLog",
    "EngineState",
    "PromptLedger",
    "PublishedVersion",
    "RolloutClient",
    "RolloutConfig",
    "RolloutError",
    "SyncResult",
    "WeightStore",
    "audit",
    "default_weight_dir",
    "urls_from_env",
]
