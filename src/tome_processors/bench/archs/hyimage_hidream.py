"""HunyuanImage 2.1 and HiDream-I1 for `tome-processors bench --arch hunyuanimage` / `--arch hidream`."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import HiDreamImageTransformer2DModel, HunyuanImageTransformer2DModel

from . import Arch, ArchInputs

#: ByT5's glyph tokens, full size and `--quick`: HunyuanImagePipeline pads them to 128 (all masked where the prompt
#: quotes no text, as here); the model attends over them all the same.
HUNYUANIMAGE_GLYPH_TOKENS = (128, 4)

# HunyuanImage 2.1 (17 B): 20 double- and 40 single-stream blocks, 28 heads x 128 (3584 wide), patch (1, 1) over
# its VAE's 64 channels (32x in space), Qwen2.5-VL-7B's 3584-wide text and ByT5's 1472-wide glyph text, 2-D rotary
# axes 64 + 64. The "hunyuanimage2.1" transformer config of diffusers' scripts/convert_hunyuan_image_to_diffusers.py
# (mlp_ratio 4 and rope_theta 256 as the class's defaults).
_HUNYUANIMAGE = dict(
    in_channels=64,
    out_channels=64,
    num_attention_heads=28,
    attention_head_dim=128,
    num_layers=20,
    num_single_layers=40,
    num_refiner_layers=2,
    patch_size=(1, 1),
    qk_norm="rms_norm",
    guidance_embeds=False,
    text_embed_dim=3584,
    text_embed_2_dim=1472,
    rope_theta=256.0,
    rope_axes_dim=(64, 64),
)


def _hunyuanimage_inputs(given: ArchInputs) -> dict[str, Any]:
    """As HunyuanImagePipeline calls the model, one guidance branch: the latent, the timestep on 0..1000, Qwen's
    prompt (a long one: every token valid) and ByT5's glyph tokens, all masked (no quoted text)."""
    config, shape, device = given.config, given.shape, given.device
    batch, text = shape.batch, shape.text_tokens
    glyph = HUNYUANIMAGE_GLYPH_TOKENS[1 if given.quick else 0]
    return {
        "hidden_states": given.randn(batch, config.in_channels, shape.height, shape.width),
        "timestep": torch.full((batch,), 500.0, device=device, dtype=given.dtype),
        "encoder_hidden_states": given.randn(batch, text, config.text_embed_dim),
        "encoder_attention_mask": torch.ones(batch, text, dtype=torch.long, device=device),
        "encoder_hidden_states_2": given.randn(batch, glyph, config.text_embed_2_dim),
        "encoder_attention_mask_2": torch.zeros(batch, glyph, dtype=torch.long, device=device),
    }


# HiDream-I1 (17 B, Full / Dev / Fast): 16 double- and 32 single-stream blocks, 20 heads x 128 (2560 wide), a
# mixture of 4 experts (2 active) in every block's image feed-forward, patch 2 over the FLUX VAE's 16 channels,
# T5-XXL's and Llama-3.1-8B's 4096-wide text (a Llama layer per block: 0..31, then the last again), CLIP-L's and
# CLIP-G's pooled 768 + 1280, rotary axes 64 + 32 + 32. The transformer config of HiDream-ai/HiDream-I1-Full as
# diffusers' conversion script for it writes it (max_resolution 128 x 128 latent pixels: 4096 tokens).
_HIDREAM = dict(
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=16,
    num_single_layers=32,
    attention_head_dim=128,
    num_attention_heads=20,
    caption_channels=[4096, 4096],
    text_emb_dim=2048,
    num_routed_experts=4,
    num_activated_experts=2,
    axes_dims_rope=(64, 32, 32),
    max_resolution=(128, 128),
    llama_layers=tuple(range(32)) + (31,) * 16,
)


def _hidream_config(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with a Llama layer for each of its blocks (the model projects one per block: `llama_layers` is as
    long as the double- and single-stream blocks together), the first of the declared ones at a shallower depth."""
    blocks = config["num_layers"] + config["num_single_layers"]
    return {**config, "llama_layers": tuple(config["llama_layers"][:blocks])}


#: The Llama layers HiDreamImagePipeline stacks (Llama-3.1-8B's 32; `--quick`: 2).
HIDREAM_LLAMA_LAYERS = (32, 2)


def _hidream_inputs(given: ArchInputs) -> dict[str, Any]:
    """As HiDreamImagePipeline calls the model: both guidance halves in one batch (the bench's batch), a square
    latent (no padding, no mask), `timesteps` on 0..1000, T5's and Llama's prompts (`max_sequence_length` tokens
    each: the pipeline pads both), every Llama layer stacked first, the pooled CLIP embeddings."""
    config, shape = given.config, given.shape
    batch, text = shape.batch, shape.text_tokens
    layers = HIDREAM_LLAMA_LAYERS[1 if given.quick else 0]
    t5_width, llama_width = config.caption_channels
    return {
        "hidden_states": given.randn(batch, config.in_channels, shape.height, shape.width),
        "timesteps": torch.full((batch,), 500.0, device=given.device, dtype=given.dtype),
        "encoder_hidden_states_t5": given.randn(batch, text, t5_width),
        "encoder_hidden_states_llama3": given.randn(layers, batch, text, llama_width),
        "pooled_embeds": given.randn(batch, config.text_emb_dim),
    }


ARCHS = (
    Arch(
        name="hunyuanimage",
        model_class=HunyuanImageTransformer2DModel,
        full=_HUNYUANIMAGE,
        quick=dict(
            _HUNYUANIMAGE,
            in_channels=4,
            out_channels=4,
            num_attention_heads=2,
            attention_head_dim=16,
            num_layers=1,
            num_single_layers=2,
            num_refiner_layers=1,
            text_embed_dim=32,
            text_embed_2_dim=8,
            rope_axes_dim=(8, 8),
        ),  # fmt: skip
        text_tokens=1000,  # Qwen2.5-VL's prompt, padded to 1,000 (ByT5's 128 glyph tokens follow)
        inputs=_hunyuanimage_inputs,
        space_stride=32,
        notes="HunyuanImage 2.1: Qwen's 1,000 prompt tokens and ByT5's 128 glyph tokens (masked)",
    ),
    Arch(
        name="hidream",
        model_class=HiDreamImageTransformer2DModel,
        full=_HIDREAM,
        quick=dict(
            _HIDREAM,
            in_channels=4,
            out_channels=4,
            num_layers=1,
            num_single_layers=2,
            attention_head_dim=8,
            num_attention_heads=2,
            caption_channels=[16, 8],
            text_emb_dim=16,
            num_routed_experts=2,
            axes_dims_rope=(4, 2, 2),
            max_resolution=(32, 32),
            llama_layers=(0, 1, 1),
        ),  # fmt: skip
        text_tokens=128,  # T5's and Llama's prompts, each padded to max_sequence_length (128): 384 tokens in all
        inputs=_hidream_inputs,
        derived=_hidream_config,
        notes="HiDream-I1: 128 T5 and 2 x 128 Llama tokens (the last layer's and each block's own)",
    ),
)
