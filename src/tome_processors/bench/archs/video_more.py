"""Cosmos Predict 2.5, MiniMax-H3, Allegro, EasyAnimate, Latte and Mochi 1 for the bench, each called as its pipeline
calls it at the pipeline's default clip. Cosmos 3 has no architecture here: ToMe refuses it (`families.REFUSED`), so
there is nothing to bench.

Cosmos's released config concatenates a padding mask to the latent, which its forward resizes with torchvision: the
full-size row needs torchvision installed (`--quick` leaves the mask out).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch
from diffusers import (
    AllegroTransformer3DModel,
    CosmosTransformer3DModel,
    EasyAnimateTransformer3DModel,
    LatteTransformer3DModel,
    MiniMaxH3Transformer3DModel,
    MochiTransformer3DModel,
)

from . import Arch, ArchInputs, VideoClip

# Cosmos-Predict2.5-2B (nvidia/Cosmos-Predict2.5-2B, "Cosmos-2.5-Predict-Base-2B" in diffusers'
# scripts/convert_cosmos_to_diffusers.py): 28 blocks of 16 heads x 128, the condition-mask and padding-mask channels,
# Cosmos-Reason1's 28 hidden layers of 3,584 (100,352 channels) projected to the cross-attention's 1,024. The padding
# mask is left out here (`concat_padding_mask=False`): the model resizes it with torchvision, which the bench does not
# need; it is one input channel of the patch embedding, the blocks are the same.
COSMOS_FULL = dict(
    in_channels=16 + 1, out_channels=16, num_attention_heads=16, attention_head_dim=128, num_layers=28, mlp_ratio=4.0,
    text_embed_dim=1024, adaln_lora_dim=256, max_size=(128, 240, 240), patch_size=(1, 2, 2), rope_scale=(1.0, 3.0, 3.0),
    concat_padding_mask=False, extra_pos_embed_type=None, use_crossattn_projection=True,
    crossattn_proj_in_channels=100352, encoder_hidden_states_channels=1024,
)  # fmt: skip
COSMOS_QUICK = dict(
    COSMOS_FULL, num_attention_heads=2, attention_head_dim=12, num_layers=2, text_embed_dim=16, adaln_lora_dim=4,
    concat_padding_mask=False, crossattn_proj_in_channels=32, encoder_hidden_states_channels=16,
)  # fmt: skip

# MiniMax-H3 (MiniMaxAI/MiniMax-H3, transformer/): the class's defaults, which its docstring gives as the released
# checkpoint's (50 blocks of 56 heads x 128 over a 5,376-wide stream, Qwen3-VL's 5,120-wide text); no config.json was
# found in the search corpora.
MINIMAX_H3_FULL = dict(
    num_attention_heads=56, attention_head_dim=128, hidden_size=5376, num_layers=50, num_refiner_layers=2,
    ffn_dim=14336, in_channels=24, audio_in_channels=32, patch_size=(1, 2, 2), text_dim=5120, freq_dim=256,
    time_embed_hidden_dim=5376, time_embed_dim=2688, rope_freq_dim=16,
)  # fmt: skip
MINIMAX_H3_QUICK = dict(
    MINIMAX_H3_FULL, num_attention_heads=2, attention_head_dim=16, hidden_size=24, num_layers=2, ffn_dim=32,
    in_channels=4, audio_in_channels=6, text_dim=8, freq_dim=8, time_embed_hidden_dim=24, time_embed_dim=16,
    rope_freq_dim=2,
)  # fmt: skip
#: MiniMax-H3's clip: 24 frames a second, 40 audio latents a second on each of its 2 channels, and its video VAE's
#: 5 latent frames per 17 pixel frames (and 2 more).
MINIMAX_FPS, MINIMAX_AUDIO_RATE, MINIMAX_AUDIO_CHANNELS = 24, 40, 2

# Allegro (rhymes-ai/Allegro, transformer/): the class's defaults, its 720p 88-frame clip's shape (32 blocks of
# 24 heads x 96, T5-XXL's 4,096-wide text projected to 2,304); no config.json was found in the search corpora.
ALLEGRO_FULL = dict(
    patch_size=2, patch_size_t=1, num_attention_heads=24, attention_head_dim=96, in_channels=4, out_channels=4,
    num_layers=32, cross_attention_dim=2304, attention_bias=True, sample_height=90, sample_width=160, sample_frames=22,
    activation_fn="gelu-approximate", norm_elementwise_affine=False, norm_eps=1e-6, caption_channels=4096,
    interpolation_scale_h=2.0, interpolation_scale_w=2.0, interpolation_scale_t=2.2,
)  # fmt: skip
ALLEGRO_QUICK = dict(
    ALLEGRO_FULL, num_attention_heads=2, attention_head_dim=12, num_layers=2, cross_attention_dim=24,
    caption_channels=24, sample_height=8, sample_width=8, sample_frames=8,
)  # fmt: skip

# EasyAnimate V5.1 12B (alibaba-pai/EasyAnimateV5.1-12b-zh): inferred, the class's defaults (48 MMDiT blocks of 48
# heads x 64, Qwen2-VL-7B's 3,584-wide text) with the MagViT VAE's 16 latent channels and a 2 x 2 patch, which have no
# defaults; no config.json was found in the search corpora.
EASYANIMATE_FULL = dict(
    num_attention_heads=48, attention_head_dim=64, in_channels=16, out_channels=16, patch_size=2, sample_width=90,
    sample_height=60, num_layers=48, mmdit_layers=48, time_embed_dim=512, text_embed_dim=3584,
)  # fmt: skip
EASYANIMATE_QUICK = dict(
    EASYANIMATE_FULL, num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, num_layers=2,
    mmdit_layers=1, time_embed_dim=8, text_embed_dim=16,
)  # fmt: skip

# Latte-1 (maxin-cn/Latte-1, text-to-video): inferred, PixArt-α XL/2's blocks it starts from (28 of 16 heads x 72,
# T5-XXL's 4,096-wide text, learned sigma: 8 output channels) over 16 frames of SD's VAE at 512 px; no config.json
# was found in the search corpora.
LATTE_FULL = dict(
    num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28,
    cross_attention_dim=1152, attention_bias=True, sample_size=64, patch_size=2, activation_fn="gelu-approximate",
    num_embeds_ada_norm=1000, norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
    caption_channels=4096, video_length=16,
)  # fmt: skip
#: `--quick`: 9 frames, the quick clip's (Latte's temporal position embedding is as long as its clip).
LATTE_QUICK = dict(
    LATTE_FULL, num_attention_heads=2, attention_head_dim=4, num_layers=2, cross_attention_dim=8, caption_channels=8,
    sample_size=8, video_length=9,
)  # fmt: skip

# Mochi 1 (genmo/mochi-1-preview, transformer/): the class's defaults, which diffusers'
# scripts/convert_mochi_to_diffusers.py builds (`MochiTransformer3DModel()`) and loads the released 48-block checkpoint
# into strictly: 48 blocks of 24 heads x 128 (3,072 wide) beside a 1,536-wide text stream, T5-XXL's 4,096-wide prompt
# padded to 256 tokens, its VAE's 12 latent channels under a 2 x 2 patch.
MOCHI_FULL = dict(
    patch_size=2, num_attention_heads=24, attention_head_dim=128, num_layers=48, pooled_projection_dim=1536,
    in_channels=12, qk_norm="rms_norm", text_embed_dim=4096, time_embed_dim=256, activation_fn="swiglu",
    max_sequence_length=256,
)  # fmt: skip
MOCHI_QUICK = dict(
    MOCHI_FULL, num_attention_heads=2, attention_head_dim=8, num_layers=2, pooled_projection_dim=16, text_embed_dim=16,
    time_embed_dim=4, max_sequence_length=16,
)  # fmt: skip


def _timestep(a: ArchInputs, value: float = 500.0) -> torch.Tensor:
    return torch.full((a.shape.batch,), value, device=a.device, dtype=a.dtype)


def _cosmos_inputs(a: ArchInputs) -> dict[str, Any]:
    """`Cosmos2_5_PredictBasePipeline`'s text-to-world call: no conditioning frame (the condition mask all 0), one
    sigma per latent frame, Cosmos-Reason1's padded prompt (every hidden layer concatenated), the padding mask at the
    clip's pixel size."""
    config, s = a.config, a.shape
    latent = config.in_channels - 1
    return {
        "hidden_states": a.randn(s.batch, latent, s.frames, s.height, s.width),
        "condition_mask": torch.zeros(s.batch, 1, s.frames, s.height, s.width, device=a.device, dtype=a.dtype),
        "timestep": torch.full((s.batch, 1, s.frames, 1, 1), 0.5, device=a.device, dtype=a.dtype),
        "encoder_hidden_states": a.randn(s.batch, s.text_tokens, config.crossattn_proj_in_channels),
        "padding_mask": torch.zeros(1, 1, 8 * s.height, 8 * s.width, device=a.device, dtype=a.dtype),
    }


