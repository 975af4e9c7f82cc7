"""diffusers' step caches as bench rows: `tome-processors bench --pipeline --cache NAME`.

A step cache (First Block Cache, TaylorSeer, Pyramid Attention Broadcast, MagCache) skips whole blocks or
attention calls on some denoising steps; ToMe makes the blocks that still run cheaper. The two act on
different axes, so the bench times the cache alone, and the cache with each ToMe row it was given, next to
ToMe alone and the baseline.

First Block Cache and TaylorSeer (diffusers' defaults, which predict the attention modules' outputs, and its lite
mode, which skips whole blocks) are offered (`CACHES`). They are diffusers' own (`model.enable_cache(config)`,
`model.disable_cache()`), so only a denoiser with diffusers' `CacheMixin` (FLUX.1 and most newer transformers;
not the UNets, PixArt, SD3 or Z-Image) takes them, and only a pipeline that opens a cache context around its
denoiser calls runs them (`opens_cache_context`; in diffusers 0.42.1 FLUX.1's, Qwen-Image's, Wan's and
LTX-Video's do, FLUX.2's and Chroma's do not). Their quality is measured on whole sampling runs of the trained
FLUX-shaped model (`cache_quality`).

Example:
    >>> sorted(CACHES)
    ['fbc', 'taylorseer', 'taylorseer-lite']
    >>> cache_methods("fbc", pipe, [baseline, balanced])  # doctest: +SKIP
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig
from diffusers.models.cache_utils import CacheMixin

from .engine import Method, with_tome_rows
from .photos import heldout_crops
from .quality import load_denoiser
from .sampling import SamplingProbe

__all__ = [
    "CACHES",
    "CacheSpec",
    "cache_config",
    "cache_methods",
    "cache_quality",
    "cache_quality_table",
    "opens_cache_context",
    "supports_caches",
]


@dataclass(frozen=True)
class CacheSpec:
    """One of diffusers' caches as the bench sets it up: its label and how to build its config.

    `build` takes a callable that returns the pipeline's current timestep (for caches that decide per step
    from it).
    """

    label: str
    build: Callable[[Callable[[], Any]], Any]
    help: str


#: The caches `--cache` offers. Left out: MagCache (it needs magnitude ratios calibrated on the real model's
#: weights), Pyramid Attention Broadcast (not yet measured with ToMe), FasterCache (it fails on FLUX.1 with or
#: without ToMe).
CACHES: dict[str, CacheSpec] = {
    "fbc": CacheSpec(
        "FirstBlockCache", lambda _: FirstBlockCacheConfig(threshold=0.2), "First Block Cache, threshold 0.2"
    ),
    "taylorseer": CacheSpec("TaylorSeer", lambda _: TaylorSeerCacheConfig(), "TaylorSeer, diffusers' defaults"),
    # Lite: whole blocks skipped on the predicted steps (only the output projection is predicted), so every block
    # that runs runs on a computed step, where ToMe's saving counts in full.
    "taylorseer-lite": CacheSpec(
        "TaylorSeer lite",
        lambda _: TaylorSeerCacheConfig(use_lite_mode=True),
        "TaylorSeer's lite mode: blocks skipped, the output projection predicted",
    ),
}


def supports_caches(model: torch.nn.Module) -> bool:
    """Whether `model` takes diffusers' caches (`enable_cache`), i.e. has diffusers' `CacheMixin`.

    Example:
        >>> supports_caches(torch.nn.Linear(1, 1))
        False
    """
    return isinstance(model, CacheMixin)


def opens_cache_context(pipe: Any) -> bool:
    """Whether `pipe`'s `__call__` opens a cache context (`transformer.cache_context(...)`) around its denoiser
    calls: diffusers' caches keep their state per context and fail without one. Read from the source; a pipeline
    whose source cannot be read is assumed to open one.

    Example:
        >>> from diffusers import Flux2Pipeline, FluxPipeline
        >>> opens_cache_context(FluxPipeline), opens_cache_context(Flux2Pipeline)
        (True, False)
    """
    call = pipe.__call__ if isinstance(pipe, type) else type(pipe).__call__
    try:
        return "cache_context(" in inspect.getsource(call)
    except (OSError, TypeError):
        return True


def cache_config(name: str, pipe: Any) -> Any:
    """The diffusers config of cache `name` for `pipe` (whose `current_timestep` a cache may read).

    Example:
        >>> type(cache_config("fbc", None)).__name__
        'FirstBlockCacheConfig'
    """
    if name not in CACHES:
        raise ValueError(f"Expected a cache among {sorted(CACHES)}, but got {name!r}.")

    def timestep() -> Any:
        current = getattr(pipe, "current_timestep", None)
        return 1000 if current is None else current  # outside a generation: no skipping window matches

    return CACHES[name].build(timestep)


def cache_methods(name: str, pipe: Any, tome_methods: Sequence[Method]) -> list[Method]:
    """Rows for cache `name` on `pipe`'s denoiser: the cache alone, then the cache with each of `tome_methods`.

    The cache goes on after ToMe and comes off before it (either order works; tests/test_caches.py).

    Example:
        >>> [m.name for m in cache_methods("fbc", pipe, [balanced])]  # doctest: +SKIP
        ['FirstBlockCache', 'FirstBlockCache + ours balanced']
    """
    spec = CACHES.get(name)
    if spec is None:
        raise ValueError(f"Expected a cache among {sorted(CACHES)}, but got {name!r}.")

    def enable(model: torch.nn.Module) -> None:
        if not supports_caches(model):
            raise ValueError(
                f"Expected a denoiser with diffusers' caches (CacheMixin) for --cache, but got {type(model).__name__}."
            )
        model.enable_cache(cache_config(name, pipe))

    def disable(model: torch.nn.Module) -> None:
        model.disable_cache()

    settings = {"cache": spec.label}
    alone = Method(spec.label, "cache", None, enable, disable, settings=settings)
    return with_tome_rows(alone, tome_methods, "cache + ours")


def cache_quality(
    name: str,
    tome_methods: Sequence[Method],
    steps: int = 20,
    strength: float = 0.6,
    references: Sequence[Method] = (),
) -> list[dict[str, Any]]:
    """The change each row makes to whole DDIM trajectories of the trained FLUX-shaped model (a
    `FluxTransformer2DModel`, which takes diffusers' caches itself; `sampling.SamplingProbe`).

    Rows: every one of `references` alone (the bounds a preset is held to, e.g. ToMe at 0.5), every one of
    `tome_methods` alone, cache `name` alone, and the cache with each of `tome_methods` (applied as on the
    bench's denoiser: ToMe first). Each row: `method`, `image_change` (relative to the
    unmerged, uncached run's final images) and `psnr_drop` (dB, against the clean crops). A cache that hooks
    none of the model's blocks gives one row, with both None.

    Example:
        >>> rows = cache_quality("fbc", [], steps=4)
        >>> rows[0]["method"], rows[0]["image_change"] >= 0
        ('FirstBlockCache', True)
        >>> cache_quality("taylorseer", [], steps=6)[0]["image_change"] > 0  # its default warm-up: 3 steps
        True
    """
    model, scheduler = load_denoiser("flux")
    probe = SamplingProbe(model, scheduler.config, heldout_crops(64, 1, 0), steps, strength)
    rows = []
    methods = cache_methods(name, probe, tome_methods)
    methods[0].apply(probe.model)
    hooked = any(_hooks_of(module) for module in probe.model.modules() if module is not probe.model)
    methods[0].remove(probe.model)
    if not hooked:  # the cache finds none of the model's blocks: no quality to report
        return [{"method": methods[0].name, "image_change": None, "psnr_drop": None}]
    for method in [*references, *tome_methods, *methods]:
        measured = probe.measure(method.apply, method.remove)
        rows.append(
            {"method": method.name, "image_change": measured["image_change"], "psnr_drop": measured["psnr_drop"]}
        )
    return rows


def _hooks_of(module: torch.nn.Module) -> bool:
    registry = getattr(module, "_diffusers_hook", None)  # where diffusers keeps a module's HookRegistry
    return bool(getattr(registry, "hooks", None))


def cache_quality_table(rows: Sequence[dict[str, Any]]) -> str:
    """A markdown table of `cache_quality` rows.

    Example:
        >>> print(cache_quality_table([{"method": "FirstBlockCache", "image_change": 0.0123, "psnr_drop": 0.05}]))
        | method (on the trained FLUX-shaped model's sampling runs) | image change % | PSNR drop dB |
        |---|---|---|
        | FirstBlockCache | 1.23 | 0.050 |
    """
    lines = [
        "| method (on the trained FLUX-shaped model's sampling runs) | image change % | PSNR drop dB |",
        "|---|---|---|",
    ]
    for row in rows:
        if row["image_change"] is None:
            lines.append(f"| {row['method']} | n/a: acts on none of the model's blocks | - |")
        else:
            lines.append(f"| {row['method']} | {100 * row['image_change']:.2f} | {row['psnr_drop']:.3f} |")
    return "\n".join(lines)
