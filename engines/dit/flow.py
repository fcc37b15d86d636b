"""Rectified flow with the LLSA paper's noise rescaling, and an Euler sampler.

    x_t    = (1 - t) x0 + s t eps,     eps ~ N(0, I),  t ~ U(0, 1)
    target = d x_t / d t = s eps - x0
    loss   = mean (model(x_t, t) - target)^2

``s = n / 64`` for n x n images with n > 64, else 1: a larger image has more pixels carrying the
same content, so at a given t its signal-to-noise ratio is effectively higher; scaling the noise
by s restores the SNR of a 64 x 64 image (the paper's "SNR adjustment"; its ablation prefers it to
a timestep shift). Sampling starts from x_1 = s eps and integrates dx/dt = v from t = 1 to 0;
a reconstruction starts from a held-out image noised to x_t0 and integrates from t0.
"""
from __future__ import annotations

import torch


def noise_scale(image_size: int) -> float:
    return image_size / 64.0 if image_size > 64 else 1.0


def noisy(x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor, s: float):
    """(x_t, target) for clean images x0 [B, C, H, W], noise eps like x0 and times t [B]."""
    tt = t.view(-1, 1, 1, 1).to(x0.dtype)
    return (1 - tt) * x0 + s * tt * eps, s * eps - x0


def flow_loss(model, x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor, s: float) -> torch.Tensor:
    x_t, target = noisy(x0, eps, t, s)
    return torch.mean((model(x_t, t) - target) ** 2)


@torch.no_grad()
def euler_from(model, x: torch.Tensor, t0: float, steps: int) -> torch.Tensor:
    """Images from x = x_t0 [B, C, H, W] after ``steps`` uniform Euler steps from t = t0 to t = 0."""
    if steps < 1:
        raise ValueError(f"steps: expected at least 1 sampling step, got {steps}")
    if not 0 < t0 <= 1:
        raise ValueError(f"t0: expected a time in (0, 1], got {t0}")
    times = torch.linspace(t0, 0.0, steps + 1, device=x.device)
    for i in range(steps):
        t = times[i].expand(x.shape[0])
        x = x + (times[i + 1] - times[i]) * model(x, t)
    return x


def euler_sample(model, noise: torch.Tensor, steps: int, s: float) -> torch.Tensor:
    """Images from noise [B, C, H, W] after ``steps`` uniform Euler steps from t = 1 to t = 0."""
    return euler_from(model, s * noise, 1.0, steps)


def sample_times(n: int, kind: str, generator: torch.Generator) -> torch.Tensor:
    """n training times: ``uniform`` t ~ U(0, 1) (the seed's), or ``logit_normal`` t = sigmoid(u),
    u ~ N(0, 1), which trains the middle times more and the ends less (Esser et al. 2024, the
    rectified-flow recipe of Stable Diffusion 3)."""
    if kind == "uniform":
        return torch.rand(n, generator=generator)
    if kind == "logit_normal":
        return torch.sigmoid(torch.randn(n, generator=generator))
    raise ValueError(f"train.timesteps: expected uniform or logit_normal, got {kind!r}")
