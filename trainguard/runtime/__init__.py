"""trainguard.runtime: the node agent (torch elastic agent + trainguard plugins), the rendezvous
wrapper, the launcher and the plugin registry, the only agent-side code that imports features."""
