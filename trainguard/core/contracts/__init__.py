"""trainguard.core.contracts: the data contracts every layer shares, each spelled in one module.

- :mod:`~trainguard.core.contracts.event_kinds`: every kind of event of ``events.jsonl``;
- :mod:`~trainguard.core.contracts.envvars`: the environment names (the agent's facts for its
  workers and role replicas, ``trainguard sbatch``'s, the secrets, fault injection);
- :mod:`~trainguard.core.contracts.rundir`: the layout of a run directory;
- :mod:`~trainguard.core.contracts.metrics`: every metric, with unit, kind and attributes;
- :mod:`~trainguard.core.contracts.actions`: findings and decisions (health and recovery
  actions, failure causes, verdicts);
- :mod:`~trainguard.core.contracts.jobstate`: how one node's run of the job ended;
- :mod:`~trainguard.core.contracts.engine`: the engine contract (replica states, endpoints,
  answer schemas and their guarded parsers).

Names and shapes only: these modules hold no settings (``trainguard.core.config``) and start
nothing. Each has a test that fails when a second spelling of its vocabulary appears.
"""
