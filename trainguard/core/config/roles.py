"""Roles of a job besides the trainer (section [roles], env TRAINGUARD_ROLES_*, ``--tg-role``).

The trainer is the SPMD group of ``trainguard run``'s workers, exactly as without roles. A
``rollout`` role (generation engines) and a ``reward`` role (scoring servers) are fleets of
independent replicas the node agent starts beside it, each with its own command, count,
restart budget and health check. Example::

    [roles.rollout]
    command = "python -m trainguard.rl.engine --model tiny-gpt2"
    replicas = 2
    port = 8100              # replica i listens on 8100 + i; 0: a free port per replica
    restart_budget = 5
    standby = 1              # a warm spare, loaded and kept out of routing, replaces a dead one

    [roles]
    readiness_timeout_s = 300.0

Under ``trainguard sbatch`` a role may run on nodes of its own (``nodes = 2``, with a fixed
``port``): the job allocates them besides the trainer's, the replicas bind the node's Slurm
address (or ``bind``) and the trainer's workers get ``http://<NodeAddr>:<port + i>``
(:func:`trainguard.roles.placement.place_roles`; docs/rl.md "Engines on nodes of their own").

On the command line (one flag per role; it replaces that role's table of the file, keys it
does not name keep the file's values)::

    trainguard run --nproc-per-node 2 \\
        --tg-role "rollout=2:python -m trainguard.rl.engine --model tiny-gpt2" \\
        --tg-role "reward=1,port=8200,budget=3:python reward_server.py" train.py
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from typing import Any

from trainguard.core.contracts.metrics import ROLES

__all__ = [
    "ROLE_NAMES",
    "RoleSpec",
    "RolesConfig",
    "parse_role_flag",
]

ROLE_NAMES = ROLES
"""Roles a job may declare besides ``trainer`` (:data:`trainguard.core.contracts.metrics.ROLES`)."""

RESTART_POLICIES = ("always", "never")

_KEYS = {
    # flag key → RoleSpec field
    "port": "port",
    "budget": "restart_budget",
    "restart_budget": "restart_budget",
    "policy": "restart_policy",
    "restart_policy": "restart_policy",
    "health": "health_path",
    "health_path": "health_path",
    "ready": "readiness_timeout_s",
    "readiness_timeout_s": "readiness_timeout_s",
    "standby": "standby",
    "nodes": "nodes",
    "bind": "bind",
    "retire": "retire_after",
    "retire_after": "retire_after",
    "floor": "floor",
    "spares": "spares",
}

_FLAG_FORM = (
    "NAME=REPLICAS[,port=P,budget=N,policy=always|never,health=/PATH,ready=S,standby=K,"
    "nodes=K,spares=S,bind=ADDR,retire=N,floor=N]:COMMAND"
)


@dataclass(frozen=True, slots=True)
class RoleSpec:
    """One role, validated (built from a ``[roles.<name>]`` table or a ``--tg-role`` flag)."""

    name: str
    command: tuple[str, ...]
    """The replica's command line (a string in the file is split like a shell does)."""
    replicas: int = 1
    port: int = 0
    """Base port: replica ``i`` listens on ``port + i`` across its restarts; 0: a free port is
    chosen for each replica once, and kept across its restarts."""
    health_path: str = "/health"
    """HTTP GET path of the health probe (200 + JSON ``{"status": ..., "weight_version": ...}``)."""
    restart_budget: int = 5
    """Restarts of this role's replicas (all together) before the role fails and ends the job.
    The trainer's restarts (``--max-restarts``) are counted apart."""
    restart_policy: str = "always"
    """``always``: a replica that exits or dies is restarted (within the budget); ``never``: a
    dead replica ends the role."""
    readiness_timeout_s: float | None = None
    """Seconds a started replica has to answer its health probe with ``loading`` or ``serving``
    (None: ``[roles] readiness_timeout_s``)."""
    env: tuple[tuple[str, str], ...] = ()
    """Extra environment of the replicas."""
    standby: int = 0
    """Warm standbys of the role: extra processes started with the same command (and
    ``TRAINGUARD_ROLE_STANDBY`` set), loaded and kept out of routing. A replica that dies is
    replaced by a ready standby (it takes the replica's port, then loads the current weights
    before it serves) instead of a cold start; a new standby is started behind it at low CPU
    priority (``[roles] standby_nice``). The command must honour the standby contract
    (``python -m trainguard.rl.engine`` and ``trainguard.rl.reward`` do); 0: none. On nodes
    of its own (``nodes``), each node keeps this many."""
    nodes: int = 0
    """Under ``trainguard sbatch``: the replicas run on this many nodes of their own (the job
    allocates them besides the trainer's), spread round-robin (replica ``i`` on the role's node
    ``i % nodes``); needs a fixed ``port``. 0: the replicas run beside the trainer, started by
    every node's agent."""
    bind: str = ""
    """The address the replicas bind (``TRAINGUARD_ROLE_HOST``); empty: ``127.0.0.1`` beside
    the trainer, the node's Slurm address (``NodeAddr``) on nodes of its own. ``0.0.0.0`` binds
    every interface: only when told."""
    retire_after: int = 3
    """Restarts of one replica after which, dying again, it is ``retired`` (not restarted: a
    replica that dies after every load) and the role goes on with the others; 0: never
    retired (only the role's ``restart_budget`` counts)."""
    floor: int = 1
    """Replicas of the role that must be left (not retired): a role below its floor fails
    and ends the job, with one line naming the role, the floor and what was lost. On nodes
    of their own a lost node's replicas count as lost until a spare node runs them again;
    the job ends with exit code 96 (``ROLE_BELOW_FLOOR_EXIT_CODE``)."""
    spares: int = 0
    """Under ``trainguard sbatch``, with ``nodes``: spare nodes of the role, allocated besides
    its ``nodes``. Their agents wait; when a node of the role is lost (its agent killed, the
    node crashed), one spare runs the lost node's replicas (same ports, its own address) and
    the lost node is drained in Slurm with the cause."""

    def url(self, port: int, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{port}"

    def to_json(self) -> dict[str, Any]:
        return {
            "command": list(self.command),
            "replicas": self.replicas,
            "port": self.port,
            "health_path": self.health_path,
            "restart_budget": self.restart_budget,
            "restart_policy": self.restart_policy,
            "readiness_timeout_s": self.readiness_timeout_s,
            "env": dict(self.env),
            "standby": self.standby,
            "nodes": self.nodes,
            "bind": self.bind,
            "retire_after": self.retire_after,
            "floor": self.floor,
            "spares": self.spares,
        }

    @classmethod
    def from_mapping(cls, name: str, table: dict[str, Any], where: str) -> RoleSpec:
        """Validate one role's table; ValueError (one line: what, where, how to fix)."""
        if name not in ROLE_NAMES:
            raise ValueError(
                f"{where}: unknown role {name!r}; roles: trainer (the workers), "
                f"{', '.join(ROLE_NAMES)}"
            )
        unknown = sorted(set(table) - _TABLE_KEYS)
        if unknown:
            raise ValueError(
                f"{where}: unknown key {unknown[0]!r} of role {name!r}; known keys: "
                + ", ".join(sorted(_TABLE_KEYS))
            )
        check = _Checker(name, table, where)
        command = check.command()
        replicas = check.integer("replicas", 1, 0)
        if replicas == 0:
            raise ValueError(
                f"{where}: role {name!r} has 0 replicas: give at least 1, or leave the role out"
            )
        port = check.integer("port", 0, 0, 65535)
        if port and port + replicas - 1 > 65535:
            raise ValueError(
                f"{where}: role {name!r}: ports {port}..{port + replicas - 1} go past 65535"
            )
        nodes = check.integer("nodes", 0, 0)
        if nodes > replicas:
            raise ValueError(
                f"{where}: role {name!r}: nodes {nodes} > replicas {replicas}: each node of the "
                "role runs at least one replica; give fewer nodes or more replicas"
            )
        if nodes and not port:
            raise ValueError(
                f"{where}: role {name!r} runs on nodes of its own (nodes = {nodes}) and needs a "
                "fixed port (port = 8100: replica i on port + i), since the trainer's URLs are "
                "known before its replicas start"
            )
        spares = check.integer("spares", 0, 0)
        if spares and not nodes:
            raise ValueError(
                f"{where}: role {name!r}: spares {spares} without nodes: spare nodes replace "
                "the role's own nodes (nodes = K); give nodes, or leave spares out"
            )
        floor = check.integer("floor", 1, 0)
        if floor > replicas:
            raise ValueError(
                f"{where}: role {name!r}: floor {floor} > replicas {replicas}: the role could "
                "never run; give a floor of at most the replica count"
            )
        return cls(
            name=name,
            retire_after=check.integer("retire_after", 3, 0),
            floor=floor,
            command=command,
            replicas=replicas,
            port=port,
            nodes=nodes,
            spares=spares,
            bind=check.bind(),
            restart_budget=check.integer("restart_budget", 5, 0),
            restart_policy=check.restart_policy(),
            health_path=check.health_path(),
            readiness_timeout_s=check.readiness_timeout(),
            env=check.env(),
            standby=check.integer("standby", 0, 0, 64),
        )


_TABLE_KEYS = frozenset(
    {
        "command",
        "replicas",
        "port",
        "health_path",
        "restart_budget",
        "restart_policy",
        "readiness_timeout_s",
        "env",
        "standby",
        "nodes",
        "bind",
        "retire_after",
        "floor",
        "spares",
    }
)
"""Keys of a ``[roles.<name>]`` table."""

_BIND_RE = re.compile(r"\A[A-Za-z0-9.:_-]+\Z")


@dataclass(frozen=True, slots=True)
class _Checker:
    """The checks of one role's table, each a ValueError of one line naming the role."""

    name: str
    table: dict[str, Any]
    where: str

    def _error(self, what: str) -> ValueError:
        return ValueError(f"{self.where}: role {self.name!r}: {what}")

    def command(self) -> tuple[str, ...]:
        raw = self.table.get("command")
        if isinstance(raw, str):
            try:
                command = tuple(shlex.split(raw))
            except ValueError as e:
                raise self._error(f"command {raw!r}: {e}") from None
        elif isinstance(raw, list | tuple) and all(isinstance(c, str) for c in raw):
            command = tuple(raw)
        elif raw is not None:
            raise self._error(f"command {raw!r} must be a string or a list of strings")
        else:
            command = ()
        if not command:
            raise ValueError(
                f'{self.where}: role {self.name!r} has no command: set command = "python -m ..."'
            )
        return command

    def integer(self, key: str, default: int, lo: int, hi: int | None = None) -> int:
        v = self.table.get(key, default)
        if isinstance(v, bool) or not isinstance(v, int | str):
            raise self._error(f"{key} {v!r} is not an integer")
        try:
            n = int(v)
        except ValueError:
            raise self._error(f"{key} {v!r} is not an integer") from None
        if n < lo or (hi is not None and n > hi):
            rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
            raise self._error(f"{key} {n} must be {rng}")
        return n

    def restart_policy(self) -> str:
        policy = str(self.table.get("restart_policy", "always"))
        if policy not in RESTART_POLICIES:
            raise self._error(
                f"restart_policy {policy!r} is not one of {', '.join(RESTART_POLICIES)}"
            )
        return policy

    def health_path(self) -> str:
        health = str(self.table.get("health_path", "/health"))
        if not health.startswith("/"):
            raise self._error(f"health_path {health!r} must start with '/'")
        return health

    def readiness_timeout(self) -> float | None:
        ready = self.table.get("readiness_timeout_s")
        if ready is None:
            return None
        try:
            seconds = float(ready)
        except (TypeError, ValueError):
            raise self._error(f"readiness_timeout_s {ready!r} is not a number") from None
        if not seconds > 0:
            raise self._error("readiness_timeout_s must be > 0")
        return seconds

    def bind(self) -> str:
        bind = str(self.table.get("bind", "") or "")
        if bind and not _BIND_RE.match(bind):
            raise self._error(f"bind {bind!r} is not an address (e.g. 10.0.0.5 or 0.0.0.0)")
        return bind

    def env(self) -> tuple[tuple[str, str], ...]:
        env = self.table.get("env") or {}
        if not isinstance(env, dict):
            raise self._error("env must be a table of strings")
        return tuple(sorted((str(k), str(v)) for k, v in env.items()))


_FLAG_RE = re.compile(r"^(?P<name>[A-Za-z_][A-Za-z0-9_-]*)=(?P<opts>[^:]*):(?P<cmd>.*)$", re.S)


def parse_role_flag(value: str) -> tuple[str, dict[str, Any]]:
    """``--tg-role rollout=2,port=8100:python -m engine`` → ``("rollout", {table})``;
    ValueError (one line) for a malformed one."""
    where = f"--tg-role {value!r}"
    m = _FLAG_RE.match(value.strip())
    if not m:
        raise ValueError(f"{where}: malformed role; use {_FLAG_FORM}")
    name = m["name"]
    opts = [o.strip() for o in m["opts"].split(",")]
    if not opts or not opts[0]:
        raise ValueError(f"{where}: the replica count is missing; use {_FLAG_FORM}")
    table: dict[str, Any] = {"replicas": opts[0]}
    if not opts[0].isdigit():
        raise ValueError(f"{where}: replica count {opts[0]!r} is not a number; use {_FLAG_FORM}")
    for opt in opts[1:]:
        key, eq, val = opt.partition("=")
        if not eq or key.strip() not in _KEYS:
            raise ValueError(
                f"{where}: unknown option {opt!r}; options: port, budget, policy, health, "
                "ready, standby, nodes, spares, bind, retire, floor"
            )
        table[_KEYS[key.strip()]] = val.strip()
    cmd = m["cmd"].strip()
    if not cmd:
        raise ValueError(f"{where}: the command is missing after ':'; use {_FLAG_FORM}")
    table["command"] = cmd
    # validated here so that a bad flag is one line before anything starts
    RoleSpec.from_mapping(name, table, where)
    return name, table


@dataclass(kw_only=True, slots=True)
class RolesConfig:
    rollout: dict[str, Any] = field(default_factory=dict)
    """``[roles.rollout]``: the generation engines (empty: no such role)."""
    reward: dict[str, Any] = field(default_factory=dict)
    """``[roles.reward]``: the scoring servers (empty: no such role)."""
    readiness_timeout_s: float = 300.0
    """Seconds a replica's first start has to answer its health probe with ``loading`` or
    ``serving`` (a standby: ``standby``); a replica that never did is a role failure naming
    it (one line). Until then only the process's exit counts: probes that get no answer are
    its start-up, never its death."""
    startup_grace_factor: float = 4.0
    """A restarted replica's readiness deadline: this many times the longest start-up measured
    in the role (start to its first ready answer), at least ``startup_grace_min_s`` and at
    most ``readiness_timeout_s``."""
    startup_grace_min_s: float = 30.0
    """The shortest readiness deadline of a restart (see ``startup_grace_factor``)."""
    port_wait_s: float = 30.0
    """How long a replica's start (or a promoted standby) waits for its port while another
    process holds it (a ``role_port_taken`` event names it); then the replica is retired."""
    probe_interval_s: float = 1.0
    """How often each replica's health endpoint is probed."""
    probe_timeout_s: float = 2.0
    """A probe without an answer this long failed: the replica is ``suspect``."""
    dead_after_s: float = 6.0
    """A replica without a good probe this long (a frozen process) is ``dead``: killed by PID
    and restarted. A process that exits or refuses connections is dead at once."""
    stop_timeout_s: float = 5.0
    """At the end of the job: seconds between SIGTERM and SIGKILL of a replica's process group."""
    standby_nice: int = 10
    """Niceness a role's warm standby starts with (``standby = N``): its start-up (imports,
    model build) yields the CPU to the trainer and the serving replicas. A promoted standby
    is set back to the supervisor's priority (where the OS lets it: root, or RLIMIT_NICE).
    0: the standbys start at normal priority."""
    router: bool = False
    """Start the fleet endpoint beside the trainer: one OpenAI-compatible URL
    (``TRAINGUARD_FLEET_URL`` in the trainer's workers and the role replicas) that routes
    ``/v1/completions`` to the serving rollout engines, retries a failed answer on another one
    and follows their restarts and re-placements (needs a ``rollout`` role)."""
    router_port: int = 0
    """The fleet endpoint's port; 0: a free one. A port already taken stops the job at
    submission (one line, exit 2)."""
    router_bind: str = "127.0.0.1"
    """The address the fleet endpoint binds; ``0.0.0.0`` (every interface) only when told."""
    node_dead_after_s: float = 10.0
    """Under ``trainguard sbatch``: a role node whose agent's beacon (``RUN_DIR/role-nodes/
    <node>.alive``, advanced every second) stood still this long is lost: its replicas are
    re-placed on a spare node of the role (``spares``) and it is drained in Slurm."""

    def __post_init__(self) -> None:
        for key in (
            "readiness_timeout_s",
            "probe_interval_s",
            "probe_timeout_s",
            "dead_after_s",
            "startup_grace_factor",
            "startup_grace_min_s",
            "port_wait_s",
            "node_dead_after_s",
        ):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key} must be > 0")
        if self.stop_timeout_s < 0:
            raise ValueError("stop_timeout_s must be >= 0")
        if not 0 <= self.standby_nice <= 19:
            raise ValueError("standby_nice must be in 0..19")
        if self.dead_after_s < self.probe_timeout_s:
            raise ValueError(
                f"dead_after_s ({self.dead_after_s}) must be >= probe_timeout_s "
                f"({self.probe_timeout_s})"
            )
        if not 0 <= self.router_port <= 65535:
            raise ValueError(f"router_port {self.router_port} must be in 0..65535 (0: a free one)")
        if not _BIND_RE.match(self.router_bind):
            raise ValueError(f"router_bind {self.router_bind!r} is not an address")
        specs = self.specs()  # every role's table is checked when the config is built
        if self.router and not any(s.name == "rollout" for s in specs):
            raise ValueError(
                "router = true routes to the rollout engines: declare [roles.rollout] "
                "(or --tg-role rollout=...), or leave the router out"
            )

    def specs(self) -> list[RoleSpec]:
        """The declared roles, validated, ``rollout`` first."""
        out = []
        for name in ROLE_NAMES:
            table = getattr(self, name)
            if table:
                out.append(RoleSpec.from_mapping(name, dict(table), f"[roles.{name}]"))
        return out

    def readiness_timeout(self, spec: RoleSpec) -> float:
        return spec.readiness_timeout_s or self.readiness_timeout_s

    def restart_deadline(self, spec: RoleSpec, measured_s: float | None) -> float:
        """A restart's readiness deadline from the role's longest measured start-up (None:
        none measured yet: the first start's)."""
        first = self.readiness_timeout(spec)
        if measured_s is None:
            return first
        return min(first, max(self.startup_grace_min_s, self.startup_grace_factor * measured_s))

    def node_count(self) -> int:
        """Nodes of their own the roles need (``nodes`` and ``spares``, all roles together)."""
        return sum(s.nodes + s.spares for s in self.specs())

    def spare_count(self) -> int:
        """Spare nodes of the roles (``spares``, all roles together)."""
        return sum(s.spares for s in self.specs())
