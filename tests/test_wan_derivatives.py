"""The Wan derivatives diffusers ships, SkyReels-V2 and Wan VACE: Wan's family, through their pipelines.

Tiny random-weight models and pipelines (no downloads); the tokenizer is written locally.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import (
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    SkyReelsV2Pipeline,
    SkyReelsV2Transformer3DModel,
    UniPCMultistepScheduler,
    WanVACEPipeline,
    WanVACETransformer3DModel,
)
from PIL import Image
from transformers import UMT5Config, UMT5EncoderModel

import tome_processors as tp
from tome_processors import ToMeConfig, ToMeProcessor
from tome_processors.bench.pipelines import write_t5_tokenizer
from tome_processors.context import BlockState
from tome_processors.families import SkyReelsV2Family, WanFamily, WanVACEFamily, family_of
from tome_processors.hooks import context_of

from leftovers import hooks_left, tome_attributes_left
from test_video import TEXT_DIM, wan_inputs

#: The tiny VAE's latent channels; VACE's control input is the video's latents twice and an 8 x 8 mask per pixel.
Z_DIM = 4
VACE_IN = 2 * Z_DIM + 8 * 8

WAN_SHAPE = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,
    in_channels=Z_DIM,
    out_channels=Z_DIM,
    text_dim=TEXT_DIM,
    freq_dim=32,
    ffn_dim=32,
    num_layers=2,
    rope_max_seq_len=32,
)


def tiny_skyreels_v2(seed: int = 0) -> SkyReelsV2Transformer3DModel:
    torch.manual_seed(seed)
    return SkyReelsV2Transformer3DModel(**WAN_SHAPE).eval()


def tiny_wan_vace(seed: int = 0) -> WanVACETransformer3DModel:
    """Two main blocks, hints into both (two VACE blocks)."""
    torch.manual_seed(seed)
    return WanVACETransformer3DModel(**WAN_SHAPE, vace_layers=[0, 1], vace_in_channels=VACE_IN).eval()


def vace_inputs(batch: int = 2, frames: int = 5, h: int = 8, w: int = 12, seed: int = 0) -> dict:
    inputs = wan_inputs(batch, frames, h, w, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    inputs["control_hidden_states"] = torch.randn(batch, VACE_IN, frames, h, w, generator=generator)
    return inputs


def run(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample


MODELS = {
    "skyreels_v2": (tiny_skyreels_v2, wan_inputs, SkyReelsV2Family),
    "wan_vace": (tiny_wan_vace, vace_inputs, WanVACEFamily),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_derivatives_are_wan_with_wans_presets(name):
    build, make_inputs, family_type = MODELS[name]
    model, inputs = build(), make_inputs()
    family = family_of(model)
    assert type(family) is family_type and isinstance(family, WanFamily) and family.video
    assert family.presets == WanFamily.presets and family.defaults == WanFamily.defaults
    assert family.token_grid(model, (), inputs) == (5, 4, 6)
    expected = list(getattr(model, "vace_blocks", [])) + list(model.blocks)
    assert [site.module for site in family.blocks(model)] == expected
    assert ToMeConfig.for_model(model) == ToMeConfig(**WanFamily.defaults)
    baseline = run(model, inputs)
    for preset in ("exact", "balanced", "fast"):
        tp.apply_tome(model, preset=preset)
        out = run(model, inputs)
        assert torch.isfinite(out).all() and not torch.allclose(out, baseline, atol=1e-4), preset
    tp.remove_tome(model)
    assert torch.equal(run(model, inputs), baseline)
    assert hooks_left(model) == 0 and tome_attributes_left(model) == []


def self_attention_tokens(model: torch.nn.Module) -> dict[str, int]:
    """Record the query tokens each block's self-attention processor runs on (hooks on the inner processors)."""
    seen: dict[str, int] = {}
    for name, module in model.named_modules():
        if name.endswith("attn1"):
            inner = module.processor
            inner = inner.inner if isinstance(inner, ToMeProcessor) else inner

            def recording(attn, hidden_states, *args, _inner=inner, _name=name, **kwargs):
                seen[_name] = hidden_states.shape[1]
                return _inner(attn, hidden_states, *args, **kwargs)

            if isinstance(module.processor, ToMeProcessor):
                module.processor.__dict__["inner"] = recording
            else:
                module.processor = recording
    return seen


def test_vace_blocks_merge_the_control_stream_on_the_videos_grid():
    model, inputs = tiny_wan_vace(), vace_inputs()
    baseline = run(model, inputs)
    tp.apply_tome(model, ratio=0.5)
    seen = self_attention_tokens(model)
    merged = run(model, inputs)
    # 5 frames of 4 x 6 tokens, half merged away in every block, the VACE blocks' control stream included.
    assert seen == {f"{blocks}.{i}.attn1": 60 for blocks in ("vace_blocks", "blocks") for i in range(2)}
    assert torch.isfinite(merged).all() and not torch.allclose(merged, baseline, atol=1e-4)
    tp.remove_tome(model)
    assert torch.equal(run(model, inputs), baseline)


