"""custom_loss: the user's own hooks, loaded from the --custom-*-path flags; its rollouts are Flow-GRPO's SDE
trajectories unless a conversion path replaces them. It may read the frozen teacher when --teacher-load is given."""

from __future__ import annotations

from miles.algorithms.base import TEACHER, Algorithm, Role

ALGORITHM = Algorithm(name="custom_loss", roles=(Role("actor", frozen_networks=(TEACHER,)),))
