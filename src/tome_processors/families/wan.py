"""Wan 2.1 / 2.2 and the models diffusers derives from it (SkyReels-V2, Wan VACE): video diffusion transformers over
a `(frames, h, w)` grid of patch tokens, 3-D rotary positions."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import SkyReelsV2Transformer3DModel, WanTransformer3DModel, WanVACETransformer3DModel

from ..arguments import argument
from .base import AttentionSite, BlockSite, Family, Layout


class WanFamily(Family):
    """`WanTransformer3DModel` (text- and image-to-video, Wan 2.1 and 2.2): `WanTransformerBlock`s.

    Each block's `attn1` is self-attention over the video tokens with 3-D rotary embeddings (a merged
    row keeps the rotation of the token it is kept at); `attn2` is cross-attention to the text (and the
    image-embedding tokens of image-to-video), whose keys and values are never merged; `ffn` is the
    feed-forward (`merge_mlp`). The token grid is the input `(B, C, F, H, W)` over `config.patch_size`.
    """

    guidance_in_batch = False  # called once per guidance branch, at batch 1

    name = "wan"
    needs_row_token = True
    video = True
    timestep_position = 1
    # K/V pooling cannot pass pooled keys through Wan's processor: it rotates the keys with a table of
    # one row per query token.
    merge_only = True
    defaults: dict[str, Any] = {"ratio": 0.5}
    # docs/options.md: on the trained Wan-shaped video model, 2x2x2 windows across two frames with window
    # matching (each source merges, if at all, into its own window's destination: merged tokens keep their
    # place and rotary position) change the noise prediction and its flicker less at 0.75 than tomesd frame by
    # frame at 0.5 (12.78% / 11.22% against 13.00% / 12.13%), and at 0.85 with one matching per forward less
    # than twice that (22.83%); global matching across the clip changed them more at lower ratios. Merging the
    # feed-forward too changed them several times as much on random weights, so no preset does.
    presets: dict[str, dict[str, Any]] = {
        "exact": {},
        "balanced": {"st": 2, "ratio": 0.75, "matching": "window"},
        "fast": {"st": 2, "ratio": 0.85, "matching": "window", "share_level": True},
    }

    model_class = WanTransformer3DModel
    #: The model's list of blocks and each block's feed-forward (a video family like Wan's names its own).
    block_list = "blocks"
    feed_forward = "ffn"

    def blocks(self, model: torch.nn.Module) -> list[BlockSite]:
        """Each block's self-attention over the video tokens (`attn1`, rotary rows) and cross-attention (`attn2`)."""
        return [self._site(block) for block in getattr(model, self.block_list)]

    def _site(self, block: torch.nn.Module) -> BlockSite:
        attentions = (AttentionSite(block.attn1, False, Layout.ROTARY), AttentionSite(block.attn2, True))
        return BlockSite(block, attentions, getattr(block, self.feed_forward))

    def token_grid(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int, int] | None:
        x = argument(args, kwargs, self.input_position, self.input_name)
        if not isinstance(x, torch.Tensor) or x.ndim != 5:
            return None
        p_t, p_h, p_w = model.config.patch_size
        return int(x.shape[2]) // p_t, int(x.shape[3]) // p_h, int(x.shape[4]) // p_w


class SkyReelsV2Family(WanFamily):
    """`SkyReelsV2Transformer3DModel` (SkyReels-V2's text- and image-to-video and diffusion-forcing pipelines): Wan's
    blocks, rotary tables and processor layout under other class names, so Wan's family, defaults and presets.

    Example:
        >>> from tome_processors.families import FAMILIES
        >>> FAMILIES["skyreels_v2"]().preset_options("balanced")["st"]
        2
    """

    name = "skyreels_v2"
    model_class = SkyReelsV2Transformer3DModel


class WanVACEFamily(WanFamily):
    """`WanVACETransformer3DModel` (Wan VACE): Wan's blocks, and before them `vace_blocks`, Wan blocks over the
    control video, whose outputs are added into the main blocks as hints.

    The VACE blocks merge too: their self-attention runs over the control stream, one token per video token on the
    same `(frames, h, w)` grid (padded to the video's length; the first VACE block adds the video tokens in), with
    the video's rotary tables, and costs as much as a main block's. The merge metric is each block's `hidden_states`
    input, here the video tokens every VACE block receives (the same as the first main block's), so with
    `share_level` the one matching per forward is the video's, as on Wan.

    Example:
        >>> from tome_processors.families import FAMILIES
        >>> FAMILIES["wan_vace"]().name
        'wan_vace'
    """

    name = "wan_vace"
    model_class = WanVACETransformer3DModel

    def blocks(self, model: torch.nn.Module) -> list[BlockSite]:
        """The VACE blocks (they run first), then the main blocks (see the class doc)."""
        return [self._site(block) for block in model.vace_blocks] + super().blocks(model)
