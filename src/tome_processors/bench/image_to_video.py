"""The image side of Wan2.1's image-to-video pipeline for `tome-processors bench --pipeline --arch wan-i2v`.

`WanImageToVideoPipeline` is `WanPipeline`'s components (`video_pipelines.py`) plus a CLIP vision encoder
and its image processor: the pipeline encodes the first frame into the penultimate layer's tokens (ViT-H/14
at 224 px: 16 x 16 patches and the class token, 257 tokens 1280 wide), which every block's cross-attention
reads beside the 512 text tokens, and also encodes the frame with the VAE into the latent's condition
channels. Random weights, as everywhere in the bench; each generation starts from the same first frame, a
bundled photo (`photos.load_photo`, scikit-image's) cropped to the clip's aspect and resized to it.

Example:
    >>> encoder = clip_vision_encoder(quick=True, small=False, width=16)
    >>> encoder.config.hidden_size, image_tokens(encoder)
    (16, 5)
    >>> first_frame(64, 96).size
    (96, 64)
"""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any

import diffusers
import torch
import transformers
from PIL import Image
from transformers import CLIPVisionConfig, CLIPVisionModel

from .photos import load_photo
from .pipelines import SMALL_TEXT_LAYERS

__all__ = [
    "CLIP_VIT_H",
    "FIRST_FRAME_PHOTO",
    "clip_image_processor",
    "clip_vision_encoder",
    "first_frame",
    "image_tokens",
    "missing_requirements",
]

#: CLIP ViT-H/14's vision tower (laion/CLIP-ViT-H-14, Wan2.1 I2V's `image_encoder`): 32 layers, 1280 wide.
CLIP_VIT_H = dict(
    hidden_size=1280,
    intermediate_size=5120,
    num_hidden_layers=32,
    num_attention_heads=16,
    image_size=224,
    patch_size=14,
    hidden_act="gelu",
    projection_dim=1024,
)
#: The tiny tower of `--quick`: 32 px images in 16 px patches, 4 patch tokens and the class token.
_TINY_SIDE, _TINY_PATCH = 32, 16
#: The photo every generation starts from.
FIRST_FRAME_PHOTO = "chelsea"


def clip_vision_encoder(quick: bool, small: bool, width: int) -> CLIPVisionModel:
    """CLIP ViT-H/14's vision tower, random weights: `quick` a tiny one `width` wide (the `--quick`
    transformer's `image_dim`), `small` the real width with `SMALL_TEXT_LAYERS` layers (`--text-encoders small`
    shortens every encoder), else the real shape (632 M parameters)."""
    shape: dict[str, Any] = dict(CLIP_VIT_H)
    if quick:
        shape.update(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2, num_attention_heads=2,
                     image_size=_TINY_SIDE, patch_size=_TINY_PATCH, projection_dim=width)  # fmt: skip
    elif small:
        shape["num_hidden_layers"] = SMALL_TEXT_LAYERS
    return CLIPVisionModel(CLIPVisionConfig(**shape)).eval()


def image_tokens(encoder: CLIPVisionModel) -> int:
    """The tokens `encoder` gives an image: its patches and the class token (257 for ViT-H/14 at 224 px)."""
    return (encoder.config.image_size // encoder.config.patch_size) ** 2 + 1


def clip_image_processor(quick: bool) -> transformers.CLIPImageProcessor:
    """CLIP's image processor at the encoder's side: 224 px (CLIP's defaults), or the tiny tower's 32."""
    side = _TINY_SIDE if quick else CLIP_VIT_H["image_size"]
    with warnings.catch_warnings():  # without torchvision it falls back to the PIL processor, and says so
        warnings.simplefilter("ignore")
        # looked up here: without torchvision, transformers warns as soon as the class is resolved
        return transformers.CLIPImageProcessor(crop_size=side, size={"shortest_edge": side})


def first_frame(height: int, width: int, photo: str = FIRST_FRAME_PHOTO) -> Image.Image:
    """The clip's first frame: `photo` centre-cropped to the clip's aspect and resized to `width x height`.

    Example:
        >>> first_frame(480, 832).size
        (832, 480)
    """
    pixels = (load_photo(photo) + 1.0) / 2.0  # [3, H, W] in [0, 1]
    _, rows, cols = pixels.shape
    if rows * width > cols * height:  # too tall for the clip: keep the middle rows
        keep = cols * height // width
        pixels = pixels[:, (rows - keep) // 2 : (rows - keep) // 2 + keep]
    else:
        keep = rows * width // height
        pixels = pixels[:, :, (cols - keep) // 2 : (cols - keep) // 2 + keep]
    resized = torch.nn.functional.interpolate(pixels[None], size=(height, width), mode="bilinear", antialias=True)
    array = (resized[0].clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()
    return Image.fromarray(array)


def missing_requirements() -> list[str]:
    """What `--pipeline --arch wan-i2v` needs that is not installed: diffusers' `WanImageToVideoPipeline` cleans
    every prompt with `ftfy` (in diffusers 0.42.1 whether it is installed or not), the first frame is a
    scikit-image photo.

    Example:
        >>> set(missing_requirements()) <= {"ftfy", "scikit-image"}
        True
    """
    cleaning = diffusers.pipelines.wan.pipeline_wan_i2v  # diffusers' lazy modules load it on first access
    missing = [] if hasattr(cleaning, "ftfy") else ["ftfy"]
    return missing + ([] if importlib.util.find_spec("skimage") else ["scikit-image"])
