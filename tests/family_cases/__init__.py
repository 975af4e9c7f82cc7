"""The table of model families that `tests/test_family_table.py` runs its checks over.

Each module of this package declares `CASES`, a tuple of `FamilyCase`: a tiny random-weight model of one family
(built from a config, as diffusers' own model tests do), its inputs as its pipeline calls it, how many of its
attention calls merge at ratio 0.5, and where diffusers has one, a tiny offline pipeline. Every module is read,
in name order; a case name is unique across them.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch


def first_output(output: Any) -> torch.Tensor:
    """A model's output as one tensor: `.sample`, the first of a tuple, a list of per-sample tensors stacked."""
    if hasattr(output, "sample"):
        output = output.sample
    elif isinstance(output, tuple):
        output = output[0]
    return torch.stack(output) if isinstance(output, list) else output


@dataclass(frozen=True)
class PipelineCase:
    """A tiny offline pipeline of the family and the keyword arguments of one call (height, width, steps, ...).

    `build(tmp_path)` returns the pipeline; the call is made with `call_kwargs` and a seeded `generator`, and its
    images (or video frames) are compared. `height` / `width` / `num_frames`: the call's size, for
    `explain_tome`.
    """

    build: Callable[[Path], Any]
    call_kwargs: dict[str, Any]
    height: int
    width: int
    num_frames: int | None = None


@dataclass(frozen=True)
class FamilyCase:
    """One model of a family, for the table's checks.

    Attributes:
        name: the case's id (unique over every module).
        family: the family's name, as `family_of(model).name` says it.
        build: a tiny random-weight model, seeded, in eval mode.
        inputs: keyword inputs of one forward as its pipeline passes them, `inputs(batch=2)`.
        merged_calls: the attention calls of one forward of `inputs()` that run on fewer tokens with ToMe at 0.5
            (counted on the queries or keys the attention kernel gets).
        pipeline: the family's tiny pipeline, where diffusers has one and it builds offline; else None.
        set_attn_processor: whether the model has `set_attn_processor` (`model.set_attn_processor(ToMeProcessor())`
            is then checked too).
        batch_independent: whether a batch of two equals two batches of one (False where the samples are padded to
            each other, say); `why_not_independent` says why.
        output: the model's output as one tensor.
        linear_attentions: the model's attention modules whose kernel is no `scaled_dot_product_attention` call
            (Sana's linear attention), where it has any: their calls are counted from the tokens their query and key
            projections (`to_q`, `to_k`) get.
    """

    name: str
    family: str
    build: Callable[[], torch.nn.Module]
    inputs: Callable[..., dict[str, Any]]
    merged_calls: int
    pipeline: PipelineCase | None = None
    set_attn_processor: bool = True
    batch_independent: bool = True
    why_not_independent: str = ""
    output: Callable[[Any], torch.Tensor] = first_output
    linear_attentions: Callable[[torch.nn.Module], list[torch.nn.Module]] | None = None


def _declared() -> dict[str, FamilyCase]:
    cases: dict[str, FamilyCase] = {}
    for module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        for case in importlib.import_module(f"{__name__}.{module.name}").CASES:
            if case.name in cases:
                raise ValueError(f"Expected unique case names, but got {case.name!r} twice.")
            cases[case.name] = case
    return cases


#: Every case of every module, by name.
CASES: dict[str, FamilyCase] = _declared()
