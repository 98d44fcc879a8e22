"""Train the learned shapes rewards (`--rm-type shapes_learned`, `shapes_learned_latent`) that ship in
miles/assets/shapes_reward/, reproducibly, on CPU.

Data: scenes of the builtin shapes generator (`miles.data.shapes.shapes_items`, train split), their colour, shape,
count and position as labels. The image network sees the rendered images and `builtin:tiny-shapes` VAE
reconstructions of some of them (the texture a generated image has), with random blur, pixel noise and left-right
mirroring (left and right swapped in the label); the latent network sees the scenes' VAE latents (posterior samples,
normalised as the engine's latents) with added Gaussian noise. Both are scored on the eval split (other seeds'
layouts): per attribute accuracy, and all four right, on clean renders and reconstructions (image) or latents.

    python scripts/train_shapes_reward.py            # writes miles/assets/shapes_reward/*.safetensors
    python scripts/train_shapes_reward.py --steps 0  # only the gold check of the networks in --out-dir

Then (`--gold-check N`) it samples N eval prompts from builtin:tiny-shapes and prints how often each network's
verdict per attribute agrees with the programmatic gold's on those samples.

The held-out accuracies it prints go in docs/user-guide/rewards.md; they are also stored in each file's metadata.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

from miles.data.shapes import shapes_items  # noqa: E402
from miles.models.shapes_reward import net as ls  # noqa: E402

COMMAND = "python scripts/train_shapes_reward.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0, help="Scenes, initialisation, batches and augmentations.")
    parser.add_argument("--train-size", type=int, default=3072, help="Training scenes (train split).")
    parser.add_argument(
        "--recon-size", type=int, default=768, help="Of them, how many the image net also sees as VAE reconstructions."
    )
    parser.add_argument("--eval-size", type=int, default=512, help="Held-out scenes (eval split).")
    parser.add_argument("--steps", type=int, default=1500, help="Optimizer steps per network.")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-width", type=int, default=16, help="Channels of the image net's first layer.")
    parser.add_argument("--latent-width", type=int, default=32, help="Channels of the latent net's first layer.")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (one is fastest on a loaded machine).")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument(
        "--label-smoothing",
        type=float,
        default=0.05,
        help="Keeps the probabilities off 0 and 1, so the score's gradient does not vanish on confident inputs.",
    )
    parser.add_argument("--latent-noise", type=float, default=0.2, help="Largest std of the noise added to latents.")
    parser.add_argument("--kinds", default="image,latent", help="Which networks to train.")
    parser.add_argument(
        "--gold-check",
        type=int,
        default=128,
        help="Then score this many builtin:tiny-shapes "
        "samples of eval prompts with the gold and the shipped networks, and print their agreement.",
    )
    parser.add_argument("--gold-check-cfg", type=float, default=4.5, help="The samples' guidance scale (20 steps).")
    parser.add_argument(
        "--model-samples",
        type=int,
        default=0,
        help="Also train on this many builtin:tiny-shapes samples of train prompts, labelled by the gold (the "
        "classes its attribute tests accept): a proxy fitted to the model's own outputs. 0 (the shipped weights): "
        "the generator's scenes only.",
    )
    parser.add_argument("--out-dir", default=str(ls.WEIGHTS_DIR))
    return parser.parse_args(argv)


def log(message: str) -> None:
    print(f"[train_shapes_reward {time.strftime('%H:%M:%S')}] {message}", flush=True)


def scenes(num: int, seed: int, split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixels (N, 3, 32, 32) in [0, 1], labels (N, 4)) of the generator's first `num` scenes of `split`."""
    items = shapes_items(num, seed=seed, split=split, resolution=ls.IMAGE_SIZE)
    pixels = np.stack([np.asarray(item["image"], dtype=np.float32) for item in items]) / 255.0
    return torch.from_numpy(pixels).permute(0, 3, 1, 2).contiguous(), ls.scene_labels([i["metadata"] for i in items])


