"""Bench architectures of `families/edit_more.py`: JoyImage-Edit (`joyimage_edit`), JoyImage-Edit Plus
(`joyimage_edit_plus`), OmniGen (`omnigen`), Motif-Video (`motif_video`), AnyFlow (`anyflow`) and DreamLite's
transformer (`dreamlite`), each called as its pipeline calls it (the edit models with a reference image of the output's
size beside the generated image). `--quick` keeps each block structure at diffusers' test sizes.

Example:
    >>> from tome_processors.bench.dit import build_transformer, make_transformer_inputs
    >>> model = build_transformer("joyimage_edit", quick=True)
    >>> inputs = make_transformer_inputs(model, "joyimage_edit", batch=1, resolution=64, text_tokens=5)
    >>> tuple(inputs.kwargs["hidden_states"].shape), tuple(inputs.run(model).shape)  # the reference, then the noise
    ((1, 2, 16, 1, 8, 8), (1, 2, 16, 1, 8, 8))
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers import (
    AnyFlowTransformer3DModel,
    DreamLiteTransformer2DModel,
    JoyImageEditPlusTransformer3DModel,
    JoyImageEditTransformer3DModel,
    MotifVideoTransformer3DModel,
    OmniGenTransformer2DModel,
)

from . import Arch, ArchInputs, VideoClip

#: JoyImage-Edit's prompt as its text encoder sees it: a 1024 px reference image is 1024 Qwen3-VL tokens (32 px a
#: token), then a short instruction and the template's end (inferred from its pipeline's processing).
JOY_TEXT_TOKENS = 1060


def _timestep(a: ArchInputs, value: float = 500.0) -> torch.Tensor:
    return torch.full((a.shape.batch,), value, device=a.device, dtype=a.dtype)


def _joyimage_inputs(a: ArchInputs) -> dict[str, Any]:
    """`JoyImageEditPipeline`'s call: `(B, 2, C, 1, H, W)`, the image to edit (resized to the output's size) then the
    noise, the scheduler's timestep and the prompt's hidden states."""
    config, s = a.config, a.shape
    return {
        "hidden_states": a.randn(s.batch, 2, config.in_channels, 1, s.height, s.width),
        "timestep": _timestep(a),
        "encoder_hidden_states": a.randn(s.batch, s.text_tokens, config.text_dim),
    }


def _joyimage_plus_inputs(a: ArchInputs) -> dict[str, Any]:
    """`JoyImageEditPlusPipeline`'s call: the generated image's patches, then one reference image's of the same size,
    `(B, 2 N, C, 1, 2, 2)`, `shape_list`, and the prompt's mask (all valid)."""
    config, s = a.config, a.shape
    h, w = s.height // 2, s.width // 2
    return {
        "hidden_states": a.randn(s.batch, 2 * h * w, config.in_channels, 1, 2, 2),
        "timestep": _timestep(a),
        "encoder_hidden_states": a.randn(s.batch, s.text_tokens, config.text_dim),
        "encoder_hidden_states_mask": torch.ones(s.batch, s.text_tokens, dtype=torch.long, device=a.device),
        "shape_list": [[(1, h, w), (1, h, w)] for _ in range(s.batch)],
    }


def _omnigen_inputs(a: ArchInputs) -> dict[str, Any]:
    """`OmniGenPipeline`'s call for text to image: the prompt's token ids, the mask its collator builds (the prompt
    and the time token causal, the generated image's tokens attending to everything), positions and `t` in 0..1."""
    config, s = a.config, a.shape
    image = s.tokens(config.patch_size)
    length = s.text_tokens + 1 + image
    mask = torch.ones(length, length, device=a.device).tril()
    mask[s.text_tokens + 1 :] = 1
    g = torch.Generator().manual_seed(1)
    return {
        "hidden_states": a.randn(s.batch, config.in_channels, s.height, s.width),
        "timestep": _timestep(a, 0.5),
        "input_ids": torch.randint(1, config.vocab_size, (s.batch, s.text_tokens), generator=g).to(a.device),
        "input_img_latents": [],
        "input_image_sizes": {},
        "attention_mask": mask.expand(s.batch, length, length),
        "position_ids": torch.arange(length, device=a.device).expand(s.batch, length),
    }


