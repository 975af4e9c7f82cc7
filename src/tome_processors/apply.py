"""`apply_tome` / `remove_tome`: wrap every attention processor and install the merge context."""

from __future__ import annotations

import logging
from typing import Any, TypeVar

import torch

from .built import rebuilt_processor
from .config import Preset, ToMeConfig
from .families import Family, find_family, set_processor
from .families.walk import one_walk
from .hooks import (
    ModelHooks,
    attention_modules,
    context_of,
    install,
    unwatch_schedule,
    warn_if_merges_nothing,
    watch_schedule,
)
from .plan import ToMePlan, plan_tome
from .processor import ToMeProcessor
from .replaced import warn_replaced_forwards

logger = logging.getLogger(__name__)

T = TypeVar("T")


def denoiser_of(pipe: Any) -> torch.nn.Module | None:
    """A pipeline's denoiser: its `unet`, or else its `transformer`; None when it has neither."""
    for name in ("unet", "transformer"):
        candidate = getattr(pipe, name, None)
        if isinstance(candidate, torch.nn.Module):
            return candidate
    return None


def target_models(model_or_pipeline: Any, controlnet: bool = False) -> list[torch.nn.Module]:
    """The models ToMe goes on: a model itself, or a pipeline's denoiser and, with `controlnet`, its ControlNets.

    A pipeline's `transformer_2` goes too (the Wan 2.2 pipelines denoise the low-noise steps with it).

    Example:
        >>> target_models(torch.nn.Linear(1, 1))
        [Linear(in_features=1, out_features=1, bias=True)]
    """
    if isinstance(model_or_pipeline, torch.nn.Module):
        return [model_or_pipeline]
    denoiser = denoiser_of(model_or_pipeline)
    if denoiser is None:
        raise TypeError(
            "Expected a diffusers model (torch.nn.Module) or a pipeline with a `unet` or `transformer`, "
            f"but got {type(model_or_pipeline).__name__}."
        )
    models = [denoiser]
    second = getattr(model_or_pipeline, "transformer_2", None)
    if isinstance(second, torch.nn.Module) and second is not denoiser:
        models.append(second)
    if controlnet:
        net = getattr(model_or_pipeline, "controlnet", None)
        if not isinstance(net, torch.nn.Module):
            raise ValueError(
                f"Expected a pipeline with a `controlnet` for controlnet=True, but got "
                f"{type(model_or_pipeline).__name__}, which has none."
            )
        nets = getattr(net, "nets", None)  # MultiControlNetModel holds a list of ControlNets
        models.extend(nets if isinstance(nets, torch.nn.ModuleList) else [net])
    return models


#: `inner_processor`'s default: find the model's family there.
_FIND = object()


def inner_processor(model: torch.nn.Module, attn: torch.nn.Module, family: Family | None | object = _FIND) -> Any:
    """The processor ToMe runs on `attn`, an attention module of `model`: its processor, or a `ToMeProcessor`'s
    inner one (for a `ToMeProcessor()` without one, a new processor of the class `model` builds `attn` with: its
    family's answer, or on a model of no supported family, its class's build (built.py)).

    `family`: `model`'s family as the caller found it once (None: of no supported family); without it, found here.

    Raises:
        ValueError: for a `ToMeProcessor()` without an inner processor where that class is unknown.
    """
    processor = attn.processor
    if not isinstance(processor, ToMeProcessor):
        return processor
    if family is _FIND:
        family = find_family(model)
    if isinstance(family, Family):
        return processor.built_inner(attn, family.built_processor(model, attn))
    if processor.inner is not None:
        return processor.inner
    built = rebuilt_processor(model, attn)
    if built is None:  # the class's default would be a guess: Sana's and CogVideoX's are not what they build
        raise ValueError(
            f"Expected to know the processor {type(model).__name__} builds its {type(attn).__name__} modules with, "
            "to put it back in place of ToMeProcessor() (made without an inner processor), but got a model ToMe "
            "cannot build again to ask. Nothing was changed; set the processors yourself: "
            "model.set_attn_processor(<the model's processor>)."
        )
    return processor.built_inner(attn, built)


def unwrap_processors(model: torch.nn.Module, family: Family | None) -> None:
    """Put every wrapped attention module of `model` (of `family`, None where unsupported) back to its inner
    processor, all found before any is set: a processor that cannot be told raises before anything changes."""
    inners = [(attn, inner_processor(model, attn, family)) for attn in attention_modules(model)]
    for attn, inner in inners:
        if attn.processor is not inner:
            set_processor(attn, inner)


