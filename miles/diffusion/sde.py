"""One reverse step of flow-matching sampling (Flow-GRPO `sde`, `cps`, DanceGRPO's `dance`, plain `ode`, DMD2's
`renoise`) and its log-prob.

Every step computes in float32 whatever the input dtype; log-probs are means over non-batch dims, never sums.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from miles.diffusion.schedule import expand_like

# σ within this distance of 1 is "pure noise": std_t would divide by zero there (compare with a tolerance).
SIGMA_ONE_ATOL = 1e-5


@dataclass(frozen=True)
class StepResult:
    """A step's output. `std_t` is what the kernel's KL divides by (see `kl_to_reference`); `step_std` is the
    true std of x' given x. Both are float32 (B,). `log_prob` (B,) is None for `ode`."""

    next_latents: torch.Tensor
    mean: torch.Tensor
    std_t: torch.Tensor
    step_std: torch.Tensor
    log_prob: torch.Tensor | None


def _mean_over_dims(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(x.shape[0], -1).mean(dim=1)


def _prepare(latents, velocity, sigma, sigma_next):
    x = latents.float()
    v = velocity.float()
    return x, v, expand_like(sigma, x), expand_like(sigma_next, x)


def _draw(mean, prev_sample, generator, noise) -> torch.Tensor:
    if prev_sample is not None:
        return prev_sample.float()
    if noise is None:
        noise = torch.randn(mean.shape, generator=generator, device=mean.device, dtype=torch.float32)
    return noise.float()


def sde_step(
    latents: torch.Tensor,
    velocity: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    *,
    noise_level: float,
    sigma_max: float,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> StepResult:
    """Flow-GRPO SDE step: std_t = a·√(σ/(1 − σ̃)), σ̃ = σ except σ ≈ 1 where `sigma_max` (the grid's second
    value) stands in; μ = x(1 + std_t²·dt/(2σ)) + v(1 + std_t²(1 − σ)/(2σ))·dt; x' = μ + std_t√(−dt)·z.

    With `prev_sample` the given x' is scored instead of sampled (training recompute). Noise level 0 gives
    Euler with a NaN log-prob (s = 0): use `ode_step` for deterministic steps. The same holds at σ' = 0 (the
    grid's last step), which is never trained.
    """
    x, v, s, s_next = _prepare(latents, velocity, sigma, sigma_next)
    is_one = torch.isclose(s, torch.ones_like(s), rtol=0.0, atol=SIGMA_ONE_ATOL)
    s_tilde = torch.where(is_one, torch.full_like(s, float(sigma_max)), s)
    std_t = noise_level * torch.sqrt(s / (1 - s_tilde))
    return _flow_sde(x, v, s, s_next, std_t, prev_sample, generator, noise)


def _flow_sde(x, v, s, s_next, std_t, prev_sample, generator, noise) -> StepResult:
    """Flow-GRPO's step mean and Gaussian log-prob for a given std_t (broadcastable to x)."""
    dt = s_next - s
    mean = x * (1 + std_t**2 * dt / (2 * s)) + v * (1 + std_t**2 * (1 - s) / (2 * s)) * dt
    step_std = std_t * torch.sqrt(-dt)
    drawn = _draw(mean, prev_sample, generator, noise)
    next_latents = drawn if prev_sample is not None else mean + step_std * drawn
    log_density = (
        -((next_latents.detach() - mean) ** 2) / (2 * step_std**2) - torch.log(step_std) - 0.5 * math.log(2 * math.pi)
    )
    return StepResult(next_latents, mean, std_t.flatten(), step_std.flatten(), _mean_over_dims(log_density))


def dance_step(
    latents: torch.Tensor,
    velocity: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    *,
    noise_level: float,
    sigma_max: float = 1.0,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> StepResult:
    """DanceGRPO step: Flow-GRPO's mean and log-prob with a constant std_t = η (`noise_level`), so the step std is
    s = η·√(−dt) and nothing divides by 1 − σ (`sigma_max` is unused: uniform API)."""
    del sigma_max
    x, v, s, s_next = _prepare(latents, velocity, sigma, sigma_next)
    std_t = torch.full_like(s, float(noise_level))
    return _flow_sde(x, v, s, s_next, std_t, prev_sample, generator, noise)


def cps_step(
    latents: torch.Tensor,
    velocity: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    *,
    noise_level: float,
    sigma_max: float,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> StepResult:
    """Coefficient-preserving step: s = σ'·sin(aπ/2); μ = (1 − σ')·x̂₀ + √(σ'² − s²)·ε̂ with x̂₀ = x − σv,
    ε̂ = x + (1 − σ)v; x' = μ + s·z. Its "log-prob" is −mean((x' − μ)²): constants and 1/(2s²) dropped, so
    clip ranges are not comparable with `sde`. `std_t` = `step_std` = s. `sigma_max` is unused (uniform API).
    """
    del sigma_max
    x, v, s, s_next = _prepare(latents, velocity, sigma, sigma_next)
    step_std = s_next * math.sin(noise_level * math.pi / 2)
    x0_hat = x - s * v
    eps_hat = x + (1 - s) * v
    mean = (1 - s_next) * x0_hat + torch.sqrt(s_next**2 - step_std**2) * eps_hat
    drawn = _draw(mean, prev_sample, generator, noise)
    next_latents = drawn if prev_sample is not None else mean + step_std * drawn
    log_prob = _mean_over_dims(-((next_latents.detach() - mean) ** 2))
    return StepResult(next_latents, mean, step_std.flatten(), step_std.flatten(), log_prob)


def ode_step(
    latents: torch.Tensor,
    velocity: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    *,
    noise_level: float = 0.0,
    sigma_max: float = 1.0,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> StepResult:
    """Plain Euler, x' = x + v·dt; deterministic, so no log-prob. Extra arguments are accepted and ignored."""
    del noise_level, sigma_max, prev_sample, generator, noise
    x, v, s, s_next = _prepare(latents, velocity, sigma, sigma_next)
    next_latents = x + v * (s_next - s)
    zeros = torch.zeros(x.shape[0], dtype=torch.float32, device=x.device)
    return StepResult(next_latents, next_latents, zeros, zeros, None)


def renoise_step(
    latents: torch.Tensor,
    velocity: torch.Tensor,
    sigma: torch.Tensor | float,
    sigma_next: torch.Tensor | float,
    *,
    noise_level: float = 0.0,
    sigma_max: float = 1.0,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
) -> StepResult:
    """Few-step generator step (DMD2): x̂₀ = x − σ·v, then x' = (1 − σ')·x̂₀ + σ'·ε with fresh ε; at σ' = 0,
    x' = x̂₀. No log-prob. `mean` is the x̂₀ of the step (the generator's output); `std_t` = `step_std` = σ'.
    `noise_level`, `sigma_max` and `prev_sample` are accepted and ignored (uniform API)."""
    del noise_level, sigma_max, prev_sample
    x, v, s, s_next = _prepare(latents, velocity, sigma, sigma_next)
    x0_hat = x - s * v
    drawn = _draw(x0_hat, None, generator, noise)
    next_latents = (1 - s_next) * x0_hat + s_next * drawn
    return StepResult(next_latents, x0_hat, s_next.flatten(), s_next.flatten(), None)


def renoise_sigmas(num_steps: int, shift: float = 3.0) -> torch.Tensor:
    """The k-step generator grid: σ_i = shift·u/(1 + (shift − 1)·u) at u = 1 − i/k, i = 0..k−1, then 0.

    Uniform in u and shifted like the training timesteps (k = 4, shift 1: 1, .75, .5, .25, 0 — DMD2's
    999/749/499/249); not the diffusers sampling grid, whose k = 2 grid ends at σ ≈ 0.003 (a wasted step).
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    u = 1.0 - torch.arange(num_steps, dtype=torch.float64) / num_steps
    sigma = shift * u / (1 + (shift - 1) * u)
    return torch.cat([sigma, torch.zeros(1, dtype=torch.float64)]).float()


SDE_KERNELS: dict[str, Callable[..., StepResult]] = {
    "sde": sde_step,
    "cps": cps_step,
    "dance": dance_step,
    "ode": ode_step,
    "renoise": renoise_step,
}


def get_sde_kernel(name: str) -> Callable[..., StepResult]:
    """The step kernel for `--diffusion-sde-type`."""
    if name not in SDE_KERNELS:
        raise ValueError(f"unknown --diffusion-sde-type {name!r}; valid: {', '.join(sorted(SDE_KERNELS))}")
    return SDE_KERNELS[name]


def kl_to_reference(mean: torch.Tensor, ref_mean: torch.Tensor, std_t: torch.Tensor) -> torch.Tensor:
    """Per-sample (B,) KL penalty as the references compute it: mean over dims of (μ − μ_ref)²/(2·std_t²).

    Pass the kernel's `StepResult.std_t`: for `sde` that is std_t (not the step std s = std_t√(−dt)), giving the
    true Gaussian KL times |dt| that published β values assume; for `cps` it is the true step std s.
    """
    std = std_t.float().reshape(-1)
    return _mean_over_dims((mean.float() - ref_mean.float()) ** 2) / (2 * std**2)
