"""Lumina 2, Lumina-Next, AuraFlow, DiT, Hunyuan-DiT and FramePack for `tome-processors bench --arch NAME`, called as
their pipelines call them (`--arch lumina2`, `lumina-next`, `auraflow`, `dit-imagenet`, `hunyuandit`,
`hunyuanvideo-framepack`)."""

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
from diffusers.models.embeddings import get_2d_rotary_pos_embed, get_2d_rotary_pos_embed_lumina

from . import Arch, ArchInputs, VideoClip, centred_region

# Lumina-Image 2.0 (2.6 B; Alpha-VLLM/Lumina-Image-2.0, transformer/config.json as quoted by a public test of another
# runtime): 2 refiner blocks each for the image and the caption, 26 main layers of 24 heads x 96 (2304 wide, 8
# key/value heads), patch 2 over FLUX's VAE's 16 channels, Gemma-2-2B's 2304-wide caption, rotary axes 32 x 3.
LUMINA2 = dict(
    sample_size=128,
    patch_size=2,
    in_channels=16,
    out_channels=None,
    hidden_size=2304,
    num_layers=26,
    num_refiner_layers=2,
    num_attention_heads=24,
    num_kv_heads=8,
    multiple_of=256,
    ffn_dim_multiplier=None,
    norm_eps=1e-5,
    scaling_factor=1.0,
    axes_dim_rope=(32, 32, 32),
    axes_lens=(300, 512, 512),
    cap_feat_dim=2304,
)
LUMINA2_QUICK = dict(
    LUMINA2, in_channels=4, hidden_size=24, num_layers=2, num_refiner_layers=1, num_attention_heads=3, num_kv_heads=1,
    multiple_of=2, axes_dim_rope=(4, 2, 2), axes_lens=(128, 128, 128), cap_feat_dim=32,
)  # fmt: skip

# Lumina-Next-SFT (2 B; Alpha-VLLM/Lumina-Next-SFT-diffusers): the config diffusers'
# scripts/convert_lumina_to_diffusers.py writes: 24 layers of 32 heads x 72 (2304 wide, 8 key/value heads), patch 2
# over SDXL's VAE's 4 channels, learned sigma, Gemma-2B's 2048-wide caption.
LUMINA_NEXT = dict(
    sample_size=128,
    patch_size=2,
    in_channels=4,
    hidden_size=2304,
    num_layers=24,
    num_attention_heads=32,
    num_kv_heads=8,
    multiple_of=256,
    ffn_dim_multiplier=None,
    norm_eps=1e-5,
    learn_sigma=True,
    qk_norm=True,
    cross_attention_dim=2048,
    scaling_factor=1.0,
)
LUMINA_NEXT_QUICK = dict(
    LUMINA_NEXT, hidden_size=24, num_layers=2, num_attention_heads=3, num_kv_heads=1, multiple_of=16,
    cross_attention_dim=32,
)  # fmt: skip

# AuraFlow v0.3 (6.8 B; fal/AuraFlow-v0.3, transformer/config.json as quoted by a public training repository): 4 joint
# and 32 single-stream blocks of 12 heads x 256 (3072 wide), patch 2 over SDXL's VAE's 4 channels, learned positions for
# up to 96 x 96 tokens, Pile-T5-XL's 2048-wide text.
AURAFLOW = dict(
    sample_size=64,
    patch_size=2,
    in_channels=4,
    num_mmdit_layers=4,
    num_single_dit_layers=32,
    attention_head_dim=256,
    num_attention_heads=12,
    joint_attention_dim=2048,
    caption_projection_dim=3072,
    out_channels=4,
    pos_embed_max_size=9216,
)
AURAFLOW_QUICK = dict(
    AURAFLOW, num_mmdit_layers=1, num_single_dit_layers=2, attention_head_dim=8, num_attention_heads=4,
    joint_attention_dim=32, caption_projection_dim=32,
)  # fmt: skip

# DiT-XL/2 (675 M; facebook/DiT-XL-2-512): 28 blocks of 16 heads x 72 (1152 wide), patch 2 over SD's VAE's 4 channels,
# learned sigma, ImageNet's 1,000 classes; diffusers' scripts/convert_dit_to_diffusers.py builds it with the class's
# defaults and the checkpoint's sample size (64 latent pixels: 512 px).
DIT = dict(
    num_attention_heads=16,
    attention_head_dim=72,
    in_channels=4,
    out_channels=8,
    num_layers=28,
    attention_bias=True,
    sample_size=64,
    patch_size=2,
    activation_fn="gelu-approximate",
    num_embeds_ada_norm=1000,
    norm_type="ada_norm_zero",
    norm_elementwise_affine=False,
)
DIT_QUICK = dict(DIT, num_attention_heads=2, attention_head_dim=4, num_layers=2, sample_size=8, num_embeds_ada_norm=8)

