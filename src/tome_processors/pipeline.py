"""`pipe.enable_tome()` / `pipe.disable_tome()` and keeping ToMe on while diffusers replaces processors.

Many diffusers APIs replace every attention processor (xFormers, attention slicing, fused QKV,
IP-Adapter, `set_default_attn_processor`) or inspect the current ones by class before doing so. ToMe's
`ProcessorKeeper` (keeper.py) keeps every merged model wrapped through the model's methods for that
under `apply_tome` too; `enable_tome` asks it to keep everything (`keep_all`):

- `set_attn_processor` is wrapped as well, so whatever processor is set, ToMe wraps it;
- the pipeline's own methods that read the processors directly (`unload_ip_adapter`,
  `set_ip_adapter_scale`, the xFormers switch) get the same treatment;
- a forward pre-hook re-wraps anything replaced some other way (`attn.processor = ...`).

No forward is copied and no class is swapped; `disable_tome()` deletes the instance attributes and
hooks and leaves the model bit-identical to never having enabled ToMe.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from .apply import apply_plan, denoiser_of, remove_model, remove_tome, target_models
from .config import Preset, ToMeConfig
from .families import Family
from .families.walk import one_walk
from .hooks import context_of, unwatch_schedule, watch_schedule
from .plan import plan_tome
from .processor import ToMeProcessor

logger = logging.getLogger(__name__)

__all__ = ["ToMeMixin", "disable_tome", "enable_tome", "patch_pipelines", "unpatch_pipelines"]

#: Instance attribute of a pipeline with ToMe enabled: its `_PipelineState`.
PIPELINE_ATTR = "_tome_pipeline_state"


class _PipelineState:
    """What `enable_tome` did to one pipeline, so that `disable_tome` can undo exactly that."""

    def __init__(self, config: ToMeConfig, models: list[torch.nn.Module]) -> None:
        self.config = config
        self.models = models


def _merged_models(pipe: Any, controlnet: bool) -> list[torch.nn.Module]:
    """`target_models` of a pipeline; a model alone is refused (`apply_tome` is for models)."""
    if isinstance(pipe, torch.nn.Module) or denoiser_of(pipe) is None:
        raise TypeError(
            f"Expected a diffusers pipeline with a `unet` (or `transformer`), but got {type(pipe).__name__}, which "
            "has none."
        )
    return target_models(pipe, controlnet)


def enable_tome(
    pipe: Any,
    ratio: float | None = None,
    *,
    config: ToMeConfig | None = None,
    preset: Preset | None = None,
    controlnet: bool = False,
    **options: Any,
) -> Any:
    """Merge tokens in the pipeline's UNet (and optionally its ControlNet) and keep merging whatever else is set.

    The pipeline's current attention processors (SDPA, xFormers, IP-Adapter, your own) stay as the
    inner processors. ToMe then survives `enable_xformers_memory_efficient_attention()`,
    `set_default_attn_processor()`, `enable_attention_slicing()`, `fuse_qkv_projections()`,
    `load_ip_adapter()` and their undoing, in any order. Enabling again replaces the options.

    Args:
        pipe: a diffusers pipeline with a `unet` (or a supported `transformer`: PixArt, SD3, Flux).
        ratio: share of the tokens merged away in the merged blocks (see `ToMeConfig`); by default
            `config.ratio`, or without a config the model family's default (0.5 for UNets, as
            tomesd; see docs/transformers.md for transformers).
        config: a `ToMeConfig` to start from; `ratio` and `options` override its fields.
        preset: `"exact"`, `"balanced"` or `"fast"` instead of a config, chosen per model family from
            measured speed and quality (docs/options.md); `ratio` and `options` override it.
        controlnet: also merge inside `pipe.controlnet` (each net of a `MultiControlNetModel`).
        **options: any other `ToMeConfig` field, e.g. `max_downsample=2`, `use_rand=False`.

    Returns:
        `pipe`, changed in place.

    Example:
        >>> import tome_processors
        >>> tome_processors.enable_tome(pipe, ratio=0.5)  # doctest: +SKIP
        >>> tome_processors.enable_tome(pipe, preset="fast")  # doctest: +SKIP
        >>> pipe.enable_xformers_memory_efficient_attention()  # ToMe stays on  # doctest: +SKIP
        >>> tome_processors.disable_tome(pipe)  # doctest: +SKIP
    """
    if not isinstance(controlnet, bool):
        raise TypeError(f"Expected controlnet to be a bool, but got {controlnet!r}.")
    if ratio is not None:
        options["ratio"] = ratio
    models = _merged_models(pipe, controlnet)
    # One plan per model (its family looked up once; without a config, the family's defaults: tomesd's for UNets,
    # docs/transformers.md for transformers): resolved and validated before anything is changed.
    plans = [plan_tome(model, config, preset, options) for model in models]
    config = plans[0].config
    disable_tome(pipe)
    try:
        for plan in plans:
            with one_walk(plan.model, plan.walk):  # enabled earlier through another pipeline sharing it (`from_pipe`)
                _forget_model(plan.model, plan.family)
            context = apply_plan(plan, stacklevel=3)
            context.keeper.install(keep_all=True)  # set_attn_processor too: ToMe stays until disable_tome
    except Exception:
        for plan in plans:
            _forget_model(plan.model, plan.family)
        raise
    object.__setattr__(pipe, PIPELINE_ATTR, _PipelineState(config, models))
    # A new generation at every denoising loop (`ratio_start`: its timesteps), a reset at every call's end,
    # the pipeline's own processor switches (xFormers, IP-Adapter scale and unloading).
    watch_schedule(pipe, models)
    logger.debug("ToMe enabled on %s: %s", type(pipe).__name__, config)
    return pipe


def _forget_model(model: torch.nn.Module, family: Family | None = None) -> None:
    """ToMe off `model` (of `family` where known) and its saved processors unwrapped."""
    context = context_of(model)
    if context is not None or family is not None:
        remove_model(model, context.family if context is not None else family)
    else:
        remove_tome(model)
    # fuse_qkv_projections() saved the processors it replaced: make unfuse restore unwrapped ones.
    saved = getattr(model, "original_attn_processors", None)
    if isinstance(saved, dict):
        for name, processor in saved.items():
            if isinstance(processor, ToMeProcessor) and processor.inner is not None:
                saved[name] = processor.inner


def disable_tome(pipe: Any) -> Any:
    """Undo `enable_tome`: inner processors back, hooks and wrapped methods gone.

    The pipeline's images are then bit-identical to never having enabled ToMe. Disabling a
    pipeline without ToMe does nothing. ToMe lives on the models: pipelines that share one (`from_pipe`)
    share its ToMe, and disabling any of them takes it off that model for all of them.

    Example:
        >>> tome_processors.disable_tome(pipe)  # doctest: +SKIP
    """
    state: _PipelineState | None = pipe.__dict__.get(PIPELINE_ATTR)
    if state is not None:
        unwatch_schedule(pipe)
        for model in state.models:
            _forget_model(model)
        del pipe.__dict__[PIPELINE_ATTR]
    # A model shared with another pipeline (`from_pipe`) that enabled ToMe on it: ToMe lives on the model, so it
    # goes for every pipeline that shares it.
    for model in _shared_enabled_models(pipe):
        _forget_model(model)
    return pipe


def _enabled_config(model: torch.nn.Module) -> ToMeConfig | None:
    """The options `enable_tome` (of any pipeline) runs on `model` now, or None."""
    context = context_of(model)
    if context is None or context.keeper is None or not context.keeper.keep_all:
        return None
    return context.model_state.config


def _shared_enabled_models(pipe: Any) -> list[torch.nn.Module]:
    """The models of `pipe` (denoisers and ControlNets) with ToMe on them from `enable_tome`."""
    if isinstance(pipe, torch.nn.Module) or denoiser_of(pipe) is None:
        return []
    controlnet = isinstance(getattr(pipe, "controlnet", None), torch.nn.Module)
    return [model for model in target_models(pipe, controlnet) if _enabled_config(model) is not None]


def tome_config_of(pipe: Any) -> ToMeConfig | None:
    """The `ToMeConfig` that `enable_tome` runs on `pipe`'s denoiser now, or None.

    Pipelines that share their denoiser (`from_pipe`) share its ToMe: each reports the options of the last
    `enable_tome` on any of them.
    """
    if isinstance(pipe, torch.nn.Module) or denoiser_of(pipe) is None:
        return None
    return _enabled_config(target_models(pipe)[0])


class ToMeMixin:
    """Gives a diffusers pipeline `enable_tome()`, `disable_tome()` and `tome_config`.

    Put it first among the bases of your pipeline class, or call `tome_processors.patch_pipelines()`
    once to give every stock diffusers pipeline these methods.

    Example:
        >>> from diffusers import StableDiffusionPipeline
        >>> from tome_processors import ToMeMixin
        >>> class MyPipeline(ToMeMixin, StableDiffusionPipeline):
        ...     pass
        >>> pipe = MyPipeline.from_pretrained("stable-diffusion-v1-5/stable-diffusion-v1-5")  # doctest: +SKIP
        >>> pipe.enable_tome(ratio=0.5)  # doctest: +SKIP
        >>> pipe.tome_config.ratio  # doctest: +SKIP
        0.5
    """

    def enable_tome(
        self,
        ratio: float | None = None,
        *,
        config: ToMeConfig | None = None,
        preset: Preset | None = None,
        controlnet: bool = False,
        **options: Any,
    ) -> None:
        """Merge tokens in the UNet (and with `controlnet=True` in the ControlNet); see `tome_processors.enable_tome`.

        Example:
            >>> pipe.enable_tome(ratio=0.5, max_downsample=2)  # doctest: +SKIP
            >>> pipe.enable_tome(preset="balanced")  # doctest: +SKIP
        """
        enable_tome(self, ratio, config=config, preset=preset, controlnet=controlnet, **options)

    def disable_tome(self) -> None:
        """Take ToMe away again; images are then bit-identical to never having enabled it.

        Example:
            >>> pipe.disable_tome()  # doctest: +SKIP
        """
        disable_tome(self)

    @property
    def tome_config(self) -> ToMeConfig | None:
        """The enabled `ToMeConfig`, or None when ToMe is off.

        Example:
            >>> pipe.enable_tome(ratio=0.4); pipe.tome_config.ratio  # doctest: +SKIP
            0.4
        """
        return tome_config_of(self)


_PATCHED_NAMES = ("enable_tome", "disable_tome", "tome_config")


def patch_pipelines() -> None:
    """Give every diffusers pipeline class `enable_tome()`, `disable_tome()` and `tome_config`.

    The one opt-in line: it adds those three attributes to `diffusers.DiffusionPipeline` (the base
    class of every pipeline) and nothing else. Calling it again does nothing;
    `unpatch_pipelines()` takes them away.

    Example:
        >>> import tome_processors
        >>> tome_processors.patch_pipelines()
        >>> from diffusers import StableDiffusionPipeline
        >>> hasattr(StableDiffusionPipeline, "enable_tome")
        True
        >>> tome_processors.unpatch_pipelines()
    """
    from diffusers import DiffusionPipeline  # here: it loads the pipeline machinery (0.7 s)

    for name in _PATCHED_NAMES:
        existing = DiffusionPipeline.__dict__.get(name)
        if existing is not None and existing is not ToMeMixin.__dict__[name]:
            raise RuntimeError(
                f"Expected DiffusionPipeline to have no `{name}` of its own, but got {existing!r}; "
                "not patching over it (use ToMeMixin or tome_processors.enable_tome(pipe) instead)."
            )
    for name in _PATCHED_NAMES:
        setattr(DiffusionPipeline, name, ToMeMixin.__dict__[name])


def unpatch_pipelines() -> None:
    """Undo `patch_pipelines()`. Pipelines with ToMe enabled keep it until `disable_tome(pipe)`.

    Example:
        >>> import tome_processors
        >>> tome_processors.unpatch_pipelines()
    """
    from diffusers import DiffusionPipeline  # here: it loads the pipeline machinery (0.7 s)

    for name in _PATCHED_NAMES:
        if DiffusionPipeline.__dict__.get(name) is ToMeMixin.__dict__[name]:
            delattr(DiffusionPipeline, name)
