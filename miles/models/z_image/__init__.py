"""The Z-Image lineage: `z_image.py` the family, `tiny.py` its tiny builder (`builtin:tiny-z-image`)."""

from miles.models.registry import lineage_exports

__getattr__ = lineage_exports(__name__)