def minimax_h3_pixel_frames(latent_frames: int) -> int:
    """The pixel frames of a MiniMax-H3 clip of `latent_frames` (`17 n + 5` for `5 n + 2`, and between).

    Example:
        >>> minimax_h3_pixel_frames(37)  # its pipeline's default clip: 124 frames, 5 s at 24 a second
        124
    """
    return round((latent_frames - 2) * 17 / 5) + 5


def _minimax_h3_inputs(a: ArchInputs) -> dict[str, Any]:
    """The t2va denoising loop's call: `[text | audio | video]` packed by the pipeline's layout step (the soundtrack
    as long as the clip, on 2 channels), the video rows patchified, one step's row timesteps (video and audio on
    their own schedules)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (
        MiniMaxH3PrepareLayoutStep,
        MiniMaxH3SetTimestepsStep,
    )

    config, s = a.config, a.shape
    p_t, p_h, p_w = config.patch_size
    audio = round(minimax_h3_pixel_frames(s.frames) / MINIMAX_FPS * MINIMAX_AUDIO_RATE)
    tags = torch.ones(s.text_tokens, dtype=torch.long)
    positions, token_tags, video, audio_rows, text, _, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        tags, s.frames, s.height, s.width, audio, tuple(config.patch_size), MINIMAX_AUDIO_CHANNELS, 2, 0
    )
    timestep, rows = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video, audio_rows, 0, 0, s.text_tokens, 0.5, 0.6, 0.999, 1.0
    )
    layout = dict(timestep=timestep, timestep_indices=rows, token_tags=token_tags, position_ids=positions)
    layout |= dict(video_indices=video, audio_indices=audio_rows, text_indices=text)
    return {
        "hidden_states": a.randn(s.batch, video.numel(), config.in_channels * p_t * p_h * p_w),
        "audio_hidden_states": a.randn(s.batch, audio_rows.numel(), config.audio_in_channels),
        "encoder_hidden_states": a.randn(s.batch, s.text_tokens, config.text_dim),
        **{name: value.to(a.device) for name, value in layout.items()},
    }


def _allegro_inputs(a: ArchInputs) -> dict[str, Any]:
    """`AllegroPipeline`'s call: the scheduler's timestep, T5's padded prompt and its mask, the rotary tables and
    positions the pipeline makes for the clip (its own method)."""
    from diffusers.pipelines.allegro.pipeline_allegro import AllegroPipeline  # imported where Allegro is benched

    config, s = a.config, a.shape
    pipe = SimpleNamespace(vae_scale_factor_spatial=8, transformer=a.model)
    rotary = AllegroPipeline._prepare_rotary_positional_embeddings(
        pipe, s.batch, 8 * s.height, 8 * s.width, s.frames, a.device
    )
    return {
        "hidden_states": a.randn(s.batch, config.in_channels, s.frames, s.height, s.width),
        "encoder_hidden_states": a.randn(s.batch, s.text_tokens, config.caption_channels),
        "encoder_attention_mask": torch.ones(s.batch, s.text_tokens, device=a.device, dtype=a.dtype),
        "timestep": _timestep(a),
        "image_rotary_emb": rotary,
    }


def _easyanimate_inputs(a: ArchInputs) -> dict[str, Any]:
    """`EasyAnimatePipeline`'s call: the flow-matching timestep, Qwen2-VL's padded prompt."""
    config, s = a.config, a.shape
    return {
        "hidden_states": a.randn(s.batch, config.in_channels, s.frames, s.height, s.width),
        "timestep": _timestep(a),
        "encoder_hidden_states": a.randn(s.batch, s.text_tokens, config.text_embed_dim),
    }


def _latte_inputs(a: ArchInputs) -> dict[str, Any]:
    """`LattePipeline`'s call: the scheduler's timestep, T5's prompt, temporal attention on."""
    config, s = a.config, a.shape
    return {
        "hidden_states": a.randn(s.batch, config.in_channels, s.frames, s.height, s.width),
        "encoder_hidden_states": a.randn(s.batch, s.text_tokens, config.caption_channels),
        "timestep": _timestep(a),
        "enable_temporal_attentions": True,
    }


