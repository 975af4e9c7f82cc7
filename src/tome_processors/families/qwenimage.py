"""Qwen-Image (and Qwen-Image-Edit): double-stream blocks, the grid from `img_shapes`."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import QwenImageTransformer2DModel
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0

from ..arguments import argument
from .base import Family, Layout, Rotary, Span, Stack
from .flux import FluxFamily


class QwenImageFamily(Family):
    """`QwenImageTransformer2DModel`: double-stream (joint) blocks only.

    The grid is the first shape of `img_shapes` (`[(frames, rows, columns), ...]` per sample, as the
    pipelines pass it). Qwen-Image-Edit appends the reference image's tokens after the generated image's
    (further shapes): they form a grid of their own and are never merged with the generated image's;
    they pass through as rows of their own (`TokenMerge.with_tail_rows`). The rotary tables come as
    `(image, text)`, complex, the image's over all image tokens: merged rows gather the image's.
    """

    guidance_in_batch = False  # called once per guidance branch, at batch 1

    name = "qwenimage"
    pipeline_patch = 2  # its pipelines pack 2 x 2 latent pixels into one token
    built_with = QwenDoubleStreamAttnProcessor2_0
    model_class = QwenImageTransformer2DModel
    stacks = (Stack("transformer_blocks", Layout.JOINT, feed_forward="img_mlp", span=Span.LEADING),)
    needs_row_token = True
    rotary = Rotary(covers_text=False)
    timestep_position = 3
    timestep_scale = 1000.0  # the pipelines pass timestep / 1000
    merge_only = True
    defaults: dict[str, Any] = dict(FluxFamily.defaults)
    presets: dict[str, dict[str, Any]] = FluxFamily.presets

    def token_grid(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int] | None:
        x = argument(args, kwargs, 0, "hidden_states")
        shapes = argument(args, kwargs, 4, "img_shapes")
        if not isinstance(x, torch.Tensor) or x.ndim != 3 or not shapes:
            return None
        first = shapes[0]  # the first sample's shapes (the model's rotary tables use them for every sample)
        if isinstance(first, list):
            first = first[0] if first else None
        if not isinstance(first, (tuple, list)) or len(first) != 3:
            return None
        frames, h, w = (int(v) for v in first)
        return (h, w) if frames == 1 and 0 < h * w <= x.shape[1] else None
