"""The planner (`--plan`): the run's own start-up, one optimizer window, the weight export and one engine step,
simulated on fake tensors under a fake process group at the requested world size, with each simulated rank's memory
tracked per phase; `run.py` drives it, `report.py` says what fits."""
