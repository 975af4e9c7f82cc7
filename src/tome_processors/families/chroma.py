"""Chroma and FLUX.2: FLUX.1-shaped (double-stream, then single-stream blocks; the grid from `img_ids`).

Unlike FLUX.1, their models concatenate text and image before the single-stream blocks, so those blocks'
input opens with the text (`Span.TRAILING`).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import ChromaTransformer2DModel, Flux2Transformer2DModel

from .._similarity import is_compiling
from ..arguments import argument
from .base import Layout, Span, Stack
from .flux import FluxFamily, IdsGridFamily

#: Double-stream blocks (image and text passed apart), then single-stream ones over the text and image.
_STACKS = (
    Stack("transformer_blocks", Layout.JOINT, feed_forward="ff"),
    Stack("single_transformer_blocks", Layout.TEXT_FIRST, span=Span.TRAILING),
)
#: FLUX.2's single-stream attention calls its processor with `(mask, rotary)` after `hidden_states`. Its
#: reference images' tokens follow the generated image's (the model's tail): after them in the double-stream
#: blocks' input, after text and generated image in the single-stream blocks'.
_FLUX2_STACKS = (
    Stack("transformer_blocks", Layout.JOINT, feed_forward="ff", span=Span.LEADING),
    Stack("single_transformer_blocks", Layout.TEXT_FIRST, span=Span.TRAILING, mask_at=0, rotary_at=1),
)


class ChromaFamily(IdsGridFamily):
    """`ChromaTransformer2DModel`: FLUX.1's blocks; its pipeline masks text padding (cut, not refused)."""

    name = "chroma"
    model_class = ChromaTransformer2DModel
    stacks = _STACKS
    timestep_position = 2
    ids_position = 3
    masks_text_only = True  # ChromaPipeline's mask: the prompt's padding, then ones for every image token
    defaults: dict[str, Any] = dict(FluxFamily.defaults)
    presets: dict[str, dict[str, Any]] = FluxFamily.presets


class Flux2Family(IdsGridFamily):
    """`Flux2Transformer2DModel`: FLUX.1's layout; the single-stream attention holds the block's MLP too.

    `img_ids` have four columns (time, row, column, layer); rows and columns are read as FLUX.1's. Given
    reference images (`Flux2Pipeline(image=...)`), the pipeline appends their tokens, at time coordinates of
    their own, after the generated image's: only the generated image's are merged (`reference_tail`).
    """

    name = "flux2"
    model_class = Flux2Transformer2DModel
    stacks = _FLUX2_STACKS
    timestep_position = 2
    ids_position = 3
    txt_ids_position = 4
    reference_tail = True
    defaults: dict[str, Any] = dict(FluxFamily.defaults)
    presets: dict[str, dict[str, Any]] = FluxFamily.presets

    def generation_marker(self, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """`txt_ids`, which the FLUX.2 pipelines make once per call (from the prompt's embeddings). Not `img_ids`:
        given reference images, the pipeline concatenates the image's ids and theirs anew at every step."""
        if is_compiling():
            return None
        ids = argument(args, kwargs, self.txt_ids_position, "txt_ids")
        return ids if isinstance(ids, torch.Tensor) else super().generation_marker(args, kwargs)
