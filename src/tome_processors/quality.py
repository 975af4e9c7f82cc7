"""Quality of a merging method on a small denoiser trained here, measured offline on held-out photos.

Random-weight UNets have no natural token redundancy, so how much a method changes their output says
little about how much it would change a trained model's. This module ships a small pixel-space DDPM
denoiser with the Stable Diffusion UNet structure (trained by `scripts/train_denoiser.py` on photos
bundled with scikit-image) and measures, on crops of photos it never saw:

- the PSNR of its x0 prediction at a few noise levels, with and without a method applied, and
- the relative change of its noise prediction against the unmerged model,
  `||eps_method - eps_base|| / ||eps_base||`.

Example:
    >>> from tome_processors import apply_tome, remove_tome
    >>> from tome_processors.quality import QualityProbe
    >>> probe = QualityProbe.default()
    >>> row = probe.measure(lambda unet: apply_tome(unet, ratio=0.5), remove_tome)
    >>> sorted(row)[:3]
    ['eps_rel_change', 'eps_rel_change_t100', 'eps_rel_change_t300']
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path

import numpy as np
import torch

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

CONTEXT_TOKENS = 8
CONTEXT_SEED = 1234
DEFAULT_TIMESTEPS: tuple[int, ...] = (100, 300, 500, 700)


def denoiser_path() -> Path:
    """The folder of the shipped denoiser (`config.json`, `diffusion_pytorch_model.safetensors`)."""
    return Path(str(resources.files("tome_processors") / "data" / "denoiser"))


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


def context_embedding(batch: int = 1, dim: int = 32) -> torch.Tensor:
    """The fixed conditioning the denoiser is trained and measured with: [batch, 8, dim].

    The denoiser is unconditional in spirit; cross-attention still needs keys and values, so every
    sample gets the same 8 tokens drawn once from `CONTEXT_SEED`. Cross-attention then learns a
    position-dependent use of a constant context, as an SD UNet does with an empty prompt.

    Example:
        >>> context_embedding(2).shape
        torch.Size([2, 8, 32])
    """
    generator = torch.Generator().manual_seed(CONTEXT_SEED)
    tokens = torch.randn(1, CONTEXT_TOKENS, dim, generator=generator)
    return tokens.expand(batch, -1, -1).contiguous()
