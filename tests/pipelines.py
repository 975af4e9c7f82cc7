"""Tiny offline Stable Diffusion pipelines and CLIP models for the tests (random weights, hand-made tokenizer)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline
from transformers import (
    CLIPConfig,
    CLIPImageProcessor,
    CLIPModel,
    CLIPProcessor,
    CLIPTextConfig,
    CLIPTextModel,
)

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
