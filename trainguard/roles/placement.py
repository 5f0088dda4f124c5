"""Where the replicas of the roles on nodes of their own run (``nodes = K`` under ``trainguard
sbatch``): the same placement on every node, so that the URLs the trainer's workers get and the
replicas each role node's agent starts agree. The nodes come from
``TRAINGUARD_SBATCH_ROLE_NODES`` (:func:`trainguard.core.contracts.envvars.parse_role_nodes`).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainguard.core.config.roles import RoleSpec

__all__ = ["Placed", "place_roles", "role_node_sets"]


@dataclass(frozen=True, slots=True)
class Placed:
    """Where one replica of a role on nodes of its own runs."""

    index: int
    node: str
    addr: str
    """The node's address: the host of the replica's URL."""
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.addr}:{self.port}"


def place_roles(specs: list[RoleSpec], nodes: list[tuple[str, str]]) -> dict[str, list[Placed]]:
    """The replicas of the roles with ``nodes = K`` on the role nodes (in order): each role takes
    the next K nodes, replica ``i`` runs on its node ``i % K`` on port ``port + i``. The same on
    every node (the URLs the trainer gets, the replicas a node's agent starts); ValueError
    (one line) when the nodes are fewer than the roles ask for. A role's spare nodes
    (``spares``) follow its own nodes and run nothing until a node of the role is lost
    (:func:`role_node_sets`, :mod:`trainguard.roles.nodeloss`)."""
    need = sum(s.nodes + s.spares for s in specs)
    if need > len(nodes):
        raise ValueError(
            f"the roles ask for {need} node(s) of their own, the job has {len(nodes)} "
            f"({','.join(n for n, _ in nodes) or 'none'})"
        )
    out: dict[str, list[Placed]] = {}
    at = 0
    for spec in specs:
        if not spec.nodes:
            continue
        mine = nodes[at : at + spec.nodes]
        at += spec.nodes + spec.spares
        out[spec.name] = [
            Placed(i, mine[i % spec.nodes][0], mine[i % spec.nodes][1], spec.port + i)
            for i in range(spec.replicas)
        ]
    return out


def role_node_sets(
    specs: list[RoleSpec], nodes: list[tuple[str, str]]
) -> dict[str, tuple[list[tuple[str, str]], list[tuple[str, str]]]]:
    """Role → (its own nodes, its spare nodes), as :func:`place_roles` assigns them."""
    out: dict[str, tuple[list[tuple[str, str]], list[tuple[str, str]]]] = {}
    at = 0
    for spec in specs:
        if not spec.nodes:
            continue
        out[spec.name] = (
            nodes[at : at + spec.nodes],
            nodes[at + spec.nodes : at + spec.nodes + spec.spares],
        )
        at += spec.nodes + spec.spares
    return out
