"""trainguard.core: the bottom layer. The data contracts (``trainguard.core.contracts``: event
kinds, env names, the run-directory layout, the metric contract, actions, the engine contract),
the settings (``trainguard.core.config``), the event log, JSONL tailing, the progress channel,
exit codes and failure classification, and the agent-plugin interface. Imports nothing of
trainguard outside itself."""
