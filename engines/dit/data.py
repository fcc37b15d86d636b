"""The procedural images the pixel DiT learns: a few soft Gaussian blobs and, sometimes, a bar.

Every image is a pure function of ``(stream, index)``: ``np.random.default_rng([stream, index])``
draws its content, so a batch is the same however it is split, a resumed run sees the images an
uninterrupted one would, and a held-out set is fixed by its stream number alone. Geometry is in
units of the image side, so the same stream at 32x32 and 128x128 draws the same scene at two
resolutions. Values lie in [-1, 1] (colours can be negative) on a background of one random colour
per image, which only the whole image reveals (a reason for attention to look far), float32,
``[count, channels, size, size]``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


MAX_BLOBS = 64  # each blob is drawn over the whole image


@dataclass(frozen=True)
class SceneParams:
    """What a scene may contain (defaults: the seed's "a few Gaussian blobs and sometimes a bar")."""

    background: float = 0.5  # each channel's background is uniform in [-background, background]
    blobs_min: int = 1
    blobs_max: int = 4
    sigma_min: float = 0.04  # blob standard deviation, in image sides
    sigma_max: float = 0.12
    bar_prob: float = 0.5
    bar_length_min: float = 0.3
    bar_length_max: float = 0.8
    bar_width_min: float = 0.03
    bar_width_max: float = 0.08

    def validate(self) -> None:
        if not 0 <= self.background <= 1:
            raise ValueError(f"data.scene.background: expected a value in [0, 1], got {self.background}")
        if not 0 <= self.blobs_min <= self.blobs_max <= MAX_BLOBS:
            raise ValueError(f"data.scene.blobs_min/blobs_max: expected 0 <= min <= max <= {MAX_BLOBS}, got "
                             f"{self.blobs_min}, {self.blobs_max}")
        if not 0 < self.sigma_min <= self.sigma_max:
            raise ValueError(f"data.scene.sigma_min/sigma_max: expected 0 < min <= max, got {self.sigma_min}, "
                             f"{self.sigma_max}")
        if not 0 <= self.bar_prob <= 1:
            raise ValueError(f"data.scene.bar_prob: expected a probability in [0, 1], got {self.bar_prob}")
        if not 0 < self.bar_length_min <= self.bar_length_max:
            raise ValueError("data.scene.bar_length_min/bar_length_max: expected 0 < min <= max")
        if not 0 < self.bar_width_min <= self.bar_width_max:
            raise ValueError("data.scene.bar_width_min/bar_width_max: expected 0 < min <= max")


def render_image(rng: np.random.Generator, size: int, channels: int, scene: SceneParams) -> np.ndarray:
    """One scene ``[channels, size, size]`` drawn from ``rng``."""
    centres = (np.arange(size, dtype=np.float64) + 0.5) / size  # pixel centres in image sides
    y, x = np.meshgrid(centres, centres, indexing="ij")
    image = np.broadcast_to(rng.uniform(-scene.background, scene.background, size=(channels, 1, 1)),
                            (channels, size, size)).astype(np.float64)
    for _ in range(int(rng.integers(scene.blobs_min, scene.blobs_max + 1))):
        cy, cx = rng.uniform(0.15, 0.85, size=2)
        sigma = rng.uniform(scene.sigma_min, scene.sigma_max)
        colour = rng.uniform(-1.0, 1.0, size=channels)
        bump = np.exp(-((y - cy) ** 2 + (x - cx) ** 2) / (2.0 * sigma * sigma))
        image += colour[:, None, None] * bump[None]
    if rng.uniform() < scene.bar_prob:
        cy, cx = rng.uniform(0.25, 0.75, size=2)
        angle = rng.uniform(0.0, np.pi)
        half_length = 0.5 * rng.uniform(scene.bar_length_min, scene.bar_length_max)
        half_width = 0.5 * rng.uniform(scene.bar_width_min, scene.bar_width_max)
        colour = rng.uniform(-1.0, 1.0, size=channels)
        along = (x - cx) * np.cos(angle) + (y - cy) * np.sin(angle)
        across = -(x - cx) * np.sin(angle) + (y - cy) * np.cos(angle)
        # A soft edge one pixel wide, so the bar has the same look at every resolution.
        edge = 1.0 / size
        alpha = (np.clip((half_length - np.abs(along)) / edge + 0.5, 0.0, 1.0) *
                 np.clip((half_width - np.abs(across)) / edge + 0.5, 0.0, 1.0))
        image = image * (1.0 - alpha[None]) + colour[:, None, None] * alpha[None]
    return np.clip(image, -1.0, 1.0).astype(np.float32)


def make_images(stream: int, start: int, count: int, size: int, channels: int = 3,
                scene: SceneParams = SceneParams()) -> np.ndarray:
    """Images ``start .. start+count-1`` of ``stream``: float32 ``[count, channels, size, size]``."""
    if size < 1:
        raise ValueError(f"size: expected a positive image side, got {size}")
    if channels < 1:
        raise ValueError(f"channels: expected a positive number of channels, got {channels}")
    if start < 0 or count < 0:
        raise ValueError(f"start/count: expected non-negative values, got {start}, {count}")
    if stream < 0:
        raise ValueError(f"stream: expected a non-negative stream number, got {stream}")
    out = np.empty((count, channels, size, size), dtype=np.float32)
    for i in range(count):
        out[i] = render_image(np.random.default_rng([stream, start + i]), size, channels, scene)
    return out
