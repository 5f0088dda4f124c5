"""Roles of a job besides the trainer: engine fleets (``rollout``, ``reward``) that the node
agent starts, probes and restarts on their own (:class:`RoleSupervisor`, :class:`RolesPlugin`)."""

from trainguard.roles.plugin import RoleFailedError, RolesPlugin
from trainguard.roles.supervisor import RoleSupervisor, probe_health

__all__ = ["RoleFailedError", "RoleSupervisor", "RolesPlugin", "probe_health"]
