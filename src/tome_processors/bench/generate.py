"""`tome-processors bench --pipeline`: whole generations per method, timed as the user sees them.

`time_generations` measures each method on a pipeline with the bench's own engine (`engine.run_benchmark`):
one "forward" there is one whole generation (text encoder, every denoising step, VAE decode) of the same
prompt from the same seed, so the engine's warm-up, rotated rounds, paired speed-up, output change (of the
final image) and peak memory apply unchanged. Alongside, hooks on the denoiser add up the time spent in
its forwards during each generation, paired with the baseline the same way: the per-step columns. What
acts across steps (`recompute_every`, `share_level` reuse) shows up in both.

`generate_image` is one timed generation on its own (also used by `tome-processors eval`).

Example:
    >>> run = time_generations(pipe, methods, "a red fox in the snow", steps=20)  # doctest: +SKIP
    >>> print(generation_table(run.rows))  # doctest: +SKIP
    | method | ratio | s/image | speed-up/image | s/step | speed-up/step | image change % | peak MiB |
    ...
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch
from diffusers.utils import logging as diffusers_logging
from PIL import Image

from ..apply import target_models
from ..arguments import argument
from .engine import BenchSettings, Method, run_benchmark
from .meta import synchronize, timed
from .report import format_number, json_safe, save_grid

__all__ = [
    "DEFAULT_PROMPT",
    "DenoiserTimer",
    "first_output",
    "GenerationRow",
    "GenerationRun",
    "generate_image",
    "generation_table",
    "pipeline_call_kwargs",
    "save_generation_grid",
    "save_generation_json",
    "time_generations",
]

#: The prompt of every generation when none is given (`--prompt`).
DEFAULT_PROMPT = "a photo of an astronaut riding a horse on mars"


def generate_image(
    pipe: Any,
    prompt: str,
    seed: int,
    steps: int,
    guidance_scale: float,
    height: int | None = None,
    width: int | None = None,
    **call_kwargs: Any,
) -> tuple[Any, float]:
    """One image of `prompt` from `seed` (a generator on the pipeline's device; on MPS, the CPU's).

    `height` / `width` None use the pipeline's defaults. Timed end to end (text encoder, every denoising
    step, VAE decode), with a device synchronise before and after (CUDA, MPS).

    Returns:
        `(PIL image, seconds)`.
    """
    device = getattr(pipe, "device", torch.device("cpu"))
    kwargs = _call_kwargs(pipe, seed, steps, guidance_scale, height, width, "pil", call_kwargs)

    def generate() -> Any:
        with torch.inference_mode():
            return pipe(prompt=prompt, **kwargs).images[0]

    return timed(generate, device)


def _call_kwargs(
    pipe: Any,
    seed: int,
    steps: int,
    guidance_scale: float,
    height: int | None,
    width: int | None,
    output_type: str,
    extra: dict[str, Any],
) -> dict[str, Any]:
    device = getattr(pipe, "device", torch.device("cpu"))
    generator = torch.Generator(device="cpu" if device.type == "mps" else device).manual_seed(seed)
    kwargs: dict[str, Any] = dict(
        num_inference_steps=steps, guidance_scale=guidance_scale, generator=generator, output_type=output_type
    )
    if height is not None:
        kwargs["height"] = height
    if width is not None:
        kwargs["width"] = width
    kwargs.update(extra)
    return kwargs


def pipeline_call_kwargs(pipe: Any) -> dict[str, Any]:
    """Arguments that make a generation do what the bench asks, where the pipeline has them.

    `use_resolution_binning=False` (PixArt): generate at the asked resolution rather than the nearest
    trained aspect-ratio bucket. `clean_caption=False` (PixArt): it needs bs4 and ftfy, and only rewrites
    the prompt.

    Example:
        >>> from diffusers import PixArtAlphaPipeline, StableDiffusionPipeline
        >>> pipeline_call_kwargs(PixArtAlphaPipeline), pipeline_call_kwargs(StableDiffusionPipeline)
        ({'use_resolution_binning': False, 'clean_caption': False}, {})
    """
    parameters = inspect.signature(pipe.__call__).parameters
    return {name: False for name in ("use_resolution_binning", "clean_caption") if name in parameters}


class DenoiserTimer:
    """Adds up the wall time spent in a module's forwards (its hooks included) while entered, and notes the
    batch size of the first one's input (the latents: its first positional argument, or `sample` or
    `hidden_states`).

    On CUDA and MPS it synchronises the device before each forward starts and after it ends, so the
    time is that of the forward's own work. The pre-hook goes first and the post-hook last of the hooks
    the module has when entered.

    Example:
        >>> layer = torch.nn.Linear(2, 2)
        >>> with DenoiserTimer(layer) as timer:
        ...     _ = layer(torch.ones(1, 2)), layer(torch.ones(1, 2))
        >>> timer.calls, timer.seconds > 0, timer.batch
        (2, True, 1)
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.seconds = 0.0
        self.calls = 0
        self.batch: int | None = None
        self._start = 0.0
        self._handles: list[Any] = []

    def _before(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self.batch is None:
            latents = argument(args, kwargs, 0, "sample")
            latents = argument(args, kwargs, 0, "hidden_states") if latents is None else latents
            if isinstance(latents, (list, tuple)):  # Z-Image: one latent per image of the batch
                self.batch = len(latents)
            else:
                self.batch = int(latents.shape[0]) if isinstance(latents, torch.Tensor) else None
        synchronize(_device_of(module))
        self._start = time.perf_counter()

    def _after(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        synchronize(_device_of(module))
        self.seconds += time.perf_counter() - self._start
        self.calls += 1

    def __enter__(self) -> DenoiserTimer:
        self._handles = [
            self.module.register_forward_pre_hook(self._before, prepend=True, with_kwargs=True),
            self.module.register_forward_hook(self._after),
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _device_of(module: torch.nn.Module) -> torch.device:
    parameter = next(module.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


@dataclass
class GenerationRow:
    """The measurements of one method over whole generations.

    Attributes:
        name, family, ratio, settings: from the `Method`.
        seconds_per_image: median over the timed rounds of one generation's wall time (text encoder,
            every denoising step, VAE decode); of a video pipeline, one whole video's.
        speedup_per_image: the engine's paired speed-up of those times (median over rounds of the mean
            of the two baseline runs around the method / the method's).
        seconds_per_step: median over the timed rounds of the time inside the denoiser's forwards during
            one generation divided by its number of denoiser calls (one call per step, classifier-free
            guidance batched; PNDM makes one more call than steps).
        speedup_per_step: the same pairing on the per-step times.
        image_change: `||image - image_baseline|| / ||image_baseline||` of the final image (pixels in [0, 1]),
            of a video pipeline of the whole video (every frame), same prompt and seed; 0 for the baseline on
            a deterministic device.
        denoiser_calls: denoiser forwards in one generation; denoiser_batch: the batch of each (2 for one
            image with classifier-free guidance, 1 without; None when the input was not seen).
        peak_memory_mib, memory_before_mib: the engine's peak memory during one generation, and before it.
        image_times: every timed generation's seconds; step_times: every timed per-step seconds.
    """

    name: str
    family: str
    ratio: float | None
    seconds_per_image: float
    speedup_per_image: float
    seconds_per_step: float
    speedup_per_step: float
    image_change: float
    denoiser_calls: int
    denoiser_batch: int | None = None
    peak_memory_mib: float | None = None
    memory_before_mib: float | None = None
    image_times: list[float] = field(default_factory=list)
    step_times: list[float] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class GenerationRun:
    """`time_generations`' result: one row and one image (the first generation's, PIL; of a video, its first
    frame) per method (no images where the generations stopped at their latents)."""

    rows: list[GenerationRow]
    images: list[Image.Image]


class _Generation(NamedTuple):
    name: str
    denoiser_seconds: float
    denoiser_calls: int
    denoiser_batch: int | None


class _Target(torch.nn.Module):
    """What the engine puts methods on: a handle on the pipeline's denoiser and the name of the active method.

    The denoiser is kept outside the module tree, so that the engine's block recorder, which finds a
    model's blocks by walking its modules, records nothing: every block input of a whole generation
    would take gigabytes, and the per-forward overhead replay does not apply to generations.
    """

    def __init__(self, denoiser: torch.nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "denoiser", denoiser)
        # The engine reads the device from the model's first parameter.
        self.anchor = torch.nn.Parameter(torch.empty(0, device=_device_of(denoiser)), requires_grad=False)
        self.active: str | None = None


def _on_denoiser(method: Method, target: _Target) -> Method:
    def apply(_: torch.nn.Module) -> None:
        method.apply(target.denoiser)
        target.active = method.name

    def remove(_: torch.nn.Module) -> None:
        target.active = None
        method.remove(target.denoiser)

    return Method(method.name, method.family, method.ratio, apply, remove, None, dict(method.settings))


@contextmanager
def _quiet_diffusers() -> Iterator[None]:
    """The same generation runs dozens of times: its warnings (prompt truncated, ...) once would be plenty."""
    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        yield
    finally:
        diffusers_logging.set_verbosity(verbosity)


def time_generations(
    pipe: Any,
    methods: Sequence[Method],
    prompt: str,
    steps: int = 20,
    guidance_scale: float = 7.5,
    resolution: int | None = None,
    seed: int = 0,
    settings: BenchSettings | None = None,
    call_kwargs: dict[str, Any] | None = None,
    decode: bool = True,
) -> GenerationRun:
    """Time whole generations of `prompt` on `pipe` for every method (applied to its denoiser).

    Args:
        pipe: a diffusers text-to-image or text-to-video pipeline with a `unet` or a `transformer`, the
            baseline on it (a video pipeline's clip, `height`, `width`, `num_frames`, in `call_kwargs`).
        methods: the baseline first (the reference of every speed-up and of the image change).
        steps, guidance_scale, seed: of every generation; `resolution` the image side (None: the pipeline's).
        settings: rounds, warm-up, memory and progress as for forwards (`BenchSettings`); no compilation,
            and no host cost (it counts one forward's operators).
        call_kwargs: further pipeline arguments (over `pipeline_call_kwargs(pipe)`).
        decode: False stops every generation at its latents (`output_type="latent"`): no VAE decode in the
            time per image (on a CPU a 1024 px decode can outlast the denoiser many times over), and the image
            change is the latents'.

    Example:
        >>> from tome_processors.bench.methods import baseline_method, preset_methods
        >>> from tome_processors.bench.models import build_model
        >>> bench = build_model(arch="sd15", quick=True, pipeline=True)
        >>> methods = [baseline_method(), *preset_methods(["fast"], "unet", auto_downsample=1)]
        >>> settings = BenchSettings(rounds=1, measure_memory=False, host_cost=False, progress=False)
        >>> run = time_generations(bench.pipe, methods, "a cat", steps=2, resolution=64, settings=settings)
        >>> [(row.name, row.speedup_per_image, row.image_change) for row in run.rows][0]
        ('baseline', 1.0, 0.0)
    """
    settings = settings or BenchSettings()
    if settings.compile is not None:
        raise ValueError(f"Expected no compilation for whole generations, but got compile={settings.compile!r}.")
    if steps < 1:
        raise ValueError(f"Expected steps >= 1, but got {steps}.")
    settings = BenchSettings(**{**asdict(settings), "host_cost": False})
    denoiser = target_models(pipe)[0]
    target = _Target(denoiser)
    kwargs = {**pipeline_call_kwargs(pipe), **(call_kwargs or {})}
    generations: list[_Generation] = []
    first_images: dict[str, torch.Tensor] = {}

    def generate(_: torch.nn.Module) -> torch.Tensor:
        name = target.active or "?"
        output_type = "pt" if decode else "latent"
        arguments = _call_kwargs(pipe, seed, steps, guidance_scale, resolution, resolution, output_type, kwargs)
        with torch.inference_mode(), DenoiserTimer(denoiser) as timer:
            image = first_output(pipe(prompt=prompt, **arguments))  # by name: FLUX.2 takes `image` first
        generations.append(_Generation(name, timer.seconds, timer.calls, timer.batch))
        first_images.setdefault(name, image.detach().float().cpu())
        return image

    if hasattr(pipe, "set_progress_bar_config"):
        pipe.set_progress_bar_config(disable=True)
    wrapped = [_on_denoiser(method, target) for method in methods]

    def seconds_per_step() -> float:  # of the generation just timed: the denoiser's own time per call
        return generations[-1].denoiser_seconds / max(generations[-1].denoiser_calls, 1)

    with _quiet_diffusers():
        rows = run_benchmark(target, wrapped, generate, settings, inner_seconds=seconds_per_step)
    result = [
        GenerationRow(
            name=row.name,
            family=row.family,
            ratio=row.ratio,
            seconds_per_image=row.seconds,
            speedup_per_image=row.speedup,
            seconds_per_step=row.inner_seconds,
            speedup_per_step=row.inner_speedup,
            image_change=row.rel_error,
            denoiser_calls=next(g.denoiser_calls for g in generations if g.name == row.name),
            denoiser_batch=next(g.denoiser_batch for g in generations if g.name == row.name),
            peak_memory_mib=row.peak_memory_mib,
            memory_before_mib=row.memory_before_mib,
            image_times=list(row.times),
            step_times=list(row.inner_times),
            settings=dict(row.settings),
        )
        for row in rows
    ]
    images = [_to_pil(first_images[m.name]) for m in methods] if decode else []  # latents make no picture
    return GenerationRun(result, images)


def first_output(output: Any) -> Any:
    """The first image of a pipeline's output (`.images`), or its first video (`.frames`, a video pipeline's).

    Example:
        >>> from diffusers.pipelines.wan.pipeline_output import WanPipelineOutput
        >>> tuple(first_output(WanPipelineOutput(frames=torch.zeros(1, 9, 3, 8, 8))).shape)
        (9, 3, 8, 8)
    """
    images = getattr(output, "images", None)
    return (output.frames if images is None else images)[0]


def _to_pil(image: torch.Tensor) -> Image.Image:
    """A `(3, H, W)` image in [0, 1] as a PIL image; of a `(F, 3, H, W)` video, its first frame."""
    image = image[0] if image.dim() == 4 else image
    array = (image.clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).numpy()
    return Image.fromarray(array)


def generation_table(rows: Sequence[GenerationRow], unit: str = "image") -> str:
    """A markdown table of `time_generations` rows; `unit` names what one generation makes (`"video"`).

    Example:
        >>> row = GenerationRow("baseline", "baseline", None, 12.5, 1.0, 0.61, 1.0, 0.0, 21)
        >>> print(generation_table([row]).splitlines()[2])
        | baseline | - | 12.50 | 1.00x | 0.610 | 1.00x | 0.00 | - |
        >>> print(generation_table([row], unit="video").splitlines()[0])
        | method | ratio | s/video | speed-up/video | s/step | speed-up/step | video change % | peak MiB |
    """
    columns = ("method", "ratio", f"s/{unit}", f"speed-up/{unit}", "s/step", "speed-up/step", f"{unit} change %",
               "peak MiB")  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [
            row.name,
            format_number(row.ratio),
            f"{row.seconds_per_image:.2f}",
            f"{row.speedup_per_image:.2f}x",
            f"{row.seconds_per_step:.3f}",
            f"{row.speedup_per_step:.2f}x",
            f"{100 * row.image_change:.2f}",
            "-" if row.peak_memory_mib is None else f"{row.peak_memory_mib:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def save_generation_json(rows: Sequence[GenerationRow], meta: dict[str, Any], path: str | Path) -> Path:
    """`{"meta": {...}, "rows": [every GenerationRow field]}` written to `path` (strict JSON, `report.json_safe`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"meta": json_safe(meta), "rows": [json_safe(asdict(row)) for row in rows]}
    path.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n", encoding="utf-8")
    return path


def save_generation_grid(run: GenerationRun, path: str | Path, unit: str = "image") -> Path:
    """The images (of videos, their first frames) side by side, each labelled with its method, seconds per
    `unit` and speed-up."""
    labels = [f"{row.name}\n{row.seconds_per_image:.2f} s/{unit}, {row.speedup_per_image:.2f}x" for row in run.rows]
    return save_grid(run.images, labels, path)
