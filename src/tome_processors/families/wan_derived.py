"""Video transformers diffusers derives from Wan with classes of their own: Wan-Animate, ChronoEdit and Helios.

Each keeps Wan's block (self-attention over the video tokens with 3-D rotary positions, cross-attention to the text,
a feed-forward) and its 5-D latent, so each is a `WanFamily`; what differs is what comes around the blocks:

- Wan-Animate (`WanAnimateTransformer3DModel`): a face adapter after every `inject_face_latents_blocks`-th block,
  and one latent frame more than the clip's (the reference image's);
- ChronoEdit (`ChronoEditTransformer3DModel`): Wan 2.1 image-to-video under another name (its rotary tables skip
  time between a 2-frame clip's frames);
- Helios (`HeliosTransformer3DModel`): the history of the clips generated before, as tokens ahead of the clip's.

`WanAnimate2Transformer3DModel` (Wan-Animate 2) is refused, with the reason (`REFUSED`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import (
    ChronoEditTransformer3DModel,
    HeliosTransformer3DModel,
    WanAnimate2Transformer3DModel,
    WanAnimateTransformer3DModel,
)

from .base import AttentionSite, BlockSite, Layout, Rotary, Span
from .wan import WanFamily


class WanAnimateFamily(WanFamily):
    """`WanAnimateTransformer3DModel` (Wan2.2-Animate): Wan's blocks over the character clip's tokens.

    The model's input is the noisy clip, the reference image's latent frame ahead of it and their conditioning, in
    one `(B, 2C + 4, 1 + T, H, W)` latent, so its grid is `(1 + T, H / 2, W / 2)`: one latent frame more than the
    clip's (`extra_latent_frames`). The pose latents are added to the patch embedding of the clip's frames, so the
    blocks get one token per grid cell, as Wan's. Its `face_adapter` attentions (after every
    `inject_face_latents_blocks`-th block) are not declared, so never wrapped: their processor reshapes the block's
    output to one row of queries per frame (`[B * T, S / T]`, keys the face motion of that frame) and masks by
    multiplying its output, neither of which holds for merged tokens. Under `set_attn_processor(ToMeProcessor())`
    they run their own processor on every token.

    Wan-Animate 2 (`WanAnimate2Transformer3DModel`) has no family: its self-attention rotates queries and keys with
    positions it builds inside the processor from `grid_sizes` over the first `f * h * w` tokens (`rope_apply`),
    caches the reference pass's keys per layer, and in the generation pass scatters the queries frame by frame
    into a flex-attention `BlockMask` buffer (`WanAnimate2AttnProcessor`, transformer_wan_animate_2.py): none of
    it lines up with fewer tokens.

    Example:
        >>> from tome_processors.families import FAMILIES
        >>> FAMILIES["wan_animate"]().extra_latent_frames
        1
    """

    name = "wan_animate"
    model_class = WanAnimateTransformer3DModel
    extra_latent_frames = 1


class ChronoEditFamily(WanFamily):
    """`ChronoEditTransformer3DModel` (ChronoEdit): Wan 2.1 image-to-video's blocks, rotary tables (one `(cos, sin)`
    row per token; a 2-frame clip's frames rotated `rope_temporal_skip_len - 1` apart) and processor layout under
    its own class, so Wan's family, defaults and presets. Its pipeline edits an image as a short clip: the input
    image and the edit as its first and last frames (and, with temporal reasoning, frames between them for the first
    steps: the grid then has fewer frames from that step on, which is read every forward).

    Example:
        >>> from tome_processors.families import FAMILIES
        >>> FAMILIES["chronoedit"]().preset_options("balanced")["st"]
        2
    """

    name = "chronoedit"
    model_class = ChronoEditTransformer3DModel


@dataclass(frozen=True)
class _ClipSite(BlockSite):
    """A Helios block: its input is the history's tokens, then the clip's `frames x h x w` (`Span.TRAILING`).

    Under context parallelism diffusers' plan for Helios splits each attention's input, history and clip as one
    sequence: a rank's run is then no grid of the clip where a history precedes it, so the whole input is the metric
    (and its attentions say they got fewer tokens than the grid holds).
    """

    def metric(
        self, hidden_states: torch.Tensor, grid_tokens: int, tail: int = 0, sharded: bool = False
    ) -> torch.Tensor:
        tokens = int(hidden_states.shape[1]) if hidden_states.ndim == 3 else 0
        if sharded and tokens != grid_tokens:
            return hidden_states
        return super().metric(hidden_states, grid_tokens, tail, sharded)


class HeliosFamily(WanFamily):
    """`HeliosTransformer3DModel` (Helios: long videos, one clip of latent frames at a time).

    The model's input is the clip's noisy `(B, C, T, H, W)` latent, whose grid is `(T, H / 2, W / 2)`; the latents
    of the clips generated before come as a history (short, mid and long term, patched at 1x, 2x and 4x), and the
    blocks get the history's tokens, then the clip's. Only the clip's tokens are merged: each block's `attn1` is
    self-attention over history and clip (`Layout.TEXT_FIRST`, the history in the text's place: each history token
    a row of its own), with one rotary row per token of both, `(B, S, 2D)` (cos and sin in one table: a merged row
    keeps its kept token's). `attn2`, the cross-attention to the text, gets the clip's tokens alone
    (`guidance_cross_attn`, the released models) or history and clip. The timestep is on the 0..1000 scale.

    Where a block amplifies the history's keys (`is_amplify_history`), its processor finds the history as the tokens
    before the last `original_context_length`, the clip's unmerged count: its `attn1` is not declared (no released
    model does). Under context parallelism the clip merges where the call passes no history (see `_ClipSite`).

    Example:
        >>> from tome_processors.families import FAMILIES
        >>> FAMILIES["helios"]().rotary.batched
        True
    """

    name = "helios"
    model_class = HeliosTransformer3DModel
    rotary = Rotary(name="rotary_emb", position=2, covers_text=True, batched=True)

    def blocks(self, model: torch.nn.Module) -> list[BlockSite]:
        """Each block's `attn1` (history then clip) and `attn2` (the clip, or history then clip)."""
        sites: list[BlockSite] = []
        for block in model.blocks:
            attentions = []
            if not getattr(block.attn1, "is_amplify_history", False):
                attentions.append(AttentionSite(block.attn1, False, Layout.TEXT_FIRST))
            cross = Layout.IMAGE if block.guidance_cross_attn else Layout.TEXT_FIRST
            attentions.append(AttentionSite(block.attn2, True, cross))
            sites.append(_ClipSite(block, tuple(attentions), block.ffn, Span.TRAILING))
        return sites


#: The model classes of this module ToMe refuses, each with why (`families.family_of` raises it). Wan-Animate 2's
#: self-attention processor (`WanAnimate2AttnProcessor`, transformer_wan_animate_2.py) builds its rotary positions
#: inside itself from `grid_sizes` over the first frames x h x w tokens (`rope_apply`), caches the reference pass's
#: keys and values per layer, and in the generation pass scatters its queries frame by frame into a flex-attention
#: block mask's buffer: fewer tokens line up with none of the three.
REFUSED: dict[type, str] = {
    WanAnimate2Transformer3DModel: (
        "Expected a model whose attention ToMe can merge, but got WanAnimate2Transformer3DModel: its self-attention "
        "processor builds the rotary positions itself from the grid's size over the first frames x h x w tokens, "
        "caches the reference pass's keys and values per layer and scatters the queries frame by frame into a "
        "flex-attention block mask, none of which merged tokens line up with. ToMe cannot merge in this model."
    )
}
