"""The `tome-processors` command: `bench` (speed against output change), `eval` (quality on real prompts) and
`quality` (the shipped trained denoiser).

Example:
    $ tome-processors bench --quick
    $ tome-processors quality --timesteps 300
    $ python -m tome_processors bench --ratios 0.3 0.5 --rounds 3 --json bench.json
"""

from __future__ import annotations

import argparse
import sys

from . import bench_command, eval_command, quality_command


def build_parser() -> argparse.ArgumentParser:
    """The parser of `tome-processors` with its subcommands."""
    parser = argparse.ArgumentParser(
        prog="tome-processors",
        description="Token Merging for diffusers: benchmark it against the baseline and tomesd, or evaluate it.",
    )
    commands = parser.add_subparsers(dest="command", metavar="{bench,eval,quality}")
    commands.required = True
    bench = commands.add_parser(
        "bench",
        help="side-by-side speed, memory and output change of the baseline, this library and tomesd",
        description=bench_command.__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    bench_command.add_arguments(bench)
    bench.set_defaults(handler=bench_command.run)
    evaluate = commands.add_parser(
        "eval",
        help="image quality (CLIP score, PSNR/SSIM) against speed on real prompts (needs weights)",
        description=eval_command.__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    eval_command.add_arguments(evaluate)
    evaluate.set_defaults(handler=eval_command.run)
    quality = commands.add_parser(
        "quality",
        help="merging measured on the small denoiser trained on photos that ships with the package (offline)",
        description=quality_command.__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    quality_command.add_arguments(quality)
    quality.set_defaults(handler=quality_command.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse `argv` (default: the command line) and run the subcommand; returns its exit code.

    Bad options exit with code 2 and an `error:` line on stderr (argparse's convention).

    Example:
        >>> main(["bench", "--quick", "--json", "bench.json"])  # doctest: +SKIP
        0
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    args.parser, args.argv = parser, argv
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
