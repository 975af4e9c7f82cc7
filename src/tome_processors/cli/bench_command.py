"""`tome-processors bench`: speed, memory and output change of the baseline, this library and tomesd, side by side.

By default it builds the Stable Diffusion 1.5 UNet architecture with random weights (nothing is downloaded)
and measures one UNet forward at 512 px, batch 2 (a classifier-free-guidance batch), fp32 on CPU or fp16
on CUDA, for every method in interleaved rounds in one process. See docs/bench.md.

Example:
    $ tome-processors bench                       # SD1.5 architecture, 512 px, batch 2
    $ tome-processors bench --quick --json b.json --plot b.png
    $ tome-processors bench --model ./sd15 --pipeline --prompt "a red fox in the snow"
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

_DEFAULT_RATIOS = [0.3, 0.5, 0.7]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `tome-processors bench`."""
    from ..bench_methods import DEFAULT_MODES, MODES  # noqa: PLC0415

    what = parser.add_argument_group("what to measure")
    what.add_argument("--model", default=None, help="a local diffusers folder (pipeline or unet) or a hub id")
    what.add_argument(
        "--arch",
        choices=["sd15", "sd2", "sdxl", "pixart", "sd3", "flux"],
        default=None,
        help="a real UNet or diffusion-transformer architecture with random weights (default sd15 when no --model)",
    )
    what.add_argument("--quick", action="store_true", help="a tiny architecture that finishes in seconds")
    what.add_argument("--resolution", type=int, default=None, help="image side in pixels (default: the model's)")
    what.add_argument("--batch", type=int, default=2, help="UNet batch size (2 = one image with CFG)")
    what.add_argument("--ratios", type=float, nargs="+", default=_DEFAULT_RATIOS, help="merge ratios")
    modes = ", ".join(f"{name} ({spec.help})" for name, spec in MODES.items())
    what.add_argument(
        "--modes",
        nargs="+",
        default=list(DEFAULT_MODES),
        metavar="MODE",
        help=f"modes beyond tomesd to add as rows, or 'none': {modes}",
    )
    what.add_argument("--no-tomesd", action="store_true", help="leave tomesd out even when it is installed")
    what.add_argument(
        "--no-trained-quality",
        action="store_true",
        help="skip the columns measured on the shipped trained denoiser (UNet methods only)",
    )

    how = parser.add_argument_group("how to measure")
    how.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5, 3 with --quick)")
    how.add_argument("--warmup", type=int, default=1, help="untimed forwards per method first")
    how.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, mps")
    how.add_argument(
        "--dtype",
        choices=["auto", "float32", "float16", "bfloat16"],
        default="auto",
        help="auto: float16 on CUDA, float32 elsewhere",
    )
    how.add_argument("--seed", type=int, default=0, help="seed of the random weights and inputs")
    how.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    how.add_argument("--no-memory", action="store_true", help="skip the peak-memory forwards")
    how.add_argument("--no-progress", action="store_true", help="no progress bar")

    out = parser.add_argument_group("output")
    out.add_argument("--json", default=None, metavar="PATH", help="write every row and the run's metadata here")
    out.add_argument("--plot", default=None, metavar="PATH", help="write a PNG of speed-up against output error")
    out.add_argument(
        "--plot-error",
        choices=["random", "trained"],
        default="random",
        help="the plot's x axis: the random-weight output error, or the trained denoiser's noise-prediction change",
    )

    gen = parser.add_argument_group("full generations (need real weights: --model)")
    gen.add_argument("--pipeline", action="store_true", help="generate one prompt per method and save a grid")
    gen.add_argument("--prompt", default="a photo of an astronaut riding a horse on mars")
    gen.add_argument("--steps", type=int, default=20, help="denoising steps per generation")
    gen.add_argument("--guidance-scale", type=float, default=7.5)
    gen.add_argument("--grid", default="tome-bench-grid.png", metavar="PATH", help="where to save the image grid")


