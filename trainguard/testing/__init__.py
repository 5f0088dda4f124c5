"""What the test suite and the benchmarks share (never imported by the product; import-linter
keeps it so).

- :mod:`~trainguard.testing.dcgm`: a dcgm-exporter endpoint serving whatever text a test sets;
- :mod:`~trainguard.testing.etcd`, :mod:`~trainguard.testing.postgres`: a real etcd and a real
  PostgreSQL on loopback, started and stopped by their PIDs;
- :mod:`~trainguard.testing.ports`, :mod:`~trainguard.testing.net`: ports for them, and
  waiting for them to listen;
- :mod:`~trainguard.testing.ft`: two torchft replica groups, one of them kill -9'd again and
  again (the survivor's pause);
- :mod:`~trainguard.testing.lineage`: productive time measured without trainguard (which step
  executions the final weights descend from).

Fault injection, which the product runs (``trainguard chaos``, ``TRAINGUARD_CHAOS``), is
:mod:`trainguard.chaos`.
"""