@torch.no_grad()
def encode(pixels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalised posterior mean and std of the scenes under the shipped VAE (x0 = (z - shift) * scale)."""
    vae = ls.shapes_vae()
    shift, scale = float(vae.config.shift_factor or 0.0), float(vae.config.scaling_factor)
    means, stds = [], []
    for chunk in (pixels * 2 - 1).split(256):
        posterior = vae.encode(chunk).latent_dist
        means.append((posterior.mean - shift) * scale)
        stds.append(posterior.std * scale)
    return torch.cat(means), torch.cat(stds)


@torch.no_grad()
def decode(latents: torch.Tensor) -> torch.Tensor:
    """Images in [0, 1] of normalised latents: what the engine hands a reward."""
    vae = ls.shapes_vae()
    shift, scale = float(vae.config.shift_factor or 0.0), float(vae.config.scaling_factor)
    chunks = [vae.decode(chunk / scale + shift).sample for chunk in latents.split(256)]
    return (torch.cat(chunks) / 2 + 0.5).clamp(0, 1)


_MIRROR = torch.tensor([ls.POSITIONS.index({"left": "right", "right": "left"}.get(p, p)) for p in ls.POSITIONS])
_BLUR = torch.tensor([[1.0, 2.0, 1.0], [2.0, 4.0, 2.0], [1.0, 2.0, 1.0]]).div(16).expand(3, 1, 3, 3)


def augment_images(x: torch.Tensor, labels: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random left-right mirror (position label swapped), blur of random strength, and pixel noise up to 0.05."""
    n = x.shape[0]
    flip = torch.rand(n, generator=g) < 0.5
    x = torch.where(flip[:, None, None, None], x.flip(-1), x)
    labels, position = labels.clone(), labels[:, 3]
    labels[:, 3] = torch.where(flip & (position >= 0), _MIRROR[position.clamp(min=0)], position)
    blurred = nn.functional.conv2d(nn.functional.pad(x, (1, 1, 1, 1), mode="replicate"), _BLUR, groups=3)
    amount = torch.rand(n, 1, 1, 1, generator=g)
    x = x + amount * (blurred - x)
    x = x + 0.05 * torch.rand(n, 1, 1, 1, generator=g) * torch.randn(x.shape, generator=g)
    return x.clamp(0, 1), labels


def augment_latents(mean: torch.Tensor, std: torch.Tensor, top: float, g: torch.Generator) -> torch.Tensor:
    """A posterior sample plus Gaussian noise of a random std in [0, top]."""
    sample = mean + std * torch.randn(mean.shape, generator=g)
    return sample + top * torch.rand(mean.shape[0], 1, 1, 1, generator=g) * torch.randn(mean.shape, generator=g)


def loss_of(net: nn.Module, x: torch.Tensor, labels: torch.Tensor, smoothing: float) -> torch.Tensor:
    heads = ls.split_logits(net(x)).values()
    return sum(nn.functional.cross_entropy(h, labels[:, k], label_smoothing=smoothing) for k, h in enumerate(heads))


def train(net: nn.Module, batch_fn, args: argparse.Namespace, name: str) -> nn.Module:
    """AdamW with a short warm-up and a cosine decay; `batch_fn(step)` gives (inputs, labels)."""
    optimizer = torch.optim.AdamW(net.parameters(), lr=args.lr, weight_decay=1e-4)
    warmup = 50
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / args.steps))
    )
    started = time.perf_counter()
    net.train()
    for step in range(args.steps):
        x, labels = batch_fn(step)
        loss = loss_of(net, x, labels, args.label_smoothing)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        schedule.step()
        if step % 250 == 0 or step == args.steps - 1:
            log(f"{name} step {step}: loss {loss.item():.4f} ({time.perf_counter() - started:.0f} s)")
    return net.eval().requires_grad_(False)


