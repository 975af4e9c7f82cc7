"""`tome-processors bench`: speed, memory, output change and host cost of the baseline, this library and tomesd.

By default it builds the Stable Diffusion 1.5 UNet architecture with random weights (nothing is downloaded)
and measures one UNet forward at 512 px, batch 2 (a classifier-free-guidance batch), fp32 on CPU or fp16
on CUDA: the baseline, the presets "exact", "balanced" and "fast" of the model's family, and tomesd at
ratio 0.5, in interleaved rounds in one process, with the trained-denoiser columns. `--full` adds ratios
0.3/0.5/0.7 and every mode. See docs/bench.md.

Example:
    $ tome-processors bench                       # SD1.5 architecture, 512 px, batch 2
    $ tome-processors bench --full --json b.json --plot b.png
    $ tome-processors bench --quick --compile reduce-overhead
    $ tome-processors bench --pipeline --quick --steps 2     # whole generations, random-weight pipeline
    $ tome-processors bench --arch svd --frames 2             # Stable Video Diffusion's UNet, 2 frames
    $ tome-processors bench --model ./sd15 --pipeline --prompt "a red fox in the snow"
    $ tome-processors bench --pipeline --quick --arch flux --cache fbc --presets balanced  # a cache, ToMe, both
    $ tome-processors bench --pipeline --quick --arch wan --steps 2   # whole videos: seconds per video (ltx, wan-i2v)
    $ tome-processors bench --pipeline --quick --arch qwenimage --steps 2   # flux2, chroma, zimage too
    $ tome-processors bench --arch hunyuanvideo15 --layers 1 --frames 33   # also wan-i2v, ltx2, hunyuanvideo
    $ tome-processors bench --train --resolution 768 --layers 1 --presets balanced   # LoRA training steps
    $ tome-processors bench --arch sd15 --resolution 1024 --batch 1   # on a CPU: a proxy of the first 2 levels
    $ tome-processors bench --pipeline --hires --steps 4 --no-decode  # 512 px, upscale, ToMe'd img2img at 1024
    $ tome-processors bench --pipeline --stack deepcache   # DeepCache alone, ToMe balanced alone, both

With `--pipeline` it times whole generations instead (text encoder, every denoising step, VAE decode) on the
architecture's pipeline with random weights, or on `--model`'s: seconds per image (per video with `--arch
wan`, `wan-i2v` or `ltx`, whose clip `--resolution`, `--width` and `--frames` set) and per denoising step.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import sys
from dataclasses import asdict
from typing import Any

import torch

from ..bench.caches import CACHES
from ..bench.dit import DECLARED_IMAGE_ARCHITECTURES, DECLARED_VIDEO_ARCHITECTURES, VIDEO_ARCHITECTURES, VIDEO_STRIDES
from ..bench.hires import HIRES_ARCHITECTURES
from ..bench.image_pipelines import IMAGE_PIPELINE_ARCHITECTURES
from ..bench.image_to_video import missing_requirements
from ..bench.methods import DEFAULT_MODES, DEFAULT_PRESETS, DEFAULT_RATIOS, FULL_RATIOS, MODES
from ..bench.parallel import RankDied, format_parallel_rows, parse_parallel, run_parallel_bench
from ..bench.pipelines import TEXT_ENCODER_SIZES
from ..bench.run import TRAIN_ARCHITECTURES, UNET_ARCHITECTURES, BenchRequest, run_bench
from ..bench.stacking import STACK_BUDGET_SECONDS, STACKS
from ..bench.train_bench import CHECKPOINTING
from ..bench.unet import ARCHITECTURES as UNET_CONFIGS
from ..bench.video_pipelines import CLIP_MULTIPLES
from ..config import PRESETS, ToMeConfig

#: `--compile` without a mode.
_COMPILE_DEFAULT = "default"
_COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


#: The newer image transformers (their random-weight pipelines: `bench.image_pipelines`).
_NEW_TRANSFORMERS = IMAGE_PIPELINE_ARCHITECTURES
#: Video transformers measured on single forwards only (no random-weight pipeline of theirs in bench/).
_FORWARD_ONLY = ("ltx2", "hunyuanvideo", "hunyuanvideo15", *DECLARED_IMAGE_ARCHITECTURES, *DECLARED_VIDEO_ARCHITECTURES)
#: Random-weight pipelines whose scheduler stretches its sigmas to a terminal value (`shift_terminal`): one step
#: makes its only sigma 0 / 0, a NaN image.
_TERMINAL_SHIFT = ("qwenimage", "ltx")


def _listed(values: Any) -> str:
    return " ".join(str(v) for v in values)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `tome-processors bench`."""
    what = parser.add_argument_group("what to measure")
    what.add_argument("--model", default=None, help="a local diffusers folder (pipeline or unet) or a hub id")
    what.add_argument(
        "--arch",
        choices=[
            "sd15",
            "sd2",
            "sdxl",
            "pixart",
            "sd3",
            "flux",
            *_NEW_TRANSFORMERS,
            *DECLARED_IMAGE_ARCHITECTURES,
            "svd",
            *VIDEO_ARCHITECTURES,
        ],  # fmt: skip
        default=None,
        help="a real UNet or diffusion-transformer architecture with random weights (default sd15 when no --model)",
    )
    what.add_argument("--quick", action="store_true", help="a tiny architecture that finishes in seconds")
    what.add_argument(
        "--parallel",
        default=None,
        metavar="SPEC",
        help="split a transformer over processes with diffusers' parallelism: ulysses=N, ring=N, ulysses=N,ring=M "
        "or tp=N (one process a rank; per row seconds per forward and the bytes its collectives send; docs/bench.md). "
        "A run whose ranks would not fit this machine's available memory is refused first, with the estimate a rank "
        "and the --layers or --frames that fit",
    )
    what.add_argument(
        "--ignore-memory-estimate",
        action="store_true",
        help="--parallel: spawn the ranks even where their estimated memory exceeds what this machine has available",
    )
    what.add_argument("--resolution", type=int, default=None, help="image side in pixels (default: the model's)")
    what.add_argument(
        "--layers",
        type=int,
        default=None,
        help="a transformer --arch (wan too) at its real width with at most this many blocks per block list; "
        "ratios are per block. sd15, sd2, sdxl: a proxy UNet with at most this many layers per block",
    )
    what.add_argument(
        "--levels",
        type=int,
        default=None,
        help="sd15, sd2, sdxl: a proxy UNet of its first N levels at their real width and token count (no mid "
        "block); default on a CPU above the model's default size: the levels up to the second with attention, "
        "1 layer per block",
    )
    what.add_argument(
        "--whole",
        action="store_true",
        help="sd15, sd2, sdxl: the whole UNet even where a CPU run would take a proxy (see --levels)",
    )
    video = parser.add_argument_group(f"video models (--arch {', '.join(VIDEO_ARCHITECTURES)}, svd)")
    video.add_argument(
        "--frames",
        type=int,
        default=None,
        help=f"{', '.join(VIDEO_ARCHITECTURES)}: pixel frames of the clip (wan's default 33: 9 latent frames); "
        "svd: frames per clip (default 14)",
    )
    video.add_argument(
        "--width",
        type=int,
        default=None,
        help=f"{', '.join(VIDEO_ARCHITECTURES)}: clip width in pixels; sd15, sd2, sdxl forwards: image width "
        "(non-square); --resolution is the height",
    )
    what.add_argument(
        "--batch", type=int, default=None, help="UNet batch size (default 2 = one image with CFG); not with --pipeline"
    )
    what.add_argument(
        "--train",
        action="store_true",
        help="time LoRA training steps (forward, loss, backward, AdamW step of a LoRA on the attention projections) "
        "instead of forwards; UNet architectures (sd15, sd2, sdxl) or a --model UNet",
    )
    what.add_argument(
        "--gradient-checkpointing",
        nargs="?",
        const="both",
        default=None,
        choices=CHECKPOINTING,
        help="with --train: the rows with the UNet's gradient checkpointing (on), without (off, the default) or "
        "both groups (both; the default when given without a value)",
    )
    what.add_argument(
        "--full",
        action="store_true",
        help=f"the full grid: ratios {_listed(FULL_RATIOS)} and every mode, 5 rounds (unless given)",
    )
    what.add_argument(
        "--ratios",
        type=float,
        nargs="+",
        default=None,
        help=f"merge ratios for ours and tomesd (default none: tomesd at 0.5; with --full {_listed(FULL_RATIOS)})",
    )
    what.add_argument(
        "--presets",
        nargs="+",
        default=None,
        metavar="PRESET",
        help=f"presets to add as rows (ToMeConfig.from_preset for the model's family), or 'none' "
        f"(default {_listed(DEFAULT_PRESETS)}): {', '.join(PRESETS)}",
    )
    modes = ", ".join(f"{name} ({spec.help})" for name, spec in MODES.items())
    what.add_argument(
        "--modes",
        nargs="+",
        default=None,
        metavar="MODE",
        help=f"modes beyond tomesd to add as rows, or 'none' (default {_listed(DEFAULT_MODES) or 'none'}; "
        f"with --full all): {modes}",
    )
    what.add_argument("--no-tomesd", action="store_true", help="leave tomesd out even when it is installed")
    what.add_argument(
        "--no-trained-quality",
        action="store_true",
        help="skip the columns measured on a shipped trained denoiser (the DiT's for transformers, else the UNet's)",
    )

    how = parser.add_argument_group("how to measure")
    how.add_argument("--rounds", type=int, default=None, help="timed rounds (default 3, 5 with --full)")
    how.add_argument("--warmup", type=int, default=BenchRequest.warmup, help="untimed forwards per method first")
    how.add_argument("--device", default=BenchRequest.device, help="auto, cpu, cuda, cuda:1, mps")
    how.add_argument(
        "--dtype",
        choices=["auto", "float32", "float16", "bfloat16"],
        default=BenchRequest.dtype,
        help="auto: float16 on CUDA, float32 elsewhere",
    )
    how.add_argument(
        "--compile",
        nargs="?",
        const=_COMPILE_DEFAULT,
        default=None,
        choices=_COMPILE_MODES,
        metavar="MODE",
        help=f"torch.compile the baseline and every method alike, with this mode ({', '.join(_COMPILE_MODES)}; "
        f"default when given without one: {_COMPILE_DEFAULT})",
    )
    how.add_argument(
        "--compile-backend",
        default=BenchRequest.compile_backend,
        help="the torch.compile backend; 'eager' or 'aot_eager' only trace (graph breaks, recompiles)",
    )
    how.add_argument("--seed", type=int, default=BenchRequest.seed, help="seed of the random weights and inputs")
    how.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    how.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    how.add_argument("--no-host-cost", action="store_true", help="skip counting aten ops, syncs and kernels")
    how.add_argument("--no-progress", action="store_true", help="no progress bar")

    out = parser.add_argument_group("output")
    out.add_argument("--json", default=None, metavar="PATH", help="write every row and the run's metadata here")
    out.add_argument("--plot", default=None, metavar="PATH", help="write a PNG of speed-up against output error")
    out.add_argument(
        "--profile",
        default=None,
        metavar="PATH",
        help="time one more forward (with --train, one more step) per method op by op (torch.profiler: device time "
        "on CUDA, CPU time elsewhere) and write each method's top ops and attention kernels to PATH (markdown); not "
        "with --pipeline",
    )
    out.add_argument(
        "--plot-error",
        choices=["random", "trained"],
        default=BenchRequest.plot_error,
        help="the plot's x axis: the random-weight output error, or the trained denoiser's noise-prediction change",
    )

    gen = parser.add_argument_group("whole generations (--pipeline)")
    gen.add_argument(
        "--pipeline",
        action="store_true",
        help="time whole generations (text encoder, every step, VAE decode) instead of single forwards, on the "
        "--arch pipeline with random weights (or --model's), and save a labelled image grid (wan, wan-i2v, ltx: "
        "whole videos, the grid of their first frames)",
    )
    gen.add_argument(
        "--text-encoders",
        choices=TEXT_ENCODER_SIZES,
        default=None,
        help="random-weight --pipeline only: the real text encoders' shapes (full, the default) or their widths "
        "with 2 layers each (small: T5-XXL alone is 19 GB in float32, FLUX.2's Mistral-Small 48 GB in bfloat16)",
    )
    gen.add_argument(
        "--cache",
        choices=sorted(CACHES),
        default=None,
        help="also time diffusers' step cache NAME alone and with each preset row (a denoiser with enable_cache "
        "whose pipeline opens a cache context: flux, qwenimage, wan, wan-i2v, ltx); taylorseer-lite skips on a "
        "fixed schedule, so it acts on random weights too",
    )
    gen.add_argument(
        "--stack",
        choices=sorted(STACKS),
        default=None,
        help="also time this accelerator alone and with each preset row, and the pair's speed-up against the product "
        "of the two alone (sd15, sd2, sdxl or a --model UNet pipeline; deepcache: DeepCache, cache interval 3). "
        f"Default rows then: the baseline and balanced; without --steps, the step count is picked so that the run "
        f"takes at most {STACK_BUDGET_SECONDS // 60} minutes, and printed",
    )
    gen.add_argument(
        "--no-decode",
        dest="decode",
        action="store_false",
        help="--pipeline only: stop every generation at its latents (no VAE decode in the time per image, no "
        "grid; on a CPU a 1024 px decode can take far longer than a shortened denoiser)",
    )
    gen.add_argument(
        "--hires",
        action="store_true",
        help="with --pipeline (sd15, sd2): the hires-fix workflow: text to image at --resolution with ToMe off, the "
        "latents upscaled 2x, image to image at twice the size with each method on that second pass only",
    )
    gen.add_argument(
        "--strength",
        type=float,
        default=BenchRequest.strength,
        help="--hires: the second pass's denoising strength (it runs int(steps * strength) steps)",
    )
    gen.add_argument("--prompt", default=BenchRequest.prompt)
    gen.add_argument(
        "--steps", type=int, default=None, help=f"denoising steps per generation (default {BenchRequest.steps})"
    )
    gen.add_argument("--guidance-scale", type=float, default=BenchRequest.guidance_scale)
    gen.add_argument("--grid", default=BenchRequest.grid_path, metavar="PATH", help="where to save the image grid")


