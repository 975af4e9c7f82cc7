"""`tome-processors quality`: token merging measured on the small denoisers trained on photos that ship with
the package (a UNet, a PixArt-shaped DiT, a FLUX-shaped joint-attention DiT and a Wan-shaped video DiT), on
held-out crops and clips; prints a markdown report (docs/quality.md).

Example:
    $ tome-processors quality --threads 1
    $ tome-processors quality --denoiser video --timesteps 300
    $ tome-processors quality --presets            # every family's presets against their bounds
"""

from __future__ import annotations

import argparse
import sys

import torch

from ..bench.presets import MEASURED_FAMILIES, preset_quality, preset_table
from ..bench.quality import DEFAULT_TIMESTEPS, DENOISERS, report


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `tome-processors quality`."""
    parser.add_argument(
        "--per-image",
        type=int,
        default=2,
        help="held-out crops per photo (the video model: clips per photo and motion)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the crop positions and the noise")
    parser.add_argument(
        "--timesteps", type=int, nargs="+", default=list(DEFAULT_TIMESTEPS), help="noise levels to measure at"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument(
        "--denoiser",
        choices=[*DENOISERS, "all"],
        default="all",
        help="which shipped denoiser to report on (default: all of them)",
    )
    parser.add_argument(
        "--presets",
        nargs="*",
        default=None,
        metavar="FAMILY",
        help="instead: the presets of these families (default: all) on the trained model of their shape, "
        "one forward and whole 20-step runs, against the presets' quality bounds",
    )


def run(args: argparse.Namespace) -> int:
    """Print the report. Returns an exit code (2 for bad options)."""
    if args.per_image < 1 or (args.threads is not None and args.threads < 1):
        print(f"error: Expected --per-image and --threads >= 1, but got {args.per_image} and {args.threads}.",
              file=sys.stderr)  # fmt: skip
        return 2
    if not all(0 <= t < 1000 for t in args.timesteps):
        print(f"error: Expected --timesteps between 0 and 999, but got {args.timesteps}.", file=sys.stderr)
        return 2
    if args.presets is not None and any(f not in MEASURED_FAMILIES for f in args.presets):
        print(f"error: Expected --presets among {sorted(MEASURED_FAMILIES)}, but got {args.presets}.", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.presets is not None:
        print(preset_table(preset_quality(args.presets or list(MEASURED_FAMILIES))))
        return 0
    names = list(DENOISERS) if args.denoiser == "all" else [args.denoiser]
    print("\n\n".join(report(args.per_image, args.seed, args.timesteps, name) for name in names))
    return 0
