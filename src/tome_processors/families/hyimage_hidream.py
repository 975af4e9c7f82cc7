"""HunyuanImage 2.1 and HiDream-I1: double-stream then single-stream blocks whose attention opens with the image
tokens and closes with the text."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import HiDreamImageTransformer2DModel, HunyuanImageTransformer2DModel
from diffusers.models.transformers.transformer_hidream_image import HiDreamAttnProcessor
from diffusers.models.transformers.transformer_hunyuanimage import HunyuanImageAttnProcessor

from ..arguments import argument
from .base import Family, Layout, Rotary, Span, Stack
from .flux import FluxFamily


class HunyuanImageFamily(Family):
    """`HunyuanImageTransformer2DModel` (HunyuanImage 2.1, its distilled model and its refiner): the double-stream
    blocks (`transformer_blocks`), then the single-stream blocks (`single_transformer_blocks`).

    HunyuanVideo's layout on an image: every block calls its attention with the image tokens as `hidden_states`
    and the text (the Qwen2.5-VL tokens, then ByT5's glyph tokens where the model has them, valid ones first) as
    `encoder_hidden_states`; the processor attends over the image then the text and returns `(image, text)`
    (`Layout.JOINT_IMAGE_FIRST`), so only image tokens are merged. The token refiner (`context_embedder`) attends
    over the text alone and is left as it is. Rotary tables `(cos, sin)`, each `(N_image, D)`, cover the image
    alone. The model's mask is ones over the image, then the text's padding: it is cut to the merged sequence.
    The grid is the 4-D latent over `patch_size` (`(1, 1)` in the released model, on 64 latent channels), or the
    refiner's 5-D latent of one frame over `(1, 1, 1)`; the pipelines pass the timestep on the 0..1000 scale and
    run guidance as one call per branch. `merge_mlp` merges the double-stream blocks' feed-forward (`ff`); the
    single-stream blocks' MLP runs on image and text together and is not merged.
    """

    guidance_in_batch = False  # its guider calls the model once per branch, at batch 1

    name = "hunyuanimage"
    vae_scale_factor = 32  # HunyuanImage 2.1's VAE (its refiner's is 16: the refiner pipeline's own factor wins)
    model_class = HunyuanImageTransformer2DModel
    stacks = (
        Stack("transformer_blocks", Layout.JOINT_IMAGE_FIRST, feed_forward="ff", built_with=HunyuanImageAttnProcessor),
        Stack("single_transformer_blocks", Layout.JOINT_IMAGE_FIRST, built_with=HunyuanImageAttnProcessor),
    )
    needs_row_token = True
    rotary = Rotary(name="image_rotary_emb", position=2, covers_text=False, text_table=False)
    masks_text_only = True  # the model's own mask: ones over the image, then the prompt's padding
    timestep_position = 1
    merge_only = True  # joint attention computes keys and values inside the processor
    # FLUX.1's presets: a joint text-image transformer with rotary positions, as FLUX.1 is; borrowed, not measured
    # on HunyuanImage.
    defaults: dict[str, Any] = dict(FluxFamily.defaults)
    presets: dict[str, dict[str, Any]] = FluxFamily.presets

    def token_grid(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int] | None:
        x = argument(args, kwargs, self.input_position, self.input_name)
        patch = tuple(int(p) for p in model.config.patch_size)
        if not isinstance(x, torch.Tensor) or x.ndim != 2 + len(patch):
            return None
        sizes = [int(size) // p for size, p in zip(x.shape[2:], patch, strict=True)]
        if len(sizes) == 3 and sizes.pop(0) != 1:  # the refiner's latent: one frame
            return None
        return sizes[0], sizes[1]


#: How HiDream's attention passes its processor the mask: by keyword, `hidden_states_masks` (first after
#: `hidden_states` in the processor's signature).
_HIDREAM_MASK = (0, "hidden_states_masks")


class HiDreamImageFamily(Family):
    """`HiDreamImageTransformer2DModel` (HiDream-I1 Full, Dev, Fast): the double-stream blocks
    (`double_stream_blocks`), then the single-stream blocks (`single_stream_blocks`).

    Each list holds `HiDreamBlock` wrappers; the block inside (`.block`) holds the attention (`attn1`) and the
    mixture-of-experts feed-forward over the image tokens (`ff_i`). The double-stream attention gets the image
    tokens and the text (T5's, the last Llama layer's, and a fresh Llama layer's in every block) apart and attends
    over the image then the text (`Layout.JOINT_IMAGE_FIRST`); the single-stream blocks get one sequence, the image
    tokens first (`Layout.IMAGE_FIRST`), the fresh Llama tokens appended in every block. Only the grid's tokens are
    merged; everything after them passes through as rows of its own (`Span.LEADING`).

    Rotary tables: one per sample, `(B, S, 1, D/2, 2, 2)`, FLUX-style ids over the whole sequence, the image's
    then the text's (all at position 0): merged rows take their kept token's row, the text keeps its own
    (`Rotary(covers_text=True, batched=True)`).

    A non-square latent is patchified into `max_resolution`'s token count: the grid's `h * w` tokens, then padding,
    and a mask (`hidden_states_masks`, multiplied into the keys) ones over the grid, zeros over the padding (and
    ones over the text in the single-stream blocks). Every grid token is a valid key, and the padding passes as
    rows of its own, so the mask is cut at its start by the tokens the merge removes (`masks_text_only`). A square
    latent has neither padding nor mask.

    The grid is the 4-D latent over `patch_size` (2); a patchified input (`(B, N, C)` with `img_sizes`) gives
    none and is left unmerged. The pipeline passes `timesteps` on the 0..1000 scale, both halves of its
    classifier-free guidance in one batch. `merge_mlp` merges `ff_i` in both kinds of block (the single-stream
    one runs on the whole sequence: the text passes through as rows of its own).
    """

    name = "hidream"
    model_class = HiDreamImageTransformer2DModel
    built_with = HiDreamAttnProcessor  # its `HiDreamAttention` subclasses `Attention` but is built with this one
    stacks = (
        Stack("double_stream_blocks", Layout.JOINT_IMAGE_FIRST, "block.attn1", "block.ff_i", Span.LEADING,
              mask_at=_HIDREAM_MASK),
        Stack("single_stream_blocks", Layout.IMAGE_FIRST, "block.attn1", "block.ff_i", Span.LEADING,
              mask_at=_HIDREAM_MASK),
    )  # fmt: skip
    needs_row_token = True
    rotary = Rotary(name="image_rotary_emb", position=2, covers_text=True, batched=True)
    masks_text_only = True  # the padding mask: every grid token a valid key (see the class doc)
    timestep_position = 1
    timestep_name = "timesteps"
    merge_only = True
    # FLUX.1's presets: a joint text-image transformer with FLUX-style rotary positions; borrowed, not measured on
    # HiDream.
    defaults: dict[str, Any] = dict(FluxFamily.defaults)
    presets: dict[str, dict[str, Any]] = FluxFamily.presets
