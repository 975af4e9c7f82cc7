"""Bench architectures of the Wan derivatives with classes of their own: Wan-Animate, ChronoEdit and Helios.

Each is a 14 B Wan 2.1 / 2.2 shape (40 blocks of 40 heads x 128, feed-forward 13,824, UMT5's 4,096-wide text padded
to 512 tokens), called as its pipeline calls it; `--quick` keeps the block structure at 2 heads x 12.
"""

from __future__ import annotations

import torch
from diffusers import ChronoEditTransformer3DModel, HeliosTransformer3DModel, WanAnimateTransformer3DModel

from . import Arch, ArchInputs, VideoClip

#: The 14 B Wan blocks all three share.
_WAN_14B = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=40,
    attention_head_dim=128,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=13824,
    num_layers=40,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
)
#: `--quick`: the same blocks at 2 heads x 12, 2 of them.
_QUICK = dict(num_attention_heads=2, attention_head_dim=12, text_dim=32, freq_dim=32, ffn_dim=32, num_layers=2)
#: UMT5's prompt, padded to 512 tokens by every one of these pipelines (the image-to-video attention of Wan-Animate and
#: ChronoEdit takes the last 512 context tokens as the text, so `--quick` keeps 512 too).
TEXT_TOKENS = 512
#: CLIP ViT-H/14's image tokens (16 x 16 patches and the class token), full size and `--quick`.
IMAGE_TOKENS = (257, 5)
#: Helios's history as its pipeline keeps it: 16 long-, 2 mid- and 1 short-term latent frames, and the first frame.
HELIOS_HISTORY = (16, 2, 1)

# Wan2.2-Animate-14B (Wan-AI/Wan2.2-Animate-14B-Diffusers, transformer/config.json, as mirrored in public conversion
# scripts): Wan 2.1 I2V's blocks with CLIP image keys, a face adapter every 5 blocks, its motion and face encoders.
WAN_ANIMATE_FULL = dict(
    _WAN_14B,
    in_channels=36,
    latent_channels=16,
    out_channels=16,
    image_dim=1280,
    added_kv_proj_dim=5120,
    rope_max_seq_len=1024,
    motion_encoder_size=512,
    motion_style_dim=512,
    motion_dim=20,
    motion_encoder_dim=512,
    face_encoder_hidden_dim=1024,
    face_encoder_num_heads=4,
    inject_face_latents_blocks=5,
    motion_encoder_batch_size=8,
)
WAN_ANIMATE_QUICK = dict(
    WAN_ANIMATE_FULL,
    **_QUICK,
    in_channels=12,
    latent_channels=4,
    out_channels=4,
    image_dim=16,
    added_kv_proj_dim=24,
    motion_encoder_channel_sizes={"4": 16, "8": 16, "16": 16},
    motion_encoder_size=16,
    motion_style_dim=8,
    motion_dim=4,
    motion_encoder_dim=16,
    face_encoder_hidden_dim=16,
    face_encoder_num_heads=2,
    inject_face_latents_blocks=2,
)
# nvidia/ChronoEdit-14B-Diffusers: finetuned from Wan2.1-I2V-14B-720P, whose transformer config it keeps (a public
# duplicate of its transformer/config.json), and ChronoEdit's rotary time skip (its class default, 8).
CHRONOEDIT_FULL = dict(
    _WAN_14B,
    in_channels=36,
    out_channels=16,
    image_dim=1280,
    added_kv_proj_dim=5120,
    rope_max_seq_len=1024,
    rope_temporal_skip_len=8,
)
CHRONOEDIT_QUICK = dict(CHRONOEDIT_FULL, **_QUICK, in_channels=12, out_channels=4, image_dim=16, added_kv_proj_dim=24)
# BestWishYsh/Helios-Base (-Mid, -Distilled): finetuned from Wan2.1-T2V-14B (its model card); inferred as the class's
# defaults, which are that shape with Helios's rotary split (44, 42, 42), history patches, and cross-attention over the
# clip alone; no config.json was found in the search corpora.
HELIOS_FULL = dict(
    _WAN_14B,
    in_channels=16,
    out_channels=16,
    rope_dim=(44, 42, 42),
    rope_theta=10000.0,
    guidance_cross_attn=True,
    zero_history_timestep=True,
    has_multi_term_memory_patch=True,
    is_amplify_history=False,
)
HELIOS_QUICK = dict(HELIOS_FULL, **_QUICK, in_channels=4, out_channels=4, rope_dim=(4, 4, 4))


