"""trainguard.checkpoint."""
