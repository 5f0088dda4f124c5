"""trainguard.telemetry."""
