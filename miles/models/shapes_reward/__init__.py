"""The learned, differentiable shapes reward: its networks (`net`) and the differentiable-reward record the trainer's
reward-gradient losses and the rollout side's reward functions share (`differentiable`)."""
