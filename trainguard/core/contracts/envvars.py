"""Environment variables the trainguard agent sets for its workers (besides torchrun's).

They live in their own namespace, ``TRAINGUARD_AGENT_*``, which the config loader never reads
as settings: ``TRAINGUARD_<SECTION>_<FIELD>`` variables are the user's settings, these are
facts the agent hands its workers. Settings reach a worker one way only: the run's
``config.json`` (``trainguard.core.config.load_worker_section``).

This module is the one place that spells these names (with the user-set ones at its end: the
secrets, fault injection, ``trainguard sbatch``'s chain; ``tests/test_envvars.py`` fails on a
``"TRAINGUARD_`` literal anywhere else but the config loader): every agent→worker variable is a
constant here and in :data:`ALL` (a worker's environment is torchrun's plus these), and the
warm-start variables a pre-started process gets before it becomes a worker are in
:data:`ZYGOTE` (taken out of its environment before the script runs).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

NAMESPACE = "TRAINGUARD_"
"""Every variable trainguard reads or sets starts with this (settings: ``TRAINGUARD_<SECTION>_<FIELD>``,
read by the config loader; the rest are spelled in this module)."""

PREFIX = "TRAINGUARD_AGENT_"
"""The agent→worker namespace (reserved: no config section may be called ``agent``)."""

RUN_DIR = PREFIX + "RUN_DIR"
"""The run directory: the one variable that carries it to every process of a run (the agent's
workers, a role's replicas, the processes of a ``trainguard sbatch`` job). Read it with
:func:`run_dir`."""
PROGRESS_DIR = PREFIX + "PROGRESS_DIR"
"""Directory of this attempt's per-rank progress files; set only under the agent."""
ATTEMPT = PREFIX + "ATTEMPT"
"""Job-wide worker-group attempt number (0-based), equal across nodes."""
NODE = PREFIX + "NODE"
"""Node name as the agent reports it (SLURMD_NODENAME or hostname)."""
TEARDOWN_FILE = PREFIX + "TEARDOWN_FILE"
"""A file the agent creates before it stops this attempt's workers for a restart or at the end
of a failed job: a worker that finds it treats the SIGTERM that follows as a teardown (exit at
once), not as a preemption notice (save at the next step boundary)."""
CHECKPOINT_MEMORY_DIR = PREFIX + "MEMORY_DIR"
"""The node's in-memory checkpoint tier (a directory in host shared memory) owned by the agent."""
INPROCESS_GENERATION = PREFIX + "INPROCESS_GENERATION"
"""Set for a worker that replaces a dead one in place: the in-process generation it joins."""
WORKER_HOOKS = PREFIX + "WORKER_HOOKS"
"""``module:function`` entries (comma-separated) the worker start-up hook calls before the
script runs, in order: what the agent's plugins declared their workers need
(:meth:`trainguard.core.plugin.AgentPlugin.worker_hooks`). Removed from the environment by the
hook, so the script and its children never see it."""
GC_HOLD_S = PREFIX + "GC_HOLD_S"
"""Seconds a worker runs with the cyclic garbage collector off while it sets up, at most (until
its first step ends): ``[warm] setup_gc_hold_s`` (``trainguard.core.procs.hold_gc_in_worker``)."""
TRACEPARENT = "TRAINGUARD_TRACEPARENT"
"""The W3C ``traceparent`` of the job's trace (telemetry): the workers' spans join it."""

# -- roles (trainguard.roles): what the role supervisor tells its replicas and the trainer ----
# A replica's facts are the agent's (``TRAINGUARD_AGENT_ROLE_*``), never one letter from the
# ``[roles]`` settings (``TRAINGUARD_ROLES_*``); the trainer's (``TRAINGUARD_ROLLOUT_*``,
# ``TRAINGUARD_REWARD_*``) name no config section either.
ROLE = PREFIX + "ROLE"
"""In a role replica: its role (``rollout``, ``reward``)."""
ROLE_REPLICA = PREFIX + "ROLE_REPLICA"
"""In a role replica: its index in the role (0-based), the same across its restarts."""
ROLE_PORT = PREFIX + "ROLE_PORT"
"""In a role replica: the port it must serve on, the same across its restarts."""
ROLE_HOST = PREFIX + "ROLE_HOST"
"""In a role replica: the address it must bind (``127.0.0.1`` beside the trainer; on nodes of
its own, the node's Slurm address, or the role's ``bind``)."""
ROLE_RUN_DIR = "TRAINGUARD_RUN_DIR"
"""In a role replica: the run directory (its state file: ``roles/<role>/<i>.json``). Read only
as a compatibility name of :data:`RUN_DIR` (an engine started by hand with it set, or by a
supervisor that sets only it): read both with :func:`run_dir`."""
ROLE_STANDBY = PREFIX + "ROLE_STANDBY"
"""In a role's warm standby only (``standby = N``): the file that promotes it. The standby
serves its health on ``TRAINGUARD_AGENT_ROLE_PORT`` (its own port, never routed to) with status
``standby`` once it is loaded; when the file appears (JSON ``{"replica": i, "port": p,
"port_wait_s": w}``) it takes port ``p`` of the dead replica ``i`` (waiting at most ``w``
seconds for it, then exiting with a line that names the port) and goes on as that replica
(loading, then serving the current weights)."""
ROLE_INCARNATION = PREFIX + "ROLE_INCARNATION"
"""In a role replica (and a standby): a nonce the supervisor draws for this process alone. The
replica reports it in its health answer (``incarnation``, beside its ``pid``), so that the
supervisor and the trainer's clients count an answer only from the process that was started
(never from another process on a dead replica's port)."""
ROLLOUT_URLS = "TRAINGUARD_ROLLOUT_URLS"
"""In the trainer's workers: the rollout engines, ``http://<host>:<port>`` comma-separated,
replica 0 first (host ``127.0.0.1`` beside the trainer, the node's address on nodes of their
own); stable across the engines' restarts."""
REWARD_URLS = "TRAINGUARD_REWARD_URLS"
"""In the trainer's workers: the reward servers, as :data:`ROLLOUT_URLS`."""

ROLE_URLS = {"rollout": ROLLOUT_URLS, "reward": REWARD_URLS}
"""Role → the trainer's variable that lists its replicas' URLs."""
VLLM_PYTHON = "TRAINGUARD_VLLM_PYTHON"
"""Set by the user for the vLLM engine adapter (``python -m trainguard.rl.engines.vllm``): the
Python interpreter of the environment that has vLLM (``make engines`` builds
``.venv-vllm``); unset: the adapter's own interpreter, when it can import vLLM."""
ROLE_TOKEN = PREFIX + "ROLE_TOKEN"
"""In a role replica: the bearer token every request to it must carry (``Authorization:
Bearer <token>``; its role's, derived from the job secret: :mod:`trainguard.core.fleetauth`).
A request without it is answered 401."""
ROLLOUT_TOKEN = "TRAINGUARD_ROLLOUT_TOKEN"
"""In the trainer's workers: the token of the ``rollout`` role (what
:class:`trainguard.rl.RolloutClient` sends to the engines)."""
REWARD_TOKEN = "TRAINGUARD_REWARD_TOKEN"
"""In the trainer's workers: the token of the ``reward`` role (what
:class:`trainguard.rl.RewardClient` sends to the reward servers)."""
ROLE_TOKENS = {"rollout": ROLLOUT_TOKEN, "reward": REWARD_TOKEN}
"""Role → the trainer's variable that holds its token."""
FLEET_URL = "TRAINGUARD_FLEET_URL"
"""In the trainer's workers and the role replicas (environments, reward servers): the fleet
endpoint, ``http://127.0.0.1:<port>``: one OpenAI-compatible URL (``/v1/completions``,
``/v1/models``, ``/health``) that routes to the serving rollout engines and survives their
restarts (``[roles] router``; :mod:`trainguard.rl.router`)."""
FLEET_TOKEN = "TRAINGUARD_FLEET_TOKEN"
"""Beside :data:`FLEET_URL`: the token every request to the fleet endpoint is signed with (the
``fleet`` role's, derived from the job secret: :mod:`trainguard.core.fleetauth`); it lets its
holder generate through the endpoint, never drive an engine directly."""
SBATCH_ROLE_NODES = "TRAINGUARD_SBATCH_ROLE_NODES"
"""In a ``trainguard sbatch`` job with roles on nodes of their own (``nodes = K``): those nodes,
``name=address`` comma-separated in the allocation's order (set by the batch script)."""
SBATCH_ROLES_STOP = "TRAINGUARD_SBATCH_ROLES_STOP"
"""There: the file whose existence tells the role nodes' agents that the trainer is done."""
SBATCH_ROLES_FAILED = "TRAINGUARD_SBATCH_ROLES_FAILED"
"""There: the file a role node writes its role failure to (one line); the trainer's agents
end the job with it."""

ALL = (
    RUN_DIR,
    PROGRESS_DIR,
    ATTEMPT,
    NODE,
    TEARDOWN_FILE,
    CHECKPOINT_MEMORY_DIR,
    INPROCESS_GENERATION,
    WORKER_HOOKS,
    GC_HOLD_S,
    TRACEPARENT,
    ROLLOUT_URLS,
    REWARD_URLS,
    ROLLOUT_TOKEN,
    REWARD_TOKEN,
    FLEET_URL,
    FLEET_TOKEN,
)
"""Every variable the agent may add to a worker's environment (documented in the generated
docs/reference/environment.md); :data:`WORKER_HOOKS` is removed again before the script runs."""

ZYGOTE_PREFIX = NAMESPACE + "ZYGOTE_"
"""The warm-start namespace: a pre-started process's own variables."""
ZYGOTE_FD = ZYGOTE_PREFIX + "FD"
"""A pre-started worker process (warm start): the descriptor of its socket to the agent."""
ZYGOTE_PRELOAD = ZYGOTE_PREFIX + "PRELOAD"
"""A pre-started worker process: the modules it imports while it waits (comma-separated)."""
ZYGOTE = (ZYGOTE_FD, ZYGOTE_PRELOAD)
"""The warm-start variables: in a pre-started process's initial environment only, never in the
environment its script sees."""

# -- trainguard sbatch (trainguard.slurm.batch): what its batch script exports -------------------
SBATCH_PREFIX = NAMESPACE + "SBATCH_"
"""The batch script's namespace (kept out of the environment a requeued job re-reads)."""
SBATCH_CHAIN_ID = SBATCH_PREFIX + "CHAIN_ID"
"""The first job id of a chain of resubmissions: the run directory (checkpoints) is keyed by it.
Its presence also tells the agents they run in a ``trainguard sbatch`` job (they drain lost
nodes: trainguard.runtime.registry)."""
SBATCH_RESUBMITS = SBATCH_PREFIX + "RESUBMITS"
"""How many times the chain has been resubmitted so far."""
SBATCH_RUN_DIR = SBATCH_PREFIX + "RUN_DIR"
"""The chain's run directory as batch scripts before :data:`RUN_DIR` exported it (a chain's
``job.sbatch`` is copied once, at its first allocation): a compatibility read of
:func:`run_dir`."""
SBATCH_BATCH_HOST = SBATCH_PREFIX + "BATCH_HOST"
"""The node that runs the batch script (``SLURMD_NODENAME`` of the batch shell)."""
SBATCH_BATCH_BEACON = SBATCH_PREFIX + "BATCH_BEACON"
"""The batch beacon's file: a counter the batch shell advances every second."""
SBATCH_CONFIG = SBATCH_PREFIX + "CONFIG"
"""The trainguard.toml handed to the job (its [slurm] section), when there is one."""
SBATCH_RDZV_NODE = SBATCH_PREFIX + "RDZV_NODE"
"""The node that hosts the job's rendezvous store (the allocation's first)."""

# -- set by the user or by trainguard for one process ------------------------------------------
ETCD_PASSWORD = NAMESPACE + "ETCD_PASSWORD"
"""The etcd-v3 rendezvous password (a secret: from the environment, never argv)."""
ETCD_PASSWORD_FILE = NAMESPACE + "ETCD_PASSWORD_FILE"
"""A file holding the etcd-v3 rendezvous password."""
GRAFANA_TOKEN = NAMESPACE + "GRAFANA_TOKEN"
"""The Grafana service-account token of ``trainguard dashboards push``."""
CHAOS = NAMESPACE + "CHAOS"
"""Fault injection inside the workers (:mod:`trainguard.chaos.faults`); never active unless set."""
CHECKPOINT_FAULT = NAMESPACE + "TEST_CHECKPOINT_FAULT"
"""Fault injection into the checkpoint persister (:mod:`trainguard.checkpoint.faults`)."""
PERSIST_PARENT_PID = NAMESPACE + "PERSIST_PARENT_PID"
"""In a checkpoint persister process: its worker's pid (it never outlives it)."""


def run_dir(environ: Mapping[str, str] | None = None) -> str | None:
    """The run directory the environment names: :data:`RUN_DIR`, else the compatibility names
    (:data:`ROLE_RUN_DIR`, :data:`SBATCH_RUN_DIR`); None when none is set."""
    env = os.environ if environ is None else environ
    for name in (RUN_DIR, ROLE_RUN_DIR, SBATCH_RUN_DIR):
        if env.get(name):
            return env[name]
    return None


def parse_role_nodes(value: str) -> list[tuple[str, str]]:
    """:data:`SBATCH_ROLE_NODES` (``name=addr,...``) → ``[(name, addr), ...]``."""
    out = []
    for item in value.split(","):
        name, _, addr = item.strip().partition("=")
        if name:
            out.append((name, addr or name))
    return out
