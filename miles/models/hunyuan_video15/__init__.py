"""The HunyuanVideo 1.5 lineage: `hunyuan_video15.py` the family, `sequence_parallel.py` (--sp-size), `tiny.py` its tiny
builder (`builtin:tiny-hunyuan-video15`)."""

from miles.models.registry import lineage_exports

__getattr__ = lineage_exports(__name__)
