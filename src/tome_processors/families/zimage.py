"""Z-Image: single-stream blocks over the image tokens, then over the image followed by the text."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import ZImageTransformer2DModel
from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor

from ..arguments import argument
from .base import Family, Layout, Rotary, Span, Stack
from .flux import FluxFamily


class ZImageFamily(Family):
    """`ZImageTransformer2DModel`: the noise refiner's blocks (image tokens and their padding), then the main
    layers (image, its padding, the caption).

    The caption refiner attends over text alone and is left as it is. The model takes a list of latents
    `(C, F, H, W)`, one per sample, patchified at `patch_size` (2 unless given); the unified sequence opens
    with the image's tokens (`Layout.IMAGE_FIRST`). Rotary tables come per sample, `(B, S, D/2)` complex,
    as `freqs_cis`; the mask, where prompts differ in length, masks caption padding only. The model takes
    `t` in 0..1 rising towards the clean image (the pipeline passes `(1000 - t) / 1000`).
    """

    name = "zimage"
    pipeline_patch = 2  # its model patchifies 2 x 2 latent pixels (`patch_size` is a forward argument)
    built_with = ZSingleStreamAttnProcessor
    model_class = ZImageTransformer2DModel
    stacks = (
        Stack("noise_refiner", Layout.IMAGE_FIRST, "attention", "feed_forward", Span.LEADING),
        Stack("layers", Layout.IMAGE_FIRST, "attention", "feed_forward", Span.LEADING),
    )
    needs_row_token = True
    rotary = Rotary(name="freqs_cis", position=2, covers_text=True, batched=True)
    masks_text_only = True
    input_name = "x"
    timestep_position = 1
    merge_only = True
    defaults: dict[str, Any] = dict(FluxFamily.defaults)
    presets: dict[str, dict[str, Any]] = FluxFamily.presets

    def token_grid(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int] | None:
        x = argument(args, kwargs, 0, "x")
        first = x[0] if isinstance(x, (list, tuple)) and x else x
        if not isinstance(first, torch.Tensor) or first.ndim != 4:  # omni mode passes lists of lists
            return None
        patch = int(argument(args, kwargs, 7, "patch_size") or 2)
        f_patch = int(argument(args, kwargs, 8, "f_patch_size") or 1)
        frames, h, w = first.shape[1] // f_patch, first.shape[2] // patch, first.shape[3] // patch
        return (h, w) if frames == 1 and h * w > 0 else None

    def timestep(self, args: tuple, kwargs: dict) -> object:
        """The noise level on the 0..1000 scale: `(1 - t) * 1000` of the model's `t`."""
        t = argument(args, kwargs, self.timestep_position, "t")
        return None if t is None else (1 - t) * 1000.0
