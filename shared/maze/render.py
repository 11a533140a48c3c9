"""Pictures of a maze: VisGym's colours as an RGB array, a text grid, PNG bytes, data URIs and GIFs."""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image

from shared.maze.core import Maze

FLOOR = (255, 255, 255)
WALL = (169, 169, 169)
TARGET = (255, 0, 0)
AGENT = (0, 0, 255)
VISGYM_CELL_PX = 25


def render_rgb(maze: Maze, cell_px: int = VISGYM_CELL_PX) -> np.ndarray:
    """Returns an (H*cell_px, W*cell_px, 3) uint8 image: floor white, walls grey, target red, agent blue."""
    height, width = maze.shape
    cells = np.where(maze.maze_map[..., None] == 1, np.array(WALL, np.uint8), np.array(FLOOR, np.uint8))
    image = np.repeat(np.repeat(cells, cell_px, axis=0), cell_px, axis=1)
    tr, tc = maze.target
    image[tr * cell_px : (tr + 1) * cell_px, tc * cell_px : (tc + 1) * cell_px] = TARGET
    # Agent: a filled disc of radius cell/4 at the cell centre, drawn over whatever is below.
    ar, ac = maze.agent
    ys, xs = np.mgrid[0:cell_px, 0:cell_px]
    centre = cell_px / 2
    disc = (ys + 0.5 - centre) ** 2 + (xs + 0.5 - centre) ** 2 <= (cell_px / 4) ** 2
    block = image[ar * cell_px : (ar + 1) * cell_px, ac * cell_px : (ac + 1) * cell_px]
    block[disc] = AGENT
    return image


def render_text(maze: Maze) -> str:
    """Returns the maze as text: '#' wall, ' ' floor, 'A' agent, 'T' target (VisGym's ansi mode)."""
    chars = np.where(maze.maze_map == 1, "#", " ").astype("<U1")
    chars[maze.target] = "T"
    chars[maze.agent] = "A"
    return "\n".join("".join(row) for row in chars)


def png_bytes(image: np.ndarray) -> bytes:
    """Returns the PNG encoding of an RGB array."""
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG", compress_level=1)
    return buffer.getvalue()


def data_uri(image: np.ndarray) -> str:
    """Returns a `data:image/png;base64,...` URI, the form OpenAI-style `image_url` parts carry."""
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def check_data_uri(uri: str, max_bytes: int = 4 * 1024 * 1024) -> str:
    """Returns the base64 payload of an image data URI within max_bytes, without decoding it; ValueError otherwise."""
    if not isinstance(uri, str) or not uri.startswith("data:image/") or ";base64," not in uri[:64]:
        raise ValueError("image_url must be a data URI like data:image/png;base64,...")
    payload = uri.split(";base64,", 1)[1]
    if len(payload) * 3 // 4 > max_bytes:
        raise ValueError(f"image is larger than the {max_bytes} byte limit")
    return payload


def decode_data_uri(uri: str, max_bytes: int = 4 * 1024 * 1024) -> Image.Image:
    """Returns the RGB image inside a base64 data URI; raises ValueError naming what is wrong."""
    payload = check_data_uri(uri, max_bytes)
    try:
        raw = base64.b64decode(payload, validate=True)
        image = Image.open(io.BytesIO(raw))
        if image.width * image.height > 4096 * 4096:
            raise ValueError("image has too many pixels")
        return image.convert("RGB")
    except ValueError:
        raise
    except Exception as exc:  # PIL raises a zoo of types for broken files
        raise ValueError(f"image could not be decoded: {exc}") from exc


def save_gif(frames: list[np.ndarray], path, frame_ms: int = 400) -> None:
    """Writes frames as a looping GIF (last frame held twice as long)."""
    images = [Image.fromarray(frame) for frame in frames]
    durations = [frame_ms] * (len(images) - 1) + [frame_ms * 2]
    images[0].save(path, save_all=True, append_images=images[1:], duration=durations, loop=0)
