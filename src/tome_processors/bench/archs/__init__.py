"""The bench's architectures declared one module each: a model class, its published and tiny configs, and inputs
made as its pipeline calls the model (`Arch`).

`bench.dit` reads `ARCHS` beside its own table, so `tome-processors bench --arch NAME` (and `--quick`, `--layers`)
runs every architecture declared here. A module of this package declares `ARCHS`, a tuple of `Arch`; every module
is read, in name order.

Example:
    >>> from tome_processors.bench.archs import Arch, LatentShape
    >>> shape = LatentShape(batch=1, frames=1, height=4, width=6, text_tokens=3)
    >>> shape.tokens(patch=2)
    6
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["ARCHS", "Arch", "ArchInputs", "LatentShape", "VideoClip", "centred_region"]


@dataclass(frozen=True)
class LatentShape:
    """What one forward gets: `batch` samples of a latent of `frames x height x width` latent pixels (the image or
    clip over the VAE's strides), and `text_tokens` of prompt."""

    batch: int
    frames: int
    height: int
    width: int
    text_tokens: int

    def tokens(self, patch: int = 1, patch_t: int = 1) -> int:
        """Image tokens per sample at a patch of `patch` latent pixels (and `patch_t` latent frames)."""
        return (self.frames // patch_t) * (self.height // patch) * (self.width // patch)


@dataclass(frozen=True)
class ArchInputs:
    """What an `Arch.inputs` function gets: the model, the shape, and a seeded `randn` on the device and dtype."""

    model: torch.nn.Module
    shape: LatentShape
    randn: Callable[..., torch.Tensor]
    device: torch.device | str
    dtype: torch.dtype
    quick: bool

    @property
    def config(self) -> Any:
        return self.model.config


@dataclass(frozen=True)
class VideoClip:
    """A video architecture's clip when none is given, and its VAE's strides."""

    height: int
    width: int
    frames: int
    time_stride: int = 4
    space_stride: int = 8


@dataclass(frozen=True)
class Arch:
    """One architecture of `tome-processors bench --arch NAME`.

    Attributes:
        name: the `--arch` name (usually the family's).
        model_class: the diffusers model class.
        full: the published transformer config (the real width and depth).
        quick: a tiny config of the same block structure (`--quick`, the tests).
        text_tokens: the prompt tokens the family's pipeline passes (padded length, or a long prompt's).
        inputs: keyword inputs of one forward, as the pipeline calls the model (`ArchInputs` -> kwargs).
        video: the clip and strides of a video architecture; None for an image one (8 pixels per latent pixel).
        depth_fields: the config fields that set the depth (`--layers` caps each).
        space_stride: pixels per latent pixel of an image architecture's VAE.
        derived: the config the model is built with from the declared one (`full` or `quick`, its depth capped):
            fields that follow others (HiDream's `llama_layers`, one per block); None: as declared.
    """

    name: str
    model_class: type
    full: dict[str, Any]
    quick: dict[str, Any]
    text_tokens: int
    inputs: Callable[[ArchInputs], dict[str, Any]]
    video: VideoClip | None = None
    depth_fields: tuple[str, ...] = ("num_layers", "num_single_layers")
    space_stride: int = 8
    derived: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    notes: str = field(default="", compare=False)


def centred_region(grid: tuple[int, int], base_w: int, base_h: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Where the pipeline places a `grid` of `(h, w)` tokens on the model's base grid of `base_h x base_w` before it
    makes the rotary positions: scaled to touch the base grid on its tighter side, centred; `((top, left), (bottom,
    right))` (as the CogVideoX and Hunyuan-DiT pipelines place it; made here, so that the bench imports no pipeline
    module).

    Example:
        >>> centred_region((30, 45), 90, 60)
        ((0, 0), (60, 90))
    """
    h, w = grid
    if h / w > base_h / base_w:  # taller than the base grid: its height fills it
        height, width = base_h, int(round(base_h / h * w))
    else:
        height, width = int(round(base_w / w * h)), base_w
    top, left = int(round((base_h - height) / 2.0)), int(round((base_w - width) / 2.0))
    return (top, left), (top + height, left + width)


def _declared() -> dict[str, Arch]:
    archs: dict[str, Arch] = {}
    for module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        for arch in importlib.import_module(f"{__name__}.{module.name}").ARCHS:
            if arch.name in archs:
                raise ValueError(f"Expected one declaration per bench architecture, but got {arch.name!r} twice.")
            archs[arch.name] = arch
    return archs


#: Every architecture declared in this package, by name.
ARCHS: dict[str, Arch] = _declared()
