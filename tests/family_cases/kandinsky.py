"""Kandinsky 5 (video, and the image pipelines' one frame) and Kandinsky 6 (video, and video with audio and a
reference frame) for the family table: tiny random-weight models called as their pipelines call them, and tiny
offline pipelines (Kandinsky 5's text-to-video and text-to-image, Kandinsky 6's text-to-video).

Every model is made of 2 visual blocks; at ratio 0.5 only each block's self-attention merges (`merge_crossattn` is
off), so each forward has 2 merged attention calls. The latents are channels last, `(B, T, H, W, C)`, over a patch
of `(1, 2, 2)`: 12 x 16 latent pixels are a 6 x 8 token grid; the text is 7 tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers import (
    AutoencoderKL,
    AutoencoderKLHunyuanVideo,
    FlowMatchEulerDiscreteScheduler,
    Kandinsky5T2IPipeline,
    Kandinsky5T2VPipeline,
    Kandinsky5Transformer3DModel,
    Kandinsky6TI2VAPipeline,
    Kandinsky6Transformer3DModel,
)
from transformers import CLIPTextConfig, CLIPTextModel, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from tome_processors.bench.pipelines import write_clip_tokenizer

from . import FamilyCase, PipelineCase
from test_new_families import write_qwen_tokenizer

TEXT_DIM, POOLED_DIM, TEXT = 16, 8, 7  # the text: 7 tokens, not a multiple of anything (an off-by-text error shows)
CHANNELS, AUDIO_CHANNELS = 4, 4
FRAMES, H, W = 2, 6, 8  # latent frames and the token grid (latent pixels over the patch (1, 2, 2))
#: Both models' widths: 2 heads of 16 channels (the head is the rotary axes' sum, 4 + 6 + 6).
SHAPE = dict(model_dim=32, ff_dim=32, time_dim=16, axes_dims=(4, 6, 6), patch_size=(1, 2, 2))
MERGED_CALLS = 2  # each of the 2 visual blocks' self-attention
#: Why Kandinsky 5's cases skip the table's batch check (tests/test_kandinsky.py makes it at its model's precision).
BFLOAT16_ROTATION = (
    "Kandinsky 5's processor rounds the rotated queries and keys to bfloat16 (apply_rotary in "
    "transformer_kandinsky.py): the plain model's batch of two already differs from two batches of one by up to 6e-5"
)


def tiny_kandinsky5(visual_cond: bool = True) -> Kandinsky5Transformer3DModel:
    """Kandinsky 5 with 2 visual blocks and 1 text block. Its modulations are built zeroed (each block starts as the
    identity, the residual gates 0), so they are drawn here: else no attention would reach the output.

    `visual_cond`: the video models' input of the noisy latent, the conditioning latent and its mask (`2 C + 1`
    channels, as the released text- and image-to-video models); False: the image models' `C` channels.
    """
    torch.manual_seed(0)
    model = Kandinsky5Transformer3DModel(
        in_visual_dim=CHANNELS, out_visual_dim=CHANNELS, in_text_dim=TEXT_DIM, in_text_dim2=POOLED_DIM,
        num_text_blocks=1, num_visual_blocks=2, visual_cond=visual_cond, **SHAPE,
    )  # fmt: skip
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "modulation" in name:
                parameter.normal_(0.0, 0.1)
    return model.eval()


def kandinsky5_inputs(batch: int = 2, frames: int = FRAMES, visual_cond: bool = True) -> dict:
    """One forward as `Kandinsky5T2VPipeline` makes it (`Kandinsky5T2IPipeline`: `frames=1`, `visual_cond=False`)."""
    g = torch.Generator().manual_seed(0)
    channels = 2 * CHANNELS + 1 if visual_cond else CHANNELS
    return {
        "hidden_states": torch.randn(batch, frames, 2 * H, 2 * W, channels, generator=g),
        "encoder_hidden_states": torch.randn(batch, TEXT, TEXT_DIM, generator=g),
        "timestep": torch.full((batch,), 750.0),
        "pooled_projections": torch.randn(batch, POOLED_DIM, generator=g),
        "visual_rope_pos": [torch.arange(frames), torch.arange(H), torch.arange(W)],
        "text_rope_pos": torch.arange(TEXT),
        "scale_factor": (1.0, 2.0, 2.0) if frames > 1 else (1.0, 1.0, 1.0),
    }


def tiny_kandinsky6() -> Kandinsky6Transformer3DModel:
    """Kandinsky 6 with 2 fused video and audio blocks and 1 text block per stream, as the released models are
    configured (`visual_cond`, `ca_rope`, `cross_gates`, `fix_modulation`, two visual token types)."""
    torch.manual_seed(0)
    return Kandinsky6Transformer3DModel(
        in_visual_dim=CHANNELS, out_visual_dim=CHANNELS, in_text_dim=TEXT_DIM, in_text_dim2=POOLED_DIM,
        num_text_blocks=1, num_visual_blocks=2, visual_cond=True, in_audio_dim=AUDIO_CHANNELS,
        out_audio_dim=AUDIO_CHANNELS, model_dim_a=32, time_dim_a=16, ff_dim_a=16, axes_dims_a=(4, 6, 6),
        text_token_padding=True, ca_rope=True, cross_gates=True, fix_modulation=True,
        visual_token_type_num_embeddings=2, **SHAPE,
    ).eval()  # fmt: skip


def kandinsky6_inputs(batch: int = 2, reference: bool = False) -> dict:
    """One forward as `Kandinsky6TI2VAPipeline` makes it: text-to-video without audio; with `reference`, image-to-
    video-and-audio: the reference image's latent appended as one more frame (token type 1, at the first frame's
    rotary position), audio latents, and a text padding mask (the second prompt 2 tokens shorter)."""
    g = torch.Generator().manual_seed(0)
    frames = FRAMES + 1 if reference else FRAMES
    inputs = {
        "hidden_states": torch.randn(batch, frames, 2 * H, 2 * W, 2 * CHANNELS + 1, generator=g),
        "encoder_hidden_states": torch.randn(batch, TEXT, TEXT_DIM, generator=g),
        "pooled_projections": torch.randn(batch, POOLED_DIM, generator=g),
        "timestep": torch.full((batch,), 750.0),
    }
    if reference:
        types = torch.zeros(batch, frames, dtype=torch.long)
        types[:, -1] = 1
        mask = torch.ones(batch, TEXT, dtype=torch.bool)
        mask[1:, -2:] = False
        inputs |= {
            "audio_hidden_states": torch.randn(batch, 5, AUDIO_CHANNELS, generator=g),
            "visual_rope_pos": (torch.cat([torch.arange(FRAMES), torch.zeros(1, dtype=torch.long)]), torch.arange(H),
                                torch.arange(W)),
            "visual_token_type_ids": types,
            "encoder_attention_mask": mask,
        }  # fmt: skip
    return inputs


# ---------------------------------------------------------------- pipelines (tiny, offline)


def _text_encoders(folder: Path) -> dict:
    """The pipelines' text side, random weights: Qwen2.5-VL (one layer) over a byte-level tokenizer, and CLIP for the
    pooled projection over a character tokenizer."""
    tokenizer = write_qwen_tokenizer(folder / "qwen")
    text = {"hidden_size": TEXT_DIM, "intermediate_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2}
    text |= {"num_key_value_heads": 2, "rope_scaling": {"mrope_section": [1, 1, 2], "rope_type": "default"}}
    text |= {"vocab_size": len(tokenizer)}  # (the top-level vocab_size does not reach the text model's lm_head)
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 16, "num_heads": 2, "out_hidden_size": 16}
    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, hidden_size=TEXT_DIM, vocab_size=len(tokenizer))
    tokenizer_2 = write_clip_tokenizer(folder / "clip", max_length=77)  # the pipelines pad to 77
    clip = CLIPTextConfig(
        vocab_size=len(tokenizer_2), hidden_size=POOLED_DIM, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )  # fmt: skip
    return {
        "text_encoder": Qwen2_5_VLForConditionalGeneration(config).eval(),
        "tokenizer": tokenizer,
        "text_encoder_2": CLIPTextModel(clip).eval(),
        "tokenizer_2": tokenizer_2,
    }


def _video_vae() -> AutoencoderKLHunyuanVideo:
    """HunyuanVideo's VAE (8x in space, 4x in time), tiny: the generations stop at the latents, its factors are read."""
    torch.manual_seed(0)
    return AutoencoderKLHunyuanVideo(
        latent_channels=CHANNELS, block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4,
        spatial_compression_ratio=8, temporal_compression_ratio=4,
    ).eval()  # fmt: skip


