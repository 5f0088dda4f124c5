"""The batch script of ``trainguard sbatch``: a pure request object rendered to text.

The script allocates ``nodes + spares`` nodes and starts one ``trainguard slurm agent`` (a
``trainguard run`` that reads the Slurm environment) per node with ``--nnodes N:N``: N agents
train, the other K wait in torch's rendezvous redundancy list and join the next round when a
node is lost. The rendezvous runs on the cluster's etcd (``[slurm] etcd_endpoint``: trainguard's
etcd-v3 backend, no rendezvous state on any node of the job) or, with no etcd named, in the agent
on the allocation's first node (c10d: that node's loss ends the round for every agent). Every
value that comes from the user is shell-quoted.

Roles with ``nodes = K`` (``[roles.<name>] nodes``, ``--tg-role rollout=2,nodes=1,...``) run on
nodes of their own: the script allocates them besides the trainer's and spares (the last ones of
the allocation's node list), names them with their Slurm address (``NodeAddr``) in
``TRAINGUARD_SBATCH_ROLE_NODES``, and starts ``trainguard slurm roles`` there in a step of its
own (``--kill-on-bad-exit=0 --no-kill``: the loss of one role node's agent ends only that task;
the trainer's agents re-place its replicas on a spare node of the role, ``spares``, and drain
it: :mod:`trainguard.roles.nodeloss`). The trainer's step runs on the other nodes. When the
trainer's step has ended the script creates the stop file (the role agents stop their replicas
and exit); a role step that ends before (every role node's agent gone) writes the failure
file, with which the trainer's agents end the job.

The batch host (the allocation's first node) runs this script. Slurm keeps a ``--no-kill`` job
RUNNING when its batch host fails, without the script that would end it (measured on Slurm
22.05: the job keeps its other nodes, with no step, until its time limit). So the script also
advances a counter in the run directory every second (the *batch beacon*); the agents on the
other nodes watch it, and when it stood still for ``[slurm] batch_dead_after_s`` one of them
drains the batch host, resubmits the job without it and cancels the orphaned job
(:func:`trainguard.slurm.finish.take_over`). A resubmitted job may start at once; a requeued one
(``scontrol requeue``) only after Slurm's credential expiry (``AuthInfo`` ``cred_expire`` + 1 s,
121 s by default).

The preemption signal is ``--signal=USR1@grace`` *without* ``B:``. Slurm then sends it to every
process of the job's steps (measured on Slurm 22.05: the agent and its workers each get one;
``B:`` would signal only the batch shell, and the only way from there to the agents,
``srun``/``scancel``, again reaches every process of the step). Every worker therefore gets the
signal straight from Slurm and saves; the agents are told (``[runtime]
preemption_signals_direct``) to log it rather than forward a second copy, which would stop a
worker before its save commits. The batch shell traps the signal too, so ``scancel
--signal=USR1 --full`` is harmless to it.

After the step the script hands the outcome to ``trainguard slurm finish``, which ends the job
(success, or the "do not requeue" exit code), requeues it (exit 75: preempted, checkpoint
committed) or drains the lost nodes and resubmits the job without them.

The run (its directory, checkpoints and events: ``slurm-<first job id>``) spans the requeues
and resubmissions of a job; each allocation has a rendezvous id of its own (``<job id>.<restart
count>``), so a closed or stale etcd rendezvous of an earlier allocation is never joined.
"""

from __future__ import annotations

import re
import shlex
import sys
from dataclasses import dataclass, field

from trainguard.core.config.slurm import SlurmConfig
from trainguard.core.contracts import envvars
from trainguard.core.contracts.rundir import RunDir

__all__ = ["BatchRequest", "TIME_FORMAT_HELP", "valid_time"]

TIME_FORMAT_HELP = (
    "use minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS (e.g. --time 2:00:00), or UNLIMITED"
)
_TIME = re.compile(
    r"\A(\d+|\d+:\d{1,2}|\d+:\d{1,2}:\d{1,2}|\d+-\d+|\d+-\d+:\d{1,2}|\d+-\d+:\d{1,2}:\d{1,2})\Z"
)
_SAFE_SBATCH = re.compile(r"\A--?[A-Za-z][A-Za-z0-9-]*(=[^\n\r]*)?\Z")
_BATCH_RUN_DIR = RunDir("$RUN_DIR")
"""The run directory as the batch script names it (its paths, for the script's text)."""

