"""Short video clips made from the bundled still photos: the training and held-out data of the video denoiser.

No video ships with scikit-image, so motion is made from stills, the three kinds of motion a video model
sees most (a camera and a subject):

- `pan`: a window moving over the photo at a constant velocity (whole pixels per frame);
- `zoom`: a window shrinking or growing about a fixed centre, each frame resized to the clip's size;
- `object`: a still background crop with a crop of another photo moving over it in a straight line.

Every clip is `[3, frames, size, size]` in [-1, 1], the layout diffusers' video models take per sample.
Everything random comes from the generator passed in.

Example:
    >>> clips = heldout_clips(frames=4, size=32, per_image=1)
    >>> clips.shape
    torch.Size([9, 3, 4, 32, 32])
"""

from __future__ import annotations

import torch

from .photos import HELDOUT_IMAGES, load_photo

__all__ = ["CLIP_FRAMES", "CLIP_SIZE", "MOTIONS", "clip_from_photo", "heldout_clips", "random_clips"]

#: The kinds of motion a clip can have.
MOTIONS: tuple[str, ...] = ("pan", "zoom", "object")

CLIP_FRAMES = 8
"""Frames of the clips the video denoiser trains and is measured on."""
CLIP_SIZE = 32
"""Side in pixels of those clips' frames (16 x 16 tokens of 2 x 2 pixels per frame)."""

MAX_SPEED = 3
"""Pans and moving objects move at most this many pixels per frame along each axis."""


def _randint(low: int, high: int, generator: torch.Generator) -> int:
    return int(torch.randint(low, high + 1, (1,), generator=generator))


def _pan(photo: torch.Tensor, frames: int, size: int, generator: torch.Generator) -> torch.Tensor:
    _, height, width = photo.shape
    travel = MAX_SPEED * (frames - 1)
    dy, dx = _randint(-MAX_SPEED, MAX_SPEED, generator), _randint(-MAX_SPEED, MAX_SPEED, generator)
    # Start where the whole path stays inside the photo.
    top = _randint(travel if dy < 0 else 0, height - size - (travel if dy > 0 else 0), generator)
    left = _randint(travel if dx < 0 else 0, width - size - (travel if dx > 0 else 0), generator)
    rows = [slice(top + f * dy, top + f * dy + size) for f in range(frames)]
    cols = [slice(left + f * dx, left + f * dx + size) for f in range(frames)]
    return torch.stack([photo[:, r, c] for r, c in zip(rows, cols, strict=True)], dim=1)


def _zoom(photo: torch.Tensor, frames: int, size: int, generator: torch.Generator) -> torch.Tensor:
    _, height, width = photo.shape
    largest = min(2 * size, height, width)
    sides = torch.linspace(largest, size, frames).round().int().tolist()
    if bool(torch.randint(2, (1,), generator=generator)):
        sides.reverse()  # zoom out instead of in
    centre_y = _randint(largest // 2, height - (largest + 1) // 2, generator)
    centre_x = _randint(largest // 2, width - (largest + 1) // 2, generator)
    windows = []
    for side in sides:
        top, left = centre_y - side // 2, centre_x - side // 2
        window = photo[None, :, top : top + side, left : left + side]
        windows.append(torch.nn.functional.interpolate(window, size=(size, size), mode="bilinear", antialias=True)[0])
    return torch.stack(windows, dim=1)


def _object(
    photo: torch.Tensor, other: torch.Tensor, frames: int, size: int, generator: torch.Generator
) -> torch.Tensor:
    background = _pan(photo, 1, size, generator)[:, 0]
    side = size // 2
    patch = _pan(other, 1, side, generator)[:, 0]
    y0, x0 = _randint(0, size - side, generator), _randint(0, size - side, generator)
    y1, x1 = _randint(0, size - side, generator), _randint(0, size - side, generator)
    clip = background[:, None].repeat(1, frames, 1, 1)
    for f in range(frames):
        y = y0 + round((y1 - y0) * f / max(1, frames - 1))
        x = x0 + round((x1 - x0) * f / max(1, frames - 1))
        clip[:, f, y : y + side, x : x + side] = patch
    return clip


def clip_from_photo(
    photo: torch.Tensor,
    motion: str,
    frames: int,
    size: int,
    generator: torch.Generator,
    other: torch.Tensor | None = None,
) -> torch.Tensor:
    """One clip `[3, frames, size, size]` of `photo` ([3, H, W]) with the given motion (see `MOTIONS`).

    `other` is the photo the moving object is cut from (`"object"` only; `photo` itself when None).

    Example:
        >>> photo = load_photo("camera")
        >>> clip_from_photo(photo, "zoom", 5, 32, torch.Generator().manual_seed(0)).shape
        torch.Size([3, 5, 32, 32])
    """
    if motion == "pan":
        return _pan(photo, frames, size, generator)
    if motion == "zoom":
        return _zoom(photo, frames, size, generator)
    if motion == "object":
        return _object(photo, photo if other is None else other, frames, size, generator)
    raise ValueError(f"Expected motion among {MOTIONS}, but got {motion!r}.")


def random_clips(
    photos: list[torch.Tensor], batch: int, frames: int, size: int, generator: torch.Generator
) -> torch.Tensor:
    """`batch` training clips `[batch, 3, frames, size, size]`: a photo, a motion and its path drawn uniformly,
    mirrored left-right half of the time."""
    clips = []
    for _ in range(batch):
        photo = photos[_randint(0, len(photos) - 1, generator)]
        other = photos[_randint(0, len(photos) - 1, generator)]
        motion = MOTIONS[_randint(0, len(MOTIONS) - 1, generator)]
        clip = clip_from_photo(photo, motion, frames, size, generator, other)
        if bool(torch.randint(2, (1,), generator=generator)):
            clip = clip.flip(-1)
        clips.append(clip)
    return torch.stack(clips)


def heldout_clips(frames: int = CLIP_FRAMES, size: int = CLIP_SIZE, per_image: int = 1, seed: int = 0) -> torch.Tensor:
    """Clips of the held-out photos: `per_image` of each motion for each photo, paths drawn from `seed`.

    Returns `[len(HELDOUT_IMAGES) * len(MOTIONS) * per_image, 3, frames, size, size]`; a moving object is cut
    from the next held-out photo, so no clip shows a training photo.

    Example:
        >>> heldout_clips(frames=4, size=32, per_image=2).shape
        torch.Size([18, 3, 4, 32, 32])
    """
    generator = torch.Generator().manual_seed(seed)
    photos = [load_photo(name) for name in HELDOUT_IMAGES]
    clips = []
    for index, photo in enumerate(photos):
        other = photos[(index + 1) % len(photos)]
        for motion in MOTIONS:
            for _ in range(per_image):
                clips.append(clip_from_photo(photo, motion, frames, size, generator, other))
    return torch.stack(clips)