def _check(args: argparse.Namespace, fail: Any) -> None:
    """Every option combination that cannot work: `fail(message)` exits with code 2."""
    from ..bench_methods import MODES, tomesd_available  # noqa: PLC0415
    from ..config import ToMeConfig  # noqa: PLC0415

    cap = ToMeConfig().max_ratio
    if not all(0.0 < r <= cap for r in args.ratios):
        fail(f"Expected --ratios between 0 (exclusive) and {cap:g}, but got {args.ratios}.")
    if len(set(args.ratios)) != len(args.ratios):
        fail(f"Expected distinct --ratios, but got {args.ratios}.")
    modes = [m for m in args.modes if m != "none"]
    unknown = [m for m in modes if m not in MODES]
    if unknown or ("none" in args.modes and len(args.modes) > 1):
        fail(f"Expected --modes among {sorted(MODES)}, or 'none' alone, but got {args.modes}.")
    if args.model is not None and (args.arch is not None or args.quick):
        fail("Expected either --model or --arch/--quick, but got both.")
    if args.resolution is not None and (args.resolution < 16 or args.resolution % 8):
        fail(f"Expected --resolution to be a multiple of 8 and >= 16, but got {args.resolution}.")
    if args.threads is not None and args.threads < 1:
        fail(f"Expected --threads >= 1, but got {args.threads}.")
    for name in ("batch", "warmup", "steps"):
        if getattr(args, name) < 1:
            fail(f"Expected --{name} >= 1, but got {getattr(args, name)}.")
    if args.rounds is not None and args.rounds < 1:
        fail(f"Expected --rounds >= 1, but got {args.rounds}.")
    if args.pipeline and args.model is None:
        fail("Expected --model with --pipeline: full generations need real weights (a pipeline folder or hub id).")
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        fail("Expected matplotlib for --plot, but it is not installed: pip install 'tome-processors[plot]'.")
    if not args.no_memory and _device(args.device).type == "cpu" and importlib.util.find_spec("psutil") is None:
        fail("Expected psutil to measure CPU memory, but it is not installed: pip install psutil, or --no-memory.")
    if args.device != "auto":
        try:
            device = torch.device(args.device)
        except RuntimeError:
            fail(f"Expected --device auto, cpu, cuda[:N] or mps, but got {args.device!r}.")
        if device.type == "cuda" and not torch.cuda.is_available():
            fail("Expected a CUDA device for --device cuda, but torch sees none.")
        if device.type == "mps" and not torch.backends.mps.is_available():
            fail("Expected an MPS device for --device mps, but torch sees none.")
    if args.no_tomesd is False and not tomesd_available():
        print("note: tomesd is not installed (pip install tomesd), so its rows are left out.", file=sys.stderr)


def _device(name: str) -> torch.device:
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _meta(args: argparse.Namespace, device: torch.device, dtype: torch.dtype, model: str, resolution: int) -> dict:
    accelerator = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    return {
        "command": "tome-processors " + shlex.join(sys.argv[1:] if args.argv is None else args.argv),
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "model": model,
        "resolution": resolution,
        "batch": args.batch,
        "device": str(device),
        "dtype": str(dtype).replace("torch.", ""),
        "rounds": args.rounds,
        "warmup": args.warmup,
        "machine": f"{platform.platform()}; {accelerator}; {os.cpu_count()} CPUs",
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "diffusers": _version("diffusers"),
        "tomesd": _version("tomesd"),
        "tome_processors": _version("tome-processors"),
        "memory": "CUDA allocator peak" if device.type == "cuda" else "peak resident set (psutil, sampled every 1 ms)",
    }


