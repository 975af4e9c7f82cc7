"""A family anyone can declare: the documented example runs as written; `register_family` and
`apply_tome(model, family=...)` check what they are given before anything changes; a model of no family, or of a
class ToMe refuses, gets an error that says why and where to read more."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from diffusers import PixArtTransformer2DModel

import tome_processors as tp
from tome_processors.families import FAMILIES, REFUSED, REGISTERED, Family, Layout, Stack, family_of
from tome_processors.hooks import context_of

DOC = Path(__file__).resolve().parents[1] / "docs" / "families.md"


def documented_example() -> str:
    section = DOC.read_text().split("## A family of your own", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.fixture
def example():
    namespace: dict = {}
    try:
        exec(compile(documented_example(), str(DOC), "exec"), namespace)  # noqa: S102 - the page's own code
        yield namespace
    finally:
        if "my_dit" in REGISTERED:
            tp.unregister_family("my_dit")


def test_the_documented_family_of_your_own_runs_as_written(example):
    model, family = example["model"], example["MyDiTFamily"]
    assert family_of(model).name == "my_dit" and FAMILIES["my_dit"] is family
    assert not torch.equal(example["merged"], example["plain"])
    plan = context_of(model).plan
    assert len(plan.sites) == 2 and plan.config.ratio == 0.5
    latents, text = example["latents"], example["text"]
    with torch.no_grad():
        assert torch.equal(model(latents, torch.tensor(500), text), example["merged"])  # the same again
        tp.remove_tome(model)
        assert torch.equal(model(latents, torch.tensor(500), text), example["plain"])
        tp.apply_tome(model, preset="fast", pays_only=False)
        assert not torch.equal(model(latents, torch.tensor(500), text), example["plain"])
    tp.remove_tome(model)
    tp.unregister_family("my_dit")
    with pytest.raises(ValueError, match="for which none is declared"):
        tp.apply_tome(model, ratio=0.5)
    tp.apply_tome(model, family=family, ratio=0.5)  # one call, unregistered
    with torch.no_grad():
        assert torch.equal(model(latents, torch.tensor(500), text), example["merged"])


def test_a_declared_family_is_used_with_set_attn_processor_too(example):
    model = example["MyDiT"]().eval()
    latents, text = example["latents"], example["text"]
    with torch.no_grad():
        plain = model(latents, torch.tensor(500), text)
        for block in model.blocks:
            block.attn1.set_processor(tp.ToMeProcessor(ratio=0.5))
        merged = model(latents, torch.tensor(500), text)
    assert context_of(model) is not None and not torch.equal(merged, plain)


class NoName(Family):
    model_class = PixArtTransformer2DModel
    stacks = (Stack("transformer_blocks", Layout.IMAGE, attention="attn1"),)


class NoModel(Family):
    name = "no_model"
    stacks = (Stack("transformer_blocks", Layout.IMAGE, attention="attn1"),)


class NoBlocks(Family):
    name = "no_blocks"
    model_class = PixArtTransformer2DModel


class TakenName(Family):
    name = "pixart"
    model_class = PixArtTransformer2DModel
    stacks = (Stack("transformer_blocks", Layout.IMAGE, attention="attn1"),)


@pytest.mark.parametrize(
    ("family", "error", "message"),
    [
        (object, TypeError, "Expected a Family subclass"),
        (NoName, ValueError, "with a name of its own"),
        (NoModel, ValueError, "which models it matches"),
        (NoBlocks, ValueError, "where its blocks are"),
        (TakenName, ValueError, "the library's own"),
    ],
)
def test_register_family_refuses_what_it_cannot_use_and_registers_nothing(family, error, message):
    before = dict(FAMILIES)
    with pytest.raises(error, match=message):
        tp.register_family(family)
    assert FAMILIES == before


def test_apply_tome_refuses_a_family_that_does_not_match_the_model():
    with pytest.raises(ValueError, match="Expected a model the family 'pixart' matches"):
        tp.apply_tome(torch.nn.Sequential(torch.nn.Linear(2, 2)), family="pixart")
    with pytest.raises(ValueError, match="registered family's name"):
        tp.apply_tome(torch.nn.Sequential(torch.nn.Linear(2, 2)), family="no such family")


def test_a_refused_model_says_why_and_where_to_read_more():
    refused, why = next(iter(REFUSED.items()))
    model = refused.__new__(refused)  # only its class is read
    torch.nn.Module.__init__(model)
    with pytest.raises(ValueError) as raised:
        tp.apply_tome(model, ratio=0.5)
    assert why in str(raised.value) and "docs/families.md" in str(raised.value)


def test_a_model_of_no_family_is_pointed_to_declaring_one():
    with pytest.raises(ValueError, match=r"none is declared\. docs/families\.md .*register_family"):
        tp.apply_tome(torch.nn.Sequential(torch.nn.Linear(2, 2)))
