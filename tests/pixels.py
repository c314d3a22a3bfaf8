"""Reading a drawn figure back as pixels: is a region of the map at the top of its colour scale, and wide enough?"""

from __future__ import annotations

import numpy as np


def rgba(fig) -> np.ndarray:
    """The figure as drawn (Agg), an (H, W, 4) uint8 array, row 0 at the top."""
    fig.canvas.draw()
    return np.asarray(fig.canvas.buffer_rgba()).copy()


def top_colour(image) -> np.ndarray:
    """The RGB of the top of a drawn image's colour scale."""
    return np.array(image.cmap(1.0)[:3]) * 255


def near(pixels: np.ndarray, colour: np.ndarray, tol: float = 40.0) -> np.ndarray:
    return np.linalg.norm(pixels[..., :3].astype(float) - colour, axis=-1) < tol


def band_rows(fig, ax, rows: tuple[float, float]) -> tuple[int, int]:
    """Pixel rows (top, bottom) of data rows ``rows`` (y in data coordinates) on ``ax``."""
    height = fig.canvas.get_width_height()[1]
    y0 = ax.transData.transform((0, rows[0]))[1]
    y1 = ax.transData.transform((0, rows[1]))[1]
    a, b = sorted((height - y0, height - y1))
    return round(a), round(b)


def map_box(fig, ax) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) pixel bounds of an axes, rows counted from the top."""
    height = fig.canvas.get_width_height()[1]
    box = ax.get_window_extent()
    return int(height - box.y1) + 1, int(height - box.y0) - 1, int(box.x0) + 1, int(box.x1) - 1


def hot_lines(pixels: np.ndarray, colour: np.ndarray, axis: int, share: float = 0.5) -> np.ndarray:
    """Indices of pixel rows (``axis=0``) or columns (``axis=1``) at least ``share`` of which is ``colour``."""
    hit = near(pixels, colour)
    return np.flatnonzero(hit.mean(axis=1 - axis) >= share)
