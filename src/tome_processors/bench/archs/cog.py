"""The CogVideoX lineage for the bench: CogVideoX 5B and ConsisID (video, 480 x 720 px, 49 frames: 13 latent frames of
30 x 45 tokens after the prompt's 226), CogView 3 Plus and CogView 4 (images), called as their pipelines call them.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import (
    CogVideoXTransformer3DModel,
    CogView3PlusTransformer2DModel,
    CogView4Transformer2DModel,
    ConsisIDTransformer3DModel,
)
from diffusers.models.embeddings import get_3d_rotary_pos_embed

from . import Arch, ArchInputs, VideoClip, centred_region

#: The T5 prompt CogVideoX's, ConsisID's and CogView 3 Plus's pipelines pad to (`max_sequence_length`).
COGVIDEOX_TEXT_TOKENS, COGVIEW3_TEXT_TOKENS = 226, 224
#: CogView 4's GLM prompt is padded to the longest prompt's length, rounded up to 16: a long prompt's (the model is
#: trained on long, detailed captions).
COGVIEW4_TEXT_TOKENS = 256
#: ConsisID's face: EVA-CLIP's 577 hidden tokens at each of `LFE_num_scale` layers, full size and `--quick`.
FACE_TOKENS = (577, 3)

# CogVideoX-5B (THUDM/CogVideoX-5b, transformer/config.json): 42 blocks of 48 heads x 64 (3072 wide), 3-D rotary
# positions, T5-XXL's 4096-wide prompt padded to 226 tokens, a 60 x 90 x 13 latent (480 x 720 px, 49 frames) base
# size. diffusers' scripts/convert_cogvideox_to_diffusers.py builds it from the class's defaults with these three
# changes (num_layers 42, num_attention_heads 48, use_rotary_positional_embeddings).
COGVIDEOX_5B = dict(
    num_attention_heads=48, attention_head_dim=64, in_channels=16, out_channels=16, flip_sin_to_cos=True, freq_shift=0,
    time_embed_dim=512, text_embed_dim=4096, num_layers=42, dropout=0.0, attention_bias=True, sample_width=90,
    sample_height=60, sample_frames=49, patch_size=2, temporal_compression_ratio=4, max_text_seq_length=226,
    activation_fn="gelu-approximate", timestep_activation_fn="silu", norm_elementwise_affine=True, norm_eps=1e-5,
    spatial_interpolation_scale=1.875, temporal_interpolation_scale=1.0, use_rotary_positional_embeddings=True,
)  # fmt: skip
#: `--quick`: the same blocks at 2 heads x 16 (3-D rotary: 4 + 6 + 6 channels), 2 of them.
_VIDEO_QUICK = dict(num_attention_heads=2, attention_head_dim=16, time_embed_dim=8, text_embed_dim=32, num_layers=2)
# ConsisID (BestWishYsh/ConsisID-preview): inferred, no config.json was found in the search corpora. It is finetuned
# from CogVideoX-5B-I2V (its paper), whose transformer is CogVideoX-5B's with the image's latents as 16 more input
# channels and learned positions (which tie it to 480 x 720 px), and its face branch at the class's defaults: a local
# facial extractor over 5 of EVA-CLIP's layers (1024 wide) and the 1280-wide identity embedding, and a perceiver
# cross-attention after every second block (its keys 2048 wide: two thirds of 3072, the extractor's output).
CONSISID = dict(
    COGVIDEOX_5B, in_channels=32, use_learned_positional_embeddings=True, is_train_face=True, is_kps=False,
    cross_attn_interval=2, cross_attn_dim_head=128, cross_attn_num_heads=16, LFE_id_dim=1280, LFE_vit_dim=1024,
    LFE_depth=10, LFE_dim_head=64, LFE_num_heads=16, LFE_num_id_token=5, LFE_num_querie=32, LFE_output_dim=2048,
    LFE_ff_mult=4, LFE_num_scale=5, local_face_scale=1.0,
)  # fmt: skip
#: `--quick`: CogVideoX's quick blocks with a tiny face branch; rotary positions alone (learned ones would tie the
#: model to one latent size).
CONSISID_QUICK = dict(
    CONSISID, **_VIDEO_QUICK, use_learned_positional_embeddings=False, cross_attn_dim_head=4,
    cross_attn_num_heads=2, LFE_id_dim=8, LFE_vit_dim=8, LFE_depth=2, LFE_dim_head=8, LFE_num_heads=2,
    LFE_num_id_token=1, LFE_num_querie=2, LFE_output_dim=21, LFE_ff_mult=1, LFE_num_scale=2,
)  # fmt: skip
# CogView3-Plus-3B (THUDM/CogView3-Plus-3B): 30 blocks of 64 heads x 40 (2560 wide), T5-XXL's prompt (224 tokens),
# absolute positions cropped from a 128 x 128 table. diffusers' scripts/convert_cogview3_to_diffusers.py builds it
# with the class's defaults.
COGVIEW3PLUS = dict(
    patch_size=2, in_channels=16, num_layers=30, attention_head_dim=40, num_attention_heads=64, out_channels=16,
    text_embed_dim=4096, time_embed_dim=512, condition_dim=256, pos_embed_max_size=128, sample_size=128,
)  # fmt: skip
# CogView4-6B (THUDM/CogView4-6B): 28 blocks of 32 heads x 128 (4096 wide), GLM-4-9B's 4096-wide prompt, 2-D rotary
# positions over 256 x 256 axes. diffusers' scripts/convert_cogview4_to_diffusers.py (its transformer's config).
COGVIEW4 = dict(
    patch_size=2, in_channels=16, out_channels=16, num_layers=28, attention_head_dim=128, num_attention_heads=32,
    text_embed_dim=4096, time_embed_dim=512, condition_dim=256, pos_embed_max_size=128, sample_size=128,
    rope_axes_dim=(256, 256),
)  # fmt: skip
_IMAGE_QUICK = dict(num_layers=2, attention_head_dim=8, num_attention_heads=2, text_embed_dim=32, time_embed_dim=8,
                    condition_dim=4)  # fmt: skip


def _rotary(a: ArchInputs) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The pipeline's rotary tables (`_prepare_rotary_positional_embeddings`): 3-D positions over the grid, cropped
    from the model's base size (`sample_height / sample_width` over the patch); None where the model has none."""
    config, s = a.config, a.shape
    if not config.use_rotary_positional_embeddings:
        return None
    p = config.patch_size
    h, w = s.height // p, s.width // p
    crops = centred_region((h, w), config.sample_width // p, config.sample_height // p)
    return get_3d_rotary_pos_embed(config.attention_head_dim, crops, (h, w), s.frames, device=a.device)


def _cogvideox_inputs(a: ArchInputs, channels: int | None = None) -> dict[str, Any]:
    """`CogVideoXPipeline`'s call: the latent frames first `(B, F, C, H, W)`, the prompt, the DDIM scheduler's
    timestep (an integer), the rotary tables (float32, as the pipeline makes them)."""
    config, s = a.config, a.shape
    return {
        "hidden_states": a.randn(s.batch, s.frames, channels or config.in_channels, s.height, s.width),
        "encoder_hidden_states": a.randn(s.batch, s.text_tokens, config.text_embed_dim),
        "timestep": torch.full((s.batch,), 500, dtype=torch.long, device=a.device),
        "image_rotary_emb": _rotary(a),
    }


def _consisid_inputs(a: ArchInputs) -> dict[str, Any]:
    """`ConsisIDPipeline`'s call: CogVideoX's with the image's latents over channels, and one face for the whole
    batch (its identity embedding and EVA-CLIP's hidden states at each scale)."""
    config = a.config
    tokens = FACE_TOKENS[1 if a.quick else 0]
    return {
        **_cogvideox_inputs(a),
        "id_cond": a.randn(1, config.LFE_id_dim),
        "id_vit_hidden": [a.randn(1, tokens, config.LFE_vit_dim) for _ in range(config.LFE_num_scale)],
    }


def _consisid_config(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with a perceiver cross-attention for every block that calls one: the model makes `num_layers //
    cross_attn_interval` of them and calls one after blocks 0, interval, 2 x interval, ...; at a depth that is no
    multiple of the interval (`--layers`), one after every block."""
    if config["num_layers"] % config["cross_attn_interval"]:
        return {**config, "cross_attn_interval": 1}
    return config


def _cogview_inputs(a: ArchInputs) -> dict[str, Any]:
    """The CogView pipelines' call: the latent `(B, C, H, W)`, the prompt, the scheduler's timestep (0..1000: CogView
    3 Plus's DDIM an integer, CogView 4's flow matching a float), and SDXL's size conditions (the image's pixels, no
    crop) in the prompt's dtype."""
    config, s = a.config, a.shape
    ddim = isinstance(a.model, CogView3PlusTransformer2DModel)
    size = torch.tensor([[8.0 * s.height, 8.0 * s.width]], device=a.device, dtype=a.dtype).repeat(s.batch, 1)
    return {
        "hidden_states": a.randn(s.batch, config.in_channels, s.height, s.width),
        "encoder_hidden_states": a.randn(s.batch, s.text_tokens, config.text_embed_dim),
        "timestep": torch.full((s.batch,), 500, device=a.device, dtype=torch.long if ddim else a.dtype),
        "original_size": size,
        "target_size": size,
        "crop_coords": torch.zeros(s.batch, 2, device=a.device, dtype=a.dtype),
    }


#: The pipelines' default clip: 480 x 720 px, 49 frames (13 latent frames).
_CLIP = VideoClip(height=480, width=720, frames=49)

ARCHS = (
    Arch(
        name="cogvideox",
        model_class=CogVideoXTransformer3DModel,
        full=COGVIDEOX_5B,
        quick=dict(COGVIDEOX_5B, **_VIDEO_QUICK),
        text_tokens=COGVIDEOX_TEXT_TOKENS,
        inputs=_cogvideox_inputs,
        video=_CLIP,
        depth_fields=("num_layers",),
        notes="CogVideoX-5B text-to-video",
    ),
    Arch(
        name="consisid",
        model_class=ConsisIDTransformer3DModel,
        full=CONSISID,
        quick=CONSISID_QUICK,
        text_tokens=COGVIDEOX_TEXT_TOKENS,
        inputs=_consisid_inputs,
        video=_CLIP,  # learned positions: 480 x 720 px only (any frame count)
        depth_fields=("num_layers",),
        derived=_consisid_config,
        notes="ConsisID-preview (inferred config); the face branch's perceiver attention is never merged",
    ),
    Arch(
        name="cogview3plus",
        model_class=CogView3PlusTransformer2DModel,
        full=COGVIEW3PLUS,
        quick=dict(COGVIEW3PLUS, **_IMAGE_QUICK),
        text_tokens=COGVIEW3_TEXT_TOKENS,
        inputs=_cogview_inputs,
        depth_fields=("num_layers",),
        notes="CogView3-Plus-3B",
    ),
    Arch(
        name="cogview4",
        model_class=CogView4Transformer2DModel,
        full=COGVIEW4,
        quick=dict(COGVIEW4, **_IMAGE_QUICK),
        text_tokens=COGVIEW4_TEXT_TOKENS,
        inputs=_cogview_inputs,
        depth_fields=("num_layers",),
        notes="CogView4-6B",
    ),
)