@torch.no_grad()
def accuracy(net: nn.Module, x: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """Share of held-out inputs whose predicted class (argmax) is right, per attribute and all four at once."""
    heads = ls.split_logits(torch.cat([net(chunk) for chunk in x.split(256)]))
    right = torch.stack([h.argmax(dim=1) == labels[:, k] for k, h in enumerate(heads.values())], dim=1)
    result = {name: float(right[:, k].float().mean()) for k, (name, _) in enumerate(ls.ATTRIBUTES)}
    result["all"] = float(right.all(dim=1).float().mean())
    return {key: round(value, 4) for key, value in result.items()}


def train_image(args, data) -> tuple[nn.Module, dict[str, dict[str, float]]]:
    (pixels, labels), recons, (eval_pixels, eval_labels, eval_recons) = data["train"], data["recons"], data["eval"]
    model_pixels, _, model_labels = data.get("model", (pixels[:0], None, labels[:0]))
    inputs = torch.cat([pixels, recons, model_pixels])
    targets = torch.cat([labels, labels[: len(recons)], model_labels])
    g = torch.Generator().manual_seed(args.seed + 1)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.randint(len(inputs), (args.batch_size,), generator=g)
        x, y = augment_images(inputs[index], targets[index], g)
        return x * 2 - 1, y

    torch.manual_seed(args.seed)
    net = train(ls.ShapesRewardNet(3, ls.IMAGE_SIZE, width=args.image_width), batch, args, "image")
    held_out = {
        "clean": accuracy(net, eval_pixels * 2 - 1, eval_labels),
        "vae_reconstruction": accuracy(net, eval_recons * 2 - 1, eval_labels),
    }
    return net, held_out


def train_latent(args, data) -> tuple[nn.Module, dict[str, dict[str, float]]]:
    (mean, std), labels = data["latents"], data["train"][1]
    if "model" in data:  # the model's final latents, exact (no posterior spread)
        _, model_latents, model_labels = data["model"]
        mean, std = torch.cat([mean, model_latents]), torch.cat([std, torch.zeros_like(model_latents)])
        labels = torch.cat([labels, model_labels])
    (eval_mean, _), eval_labels = data["eval_latents"], data["eval"][1]
    g = torch.Generator().manual_seed(args.seed + 2)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.randint(len(mean), (args.batch_size,), generator=g)
        return augment_latents(mean[index], std[index], args.latent_noise, g), labels[index]

    torch.manual_seed(args.seed)
    net = train(ls.ShapesRewardNet(mean.shape[1], mean.shape[-1], width=args.latent_width), batch, args, "latent")
    noisy = eval_mean + 0.1 * torch.randn(eval_mean.shape, generator=torch.Generator().manual_seed(args.seed + 3))
    held_out = {"posterior_mode": accuracy(net, eval_mean, eval_labels), "noise_0.1": accuracy(net, noisy, eval_labels)}
    return net, held_out


def prepare(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    data: dict = {"train": scenes(args.train_size, args.seed, "train")}
    eval_pixels, eval_labels = scenes(args.eval_size, args.seed, "eval")
    log(f"rendered {args.train_size} + {args.eval_size} scenes ({time.perf_counter() - started:.0f} s)")
    data["latents"] = encode(data["train"][0])
    data["eval_latents"] = encode(eval_pixels)
    log(f"encoded them with the {ls.LATENT_CHECKPOINT} VAE ({time.perf_counter() - started:.0f} s)")
    data["recons"] = decode(data["latents"][0][: args.recon_size])
    data["eval"] = (eval_pixels, eval_labels, decode(data["eval_latents"][0]))
    log(f"decoded {args.recon_size} + {args.eval_size} reconstructions ({time.perf_counter() - started:.0f} s)")
    if args.model_samples:
        images, latents, metadatas = model_samples(args.model_samples, "train", args)
        labels = gold_labels(images, metadatas)
        pixels = torch.from_numpy(images.astype(np.float32) / 255).permute(0, 3, 1, 2).contiguous()
        data["model"] = (pixels, latents, labels)
        kept = (labels >= 0).float().mean(dim=0).tolist()
        log(
            f"{args.model_samples} model samples labelled by the gold, share labelled per attribute {kept} "
            f"({time.perf_counter() - started:.0f} s)"
        )
    return data


def save(net: nn.Module, kind: str, held_out: dict, args: argparse.Namespace, seconds: float) -> Path:
    from safetensors.torch import save_file

    path = Path(args.out_dir) / ls.WEIGHT_FILES[kind]
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {
        "config": json.dumps(net.config),
        "kind": kind,
        "seed": str(args.seed),
        "command": COMMAND + "".join(f" {a}" for a in sys.argv[1:]),
        "parameters": str(sum(p.numel() for p in net.parameters())),
        "heldout_accuracy": json.dumps(held_out),
        "train_seconds": f"{seconds:.0f}",
    }
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path), metadata=metadata)
    return path


@torch.no_grad()
def model_samples(num: int, split: str, args: argparse.Namespace) -> tuple[np.ndarray, torch.Tensor, list[dict]]:
    """(images (N, 32, 32, 3) uint8, final latents, metadatas) of `builtin:tiny-shapes` on the first `num` prompts of
    `split`: 20 ODE steps at CFG --gold-check-cfg, prompt i from the noise of seed 1000 + i."""
    from miles.data.shapes import shapes_prompts
    from miles.models.builtin import resolve_checkpoint
    from miles.rollout.engine import DiffusionEngine
    from miles.rollout.engine_api import GenerateRequest

    records = shapes_prompts(num, seed=args.seed, split=split)
    engine = DiffusionEngine(resolve_checkpoint(ls.LATENT_CHECKPOINT))
    images, latents = [], []
    for start in range(0, num, 128):
        chunk = records[start : start + 128]
        request = GenerateRequest(
            prompts=[r["prompt"] for r in chunk],
            seeds=[1000 + start + i for i in range(len(chunk))],
            num_steps=20,
            guidance_scale=args.gold_check_cfg,
            negative_prompt="",
            sde_type="ode",
            noise_level=0.0,
            trained_steps=[],
        )
        result = engine.generate(request)
        images.append(result.images)
        latents.append(result.final_latents.float())
    return np.concatenate(images), torch.cat(latents), [r["metadata"] for r in records]


