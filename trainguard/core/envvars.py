"""Environment variables the trainguard agent sets for its workers (besides torchrun's)."""

RUN_DIR = "TRAINGUARD_RUN_DIR"
"""The run directory shared by the agent and its workers."""
PROGRESS_DIR = "TRAINGUARD_PROGRESS_DIR"
"""Directory of this attempt's per-rank progress files; set only under the agent."""
ATTEMPT = "TRAINGUARD_ATTEMPT"
"""Job-wide worker-group attempt number (0-based), equal across nodes."""
NODE = "TRAINGUARD_NODE"
"""Node name as the agent reports it (SLURMD_NODENAME or hostname)."""
HEARTBEAT_INTERVAL_S = "TRAINGUARD_HEARTBEAT_INTERVAL_S"
"""Seconds between heartbeats of a worker's background thread."""

CHECKPOINT_MEMORY_DIR = "TRAINGUARD_CHECKPOINT_MEMORY_DIR"
"""The node's in-memory checkpoint tier (a directory in host shared memory) owned by the agent."""

ALL = (RUN_DIR, PROGRESS_DIR, ATTEMPT, NODE, HEARTBEAT_INTERVAL_S)
