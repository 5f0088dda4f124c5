"""The suite's process bookkeeping; the process-tree helpers are
:mod:`trainguard.chaos.procs` (re-exported here for the tests)."""

from __future__ import annotations

from trainguard.chaos.procs import alive, become_subreaper, descendants, kill_tree, reap

__all__ = ["FIXTURE_PIDS", "alive", "become_subreaper", "descendants", "kill_tree", "reap"]

# PIDs a longer-lived (module- or session-scoped) fixture owns and will stop itself, although a
# test started them: e.g. etcd restarted by a fault test for the module's later tests. The
# suite's leftover check does not list these.
FIXTURE_PIDS: set[int] = set()
