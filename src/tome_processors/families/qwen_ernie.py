"""Qwen-Image 2.1 and ERNIE-Image: single-stream transformers, one attention over the text and the image tokens.

Qwen-Image 2.1 runs block-causal attention over `[text with any condition images' tokens; generated image]`;
ERNIE-Image runs full attention over `[image; text]` and keeps its residual stream sequence first, `(S, B, C)`.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import ErnieImageTransformer2DModel, QwenImage21Transformer2DModel

from ..arguments import argument
from .base import Family, Layout, Rotary, Span, Stack
from .flux import FluxFamily


class QwenImage21Family(Family):
    """`QwenImage21Transformer2DModel` (Qwen-Image 2.1): single-stream blocks over one joint sequence.

    The sequence is the prompt's tokens, into which the condition images' tokens are spliced, then the generated
    image's (always last: `Layout.TEXT_FIRST`, `Span.TRAILING`). Attention is block-causal: the prefix (text and
    condition images) attends to itself only, so merging the generated image's tokens leaves it, and the keys and
    values the pipeline caches from it after the first step, exactly as they were. From the second step the pipeline
    passes the generated image's tokens alone (`kv_cache_mode="cached"`), and the attention joins them to the cached
    prefix: the block input is the grid then, and the key mask (where prompts are padded) covers the prefix too.

    The grid is the last shape of `img_shapes` (`[(frames, rows, columns), ...]`, condition images first). The
    rotary table is one complex `(S, D/2)` table over the whole sequence, passed as `rotary_emb`. The key masks
    (`attention_mask` in the cached steps, `key_valid` over the whole sequence otherwise) mask prompt padding only.
    The flex processor's `BlockMask` (every step but the cached ones) cannot be cut to fewer tokens: an attention
    given one runs unmerged.
    """

    name = "qwenimage21"
    model_class = QwenImage21Transformer2DModel
    # The module calls its processor with keywords only; `(attention_mask, rotary_emb)` are its first parameters.
    stacks = (Stack("transformer_blocks", Layout.TEXT_FIRST, feed_forward="img_mlp", span=Span.TRAILING, mask_at=0),)
    needs_row_token = True
    rotary = Rotary(name="rotary_emb", position=1)
    masks_text_only = True
    timestep_position = 2
    timestep_scale = 1000.0  # the pipeline passes timestep / 1000
    merge_only = True
    guidance_in_batch = False  # called once per guidance branch
    vae_scale_factor = 16  # the pipeline's VAE: 16 px a latent pixel, one token each (`patch_size` 1)
    # Borrowed from FLUX.1 (joint text-image attention with rotary positions); not measured on this model.
    defaults: dict[str, Any] = dict(FluxFamily.defaults)
    presets: dict[str, dict[str, Any]] = FluxFamily.presets

    def token_grid(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int] | None:
        x = argument(args, kwargs, 0, "hidden_states")
        shapes = argument(args, kwargs, 3, "img_shapes")
        if not isinstance(x, torch.Tensor) or x.ndim != 3 or not shapes or not shapes[0]:
            return None
        generated = shapes[0][-1]  # the model lays every sample out as the first (the generated image last)
        if not isinstance(generated, (tuple, list)) or len(generated) != 3:
            return None
        frames, h, w = (int(v) for v in generated)
        return (h, w) if frames == 1 and 0 < h * w <= x.shape[1] else None


class ErnieImageFamily(Family):
    """`ErnieImageTransformer2DModel` (ERNIE-Image): single-stream blocks over `[image; text]`.

    The blocks keep the residual stream sequence first, `(S, B, C)`, and hand their attention its `(B, S, C)`
    transpose: the merge metric is the block input's batch-first view (`Stack.sequence_first`), and the attention
    merges as Z-Image's does (`Layout.IMAGE_FIRST`). The module calls its processor with `(mask, rotary)` after
    the tokens. The rotary table is real angles per sample, `(B, S, 1, D)` (the image's positions start at each
    sample's text length); the mask `(B, 1, 1, S)` masks text padding only. The feed-forward runs on the
    sequence-first stream, which the feed-forward hooks (`(B, S, C)`) cannot merge: `merge_mlp` has no effect.
    The latent is 128 channels at 16 px a token (the pipeline packs the VAE's 2 x 2 latent pixels; the model's
    `patch_size` is 1), and the pipeline passes the scheduler's 0..1000 timesteps, guidance in one batch.
    """

    name = "ernie_image"
    model_class = ErnieImageTransformer2DModel
    stacks = (Stack("layers", Layout.IMAGE_FIRST, "self_attention", span=Span.LEADING, mask_at=0, sequence_first=True),)
    needs_row_token = True
    rotary = Rotary(name="freqs_cis", position=1, covers_text=True, batched=True)
    masks_text_only = True
    timestep_position = 1
    merge_only = True
    vae_scale_factor = 16  # the pipeline's own: 2 ** 4 VAE levels, its 2 x 2 packing included
    # Borrowed from FLUX.1 (joint text-image attention with rotary positions); not measured on this model.
    defaults: dict[str, Any] = dict(FluxFamily.defaults)
    presets: dict[str, dict[str, Any]] = FluxFamily.presets
