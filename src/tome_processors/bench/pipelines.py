"""Random-weight text-to-image pipelines for `tome-processors bench --pipeline` without `--model`.

Every component a user's pipeline has, built offline around the bench's denoiser (`unet.py`, `dit.py`):

- text encoders of the real pipeline's classes and shapes (CLIP ViT-L/14, OpenCLIP ViT-H/14 and
  ViT-bigG/14, T5 v1.1 XXL's encoder), random weights; `text_encoders="small"` keeps their widths
  (what the denoiser reads) but only `SMALL_TEXT_LAYERS` layers each;
- tokenizers of the real classes (`CLIPTokenizer`, `T5Tokenizer`) over a character vocabulary written to
  a folder here (nothing is downloaded). The pipelines pad every prompt to the real lengths (77 CLIP
  tokens, T5's `max_sequence_length`), so the text encoders see sequences of the real length;
- the VAE of the real shape (SD's, SDXL's, or the 16-channel SD3 / Flux one), random weights;
- the real pipeline's scheduler class with its published settings.

`quick=True` makes every component tiny (for the bench's `--quick` denoisers). No safety checker and no
watermarker: the real pipelines are usually run without them.

Example:
    >>> from tome_processors.bench.unet import build_unet
    >>> built = build_pipeline(build_unet("tiny"), "sd15", quick=True)
    >>> type(built.pipe).__name__, type(built.pipe.scheduler).__name__
    ('StableDiffusionPipeline', 'PNDMScheduler')
"""

from __future__ import annotations

import json
import string
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import diffusers
import torch
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    DiffusionPipeline,
    DPMSolverMultistepScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    PNDMScheduler,
)
from transformers import (
    CLIPTextConfig,
    CLIPTextModel,
    CLIPTextModelWithProjection,
    CLIPTokenizer,
    T5Config,
    T5EncoderModel,
    T5Tokenizer,
)

from .dit import QUICK_TEXT_TOKENS

__all__ = [
    "FLUX_SCHEDULER",
    "FLUX_VAE",
    "PIPELINE_ARCHITECTURES",
    "SMALL_TEXT_LAYERS",
    "T5_XXL",
    "TEXT_ENCODER_SIZES",
    "TINY_VAE",
    "RandomPipeline",
    "build_pipeline",
    "write_clip_tokenizer",
    "write_t5_tokenizer",
]

#: `text_encoders` choices: the real depth, or `SMALL_TEXT_LAYERS` layers of the real width.
TEXT_ENCODER_SIZES = ("full", "small")
#: Layers per text encoder with `text_encoders="small"`.
SMALL_TEXT_LAYERS = 2
#: CLIP's prompt length: the SD pipelines pad every prompt to it.
CLIP_TOKENS = 77

_SYMBOLS = list(string.ascii_lowercase + string.digits + ",.-'")


@dataclass(frozen=True)
class _Encoder:
    """One text encoder of a pipeline: its component name, kind, real shape and tiny widths."""

    name: str
    kind: str  # "clip", "clip-projection" or "t5"
    label: str
    full: dict[str, Any]
    tiny_width: int
    tiny_projection: int | None = None


_CLIP_L = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    hidden_act="quick_gelu",
    projection_dim=768,
    vocab_size=49408,
)
_CLIP_H = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=23,
    num_attention_heads=16,
    hidden_act="gelu",
    projection_dim=512,
    vocab_size=49408,
)
_CLIP_G = dict(
    hidden_size=1280,
    intermediate_size=5120,
    num_hidden_layers=32,
    num_attention_heads=20,
    hidden_act="gelu",
    projection_dim=1280,
    vocab_size=49408,
)
#: T5 v1.1 XXL's encoder (PixArt-α, SD3, FLUX.1, LTX-Video).
T5_XXL = dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64, feed_forward_proj="gated-gelu",
               vocab_size=32128)  # fmt: skip

