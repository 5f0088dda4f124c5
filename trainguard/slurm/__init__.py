"""trainguard.slurm."""
