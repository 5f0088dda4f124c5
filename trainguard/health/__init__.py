"""trainguard.health."""
