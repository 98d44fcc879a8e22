"""The family contract in whole runs through the driver at dp size 2, for every case of `FAMILY_CASES`
(tests/fast/models/family_cases.py): train/rollout parity before the first update with and without guidance, every
loss type end to end, and a `--save-hf` folder that the family's own diffusers pipeline class loads and samples from."""

from __future__ import annotations

import json
import os

import diffusers
import numpy as np
import pytest
import torch
from PIL import Image

import train_diffusion
from miles.arguments.parser import parse_args
from miles.data.shapes import write_shapes_jsonl
from miles.data.shapes_edit import shapes_edit_item, write_shapes_edit_jsonl
from miles.utils.tracking import read_metrics
from tests.fast.models.family_cases import FAMILY_CASES

LOSS_CASES = [case for case in FAMILY_CASES if case.loss_runs]  # the others' loss types run elsewhere
LOSS_CASE_PARAMS = [
    pytest.param(case, marks=[pytest.mark.standard] if case.standard_loss_runs else [], id=case.id)
    for case in LOSS_CASES
]

pytestmark = pytest.mark.e2e
BRIGHTNESS = os.path.join(os.path.dirname(__file__), "rewards.py") + ":brightness"
TINY = [  # 4 samples, 4 steps, one window per rank
    "--prompt-data",
    "builtin:shapes",
    "--dp-size",
    "2",
    "--num-rollout",
    "1",
    "--rollout-batch-size",
    "2",
    "--n-samples-per-prompt",
    "2",
    "--num-steps-per-rollout",
    "1",
    "--diffusion-num-steps",
    "4",
    "--micro-batch-size",
    "2",
    "--eval-interval",
    "0",
    "--image-grid-interval",
    "0",
    "--no-progress",
    "--log-level",
    "WARNING",
]
REWARD = ["--custom-rm-path", BRIGHTNESS]
LOSS_RUNS = {
    "sft_loss": ["--train-only", "--rollout-batch-size", "4", "--n-samples-per-prompt", "1"],
    "nft": REWARD,
    "dmd2": ["--dmd2-generator-steps", "2", "--dmd2-critic-updates-per-step", "2", "--diffusion-guidance-scale", "1.0"],
}


def edit_data(case, folder) -> list[str]:
    """An editing / image-to-video case's prompts: the shapes edit world's (source image, instruction) pairs; for a
    case with several source images per prompt, a JSONL of them whose records list their own source image and the
    next records' (`images`)."""
    if case.source_images <= 1:
        return ["--prompt-data", "builtin:shapes-edit"]
    path = write_shapes_edit_jsonl(folder / "edits.jsonl", 8, seed=0, resolution=case.resolution)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    sources = [record.pop("image") for record in records]
    for i, record in enumerate(records):
        record["images"] = [sources[(i + k) % len(sources)] for k in range(case.source_images)]
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return ["--prompt-data", str(path)]


def run(case, path, out, *extra):
    """A run of `case` at its resolution (Qwen-Image's default is the pipeline's 128 latents per side) with its own
    flags (`FamilyCase.run_args`)."""
    data = edit_data(case, out.parent) if case.source_images else []
    args = ["--hf-checkpoint", path, "--resolution", str(case.resolution), *TINY, *data, *case.run_args]
    train_diffusion.run(parse_args([*args, "--output-dir", str(out), *extra]))
    return [m for m in read_metrics(os.path.join(out, "metrics.jsonl")) if m.get("role") in ("actor", "critic")]


PARITY_RUNS = [
    pytest.param(case, guidance, marks=[pytest.mark.standard] if case.slow else [], id=f"{case.id}-{guidance}")
    for case in FAMILY_CASES
    for guidance in case.e2e_guidances
]


