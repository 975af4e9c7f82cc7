"""Tiny random-weight diffusers models built from configs, shared by the tests (no downloads)."""

from __future__ import annotations

import torch
from diffusers import UNet2DConditionModel

CROSS_DIM = 32


def tiny_unet(kind: str = "sd15", seed: int = 0) -> UNet2DConditionModel:
    """A small UNet with the structure of SD1.5 ("sd15"), SD2 ("sd2") or SDXL ("sdxl")."""
    torch.manual_seed(seed)
    common = dict(
        sample_size=16,
        in_channels=4,
        out_channels=4,
        layers_per_block=1,
        norm_num_groups=8,
        cross_attention_dim=CROSS_DIM,
    )
    if kind == "sd15":
        config = dict(
            block_out_channels=(32, 48, 64),
            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
            attention_head_dim=8,
        )
    elif kind == "sd2":
        config = dict(
            block_out_channels=(32, 48, 64),
            down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
            attention_head_dim=(2, 4, 8),
            use_linear_projection=True,
        )
    elif kind == "sdxl":
        config = dict(
            block_out_channels=(32, 48, 64),
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            attention_head_dim=(2, 4, 8),
            use_linear_projection=True,
            transformer_layers_per_block=(1, 2, 2),
            addition_embed_type="text_time",
            addition_time_embed_dim=8,
            projection_class_embeddings_input_dim=CROSS_DIM + 6 * 8,
        )
    else:
        raise ValueError(f"Expected kind sd15, sd2 or sdxl, but got {kind!r}.")
    unet = UNet2DConditionModel(**common, **config).eval()
    return unet


def unet_inputs(unet: UNet2DConditionModel, batch: int = 2, height: int = 16, width: int = 16, seed: int = 0):
    """(sample, timestep, encoder_hidden_states, added_cond_kwargs) for one forward."""
    g = torch.Generator().manual_seed(seed)
    sample = torch.randn(batch, 4, height, width, generator=g)
    text = torch.randn(batch, 7, CROSS_DIM, generator=g)
    added = None
    if unet.config.addition_embed_type == "text_time":
        added = {
            "text_embeds": torch.randn(batch, CROSS_DIM, generator=g),
            "time_ids": torch.randn(batch, 6, generator=g),
        }
    return sample, torch.tensor(500), text, added


def run_unet(unet, sample, timestep, text, added=None, keyword: bool = False) -> torch.Tensor:
    with torch.no_grad():
        if keyword:
            return unet(sample=sample, timestep=timestep, encoder_hidden_states=text, added_cond_kwargs=added).sample
        return unet(sample, timestep, encoder_hidden_states=text, added_cond_kwargs=added).sample