# Hunyuan-DiT v1.2 (1.5 B; Tencent-Hunyuan/HunyuanDiT-v1.2-Diffusers, transformer/config.json as quoted by a public
# WebUI extension): 40 blocks of 16 heads x 88 (1408 wide), long skips over the second half, patch 2 over SDXL's VAE's 4
# channels, learned sigma, CLIP's 1024-wide (77 tokens) and mT5's 2048-wide (256 tokens) text.
HUNYUANDIT = dict(
    num_attention_heads=16,
    attention_head_dim=88,
    in_channels=4,
    patch_size=2,
    activation_fn="gelu-approximate",
    sample_size=128,
    hidden_size=1408,
    num_layers=40,
    mlp_ratio=4.3637,
    learn_sigma=True,
    cross_attention_dim=1024,
    norm_type="layer_norm",
    cross_attention_dim_t5=2048,
    pooled_projection_dim=1024,
    text_len=77,
    text_len_t5=256,
    use_style_cond_and_image_meta_size=False,
)
HUNYUANDIT_QUICK = dict(
    HUNYUANDIT, num_attention_heads=2, attention_head_dim=8, hidden_size=16, num_layers=4, cross_attention_dim=8,
    cross_attention_dim_t5=8, pooled_projection_dim=4,
)  # fmt: skip

# FramePack (lllyasviel/FramePackI2V_HY, HunyuanVideo's 13 B blocks; its transformer config as a public training
# script quotes it): 20 double- and 40 single-stream blocks of 24 heads x 128 (3072 wide), patch 1 x 2 x 2 over
# HunyuanVideo's VAE's 16 channels, Llama's 4096-wide text, CLIP-L's pooled 768, SigLIP's 1152-wide image tokens, the
# history patch embedder.
FRAMEPACK = dict(
    in_channels=16,
    out_channels=16,
    num_attention_heads=24,
    attention_head_dim=128,
    num_layers=20,
    num_single_layers=40,
    num_refiner_layers=2,
    mlp_ratio=4.0,
    patch_size=2,
    patch_size_t=1,
    qk_norm="rms_norm",
    guidance_embeds=True,
    text_embed_dim=4096,
    pooled_projection_dim=768,
    rope_theta=256.0,
    rope_axes_dim=(16, 56, 56),
    image_condition_type=None,
    has_image_proj=True,
    image_proj_dim=1152,
    has_clean_x_embedder=True,
)
FRAMEPACK_QUICK = dict(
    FRAMEPACK, in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10, num_layers=1,
    num_single_layers=1, num_refiner_layers=1, text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 4, 4),
    image_proj_dim=16,
)  # fmt: skip
#: SigLIP so400m-patch14-384's image tokens (27 x 27), full size and `--quick`.
FRAMEPACK_IMAGE_TOKENS = (729, 4)
#: The history FramePack's pipeline keeps: 16 latent frames at 4x, 2 at 2x, and the first frame's with 1 at 1x.
FRAMEPACK_HISTORY = (16, 2, 1)


def _hunyuandit_config(config: dict[str, Any]) -> dict[str, Any]:
    """`config` at an even depth above 1 (`--layers`): the second half's blocks each take a skip from the first half's,
    which an odd depth leaves one short of."""
    layers = config["num_layers"]
    return {**config, "num_layers": layers - 1 if layers > 1 and layers % 2 else layers}


def _timestep(a: ArchInputs, value: float) -> torch.Tensor:
    return torch.full((a.shape.batch,), value, device=a.device, dtype=a.dtype)


def _ones(a: ArchInputs, tokens: int) -> torch.Tensor:
    return torch.ones(a.shape.batch, tokens, dtype=torch.long, device=a.device)


def _latent(a: ArchInputs) -> torch.Tensor:
    s = a.shape
    return a.randn(s.batch, a.config.in_channels, s.height, s.width)


