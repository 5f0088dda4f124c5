"""The node's in-memory checkpoint tier, owned by the agent, replicated to one peer agent.

The agent plugin creates a directory in shared memory (``/dev/shm``) and exports it to its
workers (``envvars.CHECKPOINT_MEMORY_DIR``). Workers stage their snapshots into files there
(see :mod:`trainguard.checkpoint.staging`), so a worker crash does not lose them: the agent
owns the directory and removes it only when it exits.

Replication: every agent runs a small TCP server. After each rendezvous the agents publish
their addresses in the rendezvous store; each agent pushes its workers' newest snapshots to the
next node (group rank + 1). Before workers start, an agent makes sure every local rank has a
snapshot: from its own directory, from the replicas it holds, or fetched from the other agents
(marked ``source: peer:<node>``, which the worker's restore reports as ``peer_memory``).

One module per job:

- :mod:`.wire`: the wire protocol (framing, ``push_snapshot``, ``fetch_snapshot``);
- :mod:`.store`: the tier's directories and snapshot files (``TierStore``);
- :mod:`.server`: the TCP server answering the other agents from a ``TierStore``;
- :mod:`.replication`: pushing new snapshots to the peer, filling ranks from the peers;
- :mod:`.sweep`: removing tiers left by killed agents;
- :mod:`.plugin`: the agent plugin that owns and wires them.
"""

from __future__ import annotations

from trainguard.checkpoint.memtier.plugin import MemoryTierPlugin
from trainguard.checkpoint.memtier.wire import fetch_snapshot, push_snapshot

__all__ = ["MemoryTierPlugin", "fetch_snapshot", "push_snapshot"]
