"""Presets: `ToMeConfig.from_preset`, `apply_tome(preset=...)`, `enable_tome(preset=...)` on every family."""

from __future__ import annotations

import pytest
import torch

import tome_processors as tp
from test_wan_derivatives import MODELS as WAN_DERIVATIVES
from tome_processors import ToMeConfig, ToMeMixin
from tome_processors.bench.presets import preset_table
from tome_processors.bench.quality import QualityProbe, probe_quality
from tome_processors.cli.main import main
from tome_processors.config import PRESETS
from tome_processors.families import FAMILIES, family_of
from tome_processors.hooks import context_of
from tome_processors.pipeline import tome_config_of

from family_cases import CASES as TABLE_CASES
from models import tiny_unet
from pipelines import svd_inputs, tiny_sd_pipeline, tiny_svd_unet
from test_dit import ARCHS
from test_hunyuanvideo import hunyuanvideo15_inputs, hunyuanvideo_inputs, tiny_hunyuanvideo, tiny_hunyuanvideo15
from test_ltx import ltx_inputs, tiny_ltx
from test_ltx2 import ltx2_inputs, tiny_ltx2
from test_new_families import CASES
from test_video import tiny_wan, wan_inputs

FAMILY_NAMES = sorted(FAMILIES)


def unet_inputs(batch: int = 2, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "sample": torch.randn(batch, 4, 16, 16, generator=g),
        "timestep": torch.tensor(500),
        "encoder_hidden_states": torch.randn(batch, 7, 32, generator=g),
    }


def model_and_inputs(family: str) -> tuple[torch.nn.Module, dict]:
    if family == "unet":
        return tiny_unet("sd15").eval(), unet_inputs()
    if family == "svd":
        return tiny_svd_unet(), svd_inputs()
    if family in CASES:  # Qwen-Image, FLUX.2, Chroma, Z-Image (tests/test_new_families.py)
        return CASES[family].build(), CASES[family].inputs()
    if family == "wan":
        return tiny_wan(), wan_inputs()
    if family in WAN_DERIVATIVES:  # SkyReels-V2, Wan VACE
        build, make_inputs, _ = WAN_DERIVATIVES[family]
        return build(), make_inputs()
    if family == "ltx":
        return tiny_ltx(), ltx_inputs()
    if family == "ltx2":
        return tiny_ltx2(), ltx2_inputs()
    if family == "hunyuanvideo":
        return tiny_hunyuanvideo(), hunyuanvideo_inputs()
    if family == "hunyuanvideo15":
        return tiny_hunyuanvideo15(), hunyuanvideo15_inputs()
    table = [case for case in TABLE_CASES.values() if case.family == family]  # tests/family_cases/
    if table:
        return table[0].build(), table[0].inputs()
    return ARCHS[family].build(), ARCHS[family].inputs()


