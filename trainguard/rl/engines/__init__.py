"""Adapters that put a real inference engine behind trainguard's engine contract
(:mod:`trainguard.rl.engine`): ``python -m trainguard.rl.engines.vllm`` for vLLM. Importing
this package imports neither torch nor the engine."""
