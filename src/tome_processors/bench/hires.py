"""`tome-processors bench --pipeline --hires`: the hires-fix workflow, ToMe on its second pass only.

What Stable Diffusion users run at high resolution: a text-to-image pass at the model's size, the latents
upscaled 2x, and an image-to-image pass at twice the size (web UIs turn token merging on for that pass
only). `time_hires` times it per method with the bench's engine (`engine.run_benchmark`): one "forward"
there is one whole hires-fix generation, so the warm-up, rotated rounds, paired speed-up, output change and
peak memory apply unchanged. The first pass runs with no method for every row; the row's method is put on
the UNet right before the second pass and taken off right after it (inside the time per image, as a user's
`apply_tome` / `remove_tome` around that pass would be).

Example:
    >>> from tome_processors.bench.methods import baseline_method, preset_methods
    >>> from tome_processors.bench.models import build_model
    >>> bench = build_model(arch="sd15", quick=True, pipeline=True)
    >>> methods = [baseline_method(), *preset_methods(["fast"], "unet", auto_downsample=1)]
    >>> settings = BenchSettings(rounds=1, measure_memory=False, host_cost=False, progress=False)
    >>> run = time_hires(bench.pipe, methods, "a cat", steps=2, resolution=32, strength=0.5, settings=settings)
    >>> [(row.name, row.first_pass_change) for row in run.rows]
    [('baseline', 0.0), ('ours fast', 0.0)]
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import diffusers
import torch
import torch.nn.functional as F
from PIL import Image

from .engine import BenchSettings, Method, relative_error, run_benchmark
from .generate import DenoiserTimer, _quiet_diffusers, _Target, _to_pil
from .meta import synchronize

if TYPE_CHECKING:
    from diffusers import StableDiffusionPipeline

__all__ = ["HIRES_ARCHITECTURES", "HiresRow", "HiresRun", "hires_table", "time_hires", "upscale_latents"]

#: The random-weight pipelines the hires-fix run is built for (`StableDiffusionPipeline`).
HIRES_ARCHITECTURES = ("sd15", "sd2")
#: How much the second pass's side exceeds the first's.
HIRES_SCALE = 2


def upscale_latents(latents: torch.Tensor, scale: int = HIRES_SCALE) -> torch.Tensor:
    """The first pass's latents `(B, 4, h, w)` upscaled `scale` times in each side, bilinear (a latent upscaler).

    Example:
        >>> tuple(upscale_latents(torch.zeros(1, 4, 8, 12)).shape)
        (1, 4, 16, 24)
    """
    return F.interpolate(latents, scale_factor=scale, mode="bilinear", align_corners=False)


@dataclass
class HiresRow:
    """One method's hires-fix generations.

    Attributes:
        name, family, ratio, settings: from the `Method`.
        seconds_per_image: median over the timed rounds of one whole generation (both passes, the upscale,
            the method put on and taken off; the VAE decode unless the run stops at latents).
        speedup_per_image: paired as for forwards (median over rounds of the mean of the two baseline
            generations around the method / the method's).
        first_pass_seconds, upscale_seconds: medians of those parts (the same work in every row: no method).
        second_pass_seconds: median of the image-to-image call (its text encoder, its steps, its decode).
        second_pass_speedup: the engine's pairing on the second pass's times.
        second_pass_step_seconds: median time inside the UNet per denoiser call of the second pass.
        image_change: `||out - out_baseline|| / ||out_baseline||` of the final image (or latents), same prompt
            and seed: all of it made by the second pass, as the first is the baseline's.
        first_pass_change: the same for the first pass's latents; 0 unless something leaked into the first pass.
        second_pass_calls: UNet calls in the second pass.
        peak_memory_mib, memory_before_mib: the engine's peak memory during one generation, and before it.
        image_times, second_pass_times: every timed generation's and second pass's seconds.
    """

    name: str
    family: str
    ratio: float | None
    seconds_per_image: float
    speedup_per_image: float
    first_pass_seconds: float
    upscale_seconds: float
    second_pass_seconds: float
    second_pass_speedup: float
    second_pass_step_seconds: float
    image_change: float
    first_pass_change: float
    second_pass_calls: int
    peak_memory_mib: float | None = None
    memory_before_mib: float | None = None
    image_times: list[float] = field(default_factory=list)
    second_pass_times: list[float] = field(default_factory=list)
    settings: dict[str, Any] = field(default_factory=dict)


@dataclass
class HiresRun:
    """`time_hires`' result: one row per method, and each method's first final image (none at latents)."""

    rows: list[HiresRow]
    images: list[Image.Image]

    def as_json(self) -> list[dict[str, Any]]:
        """The rows as dictionaries (for `generate.save_generation_json`'s writer)."""
        return [asdict(row) for row in self.rows]


@dataclass
class _Parts:
    """The timed parts of one generation."""

    name: str
    first: float
    upscale: float
    second: float
    unet_seconds: float
    unet_calls: int


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2] if ordered else float("nan")


def time_hires(
    pipe: StableDiffusionPipeline,
    methods: Sequence[Method],
    prompt: str,
    steps: int = 20,
    guidance_scale: float = 7.5,
    resolution: int = 512,
    strength: float = 0.5,
    seed: int = 0,
    settings: BenchSettings | None = None,
    decode: bool = True,
) -> HiresRun:
    """Time the hires-fix workflow on `pipe` for every method, each on the second pass only.

    Args:
        pipe: a text-to-image `StableDiffusionPipeline` (the image-to-image pass shares its components through
            `StableDiffusionImg2ImgPipeline.from_pipe`).
        methods: the baseline first (the reference of every speed-up and of the output change).
        steps: the first pass's steps; the second runs `int(steps * strength)` of its `steps`.
        resolution: the first pass's side in pixels; the second pass's is `HIRES_SCALE` times it.
        strength: the second pass's denoising strength, in (0, 1].
        settings: rounds, warm-up, memory and progress as for forwards; no compilation, no host cost.
        decode: False stops the second pass at its latents (no VAE decode at the large size).
    """
    settings = settings or BenchSettings()
    if settings.compile is not None:
        raise ValueError(f"Expected no compilation for whole generations, but got compile={settings.compile!r}.")
    if not 0.0 < strength <= 1.0:
        raise ValueError(f"Expected strength in (0, 1], but got {strength}.")
    if int(steps * strength) < 1:
        raise ValueError(f"Expected steps * strength >= 1 (the second pass's steps), but got {steps} * {strength}.")
    settings = BenchSettings(**{**asdict(settings), "host_cost": False})
    with _quiet_diffusers():  # from_pipe casts every model in place, which warns once per model
        second = diffusers.StableDiffusionImg2ImgPipeline.from_pipe(pipe)  # its module loads here, on first use
    for part in (pipe, second):
        part.set_progress_bar_config(disable=True)
    unet = pipe.unet
    target = _Target(unet)
    pending: dict[str, Method] = {}
    parts: list[_Parts] = []
    first_latents: dict[str, torch.Tensor] = {}
    first_outputs: dict[str, torch.Tensor] = {}
    device = pipe.device

    def generator() -> torch.Generator:
        return torch.Generator(device="cpu" if device.type == "mps" else device).manual_seed(seed)

    def generate(_: torch.nn.Module) -> torch.Tensor:
        method = pending["method"]
        common = dict(num_inference_steps=steps, guidance_scale=guidance_scale)
        with torch.inference_mode():
            synchronize(device)
            start = time.perf_counter()
            latents = pipe(prompt=prompt, height=resolution, width=resolution, generator=generator(),
                           output_type="latent", **common).images  # fmt: skip
            synchronize(device)
            upscale_start = time.perf_counter()
            large = upscale_latents(latents)
            synchronize(device)
            second_start = time.perf_counter()
            method.apply(unet)
            try:
                with DenoiserTimer(unet) as timer:
                    synchronize(device)
                    pass_start = time.perf_counter()
                    output = second(prompt=prompt, image=large, strength=strength, generator=generator(),
                                    output_type="pt" if decode else "latent", **common).images[0]  # fmt: skip
                    synchronize(device)
                    pass_seconds = time.perf_counter() - pass_start
            finally:
                method.remove(unet)
        parts.append(
            _Parts(
                method.name,
                upscale_start - start,
                second_start - upscale_start,
                pass_seconds,
                timer.seconds,
                timer.calls,
            )  # fmt: skip
        )
        first_latents.setdefault(method.name, latents.detach().float().cpu())
        first_outputs.setdefault(method.name, output.detach().float().cpu())
        return output

    def deferred(method: Method) -> Method:  # the engine's apply only names the method the second pass takes
        def apply(_: torch.nn.Module) -> None:
            pending["method"] = method
            target.active = method.name

        def remove(_: torch.nn.Module) -> None:
            target.active = None

        return Method(method.name, method.family, method.ratio, apply, remove, None, dict(method.settings))

    def second_pass_seconds() -> float:
        return parts[-1].second

    with _quiet_diffusers():
        wrapped = [deferred(m) for m in methods]
        rows = run_benchmark(target, wrapped, generate, settings, inner_seconds=second_pass_seconds)
    reference = first_latents[methods[0].name]
    result = []
    for row in rows:
        mine = [p for p in parts if p.name == row.name][-settings.rounds :]  # the timed rounds come last
        result.append(
            HiresRow(
                name=row.name,
                family=row.family,
                ratio=row.ratio,
                seconds_per_image=row.seconds,
                speedup_per_image=row.speedup,
                first_pass_seconds=_median([p.first for p in mine]),
                upscale_seconds=_median([p.upscale for p in mine]),
                second_pass_seconds=row.inner_seconds,
                second_pass_speedup=row.inner_speedup,
                second_pass_step_seconds=_median([p.unet_seconds / max(p.unet_calls, 1) for p in mine]),
                image_change=row.rel_error,
                first_pass_change=relative_error(first_latents[row.name], reference),
                second_pass_calls=mine[0].unet_calls,
                peak_memory_mib=row.peak_memory_mib,
                memory_before_mib=row.memory_before_mib,
                image_times=list(row.times),
                second_pass_times=list(row.inner_times),
                settings=dict(row.settings),
            )
        )
    images = [_to_pil(first_outputs[m.name]) for m in methods] if decode else []
    return HiresRun(result, images)


def hires_table(rows: Sequence[HiresRow]) -> str:
    """A markdown table of `time_hires` rows.

    Example:
        >>> row = HiresRow("baseline", "baseline", None, 9.5, 1.0, 2.0, 0.01, 7.4, 1.0, 0.7, 0.0, 0.0, 10)
        >>> print(hires_table([row]).splitlines()[2])
        | baseline | - | 9.50 | 1.00x | 2.00 | 0.01 | 7.40 | 1.00x | 0.700 | 0.00 | 0.00 | - |
    """
    columns = ("method", "ratio", "s/image", "speed-up/image", "1st pass s", "upscale s", "2nd pass s",
               "speed-up 2nd pass", "2nd pass s/step", "image change %", "1st pass change %", "peak MiB")  # fmt: skip
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        cells = [
            row.name,
            "-" if row.ratio is None else f"{row.ratio:g}",
            f"{row.seconds_per_image:.2f}",
            f"{row.speedup_per_image:.2f}x",
            f"{row.first_pass_seconds:.2f}",
            f"{row.upscale_seconds:.2f}",
            f"{row.second_pass_seconds:.2f}",
            f"{row.second_pass_speedup:.2f}x",
            f"{row.second_pass_step_seconds:.3f}",
            f"{100 * row.image_change:.2f}",
            f"{100 * row.first_pass_change:.2f}",
            "-" if row.peak_memory_mib is None else f"{row.peak_memory_mib:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
