"""A launcher whose only plugin declares the worker group UNHEALTHY after its first step."""

import sys

from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
from torch.distributed.elastic.multiprocessing.errors import record

from trainguard.core.plugin import AgentPlugin
from trainguard.runtime import launcher


class Unhealthy(AgentPlugin):
    name = "unhealthy"

    def on_monitor(self, ctx, group, result):
        if any(s.num_steps >= 1 for s in ctx.worker_progress().values()):
            return RunResult(state=WorkerState.UNHEALTHY)
        return None


@record
def main() -> None:
    args = launcher.build_parser().parse_args(sys.argv[1:])
    launcher.run(args, plugin_factory=lambda ctx: [Unhealthy()])


if __name__ == "__main__":
    main()
