"""miles: post-training of diffusion and flow-matching models with RL and distillation."""

from miles.utils.console import quiet_third_party

# first thing in every process that imports miles (the driver, each Ray worker): the families import diffusers'
# pipelines, whose transformers imports warn about a backend miles never uses (miles.utils.console.UNACTIONABLE)
quiet_third_party()

__version__ = "0.1.0"
