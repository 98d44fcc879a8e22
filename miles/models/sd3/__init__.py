"""The SD3 lineage (SD3, SD3.5): `sd3.py` the family (`SD3PipelineConfig`), `tiny.py` its tiny builder
(`builtin:tiny-sd3`; the shipped `builtin:tiny-shapes` is one, pretrained by scripts/pretrain_tiny_shapes.py)."""

from miles.models.registry import lineage_exports

__getattr__ = lineage_exports(__name__)
