"""Sana 1.6B and Sana-Video 2B for the bench, called as SanaPipeline and SanaVideoPipeline call them: the latent, the
Gemma-2 prompt padded to 300 tokens with its padding mask, the scheduler's timestep (0..1000). Sana-WM and its refiner
have no architecture here: ToMe refuses them (`families.sana.REFUSED`), so there is nothing to bench.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import SanaTransformer2DModel, SanaVideoTransformer3DModel

from . import Arch, ArchInputs, VideoClip

#: Sana 1.6B at 1024 px (Efficient-Large-Model/Sana_1600M_1024px_diffusers): `SanaMS_1600M_P1_D20` as diffusers'
#: scripts/convert_sana_to_diffusers.py writes it: 2240 wide (linear self-attention 70 heads x 32, cross-attention
#: 20 x 112), 20 blocks, Mix-FFN ratio 2.5, patch 1 over the DC-AE's 32 channels (32 px a latent pixel), Gemma-2's
#: 2304-wide text.
SANA_1600M = dict(
    in_channels=32,
    out_channels=32,
    num_attention_heads=70,
    attention_head_dim=32,
    num_layers=20,
    num_cross_attention_heads=20,
    cross_attention_head_dim=112,
    cross_attention_dim=2240,
    caption_channels=2304,
    mlp_ratio=2.5,
    attention_bias=False,
    sample_size=32,
    patch_size=1,
    norm_elementwise_affine=False,
    norm_eps=1e-6,
)
#: Sana-Video 2B at 480p (Efficient-Large-Model/SANA-Video_2B_480p): diffusers'
#: scripts/convert_sana_video_to_diffusers.py at `--video_size 480`: 2240 wide (20 heads x 112 in both
#: attentions), 20 blocks, Mix-FFN ratio 3, patch (1, 2, 2) over Wan 2.1's VAE (16 channels, 8x in space, 4x in
#: time), RMS-normed queries and keys.
SANA_VIDEO_2B = dict(
    in_channels=16,
    out_channels=16,
    num_attention_heads=20,
    attention_head_dim=112,
    num_layers=20,
    num_cross_attention_heads=20,
    cross_attention_head_dim=112,
    cross_attention_dim=2240,
    caption_channels=2304,
    mlp_ratio=3.0,
    attention_bias=False,
    sample_size=30,
    patch_size=(1, 2, 2),
    norm_elementwise_affine=False,
    norm_eps=1e-6,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=1024,
)
#: `--quick`: the same blocks, 2 of them, 2 heads in each attention.
_QUICK_SANA = dict(num_attention_heads=2, attention_head_dim=8, num_layers=2, num_cross_attention_heads=2,
                   cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=16)  # fmt: skip
_QUICK_VIDEO = dict(_QUICK_SANA, attention_head_dim=12, cross_attention_head_dim=12, cross_attention_dim=24)
#: The pipelines pad every prompt to `max_sequence_length` (300) and pass the padding mask.
TEXT_TOKENS = 300
#: Tokens of the prompt the mask keeps (a long prompt's, as the pipelines' complex human instruction makes it).
PROMPT_TOKENS = 120


def _text(a: ArchInputs) -> dict[str, Any]:
    batch, text = a.shape.batch, a.shape.text_tokens
    mask = torch.zeros(batch, text, dtype=torch.long, device=a.device)
    mask[:, : min(PROMPT_TOKENS, text)] = 1
    return {
        "encoder_hidden_states": a.randn(batch, text, a.config.caption_channels),
        "encoder_attention_mask": mask,
        "timestep": torch.full((batch,), 500.0, device=a.device, dtype=a.dtype),
    }


def sana_inputs(a: ArchInputs) -> dict[str, Any]:
    """As SanaPipeline calls the model: the DC-AE latent `(B, 32, H / 32, W / 32)` and the text."""
    shape = a.shape
    return {"hidden_states": a.randn(shape.batch, a.config.in_channels, shape.height, shape.width), **_text(a)}


def sana_video_inputs(a: ArchInputs) -> dict[str, Any]:
    """As SanaVideoPipeline calls the model: Wan's latent `(B, 16, 1 + (F - 1) / 4, H / 8, W / 8)` and the text."""
    shape = a.shape
    latent = a.randn(shape.batch, a.config.in_channels, shape.frames, shape.height, shape.width)
    return {"hidden_states": latent, **_text(a)}


ARCHS = (
    Arch(
        name="sana",
        model_class=SanaTransformer2DModel,
        full=SANA_1600M,
        quick=dict(SANA_1600M, **_QUICK_SANA, in_channels=4, out_channels=4),
        text_tokens=TEXT_TOKENS,
        inputs=sana_inputs,
        depth_fields=("num_layers",),
        space_stride=32,
        notes="Sana 1.6B, 1024 px (linear self-attention)",
    ),
    Arch(
        name="sana_video",
        model_class=SanaVideoTransformer3DModel,
        full=SANA_VIDEO_2B,
        quick=dict(SANA_VIDEO_2B, **_QUICK_VIDEO, in_channels=4, out_channels=4),
        text_tokens=TEXT_TOKENS,
        inputs=sana_video_inputs,
        video=VideoClip(height=480, width=832, frames=81),  # SanaVideoPipeline's defaults; Wan's VAE strides
        depth_fields=("num_layers",),
        notes="Sana-Video 2B, 480p (linear self-attention with 3-D rotary positions)",
    ),
)
