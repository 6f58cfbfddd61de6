"""What a run is, shared by `simulate` and the processes: the round logic, the global run, setup, checkpoints,
the run directory and its totals."""
