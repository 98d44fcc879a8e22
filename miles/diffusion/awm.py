"""AWM (advantage-weighted matching): the flow-matching "log-prob" of a re-noised clean sample under each weighting,
the stratified training timesteps on the sampler's grid, and the advantage scaling A' = clamp(A, ±c)/c."""

from __future__ import annotations

import numpy as np
import torch

from miles.utils.simulation import real_tensors

AWM_WEIGHTINGS = ("ghuber", "l", "sigma", "sigma2")
GHUBER_EPS = 1e-10


def matching_error(v_pred: torch.Tensor, x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """ℓ per sample (B,) in float64: mean over non-batch dims of (v − (ε − x₀))²."""
    err = (v_pred.double() - (noise.double() - x0.double())) ** 2
    return err.reshape(err.shape[0], -1).mean(dim=1)


def weighted_error(err: torch.Tensor, sigma: torch.Tensor, weighting: str, power: float = 0.25) -> torch.Tensor:
    """w(ℓ, σ) per sample (B,), float64: `ghuber` (σ/p)·((ℓ + 1e-10)^p − 1e-10^p), `l` ℓ, `sigma` σ·ℓ, `sigma2` σ²·ℓ."""
    err = err.double()
    sigma = sigma.double().reshape(-1).to(err.device)
    if weighting == "ghuber":
        return (sigma / power) * ((err + GHUBER_EPS) ** power - GHUBER_EPS**power)
    if weighting == "l":
        return err
    if weighting == "sigma":
        return sigma * err
    if weighting == "sigma2":
        return sigma**2 * err
    raise ValueError(f"unknown --awm-weighting {weighting!r}; valid: {', '.join(AWM_WEIGHTINGS)}")


def awm_log_prob(
    v_pred: torch.Tensor,
    x0: torch.Tensor,
    noise: torch.Tensor,
    sigma: torch.Tensor,
    *,
    weighting: str = "ghuber",
    power: float = 0.25,
) -> torch.Tensor:
    """logp = −w(ℓ, σ) per sample (B,), float64 (the authors compute it in float64): 0 for a perfect prediction."""
    return -weighted_error(matching_error(v_pred, x0, noise), sigma, weighting, power)


def scaled_advantage(advantages: torch.Tensor, adv_clip_max: float) -> torch.Tensor:
    """A' = clamp(A, ±c)/c ∈ [−1, 1], float32 (the authors' advantage_max 1 with adv_clip_max c)."""
    return advantages.float().clamp(-adv_clip_max, adv_clip_max) / adv_clip_max


def stratum_bounds(num_steps: int, count: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """The `count` strata [lower_k, upper_k) of grid indices over [1, int(fraction·num_steps)), cut exactly as the
    authors' code cuts them: `torch.linspace(1, top, count + 1)` in float32, truncated by `.long()`. Its rounding
    puts some edges one index below the exact floor (an edge k·(top − 1)/count + 1 that is a whole number lands just
    under it) in some layouts from 14 strata on, which an exact or float64 floor does not reproduce. Each stratum is
    non-empty when count ≤ int(fraction·num_steps) − 1."""
    top = int(fraction * num_steps)
    if count < 1 or top - 1 < count:
        raise ValueError(
            f"--awm-train-timesteps {count} strata do not fit in the grid indices [1, {top}) of --diffusion-num-steps "
            f"{num_steps} x --awm-timestep-fraction {fraction}: need at most {max(top - 1, 0)}"
        )
    with real_tensors():  # the planner converts fake rollouts: the edges are numbers, never a fake tensor
        edges = torch.linspace(1, top, count + 1, dtype=torch.float32, device="cpu").long().numpy()
    return edges[:-1], edges[1:]


def stratified_indices(num_steps: int, count: int, fraction: float, u: np.ndarray) -> np.ndarray:
    """One grid index per stratum: lower_k + floor(u_k·(upper_k − lower_k)), u_k ∈ [0, 1) given (count,)."""
    lower, upper = stratum_bounds(num_steps, count, fraction)
    return lower + np.floor(np.asarray(u, dtype=np.float64) * (upper - lower)).astype(np.int64)
