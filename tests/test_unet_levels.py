"""The level search: ToMe merges at the first UNet level with self-attention in every UNet diffusers builds.

ControlNet-XS's UNet keeps its attention as `base_attentions` / `ctrl_attentions`, and the x4 upscaler's UNet
attends to the text only (`only_cross_attention`) at its first attention level: both merge at the first level
whose blocks attend over the image tokens themselves.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    DDPMScheduler,
    StableDiffusionUpscalePipeline,
    UNet2DConditionModel,
    UNetControlNetXSModel,
)
from diffusers.models.attention_processor import AttnProcessor2_0
from PIL import Image

import tome_processors as tp
from tome_processors import ToMeProcessor
from tome_processors.bench.pipelines import write_clip_tokenizer
from tome_processors.families import attention_levels, family_of

from models import CROSS_DIM, tiny_unet
from pipelines import TOKENS, tiny_text_encoder


class QueryCounts(AttnProcessor2_0):
    """SDPA, recording how many query tokens each self-attention call gets."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens: list[int] = []

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None, **kwargs):
        if encoder_hidden_states is None and not attn.is_cross_attention:
            self.tokens.append(hidden_states.shape[1])
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, temb, **kwargs)


def tiny_controlnet_xs() -> UNetControlNetXSModel:
    """diffusers' own test layout: attention starts at the second level (down_blocks[1])."""
    torch.manual_seed(0)
    return UNetControlNetXSModel(
        sample_size=16,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(4, 8),
        cross_attention_dim=8,
        transformer_layers_per_block=1,
        num_attention_heads=2,
        norm_num_groups=4,
        upcast_attention=False,
        ctrl_block_out_channels=[2, 4],
        ctrl_num_attention_heads=4,
        ctrl_max_norm_num_groups=2,
        ctrl_conditioning_embedding_out_channels=(2, 2),
    ).eval()


def controlnet_xs_inputs() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "sample": torch.randn(2, 4, 48, 48, generator=g),  # level 2: 24 x 24 = 576 tokens
        "timestep": torch.tensor([10]),
        "encoder_hidden_states": torch.randn(2, 4, 8, generator=g),
        "controlnet_cond": torch.randn(2, 3, 96, 96, generator=g),
        "conditioning_scale": 1.0,
    }


def x4_unet() -> UNet2DConditionModel:
    """diffusers' tiny x4-upscaler UNet: level 2 attends to the text only, level 4 over the image too."""
    torch.manual_seed(0)
    return UNet2DConditionModel(
        block_out_channels=(32, 32, 64),
        layers_per_block=2,
        sample_size=32,
        in_channels=7,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=CROSS_DIM,
        attention_head_dim=8,
        use_linear_projection=True,
        only_cross_attention=(True, True, False),
        num_class_embeds=100,
    ).eval()


def test_levels_come_from_where_the_self_attention_blocks_sit():
    assert attention_levels(tiny_unet("sd15")) == [1, 2, 4]  # its mid block at 4
    assert attention_levels(tiny_unet("sdxl")) == [2, 4]
    assert attention_levels(tiny_controlnet_xs()) == [2]
    assert attention_levels(x4_unet()) == [4]
    model = tiny_controlnet_xs()
    family = family_of(model)
    assert family.auto_downsample(model) == 2 and family.auto_downsample(x4_unet()) == 4
    # Both streams' blocks (base and control) sit at level 2, as does the mid block's.
    assert set(family.block_levels(model, [site.module for site in family.blocks(model)])) == {2}


