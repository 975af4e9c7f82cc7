"""Random-weight video pipelines for `tome-processors bench --pipeline --arch wan|wan-i2v|ltx` without `--model`.

The video counterpart of `pipelines.py`: every component of the real pipeline, built offline around the
bench's video transformer (`dit.py`), random weights, and a tokenizer over a character vocabulary written
to a temporary folder (prompts padded to the real lengths, as the pipelines do):

- Wan2.1-T2V-1.3B (`WanPipeline`): the UMT5-XXL encoder (`UMT5EncoderModel`, 24 layers, width 4096, 512
  tokens); Wan2.1's VAE (`AutoencoderKLWan`, 16 latent channels, 4x in time, 8x in space);
  `UniPCMultistepScheduler` with flow sigmas, `flow_shift=3.0` (the published 480p setting);
- Wan2.1-I2V-14B-480P (`WanImageToVideoPipeline`): the same, with CLIP ViT-H/14's vision tower and image
  processor and a first frame (`image_to_video.py`); its prompts always 512 tokens (the transformer's
  attention splits its context at 512 from the end), `--quick` too;
- LTX-Video 0.9 (`LTXPipeline`): the T5 v1.1 XXL encoder (`T5EncoderModel`, 128 tokens); LTX-Video's VAE
  (`AutoencoderKLLTXVideo`, 128 latent channels, 8x in time, 32x in space); `FlowMatchEulerDiscreteScheduler`
  with the published dynamic shifting.

`text_encoders="small"` keeps the encoder's width (what the transformer reads) with `SMALL_TEXT_LAYERS`
layers; `quick=True` makes every component tiny (the `--quick` transformer's widths, the real VAE strides).
The clip (`height`, `width`, `num_frames`) goes into `RandomPipeline.call_kwargs`, so that every
generation asks for it.

Example:
    >>> from tome_processors.bench.dit import build_transformer
    >>> built = build_video_pipeline(build_transformer("wan", quick=True), "wan", quick=True, height=64, frames=9)
    >>> type(built.pipe).__name__, built.call_kwargs["num_frames"], built.call_kwargs["width"]
    ('WanPipeline', 9, 64)
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import diffusers
import torch
from diffusers import AutoencoderKLLTXVideo, AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler
from PIL import Image
from transformers import T5Config, T5EncoderModel, UMT5Config, UMT5EncoderModel

from .dit import QUICK_TEXT_TOKENS, VIDEO_DEFAULTS, VIDEO_STRIDES
from .image_to_video import (
    FIRST_FRAME_PHOTO,
    clip_image_processor,
    clip_vision_encoder,
    first_frame,
    image_tokens,
    missing_requirements,
)
from .pipelines import SMALL_TEXT_LAYERS, T5_XXL, TEXT_ENCODER_SIZES, RandomPipeline, write_t5_tokenizer

__all__ = ["CLIP_MULTIPLES", "VIDEO_PIPELINE_ARCHITECTURES", "build_video_pipeline", "clip_of"]

#: UMT5-XXL's encoder, Wan's text encoder (google/umt5-xxl).
_UMT5_XXL = dict(T5_XXL, vocab_size=256384)


@dataclass(frozen=True)
class _VideoPipeline:
    """What `build_video_pipeline` builds for one architecture."""

    pipeline: str  # the class, by its name in diffusers' lazy namespace (`pipelines.py` says why)
    vae: str  # "wan" or "ltx"
    encoder: str  # "umt5" or "t5"
    encoder_label: str
    text_tokens: int  # the pipeline's `max_sequence_length` default
    patch: int  # the transformer's patch side in latent pixels
    scheduler: tuple[type, dict[str, Any], str]
    vae_label: str


#: Wan2.1's scheduler, 480p (the I2V 480P model's too: Wan's own scripts shift 480p image-to-video by 3.0).
_WAN_SCHEDULER = (
    UniPCMultistepScheduler,
    dict(num_train_timesteps=1000, prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0),
    "flow sigmas, flow_shift 3.0 (Wan2.1's published 480p settings)",
)
#: Pipelines whose prompts keep their real length with `quick` (Wan I2V: its attention needs the 512 tokens).
_FIXED_TEXT = ("wan-i2v",)

_ARCHITECTURES: dict[str, _VideoPipeline] = {
    "wan": _VideoPipeline(
        "WanPipeline", "wan", "umt5", "UMT5-XXL encoder", 512, 2, _WAN_SCHEDULER, "Wan2.1 VAE",
    ),
    "wan-i2v": _VideoPipeline(
        "WanImageToVideoPipeline", "wan", "umt5", "UMT5-XXL encoder", 512, 2, _WAN_SCHEDULER, "Wan2.1 VAE",
    ),
    "ltx": _VideoPipeline(
        "LTXPipeline", "ltx", "t5", "T5 v1.1 XXL encoder", 128, 1,
        (FlowMatchEulerDiscreteScheduler, dict(num_train_timesteps=1000, shift=1.0, use_dynamic_shifting=True,
                                               base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
                                               max_image_seq_len=4096, shift_terminal=0.1),
         "dynamic shift (LTX-Video's published settings)"),
        "LTX-Video VAE",
    ),
}  # fmt: skip
#: Architectures `build_video_pipeline` knows (`--arch` with `--pipeline`).
VIDEO_PIPELINE_ARCHITECTURES = tuple(_ARCHITECTURES)
#: What a clip's height and width must be multiples of: the VAE's spatial stride times the transformer's patch.
CLIP_MULTIPLES = {arch: VIDEO_STRIDES[arch][1] * spec.patch for arch, spec in _ARCHITECTURES.items()}


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


def _text_encoder(kind: str, vocab_size: int, quick: bool, small: bool, width: int) -> torch.nn.Module:
    shape: dict[str, Any] = dict(_UMT5_XXL if kind == "umt5" else T5_XXL)
    if quick:
        shape.update(d_model=width, d_kv=8, d_ff=2 * width, num_layers=2, num_heads=4, vocab_size=vocab_size)
    elif small:
        shape["num_layers"] = SMALL_TEXT_LAYERS
    config_class, model_class = (UMT5Config, UMT5EncoderModel) if kind == "umt5" else (T5Config, T5EncoderModel)
    return model_class(config_class(**shape, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).eval()


def _vae(kind: str, quick: bool, latent_channels: int) -> torch.nn.Module:
    """The VAE (`kind` "wan" or "ltx"): the real one's shape (diffusers' defaults are Wan2.1's and LTX-Video
    0.9's), or a tiny one with the real strides and `latent_channels` (the `--quick` transformer's)."""
    if kind == "wan":
        if not quick:
            return AutoencoderKLWan().eval()
        # two temporal downsamplings (4x), three levels (8x)
        flat = dict(z_dim=latent_channels, latents_mean=[0.0] * latent_channels, latents_std=[1.0] * latent_channels)
        return AutoencoderKLWan(base_dim=8, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                                temperal_downsample=[False, True, True], **flat).eval()  # fmt: skip
    if not quick:
        return AutoencoderKLLTXVideo().eval()
    # patch 4 and three space-time scalings (32x, 8x)
    return AutoencoderKLLTXVideo(latent_channels=latent_channels, block_out_channels=(8, 8, 8, 8),
                                 decoder_block_out_channels=(8, 8, 8, 8), layers_per_block=(1, 1, 1, 1, 1),
                                 decoder_layers_per_block=(1, 1, 1, 1, 1)).eval()  # fmt: skip


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
        arch: `wan`, `wan-i2v` or `ltx`.
        quick: every other component tiny too.
        text_encoders: `"full"` (the real encoder's shape) or `"small"` (its width, `SMALL_TEXT_LAYERS`
            layers); ignored with `quick`.
        seed: seeds every component's random weights.
        height, width, frames: the clip (`clip_of`): height and width multiples of `CLIP_MULTIPLES[arch]`,
            frames of the form `sk + 1` with `s` the VAE's stride in time (`dit.VIDEO_STRIDES`).

    Example:
        >>> from tome_processors.bench.dit import build_transformer
        >>> built = build_video_pipeline(build_transformer("wan", quick=True), "wan", quick=True)
        >>> sorted(built.components), built.call_kwargs
        (['scheduler', 'text_encoder', 'tokenizer', 'transformer', 'vae'], {'height': 128, 'width': 128, \
'num_frames': 9, 'max_sequence_length': 16})
    """
    if arch not in _ARCHITECTURES:
        raise ValueError(f"Expected arch among {list(VIDEO_PIPELINE_ARCHITECTURES)}, but got {arch!r}.")
    if text_encoders not in TEXT_ENCODER_SIZES:
        raise ValueError(f"Expected text_encoders among {list(TEXT_ENCODER_SIZES)}, but got {text_encoders!r}.")
    spec = _ARCHITECTURES[arch]
    height, width, frames = clip_of(arch, quick, height, width, frames)
    time_stride, space_stride = VIDEO_STRIDES[arch]
    if frames < 1 or (frames - 1) % time_stride:
        raise ValueError(f"Expected frames of the form {time_stride}k + 1 for {arch}, but got {frames}.")
    side = CLIP_MULTIPLES[arch]
    if height % side or width % side:
        raise ValueError(f"Expected height and width multiples of {side} for {arch}, but got {height} x {width}.")
    small = text_encoders == "small"
    config = denoiser.config
    components: dict[str, Any] = {"transformer": denoiser}
    described = {"transformer": f"{type(denoiser).__name__}, the bench's {arch}{' (tiny)' if quick else ''} model"}
    with tempfile.TemporaryDirectory(prefix="tome-bench-tokenizers-") as folder:
        tokenizer = write_t5_tokenizer(Path(folder) / spec.encoder)
    torch.manual_seed(seed + 1)
    text_width = config.text_dim if spec.vae == "wan" else config.caption_channels
    encoder = _text_encoder(spec.encoder, len(tokenizer), quick, small, text_width)
    components.update(text_encoder=encoder, tokenizer=tokenizer)
    layers, model_width = encoder.config.num_layers, encoder.config.d_model
    if quick:
        shape = f"tiny ({layers} layers, width {model_width})"
    elif small:
        shape = f"{spec.encoder_label} width, {layers} of its {T5_XXL['num_layers']} layers"
    else:
        shape = f"{spec.encoder_label} shape ({layers} layers, width {model_width})"
    described["text_encoder"] = f"{type(encoder).__name__}, {shape}, random weights"
    described["tokenizer"] = f"{type(tokenizer).__name__}, a character vocabulary written locally"
    torch.manual_seed(seed + 10)
    vae = components["vae"] = _vae(spec.vae, quick, config.out_channels)
    strides = f"{time_stride}x in time, {space_stride}x in space"
    channels = vae.config.z_dim if spec.vae == "wan" else vae.config.latent_channels
    vae_shape = "tiny" if quick else f"{spec.vae_label} shape"
    described["vae"] = f"{type(vae).__name__}, {vae_shape} ({channels} latent channels, {strides})"
    scheduler_class, scheduler_config, settings = spec.scheduler
    with torch.device("cpu"):  # its tables live on the CPU whatever default device the caller set
        components["scheduler"] = scheduler_class(**scheduler_config)
    described["scheduler"] = f"{scheduler_class.__name__}, {settings}"
    call_kwargs: dict[str, Any] = {"height": height, "width": width, "num_frames": frames}
    if arch == "wan-i2v":
        torch.manual_seed(seed + 20)
        call_kwargs["image"] = _add_image_encoder(components, described, quick, small, config.image_dim, height, width)
    pipe = getattr(diffusers, spec.pipeline)(**components)
    pipe.set_progress_bar_config(disable=True)
    call_kwargs["max_sequence_length"] = QUICK_TEXT_TOKENS if quick and arch not in _FIXED_TEXT else spec.text_tokens
    return RandomPipeline(pipe, described, call_kwargs)


def _add_image_encoder(
    components: dict[str, Any], described: dict[str, str], quick: bool, small: bool, width: int, height: int, side: int
) -> Image.Image:
    """Wan I2V's CLIP vision tower and image processor into `components` (and what they are into `described`);
    returns the first frame every generation starts from (`height x side` pixels)."""
    missing = missing_requirements()
    if missing:
        raise ValueError(f"Expected {' and '.join(missing)} for the wan-i2v pipeline: pip install {' '.join(missing)}.")
    encoder = components["image_encoder"] = clip_vision_encoder(quick, small, width)
    components["image_processor"] = clip_image_processor(quick)
    layers, tokens = encoder.config.num_hidden_layers, image_tokens(encoder)
    shape = "tiny" if quick else f"CLIP ViT-H/14's width, {layers} layers" if small else "CLIP ViT-H/14 shape"
    described["image_encoder"] = f"{type(encoder).__name__}, {shape} ({tokens} image tokens), random weights"
    side_px = encoder.config.image_size
    described["image_processor"] = f"CLIPImageProcessor, {side_px} px; the first frame: the {FIRST_FRAME_PHOTO} photo"
    return first_frame(height, side)
