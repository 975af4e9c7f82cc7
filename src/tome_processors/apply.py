"""`apply_tome` / `remove_tome`: wrap every attention processor and install the merge context."""

from __future__ import annotations

import logging
import warnings
from typing import Any, TypeVar

import torch
from diffusers.models.attention import AttentionModuleMixin
from diffusers.models.attention_processor import Attention

from .attach import discard_pending
from .config import ToMeConfig
from .families import Family, attention_levels, family_of, find_family
from .hooks import CONTEXT_ATTR, ToMeContext, install
from .processor import ToMeProcessor

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _target_models(model_or_pipeline: Any) -> list[torch.nn.Module]:
    """The denoiser(s) of a pipeline, or the model itself."""
    if isinstance(model_or_pipeline, torch.nn.Module):
        return [model_or_pipeline]
    for name in ("unet", "transformer"):
        candidate = getattr(model_or_pipeline, name, None)
        if isinstance(candidate, torch.nn.Module):
            return [candidate]
    raise TypeError(
        "Expected a diffusers model (torch.nn.Module) or a pipeline with a `unet` or `transformer`, "
        f"but got {type(model_or_pipeline).__name__}."
    )


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every attention module of `model` that holds a processor, in module order."""
    # `Attention` (UNets, PixArt, SD3) and the newer `AttentionModuleMixin` modules (FluxAttention).
    return [m for m in model.modules() if isinstance(m, (Attention, AttentionModuleMixin)) and hasattr(m, "processor")]


def _check_mergeable(model: torch.nn.Module) -> Family:
    family = family_of(model)  # names the model's class when its family is not supported
    if not attention_modules(model):
        raise ValueError(f"Expected a model with attention modules, but got {type(model).__name__}, which has none.")
    return family


def _warn_if_merges_nothing(model: torch.nn.Module, config: ToMeConfig) -> None:
    levels = attention_levels(model)
    if config.max_downsample != "auto" and levels and config.max_downsample < min(levels):
        warnings.warn(
            f"ToMe with max_downsample={config.max_downsample} merges nothing on {type(model).__name__}: its "
            f"attention starts at downsample {min(levels)}. Use max_downsample='auto' or >= {min(levels)}.",
            UserWarning,
            stacklevel=3,
        )
    elif config.ratio == 0 or not (config.merge_attn or config.merge_crossattn or config.merge_mlp):
        warnings.warn("ToMe with this configuration merges nothing (ratio 0 or every merge flag off).", stacklevel=3)


def unwrap_processors(model: torch.nn.Module) -> None:
    """Put every wrapped attention module's inner processor back in place."""
    for attn in attention_modules(model):
        if isinstance(attn.processor, ToMeProcessor):
            attn.set_processor(attn.processor.inner)


def apply_tome(model_or_pipeline: T, config: ToMeConfig | None = None, **kwargs: Any) -> T:
    """Apply Token Merging to a diffusers model or pipeline, keeping its current attention processors.

    Every attention module's processor is wrapped in a `ToMeProcessor` (so xFormers, SDPA,
    IP-Adapter or your own processor stays the inner one) and hooks that compute one merge per
    transformer block per forward are installed. Applying again replaces the earlier application.

    Args:
        model_or_pipeline: a `UNet2DConditionModel` (or another model with spatial transformer
            blocks), a `PixArtTransformer2DModel`, `SD3Transformer2DModel` or
            `FluxTransformer2DModel`, or a pipeline with a `unet` or `transformer`.
        config: a `ToMeConfig`; keyword options override its fields. Without one, the model
            family's defaults are used (tomesd's for UNets; see docs/transformers.md).

    Returns:
        `model_or_pipeline`, changed in place.

    Example:
        >>> import tome_processors
        >>> tome_processors.apply_tome(pipe, ratio=0.5)  # doctest: +SKIP
        >>> image = pipe("a photo of an astronaut riding a horse on mars").images[0]  # doctest: +SKIP
        >>> tome_processors.remove_tome(pipe)  # doctest: +SKIP
    """
    models = _target_models(model_or_pipeline)
    plans = []
    for model in models:  # check everything before changing anything
        family = _check_mergeable(model)
        # Without a config, the family's defaults (docs/transformers.md); keyword options override them.
        model_config = ToMeConfig.from_kwargs(config if config is not None else family.default_config(), **kwargs)
        family.check_config(model, model_config)
        plans.append((model, family, model_config))
    for model, family, config in plans:  # noqa: B020 (each model's own config from here on)
        _warn_if_merges_nothing(model, config)
        remove_tome(model)
        context = install(model, config, family)
        wrappers = []
        for attn in attention_modules(model):
            wrapper = ToMeProcessor(attn.processor, config)
            wrappers.append(wrapper)
            attn.set_processor(wrapper)
        discard_pending(wrappers)
        setattr(model, CONTEXT_ATTR, context)
        logger.debug("ToMe applied to %s: %d blocks", type(model).__name__, len(context.blocks))
    return model_or_pipeline


