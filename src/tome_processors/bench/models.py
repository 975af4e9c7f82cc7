"""The model `tome-processors bench` measures, with its fixed inputs: a random-weight architecture or a user's.

- `--arch sd15|sd2|sdxl` (default sd15): a UNet of that architecture with random weights (`unet.py`),
  SDPA processors (`AttnProcessor2_0`) in every attention module;
- `--arch pixart|sd3|flux`: a diffusion transformer (`dit.py`), keeping its own processors;
- `--arch svd`: Stable Video Diffusion's UNet (`svd.py`), `--frames` latent frames per clip;
- `--arch wan|wan-i2v|ltx|ltx2|hunyuanvideo|hunyuanvideo15`: a video diffusion transformer on a clip (`--frames`,
  `--width`; `--layers` shortens it; `wan-i2v` is Wan2.1's image-to-video model, with CLIP's image tokens);
- `--arch qwenimage|flux2|chroma|zimage`: the newer image transformers (`dit.py`; `--layers` shortens them);
- `--quick`: a tiny model of the same layout;
- `--model`: a local folder or hub id (a UNet, or with `--pipeline` a whole pipeline);
- `--pipeline` without `--model`: the architecture's whole pipeline around that model, every other
  component with random weights too (`pipelines.py`; `video_pipelines.py` for wan, wan-i2v and ltx;
  `image_pipelines.py` for qwenimage, flux2, chroma and zimage, whose weights are made on the device in the
  dtype, transformer included: FLUX.2's 32 B parameters would not fit the host in float32).

Example:
    >>> bench_model = build_model(arch="sd15", quick=True)
    >>> bench_model.description, bench_model.resolution
    ('tiny architecture, random weights', 128)
    >>> tuple(bench_model.forward(bench_model.model).shape)
    (2, 4, 16, 16)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers import DiffusionPipeline
from diffusers.models.attention_processor import AttnProcessor2_0

from ..apply import target_models
from ..families import Family, find_family
from .dit import (
    QUICK_TEXT_TOKENS,
    TRANSFORMER_ARCHITECTURES,
    VIDEO_ARCHITECTURES,
    VIDEO_DEFAULTS,
    build_transformer,
    make_transformer_inputs,
)
from .generate import DEFAULT_PROMPT
from .image_pipelines import IMAGE_PIPELINE_ARCHITECTURES, build_image_pipeline
from .pipelines import build_pipeline
from .svd import build_svd_unet, make_svd_inputs
from .unet import UNetProxy, build_unet, load_unet, make_inputs
from .video_pipelines import VIDEO_PIPELINE_ARCHITECTURES, build_video_pipeline

__all__ = ["UNET_FAMILIES", "BenchModel", "build_model", "cast"]

#: The families that are UNets: SDPA processors set in every attention module, tomesd's rows where it runs.
UNET_FAMILIES = ("unet", "svd")


@dataclass
class BenchModel:
    """A model ready to measure.

    Attributes:
        model: the UNet or transformer, in eval mode, on its device and dtype.
        forward: `forward(model)` runs one forward on the fixed inputs and returns the output sample
            (it takes the model, so that a compiled or copied model runs the same inputs).
        family: the library's model family (`families.find_family`), None for an unknown model.
        description: what the model is, for the report.
        resolution: image side in pixels of the inputs.
        pipe: the pipeline with `--pipeline`, else None; `model` is its denoiser.
        components: with `pipe`, component name -> what it is, for the report.
        call_kwargs: with `pipe`, arguments every generation passes.
        proxy: what a cut-down UNet keeps (`unet.UNetProxy.describe`), None for a whole model.
    """

    model: torch.nn.Module
    forward: Callable[[torch.nn.Module], torch.Tensor]
    family: Family | None
    description: str
    resolution: int
    pipe: Any = None
    components: dict[str, str] = field(default_factory=dict)
    call_kwargs: dict[str, Any] = field(default_factory=dict)
    proxy: str | None = None


def cast(model: torch.nn.Module, device: torch.device | str, dtype: torch.dtype) -> torch.nn.Module:
    """`model` moved to `device` and cast to `dtype`, in place.

    Cast with `half()` / `bfloat16()` / `float()` rather than `to(dtype)`: diffusers' `ModelMixin.to`
    warns about "modules that should be kept in float32" on every dtype cast, even for models that keep
    none (its check tests the list against None), and none of the bench's architectures keeps any.

    Example:
        >>> cast(torch.nn.Linear(2, 2), "cpu", torch.bfloat16).weight.dtype
        torch.bfloat16
    """
    casts = {torch.float32: model.float, torch.float16: model.half, torch.bfloat16: model.bfloat16}
    if dtype not in casts:
        raise ValueError(f"Expected dtype float32, float16 or bfloat16, but got {dtype}.")
    return casts[dtype]().to(device)


def build_model(
    model: str | None = None,
    arch: str | None = None,
    quick: bool = False,
    pipeline: bool = False,
    resolution: int | None = None,
    batch: int = 2,
    seed: int = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    text_encoders: str = "full",
    frames: int | None = None,
    width: int | None = None,
    layers: int | None = None,
    prompt: str = DEFAULT_PROMPT,
    proxy: UNetProxy | None = None,
) -> BenchModel:
    """The model to measure, with fixed inputs of `batch` at `resolution` pixels (default: the model's own).

    Args:
        model: a local diffusers folder (a pipeline with `unet/`, or a UNet folder) or a hub id.
        arch: `sd15`, `sd2`, `sdxl`, `pixart`, `sd3`, `flux`, `svd`, a newer image transformer (`qwenimage`,
            `flux2`, `chroma`, `zimage`) or a video one (`dit.VIDEO_ARCHITECTURES`), random weights (default `sd15`).
        quick: a tiny model of the architecture's layout (128 px by default).
        pipeline: the whole pipeline (for full generations): with `model` loaded, else the architecture's
            pipeline with random weights around the same denoiser (`pipelines.build_pipeline`; for wan, wan-i2v and ltx
            `video_pipelines.build_video_pipeline`, its clip in `call_kwargs`; for the newer image transformers
            `image_pipelines.build_image_pipeline`, every weight made on `device` in `dtype`).
        seed: seeds the random weights and inputs.
        text_encoders: with `pipeline` and no `model`: `"full"` or `"small"` (`pipelines.build_pipeline`).
        frames: a video architecture's clip: wan's pixel frames (default its clip of `dit.VIDEO_DEFAULTS`), or
            svd's frames per clip (default the model's `num_frames`, 14).
        width: the image or clip width in pixels (`resolution` is the height; None: square, or a video
            model's own clip); UNet forwards and the video transformers.
        layers: for a diffusion-transformer `arch` (wan too), at most that many blocks per block list.
        prompt: with `pipeline` for qwenimage or flux2: the prompt the generations will send (their tokenizers
            learn its words, `image_pipelines.write_bpe_tokenizer`).
        proxy: a UNet `arch` (sd15, sd2, sdxl) cut down to its first levels (`unet.UNetProxy`), for high
            resolutions where a whole forward would take too long; None: the whole UNet.

    Example:
        >>> bench_model = build_model(arch="pixart", quick=True, pipeline=True)
        >>> type(bench_model.pipe).__name__, bench_model.model is bench_model.pipe.transformer
        ('PixArtAlphaPipeline', True)
    """
    if model is not None and (arch is not None or quick):
        raise ValueError(f"Expected either a model or an architecture, but got model={model!r} and arch={arch!r}.")
    device = torch.device(device)
    if proxy is not None and (model is not None or quick or (arch or "sd15") not in ("sd15", "sd2", "sdxl")):
        raise ValueError(f"Expected a proxy only for --arch sd15, sd2 or sdxl, but got arch={arch!r}, model={model!r}.")
    pipe, components, call_kwargs = None, {}, {}
    if model is None and arch in TRANSFORMER_ARCHITECTURES:
        # the newer image pipelines: every weight made where it runs; the forward bench keeps the CPU's weights
        where = dict(device=device, dtype=dtype) if pipeline and arch in IMAGE_PIPELINE_ARCHITECTURES else {}
        net = cast(build_transformer(arch, quick=quick, seed=seed, layers=layers, **where), device, dtype)
        depth = f", {layers} blocks per block list" if layers is not None else ""
        description = f"{arch}{' (tiny)' if quick else ''} architecture{depth}, random weights"
    elif model is None and arch == "svd":
        net = cast(build_svd_unet("tiny" if quick else "svd", seed=seed), device, dtype)
        frames = int(net.config.num_frames) if frames is None else frames
        description = f"svd{' (tiny)' if quick else ''} architecture, random weights, frames: {frames}"
    elif model is None:
        name = arch or "sd15"
        if quick:
            name = "tiny-sdxl" if name == "sdxl" else "tiny"
        net = cast(build_unet(name, seed=seed, proxy=proxy), device, dtype)
        description = f"{name} architecture, random weights"
        if proxy is not None:
            description += f" (proxy: {proxy.describe(name)})"
    elif pipeline:
        pipe = DiffusionPipeline.from_pretrained(model, dtype=dtype).to(device)
        net, description = target_models(pipe)[0].eval(), model
        loaded = {name: part for name, part in pipe.components.items() if part is not None}
        components = {name: f"{type(part).__name__}, loaded" for name, part in loaded.items()}
    else:
        net, description = load_unet(model, dtype).to(device), model

    if pipeline and model is None:
        if arch in VIDEO_PIPELINE_ARCHITECTURES:
            built = build_video_pipeline(net, arch, quick, text_encoders, seed, resolution, width, frames)
        elif arch in IMAGE_PIPELINE_ARCHITECTURES:
            built = build_image_pipeline(net, arch, quick, text_encoders, seed, device, dtype, prompt)
        else:
            built = build_pipeline(net, arch or "sd15", quick=quick, text_encoders=text_encoders, seed=seed)
        for part in built.pipe.components.values():  # the newer image pipelines' parts are made in place, as loaded
            if isinstance(part, torch.nn.Module) and part is not net and arch not in IMAGE_PIPELINE_ARCHITECTURES:
                cast(part, device, dtype)
        pipe, components, call_kwargs = built.pipe, built.components, built.call_kwargs
        description = f"{type(pipe).__name__}, {description}"

    family = find_family(net)
    transformer = family is not None and family.name not in UNET_FAMILIES
    if not transformer:  # diffusion transformers keep their own processors (SD3 and Flux need them)
        net.set_attn_processor(AttnProcessor2_0())
    sample_size = getattr(net.config, "sample_size", None) or 128  # Flux has none: 1024 px
    sample_size = sample_size[0] if isinstance(sample_size, (list, tuple)) else sample_size
    # the inputs of the architecture asked for: a family holds several (Wan's text- and image-to-video)
    inputs_arch = arch if model is None and arch in TRANSFORMER_ARCHITECTURES else family.name if family else None
    video = inputs_arch in VIDEO_ARCHITECTURES
    if video and not quick:
        resolution = resolution or VIDEO_DEFAULTS[inputs_arch][0]
    resolution = resolution or (128 if quick else int(sample_size) * 8)
    if transformer:
        text_tokens = QUICK_TEXT_TOKENS if quick else None
        clip = {"frames": frames or (9 if quick else None), "width": width or (resolution if quick else None)}
        clip = clip if video else {}
        inputs: Any = make_transformer_inputs(
            net, inputs_arch, batch, resolution, seed, device, dtype, text_tokens=text_tokens, quick=quick, **clip
        )
    elif family is not None and family.name == "svd":
        inputs = make_svd_inputs(net, batch, resolution, frames, seed=seed, device=device, dtype=dtype)
    else:
        inputs = make_inputs(net, batch, resolution, seed=seed, device=device, dtype=dtype, width=width)
    described = None if proxy is None else proxy.describe(arch or "sd15", resolution, width)
    return BenchModel(net, inputs.run, family, description, resolution, pipe, components, call_kwargs, described)
