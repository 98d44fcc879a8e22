"""Where the learned shapes rewards' weights live: the shipped folder (package data), the shipped alternatives a
`builtin:` name of --shapes-learned-dir selects, or the user's folder. Torch-free: the parser checks the files."""

from __future__ import annotations

from pathlib import Path

IMAGE, LATENT = "image", "latent"  # the two networks: one reads images, one builtin:tiny-shapes latents
WEIGHTS_DIR = Path(__file__).resolve().parents[2] / "assets" / "shapes_reward"  # the shipped weights (package data)
# the weight files, in WEIGHTS_DIR or the folder --shapes-learned-dir names (the parser checks them by reward name)
WEIGHT_FILES = {IMAGE: "shapes_learned.safetensors", LATENT: "shapes_learned_latent.safetensors"}
# shipped alternatives --shapes-learned-dir names: `builtin:fitted`, the proxies fitted also to 1024 CFG-free samples of
# builtin:tiny-shapes labelled by the gold (docs/user-guide/rewards.md; the metadata holds the command)
BUILTIN_WEIGHT_DIRS = {"builtin:fitted": WEIGHTS_DIR / "fitted"}


def weights_dir(folder: str | None) -> Path:
    """The folder of the weight files --shapes-learned-dir names: None for the shipped one, a `builtin:` name, or a
    path."""
    if folder is None:
        return WEIGHTS_DIR
    if folder.startswith("builtin:"):
        if folder not in BUILTIN_WEIGHT_DIRS:
            raise ValueError(
                f"--shapes-learned-dir {folder}: no such shipped weights (known: {sorted(BUILTIN_WEIGHT_DIRS)})"
            )
        return BUILTIN_WEIGHT_DIRS[folder]
    return Path(folder)
