"""trainguard.plan: the goodput planner (a pure model and simulator). Imports the core only."""
