"""Bria (`bria`), Bria Fibo (`bria_fibo`), Bria Fibo 2 (`bria_fibo2`), GLM-Image (`glm_image`), Ideogram 4
(`ideogram4`), Nucleus-MoE-Image (`nucleusmoe_image`), PRX (`prx`) and Ovis-Image (`ovis_image`) on the bench.

Each model gets its image as its pipeline passes it (packed 2 x 2 latent pixels a token, one token per latent pixel of
Fibo's 16x VAE, or the 4-D latent the model patches itself) and the prompt's tokens at the length its pipeline pads
or typically passes.

Example:
    >>> from tome_processors.bench.dit import build_transformer, make_transformer_inputs
    >>> model = build_transformer("ideogram4", quick=True)
    >>> inputs = make_transformer_inputs(model, "ideogram4", batch=1, resolution=64, text_tokens=8)
    >>> tuple(inputs.kwargs["position_ids"].shape), tuple(inputs.run(model).shape)
    ((1, 24, 3), (1, 24, 16))
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import (
    BriaFibo2Transformer2DModel,
    BriaFiboTransformer2DModel,
    BriaTransformer2DModel,
    GlmImageTransformer2DModel,
    Ideogram4Transformer2DModel,
    NucleusMoEImageTransformer2DModel,
    OvisImageTransformer2DModel,
    PRXTransformer2DModel,
)
from diffusers.models.transformers.transformer_ideogram4 import (
    IMAGE_POSITION_OFFSET,
    LLM_TOKEN_INDICATOR,
    OUTPUT_IMAGE_INDICATOR,
    SEQUENCE_PADDING_INDICATOR,
)

from . import Arch, ArchInputs

#: Latent pixels per token side where the pipeline packs the latent itself.
PACK = 2


def _timestep(a: ArchInputs, value: float) -> torch.Tensor:
    return torch.full((a.shape.batch,), value, device=a.device, dtype=a.dtype)


def _grid_ids(h: int, w: int, device: torch.device | str) -> torch.Tensor:
    """FLUX.1's pipelines' `img_ids`, `(0, row, column)` per token of a row-major `h x w` grid."""
    ids = torch.zeros(h, w, 3, device=device)
    ids[..., 1] = torch.arange(h, device=device)[:, None]
    ids[..., 2] = torch.arange(w, device=device)[None]
    return ids.view(h * w, 3)


def _prompt_valid(a: ArchInputs) -> torch.Tensor:
    """`(B, T)`: a prompt of a quarter of the padded length, then padding."""
    valid = torch.zeros(a.shape.batch, a.shape.text_tokens, dtype=torch.bool, device=a.device)
    valid[:, : max(1, a.shape.text_tokens // 4)] = True
    return valid


def bria_inputs(a: ArchInputs) -> dict[str, Any]:
    """As `BriaPipeline` calls the model: packed tokens, the zero-padded T5 prompt (no mask), zero text ids, the
    scheduler's 0..1000 timestep."""
    shape, config = a.shape, a.config
    h, w = shape.height // PACK, shape.width // PACK
    return {
        "hidden_states": a.randn(shape.batch, h * w, config.in_channels),
        "encoder_hidden_states": a.randn(shape.batch, shape.text_tokens, config.joint_attention_dim),
        "timestep": _timestep(a, 500.0),
        "img_ids": _grid_ids(h, w, a.device),
        "txt_ids": torch.zeros(shape.text_tokens, 3, device=a.device),
    }


def ovis_inputs(a: ArchInputs) -> dict[str, Any]:
    """As `OvisImagePipeline` calls the model (one guidance branch): packed tokens, `t / 1000`, zero text ids."""
    inputs = bria_inputs(a)
    return {**inputs, "timestep": _timestep(a, 0.5)}


def bria_fibo_inputs(a: ArchInputs) -> dict[str, Any]:
    """As `BriaFiboPipeline` calls the model: one token per latent pixel of the Wan 2.2 VAE, the text's last two
    layers, one text layer per block, and a key-padding mask over `[text; image]` (a prompt a quarter of the length of
    the guidance batch's longest)."""
    shape, config = a.shape, a.config
    h, w = shape.height, shape.width
    blocks = config.num_layers + config.num_single_layers
    mask = torch.cat([_prompt_valid(a), torch.ones(shape.batch, h * w, dtype=torch.bool, device=a.device)], dim=1)
    return {
        "hidden_states": a.randn(shape.batch, h * w, config.in_channels),
        "encoder_hidden_states": a.randn(shape.batch, shape.text_tokens, config.joint_attention_dim),
        "text_encoder_layers": [a.randn(shape.batch, shape.text_tokens, config.text_encoder_dim)] * blocks,
        "timestep": _timestep(a, 500.0),
        "img_ids": _grid_ids(h, w, a.device),
        "txt_ids": torch.zeros(shape.text_tokens, 3, device=a.device),
        "joint_attention_kwargs": {"attention_mask": mask[:, None, None, :]},
    }