def gold_labels(images: np.ndarray, metadatas: list[dict]) -> torch.Tensor:
    """(N, 4) labels of model samples read by the gold: per attribute, the one class whose `ATTRIBUTE_CORRECT` test
    passes when the prompt asks for it (the other attributes as prompted); -100 (ignored) when none or several do."""
    from miles.rollout.evaluation import ATTRIBUTE_CORRECT
    from miles.rollout.rm_hub.shapes import shapes_reward

    labels = torch.full((len(metadatas), len(ls.ATTRIBUTES)), -100, dtype=torch.long)
    for k, (name, classes) in enumerate(ls.ATTRIBUTES):
        passes = torch.tensor(
            [
                [ATTRIBUTE_CORRECT[name](s) for s in shapes_reward(list(images), [{**m, name: c} for m in metadatas])]
                for c in classes
            ]
        )
        unique = passes.sum(dim=0) == 1
        labels[unique, k] = passes.float().argmax(dim=0)[unique]
    return labels


def gold_check(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Agreement of the networks in `--out-dir` with the gold, per attribute and all-correct, on samples of the
    shipped model for eval prompts: the gold's `ATTRIBUTE_CORRECT` against wanted probability > 0.5; the latent net
    reads the final latents (what a reward-gradient algorithm hands it), the image net the decoded images."""
    from miles.rollout.evaluation import ATTRIBUTE_CORRECT
    from miles.rollout.rm_hub.shapes import shapes_reward

    images, latents, metadatas = model_samples(args.gold_check, "eval", args)
    gold = shapes_reward(list(images), metadatas)
    gold_right = torch.tensor([[ATTRIBUTE_CORRECT[name](score) for name, _ in ls.ATTRIBUTES] for score in gold])
    labels = ls.scene_labels(metadatas)
    pixels = torch.from_numpy(images.astype(np.float32) / 255).permute(0, 3, 1, 2)
    inputs = {ls.IMAGE: pixels * 2 - 1, ls.LATENT: latents}
    report = {"gold_accuracy": _rates(gold_right)}
    for kind in args.kinds.split(","):
        with torch.no_grad():
            learned_right = ls.wanted_probabilities(_saved_net(args, kind)(inputs[kind]), labels) > 0.5
        report[kind] = _rates(learned_right == gold_right, all_of=(learned_right.all(1) == gold_right.all(1)))
    return report


def _rates(right: torch.Tensor, all_of: torch.Tensor | None = None) -> dict[str, float]:
    rates = {name: float(right[:, k].float().mean()) for k, (name, _) in enumerate(ls.ATTRIBUTES)}
    rates["all"] = float((right.all(1) if all_of is None else all_of).float().mean())
    return {key: round(value, 4) for key, value in rates.items()}


def _saved_net(args: argparse.Namespace, kind: str) -> nn.Module:
    from safetensors import safe_open

    with safe_open(str(Path(args.out_dir) / ls.WEIGHT_FILES[kind]), framework="pt") as f:
        net = ls.ShapesRewardNet(**json.loads(f.metadata()["config"]))
        net.load_state_dict({key: f.get_tensor(key) for key in f.keys()})
    return net.eval()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.steps == 0:  # only the gold check of the networks already in --out-dir
        torch.set_num_threads(args.threads)
        log(json.dumps(gold_check(args)))
        return
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    data = prepare(args)
    trainers = {ls.IMAGE: train_image, ls.LATENT: train_latent}
    for kind in args.kinds.split(","):
        begun = time.perf_counter()
        net, held_out = trainers[kind](args, data)
        path = save(net, kind, held_out, args, time.perf_counter() - begun)
        params = sum(p.numel() for p in net.parameters())
        log(f"{kind}: {params} parameters, held-out accuracy {json.dumps(held_out)} -> {path}")
    log(f"trained in {time.perf_counter() - started:.0f} s (torch threads: {torch.get_num_threads()})")
    if args.gold_check:
        begun = time.perf_counter()
        report = gold_check(args)
        log(
            f"gold check on {args.gold_check} samples of {ls.LATENT_CHECKPOINT} at CFG {args.gold_check_cfg:g}, "
            f"20 ODE steps ({time.perf_counter() - begun:.0f} s): {json.dumps(report)}"
        )


if __name__ == "__main__":
    main()