def forward(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        sample = model(**inputs).sample
    return torch.stack(sample) if isinstance(sample, list) else sample  # Z-Image: one tensor per sample


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_family_has_every_preset_and_they_differ(family):
    configs = {name: ToMeConfig.from_preset(name, family) for name in PRESETS}
    assert set(FAMILIES[family].presets) == set(PRESETS)
    # "exact" is the default (tomesd's), merging only where it pays; every preset does (pays_only).
    assert configs["exact"] == ToMeConfig.for_model(family).replace(pays_only=True)
    assert all(config.pays_only for config in configs.values()) and not ToMeConfig.for_model(family).pays_only
    assert len(set(configs.values())) == len(PRESETS)
    # "exact" is tomesd's algorithm: per-block matching in self-attention, no reuse, no K/V pooling.
    exact = configs["exact"]
    assert (exact.mode, exact.share_level, exact.merge_mlp, exact.recompute_every) == ("merge", False, False, 1)


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_each_preset_applies_runs_and_is_removed_exactly(family):
    model, inputs = model_and_inputs(family)
    baseline = forward(model, inputs)
    for name in PRESETS:
        assert tp.apply_tome(model, preset=name) is model
        assert context_of(model).model_state.config == ToMeConfig.from_preset(name, model)
        merged = forward(model, inputs)
        assert torch.isfinite(merged).all() and not torch.equal(merged, baseline), name
        tp.remove_tome(model)
        assert torch.equal(forward(model, inputs), baseline)


def test_explicit_options_override_the_preset():
    unet = tiny_unet("sd15")
    fast = ToMeConfig.from_preset("fast", unet)
    assert ToMeConfig.from_preset("fast", unet, kv_factor=2) == fast.replace(kv_factor=2)
    tp.apply_tome(unet, preset="fast", seed=7)
    assert context_of(unet).model_state.config == fast.replace(seed=7)
    pixart = ARCHS["pixart"].build()
    tp.apply_tome(pixart, preset="balanced", ratio=0.3)
    config = context_of(pixart).model_state.config
    assert config.ratio == 0.3 and config == ToMeConfig.from_preset("balanced", pixart).replace(ratio=0.3)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda m: tp.apply_tome(m, preset="turbo"), ValueError, "preset to be one of"),
        (lambda m: tp.apply_tome(m, ToMeConfig(), preset="fast"), ValueError, "not both"),
        (lambda m: tp.apply_tome(m, preset="fast", ratio=0.9), ValueError, "ratio between"),
        (lambda m: ToMeConfig.from_preset(None, m), ValueError, "preset to be one of"),
        (lambda m: ToMeConfig.from_preset("fast", "dit"), ValueError, "family name among"),
        (lambda m: ToMeConfig.from_preset("fast", 3), TypeError, "diffusers model or a family name"),
    ],
)
def test_bad_presets_raise_before_anything_changes(call, error, match):
    unet = tiny_unet("sd15").eval()
    inputs = unet_inputs()
    baseline = forward(unet, inputs)
    with pytest.raises(error, match=match):
        call(unet)
    assert context_of(unet) is None and torch.equal(forward(unet, inputs), baseline)


def test_unsupported_model_names_its_class():
    with pytest.raises(ValueError, match="Linear"):
        ToMeConfig.from_preset("fast", torch.nn.Linear(2, 2))


def test_enable_tome_with_a_preset_on_a_pipeline(tmp_path):
    pipe = tiny_sd_pipeline(tmp_path)
    tp.enable_tome(pipe, preset="balanced")
    assert tp.is_tome_applied(pipe)
    assert tome_config_of(pipe) == ToMeConfig.from_preset("balanced", pipe.unet)
    tp.enable_tome(pipe, 0.3, preset="exact")  # `ratio` overrides the preset too
    assert tome_config_of(pipe) == ToMeConfig(ratio=0.3, pays_only=True)
    tp.enable_tome(pipe)  # no arguments: the family's defaults, as before presets existed
    assert tome_config_of(pipe) == ToMeConfig.for_model(pipe.unet)
    with pytest.raises(ValueError, match="not both"):
        tp.enable_tome(pipe, config=ToMeConfig(), preset="fast")
    assert tome_config_of(pipe) == ToMeConfig.for_model(pipe.unet)  # unchanged by the bad call
    tp.disable_tome(pipe)


def test_mixin_enable_tome_takes_a_preset(tmp_path):
    base = tiny_sd_pipeline(tmp_path)

    class MyPipeline(ToMeMixin, type(base)):
        pass

    pipe = MyPipeline(**base.components, requires_safety_checker=False)
    pipe.enable_tome(preset="fast")
    assert pipe.tome_config == ToMeConfig.from_preset("fast", family_of(pipe.unet).name)
    pipe.disable_tome()
    assert pipe.tome_config is None


