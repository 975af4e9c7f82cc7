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

#: The subcommands: name, the module with their `add_arguments` and `run`, one line of help.
COMMANDS = (
    ("bench", bench_command, "side-by-side speed, memory and output change of the baseline, this library and tomesd"),
    ("eval", eval_command, "image quality (CLIP score, PSNR/SSIM) against speed on real prompts (needs weights)"),
    (
        "quality",
        quality_command,
        "merging measured on the small trained denoisers that ship with the package (offline)",
    ),
)


def build_parser() -> argparse.ArgumentParser:
    """The parser of `tome-processors` with its subcommands."""
    parser = argparse.ArgumentParser(
        prog="tome-processors",
        description="Token Merging for diffusers: benchmark it against the baseline and tomesd, or evaluate it.",
    )
    commands = parser.add_subparsers(dest="command", metavar="{" + ",".join(name for name, _, _ in COMMANDS) + "}")
    commands.required = True
    for name, module, summary in COMMANDS:
        command = commands.add_parser(
            name, help=summary, description=module.__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
        )
        module.add_arguments(command)
        command.set_defaults(handler=module.run)
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
