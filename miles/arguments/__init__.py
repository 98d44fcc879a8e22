"""The command line's floor, above `algorithms/` and `models/` (whose torch-free declarations it assembles) and below
everything that reads the parsed flags: the parser (`parser.py`), its rules and computed defaults (`rules.py`), the
`--config` file, the flag-reader declarations, the hook-path flags, the reward spec, and each concern's groups
(`engine.py`, `evaluation.py`, `fsdp.py`, `plan.py`, `rl.py`). Nothing below this floor imports it."""
