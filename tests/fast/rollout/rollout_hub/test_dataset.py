"""The shared dataset entry (sft_loss, and custom_loss / dpo under --train-only): images to [-1, 1] tensors by hand, and every record encoded once, row i from record i
alone, whatever the chunking (the real tiny family's VAE and text encoders)."""

import numpy as np
import pytest
import torch
from PIL import Image

from miles.data.shapes import shapes_items
from miles.models.base import get_train_pipeline_config
from miles.rollout.rollout_hub.dataset import DATASET_SPEC as SPEC
from miles.rollout.rollout_hub.dataset import encode_records, image_to_tensor


def test_image_to_tensor_maps_pixels_to_the_unit_interval_channel_first(tmp_path):
    pixels = np.zeros((2, 2, 3), dtype=np.uint8)
    pixels[0, 1] = (255, 0, 51)
    tensor = image_to_tensor(Image.fromarray(pixels), 2)
    assert tensor.shape == (3, 2, 2) and tensor.dtype == torch.float32
    assert tensor[:, 0, 1].tolist() == pytest.approx([1.0, -1.0, 51 / 127.5 - 1.0])
    assert tensor[:, 1, 0].tolist() == pytest.approx([-1.0, -1.0, -1.0])
    path = tmp_path / "x.png"
    Image.fromarray(pixels).save(path)
    assert torch.equal(image_to_tensor(str(path), 2), tensor)  # a path reads the same image
    assert image_to_tensor(Image.fromarray(pixels), 4).shape == (3, 4, 4)  # resized to the resolution


def test_an_unreadable_image_names_the_file(tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not a png")
    with pytest.raises(ValueError, match="bad.png"):
        image_to_tensor(str(bad), 8)


def test_every_record_is_encoded_once_row_by_row(tiny_pipeline_dir):
    family = get_train_pipeline_config(tiny_pipeline_dir)
    records = shapes_items(5, seed=1, resolution=32)
    pairs = SPEC.encode(None, family, records, resolution=32)  # loads the VAE and the text encoders itself
    assert pairs["x0"].shape[0] == 5 and all(v.shape[0] == 5 for v in pairs.values())
    for i, record in enumerate(records):
        with torch.no_grad():
            x0 = family.encode_images(image_to_tensor(record["image"], 32)[None]).float()
            embeds = family.encode_prompts([record["prompt"]]).to(dtype=torch.float32).to_columns()
        torch.testing.assert_close(pairs["x0"][i : i + 1], x0, rtol=1e-5, atol=1e-5)
        for name, value in embeds.items():
            torch.testing.assert_close(pairs[name][i : i + 1], value, rtol=1e-5, atol=1e-5)
    chunked = encode_records(family, records, 32, batch_size=2)
    assert set(chunked) == set(pairs)
    for name in pairs:
        torch.testing.assert_close(chunked[name], pairs[name], rtol=1e-5, atol=1e-5)
