"""One plan per model: what turning ToMe on resolves, once, and everything after reads.

`apply_tome`, `enable_tome`, a `ToMeProcessor` set with `set_attn_processor` (at its first call) and removal each
build one `ToMePlan` per model: its family (looked up once, or the one the caller declares), the configuration
resolved from the family's defaults and presets, every merge site (`BlockSite`: a block, its attention modules with
their layout, its feed-forward, where the grid's tokens sit) and every attention module, from one walk over the
model's modules. The hooks, the processors and removal read the plan; none looks the family up again.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .config import Preset, ToMeConfig
from .families import FAMILIES, BlockSite, Family, family_of, is_attention_module
from .families.walk import Walk, one_walk

__all__ = ["ToMePlan", "plan_tome", "resolve_family"]


@dataclass(frozen=True)
class ToMePlan:
    """What ToMe resolved for one model when it was turned on.

    Attributes:
        model: the model.
        family: its family (how its blocks, token grid and timestep are found).
        config: the configuration it merges with.
        sites: every block ToMe hooks, in forward order, with its attention modules and their layouts.
        attentions: every attention module of the model that holds a processor, in module order (what ToMe wraps).
        walk: `(name, module)` of every module of the model, from the one walk the plan was made with.

    Example:
        >>> plan = plan_tome(unet, preset="balanced")  # doctest: +SKIP
        >>> plan.family.name, len(plan.sites), plan.config.share_level  # doctest: +SKIP
        ('unet', 16, True)
    """

    model: torch.nn.Module
    family: Family
    config: ToMeConfig
    sites: tuple[BlockSite, ...]
    attentions: tuple[torch.nn.Module, ...]
    walk: Walk = field(repr=False)


def resolve_family(model: torch.nn.Module, family: Family | type[Family] | str | None) -> Family:
    """`model`'s family: the one given (a `Family`, a `Family` subclass or a registered family's name), which must
    match the model, or else the one registered for it (one look-up; a `ValueError` that says why where none is).

    Example:
        >>> from tome_processors.families import PixArtFamily
        >>> resolve_family(torch.nn.Linear(1, 1), PixArtFamily)
        Traceback (most recent call last):
        ...
        ValueError: Expected a model the family 'pixart' matches (PixArtTransformer2DModel), but got Linear.
    """
    if family is None:
        return family_of(model)
    if isinstance(family, str):
        if family not in FAMILIES:
            raise ValueError(
                f"Expected family to be a registered family's name among {sorted(FAMILIES)}, but got {family!r}."
            )
        family = FAMILIES[family]
    if isinstance(family, type) and issubclass(family, Family):
        family = family()
    if not isinstance(family, Family):
        raise TypeError(
            f"Expected family to be a Family, a Family subclass or a registered family's name, but got {family!r}."
        )
    if not family.matches(model):
        wanted = family.model_class.__name__ if family.model_class is not None else "its models"
        raise ValueError(
            f"Expected a model the family {family.name!r} matches ({wanted}), but got {type(model).__name__}."
        )
    return family


def plan_tome(
    model: torch.nn.Module,
    config: ToMeConfig | None = None,
    preset: Preset | None = None,
    options: dict[str, Any] | None = None,
    family: Family | type[Family] | str | None = None,
) -> ToMePlan:
    """The plan of ToMe on `model`: its family, `config` (or the family's `preset`, or its defaults) with `options`
    on top, its merge sites and attention modules, from one family look-up and one walk over its modules.

    Raises (before anything changes): a `ValueError` for a model of no family (saying why where ToMe refuses it), a
    model without attention modules, options its family cannot honour (`st=2` on an image model, K/V pooling on
    joint attention), `config` and `preset` both given; a `TypeError` for unknown options.
    """
    options = dict(options or {})
    if config is not None and preset is not None:
        raise ValueError(f"Expected a config or a preset, not both, but got config and preset={preset!r}.")
    with one_walk(model) as walk:
        resolved = resolve_family(model, family)
        if config is not None:
            resolved_config = ToMeConfig.from_kwargs(config, **options)
        else:
            resolved_config = ToMeConfig.for_family(resolved, preset, model, **options)
        attentions = tuple(module for _, module in walk if is_attention_module(module))
        if not attentions:
            raise ValueError(
                f"Expected a model with attention modules, but got {type(model).__name__}, which has none."
            )
        resolved.check_config(model, resolved_config)
        sites = tuple(resolved.blocks(model))
    return ToMePlan(model, resolved, resolved_config, sites, attentions, walk)
