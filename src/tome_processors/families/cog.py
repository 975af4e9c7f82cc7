"""The CogVideoX lineage: CogVideoX and ConsisID (video), CogView 3 Plus and CogView 4 (images).

Every one of them is one list of blocks, `transformer_blocks`, whose attention (`attn1`) gets the image (or video)
tokens as `hidden_states` and the text as `encoder_hidden_states`, attends over the text then the image in one
sequence and returns `(image, text)`: `Layout.JOINT`. The text is never merged. The blocks' feed-forward is not
declared: CogVideoX's, ConsisID's and CogView 3 Plus's run on the text and the image concatenated, and CogView 4's
runs twice a block, on the image then on the text (see `CogView4Family`).

Rotary positions, where a model has them (CogVideoX 5B and 1.5, ConsisID, CogView 4), are `(cos, sin)` tables of
one row per image token, the text's left unrotated (`Rotary(covers_text=False, text_table=False)`): a merged row
keeps the rotation of the token it is kept at. CogVideoX 2B and CogView 3 Plus add absolute positions to the tokens
before the blocks and pass no tables.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import (
    CogVideoXTransformer3DModel,
    CogView3PlusTransformer2DModel,
    CogView4Transformer2DModel,
    ConsisIDTransformer3DModel,
)
from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0
from diffusers.models.transformers.transformer_cogview4 import CogView4AttnProcessor

from ..arguments import argument
from .base import Family, Layout, Rotary, Stack
from .dit import SD3Family
from .flux import FluxFamily
from .wan import WanFamily

#: The rotary tables of the whole lineage: `image_rotary_emb`, the processor's third argument after the tokens
#: (`encoder_hidden_states, attention_mask, image_rotary_emb`), `(cos, sin)` of `(N_image, D)` each.
_IMAGE_ROTARY = Rotary(name="image_rotary_emb", position=2, covers_text=False, text_table=False)


def _blocks(processor: type) -> tuple[Stack, ...]:
    """The lineage's one block list: `attn1` joint over the text then the image, built with `processor` (not the
    `Attention` class's default)."""
    return (Stack("transformer_blocks", Layout.JOINT, attention="attn1", built_with=processor),)


class CogVideoXFamily(Family):
    """`CogVideoXTransformer3DModel` (CogVideoX 2B and 5B, 1.0 and 1.5; text-, image- and video-to-video, and the
    Fun control models): `CogVideoXBlock`s over the prompt (226 T5 tokens) then the video's tokens.

    The latent comes frames first, `(B, F, C, H, W)` (image-to-video's and control's conditions concatenated over
    channels), and the tokens are frame by frame, each frame row-major: the grid is `(F / patch_size_t, H / p,
    W / p)` (`patch_size_t` None, one latent frame a token, on 1.0; 2 on 1.5, whose pipelines pad the latent to an
    even number of frames). The pipelines pass the scheduler's timestep (0..1000) and the rotary tables they build
    for the grid (5B and 1.5; none on 2B), and run classifier-free guidance as one batch of both halves. No pipeline
    passes an attention mask (a mask, which the processor would take over the whole sequence, leaves the attention
    unmerged).

    Example:
        >>> from tome_processors.families import FAMILIES
        >>> family = FAMILIES["cogvideox"]()
        >>> family.rotary.covers_text, family.preset_options("balanced")["st"]
        (False, 2)
    """

    name = "cogvideox"
    model_class = CogVideoXTransformer3DModel
    stacks = _blocks(CogVideoXAttnProcessor2_0)
    video = True
    needs_row_token = True
    rotary = _IMAGE_ROTARY
    timestep_position = 2  # forward(hidden_states, encoder_hidden_states, timestep, ...): the scheduler's 0..1000
    merge_only = True  # joint attention computes keys and values inside the processor
    vae_scale_factor = 8  # AutoencoderKLCogVideoX: 8 px and 4 frames a latent pixel
    frames_per_latent = 4
    # Borrowed from WanFamily (a video transformer whose attention sees every frame with 3-D rotary positions);
    # not measured on this model.
    defaults: dict[str, Any] = dict(WanFamily.defaults)
    presets: dict[str, dict[str, Any]] = WanFamily.presets

    def token_grid(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int, int] | None:
        x = argument(args, kwargs, self.input_position, self.input_name)
        if not isinstance(x, torch.Tensor) or x.ndim != 5:
            return None
        p, p_t = int(model.config.patch_size), int(getattr(model.config, "patch_size_t", None) or 1)
        return int(x.shape[1]) // p_t, int(x.shape[3]) // p, int(x.shape[4]) // p


