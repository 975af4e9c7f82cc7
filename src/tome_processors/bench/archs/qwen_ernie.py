"""Qwen-Image 2.1 and ERNIE-Image: single-stream transformers over the prompt's and the image's tokens, one token per
16 x 16 px (`space_stride` 16, `patch_size` 1)."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import ErnieImageTransformer2DModel, QwenImage21Transformer2DModel
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

from . import Arch, ArchInputs

#: Latent tokens per vision-language image slot of Qwen-Image 2.1's joint sequence (2 x 2).
_SLOT = 4


def qwenimage21_inputs(a: ArchInputs) -> dict[str, Any]:
    """As `QwenImage21Pipeline` calls the model after its first step: the generated image's tokens alone against the
    prompt's keys and values, which the first step cached (`kv_cache_mode="cached"`; the pipeline's default). The
    cache is filled here, with one forward over the whole sequence (`"extract"`), as that step does. The latent's
    sides are even (the pipeline sizes them `2 * (pixels // 32)`), the prompt unpadded (one prompt a call)."""
    shape, config = a.shape, a.config
    h, w = 2 * max(shape.height // 2, 1), 2 * max(shape.width // 2, 1)
    tokens, text = h * w, shape.text_tokens
    inputs = {
        "hidden_states": a.randn(shape.batch, tokens, config.in_channels),
        "encoder_hidden_states": a.randn(shape.batch, text, config.context_in_dim),
        "timestep": torch.full((shape.batch,), 0.5, device=a.device, dtype=a.dtype),  # the pipeline's t / 1000
        "img_shapes": [[(1, h, w)]] * shape.batch,
        "img_mask": torch.cat(
            [
                torch.zeros(shape.batch, text, dtype=torch.bool),
                torch.ones(shape.batch, tokens // _SLOT, dtype=torch.bool),
            ],
            dim=1,
        ).to(a.device),
        "kv_cache": QwenImage21KVCache(len(a.model.transformer_blocks)),
    }
    with torch.no_grad():
        a.model(**inputs, kv_cache_mode="extract")
    return {**inputs, "kv_cache_mode": "cached"}


def ernie_image_inputs(a: ArchInputs) -> dict[str, Any]:
    """As `ErnieImagePipeline` calls the model: the latent packed 2 x 2 by the pipeline (`in_channels` 128), the
    scheduler's 0..1000 timestep, the prompts' embeddings (one length: `text_lens` all `text_tokens`)."""
    shape, config = a.shape, a.config
    return {
        "hidden_states": a.randn(shape.batch, config.in_channels, shape.height, shape.width),
        "timestep": torch.full((shape.batch,), 500.0, device=a.device, dtype=a.dtype),
        "text_bth": a.randn(shape.batch, shape.text_tokens, config.text_in_dim),
        "text_lens": torch.full((shape.batch,), shape.text_tokens, device=a.device),
    }


ARCHS = (
    Arch(
        name="qwenimage21",
        model_class=QwenImage21Transformer2DModel,
        # Qwen-Image 2.1: 32 single-stream blocks, 4096 wide (32 heads of 128), Qwen3-VL's 4096-wide text. The
        # class's defaults in diffusers 0.42.1; the published transformer/config.json that tools check against
        # (QwenLM's release) holds the same fields (num_layers 32, num_attention_heads 32, attention_head_dim 128,
        # context_in_dim 4096, in_channels 64, mlp_ratio 3, axes_dims_rope (16, 56, 56), causal_condition true).
        full=dict(
            patch_size=1,
            in_channels=64,
            out_channels=64,
            num_layers=32,
            attention_head_dim=128,
            num_attention_heads=32,
            context_in_dim=4096,
            mlp_ratio=3,
            axes_dims_rope=(16, 56, 56),
            causal_condition=True,
        ),
        # diffusers' own test configuration (tests/models/transformers/test_models_transformer_qwenimage21.py).
        quick=dict(
            patch_size=1,
            in_channels=4,
            out_channels=4,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            context_in_dim=8,
            mlp_ratio=2,
            axes_dims_rope=(4, 6, 6),
        ),
        # The chat template around a long prompt, its system part dropped (inferred: the pipeline pads nothing).
        text_tokens=128,
        inputs=qwenimage21_inputs,
        depth_fields=("num_layers",),
        space_stride=16,
        notes="a step after the first: the generated image's tokens against the cached prompt",
    ),
    Arch(
        name="ernie_image",
        model_class=ErnieImageTransformer2DModel,
        # ERNIE-Image (8 B): 36 single-stream blocks, 4096 wide (32 heads), Mistral-3's 3072-wide text; from
        # baidu/ERNIE-Image's transformer/config.json (as its copies on the Hub hold it).
        full=dict(
            hidden_size=4096,
            num_attention_heads=32,
            num_layers=36,
            ffn_hidden_size=12288,
            in_channels=128,
            out_channels=128,
            patch_size=1,
            text_in_dim=3072,
            rope_theta=256,
            rope_axes_dim=(32, 48, 48),
            eps=1e-6,
            qk_layernorm=True,
        ),
        # diffusers' own test configuration (test_models_transformer_ernie_image.py) at two heads and two layers.
        quick=dict(
            hidden_size=32,
            num_attention_heads=2,
            num_layers=2,
            ffn_hidden_size=32,
            in_channels=16,
            out_channels=16,
            patch_size=1,
            text_in_dim=16,
            rope_theta=256,
            rope_axes_dim=(8, 4, 4),
        ),
        # A long prompt's tokens (inferred: the pipeline pads nothing; its prompt enhancer writes long prompts).
        text_tokens=128,
        inputs=ernie_image_inputs,
        depth_fields=("num_layers",),
        space_stride=16,
        notes="diffusers zero-initialises its modulation and output projection: random weights output zeros, so the "
        "output change reads 0 (the speed is the real model's)",
    ),
)