def remove_tome(model_or_pipeline: T) -> T:
    """Take ToMe away: inner processors back in place, hooks and attributes gone.

    The model's output is then bit-identical to never having applied ToMe. Removing from a model
    without ToMe does nothing.

    Example:
        >>> tome_processors.remove_tome(pipe.unet)  # doctest: +SKIP
    """
    for model in _target_models(model_or_pipeline):
        context: ToMeContext | None = model.__dict__.get(CONTEXT_ATTR)
        if context is not None:
            context.remove(model)
        unwrap_processors(model)
    return model_or_pipeline


def attach_processors(model: torch.nn.Module, processors: list[ToMeProcessor], args: tuple) -> bool:
    """Install the merge context for processors that were set directly (see `attach.py`).

    Returns whether the forward that is starting will merge (False when its latent cannot be seen).
    """
    discard_pending(processors)
    family = find_family(model)
    if CONTEXT_ATTR in model.__dict__ or family is None:
        return True
    config = processors[0].config
    if family.merge_only and config.mode != "merge":
        warnings.warn(
            f"ToMe mode={config.mode!r} merges nothing on {type(model).__name__}; use mode='merge'.", stacklevel=3
        )
    _warn_if_merges_nothing(model, config)
    context = install(model, config, family)
    setattr(model, CONTEXT_ATTR, context)
    # This forward's own pre-hook list was fixed before the context existed: run it by hand.
    model_pre_hook = model._forward_pre_hooks[context.handles[0].id]
    model_pre_hook(model, args, {})
    if context.model_state.latent_hw is None:  # `sample` came by keyword, which that hook cannot see
        return _begin_from_submodules(model, context)
    return True


def _begin_from_submodules(model: torch.nn.Module, context: ToMeContext) -> bool:
    """Start a UNet's merge context within a forward whose inputs came by keyword.

    The UNet hands its timestep to `time_proj` and its latent to `conv_in` before any transformer
    block runs, so one-shot pre-hooks there see what the model pre-hook would have seen. Returns
    False for models without both (transformers), whose forward then runs unmerged.
    """
    time_proj, conv_in = getattr(model, "time_proj", None), getattr(model, "conv_in", None)
    if not (isinstance(time_proj, torch.nn.Module) and isinstance(conv_in, torch.nn.Module)):
        return False
    state = context.model_state
    seen: dict[str, Any] = {}

    def on_timestep(module: torch.nn.Module, args: tuple) -> None:
        seen["timestep"] = args[0] if args else None

    def on_latent(module: torch.nn.Module, args: tuple) -> None:
        for handle in handles:
            handle.remove()
        sample = args[0] if args else None
        if isinstance(sample, torch.Tensor) and sample.ndim == 4:
            hw = (int(sample.shape[-2]), int(sample.shape[-1]))
            state.begin(hw, seen.get("timestep"))

    handles = [time_proj.register_forward_pre_hook(on_timestep), conv_in.register_forward_pre_hook(on_latent)]
    context.handles.extend(handles)  # removal takes them away even if this forward never reaches conv_in
    return True


def is_tome_applied(model_or_pipeline: Any) -> bool:
    """Whether ToMe's merge context is installed on the model (or the pipeline's denoiser)."""
    return any(CONTEXT_ATTR in m.__dict__ for m in _target_models(model_or_pipeline))
