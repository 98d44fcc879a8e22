"""miles: post-training of diffusion and flow-matching models with RL and distillation."""

from miles.utils import import_gc

# in a Ray worker, `import miles` starts the imports of an actor class's module (torch, diffusers, ...): they run
# with the garbage collector paused (less CPU); the actor's __init__ turns it back on (miles.utils.import_gc)
import_gc.pause_in_ray_worker()

from miles.utils.console import quiet_third_party  # noqa: E402  (after the pause: it imports third-party modules)

# first thing in every process that imports miles (the driver, each Ray worker): the families import diffusers'
# pipelines, whose transformers imports warn about a backend miles never uses (miles.utils.console.UNACTIONABLE)
quiet_third_party()

__version__ = "0.1.0"