def _short_template(pipe) -> None:
    """The prompt alone, not the pipeline's system prompt (128 or 40 tokens of the real tokenizer, cropped from the
    encoder's output as the pipeline crops it: 0 here)."""
    pipe.prompt_template = "{}"
    pipe.prompt_template_encode_start_idx = 0


def tiny_kandinsky5_video_pipeline(folder: Path) -> Kandinsky5T2VPipeline:
    pipe = Kandinsky5T2VPipeline(
        transformer=tiny_kandinsky5(), vae=_video_vae(), scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        **_text_encoders(folder),
    )  # fmt: skip
    _short_template(pipe)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_kandinsky5_image_pipeline(folder: Path) -> Kandinsky5T2IPipeline:
    """The text-to-image pipeline with FLUX.1's VAE shape (8x, 16 channels in the released model; 4 here). It snaps
    every size to one of its trained resolutions (1024 px and up): this one is told 128 x 96 px is one."""
    torch.manual_seed(0)
    vae = AutoencoderKL(
        block_out_channels=(8, 8, 16, 16), down_block_types=("DownEncoderBlock2D",) * 4,
        up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=1, latent_channels=CHANNELS, norm_num_groups=8,
    ).eval()  # fmt: skip
    pipe = Kandinsky5T2IPipeline(
        transformer=tiny_kandinsky5(visual_cond=False), vae=vae, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        **_text_encoders(folder),
    )  # fmt: skip
    _short_template(pipe)
    pipe.resolutions = [(8 * 2 * W, 8 * 2 * H)]  # (width, height)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_kandinsky6_pipeline(folder: Path) -> Kandinsky6TI2VAPipeline:
    """Kandinsky 6's text-to-video (no audio VAE: `sample_audio=False`). Its chat template is a module constant of
    657 bytes before the prompt, cropped at 129 tokens: the byte-level tokenizer's prompt is read at a
    `max_sequence_length` of 560 (the prompt padded to it: the model gets a text padding mask)."""
    pipe = Kandinsky6TI2VAPipeline(
        transformer=tiny_kandinsky6(), vae=_video_vae(), scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        **_text_encoders(folder),
    )  # fmt: skip
    pipe.set_progress_bar_config(disable=True)
    return pipe


