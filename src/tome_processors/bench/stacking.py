"""ToMe stacked with another accelerator as bench rows: `tome-processors bench --pipeline --stack deepcache`.

DeepCache reuses the deep UNet levels' features on most denoising steps and runs only a shallow branch on
them; ToMe makes the attention that still runs cheaper. The two act on different parts of the work, so their
speed-ups can multiply. The bench times DeepCache alone and DeepCache with each ToMe row it was given, next to
ToMe alone and the plain pipeline, over whole generations (`generate.time_generations`), and `stacking_summary`
sets the pair's per-image speed-up beside the product of the two alone.

DeepCache (`deepcache`, imported as `DeepCache`) is an optional dependency (`pip install "tome-processors[bench]"`):
without it `stack_methods` returns no rows and says why.

Example:
    >>> sorted(STACKS)
    ['deepcache']
    >>> stack_methods("deepcache", pipe, [balanced])  # doctest: +SKIP
    [Method(name='DeepCache', ...), Method(name='DeepCache + ours balanced', ...)]
"""

from __future__ import annotations

import importlib.util
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .engine import BenchSettings, Method, _schedule, with_tome_rows
from .generate import DenoiserTimer, generate_image, pipeline_call_kwargs

__all__ = [
    "DEEPCACHE_BRANCH",
    "DEEPCACHE_INTERVAL",
    "STACKS",
    "STACK_BUDGET_SECONDS",
    "StackPick",
    "generations_in_run",
    "missing_stack",
    "PICK_SCALES",
    "PICK_STEPS",
    "pick_steps",
    "stack_methods",
    "stacking_summary",
    "stacking_table",
]

#: DeepCache's settings in the bench: a full UNet forward every 3rd step, the shallowest skip branch on the others
#: (DeepCache's own example for Stable Diffusion).
DEEPCACHE_INTERVAL = 3
DEEPCACHE_BRANCH = 0
#: `--stack` without `--steps` picks the step count so that the whole run takes at most this long.
STACK_BUDGET_SECONDS = 15 * 60


@dataclass(frozen=True)
class StackSpec:
    """One accelerator `--stack` offers: its row label, the module it needs and a line for the help."""

    label: str
    module: str
    install: str
    help: str


#: The accelerators `--stack` offers.
STACKS: dict[str, StackSpec] = {
    "deepcache": StackSpec(
        "DeepCache",
        "DeepCache",
        'pip install "tome-processors[bench]" (or deepcache==0.1.1)',
        f"DeepCache, cache interval {DEEPCACHE_INTERVAL}, skip branch {DEEPCACHE_BRANCH}",
    ),
}


def missing_stack(name: str) -> str | None:
    """Why `--stack name` cannot run here (its package is not installed), or None when it can.

    Example:
        >>> missing_stack("deepcache") in (None, 'DeepCache is not installed: pip install "tome-processors[bench]" '
        ...                                '(or deepcache==0.1.1)')
        True
    """
    spec = _spec(name)
    if importlib.util.find_spec(spec.module) is None:
        return f"{spec.label} is not installed: {spec.install}"
    return None


def _spec(name: str) -> StackSpec:
    if name not in STACKS:
        raise ValueError(f"Expected a stack among {sorted(STACKS)}, but got {name!r}.")
    return STACKS[name]


def stack_methods(name: str, pipe: Any, tome_methods: Sequence[Method]) -> list[Method]:
    """Rows for accelerator `name` on `pipe`: the accelerator alone, then with each of `tome_methods`.

    Each pair puts ToMe on first and the accelerator second, and takes them off in the reverse order (either order
    gives the same images: tests/test_stacking.py). DeepCache wraps the pipeline's UNet, so `pipe` must be a
    Stable Diffusion (1.x, 2.x, XL) pipeline whose denoiser is a `UNet2DConditionModel`.

    Example:
        >>> [m.name for m in stack_methods("deepcache", pipe, [balanced])]  # doctest: +SKIP
        ['DeepCache', 'DeepCache + ours balanced']
    """
    spec = _spec(name)
    missing = missing_stack(name)
    if missing is not None:
        raise ValueError(f"Expected {spec.label} for stack={name!r}, but {missing}.")
    unet = getattr(pipe, "unet", None)
    if type(unet).__name__ != "UNet2DConditionModel":
        raise ValueError(
            f"Expected a pipeline with a UNet2DConditionModel for stack={name!r}, but got {type(pipe).__name__} "
            f"with {type(unet).__name__}."
        )
    from DeepCache import DeepCacheSDHelper

    helper = DeepCacheSDHelper(pipe=pipe)
    helper.set_params(cache_interval=DEEPCACHE_INTERVAL, cache_branch_id=DEEPCACHE_BRANCH)

    def enable(model: torch.nn.Module) -> None:
        if model is not pipe.unet:  # DeepCache acts on the pipeline's own UNet, whatever it is handed
            raise ValueError(f"Expected the pipeline's UNet for {spec.label}, but got {type(model).__name__}.")
        helper.enable()

    def disable(_: torch.nn.Module) -> None:
        helper.disable()

    settings = {"stack": spec.help, "cache_interval": DEEPCACHE_INTERVAL, "cache_branch_id": DEEPCACHE_BRANCH}
    alone = Method(spec.label, "stack", None, enable, disable, settings=settings)
    return with_tome_rows(alone, tome_methods, "stack + ours")


