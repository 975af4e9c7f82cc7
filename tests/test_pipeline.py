"""`pipe.enable_tome()`, `disable_tome()`, `tome_config`, `ToMeMixin` and `patch_pipelines()` on real tiny pipelines."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import (
    ControlNetModel,
    DDIMScheduler,
    StableDiffusionControlNetImg2ImgPipeline,
    StableDiffusionControlNetPipeline,
    StableDiffusionImg2ImgPipeline,
    StableDiffusionInpaintPipeline,
    StableDiffusionPipeline,
    StableDiffusionXLControlNetPipeline,
    StableDiffusionXLImg2ImgPipeline,
    StableDiffusionXLPipeline,
)
from diffusers.models.attention_processor import AttnProcessor2_0
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

import tome_processors as tp
from tome_processors import ToMeConfig, ToMeMixin, ToMeProcessor
from tome_processors.bench.pipelines import write_clip_tokenizer

from leftovers import hooks_left
from models import CROSS_DIM, tiny_unet
from pipelines import TOKENS, tiny_sd_pipeline, tiny_vae

pytestmark = pytest.mark.usefixtures("one_thread")

SIZE = 32  # pixels; the tiny VAE downsamples by 2, so the UNet sees a 16x16 latent


# ---------------------------------------------------------------- tiny pipelines


def scheduler() -> DDIMScheduler:
    return DDIMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", clip_sample=False)


def sd_components(tmp_path: Path) -> dict:
    pipe = tiny_sd_pipeline(tmp_path)
    return dict(pipe.components)


def tiny_controlnet(unet) -> ControlNetModel:
    torch.manual_seed(1)
    # One stride-2 step in the conditioning embedding: the same factor 2 as the tiny VAE.
    net = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(8, 16)).eval()
    with torch.no_grad():  # the output convolutions start at zero: give them weights so the net matters
        for conv in [*net.controlnet_down_blocks, net.controlnet_mid_block]:
            conv.weight.normal_(0, 0.3)
    return net


def sdxl_pipeline(tmp_path: Path) -> StableDiffusionXLPipeline:
    tokenizer = write_clip_tokenizer(Path(tmp_path) / "tokenizer-files", max_length=TOKENS)
    half = CROSS_DIM // 2  # the two text encoders' hidden states are concatenated
    torch.manual_seed(0)
    encoder_1 = CLIPTextModel(_text_config(len(tokenizer), half)).eval()
    torch.manual_seed(1)
    encoder_2 = CLIPTextModelWithProjection(_text_config(len(tokenizer), half, projection_dim=CROSS_DIM)).eval()
    pipe = StableDiffusionXLPipeline(
        vae=tiny_vae(),
        text_encoder=encoder_1,
        text_encoder_2=encoder_2,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer,
        unet=tiny_unet("sdxl"),
        scheduler=scheduler(),
        force_zeros_for_empty_prompt=True,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _text_config(vocab_size: int, hidden: int, projection_dim: int | None = None) -> CLIPTextConfig:
    extra = {} if projection_dim is None else {"projection_dim": projection_dim}
    return CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=TOKENS,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        **extra,
    )


def make_pipeline(kind: str, tmp_path: Path):
    """A tiny real pipeline of `kind` and the call arguments of a 2-step generation."""
    generator_args = dict(num_inference_steps=2, output_type="np")
    image = torch.rand(1, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(5))
    if kind.startswith("sdxl"):
        pipe = sdxl_pipeline(tmp_path)
        if kind == "sdxl-controlnet":
            pipe = StableDiffusionXLControlNetPipeline(**pipe.components, controlnet=tiny_controlnet(pipe.unet))
            pipe.set_progress_bar_config(disable=True)
            return pipe, dict(prompt="a cat", image=image, height=SIZE, width=SIZE, **generator_args)
        if kind == "sdxl-img2img":
            pipe = StableDiffusionXLImg2ImgPipeline.from_pipe(pipe)
            pipe.set_progress_bar_config(disable=True)
            return pipe, dict(prompt="a cat", image=image, strength=1.0, **generator_args)
        return pipe, dict(prompt="a cat", height=SIZE, width=SIZE, **generator_args)
    base = tiny_sd_pipeline(tmp_path)
    if kind == "sd":
        return base, dict(prompt="a cat", height=SIZE, width=SIZE, **generator_args)
    if kind == "img2img":
        pipe = StableDiffusionImg2ImgPipeline.from_pipe(base)
        pipe.set_progress_bar_config(disable=True)
        return pipe, dict(prompt="a cat", image=image, strength=1.0, **generator_args)
    if kind == "inpaint":
        pipe = StableDiffusionInpaintPipeline.from_pipe(base)
        pipe.set_progress_bar_config(disable=True)
        mask = torch.zeros(1, 1, SIZE, SIZE)
        mask[..., 8:24, 8:24] = 1
        return pipe, dict(
            prompt="a cat", image=image, mask_image=mask, height=SIZE, width=SIZE, strength=1.0, **generator_args
        )
    if kind in ("controlnet", "controlnet-img2img"):
        components = dict(base.components, controlnet=tiny_controlnet(base.unet))
        if kind == "controlnet":
            pipe = StableDiffusionControlNetPipeline(**components)
            args = dict(prompt="a cat", image=image, height=SIZE, width=SIZE, **generator_args)
        else:
            pipe = StableDiffusionControlNetImg2ImgPipeline(**components)
            args = dict(prompt="a cat", image=image, control_image=image, strength=1.0, **generator_args)
        pipe.set_progress_bar_config(disable=True)
        return pipe, args
    raise ValueError(f"Expected a known pipeline kind, but got {kind!r}.")


def generate(pipe, args: dict, seed: int = 0, **extra) -> np.ndarray:
    with torch.no_grad():
        return pipe(**args, **extra, generator=torch.Generator().manual_seed(seed)).images


def inner_types(model) -> set[type]:
    """The classes of the processors ToMe wraps (every processor must be a ToMe wrapper)."""
    processors = model.attn_processors.values()
    assert all(isinstance(p, ToMeProcessor) for p in processors), {type(p).__name__ for p in processors}
    return {type(p.inner) for p in processors}


def tome_leftovers(obj) -> list[str]:
    names = [name for name in vars(obj) if name.startswith("_tome") or name in ("set_attn_processor",)]
    if isinstance(obj, torch.nn.Module):
        names += [name for m in obj.modules() for name in vars(m) if name.startswith("_tome")]
    return names


KINDS = ["sd", "img2img", "inpaint", "sdxl", "sdxl-img2img", "controlnet", "controlnet-img2img", "sdxl-controlnet"]


@pytest.fixture
def patched():
    tp.patch_pipelines()
    yield
    tp.unpatch_pipelines()


# ---------------------------------------------------------------- every pipeline kind


@pytest.mark.parametrize("kind", KINDS)
def test_enable_changes_images_reproducibly_and_disable_restores_them_bit_for_bit(kind, tmp_path, patched):
    pipe, args = make_pipeline(kind, tmp_path)
    baseline = generate(pipe, args)
    assert pipe.tome_config is None

    pipe.enable_tome(ratio=0.5)
    assert pipe.tome_config == ToMeConfig(ratio=0.5)
    assert inner_types(pipe.unet) == {AttnProcessor2_0}
    first = generate(pipe, args)
    second = generate(pipe, args)
    assert np.isfinite(first).all()
    assert np.array_equal(first, second)  # same generator, same image, run after run
    assert not np.allclose(first, baseline, atol=1e-5)

    pipe.disable_tome()
    assert pipe.tome_config is None
    assert not tp.is_tome_applied(pipe)
    assert np.array_equal(generate(pipe, args), baseline)
    assert hooks_left(pipe.unet) == 0 and tome_leftovers(pipe.unet) == [] and tome_leftovers(pipe) == []


def test_reuse_across_steps_starts_afresh_with_every_generation(tmp_path, patched):
    # Three steps with recompute_every=2: without a reset at the end of a call, the next generation's
    # first step would reuse the last generation's merge, and the same seed would give another image.
    pipe, args = make_pipeline("sd", tmp_path)
    args = dict(args, num_inference_steps=3)
    pipe.enable_tome(ratio=0.5, recompute_every=2)
    first = generate(pipe, args)
    assert np.array_equal(generate(pipe, args), first)
    assert "maybe_free_model_hooks" in vars(pipe)
    pipe.disable_tome()
    assert "maybe_free_model_hooks" not in vars(pipe)


def test_options_reach_the_config_and_enabling_again_replaces_them(tmp_path, patched):
    pipe, args = make_pipeline("sd", tmp_path)
    pipe.enable_tome(ratio=0.3, max_downsample=2, use_rand=False)
    assert pipe.tome_config == ToMeConfig(ratio=0.3, max_downsample=2, use_rand=False)
    once = generate(pipe, args)
    pipe.enable_tome(config=ToMeConfig(ratio=0.6), use_rand=False)
    assert pipe.tome_config == ToMeConfig(ratio=0.6, use_rand=False)
    assert {p.config for p in pipe.unet.attn_processors.values()} == {pipe.tome_config}
    assert hooks_left(pipe.unet) > 0
    pipe.enable_tome(ratio=0.3, max_downsample=2, use_rand=False)
    assert np.array_equal(generate(pipe, args), once)


def test_bad_input_raises_before_anything_changes(tmp_path, patched):
    pipe, args = make_pipeline("sd", tmp_path)
    baseline = generate(pipe, args)
    with pytest.raises(ValueError, match="Expected ratio"):
        pipe.enable_tome(ratio=0.9)
    with pytest.raises(TypeError, match="unknown"):
        pipe.enable_tome(ratoi=0.5)
    with pytest.raises(TypeError, match="Expected controlnet to be a bool"):
        pipe.enable_tome(controlnet="yes")
    with pytest.raises(ValueError, match="Expected a pipeline with a `controlnet`"):
        pipe.enable_tome(controlnet=True)
    assert pipe.tome_config is None and hooks_left(pipe.unet) == 0
    assert np.array_equal(generate(pipe, args), baseline)

    pipe.enable_tome(ratio=0.5)
    config = pipe.tome_config
    with pytest.raises(ValueError, match="Expected ratio"):
        pipe.enable_tome(ratio=2.0)
    assert pipe.tome_config == config  # a failed re-enable leaves the earlier one on


def test_pipeline_without_a_unet_is_refused():
    class NoUNet:
        pass

    with pytest.raises(TypeError, match="Expected a diffusers pipeline with a `unet`"):
        tp.enable_tome(NoUNet())
    assert tp.disable_tome(NoUNet()) is not None  # disabling something never enabled does nothing


def test_mixin_on_a_pipeline_subclass(tmp_path):
    class MyPipeline(ToMeMixin, StableDiffusionPipeline):
        pass

    base, args = make_pipeline("sd", tmp_path)
    pipe = MyPipeline(**base.components)
    pipe.set_progress_bar_config(disable=True)
    baseline = generate(pipe, args)
    pipe.enable_tome(ratio=0.5)
    assert pipe.tome_config.ratio == 0.5 and tp.is_tome_applied(pipe)
    assert not np.allclose(generate(pipe, args), baseline, atol=1e-5)
    pipe.disable_tome()
    assert np.array_equal(generate(pipe, args), baseline)
    assert not hasattr(StableDiffusionPipeline, "enable_tome")  # the mixin alone patches nothing


def test_patch_pipelines_is_idempotent_and_removable(tmp_path):
    assert not hasattr(StableDiffusionPipeline, "enable_tome")
    tp.patch_pipelines()
    tp.patch_pipelines()
    try:
        for cls in (StableDiffusionPipeline, StableDiffusionXLPipeline, StableDiffusionControlNetPipeline):
            assert callable(cls.enable_tome) and callable(cls.disable_tome)
        pipe, _ = make_pipeline("sd", tmp_path)
        pipe.enable_tome(ratio=0.4)
        assert pipe.tome_config.ratio == 0.4
    finally:
        tp.unpatch_pipelines()
    tp.unpatch_pipelines()
    assert not hasattr(StableDiffusionPipeline, "enable_tome")
    assert not hasattr(StableDiffusionPipeline, "tome_config")
    # A pipeline keeps ToMe until it is disabled through the function.
    assert tp.is_tome_applied(pipe)
    tp.disable_tome(pipe)
    assert not tp.is_tome_applied(pipe)


def test_patch_refuses_to_overwrite_someone_elses_method():
    from diffusers import DiffusionPipeline

    DiffusionPipeline.enable_tome = lambda self: None
    try:
        with pytest.raises(RuntimeError, match="Expected DiffusionPipeline to have no `enable_tome`"):
            tp.patch_pipelines()
        assert not hasattr(DiffusionPipeline, "disable_tome")
    finally:
        del DiffusionPipeline.enable_tome


def test_functions_work_without_patching(tmp_path):
    pipe, args = make_pipeline("sd", tmp_path)
    baseline = generate(pipe, args)
    assert tp.enable_tome(pipe, 0.5) is pipe
    assert not np.allclose(generate(pipe, args), baseline, atol=1e-5)
    tp.disable_tome(pipe)
    assert np.array_equal(generate(pipe, args), baseline)


def test_pipelines_sharing_a_unet_through_from_pipe(tmp_path):
    base, args = make_pipeline("sd", tmp_path)
    baseline = generate(base, args)
    tp.enable_tome(base, ratio=0.5)
    merged = generate(base, args)
    other = StableDiffusionPipeline.from_pipe(base)
    other.set_progress_bar_config(disable=True)
    assert np.array_equal(generate(other, args), merged)  # the shared UNet merges for both

    tp.enable_tome(other, ratio=0.5)  # the last enable owns the UNet's keeper; no doubled wrapping
    assert [name for name in vars(base.unet) if name == "set_attn_processor"] == ["set_attn_processor"]
    other.unet.set_default_attn_processor()
    assert np.array_equal(generate(base, args), generate(other, args))
    tp.disable_tome(other)
    assert hooks_left(base.unet) == 0 and tome_leftovers(base.unet) == []
    base.unet.set_attn_processor(AttnProcessor2_0())
    assert np.array_equal(generate(base, args), baseline)
    tp.disable_tome(base)  # nothing left to undo


# ---------------------------------------------------------------- ControlNet


@pytest.mark.parametrize("kind", ["controlnet", "controlnet-img2img", "sdxl-controlnet"])
def test_controlnet_is_merged_only_when_asked(kind, tmp_path, patched):
    pipe, args = make_pipeline(kind, tmp_path)
    baseline = generate(pipe, args)

    pipe.enable_tome(ratio=0.5)
    assert tp.is_tome_applied(pipe.unet) and not tp.is_tome_applied(pipe.controlnet)
    unet_only = generate(pipe, args)

    pipe.enable_tome(ratio=0.5, controlnet=True)
    assert tp.is_tome_applied(pipe.unet) and tp.is_tome_applied(pipe.controlnet)
    assert inner_types(pipe.controlnet) == {AttnProcessor2_0}
    both = generate(pipe, args)
    assert not np.allclose(both, unet_only, atol=1e-6)
    assert np.array_equal(generate(pipe, args), both)

    pipe.disable_tome()
    assert hooks_left(pipe.controlnet) == 0 and tome_leftovers(pipe.controlnet) == []
    assert np.array_equal(generate(pipe, args), baseline)


def test_multi_controlnet_merges_every_net(tmp_path, patched):
    from diffusers.models.controlnets.multicontrolnet import MultiControlNetModel

    base = tiny_sd_pipeline(tmp_path)
    nets = MultiControlNetModel([tiny_controlnet(base.unet), tiny_controlnet(base.unet)])
    pipe = StableDiffusionControlNetPipeline(**dict(base.components, controlnet=nets))
    pipe.set_progress_bar_config(disable=True)
    image = torch.rand(1, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(5))
    args = dict(prompt="a cat", image=[image, image], height=SIZE, width=SIZE, num_inference_steps=2, output_type="np")
    baseline = generate(pipe, args)
    pipe.enable_tome(controlnet=True)
    assert all(tp.is_tome_applied(net) for net in nets.nets)
    assert not np.allclose(generate(pipe, args), baseline, atol=1e-6)
    pipe.disable_tome()
    assert np.array_equal(generate(pipe, args), baseline)
