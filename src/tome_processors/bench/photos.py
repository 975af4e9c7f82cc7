"""The photos bundled with scikit-image that the shipped denoisers train and are measured on, split by photo.

Example:
    >>> load_photo("chelsea").shape
    torch.Size([3, 256, 385])
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["HELDOUT_IMAGES", "SHORT_SIDE", "TRAIN_IMAGES", "heldout_crops", "load_photo"]

# The split is by whole photo: no crop of a held-out photo is ever seen in training.
# `cat` is the same photo as `chelsea`, so it is in neither list.
TRAIN_IMAGES: tuple[str, ...] = (
    "astronaut",
    "coffee",
    "immunohistochemistry",
    "hubble_deep_field",
    "retina",
    "stereo_motorcycle",
    "brick",
    "grass",
    "gravel",
    "moon",
    "coins",
    "clock",
    "cell",
    "page",
    "text",
)
HELDOUT_IMAGES: tuple[str, ...] = ("chelsea", "rocket", "camera")

SHORT_SIDE = 256
"""Photos are downscaled (anti-aliased) so that their shorter side is at most this many pixels."""


def load_photo(name: str, short_side: int = SHORT_SIDE) -> torch.Tensor:
    """A scikit-image sample photo as a float tensor of shape [3, H, W] in [-1, 1].

    Grayscale photos are repeated on the three channels; photos whose shorter side is above
    `short_side` are downscaled (anti-aliased) so that it equals `short_side`.

    Example:
        >>> load_photo("chelsea").shape
        torch.Size([3, 256, 385])
    """
    import skimage.data
    from skimage.transform import rescale

    image = getattr(skimage.data, name)()
    if isinstance(image, tuple):  # stereo_motorcycle: (left, right, disparity)
        image = image[0]
    image = np.asarray(image, dtype=np.float64) / 255.0
    if image.ndim == 2:
        image = np.repeat(image[:, :, None], 3, axis=2)
    image = image[:, :, :3]
    scale = short_side / min(image.shape[:2])
    if scale < 1.0:
        image = rescale(image, scale, anti_aliasing=True, channel_axis=2, order=1)
    tensor = torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1))).float()
    return tensor.clamp(0.0, 1.0) * 2.0 - 1.0


def heldout_crops(size: int = 64, per_image: int = 2, seed: int = 0) -> torch.Tensor:
    """`per_image` crops of `size` x `size` from each held-out photo, at positions drawn from `seed`.

    Returns a tensor of shape [len(HELDOUT_IMAGES) * per_image, 3, size, size] in [-1, 1].

    Example:
        >>> heldout_crops().shape
        torch.Size([6, 3, 64, 64])
    """
    generator = torch.Generator().manual_seed(seed)
    crops = []
    for name in HELDOUT_IMAGES:
        photo = load_photo(name)
        _, height, width = photo.shape
        for _ in range(per_image):
            top = int(torch.randint(height - size + 1, (1,), generator=generator))
            left = int(torch.randint(width - size + 1, (1,), generator=generator))
            crops.append(photo[:, top : top + size, left : left + size])
    return torch.stack(crops)