def generations_in_run(methods: int, settings: BenchSettings) -> int:
    """How many whole generations `time_generations` makes for `methods` rows (the baseline among them): the
    reference, the warm-up rounds, the timed rounds (with the baseline runs between groups) and, when memory is
    measured, one inspection per row.

    Example:
        >>> generations_in_run(4, BenchSettings(rounds=3, warmup=1))
        24
    """
    # The engine's own schedule, so that the count cannot drift from what it runs.
    runs = sum(len(_schedule(methods, r, settings.baseline_every, False)) for r in range(settings.warmup))
    runs += sum(len(_schedule(methods, r, settings.baseline_every, True)) for r in range(settings.rounds))
    return 1 + runs + (methods if settings.measure_memory else 0)


@dataclass(frozen=True)
class StackPick:
    """The image size and step count `pick_steps` chose, and what they rest on.

    Attributes:
        resolution: image side in pixels.
        steps: denoising steps per generation.
        fixed_seconds: one plain generation's time outside the denoiser (text encoders, VAE decode, scheduler) at
            `resolution`, scaled from the timed one by the pixel count.
        step_seconds: one plain denoiser call at `resolution`, scaled the same way.
        generations: generations in the run (`generations_in_run`).
        estimate_seconds: the run's estimated time from the command's start, every generation costed as a plain one.
        budget_seconds: what it had to fit in.
    """

    resolution: int
    steps: int
    fixed_seconds: float
    step_seconds: float
    generations: int
    estimate_seconds: float
    budget_seconds: float

    def describe(self) -> str:
        """One line for the report.

        Example:
            >>> StackPick(384, 12, 4.0, 2.0, 24, 800.0, 900.0).describe()[:48]
            '384 px, 12 steps: a plain generation is costed a'
        """
        fits = "fits" if self.estimate_seconds <= self.budget_seconds else "does NOT fit"
        return (
            f"{self.resolution} px, {self.steps} steps: a plain generation is costed at {self.fixed_seconds:.1f} s "
            f"outside the denoiser and {self.step_seconds:.2f} s per denoiser call, so {self.generations} "
            f"generations at {self.estimate_seconds / 60:.1f} min in all from the start, which {fits} "
            f"{self.budget_seconds / 60:.0f} min"
        )


#: `pick_steps`' step counts, most first: the bench's default (20) down to a few full-and-partial cycles of DeepCache.
PICK_STEPS = (20, 15, 12, 9)
#: `pick_steps`' image sizes, as fractions of the model's own (each rounded down to a multiple of 64 px).
PICK_SCALES = (1.0, 0.75, 0.5)


