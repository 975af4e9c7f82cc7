"""One whole `tome-processors bench` run, from resolved options to the printed tables and written files.

The command (`cli.bench_command`) parses and checks the options, fills a `BenchRequest` and calls
`run_bench`, which does the rest: device and dtype, threads, the model (`models.build_model`), the rows
(`methods.pick_methods`), the trained-denoiser columns (`quality`), the measurement (`engine.run_benchmark`,
or `generate.time_generations` with `pipeline`), the run's metadata (`meta`), and the report (`report`).

Example:
    >>> request = BenchRequest(quick=True, ratios=(0.5,), presets=(), with_tomesd=False, rounds=1)
    >>> request.batch, request.command
    (2, 'tome-processors bench')
    >>> run_bench(request)  # doctest: +SKIP
    | method | ratio | ...
    0
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from PIL import Image

from .attention_share import attention_share_metrics
from .caches import cache_methods, cache_quality, cache_quality_table, opens_cache_context, supports_caches
from .engine import BenchSettings, Method, Row, run_benchmark
from .generate import DEFAULT_PROMPT, generation_table, save_generation_grid, save_generation_json, time_generations
from .hires import HIRES_SCALE, hires_table, time_hires
from .meta import dtype_name, machine, resolve_device, resolve_dtype, versions
from .methods import DEFAULT_MODES, DEFAULT_PRESETS, DEFAULT_RATIOS, pick_methods
from .models import BenchModel, build_model
from .profiling import save_profile_report
from .quality import TRAINED_COLUMNS, bench_denoiser, trained_quality_metrics
from .report import idle_reason, json_safe, markdown_table, meta_lines, save_grid, save_json, save_plot
from .stacking import (
    STACKS,
    generations_in_run,
    missing_stack,
    pick_steps,
    stack_methods,
    stacking_summary,
    stacking_table,
)
from .train_bench import CHECKPOINTING, GRADIENT_CHANGE, train_rows, training_meta
from .unet import ARCHITECTURES, UNetProxy, default_proxy

__all__ = ["TRAIN_ARCHITECTURES", "UNET_ARCHITECTURES", "BenchRequest", "choose_proxy", "run_bench"]

#: The UNet architectures that can be cut down to a proxy (`unet.UNetProxy`).
UNET_ARCHITECTURES = ("sd15", "sd2", "sdxl")
#: The architectures `train=True` builds (UNets: a LoRA on their attention projections).
TRAIN_ARCHITECTURES = UNET_ARCHITECTURES


@dataclass(frozen=True)
class BenchRequest:
    """One bench run, every option resolved (the defaults are the command's without `--full`).

    Attributes:
        model: a local diffusers folder or a hub id; None for an architecture with random weights.
        arch: `sd15`, `sd2`, `sdxl`, `pixart`, `sd3`, `flux`, `svd`, a newer image transformer or a video one
            (`dit.VIDEO_ARCHITECTURES`; None: sd15 when no `model`).
        quick: a tiny model of the architecture's layout.
        pipeline: time whole generations (`generate.time_generations`) instead of single forwards.
        resolution: image side in pixels (None: the model's own).
        batch: the forward's batch (None with `pipeline`: the pipeline's).
        seed: seeds the random weights, inputs and generations.
        device: `"auto"`, `"cpu"`, `"cuda"`, `"cuda:1"`, `"mps"` (`meta.resolve_device`).
        dtype: `"auto"` or a torch dtype name (`meta.resolve_dtype`).
        threads: torch CPU threads (None: torch's choice).
        ratios, modes, presets: the rows (`methods.pick_methods`); no `"none"` in them.
        with_tomesd: add tomesd's rows when it is installed.
        rounds, warmup, measure_memory, host_cost, progress, compile, compile_backend: as in `BenchSettings`.
        trained_quality: add the columns measured on the shipped trained denoiser (needs scikit-image).
        plot_error: the plot's x axis, `"random"` or `"trained"`.
        json_path, plot_path: where to write the JSON and the plot (None: not written).
        profile_path: where to write each method's forward (with `train`, its training step) timed op by op
            (`profiling.profile_report`; None: not profiled).
        grid_path: with `pipeline`, where to save the image grid.
        text_encoders: with `pipeline` and no `model`: `"full"` or `"small"` (None: full).
        cache: with `pipeline`, one of diffusers' step caches (`caches.CACHES`), timed alone and with each preset.
        stack: with `pipeline` on a UNet pipeline, an accelerator (`stacking.STACKS`: DeepCache) timed alone and with
            each preset; its rows are skipped, with a printed note, where its package is not installed.
        stack_budget_seconds: with `stack`, pick the step count so that the run fits this long
            (`stacking.pick_steps`; None: `steps` as given). stack_picked: what the pick rested on (set by `run_bench`).
        decode: with `pipeline`, False stops every generation at its latents (no VAE decode, no image grid).
        prompt, steps, guidance_scale: with `pipeline`, each generation's.
        frames: a video architecture's clip: pixel frames (wan, wan-i2v, ...) or frames per clip (svd); None: the
            model's.
        width: the image width of a UNet's forwards, or a video transformer's clip width, in pixels (`resolution`
            is the height; None: square, or the video model's own).
        layers: a diffusion-transformer `arch` (wan too) with at most that many blocks per block list (None: all);
            a UNet `arch`: the proxy's layers per block (`unet.UNetProxy`).
        levels: a UNet `arch` cut down to its first `levels` levels (`unet.UNetProxy`; None: `choose_proxy`'s).
        whole: a UNet `arch` whole, even on a CPU at a high resolution (no proxy).
        train: time LoRA training steps instead of forwards (`train_bench.train_rows`; UNets only).
        gradient_checkpointing: with `train`, `"off"`, `"on"` or `"both"` (`train_bench.CHECKPOINTING`).
        command: the command line, for the metadata.
    """

    model: str | None = None
    arch: str | None = None
    quick: bool = False
    pipeline: bool = False
    resolution: int | None = None
    batch: int | None = 2
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    threads: int | None = None
    ratios: tuple[float, ...] = DEFAULT_RATIOS
    modes: tuple[str, ...] = DEFAULT_MODES
    presets: tuple[str, ...] = DEFAULT_PRESETS
    with_tomesd: bool = True
    rounds: int = 3
    warmup: int = 1
    measure_memory: bool = True
    host_cost: bool = True
    progress: bool = True
    compile: str | None = None
    compile_backend: str = "inductor"
    trained_quality: bool = True
    plot_error: str = "random"
    json_path: str | None = None
    plot_path: str | None = None
    profile_path: str | None = None
    grid_path: str = "tome-bench-grid.png"
    text_encoders: str | None = None
    cache: str | None = None
    stack: str | None = None
    stack_budget_seconds: float | None = None
    stack_picked: str | None = None
    decode: bool = True
    prompt: str = DEFAULT_PROMPT
    steps: int = 20
    guidance_scale: float = 7.5
    frames: int | None = None
    width: int | None = None
    layers: int | None = None
    train: bool = False
    gradient_checkpointing: str = "off"
    levels: int | None = None
    whole: bool = False
    hires: bool = False
    strength: float = 0.5
    command: str = "tome-processors bench"


def run_bench(request: BenchRequest) -> int:
    """Run the benchmark `request` describes, print the table and the metadata, write the files it names.

    Notes (rows left out) go to stderr. Returns the exit code, 0.

    Example:
        >>> run_bench(BenchRequest(quick=True, json_path="bench.json"))  # doctest: +SKIP
        | method | ratio | ...
        0
    """
    if request.profile_path is not None and request.pipeline:
        raise ValueError(
            f"Expected profile_path={request.profile_path!r} only without pipeline=True (it profiles single forwards)."
        )
    _check_training(request)
    started = time.perf_counter()
    if request.threads is not None:
        torch.set_num_threads(request.threads)
    device = resolve_device(request.device)
    dtype = resolve_dtype(request.dtype, device)
    proxy = choose_proxy(request, device)
    if proxy is not None:  # say it before the minutes of measuring, and again in the report
        print(
            f"note: a proxy, {proxy.describe(request.arch or 'sd15')}: speed-ups are of these levels only",
            file=sys.stderr,
        )

    bench = build_model(
        request.model,
        request.arch,
        request.quick,
        request.pipeline,
        request.resolution,
        request.batch or 2,
        request.seed,
        device,
        dtype,
        text_encoders=request.text_encoders or "full",
        frames=request.frames,
        width=request.width,
        layers=request.layers,
        prompt=request.prompt,
        proxy=proxy,
    )
    methods, notes = pick_methods(
        bench.model,
        bench.family,
        list(request.ratios),
        list(request.modes),
        with_tomesd=request.with_tomesd,
        presets=list(request.presets),
    )
    if request.cache is not None:
        if not request.pipeline:
            raise ValueError(f"Expected cache={request.cache!r} only with pipeline=True (caches act across steps).")
        if not supports_caches(bench.model):
            raise ValueError(
                f"Expected a denoiser with diffusers' caches (CacheMixin) for cache={request.cache!r}, but got "
                f"{type(bench.model).__name__}."
            )
        if not opens_cache_context(bench.pipe):
            raise ValueError(
                f"Expected a pipeline that opens a cache context around its denoiser calls for "
                f"cache={request.cache!r}, but {type(bench.pipe).__name__} does not (diffusers' caches fail "
                "without one)."
            )
        presets = [m for m in methods if m.family in {f"ours {preset}" for preset in request.presets}]
        methods += cache_methods(request.cache, bench.pipe, presets)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)

    settings = BenchSettings(
        rounds=request.rounds,
        warmup=request.warmup,
        measure_memory=request.measure_memory,
        host_cost=request.host_cost,
        profile=request.profile_path is not None,
        progress=request.progress,
        compile=request.compile,
        compile_backend=request.compile_backend,
    )
    if request.stack is not None:
        request, bench, methods = _stack(request, bench, methods, settings, started)
    prepared = _Prepared(bench, methods, settings, device, dtype, started)
    if request.train:
        return _run_training(request, prepared)
    if request.hires:
        return _run_hires(request, prepared)
    return _run_pipeline(request, prepared) if request.pipeline else _run_forwards(request, prepared)


def _stack(
    request: BenchRequest, bench: BenchModel, methods: list[Method], settings: BenchSettings, started: float
) -> tuple[BenchRequest, BenchModel, list[Method]]:
    """`stack`: the accelerator's rows (or a printed note where it is not installed), and the size and step count
    picked."""
    if not request.pipeline or request.hires:
        raise ValueError(f"Expected stack={request.stack!r} with pipeline=True and without hires, but got {request}.")
    missing = missing_stack(request.stack)
    if missing is not None:  # an optional dependency: the other rows still run
        print(f"note: {missing}; the {STACKS[request.stack].label} rows are skipped.")
    else:
        presets = [m for m in methods if m.family in {f"ours {preset}" for preset in request.presets}]
        methods = methods + stack_methods(request.stack, bench.pipe, presets)
    if request.stack_budget_seconds is not None:
        pick = pick_steps(
            bench.pipe,
            request.prompt,
            request.guidance_scale,
            bench.resolution,
            request.seed,
            generations_in_run(len(methods), settings),
            request.stack_budget_seconds,
            elapsed_seconds=time.perf_counter() - started,
            call_kwargs=bench.call_kwargs,
        )
        print(f"size and steps picked: {pick.describe()}", flush=True)
        request = dataclasses.replace(request, steps=pick.steps, stack_picked=pick.describe())
        bench = dataclasses.replace(bench, resolution=pick.resolution)
    return request, bench, methods


def _check_training(request: BenchRequest) -> None:
    """What `train=True` cannot be combined with, before anything is built."""
    if request.gradient_checkpointing not in CHECKPOINTING:
        raise ValueError(
            f"Expected gradient_checkpointing among {list(CHECKPOINTING)}, but got {request.gradient_checkpointing!r}."
        )
    if not request.train:
        if request.gradient_checkpointing != "off":
            raise ValueError("Expected gradient_checkpointing only with train=True, but got it without.")
        return
    unsupported = {
        "pipeline": request.pipeline,
        "compile": request.compile is not None,
        "plot_path": request.plot_path is not None,
    }
    for name, given in unsupported.items():
        if given:
            raise ValueError(f"Expected train=True without {name}, but got both.")
    if request.model is None and (request.arch or "sd15") not in TRAIN_ARCHITECTURES:
        raise ValueError(f"Expected train=True with a UNet arch {TRAIN_ARCHITECTURES}, but got {request.arch!r}.")


class _Prepared(NamedTuple):
    """What both kinds of run start from: the model, the rows, the settings, where and since when."""

    bench: BenchModel
    methods: list[Method]
    settings: BenchSettings
    device: torch.device
    dtype: torch.dtype
    started: float


def choose_proxy(request: BenchRequest, device: torch.device) -> UNetProxy | None:
    """The cut-down UNet a run measures, or None for the whole model.

    `levels` / `layers` given for a UNet architecture: that proxy; `whole`: none. Otherwise, on a device other
    than CUDA, a UNet architecture (not `quick`, not `model`) whose denoiser would see more latent pixels per
    forward than at its default size and batch 2 (sd15 at 512 px, sd2 at 768, sdxl at 1024) gets
    `unet.default_proxy`: on a CPU a whole forward there takes minutes. With `hires`, the second pass's size
    (twice `resolution`) and batch 2 decide.

    Example:
        >>> choose_proxy(BenchRequest(arch="sd15", resolution=1024, batch=1), torch.device("cpu"))
        UNetProxy(levels=2, layers=1)
        >>> choose_proxy(BenchRequest(arch="sd15", resolution=1024, batch=1), torch.device("cuda")) is None
        True
    """
    arch = request.arch or ("sd15" if request.model is None else None)
    if arch not in UNET_ARCHITECTURES or request.quick or request.whole:
        return None
    if request.levels is not None or request.layers is not None:
        total = len(ARCHITECTURES[arch]["block_out_channels"])
        return UNetProxy(levels=request.levels or total, layers=request.layers)
    if device.type == "cuda":
        return None
    sample = int(ARCHITECTURES[arch]["sample_size"])
    height = request.resolution or sample * 8
    width = request.width or height
    batch = 2 if request.pipeline or request.batch is None else request.batch
    scale = 2 if request.hires else 1
    if (height * scale // 8) * (width * scale // 8) * batch <= sample * sample * 2:
        return None
    return default_proxy(arch)


#: The line that heads a proxy's report.
PROXY_HEADER = "PROXY, NOT THE WHOLE UNET"


def proxy_sentence(described: str) -> str:
    """What a proxy run measured, in one sentence for the report's header and the JSON's `meta.proxy`.

    Example:
        >>> proxy_sentence("the UNet's first 2 of 4 levels (320, 640 channels), 1 layer per block, no mid block")[:32]
        "the UNet's first 2 of 4 levels ("
    """
    return (
        f"{described}; each kept level at its real width, heads and token count at this size. Speed-ups are "
        "those of these levels alone, above the whole forward's (the levels left out do not get faster); whole "
        "forwards: --whole, or --device cuda"
    )


def _combined(
    metrics: list[Callable[[Method], dict[str, float]]],
) -> Callable[[Method], dict[str, float]] | None:
    """One `extra_metrics` callable giving the columns of all of `metrics` (None for none)."""
    if not metrics:
        return None
    return lambda method: {key: value for metric in metrics for key, value in metric(method).items()}


#: Single-forward rows time back-to-back forwards for at least this long per run (`BenchSettings.min_run_seconds`).
MIN_RUN_SECONDS = 0.05


def _run_forwards(request: BenchRequest, run: _Prepared) -> int:
    """Single forwards: the rows with the trained-denoiser columns, the table, the JSON and the plot."""
    bench, methods, settings, device, dtype, started = run
    denoiser = bench_denoiser(bench.family)  # each row is measured on the trained model of the family's shape
    metrics: list[Callable[[Method], dict[str, float]]] = []
    if bench.family is not None and bench.family.video:  # video rows also show attention's share
        metrics.append(attention_share_metrics(bench.model, bench.forward))
    trained = False
    if request.trained_quality:
        if importlib.util.find_spec("skimage") is None:
            print('note: the trained-denoiser columns need scikit-image: pip install "tome-processors[bench]".')
        else:
            metrics.append(trained_quality_metrics(denoiser))
            trained = True
    extra_metrics = _combined(metrics)
    if request.plot_error == "trained" and not trained:
        print("note: --plot-error trained needs the trained-quality columns; plotting the random-weight error.")
    # Each method stays on its own copy of the model, so every timed forward is a later one after applying it (as in
    # a generation's steps); forwards of a few milliseconds (tiny models, small sizes on a GPU) are timed in runs.
    steady = dataclasses.replace(settings, keep_applied=True, min_run_seconds=MIN_RUN_SECONDS)
    rows = run_benchmark(bench.model, methods, bench.forward, steady, extra_metrics=extra_metrics)
    forced = TRAINED_COLUMNS[denoiser] if trained else ()
    for row in rows:  # measured in its forwards (the engine counts the tokens): say why it merged nothing
        if row.merges is False:
            row.idle = idle_reason(row, device.type, forced)
    meta = {**_meta(request, device, dtype, bench, started), "forwards_per_run": rows[0].forwards_per_run}
    if trained:
        meta["trained_columns"] = (
            f"{', '.join(forced)}: the trained {denoiser} with each row's method, merging wherever it selects "
            "(the pays rule off), not the forwards timed here"
        )

    if bench.proxy is not None:
        print(f"{PROXY_HEADER}: {meta['proxy']}\n")
    print(markdown_table(rows))
    print()
    print(meta_lines(meta))
    if request.json_path:
        print(f"JSON: {save_json(rows, meta, request.json_path)}")
    _save_profiles(request, rows)
    if request.plot_path:
        title = f"{bench.description}, {bench.resolution} px, batch {request.batch}, {meta['dtype']} on {device.type}"
        error_key = TRAINED_COLUMNS[denoiser][0] if trained and request.plot_error == "trained" else None
        print(f"plot: {save_plot(rows, request.plot_path, title, error_key=error_key)}")
    return 0


def _run_training(request: BenchRequest, run: _Prepared) -> int:
    """LoRA training steps: the rows (per checkpointing group), the table and the JSON."""
    bench, methods, settings, device, dtype, started = run
    if bench.family is None or bench.family.name != "unet":
        raise ValueError(f"Expected a UNet for train=True, but got {type(bench.model).__name__}.")
    metrics = []
    if request.trained_quality:
        if importlib.util.find_spec("skimage") is None:
            print('note: the trained-denoiser columns need scikit-image: pip install "tome-processors[bench]".')
        else:
            metrics.append(trained_quality_metrics(bench_denoiser(bench.family)))
    rows = train_rows(
        bench,
        methods,
        settings,
        request.batch or 2,
        request.seed,
        checkpointing=request.gradient_checkpointing,
        extra_metrics=metrics,
    )
    meta = _meta(request, device, dtype, bench, started)
    meta.update(training_meta(request.gradient_checkpointing))
    print(markdown_table(rows, unit="step", error=GRADIENT_CHANGE))
    print()
    print(meta_lines(meta))
    if request.json_path:
        print(f"JSON: {save_json(rows, meta, request.json_path)}")
    _save_profiles(request, rows)
    return 0


def _save_profiles(request: BenchRequest, rows: list[Row]) -> None:
    """Write each row's op-by-op profile (a forward, or a training step) where `profile_path` says."""
    if request.profile_path:
        named = [(row.name, row.profile) for row in rows if row.profile is not None]
        print(f"profile: {save_profile_report(named, request.profile_path, header=f'`{request.command}`')}")


def _run_pipeline(request: BenchRequest, run: _Prepared) -> int:
    """`pipeline`: time whole generations per method, print the table, save the grid and the JSON."""
    bench, methods, settings, device, dtype, started = run
    generations = time_generations(
        bench.pipe,
        methods,
        request.prompt,
        request.steps,
        request.guidance_scale,
        bench.resolution,
        request.seed,
        settings,
        bench.call_kwargs,
        decode=request.decode,
    )
    meta = _meta(request, device, dtype, bench, started)
    video = bench.family is not None and bench.family.video
    unit = "video" if video else "image"
    meta.update(
        batch=generations.rows[0].denoiser_batch,
        pipeline=type(bench.pipe).__name__,
        components=dict(bench.components),
        prompt=request.prompt,
        steps=request.steps,
        denoiser_calls=generations.rows[0].denoiser_calls,
        guidance_scale=request.guidance_scale,
        seconds=f"per {unit}: one generation end to end; per step: inside the denoiser, per denoiser call",
    )
    if bench.call_kwargs:  # what the random-weight pipeline's every call adds (Qwen-Image's guidance, a clip, ...)
        meta["call_arguments"] = {name: _shown(value) for name, value in bench.call_kwargs.items()}
    if "num_frames" in bench.call_kwargs:  # a random-weight video pipeline's clip
        clip = bench.call_kwargs
        meta.update(output="video", frames=clip["num_frames"], height=clip["height"], width=clip["width"])
    if not request.decode:
        meta.update(output="latents (no VAE decode: not in the time per image; image change of the latents)")
    summary = stacking_summary(generations.rows, STACKS[request.stack].label) if request.stack is not None else []
    if request.stack is not None:
        meta.update(stack=STACKS[request.stack].help, steps_picked=request.stack_picked, stacking=summary)
    print(generation_table(generations.rows, unit))
    if summary:
        print()
        print(stacking_table(summary))
    print()
    print(meta_lines({key: value for key, value in meta.items() if key not in ("components", "stacking")}))
    print("- components:")
    print("\n".join(f"  - {name}: {what}" for name, what in bench.components.items()))
    if request.json_path:
        print(f"JSON: {save_generation_json(generations.rows, meta, request.json_path)}")
    if request.decode:  # latents make no picture
        grid = save_generation_grid(generations, request.grid_path, unit)
        print(f"grid: {grid}" + (" (the first frame of each video)" if video else ""))
    if request.cache is not None:
        presets = [m for m in methods if m.family in {f"ours {preset}" for preset in request.presets}]
        references = [m for m in methods if m.family == "ours"]  # `--ratios` rows: the bounds presets are held to
        print()
        print(cache_quality_table(cache_quality(request.cache, presets, references=references)))
    return 0


def _run_hires(request: BenchRequest, run: _Prepared) -> int:
    """`hires`: the hires-fix workflow per method (`hires.time_hires`), its table, the grid and the JSON."""
    bench, methods, settings, device, dtype, started = run
    if not request.pipeline or type(bench.pipe).__name__ != "StableDiffusionPipeline":
        raise ValueError(f"Expected hires=True with pipeline=True on a StableDiffusionPipeline, but got {request}.")
    hires = time_hires(
        bench.pipe,
        methods,
        request.prompt,
        request.steps,
        request.guidance_scale,
        bench.resolution,
        request.strength,
        request.seed,
        settings,
        decode=request.decode,
    )
    meta = _meta(request, device, dtype, bench, started)
    second = bench.resolution * HIRES_SCALE
    proxy = choose_proxy(request, device)
    if proxy is not None:  # its token counts at the second pass's size, where the methods act
        meta["proxy"] = proxy_sentence(proxy.describe(request.arch or "sd15", second) + f" at {second} px")
    meta.update(
        batch=2 if request.guidance_scale > 1 else 1,
        pipeline=f"{type(bench.pipe).__name__}, then StableDiffusionImg2ImgPipeline.from_pipe",
        components=dict(bench.components),
        hires=(
            f"text to image at {bench.resolution} px ({request.steps} steps, no method), latents upscaled "
            f"{HIRES_SCALE}x (bilinear), image to image at {second} px (strength {request.strength}: "
            f"{int(request.steps * request.strength)} steps) with the row's method on that pass only"
        ),
        prompt=request.prompt,
        steps=request.steps,
        strength=request.strength,
        second_pass_resolution=second,
        second_pass_calls=hires.rows[0].second_pass_calls,
        guidance_scale=request.guidance_scale,
        seconds="per image: both passes, the upscale and the method's apply/remove; 2nd pass: the img2img call",
    )
    if not request.decode:
        meta.update(output="latents (no VAE decode at the second pass's size; image change of the latents)")
    if bench.proxy is not None:
        print(f"{PROXY_HEADER}: {meta['proxy']}\n")
    print(hires_table(hires.rows))
    print()
    print(meta_lines({key: value for key, value in meta.items() if key != "components"}))
    print("- components:")
    print("\n".join(f"  - {name}: {what}" for name, what in bench.components.items()))
    if request.json_path:
        path = Path(request.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {"meta": json_safe(meta), "rows": json_safe(hires.as_json())}
        path.write_text(json.dumps(payload, indent=2, allow_nan=False) + "\n", encoding="utf-8")
        print(f"JSON: {path}")
    if request.decode:
        labels = [f"{r.name}\n{r.seconds_per_image:.2f} s/image, {r.speedup_per_image:.2f}x" for r in hires.rows]
        print(f"grid: {save_grid(hires.images, labels, request.grid_path)}")
    return 0


def _shown(value: Any) -> Any:
    """A call argument as the metadata shows it: an image (an image-to-video pipeline's first frame) by its size.

    Example:
        >>> _shown(Image.new("RGB", (832, 480))), _shown(81)
        ('an RGB image of 832 x 480 px', 81)
    """
    return f"an {value.mode} image of {value.width} x {value.height} px" if isinstance(value, Image.Image) else value


def _meta(
    request: BenchRequest, device: torch.device, dtype: torch.dtype, bench: BenchModel, started: float
) -> dict[str, Any]:
    """The run's metadata: the command, model, settings, machine and versions."""
    return {
        "command": request.command,
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "model": bench.description,
        "resolution": bench.resolution,
        "batch": request.batch,
        "device": str(device),
        "dtype": dtype_name(dtype),
        "rounds": request.rounds,
        "warmup": request.warmup,
        "wall_seconds": round(time.perf_counter() - started, 1),
        "compile": None if request.compile is None else f"{request.compile} ({request.compile_backend})",
        "machine": machine(device),
        "torch_threads": torch.get_num_threads(),
        "proxy": None if bench.proxy is None else proxy_sentence(bench.proxy),
        "width": request.width,
        **versions(),
        "memory": "CUDA allocator peak" if device.type == "cuda" else "peak resident set (psutil, sampled every 1 ms)",
    }