def _resolve_defaults(args: argparse.Namespace) -> None:
    """Fill the options whose default depends on `--full` / `--quick`."""
    if args.ratios is None:
        args.ratios = list(FULL_RATIOS if args.full else DEFAULT_RATIOS)
    if args.modes is None:
        args.modes = list(MODES if args.full else DEFAULT_MODES)
    if args.presets is None:  # --stack compares one preset alone and with the accelerator
        args.presets = ["balanced"] if args.stack is not None else list(DEFAULT_PRESETS)
    # --stack without --steps: the run picks the step count that fits its time budget.
    args.pick_steps = args.stack is not None and args.steps is None
    if args.steps is None:
        args.steps = BenchRequest.steps
    if args.rounds is None:
        args.rounds = 5 if args.full else 3
    if args.batch is None and not args.pipeline:
        args.batch = 2


def _check(args: argparse.Namespace, fail: Any) -> None:
    """Every option combination that cannot work: `fail(message)` exits with code 2."""
    cap = ToMeConfig().max_ratio
    if not all(0.0 < r <= cap for r in args.ratios):
        fail(f"Expected --ratios between 0 (exclusive) and {cap:g}, but got {args.ratios}.")
    if len(set(args.ratios)) != len(args.ratios):
        fail(f"Expected distinct --ratios, but got {args.ratios}.")
    modes = [m for m in args.modes if m != "none"]
    unknown = [m for m in modes if m not in MODES]
    if unknown or ("none" in args.modes and len(args.modes) > 1):
        fail(f"Expected --modes among {sorted(MODES)}, or 'none' alone, but got {args.modes}.")
    presets = [p for p in args.presets if p != "none"]
    if any(p not in PRESETS for p in presets) or ("none" in args.presets and len(args.presets) > 1):
        fail(f"Expected --presets among {list(PRESETS)}, or 'none' alone, but got {args.presets}.")
    if args.model is not None and (args.arch is not None or args.quick):
        fail("Expected either --model or --arch/--quick, but got both.")
    if args.ignore_memory_estimate:
        fail("Expected --ignore-memory-estimate only with --parallel, but got it without.")
    if args.resolution is not None and (args.resolution < 16 or args.resolution % 8):
        fail(f"Expected --resolution to be a multiple of 8 and >= 16, but got {args.resolution}.")
    if args.threads is not None and args.threads < 1:
        fail(f"Expected --threads >= 1, but got {args.threads}.")
    if args.frames is not None and args.arch not in ("svd", *VIDEO_ARCHITECTURES):
        videos = ", ".join(VIDEO_ARCHITECTURES)
        fail(f"Expected --frames only with a video --arch ({videos}, svd), but got --arch {args.arch}.")
    unet_arch = args.model is None and not args.quick and (args.arch or "sd15") in UNET_ARCHITECTURES
    layered = ("pixart", "sd3", "flux", *VIDEO_ARCHITECTURES, *_NEW_TRANSFORMERS, *DECLARED_IMAGE_ARCHITECTURES)
    if args.layers is not None and args.arch not in layered and not unet_arch:
        fail(f"Expected --layers with a diffusion-transformer --arch or sd15, sd2, sdxl, but got --arch {args.arch}.")
    _check_proxy(args, fail, unet_arch)
    _check_train(args, fail)
    if args.pipeline and args.arch in _FORWARD_ONLY:
        archs = ", ".join(["sd15", "sd2", "sdxl", "pixart", "sd3", "flux", *_NEW_TRANSFORMERS, "wan", "wan-i2v", "ltx"])
        fail(
            f"Expected --pipeline with {archs}, but got --arch {args.arch} (the bench builds no random-weight "
            "pipeline for it: without --pipeline it times the transformer's forwards)."
        )
    for name in ("batch", "warmup", "steps", "rounds", "frames", "layers"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            fail(f"Expected --{name} >= 1, but got {getattr(args, name)}.")
    _check_video(args, fail)
    _check_pipeline(args, fail)
    _check_hires(args, fail)
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        fail("Expected matplotlib for --plot, but it is not installed: pip install 'tome-processors[plot]'.")
    if args.device != "auto":
        try:
            device = torch.device(args.device)
        except RuntimeError:
            fail(f"Expected --device auto, cpu, cuda[:N] or mps, but got {args.device!r}.")
        if device.type == "cuda" and not torch.cuda.is_available():
            fail("Expected a CUDA device for --device cuda, but torch sees none.")
        if device.type == "mps" and not torch.backends.mps.is_available():
            fail("Expected an MPS device for --device mps, but torch sees none.")


def _check_video(args: argparse.Namespace, fail: Any) -> None:
    """The video options: for a video architecture only, and in range."""
    unet_forwards = args.arch in (None, *UNET_ARCHITECTURES) and not args.pipeline
    if args.width is not None and args.arch not in VIDEO_ARCHITECTURES and not unet_forwards:
        videos = ", ".join(VIDEO_ARCHITECTURES)
        fail(
            f"Expected --width only with a video architecture (--arch {videos}) or UNet forwards (sd15, sd2, sdxl, "
            f"--model, without --pipeline), but got --arch {args.arch}{' with --pipeline' * args.pipeline}."
        )
    if args.width is not None and unet_forwards and args.width % 8:
        fail(f"Expected --width to be a multiple of 8, but got {args.width}.")
    if args.arch in VIDEO_ARCHITECTURES and args.frames is not None:
        stride = VIDEO_STRIDES[args.arch][0]
        if args.frames < 1 or (args.frames - 1) % stride:
            fail(
                f"Expected --frames of the form {stride}k + 1 for --arch {args.arch} (its VAE's stride in time), "
                f"but got {args.frames}."
            )
    if args.width is not None and args.arch in VIDEO_ARCHITECTURES and (args.width < 16 or args.width % 16):
        fail(f"Expected --width to be a multiple of 16, but got {args.width}.")
    if args.width is not None and args.width < 16:
        fail(f"Expected --width >= 16, but got {args.width}.")
    if args.arch == "hunyuanvideo15" and args.resolution is not None and args.resolution % 16:
        fail(
            f"Expected --resolution to be a multiple of 16 for --arch hunyuanvideo15 (its VAE's stride in space), "
            f"but got {args.resolution}."
        )


def _check_train(args: argparse.Namespace, fail: Any) -> None:
    """The combinations `--train` cannot run."""
    if not args.train:
        if args.gradient_checkpointing is not None:
            fail("Expected --gradient-checkpointing only with --train, but got it without.")
        return
    for option, given in (
        ("--pipeline", args.pipeline),
        ("--compile", args.compile is not None),
        ("--plot", args.plot is not None),
    ):
        if given:
            fail(f"Expected --train without {option}, but got both.")
    if args.model is None and (args.arch or "sd15") not in TRAIN_ARCHITECTURES:
        fail(f"Expected --train with a UNet --arch ({', '.join(TRAIN_ARCHITECTURES)}), but got --arch {args.arch}.")


def _check_proxy(args: argparse.Namespace, fail: Any, unet_arch: bool) -> None:
    """`--levels` and `--whole`: a random-weight UNet architecture only, and not both."""
    if (args.levels is not None or args.whole) and not unet_arch:
        fail(
            "Expected --levels and --whole only with --arch sd15, sd2 or sdxl (random weights, not --quick), but got "
            f"{'--model' if args.model is not None else '--quick' if args.quick else f'--arch {args.arch}'}."
        )
    if args.whole and (args.levels is not None or args.layers is not None):
        fail("Expected either --whole or a proxy (--levels, --layers), but got both.")
    if args.levels is not None and unet_arch:
        total = len(UNET_CONFIGS[args.arch or "sd15"]["block_out_channels"])
        if not 1 <= args.levels <= total:
            fail(f"Expected --levels between 1 and {total} for --arch {args.arch or 'sd15'}, but got {args.levels}.")


def _check_hires(args: argparse.Namespace, fail: Any) -> None:
    """`--hires`: a random-weight SD1.x/2.x pipeline; `--strength` in (0, 1]."""
    if not 0.0 < args.strength <= 1.0:
        fail(f"Expected --strength in (0, 1], but got {args.strength}.")
    if args.strength != BenchRequest.strength and not args.hires:
        fail("Expected --strength only with --hires, but got it without.")
    if not args.hires:
        return
    if not args.pipeline:
        fail("Expected --hires with --pipeline (it times whole generations), but got it without.")
    if args.model is not None or (args.arch or "sd15") not in HIRES_ARCHITECTURES:
        fail(
            f"Expected --hires with --arch {' or '.join(HIRES_ARCHITECTURES)} (a random-weight pipeline), but got "
            f"{'--model' if args.model is not None else f'--arch {args.arch}'}."
        )
    if args.cache is not None:
        fail("Expected --hires without --cache (the UNets take no diffusers cache), but got both.")
    if int(args.steps * args.strength) < 1:
        fail(f"Expected --steps * --strength >= 1 (the second pass's steps), but got {args.steps} * {args.strength}.")


def _check_pipeline(args: argparse.Namespace, fail: Any) -> None:
    """The combinations `--pipeline` cannot run."""
    if args.stack is not None:
        if not args.pipeline or args.hires:
            given = "--hires" if args.hires else "no --pipeline"
            fail(f"Expected --stack with --pipeline and without --hires (it times whole generations), but got {given}.")
        if args.model is None and (args.arch or "sd15") not in UNET_ARCHITECTURES:
            fail(f"Expected --stack with a UNet pipeline (--arch sd15, sd2, sdxl; --model), but got --arch {args.arch}")
    if not args.pipeline:
        if args.text_encoders is not None:
            fail("Expected --text-encoders only with --pipeline, but got it without.")
        if args.cache is not None:
            fail("Expected --cache only with --pipeline (caches act across denoising steps), but got it without.")
        if not args.decode:
            fail("Expected --no-decode only with --pipeline, but got it without.")
        return
    if args.profile is not None:
        fail("Expected --pipeline without --profile: the profile is of single forwards.")
    if args.compile is not None:
        fail("Expected --pipeline without --compile: the generations run eagerly, but got both.")
    if args.batch is not None:
        fail("Expected --pipeline without --batch: a generation's batch is the pipeline's (2 with guidance).")
    if args.plot is not None:
        fail("Expected --pipeline without --plot: the plot is of single forwards.")
    if args.arch == "svd":
        fail("Expected --pipeline with an image --arch (whole SVD videos are not built offline), but got --arch svd.")
    if args.text_encoders is not None and (args.model is not None or args.quick):
        fail("Expected --text-encoders only for a full-size random-weight pipeline, not with --model or --quick.")
    if args.model is None and args.arch in _TERMINAL_SHIFT and args.steps < 2:
        fail(
            f"Expected --steps >= 2 for the {args.arch} pipeline (its scheduler stretches the sigmas to a terminal "
            f"value, which one step makes NaN), but got {args.steps}."
        )
    transformer = args.arch in ("pixart", "sd3", "flux", *_NEW_TRANSFORMERS, *DECLARED_IMAGE_ARCHITECTURES)
    if transformer and args.resolution is not None and args.resolution % 16:
        fail(f"Expected --resolution to be a multiple of 16 for the {args.arch} pipeline, but got {args.resolution}.")
    if args.arch == "wan-i2v" and args.model is None:
        missing = missing_requirements()
        if missing:
            fail(
                f"Expected {' and '.join(missing)} for the wan-i2v pipeline (WanImageToVideoPipeline cleans prompts "
                f"with ftfy; the first frame is a scikit-image photo): pip install {' '.join(missing)}."
            )
    if args.arch in CLIP_MULTIPLES:
        side = CLIP_MULTIPLES[args.arch]
        for name in ("resolution", "width"):
            if getattr(args, name) is not None and getattr(args, name) % side:
                fail(
                    f"Expected --{name} to be a multiple of {side} for the {args.arch} pipeline (its VAE's stride "
                    f"times the transformer's patch), but got {getattr(args, name)}."
                )


def _request(args: argparse.Namespace) -> BenchRequest:
    """The run the checked options describe; `--modes none` and `--presets none` become no rows."""
    return BenchRequest(
        model=args.model,
        arch=args.arch,
        quick=args.quick,
        layers=args.layers,
        pipeline=args.pipeline,
        resolution=args.resolution,
        batch=args.batch,
        seed=args.seed,
        device=args.device,
        dtype=args.dtype,
        threads=args.threads,
        ratios=tuple(args.ratios),
        modes=tuple(m for m in args.modes if m != "none"),
        presets=tuple(p for p in args.presets if p != "none"),
        with_tomesd=not args.no_tomesd and args.stack is None,  # --stack: its rows and ToMe's, not tomesd's
        rounds=args.rounds,
        warmup=args.warmup,
        measure_memory=not args.no_memory,
        host_cost=not args.no_host_cost,
        progress=not args.no_progress,
        compile=args.compile,
        compile_backend=args.compile_backend,
        trained_quality=not args.no_trained_quality,
        plot_error=args.plot_error,
        json_path=args.json,
        plot_path=args.plot,
        profile_path=args.profile,
        grid_path=args.grid,
        text_encoders=args.text_encoders,
        decode=args.decode,
        cache=args.cache,
        stack=args.stack,
        stack_budget_seconds=STACK_BUDGET_SECONDS if args.pick_steps else None,
        prompt=args.prompt,
        steps=args.steps,
        guidance_scale=args.guidance_scale,
        frames=args.frames,
        width=args.width,
        train=args.train,
        gradient_checkpointing=args.gradient_checkpointing or "off",
        levels=args.levels,
        whole=args.whole,
        hires=args.hires,
        strength=args.strength,
        command="tome-processors " + shlex.join(sys.argv[1:] if args.argv is None else args.argv),
    )


def run(args: argparse.Namespace) -> int:
    """Check the options (exit code 2 for bad ones), then run the benchmark (`bench.run.run_bench`)."""
    parser = getattr(args, "parser", None)
    args.argv = getattr(args, "argv", None)
    if getattr(args, "parallel", None) is not None:
        return _run_parallel(args, parser.error if parser is not None else _exit_2)
    _resolve_defaults(args)
    _check(args, parser.error if parser is not None else _exit_2)
    return run_bench(_request(args))


def _run_parallel(args: argparse.Namespace, fail: Any) -> int:
    """`--parallel SPEC`: the ranks' rows (`bench.parallel`), printed, and written with `--json`."""
    try:
        spec = parse_parallel(args.parallel)
    except ValueError as error:
        fail(str(error))
    arch = args.arch or "wan"
    presets = [p for p in (DEFAULT_PRESETS if args.presets is None else args.presets) if p != "none"]
    device = "cpu" if args.device in ("auto", "cpu") and not torch.cuda.is_available() else args.device
    if device == "auto":
        device = "cuda"
    try:
        rows = run_parallel_bench(
            spec,
            arch,
            presets,
            ratios=args.ratios or (),
            rounds=args.rounds or 3,
            warmup=args.warmup,
            resolution=args.resolution,
            width=args.width,
            frames=args.frames,
            layers=args.layers,
            batch=args.batch or 1,
            seed=args.seed,
            threads=args.threads or 1,
            device=device,
            dtype="float32" if device == "cpu" and args.dtype == "auto" else args.dtype,
            quick=args.quick,
            check_memory=not args.ignore_memory_estimate,
        )
    except ValueError as error:
        fail(str(error))
    except RankDied as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(format_parallel_rows(rows, spec))
    command = "tome-processors " + shlex.join(sys.argv[1:] if args.argv is None else args.argv)
    print(f"\n{command}: {spec.world_size} ranks on {device}, {args.threads or 1} thread(s) each, arch {arch}")
    if args.json:
        with open(args.json, "w") as handle:
            meta = {"command": command, "parallel": str(spec), "arch": arch, "device": device}
            json.dump({"meta": meta, "rows": [asdict(row) for row in rows]}, handle, indent=2)
    return 0


def _exit_2(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)