# The batch script's variables (trainguard.core.contracts.envvars spells them; these names are kept).
CHAIN_ENV = envvars.SBATCH_CHAIN_ID
RESUBMITS_ENV = envvars.SBATCH_RESUBMITS
RUN_DIR_ENV = envvars.RUN_DIR
"""The chain's run directory (holds ``job.sbatch``, the events and the batch beacon): the run
directory's one variable (a chain started before exported ``TRAINGUARD_SBATCH_RUN_DIR``, still
read by :func:`trainguard.core.contracts.envvars.run_dir`)."""
BATCH_HOST_ENV = envvars.SBATCH_BATCH_HOST
BEACON_ENV = envvars.SBATCH_BATCH_BEACON
CONFIG_ENV = envvars.SBATCH_CONFIG


def valid_time(t: str) -> bool:
    """Slurm's ``--time`` formats."""
    return t.upper() in ("UNLIMITED", "INFINITE") or bool(_TIME.match(t))


def _q(value: object) -> str:
    return shlex.quote(str(value))


def _sbatch_q(value: str, what: str) -> str:
    """Quote a value of an ``#SBATCH`` line: sbatch strips single quotes itself, but has no
    escape for a quote inside a quoted value, and a newline would end the directive."""
    if "'" in value or "\n" in value or "\r" in value:
        raise ValueError(f"{what} {value!r}: quotes and newlines are not allowed here")
    return _q(value)


