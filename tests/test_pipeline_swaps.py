"""What a pipeline does to its UNet's processors keeps ToMe on: its fused projections (`pipe.fuse_qkv_projections()`,
with every preset, before or after ToMe, each way of turning it on), on SD and AnimateDiff; and a compiled
UNet with the README's first usage merges from its first call."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import tome_processors as tp
from tome_processors import ToMeConfig, ToMeProcessor

from models import tiny_unet, unet_inputs
from pipelines import TOME_USAGES, tiny_animatediff_pipeline, tiny_sd_pipeline


def sd_images(pipe) -> np.ndarray:
    with torch.no_grad():
        call = dict(height=32, width=32, num_inference_steps=2, output_type="np")
        return np.asarray(pipe("a cat", generator=torch.Generator().manual_seed(0), **call).images)


def animatediff_frames(pipe) -> np.ndarray:
    with torch.no_grad():
        call = dict(height=32, width=32, num_frames=4, num_inference_steps=2, output_type="np")
        return np.asarray(pipe("a cat", generator=torch.Generator().manual_seed(0), **call).frames)


FAMILIES = {"sd": (tiny_sd_pipeline, sd_images), "animatediff": (tiny_animatediff_pipeline, animatediff_frames)}


def turn_on(pipe, how: str, preset: str) -> None:
    if how == "apply_tome":
        tp.apply_tome(pipe, preset=preset)
    elif how == "apply_tome(unet)":
        tp.apply_tome(pipe.unet, preset=preset)
    elif how == "enable_tome":
        tp.enable_tome(pipe, preset=preset)
    else:  # the README's first usage
        pipe.unet.set_attn_processor(ToMeProcessor(config=ToMeConfig.for_model(pipe.unet, preset)))


@pytest.mark.parametrize("fuse_first", [False, True], ids=["fuse-after", "fuse-before"])
@pytest.mark.parametrize("preset", ["exact", "balanced", "fast"])
@pytest.mark.parametrize("how", [*TOME_USAGES, "apply_tome(unet)"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_pipeline_fuse_qkv_projections_keeps_tome_on_with_every_preset(
    family, how, preset, fuse_first, tmp_path, one_thread
):
    build, generate = FAMILIES[family]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # diffusers' notes about the tiny components' configs
        reference = build(tmp_path / "a")
        plain = generate(reference)
        tp.apply_tome(reference, preset=preset)
        merged = generate(reference)  # unfused, merging

        pipe = build(tmp_path / "b")
        if fuse_first:
            pipe.fuse_qkv_projections()
            turn_on(pipe, how, preset)
        else:
            turn_on(pipe, how, preset)
            generate(pipe)  # `set_attn_processor(ToMeProcessor())` attaches at the first forward
            pipe.fuse_qkv_projections()
        first, second = generate(pipe), generate(pipe)
        fused = any(getattr(m, "fused_projections", False) for m in pipe.unet.modules())
        applied = tp.is_tome_applied(pipe.unet)
        if not fuse_first:
            pipe.unfuse_qkv_projections()
            unfused = generate(pipe)
    assert fused and applied
    assert np.array_equal(first, second)
    assert not np.allclose(first, plain, atol=1e-4)  # merging
    np.testing.assert_allclose(first, merged, rtol=0, atol=2e-4)  # as unfused ToMe
    if not fuse_first:
        assert tp.is_tome_applied(pipe.unet)
        np.testing.assert_allclose(unfused, merged, rtol=0, atol=2e-4)
