"""Fakes for the test suite and benchmarks (never imported by the product; import-linter
keeps it so).

- :mod:`~trainguard.testing.dcgm`: a dcgm-exporter endpoint serving whatever text a test sets.

Fault injection, which the product runs (``trainguard chaos``, ``TRAINGUARD_CHAOS``), is
:mod:`trainguard.chaos`.
"""
