"""`tome-processors eval`: quality against speed on real prompts, with any number of processes."""

from __future__ import annotations

import argparse
import sys

from ..config import ToMeConfig
from ..evaluate.run import EvalRequest, run_evaluation


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `tome-processors eval`."""
    parser.add_argument("--model", required=True, help="a local diffusers pipeline folder or a hub id")
    parser.add_argument("--prompts", default=None, help="a text file with one prompt per line (default: shipped list)")
    parser.add_argument("--ratios", type=float, nargs="+", default=list(EvalRequest.ratios))
    parser.add_argument("--seeds", type=int, nargs="+", default=list(EvalRequest.seeds))
    parser.add_argument("--mode", choices=["merge", "downsample_kv"], default=EvalRequest.mode)
    parser.add_argument(
        "--clip-model", default=None, help="a transformers CLIP model (folder or hub id) for CLIP scores"
    )
    parser.add_argument("--steps", type=int, default=EvalRequest.steps)
    parser.add_argument("--guidance-scale", type=float, default=EvalRequest.guidance_scale)
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default=EvalRequest.dtype)
    parser.add_argument("--out", default=EvalRequest.out, help="output folder")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N prompts")


def run(args: argparse.Namespace) -> int:
    """Check the options (exit code 2 for bad ones), then run the evaluation (`evaluate.run.run_evaluation`)."""
    if not _valid_ratios(args.ratios):
        print(
            f"error: Expected ratios between 0 and {ToMeConfig().max_ratio:g}, but got {args.ratios}.",
            file=sys.stderr,
        )
        return 2
    return run_evaluation(_request(args))


def _request(args: argparse.Namespace) -> EvalRequest:
    """The evaluation the checked options describe."""
    return EvalRequest(
        model=args.model,
        prompts=args.prompts,
        ratios=tuple(args.ratios),
        seeds=tuple(args.seeds),
        mode=args.mode,
        clip_model=args.clip_model,
        steps=args.steps,
        guidance_scale=args.guidance_scale,
        height=args.height,
        width=args.width,
        dtype=args.dtype,
        out=args.out,
        limit=args.limit,
    )


def _valid_ratios(ratios: list[float]) -> bool:
    return all(0 <= r <= ToMeConfig().max_ratio for r in ratios)
