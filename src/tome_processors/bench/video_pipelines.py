"""Random-weight text-to-video pipelines for `tome-processors bench --pipeline --arch wan` without `--model`.

The video counterpart of `pipelines.py`: every component of the real pipeline, built offline around the
bench's video transformer (`dit.py`), random weights:

- Wan2.1-T2V-1.3B (`WanPipeline`): the UMT5-XXL encoder (`UMT5EncoderModel`, 24 layers, width 4096) and a
  T5 tokenizer over a character vocabulary written to a temporary folder (prompts padded to 512 tokens,
  as the pipeline does); Wan2.1's VAE (`AutoencoderKLWan`, 16 latent channels, 4x in time, 8x in space);
  `UniPCMultistepScheduler` with flow sigmas, `flow_shift=3.0` (the published 480p setting).

`text_encoders="small"` keeps UMT5's width (what the transformer reads) with `SMALL_TEXT_LAYERS` layers;
`quick=True` makes every component tiny (the `--quick` transformer's widths). The clip (`height`,
`width`, `num_frames`) goes into `RandomPipeline.call_kwargs`, so that every generation asks for it.

Example:
    >>> from tome_processors.bench.dit import build_transformer
    >>> built = build_video_pipeline(build_transformer("wan", quick=True), "wan", quick=True, height=64, frames=9)
    >>> type(built.pipe).__name__, built.call_kwargs["num_frames"], built.call_kwargs["width"]
    ('WanPipeline', 9, 64)
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import diffusers
import torch
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler
from transformers import UMT5Config, UMT5EncoderModel

from .dit import QUICK_TEXT_TOKENS, VIDEO_DEFAULTS, VIDEO_STRIDES
from .pipelines import SMALL_TEXT_LAYERS, TEXT_ENCODER_SIZES, RandomPipeline, write_t5_tokenizer

__all__ = ["VIDEO_PIPELINE_ARCHITECTURES", "build_video_pipeline", "clip_of"]

#: Architectures `build_video_pipeline` knows (`--arch` with `--pipeline`).
VIDEO_PIPELINE_ARCHITECTURES = ("wan",)


#: The pipeline class of each architecture, by its name in diffusers' lazy namespace.
_PIPELINES = {"wan": "WanPipeline"}
#: UMT5-XXL's encoder, Wan's text encoder (google/umt5-xxl).
_UMT5_XXL = dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64, feed_forward_proj="gated-gelu",
                 vocab_size=256384, relative_attention_num_buckets=32, tie_word_embeddings=False)  # fmt: skip
#: Wan2.1-T2V's scheduler (the published 480p settings).
_WAN_SCHEDULER = dict(num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
#: A tiny Wan VAE with the real strides (4x in time: two temporal downsamplings; 8x in space: three levels).
_TINY_WAN_VAE = dict(base_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True])


def clip_of(arch: str, quick: bool, height: int | None, width: int | None, frames: int | None) -> tuple[int, int, int]:
    """The clip a generation asks for: `(height, width, num_frames)`, as the forward bench's (`models.build_model`).

    Unset values: the architecture's `dit.VIDEO_DEFAULTS`, or with `quick` 128 px, a square clip and 9
    frames (3 latent frames).

    Example:
        >>> clip_of("wan", False, None, None, None), clip_of("wan", True, 64, None, None)
        ((480, 832, 33), (64, 64, 9))
    """
    default_height, default_width, default_frames = VIDEO_DEFAULTS[arch]
    if quick:
        height = height or 128
        return height, width or height, frames or 9
    return height or default_height, width or default_width, frames or default_frames


def _umt5(vocab_size: int, quick: bool, small: bool, width: int) -> UMT5EncoderModel:
    shape: dict[str, Any] = dict(_UMT5_XXL)
    if quick:
        shape.update(d_model=width, d_kv=8, d_ff=2 * width, num_layers=2, num_heads=4, vocab_size=vocab_size)
    elif small:
        shape["num_layers"] = SMALL_TEXT_LAYERS
    return UMT5EncoderModel(UMT5Config(**shape, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).eval()


def build_video_pipeline(
    denoiser: torch.nn.Module,
    arch: str,
    quick: bool = False,
    text_encoders: str = "full",
    seed: int = 0,
    height: int | None = None,
    width: int | None = None,
    frames: int | None = None,
) -> RandomPipeline:
    """The text-to-video pipeline of `arch` around `denoiser` (the bench's transformer), random weights.

    Args:
        denoiser: the bench's transformer of that architecture (`--quick`: the tiny one); it is not copied.
        arch: `wan`.
        quick: every other component tiny too.
        text_encoders: `"full"` (UMT5-XXL's shape) or `"small"` (its width, `SMALL_TEXT_LAYERS` layers);
            ignored with `quick`.
        seed: seeds every component's random weights.
        height, width, frames: the clip (`clip_of`); `frames` must be of the form 4k + 1.

    Example:
        >>> from tome_processors.bench.dit import build_transformer
        >>> built = build_video_pipeline(build_transformer("wan", quick=True), "wan", quick=True)
        >>> sorted(built.components), built.call_kwargs
        (['scheduler', 'text_encoder', 'tokenizer', 'transformer', 'vae'], {'height': 128, 'width': 128, \
'num_frames': 9, 'max_sequence_length': 16})
    """
    if arch not in VIDEO_PIPELINE_ARCHITECTURES:
        raise ValueError(f"Expected arch among {list(VIDEO_PIPELINE_ARCHITECTURES)}, but got {arch!r}.")
    if text_encoders not in TEXT_ENCODER_SIZES:
        raise ValueError(f"Expected text_encoders among {list(TEXT_ENCODER_SIZES)}, but got {text_encoders!r}.")
    height, width, frames = clip_of(arch, quick, height, width, frames)
    time_stride, space_stride = VIDEO_STRIDES[arch]
    if frames < 1 or (frames - 1) % time_stride:
        raise ValueError(f"Expected frames of the form {time_stride}k + 1 for {arch}, but got {frames}.")
    side = 2 * space_stride  # the VAE's stride times the transformer's 2 x 2 patch
    if height % side or width % side:
        raise ValueError(f"Expected height and width multiples of {side} for {arch}, but got {height} x {width}.")
    small = text_encoders == "small"
    config = denoiser.config
    components: dict[str, Any] = {"transformer": denoiser}
    described = {"transformer": f"{type(denoiser).__name__}, the bench's {arch}{' (tiny)' if quick else ''} model"}
    with tempfile.TemporaryDirectory(prefix="tome-bench-tokenizers-") as folder:
        tokenizer = write_t5_tokenizer(Path(folder) / "umt5")
    torch.manual_seed(seed + 1)
    encoder = _umt5(len(tokenizer), quick, small, config.text_dim)
    components.update(text_encoder=encoder, tokenizer=tokenizer)
    layers, model_width = encoder.config.num_layers, encoder.config.d_model
    if quick:
        shape = f"tiny ({layers} layers, width {model_width})"
    elif small:
        shape = f"UMT5-XXL encoder width, {layers} of its 24 layers"
    else:
        shape = f"UMT5-XXL encoder shape ({layers} layers, width {model_width})"
    described["text_encoder"] = f"UMT5EncoderModel, {shape}, random weights"
    described["tokenizer"] = f"{type(tokenizer).__name__}, a character vocabulary written locally"
    torch.manual_seed(seed + 10)
    if quick:
        vae = AutoencoderKLWan(
            **_TINY_WAN_VAE,
            z_dim=config.out_channels,
            latents_mean=[0.0] * config.out_channels,
            latents_std=[1.0] * config.out_channels,
        )
    else:
        vae = AutoencoderKLWan()  # diffusers' defaults are Wan2.1's VAE
    components["vae"] = vae.eval()
    vae_shape = "tiny" if quick else "Wan2.1 VAE shape"
    described["vae"] = f"AutoencoderKLWan, {vae_shape} (base width {vae.config.base_dim}, {vae.config.z_dim} latent "
    described["vae"] += "channels, 4x in time, 8x in space)"
    with torch.device("cpu"):  # its tables live on the CPU whatever default device the caller set
        components["scheduler"] = UniPCMultistepScheduler(**_WAN_SCHEDULER)
    described["scheduler"] = "UniPCMultistepScheduler, flow sigmas, flow_shift 3.0 (Wan2.1's published settings)"
    # By name in diffusers' lazy namespace, as in `pipelines.py`: the pipeline classes import transformers'
    # image processors, which a bench that builds no pipeline never loads.
    pipe = getattr(diffusers, _PIPELINES[arch])(**components)
    pipe.set_progress_bar_config(disable=True)
    call_kwargs: dict[str, Any] = {"height": height, "width": width, "num_frames": frames}
    if quick:
        call_kwargs["max_sequence_length"] = QUICK_TEXT_TOKENS
    return RandomPipeline(pipe, described, call_kwargs)
