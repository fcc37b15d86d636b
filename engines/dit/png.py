"""PNG output with zlib alone (no imaging library): 8-bit RGB or grey, filter 0 on every row."""
from __future__ import annotations

import struct
import zlib

import numpy as np


def _chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload) & 0xFFFFFFFF)


def encode_png(pixels: np.ndarray) -> bytes:
    """``pixels``: uint8 ``[height, width, 3]`` (RGB) or ``[height, width]`` (grey)."""
    pixels = np.asarray(pixels)
    if pixels.dtype != np.uint8:
        raise TypeError(f"pixels: expected uint8, got {pixels.dtype}")
    if pixels.ndim == 2:
        colour_type = 0
        pixels = pixels[:, :, None]
    elif pixels.ndim == 3 and pixels.shape[2] == 3:
        colour_type = 2
    else:
        raise ValueError(f"pixels: expected [height, width] or [height, width, 3], got {list(pixels.shape)}")
    height, width = pixels.shape[:2]
    if height < 1 or width < 1:
        raise ValueError(f"pixels: expected a non-empty image, got {height}x{width}")
    rows = np.concatenate([np.zeros((height, 1), np.uint8), pixels.reshape(height, -1)], axis=1)
    header = struct.pack(">IIBBBBB", width, height, 8, colour_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(rows.tobytes(), 9)) +
            _chunk(b"IEND", b""))


def image_grid(images: np.ndarray, columns: int, pad: int = 2, upscale: int = 1) -> np.ndarray:
    """Tile float images ``[count, channels, h, w]`` in [-1, 1] into one uint8 RGB grid; a grey
    border of ``pad`` pixels separates them; ``upscale`` repeats each pixel (nearest)."""
    images = np.asarray(images, dtype=np.float32)
    if images.ndim != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"images: expected [count, 1 or 3, h, w], got {list(images.shape)}")
    if columns < 1 or upscale < 1 or pad < 0:
        raise ValueError(f"columns/upscale/pad: expected >= 1, >= 1, >= 0, got {columns}, {upscale}, {pad}")
    count, channels, h, w = images.shape
    if channels == 1:
        images = np.repeat(images, 3, axis=1)
    images = np.repeat(np.repeat(images, upscale, axis=2), upscale, axis=3)
    h, w = h * upscale, w * upscale
    rows = (count + columns - 1) // columns
    grid = np.full((rows * (h + pad) + pad, columns * (w + pad) + pad, 3), 128, dtype=np.uint8)
    pixels = np.round((np.clip(images, -1.0, 1.0) + 1.0) * 127.5).astype(np.uint8).transpose(0, 2, 3, 1)
    for i in range(count):
        r, c = divmod(i, columns)
        y, x = pad + r * (h + pad), pad + c * (w + pad)
        grid[y:y + h, x:x + w] = pixels[i]
    return grid