def _build(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> tuple[Any, Any, str]:
    """(unet, pipeline or None, model description)."""
    from ..bench_models import build_unet, load_unet  # noqa: PLC0415
    from ..bench_transformers import TRANSFORMER_ARCHITECTURES, build_transformer  # noqa: PLC0415

    if args.model is None and args.arch in TRANSFORMER_ARCHITECTURES:
        model = build_transformer(args.arch, quick=args.quick, seed=args.seed).to(device, dtype)
        return model, None, f"{args.arch}{' (tiny)' if args.quick else ''} architecture, random weights"
    if args.model is None:
        arch = args.arch or "sd15"
        if args.quick:
            arch = "tiny-sdxl" if arch == "sdxl" else "tiny"
        unet = build_unet(arch, seed=args.seed).to(device)
        return (unet if dtype == torch.float32 else unet.to(dtype)), None, f"{arch} architecture, random weights"
    if args.pipeline:
        from diffusers import DiffusionPipeline  # noqa: PLC0415

        pipe = DiffusionPipeline.from_pretrained(args.model, dtype=dtype).to(device)
        if not isinstance(getattr(pipe, "unet", None), torch.nn.Module):
            raise SystemExit(f"error: Expected a pipeline with a UNet in {args.model}, but got {type(pipe).__name__}.")
        return pipe.unet.eval(), pipe, args.model
    return load_unet(args.model, dtype).to(device), None, args.model


def _methods(args: argparse.Namespace, auto_downsample: int, family: Any = None) -> list:
    from ..bench_methods import (  # noqa: PLC0415
        MODES,
        baseline_method,
        mode_methods,
        ours_methods,
        tomesd_available,
        tomesd_methods,
    )

    methods = [baseline_method(), *ours_methods(args.ratios, auto_downsample)]
    unet = family is None or family.name == "unet"
    if unet and not args.no_tomesd and tomesd_available():  # tomesd patches UNet blocks only
        methods += tomesd_methods(args.ratios, max_downsample=auto_downsample)
    modes = [m for m in args.modes if m != "none"]
    if family is not None and family.merge_only:  # joint attention: no K/V pooling (docs/transformers.md)
        skipped = [m for m in modes if MODES[m].options.get("mode", "merge") != "merge"]
        modes = [m for m in modes if m not in skipped]
        if skipped:
            print(f"note: modes {skipped} do not apply to {family.name} and are left out.", file=sys.stderr)
    return methods + mode_methods(modes, args.ratios, auto_downsample)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print the table, write the optional files. Returns an exit code."""
    from diffusers.models.attention_processor import AttnProcessor2_0  # noqa: PLC0415

    from ..bench_models import make_inputs  # noqa: PLC0415
    from ..bench_quality import TRAINED_EPS_CHANGE  # noqa: PLC0415
    from ..bench_report import markdown_table, meta_lines, save_json, save_plot  # noqa: PLC0415
    from ..bench_transformers import QUICK_TEXT_TOKENS, make_transformer_inputs  # noqa: PLC0415
    from ..benchmark import BenchSettings, run_benchmark  # noqa: PLC0415
    from ..families import (
        attention_levels,  # noqa: PLC0415
        find_family,  # noqa: PLC0415
    )

    parser = getattr(args, "parser", None)
    args.argv = getattr(args, "argv", None)
    _check(args, parser.error if parser is not None else _exit_2)
    if args.rounds is None:
        args.rounds = 3 if args.quick else 5
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = _device(args.device)
    dtype = _dtype(args.dtype, device)

    unet, pipe, model = _build(args, device, dtype)
    family = find_family(unet)
    transformer = family is not None and family.name != "unet"
    if not transformer:  # diffusion transformers keep their own processors (SD3 and Flux need them)
        unet.set_attn_processor(AttnProcessor2_0())
    sample_size = getattr(unet.config, "sample_size", None) or 128  # Flux has none: 1024 px
    sample_size = sample_size[0] if isinstance(sample_size, (list, tuple)) else sample_size
    resolution = args.resolution or (128 if args.quick else int(sample_size) * 8)
    if transformer:
        text_tokens = QUICK_TEXT_TOKENS if args.quick else None
        inputs = make_transformer_inputs(
            unet, family.name, args.batch, resolution, args.seed, device, dtype, text_tokens=text_tokens
        )
    else:
        inputs = make_inputs(unet, args.batch, resolution, seed=args.seed, device=device, dtype=dtype)
    levels = attention_levels(unet)
    methods = _methods(args, min(levels) if levels else 1, family)

    settings = BenchSettings(
        rounds=args.rounds, warmup=args.warmup, measure_memory=not args.no_memory, progress=not args.no_progress
    )
    extra_metrics = None
    if not (args.no_trained_quality or transformer):
        if importlib.util.find_spec("skimage") is None:
            print('note: the trained-denoiser columns need scikit-image: pip install "tome-processors[bench]".')
        else:
            from ..bench_quality import trained_quality_metrics  # noqa: PLC0415

            extra_metrics = trained_quality_metrics()
    elif args.plot_error == "trained":
        print("note: --plot-error trained needs the trained-quality columns; plotting the random-weight error.")
    rows = run_benchmark(unet, methods, lambda: inputs.run(unet), settings, extra_metrics=extra_metrics)
    meta = _meta(args, device, dtype, model, resolution)

    print(markdown_table(rows))
    print()
    print(meta_lines(meta))
    if args.json:
        print(f"JSON: {save_json(rows, meta, args.json)}")
    if args.plot:
        title = f"{model}, {resolution} px, batch {args.batch}, {meta['dtype']} on {device.type}"
        error_key = TRAINED_EPS_CHANGE if args.plot_error == "trained" and extra_metrics is not None else None
        print(f"plot: {save_plot(rows, args.plot, title, error_key=error_key)}")
    if pipe is not None:
        from ..bench_pipeline import generate_grid  # noqa: PLC0415

        results = generate_grid(
            pipe, methods, args.prompt, args.grid, args.steps, args.guidance_scale, resolution, args.seed
        )
        print()
        print("| method | s/image |\n|---|---|")
        print("\n".join(f"| {name} | {seconds:.2f} |" for name, seconds in results))
        print(f"grid: {args.grid}")
    return 0


def _exit_2(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def main(argv: list[str] | None = None) -> int:
    """`python -m tome_processors.cli.bench_command ...`, the same as `tome-processors bench ...`."""
    parser = argparse.ArgumentParser(prog="tome-processors bench", description=__doc__)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.parser, args.argv = parser, ["bench", *(sys.argv[1:] if argv is None else argv)]
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
