"""The tiny Wan image-to-video builder (miles/models/wan/tiny_i2v.py): a folder whose transformer takes the noisy
latents with the first-frame mask and image latents, and the CLIP vision tower's image embeddings, with CLIP's own
image processor at the tower's crop."""

from __future__ import annotations

from transformers import CLIPImageProcessor

from miles.models.wan.tiny import TINY_WAN_LATENT_CHANNELS, TINY_WAN_NUM_FRAMES, TINY_WAN_RESOLUTION
from miles.models.wan.tiny_i2v import TINY_CLIP_IMAGE_SIZE, TINY_CLIP_VISION_WIDTH
from tests.fast.models.tiny_checks import check_tiny_folder


def test_the_folder_fits_its_transformer_to_the_image_branch(tiny_wan_i2v_dir):
    defaults = {"resolution": TINY_WAN_RESOLUTION, "num_frames": TINY_WAN_NUM_FRAMES}
    configs = check_tiny_folder(tiny_wan_i2v_dir, "WanImageToVideoPipeline", "wan-i2v", defaults)
    transformer, vision = configs["transformer"], configs["image_encoder"]
    # noisy latents, then the condition: 4 mask channels (the VAE's temporal factor) and the image latents
    assert transformer["in_channels"] == 2 * TINY_WAN_LATENT_CHANNELS + 4 == 12
    assert transformer["image_dim"] == vision["hidden_size"] == TINY_CLIP_VISION_WIDTH
    assert vision["image_size"] == TINY_CLIP_IMAGE_SIZE
    processor = CLIPImageProcessor.from_pretrained(tiny_wan_i2v_dir, subfolder="image_processor")
    assert processor.crop_size == {"height": TINY_CLIP_IMAGE_SIZE, "width": TINY_CLIP_IMAGE_SIZE}
