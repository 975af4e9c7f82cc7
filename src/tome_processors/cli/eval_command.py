"""`tome-processors eval`: quality against speed on real prompts, with any number of processes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from accelerate import PartialState
from diffusers import DiffusionPipeline

from ..bench.meta import machine, resolve_dtype, versions
from ..config import ToMeConfig
from ..evaluate.engine import ClipScorer, EvalSettings, eval_configs, load_prompts, run_eval
from ..evaluate.report import write_reports


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `tome-processors eval`."""
    parser.add_argument("--model", required=True, help="a local diffusers pipeline folder or a hub id")
    parser.add_argument("--prompts", default=None, help="a text file with one prompt per line (default: shipped list)")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.3, 0.5, 0.7])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--mode", choices=["merge", "downsample_kv"], default="merge")
    parser.add_argument(
        "--clip-model", default=None, help="a transformers CLIP model (folder or hub id) for CLIP scores"
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--guidance-scale", type=float, default=7.5)
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--dtype", choices=["auto", "float32", "float16", "bfloat16"], default="auto")
    parser.add_argument("--out", default="tome-eval", help="output folder")
    parser.add_argument("--limit", type=int, default=None, help="use only the first N prompts")


def run(args: argparse.Namespace) -> int:
    """Run the evaluation; the main process writes the reports. Returns an exit code."""
    prompts = load_prompts(args.prompts)[: args.limit]
    configs = eval_configs(args.ratios, mode=args.mode) if _valid_ratios(args.ratios) else None
    if configs is None:
        print(
            f"error: Expected ratios between 0 and {ToMeConfig().max_ratio:g}, but got {args.ratios}.",
            file=sys.stderr,
        )
        return 2
    state = PartialState(cpu=not torch.cuda.is_available())
    dtype = resolve_dtype(args.dtype, state.device)
    pipe = DiffusionPipeline.from_pretrained(args.model, dtype=dtype).to(state.device)
    pipe.set_progress_bar_config(disable=True)
    scorer = ClipScorer(args.clip_model, state.device) if args.clip_model else None
    settings = EvalSettings(
        prompts=prompts,
        seeds=list(args.seeds),
        configs=configs,
        steps=args.steps,
        guidance_scale=args.guidance_scale,
        height=args.height,
        width=args.width,
    )
    rows = run_eval(pipe, settings, args.out, clip_scorer=scorer, state=state)
    if state.is_main_process:
        meta = {
            "model": args.model,
            "processes": state.num_processes,
            "device": str(state.device),
            "dtype": str(dtype).replace("torch.", ""),
            "steps": args.steps,
            "guidance_scale": args.guidance_scale,
            "seeds": list(args.seeds),
            "prompts": len(prompts),
            "clip_model": args.clip_model,
            "machine": machine(state.device),
            **versions(),
        }
        paths = write_reports(rows, configs, args.out, meta)
        print(Path(paths["report"]).read_text(encoding="utf-8"))
    state.wait_for_everyone()
    return 0


def _valid_ratios(ratios: list[float]) -> bool:
    return all(0 <= r <= ToMeConfig().max_ratio for r in ratios)
