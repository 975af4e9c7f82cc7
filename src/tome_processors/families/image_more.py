"""Bria, Bria Fibo, Bria Fibo 2, GLM-Image, Ideogram 4, Nucleus-MoE-Image, PRX and Ovis-Image: image transformers whose
attention sees the image tokens beside text (or text-like) tokens.

By layout:

- FLUX.1-shaped joint then single-stream blocks, the grid from `img_ids` (`IdsGridFamily`): Bria, Ovis-Image and
  Bria Fibo (whose single-stream blocks get the text and image already concatenated, and whose pipeline masks the
  text's padding).
- Image queries against image and text keys, one output (the image's): GLM-Image (text queries too, image rotary
  tables only, a KV cache of the condition images), Nucleus-MoE-Image (image then text keys) and PRX (text then image
  keys, one tensor of 2x2 rotations per token with a head axis first).
- Single-stream: Ideogram 4 (one packed `[padding; text; image]` sequence, the grid from `position_ids`) and
  Bria Fibo 2 (Z-Image's refiner over the image, then blocks over `[gist; image; context]`).

Every pipeline of these models masks text padding only (every image token a valid key): the masks are cut to the
merged sequence or, where the processor builds the image's part itself (GLM-Image, PRX), passed as they are.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from diffusers import (
    BriaFibo2Transformer2DModel,
    BriaFiboTransformer2DModel,
    BriaTransformer2DModel,
    GlmImageTransformer2DModel,
    Ideogram4Transformer2DModel,
    NucleusMoEImageTransformer2DModel,
    OvisImageTransformer2DModel,
    PRXTransformer2DModel,
)
from diffusers.models.transformers.transformer_bria import BriaAttnProcessor
from diffusers.models.transformers.transformer_bria_fibo2 import compute_gist_count
from diffusers.models.transformers.transformer_glm_image import GlmImageAttnProcessor
from diffusers.models.transformers.transformer_ideogram4 import IMAGE_POSITION_OFFSET
from diffusers.models.transformers.transformer_nucleusmoe_image import NucleusMoEAttnProcessor2_0

from .._similarity import is_compiling
from ..arguments import argument
from .base import Family, Layout, Rotary, Span, Stack
from .flux import FluxFamily, IdsGridFamily, grid_from_ids

#: FLUX.1's blocks: double-stream (image and text passed apart), then single-stream blocks that get the image tokens
#: and put the text ahead of them inside (Bria, Ovis-Image).
_FLUX_STACKS = (
    Stack("transformer_blocks", Layout.JOINT, feed_forward="ff"),
    Stack("single_transformer_blocks", Layout.TEXT_FIRST),
)

# Borrowed from FLUX.1 (joint text-image attention with rotary positions); not measured on these models.
_DEFAULTS: dict[str, Any] = dict(FluxFamily.defaults)
_PRESETS: dict[str, dict[str, Any]] = FluxFamily.presets


class BriaFamily(IdsGridFamily):
    """`BriaTransformer2DModel` (BRIA 3.x): FLUX.1's blocks and `img_ids`, no mask (its prompts are zero-padded).

    `BriaPipeline` passes the scheduler's 0..1000 timesteps and runs guidance as one batch of both halves.
    """

    name = "bria"
    model_class = BriaTransformer2DModel
    stacks = _FLUX_STACKS
    timestep_position = 3  # forward(hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, ...)
    ids_position = 4
    timestep_scale = 1.0
    guidance_in_batch = True
    # `BriaPipeline.vae_scale_factor` counts its 2 x 2 packing in (16: 8 px a latent pixel, 2 x 2 a token).
    vae_scale_factor = 16
    pipeline_patch = 1
    defaults = _DEFAULTS
    presets = _PRESETS


class OvisImageFamily(IdsGridFamily):
    """`OvisImageTransformer2DModel` (Ovis-Image): FLUX.1's blocks and `img_ids`; its pipeline passes `t / 1000` and
    calls the model once per guidance branch."""

    name = "ovis_image"
    model_class = OvisImageTransformer2DModel
    stacks = _FLUX_STACKS
    timestep_position = 2  # forward(hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids, ...)
    ids_position = 3
    defaults = _DEFAULTS
    presets = _PRESETS


class BriaFiboFamily(IdsGridFamily):
    """`BriaFiboTransformer2DModel` (Bria FIBO): FLUX.1-shaped blocks over one token per latent pixel of the Wan 2.2
    VAE (16 px), the grid from `img_ids`.

    The model concatenates the text ahead of the image before each single-stream block (`Span.TRAILING`), whose
    attention is an `Attention` built with Bria's processor. The pipeline passes a key-padding mask over
    `[text; image]` (the prompt's padding, every image token valid: `masks_text_only`), the scheduler's 0..1000
    timesteps, and guidance as one batch of both halves.
    """

    name = "bria_fibo"
    model_class = BriaFiboTransformer2DModel
    stacks = (
        Stack("transformer_blocks", Layout.JOINT, feed_forward="ff"),
        Stack("single_transformer_blocks", Layout.TEXT_FIRST, span=Span.TRAILING, built_with=BriaAttnProcessor),
    )
    timestep_position = 4  # forward(hidden_states, encoder_hidden_states, text_encoder_layers, pooled_projections, t
    ids_position = 5
    timestep_scale = 1.0
    guidance_in_batch = True
    masks_text_only = True
    vae_scale_factor = 16
    pipeline_patch = 1  # one token per latent pixel (the pipeline's default, `do_patching=False`)
    defaults = _DEFAULTS
    presets = _PRESETS


class Ideogram4Family(IdsGridFamily):
    """`Ideogram4Transformer2DModel` (Ideogram 4): single-stream blocks over one packed `[padding; text; image]`.

    The pipeline packs the (left-padded) prompt's slots and the image's tokens into one sequence, and numbers them in
    `position_ids` `(B, S, 3)`: the image's rows `(t, h, w)` from `IMAGE_POSITION_OFFSET`, after every text position.
    The grid is read from those trailing rows (`grid_of_image_ids`); the image closes the sequence
    (`Layout.TEXT_FIRST`, `Span.TRAILING`). The block-diagonal mask `(B, 1, S, S)` over the segments keeps padding
    apart from text and image; every image token sits in the sample's segment (`masks_text_only`). The rotary tables
    are `(cos, sin)` per sample over the whole sequence. The conditional and unconditional passes are two models
    (`unconditional_transformer` gets the image alone). The model's time runs from 0 (noise) to 1 (clean):
    `timestep()` turns it around.
    """

    name = "ideogram4"
    model_class = Ideogram4Transformer2DModel
    stacks = (
        Stack("layers", Layout.TEXT_FIRST, "attention", feed_forward="feed_forward", span=Span.TRAILING, mask_at=0),
    )
    rotary = Rotary(position=1, batched=True)
    timestep_position = 1  # forward(hidden_states, timestep, encoder_hidden_states, position_ids, segment_ids, ...)
    ids_position = 3
    ids_name = "position_ids"
    masks_text_only = True
    defaults = _DEFAULTS
    presets = _PRESETS

    def timestep(self, args: tuple, kwargs: dict) -> object:
        """The noise level on the 0..1000 scale: `(1 - t) * 1000` of the model's `t` (1 is the clean image)."""
        t = argument(args, kwargs, self.timestep_position, self.timestep_name)
        return None if t is None else (1 - t) * 1000.0

    def grid_of_image_ids(self, ids: torch.Tensor, num_tokens: int) -> tuple[int, int] | None:
        """The grid of the rows from `IMAGE_POSITION_OFFSET` on, where they close the sequence."""
        if ids.ndim != 2 or ids.shape[-1] != 3:
            return None
        image = ids[:, 0] >= IMAGE_POSITION_OFFSET
        count = int(image.sum())
        if count == 0 or not bool(image[num_tokens - count :].all()):
            return None
        return grid_from_ids(ids[num_tokens - count :], count)


class GlmImageFamily(Family):
    """`GlmImageTransformer2DModel` (GLM-Image): blocks whose attention (`attn1`) puts the text ahead of the image.

    The processor concatenates text and image, rotates the image's queries and keys only (`(cos, sin)` over the
    image: `Rotary(covers_text=False, text_table=False)`) and returns `(image, text)`. Its mask is over the text
    alone `(B, T)`; the processor adds the image's part itself, so it lines up with merged tokens as it is. Given
    condition images, the pipeline first runs the model on each (KV cache `write` mode: its merged keys and values are
    what the cache keeps, as the generated image's are merged in its own attention), then the generated image's
    attention reads them ahead of its own keys. The block's feed-forward runs on the image and then the text: not
    declared (`merge_mlp` has no effect). The grid is the latent's over `patch_size`; the timestep the scheduler's
    0..1000, once per guidance branch.
    """

    name = "glm_image"
    model_class = GlmImageTransformer2DModel
    stacks = (Stack("transformer_blocks", Layout.JOINT, "attn1", built_with=GlmImageAttnProcessor),)
    needs_row_token = True
    rotary = Rotary(covers_text=False, text_table=False)
    timestep_position = 4  # forward(hidden_states, encoder_hidden_states, prior_token_id, prior_token_drop, timestep)
    merge_only = True
    masks_text_only = True
    guidance_in_batch = False
    defaults = _DEFAULTS
    presets = _PRESETS

    def generation_marker(self, args: tuple, kwargs: dict) -> torch.Tensor | None:
        """`prior_token_drop`: the pipeline makes it once per call and guidance branch (its timestep is `t - 1`, no
        view of the schedule)."""
        if is_compiling():
            return None
        drop = argument(args, kwargs, 3, "prior_token_drop")
        return drop if isinstance(drop, torch.Tensor) else None


class NucleusMoEImageFamily(Family):
    """`NucleusMoEImageTransformer2DModel` (Nucleus-MoE-Image): the image tokens' queries attend over the image's keys
    then the text's (`Layout.JOINT_IMAGE_FIRST`, one output: the image's).

    The rotary tables are complex `(image, text)`, the image's over the image alone (Qwen-Image's). The mask
    `(B, N + T)` is ones over the image and the prompt's padding mask over the text (`masks_text_only`). The grid is
    the first shape of `img_shapes`. The feed-forward is a mixture of experts with expert-choice routing in most
    blocks (each expert picks its tokens among the whole sequence): not declared, so `merge_mlp` has no effect. A
    forward given cached text keys (`attention_kwargs["cached_txt_key"]`) with a mask merges nothing: the module gets
    no text then, and the mask's text part could not be told apart.
    """

    name = "nucleusmoe_image"
    model_class = NucleusMoEImageTransformer2DModel
    stacks = (Stack("transformer_blocks", Layout.JOINT_IMAGE_FIRST, built_with=NucleusMoEAttnProcessor2_0),)
    needs_row_token = True
    rotary = Rotary(covers_text=False)
    timestep_position = 4  # forward(hidden_states, img_shapes, encoder_hidden_states, mask, timestep): t / 1000
    timestep_scale = 1000.0
    merge_only = True
    masks_text_only = True
    guidance_in_batch = False
    defaults = _DEFAULTS
    presets = _PRESETS

    def token_grid(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int] | None:
        x = argument(args, kwargs, 0, "hidden_states")
        shapes = argument(args, kwargs, 1, "img_shapes")
        if not isinstance(x, torch.Tensor) or x.ndim != 3 or not shapes:
            return None
        cached = (argument(args, kwargs, 5, "attention_kwargs") or {}).get("cached_txt_key") is not None
        if cached and argument(args, kwargs, 3, "encoder_hidden_states_mask") is not None:
            return None  # (class doc)
        first = shapes[0] if isinstance(shapes, list) else shapes  # the first sample's (the model uses it for all)
        if isinstance(first, list):  # a list of shapes per sample: the first
            first = first[0] if first else None
        if not isinstance(first, (tuple, list)) or len(first) != 3:
            return None
        frames, h, w = (int(v) for v in first)
        return (h, w) if frames == 1 and h * w == x.shape[1] else None


class PRXFamily(Family):
    """`PRXTransformer2DModel` (PRX, and the pixel-space PRX-7B): the image tokens' queries attend over the text's keys
    then the image's (`Layout.JOINT`, one output: the image's).

    The rotary table is one tensor of 2x2 rotations per image token with a head axis first, `(B, 1, N, D/2, 2, 2)`
    (`Rotary(batched=True, sequence_dim=2)`), over the image alone. The mask `(B, T)` is over the text; the processor
    adds the image's part itself. The grid is the latent's over `patch_size`; the pipelines pass `t / 1000` and run
    guidance as one batch of both halves. The blocks' MLP is inline (no module of its own): `merge_mlp` has no effect.
    """

    name = "prx"
    model_class = PRXTransformer2DModel
    stacks = (Stack("blocks", Layout.JOINT, "attention"),)
    needs_row_token = True
    rotary = Rotary(covers_text=False, batched=True, sequence_dim=2)
    timestep_position = 1  # forward(hidden_states, timestep, encoder_hidden_states, attention_mask, ...)
    timestep_scale = 1000.0
    merge_only = True
    masks_text_only = True
    defaults = _DEFAULTS
    presets = _PRESETS


class BriaFibo2Family(Family):
    """`BriaFibo2Transformer2DModel` (Bria Fibo 2.0): Z-Image-like blocks over 2 x 2 patches of FLUX.2's latent.

    The noise refiner's blocks attend over the image tokens then any context images' (the images to edit:
    `Layout.IMAGE_FIRST`, `Span.LEADING`). The main blocks attend over `[gist; image; context]`: the Perceiver's gist
    tokens (text) lead, the context images' tokens are the model's tail (`trailing_tokens`), passed through
    (`Layout.TEXT_FIRST`, `Span.TRAILING`). Both get one complex rotary table `(1, S, D/2)` over their whole sequence
    (`freqs_cis`). The injection blocks' cross-attention reads the text from every token of the stream: not declared.

    A batch of prompts whose gist counts differ (from their lengths in `encoder_attention_mask`) puts the gist last,
    `[image; context; gist]`, with a mask over the gist's padding: such a forward gives no grid and merges nothing
    (read on the host once per mask tensor). The timestep is the noise level in 0..1, per guidance branch.
    """

    name = "bria_fibo2"
    model_class = BriaFibo2Transformer2DModel
    stacks = (
        Stack("noise_refiner", Layout.IMAGE_FIRST, "attention", feed_forward="feed_forward", span=Span.LEADING),
        Stack("layers", Layout.TEXT_FIRST, "attention", feed_forward="feed_forward", span=Span.TRAILING),
    )
    needs_row_token = True
    rotary = Rotary(name="freqs_cis", batched=True)
    timestep_position = 1  # forward(hidden_states, timestep, encoder_hidden_states, encoder_attention_mask, ...)
    timestep_scale = 1000.0
    merge_only = True
    guidance_in_batch = False
    defaults = _DEFAULTS
    presets = _PRESETS

    def __init__(self) -> None:
        self._last: tuple[weakref.ref, object, bool] | None = None

    def __getstate__(self) -> dict:  # a copy reads its mask afresh (the last read holds a weak reference)
        return {**vars(self), "_last": None}

    def token_grid(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
        mask = argument(args, kwargs, 3, "encoder_attention_mask")
        if isinstance(mask, torch.Tensor) and mask.ndim == 2 and mask.shape[0] > 1 and self._gist_last(model, mask):
            return None  # (class doc)
        return super().token_grid(model, args, kwargs)

    def trailing_tokens(self, args: tuple, kwargs: dict, grid: tuple[int, ...]) -> int:
        """The context images' tokens, after the image's."""
        x = argument(args, kwargs, self.input_position, self.input_name)
        context = argument(args, kwargs, 4, "context_latents") or ()
        if not isinstance(x, torch.Tensor) or x.ndim != 4:
            return 0
        patch = int(x.shape[-1]) // grid[-1]  # the model's patch_size: the grid is the latent's over it
        return sum(
            int(c.shape[-2]) // patch * (int(c.shape[-1]) // patch) for c in context if isinstance(c, torch.Tensor)
        )

    def _gist_last(self, model: torch.nn.Module, mask: torch.Tensor) -> bool:
        """Whether the prompts of `mask` get gist counts that differ (the model then puts the gist last)."""
        if is_compiling():
            return _gist_last_outside_the_graph(self, model, mask)
        version = (-1, mask.data_ptr(), tuple(mask.shape)) if mask.is_inference() else mask._version
        last = self._last
        if last is not None and last[0]() is mask and last[1] == version:
            return last[2]
        config = model.config
        counts = compute_gist_count(
            mask.sum(dim=1).tolist(),
            min_gist=config.min_num_gist_tokens,
            max_gist=config.max_num_gist_tokens,
            gist_step=config.gist_step,
            min_text_len=config.gist_min_text_len,
            max_text_len=config.gist_max_text_len,
        )
        differ = min(counts) < max(counts)
        self._last = (weakref.ref(mask), version, differ)
        return differ


@torch.compiler.disable
def _gist_last_outside_the_graph(family: BriaFibo2Family, model: torch.nn.Module, mask: torch.Tensor) -> bool:
    return family._gist_last(model, mask)
