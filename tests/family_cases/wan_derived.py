"""Wan-Animate, ChronoEdit and Helios (`families/wan_derived.py`): tiny random-weight models, inputs as their
pipelines pass them, and tiny offline pipelines (no downloads; the T5 tokenizer is written to the folder given).

Each grid is 6 x 8 tokens a frame (a 12 x 16 latent over Wan's 2 x 2 patch). Wan-Animate and ChronoEdit attend
to the image's CLIP tokens through their own keys (`added_kv_proj_dim`, as the released models): their processor
takes the last 512 context tokens as the text, as their pipelines pad it. At 0.5 the self-attention (`attn1`) of
each of the 2 blocks merges; cross-attention (unmerged by default) and Wan-Animate's face adapter keep every token.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch
from diffusers import (
    ChronoEditPipeline,
    ChronoEditTransformer3DModel,
    FlowMatchEulerDiscreteScheduler,
    HeliosPipeline,
    HeliosScheduler,
    HeliosTransformer3DModel,
    WanAnimatePipeline,
    WanAnimateTransformer3DModel,
)
from PIL import Image
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel, CLIPVisionModelWithProjection

from family_cases import FamilyCase, PipelineCase

#: The tiny models' width (2 heads of 12), latent channels, text width and prompt length (Helios: not padded).
WIDTH, LATENT, TEXT_DIM, TEXT = 24, 4, 16, 7
#: The text Wan's image-to-video attention splits off the end of its context (`WanAttnProcessor`).
PADDED_TEXT = 512
#: CLIP's width and image tokens in the model cases.
IMAGE_DIM, IMAGE_TOKENS = 16, 5
#: Wan-Animate's motion encoder reads faces of this side (`motion_encoder_size`).
FACE_SIDE = 16

_BLOCKS = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    text_dim=TEXT_DIM,
    freq_dim=32,
    ffn_dim=32,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
)


def tiny_wan_animate(image_dim: int = IMAGE_DIM) -> WanAnimateTransformer3DModel:
    """diffusers' own test config (its motion and face encoders), with the released model's image keys: a face
    adapter after block 0 (`inject_face_latents_blocks=2` of 2 blocks)."""
    torch.manual_seed(0)
    return WanAnimateTransformer3DModel(
        **_BLOCKS,
        in_channels=2 * LATENT + 4,
        latent_channels=LATENT,
        out_channels=LATENT,
        image_dim=image_dim,
        added_kv_proj_dim=WIDTH,
        rope_max_seq_len=32,
        motion_encoder_channel_sizes={"4": 16, "8": 16, "16": 16},
        motion_encoder_size=FACE_SIDE,
        motion_style_dim=8,
        motion_dim=4,
        motion_encoder_dim=16,
        face_encoder_hidden_dim=16,
        face_encoder_num_heads=2,
        inject_face_latents_blocks=2,
    ).eval()


def wan_animate_inputs(batch: int = 2, clip_frames: int = 2, h: int = 12, w: int = 16) -> dict:
    """As `WanAnimatePipeline` calls the model: the reference frame and `clip_frames` latent frames (5 pixel frames
    of face video per 2 latent frames), the pose latents of the clip's frames, 512 text tokens."""
    g = torch.Generator().manual_seed(0)
    face_frames = 4 * clip_frames - 3
    return {
        "hidden_states": torch.randn(batch, 2 * LATENT + 4, 1 + clip_frames, h, w, generator=g),
        "timestep": torch.full((batch,), 500.0),
        "encoder_hidden_states": torch.randn(batch, PADDED_TEXT, TEXT_DIM, generator=g),
        "encoder_hidden_states_image": torch.randn(batch, IMAGE_TOKENS, IMAGE_DIM, generator=g),
        "pose_hidden_states": torch.randn(batch, LATENT, clip_frames, h, w, generator=g),
        "face_pixel_values": torch.rand(batch, 3, face_frames, FACE_SIDE, FACE_SIDE, generator=g) * 2 - 1,
    }