# Tiny widths match the `--quick` denoisers: cross-attention 32 (SDXL: 16 + 16, pooled 32), captions 32.
_ENCODERS: dict[str, tuple[_Encoder, ...]] = {
    "sd15": (_Encoder("text_encoder", "clip", "CLIP ViT-L/14", _CLIP_L, 32),),
    "sd2": (_Encoder("text_encoder", "clip", "OpenCLIP ViT-H/14", _CLIP_H, 32),),
    "sdxl": (
        _Encoder("text_encoder", "clip", "CLIP ViT-L/14", _CLIP_L, 16),
        _Encoder("text_encoder_2", "clip-projection", "OpenCLIP ViT-bigG/14", _CLIP_G, 16, 32),
    ),
    "pixart": (_Encoder("text_encoder", "t5", "T5 v1.1 XXL encoder", T5_XXL, 32),),
    "sd3": (
        _Encoder("text_encoder", "clip-projection", "CLIP ViT-L/14", _CLIP_L, 16, 16),
        _Encoder("text_encoder_2", "clip-projection", "OpenCLIP ViT-bigG/14", _CLIP_G, 16, 16),
        _Encoder("text_encoder_3", "t5", "T5 v1.1 XXL encoder", T5_XXL, 32),
    ),
    "flux": (
        _Encoder("text_encoder", "clip", "CLIP ViT-L/14", _CLIP_L, 32),
        _Encoder("text_encoder_2", "t5", "T5 v1.1 XXL encoder", T5_XXL, 32),
    ),
}
#: Architectures `build_pipeline` knows (those of `--arch`).
PIPELINE_ARCHITECTURES = tuple(_ENCODERS)

#: The pipeline class of each architecture, by its name in diffusers' lazy namespace: importing the pipeline
#: classes imports transformers' image processors (which warn when torchvision is missing), so a bench that
#: builds no pipeline never loads them.
_PIPELINES: dict[str, str] = {
    "sd15": "StableDiffusionPipeline",
    "sd2": "StableDiffusionPipeline",
    "sdxl": "StableDiffusionXLPipeline",
    "pixart": "PixArtAlphaPipeline",
    "sd3": "StableDiffusion3Pipeline",
    "flux": "FluxPipeline",
}
_SD_BETAS = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear")
#: The published scheduler of each pipeline (SD 1.5, SD 2.1, SDXL base, PixArt-α, SD3 medium, FLUX.1-dev).
_SCHEDULERS: dict[str, tuple[type, dict[str, Any]]] = {
    "sd15": (PNDMScheduler, dict(_SD_BETAS, skip_prk_steps=True, set_alpha_to_one=False, steps_offset=1)),
    "sd2": (DDIMScheduler, dict(_SD_BETAS, clip_sample=False, set_alpha_to_one=False, steps_offset=1,
                                prediction_type="v_prediction")),
    "sdxl": (EulerDiscreteScheduler, dict(_SD_BETAS, steps_offset=1, timestep_spacing="leading")),
    "pixart": (DPMSolverMultistepScheduler, dict(num_train_timesteps=1000, beta_start=0.0001, beta_end=0.02,
                                                 beta_schedule="linear", solver_order=2)),
    "sd3": (FlowMatchEulerDiscreteScheduler, dict(num_train_timesteps=1000, shift=3.0)),
    "flux": (FlowMatchEulerDiscreteScheduler, dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                                                   base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                                                   max_image_seq_len=4096)),
}  # fmt: skip
_VAE_SD: dict[str, Any] = dict(
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    latent_channels=4,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    scaling_factor=0.18215,
)
_VAE_16: dict[str, Any] = dict(_VAE_SD, latent_channels=16, use_quant_conv=False, use_post_quant_conv=False)
_VAES: dict[str, tuple[str, dict[str, Any]]] = {
    "sd15": ("SD VAE", _VAE_SD),
    "sd2": ("SD VAE", _VAE_SD),
    "sdxl": ("SDXL VAE", dict(_VAE_SD, scaling_factor=0.13025, force_upcast=True)),
    "pixart": ("SD VAE", _VAE_SD),
    "sd3": ("SD3 VAE", dict(_VAE_16, scaling_factor=1.5305, shift_factor=0.0609)),
    "flux": ("Flux VAE", dict(_VAE_16, scaling_factor=0.3611, shift_factor=0.1159)),
}  # fmt: skip
#: FLUX.1-dev's scheduler settings and VAE config (Chroma and Z-Image have the same: `image_pipelines.py`).
FLUX_SCHEDULER = _SCHEDULERS["flux"][1]
FLUX_VAE = _VAES["flux"][1]
# Four levels like the real VAEs (8x downsampling, so `--quick` latents match the forward bench's), tiny widths;
# 4 latent channels: what the `--quick` SD3 and Flux transformers read.
TINY_VAE = dict(block_out_channels=(16, 16, 32, 32), layers_per_block=1, norm_num_groups=8, latent_channels=4,
                 use_quant_conv=True, use_post_quant_conv=True)  # fmt: skip


