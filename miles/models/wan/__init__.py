"""The Wan lineage: `folder.py` its lineage base (`WanFolderFamily`: UMT5 text, the Wan VAE, the two experts' folders),
`experts.py` (`WanExperts`, the two experts as one network), the families `wan.py` (text-to-video) and `wan_i2v.py`
(image-to-video), `sequence_parallel.py` (--sp-size), their tiny builders `tiny.py` (`builtin:tiny-wan`,
`-2-experts`; the shipped `builtin:tiny-moving-shapes` is one) and `tiny_i2v.py` (`builtin:tiny-wan-i2v`)."""

from miles.models.registry import lineage_exports

__getattr__ = lineage_exports(__name__)