def tiny_chronoedit(image_dim: int = IMAGE_DIM) -> ChronoEditTransformer3DModel:
    """Wan 2.1 image-to-video's shape (the released model's): the first frame's latents and mask as channels."""
    torch.manual_seed(0)
    return ChronoEditTransformer3DModel(
        **_BLOCKS,
        in_channels=2 * LATENT + 4,
        out_channels=LATENT,
        image_dim=image_dim,
        added_kv_proj_dim=WIDTH,
        rope_max_seq_len=32,
    ).eval()


def chronoedit_inputs(batch: int = 2, frames: int = 2, h: int = 12, w: int = 16) -> dict:
    """As `ChronoEditPipeline` calls the model: 2 latent frames (the image and its edit), 512 text tokens."""
    g = torch.Generator().manual_seed(0)
    return {
        "hidden_states": torch.randn(batch, 2 * LATENT + 4, frames, h, w, generator=g),
        "timestep": torch.full((batch,), 500.0),
        "encoder_hidden_states": torch.randn(batch, PADDED_TEXT, TEXT_DIM, generator=g),
        "encoder_hidden_states_image": torch.randn(batch, IMAGE_TOKENS, IMAGE_DIM, generator=g),
    }


def tiny_helios(**config) -> HeliosTransformer3DModel:
    """diffusers' own test config: rotary dims 4 + 4 + 4 of the 12 a head, the history's patches, cross-attention
    over the clip alone."""
    torch.manual_seed(0)
    shape = dict(
        **_BLOCKS,
        in_channels=LATENT,
        out_channels=LATENT,
        rope_dim=(4, 4, 4),
        has_multi_term_memory_patch=True,
        guidance_cross_attn=True,
        zero_history_timestep=True,
        is_amplify_history=False,
    )
    return HeliosTransformer3DModel(**{**shape, **config}).eval()


#: Helios's pipeline's history: 16 long-term, 2 mid-term and 1 short-term latent frames, with the first frame kept.
HISTORY = (16, 2, 1)


def helios_inputs(batch: int = 2, frames: int = 2, h: int = 12, w: int = 16, history: bool = True) -> dict:
    """As `HeliosPipeline` calls the model: the clip's `frames` latent frames and the history's latents (the first
    chunk's: zeros), the frame indices of both (one row for the whole batch, as the pipeline makes them)."""
    g = torch.Generator().manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(batch, LATENT, frames, h, w, generator=g),
        "timestep": torch.full((batch,), 500.0),
        "encoder_hidden_states": torch.randn(batch, TEXT, TEXT_DIM, generator=g),
    }
    long, mid, short = HISTORY
    indices = torch.arange(1 + long + mid + short + frames)
    prefix, long_at, mid_at, short_at, clip_at = indices.split([1, long, mid, short, frames])
    inputs["indices_hidden_states"] = clip_at[None]
    if not history:
        return inputs
    return {
        **inputs,
        "indices_latents_history_short": torch.cat([prefix, short_at])[None],
        "indices_latents_history_mid": mid_at[None],
        "indices_latents_history_long": long_at[None],
        "latents_history_short": torch.randn(batch, LATENT, 1 + short, h, w, generator=g),
        "latents_history_mid": torch.randn(batch, LATENT, mid, h, w, generator=g),
        "latents_history_long": torch.randn(batch, LATENT, long, h, w, generator=g),
    }


# ---------------------------------------------------------------- tiny pipelines


def _text_and_vae(folder: Path) -> dict:
    """The tiny Wan pipeline's tokenizer (written to `folder`), UMT5 text encoder and VAE (4 latent channels)."""
    from test_video import tiny_wan_pipeline

    wan = tiny_wan_pipeline(folder)
    return dict(tokenizer=wan.tokenizer, text_encoder=wan.text_encoder, vae=wan.vae)


