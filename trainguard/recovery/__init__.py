"""trainguard.recovery."""