@dataclass(kw_only=True, slots=True)
class BatchRequest:
    """Everything the batch script needs; :meth:`materialize` renders it, nothing else runs."""

    script: str
    """The training script (path as the nodes see it)."""
    script_args: list[str] = field(default_factory=list)
    nodes: int
    """Nodes that train (``--nnodes N:N``)."""
    spares: int = 0
    """Extra nodes whose agents wait as hot spares."""
    gpus_per_node: int | None = None
    time: str | None = None
    partition: str | None = None
    account: str | None = None
    job_name: str | None = None
    sbatch_args: list[str] = field(default_factory=list)
    """More ``#SBATCH`` options, each one ``--name=value`` (or ``--flag``)."""
    run_args: list[str] = field(default_factory=list)
    """``trainguard run`` options for every agent (``--nproc-per-node 8``, ``--config F``...)."""
    config_file: str | None = None
    """trainguard.toml handed to the agents (``--config``); its [slurm] section is ``slurm``."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    python: str = field(default_factory=lambda: sys.executable)
    dir_mode: str = "0700"
    """Mode of the run directory the script creates (``[runtime] dir_mode``)."""
    workdir: str | None = None
    """Directory the job runs in (``--chdir``); default: where ``sbatch`` was run."""
    role_nodes: int = 0
    """Nodes of the roles' own (``nodes = K`` and ``spares = S`` of every role together),
    allocated besides the trainer's and the spares."""
    role_spares: int = 0
    """Of ``role_nodes``: the roles' spare nodes (``spares``)."""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ValueError(f"--nodes {self.nodes}: at least 1 node must train")
        if self.role_nodes < 0:
            raise ValueError(f"role nodes {self.role_nodes}: must be >= 0")
        if not 0 <= self.role_spares <= self.role_nodes:
            raise ValueError(f"role spares {self.role_spares}: must be in 0..{self.role_nodes}")
        if self.spares < 0:
            raise ValueError(f"--spares {self.spares}: must be >= 0")
        if self.gpus_per_node is not None and self.gpus_per_node < 0:
            raise ValueError(f"--gpus-per-node {self.gpus_per_node}: must be >= 0")
        if self.time is not None and not valid_time(self.time):
            raise ValueError(f"--time {self.time!r} is not a Slurm time limit: {TIME_FORMAT_HELP}")
        for a in self.sbatch_args:
            if not _SAFE_SBATCH.match(a):
                raise ValueError(
                    f"--sbatch-arg {a!r}: give one sbatch option as --name=value (no newlines)"
                )
        for name, v in (("--partition", self.partition), ("--account", self.account)):
            if v is not None and not re.match(r"\A[A-Za-z0-9._\-,]+\Z", v):
                raise ValueError(f"{name} {v!r} is not a Slurm name")
        self._directives()  # the #SBATCH values that cannot be quoted raise here

    @property
    def total_nodes(self) -> int:
        return self.nodes + self.spares + self.role_nodes

    @property
    def trainer_nodes(self) -> int:
        """The nodes of the trainer's step: those that train and the spares."""
        return self.nodes + self.spares

    def _directives(self) -> list[str]:
        cfg = self.slurm
        name = self.job_name or "trainguard-" + re.sub(r"[^A-Za-z0-9._-]", "_", _stem(self.script))
        d = [
            f"--job-name={_sbatch_q(name, '--job-name')}",
            f"--nodes={self.total_nodes}",
            "--ntasks-per-node=1",
            f"--signal={cfg.signal_name}@{cfg.grace_s}",
            "--requeue",
            "--no-kill",
            f"--output={_sbatch_q(cfg.runs_root + '/slurm-%j.out', '[slurm] runs_root')}",
            "--open-mode=append",
        ]
        if self.time:
            d.append(f"--time={self.time}")
        if self.partition:
            d.append(f"--partition={self.partition}")
        if self.account:
            d.append(f"--account={self.account}")
        if self.gpus_per_node:
            d.append(f"--gpus-per-node={self.gpus_per_node}")
        if cfg.blocklist:
            d.append(f"--exclude={','.join(cfg.blocklist)}")
        if self.workdir:
            d.append(f"--chdir={_sbatch_q(self.workdir, '--chdir')}")
        d.extend(self.sbatch_args)
        return ["#SBATCH " + x for x in d]

    def _agent_command(self) -> str:
        cfg = self.slurm
        tg = f"{_q(self.python)} -m trainguard"
        parts = ["srun --ntasks-per-node=1 --kill-on-bad-exit=0 --no-kill"]
        if self.role_nodes:
            t = self.trainer_nodes
            parts.append(f'--nodes={t} --ntasks={t} --nodelist="$TRAIN_HOSTS"')
        parts += [
            f'--output="{_BATCH_RUN_DIR.step_log("agent")}" {tg} slurm agent',
            f"--nnodes {self.nodes}:{self.nodes}",
        ]
        if cfg.rendezvous == "etcd-v3":
            parts.append(f"--rdzv-backend etcd-v3 --rdzv-endpoint {_q(cfg.etcd_endpoint)}")
        else:
            parts.append('--rdzv-backend c10d --rdzv-endpoint "$RDZV_ADDR:$RDZV_PORT"')
        parts.append(f'--rdzv-id "$RDZV_ID" --rdzv-conf join_timeout={cfg.join_timeout_s}')
        parts.append('--tg-run-dir "$RUN_DIR"')
        if self.config_file:
            parts.append(f"--config {_q(self.config_file)}")
        if not any(a.split("=")[0] in ("--max-restarts", "--max_restarts") for a in self.run_args):
            parts.append(f"--max-restarts {cfg.max_restarts}")
        nproc = ("--nproc-per-node", "--nproc_per_node")
        if self.gpus_per_node and not any(a.split("=")[0] in nproc for a in self.run_args):
            parts.append(f"--nproc-per-node {self.gpus_per_node}")  # one worker per GPU
        if self.run_args:
            parts.append(" ".join(_q(a) for a in self.run_args))
        parts.append(" ".join(_q(a) for a in [self.script, *self.script_args]))
        return " \\\n    ".join(parts)

    def _roles_command(self) -> str:
        """The role nodes' step: ``trainguard slurm roles`` with the agents' options."""
        r = self.role_nodes
        tg = f"{_q(self.python)} -m trainguard"
        parts = [
            f'srun --nodes={r} --ntasks={r} --ntasks-per-node=1 --nodelist="$ROLE_HOSTS"',
            "--kill-on-bad-exit=0 --no-kill",
            f'--output="{_BATCH_RUN_DIR.step_log("roles")}" {tg} slurm roles',
            '--tg-run-dir "$RUN_DIR"',
        ]
        if self.config_file:
            parts.append(f"--config {_q(self.config_file)}")
        if self.run_args:
            parts.append(" ".join(_q(a) for a in self.run_args))
        parts.append(" ".join(_q(a) for a in [self.script, *self.script_args]))
        return " \\\n    ".join(parts)

    def _roles_lines(self) -> list[str]:
        """Split the allocation (trainer and spares first, the role nodes last), name the role
        nodes with their addresses and start their step in the background."""
        t, r = self.trainer_nodes, self.role_nodes
        return [
            "# the roles' own nodes: the last of the allocation, named with their Slurm address",
            'TG_HOSTS=$(scontrol show hostnames "$SLURM_JOB_NODELIST")',
            f"TRAIN_HOSTS=$(printf '%s\\n' $TG_HOSTS | head -n {t} | paste -sd, -)",
            f"ROLE_HOSTS=$(printf '%s\\n' $TG_HOSTS | tail -n {r} | paste -sd, -)",
            "ROLE_NODES=",
            f"for h in $(printf '%s\\n' $TG_HOSTS | tail -n {r}); do",
            "  a=$(scontrol show node -o \"$h\" | sed -n 's/.* NodeAddr=\\([^ ]*\\).*/\\1/p')",
            '  ROLE_NODES="$ROLE_NODES${ROLE_NODES:+,}$h=${a:-$h}"',
            "done",
            f'export {envvars.SBATCH_ROLE_NODES}="$ROLE_NODES"',
            f'export {envvars.SBATCH_ROLES_STOP}="$RUN_DIR/roles-$SLURM_JOB_ID.stop"',
            f'export {envvars.SBATCH_ROLES_FAILED}="$RUN_DIR/roles-$SLURM_JOB_ID.failed"',
            f'rm -f "${envvars.SBATCH_ROLES_STOP}" "${envvars.SBATCH_ROLES_FAILED}"',
            "# a role step that ends before the trainer's (every role node's agent gone) fails",
            "# the job: the trainer's agents read the line and end it (never a trainer restart)",
            "(",
            "  " + self._roles_command().replace("\n", "\n  "),
            "  rrc=$?",
            f'  [ -e "${envvars.SBATCH_ROLES_STOP}" ] || [ -e "${envvars.SBATCH_ROLES_FAILED}" ] ||',
            '    echo "role nodes $ROLE_HOSTS: their step ended with exit code $rrc before the '
            f'trainer\'s" > "${envvars.SBATCH_ROLES_FAILED}"',
            ") &",
            "ROLES_PID=$!",
        ]

    def materialize(self) -> str:
        """The batch script's text."""
        cfg = self.slurm
        tg = f"{_q(self.python)} -m trainguard"
        runs_root = _q(cfg.runs_root)
        lines = [
            "#!/bin/bash",
            *self._directives(),
            f"# generated by trainguard sbatch: {self.nodes} training node(s) + {self.spares} spare(s)"
            + (f" + {self.role_nodes} role node(s)" if self.role_nodes else ""),
            "set -u",
            "# Slurm sends the preemption signal to the agents and workers themselves (no B:);",
            "# the batch shell only notes it and waits for them to save and exit 75.",
            f"trap 'echo \"trainguard: SIG{cfg.signal_name} (preemption notice)\" >&2' "
            f"{cfg.signal_name}",
            f'RUN_ID="${{{CHAIN_ENV}:-$SLURM_JOB_ID}}"',
            f'export {CHAIN_ENV}="$RUN_ID"',
            "# a rendezvous of its own per allocation (a requeue, a resubmission): the etcd",
            "# rendezvous of an earlier one may have been closed when its agents ended; the",
            "# cluster's name (clusters sharing one etcd prefix) and a random part made here",
            "# (a job id is predictable: nobody joins or blocks a rendezvous named in advance)",
            'RDZV_ID="${SLURM_CLUSTER_NAME:-slurm}.$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}'
            ".$(od -An -N8 -tx1 /dev/urandom | tr -d ' \\n')\"",
            f'export {RESUBMITS_ENV}="${{{RESUBMITS_ENV}:-0}}"',
            f'RUN_DIR={runs_root}/"slurm-$RUN_ID"',
            f'[ -d "$RUN_DIR" ] || mkdir -p -m {_q(self.dir_mode)} "$RUN_DIR"',
            f'mkdir -p "{_BATCH_RUN_DIR.logs}"',
            '[ -e "$RUN_DIR/job.sbatch" ] || cp "$0" "$RUN_DIR/job.sbatch"',
            f'ln -sfn "slurm-$RUN_ID" {runs_root}/"job-$SLURM_JOB_ID"',
            "export TRAINGUARD_RUNTIME_PREEMPTION_SIGNALS_DIRECT=1",
            f'export {RUN_DIR_ENV}="$RUN_DIR" {BATCH_HOST_ENV}="${{SLURMD_NODENAME:-}}"',
            f'export {BEACON_ENV}="$RUN_DIR/batch-$SLURM_JOB_ID.alive"',
        ]
        if self.config_file:
            lines.append(f"export {CONFIG_ENV}={_q(self.config_file)}")
        lines += [
            "# the batch beacon (while this shell, then its finish step, lives): when it stands",
            "# still, an agent on another node resubmits the job",
            f"( trap '' {cfg.signal_name}; n=0; while kill -0 $$ 2>/dev/null; do n=$((n + 1)); "
            f'echo "$n" > "${BEACON_ENV}"; sleep 1; done ) >/dev/null 2>&1 &',
        ]
        if cfg.rendezvous == "c10d":
            lines += [
                'RDZV_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
                'RDZV_ADDR=$(scontrol show node -o "$RDZV_NODE" '
                "| sed -n 's/.* NodeAddr=\\([^ ]*\\).*/\\1/p')",
                f"RDZV_PORT={cfg.rdzv_port}",
                f'export {envvars.SBATCH_RDZV_NODE}="$RDZV_NODE"',
            ]
        watch_log = _BATCH_RUN_DIR.logs / "watch.log"
        lines += [
            "STARTED=$(date +%s.%N)",
            'echo "trainguard: job $SLURM_JOB_ID (run $RUN_ID, restart ${SLURM_RESTART_COUNT:-0},'
            " resubmit ${" + RESUBMITS_ENV + '}) on $SLURM_JOB_NODELIST" >&2',
            *(self._roles_lines() if self.role_nodes else []),
            *(
                [
                    "# a watcher outside the job step: pages when the job goes silent",
                    f'{tg} watch "$RUN_DIR" --if-configured >> "{watch_log}" 2>&1 &',
                    "WATCH_PID=$!",
                ]
                if cfg.watch
                else []
            ),
            self._agent_command(),
            "rc=$?",
            *(
                [
                    'kill "$WATCH_PID" 2>/dev/null',
                    "# the step ended: pages when it ended without the agents' final events",
                    f'{tg} watch "$RUN_DIR" --if-configured --step-ended "$rc" '
                    f'>> "{watch_log}" 2>&1',
                ]
                if cfg.watch
                else []
            ),
            *(
                [
                    f'touch "${envvars.SBATCH_ROLES_STOP}"  # the role agents stop their replicas',
                    "# (at most a minute: a role step still there then ends with the job)",
                    'for _ in $(seq 60); do kill -0 "$ROLES_PID" 2>/dev/null || break; sleep 1; done',
                ]
                if self.role_nodes
                else []
            ),
            f'exec {tg} slurm finish --run-dir "$RUN_DIR" --rc "$rc" --since "$STARTED" \\\n'
            f'    --script "$RUN_DIR/job.sbatch"'
            + (f" --config {_q(self.config_file)}" if self.config_file else ""),
            "",
        ]
        return "\n".join(lines)


def _stem(path: str) -> str:
    base = path.rstrip("/").rsplit("/", 1)[-1]
    return base[:-3] if base.endswith(".py") else base