@pytest.mark.parametrize(("case", "guidance"), PARITY_RUNS)
def test_ratio_is_one_before_first_update_and_save_hf_loads(ray_cluster, request, tmp_path, case, guidance):
    path = request.getfixturevalue(case.fixture)
    hf = tmp_path / "hf"
    save_hf = guidance == case.e2e_guidances[0]
    windows = run(
        case,
        path,
        tmp_path / "run",
        "--loss-type",
        "policy_loss",
        *REWARD,
        "--diffusion-num-sde-steps",
        "2",
        "--diffusion-guidance-scale",
        str(guidance),
        *(["--save-hf", str(hf)] if save_hf else []),
    )
    first = windows[0]
    # the engine's and the trainer's batches differ in size, so the forwards agree to float rounding (~1e-8)
    assert abs(first["train/ratio_mean"] - 1.0) <= 1e-6, first
    assert first["train/log_prob_abs_diff"] <= 1e-6, first
    if not save_hf:
        return
    pipe = getattr(diffusers, case.pipeline_class).from_pretrained(str(hf), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    images = {}
    if case.source_images:
        source = Image.fromarray(shapes_edit_item(0, "eval", 0, case.resolution)["source_images"][0])
        images = case.image_kwargs([[source] * case.source_images])
    with case.call_context(str(hf)):
        output = pipe(
            prompt="two red circles",
            num_inference_steps=2,
            generator=torch.Generator().manual_seed(0),
            output_type="np",
            **images,
            **case.pipeline_kwargs,
        )
    media = (output.images if case.num_frames is None else output.frames)[0]
    assert media.shape == case.media_shape and np.isfinite(media).all() and media.std() > 0
    if getattr(output, "audio", None) is not None:  # joint audio-video families
        audio = torch.as_tensor(output.audio[0]).float()
        assert audio.ndim == 2 and torch.isfinite(audio).all() and audio.std() > 0


# bf16: the trainer's sharded forward is the engine module's, so the first step's log-probs match as fp32 ones do and
# dp 1 and 2 agree. FLUX: its fp32 rotary embedding reached the blocks cast to bf16 at dp 2 (2.1e-5 before); SD3: its
# pos_embed table was fp32 in the trainer, bf16 in the engines (8.1e-5 at dp 1 and 2 before). Wan is not run: its
# engines cannot sample in bf16 (`compute_dtype` reads its first parameter, the fp32 `scale_shift_table`).
BF16_CASES = [case for case in FAMILY_CASES if case.id in ("flux-dev", "sd3", "wan")]


@pytest.mark.parametrize("case", BF16_CASES, ids=[case.id for case in BF16_CASES])
def test_bf16_first_step_matches_the_engines_at_dp_size_1_and_2(ray_cluster, request, tmp_path, case):
    path = request.getfixturevalue(case.fixture)
    first = {}
    for dp in (1, 2):
        windows = run(
            case,
            path,
            tmp_path / f"dp{dp}",
            "--loss-type",
            "policy_loss",
            *REWARD,
            "--diffusion-num-sde-steps",
            "2",
            "--diffusion-guidance-scale",
            "1.0",
            "--diffusion-forward-dtype",
            "bf16",
            "--diffusion-recompute-old-log-prob",
            "--dp-size",
            str(dp),
        )
        first[dp] = windows[0]
    for window in first.values():  # the bound of the fp32 runs above (measured 0 here, as there)
        assert window["train/log_prob_abs_diff"] <= 1e-6, window
        assert window["train/clipfrac"] == 0.0 and window["train/ratio_mean"] == 1.0, window
    # each dp 2 rank's bf16 gradient is of half the batch, summed over ranks in fp32: within one bf16 rounding
    # (measured 6e-6 apart on flux-dev, 1.5e-5 on sd3)
    assert first[2]["train/grad_norm"] == pytest.approx(first[1]["train/grad_norm"], rel=2**-7), first


@pytest.mark.parametrize("case", LOSS_CASE_PARAMS)
@pytest.mark.parametrize("loss_type", sorted(LOSS_RUNS))
def test_every_loss_type_runs_at_dp_size_2(ray_cluster, request, tmp_path, case, loss_type):
    path = request.getfixturevalue(case.fixture)
    extra = list(LOSS_RUNS[loss_type])
    if loss_type == "sft_loss":  # (prompt, image) pairs, or an editing family's (source, instruction, target)
        write = write_shapes_edit_jsonl if case.source_images else write_shapes_jsonl
        extra[-4:-4] = ["--prompt-data", str(write(tmp_path / "shapes.jsonl", 4, seed=0))]
    if loss_type == "dmd2":
        extra += ["--teacher-load", path]
    if loss_type == "sft_loss" and not case.sft:  # refused at start-up, before Ray and any actor
        with pytest.raises(ValueError, match="sft_loss trains on .*dataset records.*not supported"):
            run(case, path, tmp_path / "run", "--loss-type", loss_type, *extra)
        return
    windows = run(case, path, tmp_path / "run", "--loss-type", loss_type, *extra)
    assert windows and all(np.isfinite(m["train/loss"]) for m in windows), windows
    if loss_type == "dmd2":
        assert {m["role"] for m in windows} == {"actor", "critic"}


EDIT_CASES = [case for case in FAMILY_CASES if case.source_images]


@pytest.mark.parametrize("case", EDIT_CASES[:1], ids=[case.id for case in EDIT_CASES[:1]])
def test_a_broken_source_image_fails_before_any_actor_starts_naming_it(request, tmp_path, case):
    path = request.getfixturevalue(case.fixture)
    data = write_shapes_edit_jsonl(tmp_path / "edits.jsonl", 4, seed=0)
    lines = data.read_text().splitlines()
    lines[2] = lines[2].replace("_source.png", "_gone.png")
    data.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"edits\.jsonl:3: source image 0 .*_gone\.png not found"):
        run(case, path, tmp_path / "run", "--loss-type", "nft", *REWARD, "--prompt-data", str(data))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
