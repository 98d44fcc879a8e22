"""miles: post-training of diffusion and flow-matching models with RL and distillation."""

__version__ = "0.1.0"
