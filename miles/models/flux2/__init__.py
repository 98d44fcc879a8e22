"""The FLUX.2 lineage: `flux2.py` its families (`Flux2Family`, FLUX.2 [klein] and [dev]), `tiny.py` their tiny builder
(`builtin:tiny-flux2-klein`, `builtin:tiny-flux2-dev`)."""

from miles.models.registry import lineage_exports

__getattr__ = lineage_exports(__name__)