def apply_tome(
    model_or_pipeline: T,
    config: ToMeConfig | None = None,
    *,
    preset: Preset | None = None,
    family: Family | type[Family] | str | None = None,
    **kwargs: Any,
) -> T:
    """Apply Token Merging to a diffusers model or pipeline, keeping its current attention processors.

    Every attention module's processor is wrapped in a `ToMeProcessor` (so xFormers, SDPA,
    IP-Adapter or your own processor stays the inner one) and hooks that compute one merge per
    transformer block per forward are installed. Applying again replaces the earlier application.

    Args:
        model_or_pipeline: a model of a declared family (docs/families.md lists every diffusers model and its
            family) or a pipeline with a `unet` or `transformer` of one.
        config: a `ToMeConfig`; keyword options override its fields. Without one, the model
            family's defaults are used (tomesd's for UNets; see docs/transformers.md).
        preset: `"exact"`, `"balanced"` or `"fast"` instead of a config: settings chosen per model
            family from measured speed and quality (docs/options.md); keyword options override it.
        family: the model's family, where the library declares none for it or you want another: a `Family`
            subclass (or instance, or a registered family's name) that you declared (docs/families.md, "A family
            of your own"); by default the family registered for the model's class.

    Returns:
        `model_or_pipeline`, changed in place.

    Example:
        >>> import tome_processors
        >>> tome_processors.apply_tome(pipe, ratio=0.5)  # doctest: +SKIP
        >>> image = pipe("a photo of an astronaut riding a horse on mars").images[0]  # doctest: +SKIP
        >>> tome_processors.remove_tome(pipe)  # doctest: +SKIP
        >>> tome_processors.apply_tome(pipe, preset="fast")  # doctest: +SKIP
        >>> tome_processors.apply_tome(my_model, family=MyFamily, ratio=0.5)  # doctest: +SKIP
    """
    models = target_models(model_or_pipeline)
    plans = [plan_tome(model, config, preset, kwargs, family) for model in models]  # all checked before any change
    for plan in plans:
        apply_plan(plan, stacklevel=3)
    if not isinstance(model_or_pipeline, torch.nn.Module):  # `ratio_start` finds its timesteps on the host
        watch_schedule(model_or_pipeline, models)
    return model_or_pipeline


def apply_plan(plan: ToMePlan, stacklevel: int = 2) -> ModelHooks:
    """Put ToMe on `plan.model` as `plan` says (an earlier application goes first); its merge context."""
    model, family = plan.model, plan.family
    with one_walk(model, plan.walk):
        warn_if_merges_nothing(model, plan.config, stacklevel=stacklevel, family=family, sites=plan.sites)
        remove_model(model, family)
        inners = [(attn, inner_processor(model, attn, family)) for attn in plan.attentions]
        context = install(plan, ToMeProcessor)
        for attn, inner in inners:
            set_processor(attn, ToMeProcessor(inner, plan.config))
        context.keeper.install()  # ToMe stays on through fusing, IP-Adapter loading, ... (keeper.py)
        warn_replaced_forwards(model, context.slotted, stacklevel=stacklevel)  # a forward that runs no processor
    logger.debug("ToMe applied to %s: %d blocks", type(model).__name__, len(context.block_modules))
    return context


def remove_tome(model_or_pipeline: T) -> T:
    """Take ToMe away: inner processors back in place, hooks and attributes gone.

    The model's output is then bit-identical to never having applied ToMe. Removing from a model
    without ToMe does nothing.

    Example:
        >>> tome_processors.remove_tome(pipe.unet)  # doctest: +SKIP
    """
    for model in target_models(model_or_pipeline):
        context = context_of(model)
        remove_model(model, context.family if context is not None else find_family(model))
    if not isinstance(model_or_pipeline, torch.nn.Module):
        unwatch_schedule(model_or_pipeline)
    return model_or_pipeline


def remove_model(model: torch.nn.Module, family: Family | None) -> None:
    """`remove_tome` on one model of `family` (None: of no declared family)."""
    context = context_of(model)
    if context is not None:
        context.remove()
    unwrap_processors(model, family)


def is_tome_applied(model_or_pipeline: Any) -> bool:
    """Whether ToMe is on the model (or the pipeline's denoiser): its merge context is installed and some
    attention module still holds a ToMe processor (after `set_attn_processor(AttnProcessor2_0())` it is off).

    Example:
        >>> tome_processors.is_tome_applied(pipe)  # doctest: +SKIP
        False
    """
    for model in target_models(model_or_pipeline):
        context = context_of(model)
        if context is not None and context.holds_processor():
            return True
    return False


def new_generation(model_or_pipeline: Any) -> None:
    """Start a new generation: the next forward is its first step, whatever ran before.

    ToMe keeps merges across steps with `recompute_every`. Pipeline calls start afresh by themselves (see
    docs/guarantees.md); a loop of your own starts afresh by itself where it calls the model with views
    of `scheduler.timesteps` (`for t in scheduler.timesteps`) or, on Flux, with `img_ids` made for it.
    Call this before a generation where it cannot be seen: timesteps made for each call
    (`unet(x, torch.tensor(t))`), Flux's `img_ids` reused from an earlier generation.

    Args:
        model_or_pipeline: a model (or a pipeline's denoiser) with ToMe on it, applied or set with
            `set_attn_processor(ToMeProcessor(...))`.

    Example:
        >>> import tome_processors
        >>> tome_processors.new_generation(unet)  # doctest: +SKIP
        >>> for t in (999, 500, 1):  # doctest: +SKIP
        ...     noise = unet(latents, torch.tensor(t), text).sample
    """
    models = target_models(model_or_pipeline)
    for model in models:  # checked before anything changes
        if context_of(model) is None and not any(
            isinstance(getattr(attn, "processor", None), ToMeProcessor) for attn in attention_modules(model)
        ):
            raise ValueError(f"Expected a model with ToMe on it, but got {type(model).__name__} without it.")
    for model in models:
        context = context_of(model)
        if context is not None:  # a processor not attached yet starts afresh at its first forward
            context.reset()
