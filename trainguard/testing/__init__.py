"""Fault injection and fakes: what ``trainguard chaos`` and ``TRAINGUARD_CHAOS`` inject, and
what the test suite and benchmarks use to play a failing cluster.

- :mod:`~trainguard.testing.chaos`: ``TRAINGUARD_CHAOS`` (faults a worker injects into
  itself at a step: kill, hang, slow, exit);
- :mod:`~trainguard.testing.chaos_ops`: faults from outside a job (``trainguard chaos``):
  resolve a run directory's ranks and agents to verified PIDs, pause a service, corrupt a
  checkpoint;
- :mod:`~trainguard.testing.procs`: process trees by PID (find, kill, reap);
- :mod:`~trainguard.testing.dcgm`: a dcgm-exporter endpoint of an H100 node, healthy or not.

Standard library and :mod:`trainguard.core` only (import-linter keeps it so).
"""
