"""The FLUX.2 lineage: `folder.py` the families' shared base (`Flux2Family`), `flux2.py` its families (FLUX.2 [klein]
and [dev]), `tiny.py` their tiny builder (`builtin:tiny-flux2-klein`, `builtin:tiny-flux2-dev`)."""

from miles.models.registry import lineage_exports

__getattr__ = lineage_exports(__name__)
