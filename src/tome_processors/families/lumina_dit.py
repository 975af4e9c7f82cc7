"""Lumina 2, Lumina-Next, AuraFlow, DiT, Hunyuan-DiT and FramePack: diffusion transformers of four layouts.

- Lumina 2 (`Lumina2Transformer2DModel`): a refiner over the image tokens, then one sequence of the caption and the
  image (text first), rotary rows over both; its `t` rises towards the clean image (as Lumina-Next's).
- Lumina-Next (`LuminaNextDiT2DModel`) and Hunyuan-DiT (`HunyuanDiT2DModel`): PixArt's layout with rotary rows,
  self-attention over the image tokens and cross-attention to the text in every block.
- AuraFlow (`AuraFlowTransformer2DModel`): joint then single-stream blocks (SD3's and FLUX's layouts) without rotary
  positions (a learned position table is added to the patches).
- DiT (`DiTTransformer2DModel`): PixArt's `BasicTransformerBlock`s, class-conditional (no text).
- FramePack (`HunyuanVideoFramepackTransformer3DModel`): HunyuanVideo's blocks with the history latents' tokens ahead
  of the clip's.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import (
    AuraFlowTransformer2DModel,
    DiTTransformer2DModel,
    HunyuanDiT2DModel,
    HunyuanVideoFramepackTransformer3DModel,
    Lumina2Transformer2DModel,
    LuminaNextDiT2DModel,
)
from diffusers.models.attention_processor import (
    AuraFlowAttnProcessor2_0,
    HunyuanAttnProcessor2_0,
    LuminaAttnProcessor2_0,
)
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0
from diffusers.models.transformers.transformer_lumina2 import Lumina2AttnProcessor2_0

from ..arguments import argument
from .base import AttentionSite, BlockSite, Family, Layout, Rotary, Span, Stack
from .dit import PixArtFamily, SD3Family
from .flux import FluxFamily
from .hunyuanvideo import HunyuanVideoFamily
from .wan_derived import HistoryClipSite


class _RisingTime(Family):
    """A family whose pipelines pass the model `t = 1 - sigma` in 0..1, rising towards the clean image (Lumina's):
    the noise level on the 0..1000 scale is `(1 - t) * 1000`."""

    timestep_position = 1

    def timestep(self, args: tuple, kwargs: dict) -> object:
        t = argument(args, kwargs, self.timestep_position, self.timestep_name)
        return None if t is None else (1 - t) * 1000.0


class Lumina2Family(_RisingTime):
    """`Lumina2Transformer2DModel` (Lumina-Image 2.0): the noise refiner's blocks over the image tokens, then the main
    `layers` over one sequence of the caption's valid tokens followed by the image's.

    Every block calls its attention with its tokens as `hidden_states` and again as `encoder_hidden_states` (keys and
    values from the same tokens), which get the merged tokens too. The noise refiner's input is the grid's tokens
    alone (`Layout.IMAGE_FIRST` with nothing after them); the main layers' opens with the caption, each caption token a
    row of its own (`Layout.TEXT_FIRST`, `Span.TRAILING`). The context refiner attends over the caption alone and is
    left as it is. Rotary tables are complex, one per sample, `(B, S, D/2)`, over each block's whole sequence: a merged
    row takes its kept token's row, each caption token keeps its own.

    Where the captions of a batch differ in valid length, the model pads each sample's sequence after its image tokens
    to the longest and passes a mask over them: the grid's tokens then sit at another offset in each sample, so the
    main layers' attention runs unmerged there (the mask is not cut; the noise refiner still merges). The pipeline
    calls the model once per guidance branch, so a batch of one prompt's images never has such a mask. The pipeline
    passes `t = 1 - timestep / 1000`. `merge_mlp` merges the noise refiner's feed-forward; the main layers' runs on the
    caption and the image together, which the feed-forward's merge (the image tokens' alone) does not cover.
    """

    guidance_in_batch = False  # its pipeline calls the model once per guidance branch

    name = "lumina2"
    model_class = Lumina2Transformer2DModel
    built_with = Lumina2AttnProcessor2_0
    stacks = (
        Stack("noise_refiner", Layout.IMAGE_FIRST, feed_forward="feed_forward"),
        Stack("layers", Layout.TEXT_FIRST, span=Span.TRAILING),
    )
    needs_row_token = True
    rotary = Rotary(name="image_rotary_emb", position=2, covers_text=True, batched=True)
    merge_only = True  # the keys carry rotary rows (in the main layers beside the caption's): pooled keys have none
    # FLUX.1's presets (a text-image sequence with rotary positions, as Z-Image borrows them); not measured on
    # Lumina 2.
    defaults: dict[str, Any] = dict(FluxFamily.defaults)
    presets: dict[str, dict[str, Any]] = FluxFamily.presets


#: Lumina-Next's processor takes `(encoder_hidden_states, attention_mask, query_rotary_emb, key_rotary_emb)` after
#: `hidden_states`: its self-attention gets one table for queries and keys, its cross-attention the queries' alone.
_LUMINA_NEXT_ROTARY = Rotary(
    name="query_rotary_emb", position=3, covers_text=True, batched=True, key_name="key_rotary_emb", key_position=4
)


class LuminaNextFamily(_RisingTime):
    """`LuminaNextDiT2DModel` (Lumina-Next-SFT): in every block, self-attention over the image tokens (`attn1`) and
    cross-attention from them to the caption (`attn2`), both with rotary rows on the image tokens.

    The self-attention gets its tokens again as `encoder_hidden_states` (the keys' and values'), merged alike, the
    same complex table `(1, N, D/2)` as `query_rotary_emb` and `key_rotary_emb` (a merged row takes its kept token's
    row), and a mask of ones over the image tokens, cut to the merged tokens (`masks_text_only`). The cross-attention
    (merged only with `merge_crossattn`) rotates its queries alone; its mask covers the caption, its keys, and stays.
    Both return `(B, tokens, heads, head_dim)`, unmerged as such; the block sums them before its output projection.

    With proportional attention (the pipeline's default, `base_sequence_length`), the self-attention's softmax scale
    grows with the number of tokens it gets, `sqrt(log_base(tokens))`: merged, it is taken at the merged count (the
    attention then attends over that many). The pipeline passes `t = 1 - timestep / 1000`, both guidance halves in
    one batch. `merge_mlp` merges the feed-forward.
    """

    name = "lumina_next"
    model_class = LuminaNextDiT2DModel
    built_with = LuminaAttnProcessor2_0
    needs_row_token = True
    rotary = _LUMINA_NEXT_ROTARY
    masks_text_only = True  # the self-attention's mask: ones over every image token
    merge_only = True  # the keys carry rotary rows: pooled keys would have none
    # PixArt's presets (self-attention over the image tokens and cross-attention to the text, as PixArt); not measured
    # on Lumina-Next.
    defaults: dict[str, Any] = dict(PixArtFamily.defaults)
    presets: dict[str, dict[str, Any]] = PixArtFamily.presets

    def blocks(self, model: torch.nn.Module) -> list[BlockSite]:
        return [_self_and_cross(block, block.feed_forward) for block in model.layers]


def _self_and_cross(block: torch.nn.Module, feed_forward: torch.nn.Module | None) -> BlockSite:
    """A block of self-attention (`attn1`) over the image tokens and cross-attention (`attn2`) to the text, with rotary
    rows on the image tokens: both get the grid's tokens alone as `hidden_states`."""
    attentions = (
        AttentionSite(block.attn1, False, Layout.IMAGE_FIRST),
        AttentionSite(block.attn2, True, Layout.IMAGE_FIRST),
    )
    return BlockSite(block, attentions, feed_forward)


class AuraFlowFamily(Family):
    """`AuraFlowTransformer2DModel` (AuraFlow): joint blocks (`joint_transformer_blocks`: the image tokens and the
    text apart, `(image, text)` out), then single-stream blocks over the text followed by the image
    (`single_transformer_blocks`).

    The text is the prompt's tokens after the model's 8 register tokens; it is never merged (the single-stream
    blocks pass each text token as a row of its own). Positions are a learned table added to the patches before
    the blocks, so nothing follows the merged rows. The pipeline passes `timestep / 1000` (0..1) and both guidance
    halves in one batch, with no attention mask. `merge_mlp` merges the joint blocks' image feed-forward (`ff`); the
    single-stream blocks' runs on text and image together, which the feed-forward's merge (the image tokens' alone)
    does not cover.
    """

    name = "auraflow"
    model_class = AuraFlowTransformer2DModel
    built_with = AuraFlowAttnProcessor2_0
    stacks = (
        Stack("joint_transformer_blocks", Layout.JOINT, feed_forward="ff"),
        Stack("single_transformer_blocks", Layout.TEXT_FIRST, span=Span.TRAILING),
    )
    timestep_position = 2
    timestep_scale = 1000.0  # the pipeline passes t / 1000
    merge_only = True  # joint attention computes keys and values inside the processor
    # SD3's presets (an MMDiT with learned positions, as SD3); not measured on AuraFlow.
    defaults: dict[str, Any] = dict(SD3Family.defaults)
    presets: dict[str, dict[str, Any]] = SD3Family.presets


class DiTFamily(PixArtFamily):
    """`DiTTransformer2DModel` (DiT, class-conditional on ImageNet): PixArt's `BasicTransformerBlock`s (`ada_norm_zero`)
    over the patch grid, self-attention alone (no text). Its output is unpatchified as a square, so it takes square
    latents only. The pipeline passes the scheduler's timestep (0..1000) and both guidance halves in one batch.
    """

    name = "dit_imagenet"
    model_class = DiTTransformer2DModel
    timestep_position = 1


class HunyuanDiTFamily(Family):
    """`HunyuanDiT2DModel` (Hunyuan-DiT): in every block, self-attention over the image tokens (`attn1`) and
    cross-attention from them to the text (`attn2`: CLIP's and mT5's tokens), with 2-D rotary rows on the image tokens;
    the second half's blocks add the first half's outputs (long skips) before their attention.

    The tables `(cos, sin)`, each `(N, D)`, cover the image tokens: a merged row takes its kept token's rows (the
    self-attention rotates queries and keys, the cross-attention its queries). The model attends with no mask (it
    replaces the text's padding by a learned embedding). The grid is the 4-D latent over `patch_size`; the pipeline
    passes the scheduler's timestep (0..1000) and both guidance halves in one batch. `merge_mlp` merges the
    feed-forward.
    """

    name = "hunyuandit"
    model_class = HunyuanDiT2DModel
    built_with = HunyuanAttnProcessor2_0
    needs_row_token = True
    rotary = Rotary(name="image_rotary_emb", position=4, covers_text=True)
    timestep_position = 1
    merge_only = True  # the keys carry rotary rows: pooled keys would have none
    # PixArt's presets (self-attention over the image tokens and cross-attention to the text, as PixArt); not measured
    # on Hunyuan-DiT.
    defaults: dict[str, Any] = dict(PixArtFamily.defaults)
    presets: dict[str, dict[str, Any]] = PixArtFamily.presets

    def blocks(self, model: torch.nn.Module) -> list[BlockSite]:
        return [_self_and_cross(block, block.ff) for block in model.blocks]


class HunyuanVideoFramepackFamily(HunyuanVideoFamily):
    """`HunyuanVideoFramepackTransformer3DModel` (FramePack on HunyuanVideo): HunyuanVideo's double- and single-stream
    blocks over the clip's tokens after those of the history latents.

    The history (4x-, 2x- and 1x-compressed latents of the frames generated before, and the first frame's) is patched
    into tokens put ahead of the clip's: every block's attention gets history and clip as `hidden_states` and the
    text (the image encoder's tokens, then the prompt's) apart, and attends over the three
    (`Layout.JOINT_IMAGE_FIRST_HISTORY`). Only the clip's tokens are merged: its grid is the 5-D latent's
    `(frames, h, w)` over the patch sizes, the last of each block's input (`Span.TRAILING`); the history's tokens
    pass as rows of their own. Rotary tables `(cos, sin)`, each `(N_history + N_clip, D)`, cover both: a merged row
    takes its kept token's, each history token keeps its own. At a batch above one the model masks the text's padding
    (ones over history and clip): the mask is cut to the merged rows. The pipeline passes the timestep on 0..1000,
    one guidance branch per call. No feed-forward is declared (`merge_mlp` merges none): the double-stream blocks' runs
    on history and clip together, which the feed-forward's merge (the clip's tokens alone) does not cover.
    """

    name = "hunyuanvideo_framepack"
    model_class = HunyuanVideoFramepackTransformer3DModel

    def blocks(self, model: torch.nn.Module) -> list[BlockSite]:
        sites: list[BlockSite] = []
        for block in (*model.transformer_blocks, *model.single_transformer_blocks):
            attention = AttentionSite(block.attn, False, Layout.JOINT_IMAGE_FIRST_HISTORY, HunyuanVideoAttnProcessor2_0)
            sites.append(HistoryClipSite(block, (attention,), None, Span.TRAILING))
        return sites