@dataclass
class RandomPipeline:
    """A random-weight pipeline and what it is made of.

    Attributes:
        pipe: the pipeline (float32 on the CPU, except the denoiser, which is as it was given).
        components: component name -> what it is, for the report.
        call_kwargs: arguments every generation passes (`max_sequence_length` of the `--quick` T5s).
    """

    pipe: DiffusionPipeline
    components: dict[str, str] = field(default_factory=dict)
    call_kwargs: dict[str, Any] = field(default_factory=dict)


def write_clip_tokenizer(folder: str | Path, max_length: int = CLIP_TOKENS) -> CLIPTokenizer:
    """A CLIP BPE tokenizer over single characters, written to `folder` (vocab.json, merges.txt) and loaded.

    Token 0 is the start token, 1 the end token (also the padding, as in SD's tokenizers).

    Example:
        >>> import tempfile
        >>> tokenizer = write_clip_tokenizer(tempfile.mkdtemp(), max_length=16)
        >>> tokenizer("a cat").input_ids
        [0, 3, 6, 2, 41, 1]
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for symbol in _SYMBOLS:
        vocab[symbol] = len(vocab)
        vocab[symbol + "</w>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    return CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=max_length)


def write_t5_tokenizer(folder: str | Path) -> T5Tokenizer:
    """A T5 (unigram) tokenizer over single characters, saved to `folder` and loaded from it.

    Ids as T5's: 0 padding, 1 end of sequence, 2 unknown.

    Example:
        >>> import tempfile
        >>> tokenizer = write_t5_tokenizer(tempfile.mkdtemp())
        >>> ids = tokenizer("a cat").input_ids
        >>> ids[-1], tokenizer.decode(ids, skip_special_tokens=True)
        (1, 'a cat')
    """
    folder = Path(folder)
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(symbol, -3.0) for symbol in _SYMBOLS] + [("\u2581" + symbol, -2.5) for symbol in _SYMBOLS]
    T5Tokenizer(vocab=pieces, extra_ids=0).save_pretrained(folder)
    return T5Tokenizer.from_pretrained(folder)


def _text_encoder(spec: _Encoder, vocab_size: int, quick: bool, small: bool) -> torch.nn.Module:
    if spec.kind == "t5":
        shape = dict(spec.full)
        if quick:
            shape.update(d_model=spec.tiny_width, d_kv=8, d_ff=2 * spec.tiny_width, num_layers=2, num_heads=4)
            shape["vocab_size"] = vocab_size
        elif small:
            shape["num_layers"] = SMALL_TEXT_LAYERS
        return T5EncoderModel(T5Config(**shape, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).eval()
    shape = dict(spec.full)
    if quick:
        width = spec.tiny_width
        projection = spec.tiny_projection or width
        shape.update(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2, num_attention_heads=2)
        shape.update(projection_dim=projection, vocab_size=vocab_size)
    elif small:
        shape["num_hidden_layers"] = SMALL_TEXT_LAYERS
    config = CLIPTextConfig(**shape, max_position_embeddings=CLIP_TOKENS, bos_token_id=0, eos_token_id=1,
                            pad_token_id=1)  # fmt: skip
    model_class = CLIPTextModelWithProjection if spec.kind == "clip-projection" else CLIPTextModel
    return model_class(config).eval()


def _describe_encoder(spec: _Encoder, model: torch.nn.Module, quick: bool, small: bool) -> str:
    config = model.config
    layers = config.num_layers if spec.kind == "t5" else config.num_hidden_layers
    width = config.d_model if spec.kind == "t5" else config.hidden_size
    if quick:
        shape = f"tiny ({layers} layers, width {width})"
    elif small:
        real = spec.full["num_layers" if spec.kind == "t5" else "num_hidden_layers"]
        shape = f"{spec.label} width, {layers} of its {real} layers"
    else:
        shape = f"{spec.label} shape ({layers} layers, width {width})"
    return f"{type(model).__name__}, {shape}, random weights"


def build_pipeline(
    denoiser: torch.nn.Module,
    arch: str,
    quick: bool = False,
    text_encoders: str = "full",
    seed: int = 0,
) -> RandomPipeline:
    """The pipeline of `arch` around `denoiser` (a UNet for sd15/sd2/sdxl, else a transformer), random weights.

    Args:
        denoiser: the bench's denoiser of that architecture (`--quick`: the tiny one); it is not copied.
        arch: `sd15`, `sd2`, `sdxl`, `pixart`, `sd3` or `flux`.
        quick: every other component tiny too.
        text_encoders: `"full"` (the real encoders' shapes) or `"small"` (their widths, `SMALL_TEXT_LAYERS`
            layers each); ignored with `quick`.
        seed: seeds every component's random weights.

    Example:
        >>> from tome_processors.bench.dit import build_transformer
        >>> built = build_pipeline(build_transformer("pixart", quick=True), "pixart", quick=True)
        >>> sorted(built.components), built.call_kwargs
        (['scheduler', 'text_encoder', 'tokenizer', 'transformer', 'vae'], {'max_sequence_length': 16})
    """
    if arch not in _ENCODERS:
        raise ValueError(f"Expected arch among {list(PIPELINE_ARCHITECTURES)}, but got {arch!r}.")
    if text_encoders not in TEXT_ENCODER_SIZES:
        raise ValueError(f"Expected text_encoders among {list(TEXT_ENCODER_SIZES)}, but got {text_encoders!r}.")
    small = text_encoders == "small"
    unet = arch in ("sd15", "sd2", "sdxl")
    denoiser_name = "unet" if unet else "transformer"
    components: dict[str, Any] = {denoiser_name: denoiser}
    described = {denoiser_name: f"{type(denoiser).__name__}, the bench's {arch}{' (tiny)' if quick else ''} model"}
    with tempfile.TemporaryDirectory(prefix="tome-bench-tokenizers-") as folder:
        for index, spec in enumerate(_ENCODERS[arch]):
            suffix = spec.name.removeprefix("text_encoder")
            if spec.kind == "t5":
                tokenizer: Any = write_t5_tokenizer(Path(folder) / f"t5{suffix}")
            else:
                tokenizer = write_clip_tokenizer(Path(folder) / f"clip{suffix}")
            torch.manual_seed(seed + 1 + index)
            encoder = _text_encoder(spec, len(tokenizer), quick, small)
            components[spec.name], components[f"tokenizer{suffix}"] = encoder, tokenizer
            described[spec.name] = _describe_encoder(spec, encoder, quick, small)
            described[f"tokenizer{suffix}"] = f"{type(tokenizer).__name__}, a character vocabulary written locally"
    vae_label, vae_config = _VAES[arch]
    if quick:
        vae_config = dict(vae_config, **TINY_VAE)
    torch.manual_seed(seed + 10)
    components["vae"] = AutoencoderKL(**vae_config).eval()
    channels = "/".join(str(c) for c in vae_config["block_out_channels"])
    shape = "tiny" if quick else f"{vae_label} shape"
    described["vae"] = f"AutoencoderKL, {shape} ({channels}, {vae_config['latent_channels']} latent channels)"
    scheduler_class, scheduler_config = _SCHEDULERS[arch]
    with torch.device("cpu"):  # its tables live on the CPU whatever default device the caller set
        components["scheduler"] = scheduler_class(**scheduler_config)
    described["scheduler"] = f"{scheduler_class.__name__}, the published pipeline's settings"
    if unet and arch != "sdxl":
        components.update(safety_checker=None, feature_extractor=None, requires_safety_checker=False)
    elif arch == "sdxl":
        components["add_watermarker"] = False
    pipeline_class: type[DiffusionPipeline] = getattr(diffusers, _PIPELINES[arch])
    pipe = pipeline_class(**components)
    pipe.set_progress_bar_config(disable=True)
    call_kwargs = {"max_sequence_length": QUICK_TEXT_TOKENS} if quick and not unet else {}
    return RandomPipeline(pipe, described, call_kwargs)
