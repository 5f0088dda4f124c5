"""trainguard.cli."""
