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
from test_video import tiny_wan, wan_inputs


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


#: Every family, way in, preset and order; the quick loop runs a few of each kind (the rest are marked slow).
QUICK = {("sd", how, "exact", False) for how in (*TOME_USAGES, "apply_tome(unet)")} | {
    ("sd", "apply_tome", "balanced", True),
    ("sd", "set_attn_processor", "fast", False),
    ("animatediff", "apply_tome", "exact", False),
    ("animatediff", "enable_tome", "balanced", True),
}
FUSE_CASES = [
    pytest.param(
        family,
        how,
        preset,
        fuse_first,
        id=f"{family}-{how}-{preset}-{'fuse-before' if fuse_first else 'fuse-after'}",
        marks=() if (family, how, preset, fuse_first) in QUICK else pytest.mark.slow,
    )
    for family in sorted(FAMILIES)
    for how in (*TOME_USAGES, "apply_tome(unet)")
    for preset in ("exact", "balanced", "fast")
    for fuse_first in (False, True)
]


@pytest.mark.parametrize(("family", "how", "preset", "fuse_first"), FUSE_CASES)
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


# ---------------------------------------------------------------- torch.compile


def unet_call(model, timestep: float) -> torch.Tensor:
    sample, _, text, _ = unet_inputs(tiny_unet("sd15"), height=16, width=24)
    with torch.no_grad():
        return model(sample, torch.tensor(timestep), encoder_hidden_states=text).sample


@pytest.mark.parametrize("how", ["set_attn_processor", "apply_tome"])
def test_a_unet_compiled_before_any_call_merges_from_its_first_call_in_one_graph(how, one_thread):
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    timesteps = [999.0, 500.0, 250.0]
    reference = tiny_unet("sd15")
    plain = unet_call(reference, timesteps[0])
    tp.apply_tome(reference, ratio=0.5)
    eager = [unet_call(reference, t) for t in timesteps]
    torch._dynamo.reset()
    unet = tiny_unet("sd15")
    if how == "apply_tome":
        tp.apply_tome(unet, ratio=0.5)
    else:  # the README's first usage
        unet.set_attn_processor(ToMeProcessor(ratio=0.5))
    counter = CompileCounter()
    compiled = torch.compile(unet, fullgraph=True, backend=counter)  # a graph break would raise
    try:
        first = unet_call(compiled, timesteps[0])
        assert not torch.allclose(first, plain, atol=1e-4) and tp.is_tome_applied(unet)
        torch.testing.assert_close(first, eager[0], rtol=1e-4, atol=1e-5)
        with torch._dynamo.config.patch(error_on_recompile=True):  # not even at the second call
            for t, expected in zip(timesteps[1:], eager[1:], strict=True):
                torch.testing.assert_close(unet_call(compiled, t), expected, rtol=1e-4, atol=1e-5)
        assert counter.frame_count == 1
    finally:
        torch._dynamo.reset()


def test_a_processor_made_before_a_dynamo_reset_attaches_outside_the_graph(one_thread):
    import torch._dynamo

    reference = tiny_unet("sd15")
    tp.apply_tome(reference, ratio=0.5)
    expected = unet_call(reference, 999.0)
    unet = tiny_unet("sd15")
    unet.set_attn_processor(ToMeProcessor(ratio=0.5))
    torch._dynamo.reset()  # forgets the compile-start callback: the fallback, one graph break at the first call
    try:
        with pytest.raises(torch._dynamo.exc.Unsupported, match="apply_tome"):
            torch.compile(unet, fullgraph=True, backend="eager")(torch.zeros(1, 4, 8, 8), 1, torch.zeros(1, 7, 32))
        torch._dynamo.reset()
        unet = tiny_unet("sd15")
        unet.set_attn_processor(ToMeProcessor(ratio=0.5))
        torch._dynamo.reset()
        compiled = torch.compile(unet, backend="eager")
        torch.testing.assert_close(unet_call(compiled, 999.0), expected, rtol=1e-4, atol=1e-5)
        assert tp.is_tome_applied(unet)
        torch.testing.assert_close(unet_call(compiled, 999.0), expected, rtol=1e-4, atol=1e-5)
    finally:
        torch._dynamo.reset()