def test_vace_share_level_computes_the_videos_one_matching():
    # With `share_level`, the one matching per forward comes from the first VACE block's input: the video tokens
    # the first main block gets too, so the main blocks merge as they would without the VACE blocks merging.
    model, inputs = tiny_wan_vace(), vace_inputs()
    tp.apply_tome(model, ratio=0.5, share_level=True, st=2)
    metrics: list[torch.Tensor] = []
    original = BlockState.merge_for

    def recording(self, config, *args, **kwargs):
        metrics.append(self.metric)
        return original(self, config, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BlockState, "merge_for", recording)
        run(model, inputs)
    first = next(metric for metric in metrics if metric is not None)
    video = model.patch_embedding(inputs["hidden_states"]).flatten(2).transpose(1, 2)
    torch.testing.assert_close(first, video)
    assert len(context_of(model).model_state._shared) == 1


# Pipelines: a whole call twice with one seed, as a user runs them.


def _components(folder: Path) -> dict:
    tokenizer = write_t5_tokenizer(folder / "tokenizer-files")
    torch.manual_seed(0)
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer), d_model=TEXT_DIM, d_kv=8, d_ff=24, num_layers=2, num_heads=2, pad_token_id=0
        )
    ).eval()
    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=3,
        z_dim=Z_DIM,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * Z_DIM,
        latents_std=[1.0] * Z_DIM,
    ).eval()
    return dict(tokenizer=tokenizer, text_encoder=text_encoder, vae=vae)


def skyreels_pipeline(folder: Path) -> SkyReelsV2Pipeline:
    pipe = SkyReelsV2Pipeline(
        **_components(folder), transformer=tiny_skyreels_v2(), scheduler=UniPCMultistepScheduler(flow_shift=8.0)
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def vace_pipeline(folder: Path) -> WanVACEPipeline:
    pipe = WanVACEPipeline(
        **_components(folder), transformer=tiny_wan_vace(), scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0)
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


COMMON = dict(
    prompt="a cat walks",
    negative_prompt="blurry",
    height=32,
    width=32,
    num_frames=9,  # 3 latent frames of 2 x 2 tokens
    num_inference_steps=2,
    guidance_scale=5.0,
    max_sequence_length=16,
    output_type="np",
)


def generate_skyreels(pipe: SkyReelsV2Pipeline) -> np.ndarray:
    with torch.no_grad():
        return pipe(**COMMON, generator=torch.Generator().manual_seed(0)).frames


def generate_vace(pipe: WanVACEPipeline) -> np.ndarray:
    rng = np.random.default_rng(0)
    video = [Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)) for _ in range(9)]
    with torch.no_grad():
        return pipe(**COMMON, video=video, generator=torch.Generator().manual_seed(0)).frames


PIPELINES: dict[str, tuple[Callable[[Path], object], Callable[[object], np.ndarray]]] = {
    "skyreels_v2": (skyreels_pipeline, generate_skyreels),
    "wan_vace": (vace_pipeline, generate_vace),
}


@pytest.mark.parametrize("how", ["apply_tome", "set_attn_processor", pytest.param("preset", marks=pytest.mark.slow)])
@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_pipelines_merge_and_generate_the_same_video_twice(tmp_path, name, how):
    build, generate = PIPELINES[name]
    pipe = build(tmp_path)
    baseline = generate(pipe)
    merged_blocks: set[int] = set()
    original = BlockState.merge_for

    def recording(self, config, *args, **kwargs):
        merge = original(self, config, *args, **kwargs)
        if merge is not None:
            merged_blocks.add(self.index)
        return merge

    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # ToMe merges here: nothing to warn about
        if how == "apply_tome":
            tp.apply_tome(pipe, ratio=0.5)
        elif how == "preset":
            tp.apply_tome(pipe, preset="balanced")
        else:
            pipe.transformer.set_attn_processor(ToMeProcessor(ratio=0.5))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(BlockState, "merge_for", recording)
            first = generate(pipe)
        second = generate(pipe)
    assert tp.is_tome_applied(pipe)
    assert merged_blocks == set(range(len(context_of(pipe.transformer).blocks)))  # every block merged
    assert first.shape == baseline.shape and np.isfinite(first).all()
    np.testing.assert_array_equal(first, second)
    assert not np.array_equal(first, baseline)
    tp.remove_tome(pipe)
    assert not tp.is_tome_applied(pipe)
    np.testing.assert_array_equal(generate(pipe), baseline)
