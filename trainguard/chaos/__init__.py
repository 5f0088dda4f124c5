"""Fault injection: what ``trainguard chaos`` and ``TRAINGUARD_CHAOS`` inject into a real job.

- :mod:`~trainguard.chaos.faults`: ``TRAINGUARD_CHAOS`` (faults a worker injects into itself
  at a step: kill, hang, slow, exit);
- :mod:`~trainguard.chaos.ops`: faults from outside a job (``trainguard chaos``): resolve a
  run directory's ranks and agents to verified PIDs, pause a service, corrupt a checkpoint;
- :mod:`~trainguard.chaos.procs`: process trees by PID (find, kill, reap);
- :mod:`~trainguard.chaos.throttle`: a running process slowed down for real (a duty cycle of
  stop and continue signals, else a cgroup's CPU quota, else a shared core);
- :mod:`~trainguard.chaos.dcgm`: a dcgm-exporter endpoint of an H100 node that turns faulty.

Nothing here runs unless asked. Standard library and :mod:`trainguard.core` only
(import-linter keeps it so).
"""
