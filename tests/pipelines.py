"""Tiny offline Stable Diffusion pipelines and CLIP models for the tests (random weights, hand-made tokenizer)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from diffusers import (
    AnimateDiffPipeline,
    AutoencoderKL,
    AutoencoderKLTemporalDecoder,
    DDIMScheduler,
    EulerDiscreteScheduler,
    MotionAdapter,
    StableDiffusionPipeline,
    StableVideoDiffusionPipeline,
    UNetSpatioTemporalConditionModel,
)
from transformers import (
    CLIPConfig,
    CLIPImageProcessor,
    CLIPModel,
    CLIPProcessor,
    CLIPTextConfig,
    CLIPTextModel,
    CLIPVisionConfig,
    CLIPVisionModelWithProjection,
)

import tome_processors as tp
from tome_processors import ToMeProcessor
from tome_processors.bench.dit import build_transformer
from tome_processors.bench.generate import pipeline_call_kwargs
from tome_processors.bench.pipelines import build_pipeline, write_clip_tokenizer

from models import CROSS_DIM, tiny_unet

#: Prompt length of the tiny text encoders (their position table).
TOKENS = 16


def tiny_text_encoder(vocab_size: int) -> CLIPTextModel:
    torch.manual_seed(0)
    config = CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=CROSS_DIM,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=TOKENS,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
    )
    return CLIPTextModel(config).eval()


def tiny_vae() -> AutoencoderKL:
    torch.manual_seed(0)
    return AutoencoderKL(
        block_out_channels=(16, 32),
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        norm_num_groups=8,
    ).eval()


def tiny_sd_pipeline(tmp_path: str | Path) -> StableDiffusionPipeline:
    """An SD1.5-shaped text-to-image pipeline small enough for two-step generations at 32x32 px."""
    tokenizer = write_clip_tokenizer(Path(tmp_path) / "tokenizer-files", max_length=TOKENS)
    pipe = StableDiffusionPipeline(
        vae=tiny_vae(),
        text_encoder=tiny_text_encoder(len(tokenizer)),
        tokenizer=tokenizer,
        unet=tiny_unet("sd15"),
        scheduler=DDIMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", clip_sample=False),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def save_tiny_clip(folder: str | Path) -> Path:
    """A tiny random CLIP model with its processor (tokenizer and image processor) saved to `folder`."""
    folder = Path(folder)
    tokenizer = write_clip_tokenizer(folder / "tokenizer-files", max_length=TOKENS)
    torch.manual_seed(0)
    config = CLIPConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=TOKENS,
            bos_token_id=0,
            eos_token_id=1,
            pad_token_id=1,
        ),
        vision_config=dict(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        projection_dim=8,
    )
    CLIPModel(config).save_pretrained(folder)
    image_processor = CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    CLIPProcessor(image_processor=image_processor, tokenizer=tokenizer).save_pretrained(folder)
    return folder


#: The families' tiny pipelines: `family_pipeline(name, ...)`.
FAMILY_PIPELINES = ("sd", "pixart", "sd3", "flux")


def family_pipeline(family: str, tmp_path: str | Path) -> tuple[Any, dict]:
    """A tiny offline pipeline of `family` (`FAMILY_PIPELINES`) and the arguments of a small generation.

    SD: `tiny_sd_pipeline` (DDIM, 32 px); PixArt, SD3 and FLUX.1: the bench's `--quick` pipelines
    (their published schedulers, 64 px).
    """
    if family == "sd":
        return tiny_sd_pipeline(tmp_path), dict(prompt="a cat", height=32, width=32, output_type="np")
    built = build_pipeline(build_transformer(family, quick=True), family, quick=True)
    args = dict(prompt="a cat", height=64, width=64, output_type="np", **built.call_kwargs)
    return built.pipe, {**args, **pipeline_call_kwargs(built.pipe)}


def denoiser(pipe: Any) -> torch.nn.Module:
    return pipe.unet if hasattr(pipe, "unet") else pipe.transformer


def tiny_svd_unet(seed: int = 0) -> UNetSpatioTemporalConditionModel:
    """A Stable Video Diffusion UNet (diffusers' test config): spatio-temporal transformers at the first level."""
    torch.manual_seed(seed)
    return UNetSpatioTemporalConditionModel(
        block_out_channels=(32, 64),
        layers_per_block=2,
        sample_size=32,
        in_channels=8,
        out_channels=4,
        down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
        up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"),
        cross_attention_dim=CROSS_DIM,
        num_attention_heads=8,
        projection_class_embeddings_input_dim=96,
        addition_time_embed_dim=32,
    ).eval()


def tiny_svd_pipeline() -> StableVideoDiffusionPipeline:
    """An image-to-video Stable Video Diffusion pipeline for two-step, few-frame generations at 32x32 px."""
    torch.manual_seed(0)
    vae = AutoencoderKLTemporalDecoder(
        block_out_channels=(32, 64),
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * 2,
        latent_channels=4,
    ).eval()
    torch.manual_seed(0)
    vision = CLIPVisionConfig(
        hidden_size=CROSS_DIM,
        projection_dim=CROSS_DIM,
        num_hidden_layers=2,
        num_attention_heads=4,
        image_size=32,
        intermediate_size=37,
        patch_size=4,
    )
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        interpolation_type="linear",
        prediction_type="v_prediction",
        sigma_max=700.0,
        sigma_min=0.002,
        steps_offset=1,
        timestep_spacing="leading",
        timestep_type="continuous",
        use_karras_sigmas=True,
    )
    pipe = StableVideoDiffusionPipeline(
        vae=vae,
        image_encoder=CLIPVisionModelWithProjection(vision).eval(),
        unet=tiny_svd_unet(),
        scheduler=scheduler,
        feature_extractor=CLIPImageProcessor(crop_size=32, size=32),
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def tiny_animatediff_pipeline(tmp_path: str | Path) -> AnimateDiffPipeline:
    """A text-to-video AnimateDiff pipeline (a tiny SD1.5-shaped UNet with a motion adapter) at 32x32 px."""
    tokenizer = write_clip_tokenizer(Path(tmp_path) / "tokenizer-files", max_length=TOKENS)
    torch.manual_seed(0)
    adapter = MotionAdapter(
        block_out_channels=(32, 48, 64),
        motion_layers_per_block=1,
        motion_norm_num_groups=8,
        motion_num_attention_heads=4,
    )
    pipe = AnimateDiffPipeline(
        vae=tiny_vae(),
        text_encoder=tiny_text_encoder(len(tokenizer)),
        tokenizer=tokenizer,
        unet=tiny_unet("sd15"),
        motion_adapter=adapter,
        scheduler=DDIMScheduler(num_train_timesteps=1000, beta_schedule="linear", clip_sample=False),
        feature_extractor=None,
        image_encoder=None,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def svd_inputs(batch: int = 2, frames: int = 3, height: int = 16, width: int = 16, seed: int = 0) -> dict:
    """Keyword inputs of one `tiny_svd_unet` forward: `sample` is `(batch, frames, 8, height, width)`."""
    g = torch.Generator().manual_seed(seed)
    return {
        "sample": torch.randn(batch, frames, 8, height, width, generator=g),
        "timestep": torch.tensor(0.7),  # SVD's scheduler passes 0.25 * log(sigma)
        "encoder_hidden_states": torch.randn(batch, 1, CROSS_DIM, generator=g),  # the CLIP image embedding
        "added_time_ids": torch.tensor([[6.0, 127.0, 0.02]]).repeat(batch, 1),  # fps, motion bucket, noise
    }


#: The ways a user turns ToMe on in a pipeline: `apply_tome(pipe)`, `enable_tome(pipe)`, the README's first usage.
TOME_USAGES = ("apply_tome", "enable_tome", "set_attn_processor")


def check_pipeline_usage(
    build: Callable[[Path], Any], generate: Callable[[Any], Any], how: str, tmp_path: Path
) -> None:
    """A whole pipeline with ToMe at 0.5 turned on `how` (`TOME_USAGES`) before its first call, run as a user runs
    it: it merges (the output moves from a twin pipeline's plain output), two calls with one seed agree bit for
    bit and match `apply_tome` on that twin, and turning ToMe off gives the plain output back. `build(folder)`
    makes the pipeline, `generate(pipe)` one call.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = build(tmp_path / "a")
        if how == "apply_tome":
            tp.apply_tome(pipe, ratio=0.5)
        elif how == "enable_tome":
            tp.enable_tome(pipe, ratio=0.5)
        else:  # the README's first usage
            pipe.transformer.set_attn_processor(ToMeProcessor(ratio=0.5))
        first, second = np.asarray(generate(pipe)), np.asarray(generate(pipe))
        applied = tp.is_tome_applied(pipe)
        reference = build(tmp_path / "b")
        plain = np.asarray(generate(reference))
        tp.apply_tome(reference, ratio=0.5)
        expected = np.asarray(generate(reference))
    assert np.isfinite(first).all() and not np.allclose(first, plain, atol=1e-6)
    assert np.array_equal(first, second) and applied
    np.testing.assert_allclose(first, expected, rtol=0, atol=1e-6)
    tp.remove_tome(pipe) if how != "enable_tome" else tp.disable_tome(pipe)
    assert not tp.is_tome_applied(pipe) and np.array_equal(np.asarray(generate(pipe)), plain)
