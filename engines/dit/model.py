"""The pixel diffusion transformer (DiT with patch size 1: one token per pixel).

    tokens  = pixels of x_t [B, C, H, W], reordered into the layout (Z-order)   [B, N, C]
    h       = W_in tokens                                                        [B, N, D]
    c       = MLP(sinusoidal(1000 t))                                            [B, D]
    per block (AdaLN-Zero, Peebles & Xie 2023):
        (a1, b1, g1, a2, b2, g2) = W_ada SiLU(c)           (W_ada zero-initialised)
        h += g1 * Attn(LN(h) * (1 + b1) + a1)
        h += g2 * MLP(LN(h) * (1 + b2) + a2)               (MLP: D -> 4D -> D, GELU tanh)
    Attn: q, k, v = W_qkv x; q, k = RMSNorm(q), RMSNorm(k) per head (QK norm);
          q, k = RoPE2d(q), RoPE2d(k); o = attend(q, k, v); W_o o
    out     = W_out (LN(h) * (1 + b) + a), (a, b) = W_f SiLU(c)  (W_out zero-initialised)
    v_pred  = out restored to row-major pixel order                              [B, C, H, W]
              (prediction "x0": out is the clean image's estimate x0_pred, and
               v_pred = (x_t - x0_pred) / max(t, T_MIN), the velocity it implies)

Prediction. The network's output is the velocity itself (``velocity``, the seed's), or the clean
image (``x0``): on the path x_t = (1 - t) x0 + s t eps the velocity is s eps - x0 = (x_t - x0) / t,
so an estimate of x0 gives one of the velocity, and the loss, the sampler and the held-out score
stay in velocity space for both. Predicting the clean image, which lies near a low-dimensional
set where the noise does not, is the fix Li & He (2025, "Back to Basics: Let Denoising Generative
Models Denoise") give for pixel-space transformers; their v-loss with x-prediction divides by t
clipped at 0.05 (T_MIN), as here. On the seed's experiment it did worse than predicting the
velocity (docs/dit.md, "What the network predicts"): their tokens are patches of many values, ours
single pixels.

RoPE 2-D: the first half of each head's dimensions rotates with the pixel's row, the second half
with its column; in each half the pairs (2j, 2j+1) turn by pos * theta^(-2j / half). RoPE is
applied to full-resolution q and k before attention, so LLSA's pooled q and k are means of rotated
vectors (as the LLSA authors' model does). Everything but attention is per token, so the layout
order matters only to the sparse attentions; full attention with RoPE is exactly equivariant to
the reordering.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence, Union

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import AttentionSpec, attend

LAYOUTS = ("z_order", "hilbert", "row_major")
PREDICTIONS = ("velocity", "x0")
T_MIN = 0.05  # x0 prediction: the velocity's divisor t is clipped here
MAX_IMAGE_SIZE = 1024  # 1,048,576 pixel tokens, the largest LLSA is tested at
MAX_MLP_RATIO = 64.0
MAX_PARAMETERS = 2 ** 31  # 8 GiB of float32 weights, and as much again for each of Adam's moments


@dataclass(frozen=True)
class DiTConfig:
    image_size: int = 32
    channels: int = 3
    depth: int = 4
    width: int = 64
    heads: int = 4
    mlp_ratio: float = 4.0
    rope_theta: float = 10000.0
    layout: str = "z_order"
    prediction: str = "velocity"  # or "x0" (the header's "Prediction")

    @property
    def head_dim(self) -> int:
        return self.width // self.heads

    @property
    def tokens(self) -> int:
        return self.image_size * self.image_size

    def validate(self) -> None:
        for name in ("image_size", "channels", "depth", "width", "heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model.{name}: expected a positive integer, got {value!r}")
        if self.image_size > MAX_IMAGE_SIZE:
            raise ValueError(f"model.image_size: expected at most {MAX_IMAGE_SIZE} pixels a side "
                             f"({MAX_IMAGE_SIZE ** 2} tokens), got {self.image_size}")
        if self.width % self.heads:
            raise ValueError(f"model.width: expected a multiple of model.heads ({self.heads}), got {self.width}")
        if self.head_dim % 4:
            raise ValueError(f"model.width/heads: 2-D RoPE needs head_dim divisible by 4, got {self.head_dim}")
        if not (self.mlp_ratio <= MAX_MLP_RATIO and round(self.width * self.mlp_ratio) >= 1):
            raise ValueError(f"model.mlp_ratio: expected an MLP of at least one unit (width x mlp_ratio >= 0.5) "
                             f"and a ratio of at most {MAX_MLP_RATIO}, got {self.mlp_ratio}")
        # per block: qkv and proj (4 w^2), the MLP (2 ratio w^2), AdaLN's six modulations (6 w^2)
        parameters = self.depth * (10 + 2 * self.mlp_ratio) * self.width ** 2
        if parameters > MAX_PARAMETERS:
            raise ValueError(f"model.width/depth: {self.width} wide and {self.depth} deep is about "
                             f"{parameters:.3g} parameters, more than the {MAX_PARAMETERS:.3g} allowed")
        if not self.rope_theta > 1:
            raise ValueError(f"model.rope_theta: expected a number above 1, got {self.rope_theta}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"model.layout: expected one of {', '.join(LAYOUTS)}, got {self.layout!r}")
        if self.prediction not in PREDICTIONS:
            raise ValueError(f"model.prediction: expected one of {', '.join(PREDICTIONS)}, got {self.prediction!r}")


def token_order(size: int, layout: str) -> np.ndarray:
    """``perm[p]`` = the row-major index of the pixel at layout position p (sparsa's layouts)."""
    if layout == "row_major":
        return np.arange(size * size, dtype=np.int64)
    import sparsa

    return np.asarray(sparsa.token_permutation(size, size, layout), dtype=np.int64)


def rope_angles(size: int, head_dim: int, theta: float) -> torch.Tensor:
    """Rotation angles ``[size*size, head_dim/2]`` in row-major pixel order: row angles, then column."""
    quarter = head_dim // 4
    freqs = theta ** (-torch.arange(quarter, dtype=torch.float64) * 2.0 / (head_dim // 2))
    rows = torch.arange(size, dtype=torch.float64).repeat_interleave(size)
    cols = torch.arange(size, dtype=torch.float64).repeat(size)
    return torch.cat([rows[:, None] * freqs, cols[:, None] * freqs], dim=1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs (2j, 2j+1) of ``x`` [B, H, N, hd] by the angles whose cos/sin are [N, hd/2]."""
    pairs = x.unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


def timestep_embedding(t: torch.Tensor, dim: int = 256, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal features of 1000 t (t in [0, 1]), [B, dim]: cos then sin (f64 for f64 t, else f32)."""
    half = dim // 2
    dtype = torch.float64 if t.dtype == torch.float64 else torch.float32
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=dtype, device=t.device) / half)
    args = 1000.0 * t.to(dtype)[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale[:, None]) + shift[:, None]


class Attention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.q_norm = nn.RMSNorm(width // heads, eps=1e-6)
        self.k_norm = nn.RMSNorm(width // heads, eps=1e-6)
        self.proj = nn.Linear(width, width)
        self.spec = AttentionSpec()

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, n, width = x.shape
        q, k, v = self.qkv(x).view(batch, n, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(k), cos, sin)
        out = attend(q, k, v.contiguous(), self.spec)
        return self.proj(out.transpose(1, 2).reshape(batch, n, width))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, mlp_ratio: float):
        super().__init__()
        hidden = int(round(width * mlp_ratio))
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(width, heads)
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(width, hidden), nn.GELU(approximate="tanh"), nn.Linear(hidden, width))
        self.ada = nn.Linear(width, 6 * width)

    def forward(self, x: torch.Tensor, c: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(F.silu(c)).chunk(6, dim=-1)
        x = x + gate1[:, None] * self.attn(modulate(self.norm1(x), shift1, scale1), cos, sin)
        return x + gate2[:, None] * self.mlp(modulate(self.norm2(x), shift2, scale2))


class PixelDiT(nn.Module):
    def __init__(self, config: DiTConfig):
        super().__init__()
        config.validate()
        self.config = config
        width = config.width
        self.embed = nn.Linear(config.channels, width)
        self.t_embed = nn.Sequential(nn.Linear(256, width), nn.SiLU(), nn.Linear(width, width))
        self.blocks = nn.ModuleList([Block(width, config.heads, config.mlp_ratio) for _ in range(config.depth)])
        self.final_norm = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.final_ada = nn.Linear(width, 2 * width)
        self.out = nn.Linear(width, config.channels)

        perm = torch.from_numpy(token_order(config.image_size, config.layout))
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel())
        angles = rope_angles(config.image_size, config.head_dim, config.rope_theta)[perm]
        self.register_buffer("perm", perm, persistent=False)
        self.register_buffer("inverse_perm", inverse, persistent=False)
        self.register_buffer("rope_cos", torch.cos(angles).float(), persistent=False)
        self.register_buffer("rope_sin", torch.sin(angles).float(), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Xavier-uniform linears, N(0, 0.02) timestep MLP, and AdaLN-Zero: every modulation and
        the output projection start at zero, so each block starts as the identity."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        for layer in (self.t_embed[0], self.t_embed[2]):
            nn.init.normal_(layer.weight, std=0.02)
        for block in self.blocks:
            nn.init.zeros_(block.ada.weight)
            nn.init.zeros_(block.ada.bias)
        for layer in (self.final_ada, self.out):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def set_attention(self, spec: Union[AttentionSpec, Sequence[AttentionSpec]]) -> None:
        """One spec for every layer, or one per layer."""
        specs: List[AttentionSpec] = [spec] * len(self.blocks) if isinstance(spec, AttentionSpec) else list(spec)
        if len(specs) != len(self.blocks):
            raise ValueError(f"spec: expected one attention per layer ({len(self.blocks)}), got {len(specs)}")
        for s in specs:
            s.validate()
        for block, s in zip(self.blocks, specs):
            block.attn.spec = s

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The predicted velocity for x_t ``[B, C, H, W]`` at times ``t`` [B] in [0, 1]."""
        cfg = self.config
        if x.ndim != 4 or tuple(x.shape[1:]) != (cfg.channels, cfg.image_size, cfg.image_size):
            raise ValueError(f"x: expected [batch, {cfg.channels}, {cfg.image_size}, {cfg.image_size}], "
                             f"got {list(x.shape)}")
        if t.shape != (x.shape[0],):
            raise ValueError(f"t: expected [{x.shape[0]}], got {list(t.shape)}")
        tokens = x.flatten(2).transpose(1, 2)[:, self.perm]
        h = self.embed(tokens)
        c = self.t_embed(timestep_embedding(t))
        for block in self.blocks:
            h = block(h, c, self.rope_cos, self.rope_sin)
        shift, scale = self.final_ada(F.silu(c)).chunk(2, dim=-1)
        out = self.out(modulate(self.final_norm(h), shift, scale))[:, self.inverse_perm]
        out = out.transpose(1, 2).reshape(x.shape)
        if cfg.prediction == "x0":
            return (x - out) / t.clamp(min=T_MIN).view(-1, 1, 1, 1).to(x.dtype)
        return out
