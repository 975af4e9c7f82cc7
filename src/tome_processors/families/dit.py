"""PixArt and SD3: diffusion transformers over one patch grid."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import PixArtTransformer2DModel, SD3Transformer2DModel
from diffusers.models.attention_processor import JointAttnProcessor2_0

from .base import AttentionSite, BlockSite, Family, Layout

#: PixArt's and SD3's presets. Measured on the trained DiT (docs/options.md): merging the feed-forward too
#: (`merge_mlp`) costs 2.5x ToMe's change at 0.5 already at ratio 0.3, so the presets share one matching per
#: forward instead.
_DIT_PRESETS: dict[str, dict[str, Any]] = {
    "exact": {},
    "balanced": {"ratio": 0.4, "share_level": True},
    "fast": {"ratio": 0.7, "share_level": True},
}


class PixArtFamily(Family):
    """`PixArtTransformer2DModel`: `BasicTransformerBlock`s (ada_norm_single) over the patch grid."""

    name = "pixart"
    model_class = PixArtTransformer2DModel
    timestep_position = 2
    defaults: dict[str, Any] = {"ratio": 0.4}
    presets = _DIT_PRESETS

    def blocks(self, model: torch.nn.Module) -> list[BlockSite]:
        # Glue: which of attn1 / attn2 are self-attention depends on each block's configuration.
        sites = []
        for block in model.transformer_blocks:
            attentions = [AttentionSite(block.attn1, bool(block.only_cross_attention))]
            if block.attn2 is not None:
                attentions.append(AttentionSite(block.attn2, True))
            sites.append(BlockSite(block, tuple(attentions), getattr(block, "ff", None)))
        return sites


class SD3Family(Family):
    """`SD3Transformer2DModel`: `JointTransformerBlock`s; the text stream is never merged."""

    name = "sd3"
    model_class = SD3Transformer2DModel
    timestep_position = 3
    merge_only = True
    defaults: dict[str, Any] = {"ratio": 0.4}
    presets = _DIT_PRESETS

    def blocks(self, model: torch.nn.Module) -> list[BlockSite]:
        # Glue: SD3.5's blocks may add a second attention over the image tokens alone.
        sites = []
        for block in model.transformer_blocks:
            # Both built with `JointAttnProcessor2_0`, not `Attention`'s default.
            attentions = [AttentionSite(block.attn, False, Layout.JOINT, JointAttnProcessor2_0)]
            if getattr(block, "attn2", None) is not None:  # SD3.5 dual attention: image tokens only
                attentions.append(AttentionSite(block.attn2, False, Layout.IMAGE, JointAttnProcessor2_0))
            sites.append(BlockSite(block, tuple(attentions), block.ff))
        return sites