def _motif_video_inputs(a: ArchInputs) -> dict[str, Any]:
    """`MotifVideoPipeline`'s call: the noisy latents, a zero condition and mask in `2 C + 1` channels, the prompt
    padded to 512 tokens (a quarter of them valid)."""
    config, s = a.config, a.shape
    mask = torch.zeros(s.batch, s.text_tokens, dtype=torch.bool, device=a.device)
    mask[:, : max(1, s.text_tokens // 4)] = True
    return {
        "hidden_states": a.randn(s.batch, config.in_channels, s.frames, s.height, s.width),
        "timestep": _timestep(a),
        "encoder_hidden_states": a.randn(s.batch, s.text_tokens, config.text_embed_dim),
        "encoder_attention_mask": mask,
    }


def _anyflow_inputs(a: ArchInputs) -> dict[str, Any]:
    """`AnyFlowPipeline`'s call: latents frames first, `(B, F, C, H, W)`, the timestep and the timestep it flows to
    (`target_timestep`) per frame, the padded UMT5 prompt."""
    config, s = a.config, a.shape
    return {
        "hidden_states": a.randn(s.batch, s.frames, config.in_channels, s.height, s.width),
        "timestep": torch.full((s.batch, s.frames), 500.0, device=a.device, dtype=a.dtype),
        "r_timestep": torch.full((s.batch, s.frames), 250.0, device=a.device, dtype=a.dtype),
        "encoder_hidden_states": a.randn(s.batch, s.text_tokens, config.text_dim),
    }


def _dreamlite_inputs(a: ArchInputs) -> dict[str, Any]:
    """As DreamLite's U-Net calls its deepest level's transformer: the level's feature map and the prompt."""
    config, s = a.config, a.shape
    return {
        "hidden_states": a.randn(s.batch, config.in_channels, s.height, s.width),
        "encoder_hidden_states": a.randn(s.batch, s.text_tokens, config.cross_attention_dim),
    }


# JoyAI-Image-Edit-Plus (jdopensource/JoyAI-Image-Edit-Plus-Diffusers; its ComfyUI repackaging's model card): 40
# double-stream blocks, 4096 wide (32 heads of 128), rotary dims 16 + 56 + 56 at theta 10000, Qwen3-VL-8B's 4096-wide
# text. JoyAI-Image-Edit (jdopensource/JoyAI-Image-Edit-Diffusers) is the same 16 B MMDiT (inferred: no config.json
# in the search corpora).
JOYIMAGE_FULL: dict[str, Any] = dict(
    patch_size=[1, 2, 2],
    in_channels=16,
    hidden_size=4096,
    num_attention_heads=32,
    text_dim=4096,
    mlp_width_ratio=4.0,
    num_layers=40,
    rope_dim_list=[16, 56, 56],
    theta=10000,
)
#: diffusers' test config of both JoyImage transformers.
JOYIMAGE_QUICK: dict[str, Any] = dict(
    JOYIMAGE_FULL, hidden_size=32, num_attention_heads=2, text_dim=16, num_layers=2, rope_dim_list=[4, 6, 6], theta=256
)
# OmniGen v1 (Shitao/OmniGen-v1-diffusers, transformer/config.json as public reports of it list it): Phi-3's 32 layers,
# 3072 wide (32 heads of 96, 32 key/value heads), SwiGLU 8192, its 32064-token vocabulary, su-scaled rotary positions
# (4096 original, 131072 most). The su scaling's 48 short and long factors change no work: 1 here.
OMNIGEN_FULL: dict[str, Any] = dict(
    in_channels=4,
    patch_size=2,
    hidden_size=3072,
    num_attention_heads=32,
    num_key_value_heads=32,
    intermediate_size=8192,
    num_layers=32,
    pad_token_id=32000,
    vocab_size=32064,
    max_position_embeddings=131072,
    original_max_position_embeddings=4096,
    rope_base=10000,
    rope_scaling={"long_factor": [1.0] * 48, "short_factor": [1.0] * 48},
    pos_embed_max_size=192,
    time_step_dim=256,
)
OMNIGEN_QUICK: dict[str, Any] = dict(
    OMNIGEN_FULL, hidden_size=16, num_attention_heads=4, num_key_value_heads=4, intermediate_size=32, num_layers=2,
    pad_token_id=0, vocab_size=1000, time_step_dim=4,
    rope_scaling={"long_factor": [1.0, 2.0], "short_factor": [1.0, 2.0]},
)  # fmt: skip
# Motif-Video 2B (Motif-Technologies/Motif-Video-2B; its model card and diffusers' model docs): 12 double-stream, 16
# single-stream and 8 DDT decoder blocks, 1536 wide (12 heads of 128), Wan 2.1's VAE patched 2 x 2 x 1, shared
# cross-attention in the single-stream stage, QK norm; T5Gemma 2's 2560-wide text (its text encoder's config, as a
# public ComfyUI port's parity test lists it) and SigLIP's image embeddings (1152, inferred). No config.json in the
# search corpora.
MOTIF_VIDEO_FULL: dict[str, Any] = dict(
    in_channels=33,
    out_channels=16,
    num_attention_heads=12,
    attention_head_dim=128,
    num_layers=12,
    num_single_layers=24,
    num_decoder_layers=8,
    mlp_ratio=4.0,
    patch_size=2,
    patch_size_t=1,
    qk_norm="rms_norm",
    text_embed_dim=2560,
    image_embed_dim=1152,
    rope_axes_dim=(16, 56, 56),
    enable_text_cross_attention_single=True,
)
#: diffusers' test config, with a decoder block and the shared cross-attention.
MOTIF_VIDEO_QUICK: dict[str, Any] = dict(
    MOTIF_VIDEO_FULL, num_attention_heads=2, attention_head_dim=12, num_layers=1, num_single_layers=2,
    num_decoder_layers=1, patch_size=1, text_embed_dim=32, image_embed_dim=4, rope_axes_dim=(4, 4, 4),
)  # fmt: skip
# AnyFlow-Wan2.1-T2V-14B (nvidia/AnyFlow-Wan2.1-T2V-14B-Diffusers, its pipeline's example): Wan 2.1 T2V 14B's blocks
# (40 of 40 heads x 128, feed-forward 13,824, UMT5's 4096-wide text) under the flow-map embedding (the class's gate
# 0.25, delta `r`); inferred from Wan2.1-T2V-14B's transformer config.
ANYFLOW_FULL: dict[str, Any] = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=40,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=13824,
    num_layers=40,
    cross_attn_norm=True,
    eps=1e-6,
    rope_max_seq_len=1024,
    gate_value=0.25,
    deltatime_type="r",
)
ANYFLOW_QUICK: dict[str, Any] = dict(
    ANYFLOW_FULL, num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4, text_dim=16, freq_dim=32,
    ffn_dim=32, num_layers=2, rope_max_seq_len=32,
)  # fmt: skip
# DreamLite-base (carlofkl/DreamLite-base): the transformer of its U-Net's deepest level (1280 channels, a 32 x 32 map
# at 1024 px), inferred from `DreamLiteUNetModel`'s defaults (no config.json in the search corpora): 64 heads of 20,
# RMS QK norm, feed-forward x6, 2048-wide text. The U-Net's one key/value head needs the processor it sets
# (`DreamLiteAttnProcessor2_0`); the class alone builds `AttnProcessor2_0`, so this declares multi-head keys.
DREAMLITE_FULL: dict[str, Any] = dict(
    num_attention_heads=64,
    attention_head_dim=20,
    in_channels=1280,
    num_layers=1,
    norm_num_groups=32,
    cross_attention_dim=2048,
    qk_norm="rms_norm",
    ff_mult=6,
)
DREAMLITE_QUICK: dict[str, Any] = dict(
    DREAMLITE_FULL, num_attention_heads=4, attention_head_dim=8, in_channels=32, num_layers=2, norm_num_groups=8,
    cross_attention_dim=16, ff_mult=2,
)  # fmt: skip

ARCHS = (
    Arch(
        name="joyimage_edit",
        model_class=JoyImageEditTransformer3DModel,
        full=JOYIMAGE_FULL,
        quick=JOYIMAGE_QUICK,
        text_tokens=JOY_TEXT_TOKENS,
        inputs=_joyimage_inputs,
        depth_fields=("num_layers",),
        notes="double-stream blocks over the generated image, the reference image (never merged) and the text",
    ),
    Arch(
        name="joyimage_edit_plus",
        model_class=JoyImageEditPlusTransformer3DModel,
        full=JOYIMAGE_FULL,
        quick=JOYIMAGE_QUICK,
        text_tokens=JOY_TEXT_TOKENS,
        inputs=_joyimage_plus_inputs,
        depth_fields=("num_layers",),
        notes="JoyImage-Edit's blocks over patched items: the generated image, then each reference (never merged)",
    ),
    Arch(
        name="omnigen",
        model_class=OmniGenTransformer2DModel,
        full=OMNIGEN_FULL,
        quick=OMNIGEN_QUICK,
        text_tokens=50,  # its processor's template around a short prompt, in Llama tokens (inferred)
        inputs=_omnigen_inputs,
        depth_fields=("num_layers",),
        notes="one decoder over prompt, time token and image under a causal mask (the image's rows merged)",
    ),
    Arch(
        name="motif_video",
        model_class=MotifVideoTransformer3DModel,
        full=MOTIF_VIDEO_FULL,
        quick=MOTIF_VIDEO_QUICK,
        text_tokens=512,  # the pipeline pads the prompt to max_sequence_length, 512
        inputs=_motif_video_inputs,
        video=VideoClip(height=736, width=1280, frames=121),  # the pipeline's defaults
        depth_fields=("num_layers", "num_single_layers", "num_decoder_layers"),
        notes="HunyuanVideo's kind of double- and single-stream blocks, then DDT decoder blocks",
    ),
    Arch(
        name="anyflow",
        model_class=AnyFlowTransformer3DModel,
        full=ANYFLOW_FULL,
        quick=ANYFLOW_QUICK,
        text_tokens=512,  # the pipeline's max_sequence_length
        inputs=_anyflow_inputs,
        video=VideoClip(height=480, width=832, frames=81),  # the pipeline's defaults
        depth_fields=("num_layers",),
        notes="Wan 2.1's blocks, a flow-map timestep per frame",
    ),
    Arch(
        name="dreamlite",
        model_class=DreamLiteTransformer2DModel,
        full=DREAMLITE_FULL,
        quick=DREAMLITE_QUICK,
        text_tokens=200,  # the pipeline's max_sequence_length
        inputs=_dreamlite_inputs,
        depth_fields=("num_layers",),
        space_stride=32,  # the VAE's 8 px a latent pixel, then the U-Net's two downsamples to the deepest level
        notes="the spatial transformer of DreamLite's U-Net at its deepest level",
    ),
)