def _mochi_inputs(a: ArchInputs) -> dict[str, Any]:
    """`MochiPipeline`'s call: T5's prompt padded to 256 and its boolean mask (a long prompt's: every token valid), the
    timestep `1000 (1 - sigma)` of its inverted-sigma scheduler mid-schedule."""
    config, s = a.config, a.shape
    return {
        "hidden_states": a.randn(s.batch, config.in_channels, s.frames, s.height, s.width),
        "encoder_hidden_states": a.randn(s.batch, s.text_tokens, config.text_embed_dim),
        "timestep": _timestep(a),
        "encoder_attention_mask": torch.ones(s.batch, s.text_tokens, device=a.device, dtype=torch.bool),
    }


ARCHS = (
    Arch(
        name="cosmos",
        model_class=CosmosTransformer3DModel,
        full=COSMOS_FULL,
        quick=COSMOS_QUICK,
        text_tokens=512,  # Cosmos-Reason1's prompt, padded to 512
        inputs=_cosmos_inputs,
        video=VideoClip(height=704, width=1280, frames=93),  # the pipeline's defaults: 24 latent frames of Wan's VAE
        depth_fields=("num_layers",),
        notes="Cosmos-Predict2.5-2B text-to-world; the full config's padding mask needs torchvision",
    ),
    Arch(
        name="minimax_h3",
        model_class=MiniMaxH3Transformer3DModel,
        full=MINIMAX_H3_FULL,
        quick=MINIMAX_H3_QUICK,
        text_tokens=256,  # the prompt's own tokens (no padding): a long prompt's
        inputs=_minimax_h3_inputs,
        # The pipeline's default clip, 124 frames on its 768 x 1344 canvas: 37 latent frames of 48 x 84. Its VAE packs
        # 17 pixel frames into 5 latent ones, no whole stride: 109 frames over a stride of 3 give those 37.
        video=VideoClip(height=768, width=1344, frames=109, time_stride=3, space_stride=16),
        depth_fields=("num_layers", "num_refiner_layers"),
        notes="MiniMax-H3 t2va; text and audio rows are never merged",
    ),
    Arch(
        name="allegro",
        model_class=AllegroTransformer3DModel,
        full=ALLEGRO_FULL,
        quick=ALLEGRO_QUICK,
        text_tokens=512,  # T5's prompt, padded to 512
        inputs=_allegro_inputs,
        video=VideoClip(height=720, width=1280, frames=88),  # the pipeline's defaults: 22 latent frames
        depth_fields=("num_layers",),
        notes="Allegro text-to-video",
    ),
    Arch(
        name="easyanimate",
        model_class=EasyAnimateTransformer3DModel,
        full=EASYANIMATE_FULL,
        quick=EASYANIMATE_QUICK,
        text_tokens=256,  # Qwen2-VL's prompt, padded to 256
        inputs=_easyanimate_inputs,
        video=VideoClip(height=512, width=512, frames=49),  # the pipeline's defaults: 13 latent frames
        depth_fields=("num_layers", "mmdit_layers"),
        notes="EasyAnimate V5.1 12B text-to-video",
    ),
    Arch(
        name="latte",
        model_class=LatteTransformer3DModel,
        full=LATTE_FULL,
        quick=LATTE_QUICK,
        text_tokens=120,  # T5's prompt padded to 120 (with `mask_feature`, the pipeline's default, cut to its own)
        inputs=_latte_inputs,
        video=VideoClip(height=512, width=512, frames=16, time_stride=1),  # its 16 frames, SD's VAE frame by frame
        depth_fields=("num_layers",),
        notes="Latte-1 text-to-video; its temporal blocks are never merged",
    ),
    Arch(
        name="mochi",
        model_class=MochiTransformer3DModel,
        full=MOCHI_FULL,
        quick=MOCHI_QUICK,
        text_tokens=256,  # T5's prompt, padded to 256
        inputs=_mochi_inputs,
        # The pipeline's defaults: 19 frames of 480 x 848 px, 4 latent frames of 60 x 106 (its VAE: 6 frames a latent
        # frame after the first, 8 px a latent pixel); its docs' example asks for 85 frames (`--frames 85`: 15).
        video=VideoClip(height=480, width=848, frames=19, time_stride=6),
        depth_fields=("num_layers",),
        notes="Mochi 1 preview text-to-video; the text stream is never merged",
    ),
)
