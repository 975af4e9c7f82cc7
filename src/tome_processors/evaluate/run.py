"""One whole `tome-processors eval` run, from resolved options to the written reports.

The command (`cli.eval_command`) parses and checks the options, fills an `EvalRequest` and calls
`run_evaluation`, which does the rest: the processes (accelerate's `PartialState`), the pipeline, the
configurations, the evaluation (`engine.run_eval`), the run's metadata and the reports (`report`).

Example:
    >>> request = EvalRequest(model="./sd15", ratios=(0.5,), seeds=(0,), limit=2)
    >>> request.steps, request.out
    (20, 'tome-eval')
    >>> run_evaluation(request)  # doctest: +SKIP
    # ToMe quality against speed
    ...
    0
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import PartialState
from diffusers import DiffusionPipeline

from ..bench.meta import dtype_name, machine, resolve_dtype, versions
from .engine import ClipScorer, EvalSettings, eval_configs, load_prompts, run_eval
from .report import write_reports

__all__ = ["EvalRequest", "run_evaluation"]


@dataclass(frozen=True)
class EvalRequest:
    """One evaluation, every option resolved (the defaults are the command's).

    Attributes:
        model: a local diffusers pipeline folder or a hub id.
        prompts: a text file with one prompt per line (None: the shipped list, `engine.load_prompts`).
        ratios: ToMe's merge ratios, one configuration each besides the baseline.
        seeds: every prompt is generated from each seed.
        mode: ToMe's mode for every configuration (`"merge"` or `"downsample_kv"`).
        clip_model: a transformers CLIP model (folder or hub id) for CLIP scores; None: no CLIP scores.
        steps, guidance_scale, height, width: each generation's (None height/width: the pipeline's).
        dtype: `"auto"` or a torch dtype name (`bench.meta.resolve_dtype`).
        out: the output folder.
        limit: use only the first `limit` prompts (None: all).
    """

    model: str
    prompts: str | None = None
    ratios: tuple[float, ...] = (0.3, 0.5, 0.7)
    seeds: tuple[int, ...] = (0, 1)
    mode: str = "merge"
    clip_model: str | None = None
    steps: int = 20
    guidance_scale: float = 7.5
    height: int | None = None
    width: int | None = None
    dtype: str = "auto"
    out: str = "tome-eval"
    limit: int | None = None


def run_evaluation(request: EvalRequest) -> int:
    """Run the evaluation `request` describes, in every process; the main process writes the reports and
    prints the markdown report. Returns the exit code, 0.

    Unlike `engine.run_eval`, which evaluates a pipeline already loaded, this loads the pipeline (and the
    CLIP model) on the process's device first.

    Example:
        >>> run_evaluation(EvalRequest(model="./sd15", limit=4))  # doctest: +SKIP
        # ToMe quality against speed
        ...
        0
    """
    prompts = load_prompts(request.prompts)[: request.limit]
    configs = eval_configs(request.ratios, mode=request.mode)
    state = PartialState(cpu=not torch.cuda.is_available())
    dtype = resolve_dtype(request.dtype, state.device)
    pipe = DiffusionPipeline.from_pretrained(request.model, dtype=dtype).to(state.device)
    pipe.set_progress_bar_config(disable=True)
    scorer = ClipScorer(request.clip_model, state.device) if request.clip_model else None
    settings = EvalSettings(
        prompts=prompts,
        seeds=list(request.seeds),
        configs=configs,
        steps=request.steps,
        guidance_scale=request.guidance_scale,
        height=request.height,
        width=request.width,
    )
    rows = run_eval(pipe, settings, request.out, clip_scorer=scorer, state=state)
    if state.is_main_process:
        meta = {
            "model": request.model,
            "processes": state.num_processes,
            "device": str(state.device),
            "dtype": dtype_name(dtype),
            "steps": request.steps,
            "guidance_scale": request.guidance_scale,
            "seeds": list(request.seeds),
            "prompts": len(prompts),
            "clip_model": request.clip_model,
            "machine": machine(state.device),
            **versions(),
        }
        paths = write_reports(rows, configs, request.out, meta)
        print(Path(paths["report"]).read_text(encoding="utf-8"))
    state.wait_for_everyone()
    return 0
