"""`tome-processors bench --train`: the rows measured as LoRA training steps instead of forwards.

Every row runs `training.TrainingStep` (forward, noise-prediction MSE, backward, AdamW step of a LoRA on the
attention projections) through the bench's engine (`engine.run_benchmark`): paired interleaved rounds,
seconds per step, speed-up against the baseline's steps around it, peak memory. The error column is the
change of the LoRA gradients of one fixed draw (noise and timesteps from the seed) against the baseline's,
measured after the first group's rounds on the weights the LoRA has then, the same weights for every row.
With gradient checkpointing the rows run again as a second group, paired with a checkpointed baseline.

Example:
    >>> from tome_processors.bench.run import BenchRequest
    >>> run_training(BenchRequest(quick=True, train=True, rounds=1, with_tomesd=False))  # doctest: +SKIP
    | method | ratio | s/step | baseline s/step | speed-up | ...
    0
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .engine import BenchSettings, Method, Row, run_benchmark
from .models import BenchModel
from .training import LORA_TARGETS, TrainingStep, gradient_change
from .unet import make_inputs

__all__ = [
    "CHECKPOINTING",
    "GRADIENT_CHANGE",
    "GradientAnchor",
    "checkpointing_groups",
    "gradient_change_metric",
    "train_rows",
    "training_meta",
]

#: `--gradient-checkpointing` choices: the rows without it, with it, or both groups.
CHECKPOINTING = ("off", "on", "both")
#: The extra column with the LoRA gradient change (percent), also stored as each row's `rel_error`.
GRADIENT_CHANGE = "LoRA grad change %"
#: The LoRA's rank (diffusers' example's default).
LORA_RANK = 4


def checkpointing_groups(choice: str) -> list[bool]:
    """The gradient-checkpointing settings to measure, one group of rows each.

    Example:
        >>> checkpointing_groups("both")
        [False, True]
    """
    groups = {"off": [False], "on": [True], "both": [False, True]}
    if choice not in groups:
        raise ValueError(f"Expected gradient checkpointing among {list(CHECKPOINTING)}, but got {choice!r}.")
    return groups[choice]


class GradientAnchor:
    """The LoRA weights and plain gradients every row's gradient change is measured at, fixed at first use.

    The rows of one run (both checkpointing groups) are measured on these weights, whatever steps ran between.
    """

    def __init__(self, step: TrainingStep, unet: torch.nn.Module) -> None:
        self.step, self.unet = step, unet
        self.weights: list[torch.Tensor] = []
        self.reference: dict[str, torch.Tensor] = {}

    def gradients(self) -> dict[str, torch.Tensor]:
        """The LoRA gradients of the step's fixed draw at the anchored weights (anchored now if not yet)."""
        params = self.step.params
        if not self.weights:
            self.weights = [p.detach().clone() for p in params]
            self.reference = self.step.gradients(self.unet)
        current = [p.detach().clone() for p in params]
        _load(params, self.weights)
        try:
            return self.step.gradients(self.unet)
        finally:
            _load(params, current)


def _load(params: Sequence[torch.nn.Parameter], values: Sequence[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, value in zip(params, values, strict=True):
            p.copy_(value)


def gradient_change_metric(anchor: GradientAnchor) -> Callable[[Method], dict[str, float]]:
    """An `extra_metrics` callable: the method's LoRA gradients of one fixed draw against the plain model's.

    Both at the anchor's weights (`GradientAnchor`), so every row, in either checkpointing group, is measured
    on the same weights.
    """

    def metric(method: Method) -> dict[str, float]:
        if not anchor.weights:
            anchor.gradients()
        method.apply(anchor.unet)
        try:
            grads = anchor.gradients()
        finally:
            method.remove(anchor.unet)
        return {GRADIENT_CHANGE: 100.0 * gradient_change(grads, anchor.reference)}

    return metric


def train_rows(
    bench: BenchModel,
    methods: Sequence[Method],
    settings: BenchSettings,
    batch: int,
    seed: int,
    checkpointing: str = "off",
    extra_metrics: Sequence[Callable[[Method], dict[str, float]]] = (),
) -> list[Row]:
    """Measure every method as LoRA training steps on `bench.model`; one group of rows per checkpointing setting.

    The LoRA is added to `bench.model` here (`training.add_lora`, rank 4, from `seed`). Rows of the
    checkpointed group are named with ` (checkpointing)` and record `gradient_checkpointing` in their settings.
    """
    unet = bench.model
    device, dtype = next(unet.parameters()).device, next(unet.parameters()).dtype
    inputs = make_inputs(unet, batch, bench.resolution, seed=seed, device=device, dtype=dtype)
    step = TrainingStep(unet, inputs, seed=seed, rank=LORA_RANK)
    anchor = GradientAnchor(step, unet)
    rows: list[Row] = []
    for checkpoint in checkpointing_groups(checkpointing):
        step.gradient_checkpointing = checkpoint
        metrics = [gradient_change_metric(anchor), *extra_metrics]

        def combined(method: Method, metrics: list = metrics) -> dict[str, float]:
            return {key: value for metric in metrics for key, value in metric(method).items()}

        group = run_benchmark(unet, methods, step, settings, extra_metrics=combined)
        for row in group:
            change = row.extra[GRADIENT_CHANGE] / 100.0
            name = f"{row.name} (checkpointing)" if checkpoint else row.name
            settings_ = {**row.settings, "gradient_checkpointing": checkpoint}
            rows.append(dataclasses.replace(row, name=name, rel_error=change, settings=settings_))
    unet.disable_gradient_checkpointing()
    return rows


def training_meta(checkpointing: str) -> dict[str, Any]:
    """What one timed run is, for the report's metadata.

    Example:
        >>> training_meta("off")["step"].split(":")[0]
        'one optimizer step'
    """
    return {
        "step": "one optimizer step: draw noise and timesteps (uniform, one per sample, seeded), forward, "
        "noise-prediction MSE, backward, AdamW (lr 1e-4)",
        "lora": f"rank {LORA_RANK} on {', '.join(LORA_TARGETS)} (peft, unet.add_adapter), base weights frozen",
        "gradient_checkpointing": checkpointing,
        "seconds": "per optimizer step",
        "error": "LoRA grad change: ||g - g_baseline|| / ||g_baseline|| of the LoRA gradients of one fixed draw, "
        "on the same weights for every row",
    }