def bria_fibo2_inputs(a: ArchInputs) -> dict[str, Any]:
    """As `BriaFibo2Pipeline` calls the model (one guidance branch): the 4-D latent, the noise level in 0..1, the text
    bundles (the Perceiver's, then one per injection block), no padding."""
    shape, config = a.shape, a.config
    bundles = 1 + len(config.injection_layer_ids)
    return {
        "hidden_states": a.randn(shape.batch, config.in_channels, shape.height, shape.width),
        "timestep": _timestep(a, 0.5),
        "encoder_hidden_states": a.randn(shape.batch, bundles, shape.text_tokens, config.cap_feat_dim),
    }


def glm_image_inputs(a: ArchInputs) -> dict[str, Any]:
    """As `GlmImagePipeline` calls the model (one guidance branch): the 4-D latent, the glyph text, a prior token per
    patch, the scheduler's timestep less one, the image size to make (`target_size`)."""
    shape, config = a.shape, a.config
    patch = config.patch_size
    tokens = (shape.height // patch) * (shape.width // patch)
    size = torch.tensor([[8.0 * shape.height, 8.0 * shape.width]], device=a.device).expand(shape.batch, 2)
    return {
        "hidden_states": a.randn(shape.batch, config.in_channels, shape.height, shape.width),
        "encoder_hidden_states": a.randn(shape.batch, shape.text_tokens, config.text_embed_dim),
        "prior_token_id": torch.arange(tokens, device=a.device).remainder(config.prior_vq_quantizer_codebook_size)
        .expand(shape.batch, tokens),
        "prior_token_drop": torch.zeros(shape.batch, tokens, dtype=torch.bool, device=a.device),
        "timestep": _timestep(a, 499.0),
        "target_size": size.to(a.dtype),
        "crop_coords": torch.zeros(shape.batch, 2, device=a.device, dtype=a.dtype),
    }  # fmt: skip


def ideogram4_inputs(a: ArchInputs) -> dict[str, Any]:
    """As `Ideogram4Pipeline` calls its conditional model: `text_tokens` left-padded text slots (a prompt of a quarter
    of them), then the packed image; ids, segments and roles as its `_prepare_ids` lays them out; model time 0.5."""
    shape, config, device = a.shape, a.config, a.device
    h, w = shape.height // PACK, shape.width // PACK
    slots, real = shape.text_tokens, max(1, shape.text_tokens // 4)
    seq = slots + h * w
    image = _grid_ids(h, w, device).long() + IMAGE_POSITION_OFFSET  # (t, h, w), every axis from the offset
    text = torch.arange(real, device=device)[:, None].expand(real, 3)
    position_ids = torch.cat([torch.zeros(slots - real, 3, dtype=torch.long, device=device), text, image])
    indicator = torch.zeros(seq, dtype=torch.long, device=device)
    indicator[slots - real : slots], indicator[slots:] = LLM_TOKEN_INDICATOR, OUTPUT_IMAGE_INDICATOR
    segment_ids = torch.full((seq,), SEQUENCE_PADDING_INDICATOR, dtype=torch.long, device=device)
    segment_ids[slots - real :] = 1
    return {
        "hidden_states": a.randn(shape.batch, seq, config.in_channels),
        "timestep": _timestep(a, 0.5),
        "encoder_hidden_states": a.randn(shape.batch, seq, config.llm_features_dim),
        "position_ids": position_ids.expand(shape.batch, seq, 3),
        "segment_ids": segment_ids.expand(shape.batch, seq),
        "indicator": indicator.expand(shape.batch, seq),
    }


def nucleusmoe_inputs(a: ArchInputs) -> dict[str, Any]:
    """As `NucleusMoEImagePipeline` calls the model (one guidance branch): packed tokens, `img_shapes`, the prompt
    unpadded (one prompt a call: no mask), `t / 1000`."""
    shape, config = a.shape, a.config
    h, w = shape.height // PACK, shape.width // PACK
    return {
        "hidden_states": a.randn(shape.batch, h * w, config.in_channels),
        "img_shapes": [(1, h, w)] * shape.batch,
        "encoder_hidden_states": a.randn(shape.batch, shape.text_tokens, config.joint_attention_dim),
        "timestep": _timestep(a, 0.5),
    }


def prx_inputs(a: ArchInputs) -> dict[str, Any]:
    """As `PRXPipeline` calls the model: the 4-D latent, `t / 1000`, the padded prompt and its mask `(B, T)`."""
    shape, config = a.shape, a.config
    return {
        "hidden_states": a.randn(shape.batch, config.in_channels, shape.height, shape.width),
        "timestep": _timestep(a, 0.5),
        "encoder_hidden_states": a.randn(shape.batch, shape.text_tokens, config.context_in_dim),
        "attention_mask": _prompt_valid(a),
    }


# BRIA 3.2 (4 B): no published transformer config in reach; the class's defaults (FLUX.1's shape: 19 double- and 38
# single-stream blocks of 24 heads of 128) with T5-XXL's 4096-wide text (inferred).
BRIA_FULL: dict[str, Any] = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=4096, axes_dims_rope=[16, 56, 56],
)  # fmt: skip
# Bria FIBO: briaai/Fibo-Edit's transformer/config.json (as its 4-bit copy, boredcoder/Fibo-Edit-4bit, publishes it):
# 8 double- and 38 single-stream blocks, 24 heads of 128, 48 input channels (the Wan 2.2 VAE's), SmolLM3's 2048-wide
# layers.
BRIA_FIBO_FULL: dict[str, Any] = dict(
    patch_size=1, in_channels=48, num_layers=8, num_single_layers=38, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=4096, axes_dims_rope=[16, 56, 56], text_encoder_dim=2048,
)  # fmt: skip
# Bria Fibo 2.0: the class's defaults, which its pipeline's docs describe as the released model's (inferred): 44 blocks
# (5 injection) and 2 refiner blocks of 3584 (28 heads), Qwen3-VL's 7680-wide stacked text.
BRIA_FIBO2_FULL: dict[str, Any] = dict(
    in_channels=32, patch_size=2, dim=3584, n_layers=44, n_refiner_layers=2, n_heads=28, cap_feat_dim=7680,
    injection_layer_ids=(6, 14, 22, 30, 38), perceiver_num_layers=2,
)  # fmt: skip
# GLM-Image's 7 B decoder (zai-org/GLM-Image transformer/config.json as sglang's and FastVideo's GlmImage configs
# declare it): 30 blocks of 32 heads of 128, the glyph encoder's 1472-wide text.
GLM_IMAGE_FULL: dict[str, Any] = dict(
    patch_size=2, in_channels=16, out_channels=16, num_layers=30, attention_head_dim=128, num_attention_heads=32,
    text_embed_dim=1472, time_embed_dim=512, condition_dim=256, prior_vq_quantizer_codebook_size=16384,
)  # fmt: skip
# Ideogram 4: the class's defaults (no published config in reach; inferred): 34 blocks of 18 heads of 256, 13 tapped
# Qwen3-VL layers as 53248-wide text features.
IDEOGRAM4_FULL: dict[str, Any] = dict(
    in_channels=128, num_layers=34, attention_head_dim=256, num_attention_heads=18, intermediate_size=12288,
    adaln_dim=512, llm_features_dim=53248, rope_theta=5_000_000, mrope_section=(24, 20, 20),
)  # fmt: skip
# Nucleus-Image (17 B, mixture of experts): its transformer/config.json (FenomAI/Nucleus-Image): 32 blocks of 16 query
# and 4 key/value heads of 128, the first three dense, 64 experts of 1344.
NUCLEUSMOE_FULL: dict[str, Any] = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=32, attention_head_dim=128, num_attention_heads=16,
    num_key_value_heads=4, joint_attention_dim=4096, axes_dims_rope=(16, 56, 56), mlp_ratio=4.0, moe_enabled=True,
    dense_moe_strategy="leave_first_three_blocks_dense", num_experts=64, moe_intermediate_dim=1344,
    capacity_factors=[0.0, 0.0, 0.0, 4.0, 4.0] + [2.0] * 27, use_grouped_mm=True,
)  # fmt: skip
# PRX (1.3 B): the class's defaults (no published config in reach; inferred): 16 blocks of 1792 (28 heads of 64),
# T5Gemma's 2304-wide text, FLUX.1's 16-channel VAE.
PRX_FULL: dict[str, Any] = dict(
    in_channels=16, patch_size=2, context_in_dim=2304, hidden_size=1792, mlp_ratio=3.5, num_heads=28, depth=16,
    axes_dim=[32, 32],
)  # fmt: skip
# Ovis-Image (7 B): 6 double- and 27 single-stream blocks of 24 heads of 128, Qwen3's 2048-wide text (its
# transformer/config.json as FastVideo's OvisImage config declares it; the class's defaults).
OVIS_FULL: dict[str, Any] = dict(
    patch_size=1, in_channels=64, out_channels=64, num_layers=6, num_single_layers=27, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=2048, axes_dims_rope=(16, 56, 56),
)  # fmt: skip