#: One call of the video pipelines: 5 frames (2 latent frames) of 96 x 128 px (6 x 8 tokens), two steps with
#: classifier-free guidance (two model calls each), up to the latents.
VIDEO_CALL = {
    "prompt": "a cat walks",
    "negative_prompt": "dark",
    "height": 8 * 2 * H,
    "width": 8 * 2 * W,
    "num_frames": 5,
    "num_inference_steps": 2,
    "guidance_scale": 5.0,
    "max_sequence_length": 16,
    "output_type": "latent",
}
IMAGE_CALL = {key: value for key, value in VIDEO_CALL.items() if key != "num_frames"}
KANDINSKY6_CALL = {**VIDEO_CALL, "max_sequence_length": 560, "sample_audio": False}


CASES = (
    FamilyCase(
        name="kandinsky5",
        family="kandinsky5",
        build=tiny_kandinsky5,
        inputs=kandinsky5_inputs,
        merged_calls=MERGED_CALLS,
        batch_independent=False,
        why_not_independent=BFLOAT16_ROTATION,
        pipeline=PipelineCase(tiny_kandinsky5_video_pipeline, VIDEO_CALL, 8 * 2 * H, 8 * 2 * W, num_frames=5),
    ),
    FamilyCase(
        name="kandinsky5-image",
        family="kandinsky5",
        build=lambda: tiny_kandinsky5(visual_cond=False),
        inputs=lambda batch=2: kandinsky5_inputs(batch, frames=1, visual_cond=False),
        merged_calls=MERGED_CALLS,
        batch_independent=False,
        why_not_independent=BFLOAT16_ROTATION,
        pipeline=PipelineCase(tiny_kandinsky5_image_pipeline, IMAGE_CALL, 8 * 2 * H, 8 * 2 * W),
    ),
    FamilyCase(
        name="kandinsky6",
        family="kandinsky6",
        build=tiny_kandinsky6,
        inputs=kandinsky6_inputs,
        merged_calls=MERGED_CALLS,
        pipeline=PipelineCase(tiny_kandinsky6_pipeline, KANDINSKY6_CALL, 8 * 2 * H, 8 * 2 * W, num_frames=5),
    ),
    FamilyCase(
        name="kandinsky6-i2va",
        family="kandinsky6",
        build=tiny_kandinsky6,
        inputs=lambda batch=2: kandinsky6_inputs(batch, reference=True),
        merged_calls=MERGED_CALLS,
    ),
)
