"""One plan per model: turning ToMe on looks the model's family up once and walks its modules once, whatever the
family; everything after reads the plan."""

from __future__ import annotations

import pytest
import torch

import tome_processors as tp
from tome_processors import families
from tome_processors.hooks import context_of
from tome_processors.plan import plan_tome

from family_cases import CASES
from models import tiny_unet
from pipelines import tiny_sd_pipeline
from test_dit import tiny_flux


class Counted:
    """Counts the family look-ups (`find_family`) and the walks over one model's modules (`named_modules` of the
    model itself; `modules()` goes through it) while it is on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *models: torch.nn.Module) -> None:
        self.lookups = 0
        self.walks = {id(model): 0 for model in models}
        find = families.find_family

        def counting_find(model):
            self.lookups += 1
            return find(model)

        for module in ("tome_processors.families", "tome_processors.apply", "tome_processors.attach"):
            monkeypatch.setattr(f"{module}.find_family", counting_find, raising=False)
        for model in models:
            walk = model.named_modules

            def counting_walk(*args, _walk=walk, _model=model, **kwargs):
                self.walks[id(_model)] += 1
                return _walk(*args, **kwargs)

            monkeypatch.setattr(model, "named_modules", counting_walk)


MODELS = {"unet": lambda: tiny_unet("sd15"), "sdxl": lambda: tiny_unet("sdxl"), "flux": tiny_flux}
for _name in ("wan_animate", "hunyuanimage", "kandinsky5", "krea2"):
    if _name in CASES:
        MODELS[_name] = CASES[_name].build


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("preset", [None, "balanced"])
def test_apply_tome_looks_the_family_up_once_and_walks_the_modules_once(name, preset, monkeypatch):
    model = MODELS[name]()
    counted = Counted(monkeypatch, model)
    tp.apply_tome(model, preset=preset)
    assert (counted.lookups, counted.walks[id(model)]) == (1, 1)
    assert context_of(model).plan.family.name == families.family_of(model).name


def test_enable_tome_plans_each_model_once(tmp_path, monkeypatch):
    pipe = tiny_sd_pipeline(tmp_path)
    counted = Counted(monkeypatch, pipe.unet)
    tp.enable_tome(pipe, preset="fast")
    assert (counted.lookups, counted.walks[id(pipe.unet)]) == (1, 1)
    tp.disable_tome(pipe)


def test_the_plan_holds_the_family_the_config_and_every_site():
    unet = tiny_unet("sd15")
    plan = plan_tome(unet, preset="balanced")
    assert plan.family.name == "unet" and plan.config == tp.ToMeConfig.from_preset("balanced", unet)
    assert len(plan.sites) == len(plan.family.blocks(unet)) and plan.attentions
    assert all(
        any(a.module is attn for a in site.attentions) for site in plan.sites for attn in [site.attentions[0].module]
    )
    context = context_of(tp.apply_tome(unet, preset="balanced"))
    assert [site.module for site in context.plan.sites] == context.block_modules
