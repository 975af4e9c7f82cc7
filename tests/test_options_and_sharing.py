"""Whole tiny pipelines: refused options leave what was on, one rule for `apply_tome` and `set_attn_processor`,
NumPy numbers as options, and ToMe on a UNet that two pipelines share (`from_pipe`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionImg2ImgPipeline, StableDiffusionPipeline

import tome_processors as tp
from tome_processors import ToMeConfig, ToMeProcessor
from tome_processors.hooks import context_of
from tome_processors.pipeline import tome_config_of

from leftovers import hooks_left
from pipelines import tiny_sd_pipeline

pytestmark = pytest.mark.usefixtures("one_thread")

ARGS = dict(prompt="a cat", height=32, width=32, num_inference_steps=2, output_type="np")


def generate(pipe) -> np.ndarray:
    return pipe(**ARGS, generator=torch.Generator().manual_seed(0)).images


def test_a_refused_enable_tome_leaves_the_earlier_one_on(tmp_path):
    pipe = tiny_sd_pipeline(tmp_path)
    tp.enable_tome(pipe, ratio=0.5)
    merged = generate(pipe)
    # st=2 is a video option: the UNet's family refuses it, before anything changes.
    with pytest.raises(ValueError, match="Expected st=1 on UNet2DConditionModel"):
        tp.enable_tome(pipe, ratio=0.5, st=2)
    assert tome_config_of(pipe) == ToMeConfig(ratio=0.5) and tp.is_tome_applied(pipe)
    assert np.array_equal(generate(pipe), merged)
    with pytest.raises(ValueError, match="Expected st=1"):
        tp.enable_tome(pipe, config=ToMeConfig(ratio=0.3, st=2))
    assert np.array_equal(generate(pipe), merged)
    tp.disable_tome(pipe)
    assert hooks_left(pipe.unet) == 0


def test_set_attn_processor_refuses_what_apply_tome_refuses(tmp_path):
    pipe = tiny_sd_pipeline(tmp_path)
    plain = generate(pipe)
    with pytest.raises(ValueError, match="Expected st=1 on UNet2DConditionModel") as applied:
        tp.apply_tome(pipe, ratio=0.5, st=2)
    assert hooks_left(pipe.unet) == 0
    pipe.unet.set_attn_processor(ToMeProcessor(ratio=0.5, st=2))
    with pytest.raises(ValueError, match="Expected st=1 on UNet2DConditionModel") as attached:
        generate(pipe)
    assert str(attached.value) == str(applied.value)  # one rule, one message
    assert context_of(pipe.unet) is None  # nothing attached
    with pytest.raises(ValueError, match="Expected st=1"):  # and the next call is refused as well
        generate(pipe)
    pipe.unet.set_attn_processor(ToMeProcessor(ratio=0.5))
    assert not np.allclose(generate(pipe), plain, atol=1e-6)


def test_numpy_numbers_are_options_like_python_numbers(tmp_path):
    config = ToMeConfig(ratio=np.float32(0.5), sx=np.int64(2), seed=np.int32(3), level_ratios={np.int64(1): 0.5})
    assert config == ToMeConfig(ratio=0.5, seed=3, level_ratios={1: 0.5})
    assert type(config.ratio) is float and type(config.seed) is int and type(config.sx) is int
    assert ToMeConfig(ratio=np.float64(0.25), ratio_start=np.float32(0.5)).ratio_start == 0.5
    for bad in (dict(ratio=True), dict(ratio=np.bool_(True)), dict(ratio="0.5"), dict(sx=np.float32(2.0))):
        with pytest.raises(ValueError, match="Expected"):
            ToMeConfig(**bad)

    pipe = tiny_sd_pipeline(tmp_path)
    tp.apply_tome(pipe, ratio=np.float32(0.5))
    numpy_ratio = generate(pipe)
    tp.apply_tome(pipe, ratio=0.5)
    assert np.array_equal(numpy_ratio, generate(pipe))
    tp.enable_tome(pipe, ratio=np.float32(0.5))
    assert tome_config_of(pipe) == ToMeConfig(ratio=0.5)
    assert np.array_equal(numpy_ratio, generate(pipe))
    pipe.unet.set_attn_processor(ToMeProcessor(ratio=np.float16(0.5)))  # kept on: contributes its inner processor
    tp.disable_tome(pipe)


def test_pipelines_sharing_a_unet_share_its_tome(tmp_path):
    base = tiny_sd_pipeline(tmp_path)
    plain = generate(base)
    other = StableDiffusionPipeline.from_pipe(base)
    other.set_progress_bar_config(disable=True)
    assert other.unet is base.unet

    tp.enable_tome(base, ratio=0.5)
    tp.enable_tome(other, ratio=0.3)  # the shared UNet now merges at 0.3: for both pipelines
    assert tome_config_of(base) == tome_config_of(other) == ToMeConfig(ratio=0.3)
    at_03 = generate(other)
    assert np.array_equal(generate(base), at_03)
    tp.enable_tome(base, ratio=0.5)
    assert tome_config_of(other) == ToMeConfig(ratio=0.5)
    assert not np.array_equal(generate(other), at_03)

    # Disabling either takes ToMe off the shared UNet, for both.
    tp.disable_tome(other)
    assert tome_config_of(base) is None and tome_config_of(other) is None
    assert not tp.is_tome_applied(base) and hooks_left(base.unet) == 0
    assert np.array_equal(generate(base), plain) and np.array_equal(generate(other), plain)
    tp.disable_tome(base)  # its own pipeline-level wrappers go too
    assert "maybe_free_model_hooks" not in vars(base) and "maybe_free_model_hooks" not in vars(other)

    # A pipeline made from one with ToMe enabled merges too, and reports it.
    tp.enable_tome(base, ratio=0.5)
    img2img = StableDiffusionImg2ImgPipeline.from_pipe(base)
    assert tome_config_of(img2img) == ToMeConfig(ratio=0.5)
    tp.disable_tome(img2img)
    assert tome_config_of(base) is None and hooks_left(base.unet) == 0