def _lumina2_inputs(a: ArchInputs) -> dict[str, Any]:
    """`Lumina2Pipeline`'s call, one guidance branch: the latent, `t = 1 - sigma`, Gemma 2's caption (the system prompt
    and a long prompt: every one of the `text_tokens` valid, as the model keeps only the valid ones)."""
    s = a.shape
    return {
        "hidden_states": _latent(a),
        "timestep": _timestep(a, 0.5),
        "encoder_hidden_states": a.randn(s.batch, s.text_tokens, a.config.cap_feat_dim),
        "encoder_attention_mask": _ones(a, s.text_tokens),
    }


def _lumina_next_inputs(a: ArchInputs) -> dict[str, Any]:
    """`LuminaPipeline`'s call: the latent, `t = 1 - sigma`, Gemma's caption padded to 256 (a long prompt: all valid),
    the pipeline's rotary table over 384 x 384 patches and proportional attention's base length (its 1024 px
    default)."""
    s, config = a.shape, a.config
    head_dim = config.hidden_size // config.num_attention_heads
    return {
        "hidden_states": _latent(a),
        "timestep": _timestep(a, 0.5),
        "encoder_hidden_states": a.randn(s.batch, s.text_tokens, config.cross_attention_dim),
        "encoder_mask": _ones(a, s.text_tokens),
        "image_rotary_emb": get_2d_rotary_pos_embed_lumina(head_dim, 384, 384).to(a.device),
        "cross_attention_kwargs": {"base_sequence_length": (config.sample_size * 8 // 16) ** 2},
    }


def _auraflow_inputs(a: ArchInputs) -> dict[str, Any]:
    """`AuraFlowPipeline`'s call: the latent, the T5 prompt padded to 256 (its padding zeroed: a long prompt here) and
    `t / 1000`."""
    s = a.shape
    return {
        "hidden_states": _latent(a),
        "encoder_hidden_states": a.randn(s.batch, s.text_tokens, a.config.joint_attention_dim),
        "timestep": _timestep(a, 0.5),
    }


def _dit_inputs(a: ArchInputs) -> dict[str, Any]:
    """`DiTPipeline`'s call: the square latent, the scheduler's timestep and the class labels (the null class, 1,000,
    for the unconditional half)."""
    classes, batch = a.config.num_embeds_ada_norm, a.shape.batch
    labels = torch.where(torch.arange(batch, device=a.device) < (batch + 1) // 2, 207 % classes, classes)
    return {
        "hidden_states": _latent(a),
        "timestep": torch.full((a.shape.batch,), 500, dtype=torch.long, device=a.device),
        "class_labels": labels,
    }


def _hunyuandit_inputs(a: ArchInputs) -> dict[str, Any]:
    """`HunyuanDiTPipeline`'s call: the latent, the timestep (0..1000), CLIP's and mT5's prompts at their padded
    lengths (`text_len`, `text_len_t5`) with their masks, the size conditions, the style and the rotary tables (the
    grid cropped from the pipeline's 512 px base)."""
    s, config = a.shape, a.config
    patch = config.patch_size
    h, w = s.height // patch, s.width // patch
    head_dim = config.hidden_size // config.num_attention_heads
    crops = centred_region((h, w), 512 // 8 // patch, 512 // 8 // patch)
    cos, sin = get_2d_rotary_pos_embed(head_dim, crops, (h, w), output_type="pt")
    side = 8.0 * s.height
    return {
        "hidden_states": _latent(a),
        "timestep": _timestep(a, 500.0),
        "encoder_hidden_states": a.randn(s.batch, config.text_len, config.cross_attention_dim),
        "text_embedding_mask": _ones(a, config.text_len),
        "encoder_hidden_states_t5": a.randn(s.batch, config.text_len_t5, config.cross_attention_dim_t5),
        "text_embedding_mask_t5": _ones(a, config.text_len_t5),
        "image_meta_size": torch.tensor([[1024.0, 1024.0, side, side, 0.0, 0.0]], device=a.device, dtype=a.dtype)
        .expand(s.batch, 6)
        .contiguous(),
        "style": torch.zeros(s.batch, dtype=torch.long, device=a.device),
        "image_rotary_emb": (cos.to(a.device), sin.to(a.device)),  # float32, as the pipeline makes them
    }


def _framepack_inputs(a: ArchInputs) -> dict[str, Any]:
    """`HunyuanVideoFramepackPipeline`'s call (`vanilla` sampling): one section's latent clip, the timestep (0..1000),
    Llama's prompt (a long one: all 256 tokens valid), CLIP's pooled projection, SigLIP's image tokens, the distilled
    guidance (6.0 x 1000) and the history's latents with every latent frame's index."""
    s, config = a.shape, a.config
    long, mid, short = FRAMEPACK_HISTORY
    indices = torch.arange(1 + long + mid + short + s.frames, device=a.device)
    prefix, long_at, mid_at, short_at, clip_at = indices.split([1, long, mid, short, s.frames])
    image_tokens = FRAMEPACK_IMAGE_TOKENS[1 if a.quick else 0]

    def latent(frames: int) -> torch.Tensor:
        return a.randn(s.batch, config.in_channels, frames, s.height, s.width)

    return {
        "hidden_states": latent(s.frames),
        "timestep": _timestep(a, 500.0),
        "encoder_hidden_states": a.randn(s.batch, s.text_tokens, config.text_embed_dim),
        "encoder_attention_mask": _ones(a, s.text_tokens),
        "pooled_projections": a.randn(s.batch, config.pooled_projection_dim),
        "image_embeds": a.randn(s.batch, image_tokens, config.image_proj_dim),
        "indices_latents": clip_at,
        "guidance": _timestep(a, 6000.0),
        "latents_clean": latent(1 + short),
        "indices_latents_clean": torch.cat([prefix, short_at]),
        "latents_history_2x": latent(mid),
        "indices_latents_history_2x": mid_at,
        "latents_history_4x": latent(long),
        "indices_latents_history_4x": long_at,
    }


ARCHS = (
    Arch(
        name="lumina2",
        model_class=Lumina2Transformer2DModel,
        full=LUMINA2,
        quick=LUMINA2_QUICK,
        text_tokens=256,  # Gemma 2's caption, padded to max_sequence_length (256); a long one fills it
        inputs=_lumina2_inputs,
        depth_fields=("num_layers", "num_refiner_layers"),
        notes="Lumina-Image 2.0: the system prompt and a long prompt (256 caption tokens, all valid)",
    ),
    Arch(
        name="lumina-next",
        model_class=LuminaNextDiT2DModel,
        full=LUMINA_NEXT,
        quick=LUMINA_NEXT_QUICK,
        text_tokens=256,  # Gemma's prompt, padded to 256
        inputs=_lumina_next_inputs,
        depth_fields=("num_layers",),
        notes="Lumina-Next-SFT with proportional attention; cross-attention not merged",
    ),
    Arch(
        name="auraflow",
        model_class=AuraFlowTransformer2DModel,
        full=AURAFLOW,
        quick=AURAFLOW_QUICK,
        text_tokens=256,  # Pile-T5's prompt, padded to 256 (the model puts 8 register tokens ahead of it)
        inputs=_auraflow_inputs,
        depth_fields=("num_mmdit_layers", "num_single_dit_layers"),
        notes="AuraFlow v0.3: 8 register and 256 prompt tokens",
    ),
    Arch(
        name="dit-imagenet",
        model_class=DiTTransformer2DModel,
        full=DIT,
        quick=DIT_QUICK,
        text_tokens=0,  # class-conditional: no text
        inputs=_dit_inputs,
        depth_fields=("num_layers",),
        notes="DiT-XL/2 (generates at 512 px: sample_size 64); square latents only",
    ),
    Arch(
        name="hunyuandit",
        model_class=HunyuanDiT2DModel,
        full=HUNYUANDIT,
        quick=HUNYUANDIT_QUICK,
        text_tokens=77 + 256,  # CLIP's 77 and mT5's 256 tokens (the model's text_len and text_len_t5)
        inputs=_hunyuandit_inputs,
        depth_fields=("num_layers",),
        derived=_hunyuandit_config,
        notes="Hunyuan-DiT v1.2: cross-attention to 77 CLIP and 256 mT5 tokens, not merged",
    ),
    Arch(
        name="hunyuanvideo-framepack",
        model_class=HunyuanVideoFramepackTransformer3DModel,
        full=FRAMEPACK,
        quick=FRAMEPACK_QUICK,
        text_tokens=256,  # Llama's prompt, padded to max_sequence_length (256)
        inputs=_framepack_inputs,
        # The pipeline's defaults: 720 x 1280 px, sections of latent_window_size 9 (33 pixel frames).
        video=VideoClip(height=720, width=1280, frames=33),
        depth_fields=("num_layers", "num_single_layers"),
        notes="FramePack (HunyuanVideo I2V): one section, after 16 + 2 + 2 history latent frames (never merged)",
    ),
)
