"""User hooks for the rollout-step path flags (used by tests/e2e/test_rollout_steps.py)."""

import numpy as np

PROMPTS = [f"{n} red circle{'s' if n > 1 else ''} on the left" for n in (1, 2, 3)] + ["a blue square", "green"]
CALLS: list = []


async def half_constant(args, samples):
    """Brightness for prompts of odd length; 0.5 for every sample of an even-length prompt (zero spread)."""
    return [
        0.5 if len(s.prompt) % 2 == 0 else float(np.asarray(s.image, dtype=np.float32).mean() / 255.0) for s in samples
    ]


def keep_spread(args, group):
    return len({s.reward for s in group}) > 1


def remove_first_of_group(args, samples):
    for sample in samples:
        if sample.index % args.n_samples_per_prompt == 0:
            sample.remove_sample = True


def cycle_prompts(args, rollout_id, num_prompts, attempt):
    start = rollout_id * 7 + attempt * 3
    return [{"prompt": PROMPTS[(start + i) % len(PROMPTS)]} for i in range(num_prompts)]


def bad_filter(args):
    return True