class ConsisIDFamily(CogVideoXFamily):
    """`ConsisIDTransformer3DModel` (ConsisID: identity-preserving image-to-video): CogVideoX 1.0's blocks, latent,
    rotary tables and pipeline call (the reference image's latents concatenated over channels).

    After every `cross_attn_interval`-th block it adds a perceiver cross-attention from the block's video tokens to
    the face's identity tokens (`perceiver_cross_attention`, no `Attention` module): it runs on the block's output,
    after the merged attention has given every token back, so it is left as it is.

    Example:
        >>> from tome_processors.families import FAMILIES
        >>> FAMILIES["consisid"]().timestep_position
        2
    """

    name = "consisid"
    model_class = ConsisIDTransformer3DModel


class CogView3PlusFamily(Family):
    """`CogView3PlusTransformer2DModel` (CogView 3 Plus): `CogView3PlusTransformerBlock`s over the prompt (224 T5
    tokens) then the image's tokens, the grid the latent `(B, C, H, W)` over `patch_size`. Positions are absolute
    (added to the tokens before the blocks), so there are no rotary tables to follow the merged rows. The pipeline
    passes the scheduler's timestep (0..1000) and runs classifier-free guidance as one batch of both halves.

    Example:
        >>> from tome_processors.families import FAMILIES
        >>> FAMILIES["cogview3plus"]().preset_options("balanced")["ratio"]
        0.4
    """

    name = "cogview3plus"
    model_class = CogView3PlusTransformer2DModel
    stacks = _blocks(CogVideoXAttnProcessor2_0)
    timestep_position = 2  # forward(hidden_states, encoder_hidden_states, timestep, original_size, ...)
    merge_only = True  # joint attention computes keys and values inside the processor
    vae_scale_factor = 8
    # Borrowed from SD3Family (a joint text-image transformer with absolute positions, as this one); not measured on
    # this model.
    defaults: dict[str, Any] = dict(SD3Family.defaults)
    presets: dict[str, dict[str, Any]] = SD3Family.presets


class CogView4Family(Family):
    """`CogView4Transformer2DModel` (CogView 4, and its Control pipeline, whose condition is concatenated over the
    latent's channels): `CogView4TransformerBlock`s over the prompt (GLM's, padded to a multiple of 16) then the
    image's tokens, the grid the latent `(B, C, H, W)` over `patch_size`.

    The model builds 2-D rotary tables for the image tokens alone (`image_rotary_emb`, on the host: they are gathered
    on the merge's device). Its mask, where one is given, is `(B, text)` over the prompt alone, which the processor
    extends over the image tokens itself, so it fits any number of merged rows and passes as it is
    (`masks_text_only`). The pipeline passes the flow-matching timestep on the 0..1000 scale and calls the model
    once per guidance branch.

    Its feed-forward is not declared (`merge_mlp` merges nothing here): each block calls the same `ff` on the image
    tokens, then on the text, and the text's call would be taken for a chunk of the image's.

    Example:
        >>> from tome_processors.families import FAMILIES
        >>> FAMILIES["cogview4"]().masks_text_only
        True
    """

    name = "cogview4"
    model_class = CogView4Transformer2DModel
    stacks = _blocks(CogView4AttnProcessor)
    needs_row_token = True
    rotary = _IMAGE_ROTARY
    masks_text_only = True  # (B, text): the processor opens the image tokens itself
    timestep_position = 2  # forward(hidden_states, encoder_hidden_states, timestep, original_size, ...): 0..1000
    merge_only = True  # joint attention computes keys and values inside the processor
    guidance_in_batch = False  # called once per guidance branch
    vae_scale_factor = 8
    # Borrowed from FluxFamily (a joint text-image transformer with rotary positions); not measured on this model.
    defaults: dict[str, Any] = dict(FluxFamily.defaults)
    presets: dict[str, dict[str, Any]] = FluxFamily.presets