#: One double- and two single-stream blocks of 2 heads of 16 (the quick FLUX.1-shaped configurations).
_TINY_FLUX = dict(
    num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2, axes_dims_rope=[4, 6, 6]
)

ARCHS = (
    Arch(
        name="bria",
        model_class=BriaTransformer2DModel,
        full=BRIA_FULL,
        quick=dict(BRIA_FULL, in_channels=16, joint_attention_dim=16, **_TINY_FLUX),
        text_tokens=128,  # BriaPipeline pads the prompt to max_sequence_length (128)
        inputs=bria_inputs,
        notes="FLUX.1's blocks; the T5 prompt zero-padded, no mask",
    ),
    Arch(
        name="bria_fibo",
        model_class=BriaFiboTransformer2DModel,
        full=BRIA_FIBO_FULL,
        quick=dict(BRIA_FIBO_FULL, in_channels=16, joint_attention_dim=32, text_encoder_dim=16, **_TINY_FLUX),
        text_tokens=1024,  # a structured JSON caption, padded to the guidance batch's longest (inferred)
        inputs=bria_fibo_inputs,
        space_stride=16,
        notes="FLUX.1-shaped blocks over 16x latent pixels; a key-padding mask over the text",
    ),
    Arch(
        name="bria_fibo2",
        model_class=BriaFibo2Transformer2DModel,
        full=BRIA_FIBO2_FULL,
        quick=dict(in_channels=4, patch_size=2, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2, cap_feat_dim=24,
                   injection_layer_ids=(1,), perceiver_num_layers=1, min_num_gist_tokens=4, max_num_gist_tokens=8,
                   gist_step=4, gist_min_text_len=4, gist_max_text_len=16, axes_dims=(4, 6, 6),
                   axes_lens=(64, 64, 64)),
        text_tokens=512,  # a structured caption of about 500 tokens (inferred): 320 gist tokens in the blocks
        inputs=bria_fibo2_inputs,
        depth_fields=("n_layers", "n_refiner_layers"),
        notes="Z-Image-like refiner, then blocks over [gist; image]",
    ),
    Arch(
        name="glm_image",
        model_class=GlmImageTransformer2DModel,
        full=GLM_IMAGE_FULL,
        quick=dict(GLM_IMAGE_FULL, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
                   num_attention_heads=2, text_embed_dim=16, time_embed_dim=16, condition_dim=8,
                   prior_vq_quantizer_codebook_size=32),
        text_tokens=32,  # the glyph encoder reads the prompt's quoted text only (inferred: a short sign)
        inputs=glm_image_inputs,
        depth_fields=("num_layers",),
        notes="text then image in one attention, rotary over the image only",
    ),
    Arch(
        name="ideogram4",
        model_class=Ideogram4Transformer2DModel,
        full=IDEOGRAM4_FULL,
        quick=dict(in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=4, intermediate_size=32,
                   adaln_dim=16, llm_features_dim=24, rope_theta=10_000, mrope_section=(2, 1, 1)),
        text_tokens=2048,  # Ideogram4Pipeline packs max_sequence_length (2048) left-padded text slots every call
        inputs=ideogram4_inputs,
        depth_fields=("num_layers",),
        notes="one packed [padding; text; image] sequence; block-diagonal segment mask",
    ),
    Arch(
        name="nucleusmoe_image",
        model_class=NucleusMoEImageTransformer2DModel,
        full=NUCLEUSMOE_FULL,
        quick=dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16,
                   num_attention_heads=4, num_key_value_heads=2, joint_attention_dim=16, axes_dims_rope=(8, 4, 4),
                   moe_enabled=False, capacity_factors=[8.0, 8.0]),
        text_tokens=256,  # the chat-templated prompt, padded to a multiple of 8 (inferred)
        inputs=nucleusmoe_inputs,
        depth_fields=("num_layers",),
        notes="image queries over image then text keys; expert-choice MoE feed-forwards",
    ),
    Arch(
        name="prx",
        model_class=PRXTransformer2DModel,
        full=PRX_FULL,
        quick=dict(in_channels=4, patch_size=2, context_in_dim=16, hidden_size=32, mlp_ratio=2.0, num_heads=2, depth=2,
                   axes_dim=[8, 8]),
        text_tokens=256,  # the tokenizer's padded length (inferred)
        inputs=prx_inputs,
        depth_fields=("depth",),
        notes="image queries over text then image keys; 2x2 rotations per token",
    ),
    Arch(
        name="ovis_image",
        model_class=OvisImageTransformer2DModel,
        full=OVIS_FULL,
        quick=dict(OVIS_FULL, in_channels=16, out_channels=16, joint_attention_dim=16, **_TINY_FLUX),
        text_tokens=256,  # OvisImagePipeline pads the prompt to max_sequence_length (256)
        inputs=ovis_inputs,
        notes="FLUX.1's blocks, Qwen3 text",
    ),
)  # fmt: skip
