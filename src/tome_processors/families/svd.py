"""Stable Video Diffusion (`UNetSpatioTemporalConditionModel`): the spatial blocks merge, frame by frame.

SVD's `TransformerSpatioTemporalModel` holds two kinds of block: spatial `BasicTransformerBlock`s in
`transformer_blocks`, whose tokens are one frame's latent pixels (the batch is batch x frames), and
`TemporalBasicTransformerBlock`s in `temporal_transformer_blocks`, whose tokens are the frames of one
pixel. Only the spatial blocks merge (tomesd's windows inside each frame); the temporal blocks are
another class and never get a slot. The token grid is the last two sides of `sample`
`(batch, frames, channels, height, width)`; the rest (levels, presets' downsample) is the UNet's.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.transformers.transformer_temporal import TransformerSpatioTemporalModel

from .unet import UNetFamily
from .walk import modules_of


def spatio_temporal_blocks(model: torch.nn.Module) -> list[BasicTransformerBlock]:
    """The spatial `BasicTransformerBlock`s of every `TransformerSpatioTemporalModel` in `model`, in module order."""
    blocks: list[BasicTransformerBlock] = []
    for module in modules_of(model):
        if isinstance(module, TransformerSpatioTemporalModel):
            blocks.extend(b for b in module.transformer_blocks if isinstance(b, BasicTransformerBlock))
    return blocks


class SVDFamily(UNetFamily):
    """Stable Video Diffusion's `UNetSpatioTemporalConditionModel` (or any model with spatio-temporal transformers).

    Example:
        >>> from tome_processors.families import FAMILIES
        >>> FAMILIES["svd"]().preset_options("balanced")["mode"]
        'downsample_kv'
    """

    name = "svd"
    # Defaults and presets: the UNet's, frame by frame (measured on SVD's architecture: docs/options.md).

    def spatial_blocks(self, model: torch.nn.Module) -> list[BasicTransformerBlock]:
        return spatio_temporal_blocks(model)

    def check_config(self, model: torch.nn.Module, config: Any) -> None:
        super().check_config(model, config)
        # SVD's scheduler passes 0.25 * log(sigma) (about -1.6 to 1.7), not a 0..1000 timestep.
        if config.ratio_start is not None:
            raise ValueError(
                f"Expected ratio_start=None on {type(model).__name__} (its timesteps are 0.25 * log(sigma), "
                f"not on the 0..1000 scale ratio_start follows), but got ratio_start={config.ratio_start!r}."
            )
