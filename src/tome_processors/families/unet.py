"""UNets (SD1.x, SD2.x, SDXL): `BasicTransformerBlock`s inside `Transformer2DModel`s."""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.attention import BasicTransformerBlock
from diffusers.models.transformers.transformer_2d import Transformer2DModel
from diffusers.models.transformers.transformer_temporal import TransformerSpatioTemporalModel

from ..arguments import argument
from .base import AttentionSite, BlockSite, Family, is_mergeable_attention, max_downsample_for_levels
from .walk import modules_of


def spatial_transformer_blocks(model: torch.nn.Module) -> list[BasicTransformerBlock]:
    """The `BasicTransformerBlock`s that attend over image tokens, in module order.

    Only blocks inside a `Transformer2DModel` count: the same block class inside temporal
    transformers (AnimateDiff motion modules) attends over frames, and merging would mix them.
    """
    blocks: list[BasicTransformerBlock] = []
    for module in modules_of(model):
        if isinstance(module, Transformer2DModel):
            blocks.extend(b for b in module.transformer_blocks if isinstance(b, BasicTransformerBlock))
    return blocks


def _level_parts(model: torch.nn.Module) -> list[tuple[torch.nn.Module, int]]:
    """Each part of a UNet's module tree with the downsample level its tokens sit at: `down_blocks[i]` 2**i, the
    mid block the deepest, `up_blocks[j]` mirrored. Every UNet diffusers builds keeps its levels there, whatever
    each block calls its attention (`attentions`, ControlNet-XS's `base_attentions` / `ctrl_attentions`)."""
    down = list(getattr(model, "down_blocks", None) or ())
    up = list(getattr(model, "up_blocks", None) or ())
    parts = [(block, 2**i) for i, block in enumerate(down)]
    mid = getattr(model, "mid_block", None)
    if mid is not None and down:
        parts.append((mid, 2 ** (len(down) - 1)))
    parts += [(block, 2 ** (len(up) - 1 - j)) for j, block in enumerate(up)]
    return parts


def block_levels(model: torch.nn.Module, blocks: list[torch.nn.Module]) -> list[int]:
    """The downsample level of each of `blocks`, from where it sits in `model` (`_level_parts`); 1 for a block
    found in none of its parts."""
    level_of = {id(module): level for part, level in _level_parts(model) for module in part.modules()}
    return [level_of.get(id(block), 1) for block in blocks]


def _spatial_self_attention_blocks(model: torch.nn.Module) -> list[BasicTransformerBlock]:
    """The spatial blocks (one frame's tokens) whose first attention attends over the image tokens themselves:
    blocks built with `only_cross_attention` attend to the text twice and merge nothing by default."""
    blocks = [
        block
        for module in modules_of(model)
        if isinstance(module, (Transformer2DModel, TransformerSpatioTemporalModel))
        for block in module.transformer_blocks
        if isinstance(block, BasicTransformerBlock)
    ]
    return [b for b in blocks if not b.only_cross_attention and is_mergeable_attention(b.attn1)]


def attention_levels(model: torch.nn.Module) -> list[int]:
    """The downsample levels of a UNet that hold self-attention over image tokens, in order (SD1.5: [1, 2, 4, 8],
    its mid block at 8; the x4 upscaler's tiny test UNet: [4], its level 2 attending to the text only); [] for a
    model without UNet levels (a diffusion transformer).

    Levels come from where the blocks sit (`_level_parts`), not from the names blocks give their attention, so
    ControlNet-XS's UNet (`base_attentions`) is read as any other.

    Example:
        >>> from diffusers import UNet2DConditionModel
        >>> unet = UNet2DConditionModel(
        ...     block_out_channels=(8, 16), norm_num_groups=8, cross_attention_dim=8, attention_head_dim=2,
        ...     down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        ...     up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        ... )
        >>> attention_levels(unet)
        [2]
    """
    if not getattr(model, "down_blocks", None):
        return []
    return sorted(set(block_levels(model, _spatial_self_attention_blocks(model))))


class UNetFamily(Family):
    """UNets (SD1.x, SD2.x, SDXL) and any model with `BasicTransformerBlock`s in `Transformer2DModel`s."""

    name = "unet"
    input_name = "sample"
    timestep_position = 1
    defaults: dict[str, Any] = {}  # tomesd's defaults
    presets: dict[str, dict[str, Any]] = {
        "exact": {},
        "balanced": {"mode": "downsample_kv", "kv_pool": "nearest"},
        # 4x4 at the first attention level, 2x2 at the second: the levels from the model's (preset_options).
        "fast": {"mode": "downsample_kv", "kv_pool": "nearest", "kv_factor": 4},
    }

    def preset_options(self, name: str, model: torch.nn.Module | None = None) -> dict[str, Any]:
        options = super().preset_options(name, model)
        if name == "fast":
            first_level = self.auto_downsample(model) if model is not None else 1
            options["max_downsample"] = max_downsample_for_levels(first_level, 2)
            # 4x4 at the second level changed the trained model's prediction more than tomesd at 0.5 for little
            # more speed (SD1.5 at 1024 px on the CPU: 2.26x against 2.12x); on a GPU the pays rule pools that
            # level 2x2 or not at all.
            options["level_kv_factors"] = {max_downsample_for_levels(first_level, 2): 2}
        return options

    def spatial_blocks(self, model: torch.nn.Module) -> list[BasicTransformerBlock]:
        """The blocks that attend over the image tokens of one frame (a subclass finds them elsewhere)."""
        return spatial_transformer_blocks(model)

    def matches(self, model: torch.nn.Module) -> bool:
        return bool(self.spatial_blocks(model))

    def blocks(self, model: torch.nn.Module) -> list[BlockSite]:
        sites = []
        for block in self.spatial_blocks(model):
            attentions = tuple(
                AttentionSite(attn, is_cross)
                for attn, is_cross in ((block.attn1, block.only_cross_attention), (block.attn2, True))
                if attn is not None and is_mergeable_attention(attn)
            )
            sites.append(BlockSite(block, attentions, getattr(block, "ff", None)))
        return sites

    def block_levels(self, model: torch.nn.Module, blocks: list[torch.nn.Module]) -> list[int]:
        """Each block's downsample level, from where it sits (`block_levels`)."""
        return block_levels(model, blocks)

    def auto_downsample(self, model: torch.nn.Module) -> int:
        """The first level with self-attention over image tokens (`attention_levels`)."""
        levels = attention_levels(model)
        return min(levels) if levels else 1

    def token_grid(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[int, int] | None:
        sample = argument(args, kwargs, 0, "sample")
        if not isinstance(sample, torch.Tensor) or sample.ndim < 4:
            return None
        return int(sample.shape[-2]), int(sample.shape[-1])
