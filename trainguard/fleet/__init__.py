"""trainguard.fleet: node history across jobs (SQLite or PostgreSQL) and lemon nodes."""
