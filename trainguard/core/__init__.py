"""trainguard.core: the bottom layer. Env names, the event log, JSONL tailing, the progress
channel, exit codes and failure classification, the metric contract, the config loader and the
agent-plugin interface. Imports nothing of trainguard outside itself."""