def test_unet_fast_pools_the_first_two_attention_levels_of_the_model():
    # SD1.5's first attention level is downsample 1, SDXL's is 2: "fast" pools the first two of each.
    assert ToMeConfig.from_preset("fast", tiny_unet("sd15")).max_downsample == 2
    assert ToMeConfig.from_preset("fast", tiny_unet("sdxl")).max_downsample == 4
    assert ToMeConfig.from_preset("fast", "unet").max_downsample == 2  # no model: SD1.5's layout
    # 4x4 at the first of them, 2x2 at the second.
    assert ToMeConfig.from_preset("fast", tiny_unet("sd15")).level_kv_factors == ((2, 2),)
    sdxl = ToMeConfig.from_preset("fast", tiny_unet("sdxl"))
    assert (sdxl.kv_factor_at(2), sdxl.kv_factor_at(4)) == (4, 2)


def test_kv_factors_per_level_pool_each_level_with_its_own_window():
    unet = tiny_unet("sd15")
    inputs = unet_inputs()
    base = dict(mode="downsample_kv", kv_pool="nearest", max_downsample=2, pays_only=False)

    def run(**options):
        tp.apply_tome(unet, ToMeConfig(**base, **options))
        with torch.no_grad():
            out = unet(**inputs).sample
        tp.remove_tome(unet)
        return out

    uniform4, uniform2, mixed = run(kv_factor=4), run(kv_factor=2), run(kv_factor=4, level_kv_factors={2: 2})
    assert not torch.equal(mixed, uniform4) and not torch.equal(mixed, uniform2)
    assert torch.equal(run(kv_factor=4, level_kv_factors={2: 4}), uniform4)  # the level's factor is kv_factor's
    assert torch.equal(run(kv_factor=4, level_kv_factors={1: 2, 2: 2}), uniform2)


def test_presets_quality_on_the_trained_unet_denoiser():
    """The quality targets of the presets, on the shipped trained UNet (two of the probe's four timesteps).

    "balanced" changes the noise prediction by no more than ToMe at 0.5 (tomesd's algorithm,
    "exact") does, and "fast" by no more than twice that. Measured (docs/options.md): exact 1.40%,
    balanced 0.24%, fast 1.18%.
    """
    pytest.importorskip("skimage")
    probe = QualityProbe.default(timesteps=(300, 700))
    change = {
        name: probe.measure(lambda unet, name=name: tp.apply_tome(unet, preset=name), tp.remove_tome)["eps_rel_change"]
        for name in PRESETS
    }
    tome_half = probe.measure(lambda unet: tp.apply_tome(unet, ToMeConfig(ratio=0.5)), tp.remove_tome)
    assert change["exact"] == tome_half["eps_rel_change"] > 0
    assert 0 < change["balanced"] <= change["exact"]
    assert 0 < change["fast"] <= 2 * change["exact"]


@pytest.mark.parametrize("family", ["pixart", "sd3"])
def test_transformer_presets_quality_on_the_trained_dit(family):
    """The same targets on the trained PixArt-shaped DiT, which PixArt's and SD3's presets run on (the joint
    and video families': tests/test_trained_shapes.py)."""
    pytest.importorskip("skimage")
    timesteps = (100, 500)
    reference = probe_quality(ToMeConfig(ratio=0.5), "dit", timesteps=timesteps)["eps_rel_change"]
    change = {
        name: probe_quality(ToMeConfig.from_preset(name, family), "dit", timesteps=timesteps)["eps_rel_change"]
        for name in ("balanced", "fast")
    }
    assert 0 < change["balanced"] <= reference
    assert change["balanced"] < change["fast"] <= 2 * reference


def test_preset_table_marks_a_missed_target():
    row = {"family": "sd3", "denoiser": "dit", "preset": "fast", "settings": "ratio=0.7", "eps_change": 0.3}
    row |= {"psnr_drop": 1.0, "image_change": 0.2, "image_psnr_drop": 0.5, "target": 0.2, "within_target": False}
    table = preset_table([row, {**row, "eps_change": 0.1, "within_target": True}])
    lines = table.splitlines()
    assert "(missed)" in lines[2] and "(missed)" not in lines[3] and "| 30.00 | <= 20.00" in lines[2]


def test_quality_command_refuses_unknown_families(capsys):
    assert main(["quality", "--presets", "dit"]) == 2
    assert "Expected --presets among" in capsys.readouterr().err
