"""The Qwen-Image lineage: `folder.py` its lineage base (`QwenFolderFamily`: Qwen2.5-VL text, the Qwen VAE, the σ grid),
the families `qwen_image.py` (text-to-image) and `qwen_image_edit.py` (Edit and Edit Plus), their tiny builders
`tiny.py` (`builtin:tiny-qwen-image`) and `tiny_edit.py` (`builtin:tiny-qwen-image-edit`, `-edit-plus`)."""

from miles.models.registry import lineage_exports

__getattr__ = lineage_exports(__name__)
