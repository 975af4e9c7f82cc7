"""Kandinsky 5.0 (Video Lite, Image Lite) and Kandinsky 6.0 (Video Pro, with its audio) for the bench, called as their
pipelines call them: channels-last latents `(B, T, H, W, C)`, the scheduler's timestep (0..1000), the Qwen2.5-VL
prompt tokens and the CLIP pooled embedding. Kandinsky 6.0's super-resolution transformer has no architecture here:
ToMe refuses it (its attention is block-sparse, `Kandinsky6SRFamily`), so there is nothing to bench.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from diffusers import Kandinsky5Transformer3DModel, Kandinsky6Transformer3DModel

from . import Arch, ArchInputs, VideoClip

#: Kandinsky 5.0 Video Lite (2B; text- and image-to-video, 5 s): `dit_params` of ai-forever/Kandinsky-5's
#: configs/config_5s_sft.yaml. Its attention is "flash", the regular one (the 10 s models' NABLA is refused).
KANDINSKY5_VIDEO = dict(
    in_visual_dim=16, out_visual_dim=16, in_text_dim=3584, in_text_dim2=768, time_dim=512, patch_size=(1, 2, 2),
    model_dim=1792, ff_dim=7168, num_text_blocks=2, num_visual_blocks=32, axes_dims=(16, 24, 24), visual_cond=True,
)  # fmt: skip
#: Kandinsky 5.0 Image Lite (6B; text-to-image): kandinskylab/Kandinsky-5.0-T2I-Lite-sft-Diffusers'
#: transformer/config.json as quoted by a public port of the model (not read from the repository itself).
KANDINSKY5_IMAGE = dict(
    in_visual_dim=16, out_visual_dim=16, in_text_dim=3584, in_text_dim2=768, time_dim=512, patch_size=(1, 2, 2),
    model_dim=2560, ff_dim=10240, num_text_blocks=2, num_visual_blocks=50, axes_dims=(32, 48, 48), visual_cond=False,
)  # fmt: skip
#: Kandinsky 6.0 Video Pro (29B; text- and image-to-video-and-audio): the `DIT_CONFIG` of Kandinsky 6's ComfyUI
#: release contract (its video stream is diffusers' defaults; `is_multimodal` is not a diffusers argument).
KANDINSKY6 = dict(
    in_visual_dim=16, out_visual_dim=16, in_text_dim=3584, in_text_dim2=768, time_dim=1024, patch_size=(1, 2, 2),
    model_dim=4096, ff_dim=16384, num_text_blocks=4, num_visual_blocks=60, axes_dims=(32, 48, 48), visual_cond=True,
    in_audio_dim=40, out_audio_dim=40, model_dim_a=2048, time_dim_a=1024, ff_dim_a=7168, axes_dims_a=(32, 48, 48),
    audio_freqs_scaling=0.144, text_token_padding=True, ca_rope=True, cross_gates=True, fix_modulation=True,
    visual_token_type_num_embeddings=2,
)  # fmt: skip

_TINY = dict(in_text_dim=32, in_text_dim2=16, time_dim=32, model_dim=64, ff_dim=128, num_text_blocks=1,
             num_visual_blocks=2, axes_dims=(8, 12, 12))  # fmt: skip
_DEPTH = ("num_text_blocks", "num_visual_blocks")

#: Kandinsky 6's audio: 44.1 kHz, 1024 samples a latent, the clip's duration at 24 frames a second.
AUDIO_RATE, AUDIO_HOP, FRAME_RATE = 44_100, 1024, 24.0
#: Text tokens that reach a Kandinsky 6 model of a padded prompt: those of a long prompt.
KANDINSKY6_PROMPT = 256


def _scale_factor(shape: Any, video: bool) -> tuple[float, float, float]:
    """The rotary positions' scaling `Kandinsky5T2VPipeline._get_scale_factor` chooses (1, 2, 2) between 480 and
    854 px a side, else (1, 3.16, 3.16); the image pipelines (1, 1, 1)."""
    if not video:
        return (1.0, 1.0, 1.0)
    height, width = 8 * shape.height, 8 * shape.width
    return (1.0, 2.0, 2.0) if 480 <= height <= 854 and 480 <= width <= 854 else (1.0, 3.16, 3.16)


def _latent(a: ArchInputs) -> torch.Tensor:
    config, shape = a.config, a.shape
    channels = 2 * config.in_visual_dim + 1 if config.visual_cond else config.in_visual_dim
    return a.randn(shape.batch, shape.frames, shape.height, shape.width, channels)


def kandinsky5_inputs(a: ArchInputs, video: bool = True) -> dict[str, Any]:
    """As `Kandinsky5T2VPipeline` (`video=False`: `Kandinsky5T2IPipeline`, one frame) calls the model: the prompt's
    own tokens (no padding), their 1-D positions, and the grid's 3-D positions."""
    config, shape = a.config, a.shape
    p_t, p_h, p_w = config.patch_size
    return {
        "hidden_states": _latent(a),
        "encoder_hidden_states": a.randn(shape.batch, shape.text_tokens, config.in_text_dim),
        "timestep": torch.full((shape.batch,), 500.0, device=a.device, dtype=a.dtype),
        "pooled_projections": a.randn(shape.batch, config.in_text_dim2),
        "visual_rope_pos": [
            torch.arange(shape.frames // p_t, device=a.device),
            torch.arange(shape.height // p_h, device=a.device),
            torch.arange(shape.width // p_w, device=a.device),
        ],
        "text_rope_pos": torch.arange(shape.text_tokens, device=a.device),
        "scale_factor": _scale_factor(shape, video),
    }


def audio_latents(frames: int) -> int:
    """The audio latents `Kandinsky6TI2VAPipeline` makes for `frames` latent frames (4 pixel frames each).

    Example:
        >>> audio_latents(31)  # 121 frames: 5 s of 44.1 kHz audio
        218
    """
    return math.ceil(((frames - 1) * 4 + 1) / FRAME_RATE * AUDIO_RATE / AUDIO_HOP)


def kandinsky6_inputs(a: ArchInputs) -> dict[str, Any]:
    """As `Kandinsky6TI2VAPipeline` calls the model with its defaults: video and audio (`sample_audio=True`), the
    prompt padded to `text_tokens` with a padding mask (a long prompt's tokens valid)."""
    config, shape = a.config, a.shape
    mask = torch.zeros(shape.batch, shape.text_tokens, dtype=torch.bool, device=a.device)
    mask[:, : min(KANDINSKY6_PROMPT, shape.text_tokens)] = True
    return {
        "hidden_states": _latent(a),
        "encoder_hidden_states": a.randn(shape.batch, shape.text_tokens, config.in_text_dim),
        "pooled_projections": a.randn(shape.batch, config.in_text_dim2),
        "timestep": torch.full((shape.batch,), 500.0, device=a.device, dtype=a.dtype),
        "audio_hidden_states": a.randn(shape.batch, audio_latents(shape.frames), config.in_audio_dim),
        "encoder_attention_mask": mask,
    }


ARCHS = (
    Arch(
        name="kandinsky5",
        model_class=Kandinsky5Transformer3DModel,
        full=KANDINSKY5_VIDEO,
        quick=dict(KANDINSKY5_VIDEO, **_TINY, in_visual_dim=4, out_visual_dim=4),
        # The pipeline passes the prompt's own tokens after its template (no padding): a long prompt's, as the
        # original code's Qwen limit (256).
        text_tokens=256,
        inputs=kandinsky5_inputs,
        video=VideoClip(height=512, width=768, frames=121),  # Kandinsky5T2VPipeline's defaults
        depth_fields=_DEPTH,
        notes="Kandinsky 5.0 Video Lite 5 s (regular attention)",
    ),
    Arch(
        name="kandinsky5-image",
        model_class=Kandinsky5Transformer3DModel,
        full=KANDINSKY5_IMAGE,
        quick=dict(KANDINSKY5_IMAGE, **_TINY, in_visual_dim=4, out_visual_dim=4),
        text_tokens=256,
        inputs=partial(kandinsky5_inputs, video=False),
        depth_fields=_DEPTH,
        notes="Kandinsky 5.0 Image Lite (one frame)",
    ),
    Arch(
        name="kandinsky6",
        model_class=Kandinsky6Transformer3DModel,
        full=KANDINSKY6,
        quick=dict(
            KANDINSKY6,
            **_TINY,
            in_visual_dim=4,
            out_visual_dim=4,
            in_audio_dim=4,
            out_audio_dim=4,
            model_dim_a=64,
            time_dim_a=32,
            ff_dim_a=64,
            axes_dims_a=(8, 12, 12),
        ),  # fmt: skip
        # The pipeline pads every prompt to max_sequence_length (1024 by default) and masks the padding.
        text_tokens=1024,
        inputs=kandinsky6_inputs,
        video=VideoClip(height=480, width=864, frames=121),  # the release's defaults
        depth_fields=_DEPTH,
        notes="Kandinsky 6.0 Video Pro, video and audio",
    ),
)
