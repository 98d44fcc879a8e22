"""The LTX-2 lineage: `ltx2.py` the family (joint audio-video latent), `streams.py` its two streams' token layouts,
forward and guidance, `sequence_parallel.py` (--sp-size), `tiny.py` its tiny builder (`builtin:tiny-ltx2`)."""

from miles.models.registry import lineage_exports

__getattr__ = lineage_exports(__name__)
