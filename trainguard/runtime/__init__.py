"""trainguard.runtime."""
