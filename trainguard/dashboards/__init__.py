"""trainguard.dashboards."""
