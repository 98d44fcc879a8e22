"""The FLUX.1 lineage: `folder.py` its lineage base (`FluxFolderFamily`: loading, packing, guidance embedding), the
families `flux.py` (FLUX.1 [dev] / [schnell]) and `flux_kontext.py` (FLUX.1 Kontext editing), `tiny.py` their tiny
builder (`builtin:tiny-flux`, `builtin:tiny-flux-kontext`; the shipped `builtin:tiny-shapes-edit` is one)."""

from miles.models.registry import lineage_exports

__getattr__ = lineage_exports(__name__)