def _wan_animate_inputs(a: ArchInputs) -> dict[str, torch.Tensor]:
    """`WanAnimatePipeline`'s call: the reference image's latent frame ahead of the clip's (noise, reference and
    conditioning in channels), the pose latents of the clip's frames, the segment's face video (4 pixel frames a
    latent frame, less 3) at the motion encoder's side, CLIP's image tokens and the padded text."""
    config, s = a.config, a.shape
    latent = config.latent_channels
    side = config.motion_encoder_size
    image_tokens = IMAGE_TOKENS[1] if a.quick else IMAGE_TOKENS[0]
    return {
        "hidden_states": a.randn(s.batch, config.in_channels, 1 + s.frames, s.height, s.width),
        "timestep": torch.full((s.batch,), 500.0, device=a.device, dtype=a.dtype),
        "encoder_hidden_states": a.randn(s.batch, s.text_tokens, config.text_dim),
        "encoder_hidden_states_image": a.randn(s.batch, image_tokens, config.image_dim),
        "pose_hidden_states": a.randn(s.batch, latent, s.frames, s.height, s.width),
        "face_pixel_values": a.randn(s.batch, 3, 4 * s.frames - 3, side, side).clamp(-1, 1),
    }


def _chronoedit_inputs(a: ArchInputs) -> dict[str, torch.Tensor]:
    """`ChronoEditPipeline`'s call: the clip's latents with the input image's latents and mask as channels, CLIP's
    image tokens and the padded text."""
    config, s = a.config, a.shape
    image_tokens = IMAGE_TOKENS[1] if a.quick else IMAGE_TOKENS[0]
    return {
        "hidden_states": a.randn(s.batch, config.in_channels, s.frames, s.height, s.width),
        "timestep": torch.full((s.batch,), 500.0, device=a.device, dtype=a.dtype),
        "encoder_hidden_states": a.randn(s.batch, s.text_tokens, config.text_dim),
        "encoder_hidden_states_image": a.randn(s.batch, image_tokens, config.image_dim),
    }


def _helios_inputs(a: ArchInputs) -> dict[str, torch.Tensor]:
    """`HeliosPipeline`'s call: one chunk's latents, the history's (short term with the first frame), the frame
    indices of both for the whole batch, and the padded text."""
    config, s = a.config, a.shape
    long, mid, short = HELIOS_HISTORY
    indices = torch.arange(1 + long + mid + short + s.frames, device=a.device)
    prefix, long_at, mid_at, short_at, clip_at = indices.split([1, long, mid, short, s.frames])
    channels = config.in_channels
    return {
        "hidden_states": a.randn(s.batch, channels, s.frames, s.height, s.width),
        "timestep": torch.full((s.batch,), 500.0, device=a.device, dtype=a.dtype),
        "encoder_hidden_states": a.randn(s.batch, s.text_tokens, config.text_dim),
        "indices_hidden_states": clip_at[None],
        "indices_latents_history_short": torch.cat([prefix, short_at])[None],
        "indices_latents_history_mid": mid_at[None],
        "indices_latents_history_long": long_at[None],
        "latents_history_short": a.randn(s.batch, channels, 1 + short, s.height, s.width),
        "latents_history_mid": a.randn(s.batch, channels, mid, s.height, s.width),
        "latents_history_long": a.randn(s.batch, channels, long, s.height, s.width),
    }


ARCHS = (
    Arch(
        name="wan-animate",
        model_class=WanAnimateTransformer3DModel,
        full=WAN_ANIMATE_FULL,
        quick=WAN_ANIMATE_QUICK,
        text_tokens=TEXT_TOKENS,
        inputs=_wan_animate_inputs,
        video=VideoClip(height=720, width=1280, frames=77),  # the pipeline's defaults: one 77-frame segment at 720p
        # A face adapter follows block 0 and every 5th: `--layers` below 5 keeps one, after every block.
        depth_fields=("num_layers", "inject_face_latents_blocks"),
        notes="Wan2.2-Animate-14B; the face adapters (every 5 blocks) are never merged",
    ),
    Arch(
        name="chronoedit",
        model_class=ChronoEditTransformer3DModel,
        full=CHRONOEDIT_FULL,
        quick=CHRONOEDIT_QUICK,
        text_tokens=TEXT_TOKENS,
        inputs=_chronoedit_inputs,
        video=VideoClip(height=720, width=1280, frames=5),  # its example: an edit at 720p, 5 frames (2 latent)
        depth_fields=("num_layers",),
        notes="ChronoEdit-14B without temporal reasoning",
    ),
    Arch(
        name="helios",
        model_class=HeliosTransformer3DModel,
        full=HELIOS_FULL,
        quick=HELIOS_QUICK,
        text_tokens=TEXT_TOKENS,
        inputs=_helios_inputs,
        video=VideoClip(height=384, width=640, frames=33),  # the pipeline's defaults: a chunk of 9 latent frames
        depth_fields=("num_layers",),
        notes="Helios-Base; the history's tokens are never merged",
    ),
)
