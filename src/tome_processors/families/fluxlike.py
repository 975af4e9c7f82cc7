"""FLUX-like successors: Krea 2, FLUX.3 and LongCat-Image, their grids read from rotary ids as FLUX.1's.

- `Krea2Transformer2DModel` (Krea 2): single-stream blocks only, over the text then the image tokens, with one
  `position_ids` table for both (the text's rows first) and a key-padding mask over the text.
- `Flux3Transformer2DModel` (FLUX.3): per-mode blocks, each mode attending within itself (the image's are merged;
  the text's and the reference image's are not), then single-stream blocks over text, image and reference tokens.
- `LongCatImageTransformer2DModel` (LongCat-Image and -Edit): FLUX.1's double- then single-stream blocks; its
  image ids start at row and column 512, after the text's; Edit appends its reference image after the image.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import Flux3Transformer2DModel, Krea2Transformer2DModel, LongCatImageTransformer2DModel

from ..arguments import argument
from .base import Layout, Span, Stack
from .flux import FluxFamily, IdsGridFamily


class Krea2Family(IdsGridFamily):
    """`Krea2Transformer2DModel`: one list of single-stream blocks over `[text, image]`.

    Its attention passes `(mask, rotary)` to the processor; the rotary tables come from `position_ids`, one row
    per text token (all zeros) then one per image token (`(0, row, column)`): the grid is read from the last rows
    (`image_ids`). The mask is the prompt's key-padding mask with every image token valid (`masks_text_only`).
    """

    name = "krea2"
    model_class = Krea2Transformer2DModel
    stacks = (Stack("transformer_blocks", Layout.TEXT_FIRST, span=Span.TRAILING, mask_at=0, rotary_at=1),)
    timestep_position = 2  # forward(hidden_states, encoder_hidden_states, timestep, position_ids, mask): 0..1
    ids_position = 3
    ids_name = "position_ids"
    masks_text_only = True  # Krea2Pipeline's mask: the prompt template's padding, the image all valid
    # The Qwen-Image VAE (8 px a latent pixel); `Krea2Pipeline(patch_size=2)` packs 2 x 2 latent pixels a token.
    vae_scale_factor = 8
    pipeline_patch = 2
    defaults: dict[str, Any] = dict(FluxFamily.defaults)
    presets: dict[str, dict[str, Any]] = FluxFamily.presets  # borrowed from FLUX.1; not measured on this model

    def image_ids(self, ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """The last `num_tokens` rows of `position_ids`: the image's, after the text's."""
        return super().image_ids(ids, num_tokens)[-num_tokens:]


class Flux3Family(IdsGridFamily):
    """`Flux3Transformer2DModel`: per-mode blocks, then single-stream blocks over `[text, image, reference]`.

    The image's per-mode blocks (`mode_blocks["image"]`) attend over the image tokens alone, with rotary tables
    from `img_ids` over them alone: they are declared `Layout.IMAGE_FIRST` with nothing after the image, so merged
    rows keep their tokens' rotations. The text's (`txt_mode_blocks`) and the reference image's per-mode blocks
    hold no tokens of the grid and are not wrapped. The single-stream blocks get the image tokens, then any
    reference image's (`image_cond_hidden_states`), as their input and concatenate the text ahead of them inside:
    the reference tokens are the model's tail (`trailing_tokens`), passed through unmerged.

    `img_ids` `(t, h, w, l)` number the image's rows and columns as FLUX.2's pipelines build them.
    """

    name = "flux3"
    model_class = Flux3Transformer2DModel
    stacks = (
        Stack("mode_blocks.image", Layout.IMAGE_FIRST, feed_forward="ff", mask_at=0, rotary_at=1),
        Stack("single_transformer_blocks", Layout.TEXT_FIRST, span=Span.LEADING, mask_at=0, rotary_at=1),
    )
    timestep_position = 2  # forward(hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids, ...): 0..1
    ids_position = 3
    cond_position = 5  # image_cond_hidden_states
    # No pipeline in diffusers yet: FLUX.2's VAE and packing (its 128 input channels: 32 latent channels x 2 x 2).
    vae_scale_factor = 8
    pipeline_patch = 2
    defaults: dict[str, Any] = dict(FluxFamily.defaults)
    presets: dict[str, dict[str, Any]] = FluxFamily.presets  # borrowed from FLUX.1; not measured on this model

    def trailing_tokens(self, args: tuple, kwargs: dict, grid: tuple[int, ...]) -> int:
        """The reference image's tokens, which follow the image's in the single-stream blocks."""
        cond = argument(args, kwargs, self.cond_position, "image_cond_hidden_states")
        return int(cond.shape[1]) if isinstance(cond, torch.Tensor) and cond.ndim == 3 else 0


class LongCatImageFamily(IdsGridFamily):
    """`LongCatImageTransformer2DModel`: FLUX.1's double-stream (joint) then single-stream (text first) blocks.

    Its pipelines number the image's rows and columns from 512 (after the text's positions), with time
    coordinate 1; LongCat-Image-Edit appends its reference image's tokens, at time coordinate 2, after the
    generated image's: only the generated image's are merged (`reference_tail`), in both block lists, whose
    input is the image tokens then the reference's (the single-stream blocks put the text ahead inside).
    """

    name = "longcat_image"
    model_class = LongCatImageTransformer2DModel
    stacks = (
        Stack("transformer_blocks", Layout.JOINT, feed_forward="ff", span=Span.LEADING),
        Stack("single_transformer_blocks", Layout.TEXT_FIRST, span=Span.LEADING),
    )
    timestep_position = 2  # forward(hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids): t / 1000
    ids_position = 3
    reference_tail = True
    generated_time = 1.0
    defaults: dict[str, Any] = dict(FluxFamily.defaults)
    presets: dict[str, dict[str, Any]] = FluxFamily.presets  # borrowed from FLUX.1; not measured on this model