def pick_steps(
    pipe: Any,
    prompt: str,
    guidance_scale: float,
    resolution: int,
    seed: int,
    generations: int,
    budget_seconds: float,
    elapsed_seconds: float = 0.0,
    call_kwargs: dict[str, Any] | None = None,
) -> StackPick:
    """The largest image size, then the most steps, whose run of `generations` generations fits `budget_seconds`.

    Sizes: `resolution` (the model's own) and `PICK_SCALES` of it; steps: `PICK_STEPS`. One untimed generation of
    one step at the smallest size warms the pipeline up (a model's first forwards on a CPU are several times slower
    than the later ones); then one generation of `DEEPCACHE_INTERVAL` steps at `resolution` is timed, the denoiser's
    calls apart from the rest (text encoders, VAE decode). A smaller size is costed by its pixel count, every
    generation of the run at plain speed (the methods only make it shorter), after `elapsed_seconds` already spent
    and this calibration. None fitting, the smallest size with the fewest steps is taken (and `describe` says it does
    not fit).

    Example:
        >>> pick = pick_steps(pipe, "a cat", 7.5, 512, 0, generations=24, budget_seconds=900)  # doctest: +SKIP
        >>> pick.resolution, pick.steps  # doctest: +SKIP
        (384, 12)
    """
    started = time.perf_counter()
    sizes = sorted({max(64, int(resolution * scale) // 64 * 64) for scale in PICK_SCALES} | {resolution}, reverse=True)
    kwargs = {**pipeline_call_kwargs(pipe), **(call_kwargs or {})}
    generate_image(pipe, prompt, seed, 1, guidance_scale, sizes[-1], sizes[-1], **kwargs)  # warm-up, untimed
    with DenoiserTimer(pipe.unet) as timer:
        _, total = generate_image(
            pipe, prompt, seed, DEEPCACHE_INTERVAL, guidance_scale, resolution, resolution, **kwargs
        )
    step_seconds = timer.seconds / max(timer.calls, 1)
    fixed_seconds = max(total - timer.seconds, 0.0)
    calls_per_step = timer.calls / DEEPCACHE_INTERVAL  # PNDM makes one more denoiser call than steps
    spent = elapsed_seconds + time.perf_counter() - started

    def pick(size: int, steps: int) -> StackPick:
        scale = (size / resolution) ** 2
        fixed, step = fixed_seconds * scale, step_seconds * scale
        estimate = spent + generations * (fixed + math.ceil(steps * calls_per_step) * step)
        return StackPick(size, steps, fixed, step, generations, estimate, budget_seconds)

    candidates = [pick(size, steps) for size in sizes for steps in PICK_STEPS]
    return next((c for c in candidates if c.estimate_seconds <= budget_seconds), candidates[-1])


def _row_value(row: Any, key: str) -> Any:
    return row[key] if isinstance(row, dict) else getattr(row, key)


def stacking_summary(rows: Sequence[Any], label: str) -> list[dict[str, Any]]:
    """Per pair row (`"{label} + {tome row}"`): each speed-up alone, their product, the pair's and its ratio to the
    product, per image and per step, with the image change of each (against the plain pipeline's image).

    `rows` are `generate.GenerationRow`s (or their JSON dicts). A pair whose ToMe row is absent is left out.

    Example:
        >>> from tome_processors.bench.generate import GenerationRow
        >>> rows = [GenerationRow("baseline", "baseline", None, 10.0, 1.0, 0.5, 1.0, 0.0, 21),
        ...         GenerationRow("ours balanced", "ours balanced", None, 8.0, 1.25, 0.4, 1.25, 0.01, 21),
        ...         GenerationRow("DeepCache", "stack", None, 5.0, 2.0, 0.25, 2.0, 0.02, 21),
        ...         GenerationRow("DeepCache + ours balanced", "stack + ours", None, 4.0, 2.5, 0.2, 2.5, 0.025, 21)]
        >>> summary = stacking_summary(rows, "DeepCache")[0]
        >>> summary["product_per_image"], summary["pair_per_image"], summary["ratio_per_image"]
        (2.5, 2.5, 1.0)
    """
    by_name = {_row_value(row, "name"): row for row in rows}
    alone = by_name.get(label)
    if alone is None:
        return []
    summary = []
    prefix = f"{label} + "
    for name, pair in by_name.items():
        tome = by_name.get(name[len(prefix) :]) if name.startswith(prefix) else None
        if tome is None:
            continue
        entry: dict[str, Any] = {"pair": name, "tome": _row_value(tome, "name"), "accelerator": label}
        for unit in ("image", "step"):
            key = f"speedup_per_{unit}"
            a, b, both = _row_value(tome, key), _row_value(alone, key), _row_value(pair, key)
            entry[f"tome_per_{unit}"], entry[f"accelerator_per_{unit}"] = a, b
            entry[f"product_per_{unit}"], entry[f"pair_per_{unit}"] = a * b, both
            entry[f"ratio_per_{unit}"] = both / (a * b)
        entry["tome_change"] = _row_value(tome, "image_change")
        entry["accelerator_change"] = _row_value(alone, "image_change")
        entry["pair_change"] = _row_value(pair, "image_change")
        summary.append(entry)
    return summary


def stacking_table(summary: Sequence[dict[str, Any]]) -> str:
    """A markdown table of `stacking_summary`: per image and per step, the two alone, their product, the pair,
    and the pair's ratio to the product; then the image change of each against the plain pipeline's image.

    Example:
        >>> entry = {"pair": "DeepCache + ours balanced", "tome": "ours balanced", "accelerator": "DeepCache",
        ...          "tome_per_image": 1.25, "accelerator_per_image": 2.0, "product_per_image": 2.5,
        ...          "pair_per_image": 2.4, "ratio_per_image": 0.96, "tome_per_step": 1.3,
        ...          "accelerator_per_step": 2.5, "product_per_step": 3.25, "pair_per_step": 3.3,
        ...          "ratio_per_step": 1.015, "tome_change": 0.01, "accelerator_change": 0.02, "pair_change": 0.025}
        >>> print(stacking_table([entry]).splitlines()[2])
        | DeepCache + ours balanced | image | 1.25x | 2.00x | 2.50x | 2.40x | 0.96 | 1.00 | 2.00 | 2.50 |
    """
    lines = [
        "| pair | per | ToMe alone | accelerator alone | product of the two | pair | pair / product "
        "| ToMe change % | accelerator change % | pair change % |",
        "|" + "---|" * 10,
    ]
    for entry in summary:
        for unit in ("image", "step"):
            changes = [f"{100 * entry[key]:.2f}" for key in ("tome_change", "accelerator_change", "pair_change")]
            if unit == "step":
                changes = ["", "", ""]  # one image per generation: the changes stand on the image line
            cells = [
                entry["pair"],
                unit,
                *(f"{entry[f'{key}_per_{unit}']:.2f}x" for key in ("tome", "accelerator", "product", "pair")),
                f"{entry[f'ratio_per_{unit}']:.2f}",
                *changes,
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