@pytest.mark.parametrize("how", ["apply_tome", "set_attn_processor"])
def test_controlnet_xs_merges_at_its_first_attention_level(how):
    model, inputs = tiny_controlnet_xs(), controlnet_xs_inputs()
    recorder = QueryCounts()
    model.set_attn_processor(recorder)
    with torch.no_grad():
        baseline = model(**inputs).sample
    plain = list(recorder.tokens)
    assert set(plain) == {576}  # 24 x 24 at level 2, the mid block's too (the last level does not downsample)
    recorder.tokens.clear()
    if how == "apply_tome":
        tp.apply_tome(model, ratio=0.5)
    else:
        model.set_attn_processor(ToMeProcessor(recorder, ratio=0.5))
    with torch.no_grad():
        merged = model(**inputs).sample
    assert tp.is_tome_applied(model)
    # Every level-2 self-attention, of the base and the control stream alike, sees half the tokens.
    assert recorder.tokens == [288] * len(plain)
    assert torch.isfinite(merged).all() and not torch.allclose(merged, baseline, atol=1e-5)
    tp.remove_tome(model)
    with torch.no_grad():
        assert torch.equal(model(**inputs).sample, baseline)


# The x4 upscaler's pipeline, tiny and offline (diffusers' own test components, a tokenizer written here).


def tiny_upscale_pipeline(folder: Path) -> StableDiffusionUpscalePipeline:
    tokenizer = write_clip_tokenizer(folder / "tokenizer-files", max_length=TOKENS)
    torch.manual_seed(0)
    vae = AutoencoderKL(
        block_out_channels=(32, 32, 64),
        down_block_types=("DownEncoderBlock2D",) * 3,
        up_block_types=("UpDecoderBlock2D",) * 3,
        latent_channels=4,
        scaling_factor=0.08333,  # the x4 upscaler's
    ).eval()
    pipe = StableDiffusionUpscalePipeline(
        vae=vae,
        text_encoder=tiny_text_encoder(len(tokenizer)),
        tokenizer=tokenizer,
        unet=x4_unet(),
        low_res_scheduler=DDPMScheduler(),
        scheduler=DDIMScheduler(prediction_type="v_prediction"),
        max_noise_level=350,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def upscale(pipe: StableDiffusionUpscalePipeline) -> np.ndarray:
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 32, 3), dtype=np.uint8))
    with torch.no_grad():
        return pipe(
            "a cat",
            image=image,
            num_inference_steps=2,
            guidance_scale=6.0,
            noise_level=20,
            generator=torch.Generator().manual_seed(0),
            output_type="np",
        ).images


@pytest.mark.parametrize("how", ["apply_tome", "set_attn_processor", "enable_tome"])
def test_x4_upscaler_merges_at_its_first_self_attention_level(tmp_path, request, how):
    pipe = tiny_upscale_pipeline(tmp_path)
    recorder = QueryCounts()
    pipe.unet.set_attn_processor(recorder)
    baseline = upscale(pipe)
    plain = list(recorder.tokens)
    assert set(plain) == {8 * 8}  # a 32 x 32 px image is a 32 x 32 latent, 8 x 8 at level 4
    recorder.tokens.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # it merges: nothing to warn about
        if how == "apply_tome":
            tp.apply_tome(pipe, ratio=0.5)
        elif how == "enable_tome":
            tp.enable_tome(pipe, ratio=0.5)
        else:
            pipe.unet.set_attn_processor(ToMeProcessor(recorder, ratio=0.5))
        first = upscale(pipe)
    assert tp.is_tome_applied(pipe)
    assert recorder.tokens == [32] * len(plain)  # every self-attention merged, half its tokens
    assert np.isfinite(first).all() and not np.array_equal(first, baseline)
    np.testing.assert_array_equal(upscale(pipe), first)
    tp.disable_tome(pipe) if how == "enable_tome" else tp.remove_tome(pipe)
    assert not tp.is_tome_applied(pipe)
    np.testing.assert_array_equal(upscale(pipe), baseline)


def test_a_unet_that_attends_to_the_text_only_says_it_merges_no_attention():
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(8, 16),
        norm_num_groups=8,
        cross_attention_dim=8,
        attention_head_dim=2,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        only_cross_attention=True,
        mid_block_type=None,  # its mid block would attend over the image
    ).eval()
    assert attention_levels(unet) == []
    with pytest.warns(UserWarning, match="none of its blocks attends over the image tokens"):
        tp.apply_tome(unet, ratio=0.5)