def _clip(side: int, projection: bool) -> tuple[torch.nn.Module, CLIPImageProcessor]:
    torch.manual_seed(0)
    config = CLIPVisionConfig(
        hidden_size=IMAGE_DIM,
        intermediate_size=32,
        projection_dim=IMAGE_DIM,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=side,
        patch_size=8,
    )
    encoder = (CLIPVisionModelWithProjection if projection else CLIPVisionModel)(config).eval()
    with warnings.catch_warnings():  # without torchvision it falls back to the PIL processor, and says so
        warnings.simplefilter("ignore")
        return encoder, CLIPImageProcessor(crop_size=side, size={"shortest_edge": side})


def _picture(side: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8))


def wan_animate_pipeline(folder: Path) -> WanAnimatePipeline:
    encoder, processor = _clip(32, projection=False)
    pipe = WanAnimatePipeline(
        **_text_and_vae(folder),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        image_processor=processor,
        image_encoder=encoder,
        transformer=tiny_wan_animate(),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def chronoedit_pipeline(folder: Path) -> ChronoEditPipeline:
    encoder, processor = _clip(32, projection=True)
    pipe = ChronoEditPipeline(
        **_text_and_vae(folder),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        image_processor=processor,
        image_encoder=encoder,
        transformer=tiny_chronoedit(),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def helios_pipeline(folder: Path) -> HeliosPipeline:
    pipe = HeliosPipeline(
        **_text_and_vae(folder),
        scheduler=HeliosScheduler(stage_range=[0, 1], stages=1, use_dynamic_shifting=True),
        transformer=tiny_helios(),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


#: 32 x 32 px clips of 5 frames: 2 latent frames of 2 x 2 tokens (Wan-Animate: and the reference image's frame).
SIDE, FRAMES = 32, 5

CASES = (
    FamilyCase(
        name="wan_animate",
        family="wan_animate",
        build=tiny_wan_animate,
        inputs=wan_animate_inputs,
        merged_calls=2,  # attn1 of the 2 blocks (3 frames of 6 x 8 tokens); not attn2's two calls, not the face adapter
        pipeline=PipelineCase(
            build=wan_animate_pipeline,
            call_kwargs=dict(
                image=_picture(SIDE),
                pose_video=[_picture(SIDE, seed) for seed in range(FRAMES)],
                face_video=[_picture(FACE_SIDE, seed) for seed in range(FRAMES)],
                prompt="a cat dances",
                height=SIDE,
                width=SIDE,
                segment_frame_length=FRAMES,
                num_inference_steps=2,
                output_type="np",
            ),
            height=SIDE,
            width=SIDE,
            num_frames=FRAMES,
        ),
    ),
    FamilyCase(
        name="chronoedit",
        family="chronoedit",
        build=tiny_chronoedit,
        inputs=chronoedit_inputs,
        merged_calls=2,  # attn1 of the 2 blocks (2 frames of 6 x 8 tokens)
        pipeline=PipelineCase(
            build=chronoedit_pipeline,
            call_kwargs=dict(
                image=_picture(SIDE),
                prompt="make it red",
                negative_prompt="blurry",
                height=SIDE,
                width=SIDE,
                num_frames=FRAMES,
                num_inference_steps=2,
                guidance_scale=5.0,
                output_type="np",
            ),
            height=SIDE,
            width=SIDE,
            num_frames=FRAMES,
        ),
    ),
    FamilyCase(
        name="helios",
        family="helios",
        build=tiny_helios,
        inputs=helios_inputs,
        merged_calls=2,  # attn1 of the 2 blocks (2 frames of 6 x 8 tokens after 124 history tokens)
        pipeline=PipelineCase(
            build=helios_pipeline,
            call_kwargs=dict(
                prompt="a cat walks",
                negative_prompt="blurry",
                height=SIDE,
                width=SIDE,
                num_frames=FRAMES,
                num_latent_frames_per_chunk=2,  # one chunk of the 5 frames
                num_inference_steps=2,
                guidance_scale=5.0,
                max_sequence_length=16,
                output_type="np",
            ),
            height=SIDE,
            width=SIDE,
            num_frames=FRAMES,
        ),
    ),
)