#: Clip sizes (frames, height, width of the latent): two of one token count, then other counts.
WAN_SIZES = [(5, 8, 12), (5, 12, 8), (9, 8, 12), (5, 16, 16), (3, 8, 8)]


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["exact", "balanced", "fast"])
def test_wan_blocks_compiled_alone_take_five_clip_sizes_with_every_preset(preset, one_thread):
    # The plain model compiles any number of sizes (dynamic shapes); with ToMe every size is a graph of its own,
    # one for all blocks: torch.compile gives up on a function after 8 (`recompile_limit`).
    import torch._dynamo

    reference, model = tiny_wan(3), tiny_wan(3)
    tp.apply_tome(reference, preset=preset)
    tp.apply_tome(model, preset=preset)
    torch._dynamo.reset()
    model.compile_repeated_blocks(fullgraph=True, backend="eager")
    try:
        for frames, h, w in WAN_SIZES:
            inputs = wan_inputs(batch=1, frames=frames, h=h, w=w)
            for t in (999, 500):
                inputs["timestep"] = torch.full((1,), t)
                with torch.no_grad():
                    expected, out = reference(**inputs).sample, model(**inputs).sample
                torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    finally:
        torch._dynamo.reset()


def attend_and_excite_images(pipe) -> np.ndarray:
    # Its latent update takes gradients through the UNet; 2 steps at 32 px: the attention store's maps at 4 x 4.
    call = dict(height=32, width=32, num_inference_steps=2, output_type="np", attn_res=(4, 4), max_iter_to_alter=2)
    images = pipe("a cat and a dog", token_indices=[2, 5], generator=torch.Generator().manual_seed(0), **call)
    return np.asarray(images.images)


def test_a_pipeline_that_sets_its_own_processors_at_every_call_keeps_apply_tome_on(tmp_path):
    # Attend-and-Excite replaces every processor of its UNet with its attention store's at every call (and puts the
    # earlier ones back at the end): under `apply_tome` they are wrapped, as under `enable_tome`, and ToMe merges.
    from diffusers import StableDiffusionAttendAndExcitePipeline

    parts = {k: v for k, v in tiny_sd_pipeline(tmp_path).components.items() if k != "image_encoder"}
    pipe = StableDiffusionAttendAndExcitePipeline(**parts)
    pipe.set_progress_bar_config(disable=True)
    plain = attend_and_excite_images(pipe)
    tp.apply_tome(pipe, ratio=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tp.ToMeSkipWarning)
        first, second = attend_and_excite_images(pipe), attend_and_excite_images(pipe)
    assert tp.is_tome_applied(pipe) and np.array_equal(first, second)
    assert not np.allclose(first, plain, atol=1e-6), "ToMe stood down: the call ran unmerged"
    tp.remove_tome(pipe)
    assert np.array_equal(attend_and_excite_images(pipe), plain)


def test_tome_standing_down_because_every_processor_was_replaced_says_so_once(tmp_path):
    unet = tiny_unet("sd15")
    sample, timestep, text, _ = unet_inputs(unet)
    tp.apply_tome(unet, ratio=0.5)
    unet.set_attn_processor(
        unet.attn_processors["down_blocks.0.attentions.0.transformer_blocks.0.attn1.processor"].inner
    )
    with pytest.warns(tp.ToMeSkipWarning, match="enable_tome") as said:
        for _ in range(2):
            with torch.no_grad():
                unet(sample, timestep, text)
    assert len([w for w in said if issubclass(w.category, tp.ToMeSkipWarning)]) == 1
    assert not tp.is_tome_applied(unet)
    tp.apply_tome(unet, ratio=0.5)
    unet.set_attn_processor(
        unet.attn_processors["down_blocks.0.attentions.0.transformer_blocks.0.attn1.processor"].inner
    )
    with tp.strict_skips(), pytest.raises(tp.ToMeSkipError, match="stood down"), torch.no_grad():
        unet(sample, timestep, text)
    with warnings.catch_warnings():  # removed on purpose: nothing to say
        warnings.simplefilter("error", tp.ToMeSkipWarning)
        tp.apply_tome(unet, ratio=0.5)
        tp.remove_tome(unet)
        with torch.no_grad():
            unet(sample, timestep, text)
