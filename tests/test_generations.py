"""Same seed, same image: every pipeline call starts a new generation however ToMe was turned on.

Everything here goes through real (tiny, offline) pipeline calls of every family; nothing calls a reset
in the pipeline's place.
"""

from __future__ import annotations

import gc
import inspect
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler
from diffusers.models.attention_processor import AttnProcessor2_0, JointAttnProcessor2_0
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

import tome_processors as tp
import tome_processors.context as context_module
from tome_processors import ToMeMixin, ToMeProcessor
from tome_processors.hooks import context_of

from models import tiny_unet
from pipelines import FAMILY_PIPELINES, denoiser, family_pipeline, tiny_vae
from test_dit import flux_inputs, image_ids, tiny_flux

pytestmark = pytest.mark.usefixtures("one_thread")

#: The processor each family's attention is built with: what `ToMeProcessor()` must wrap there.
BUILT_WITH = {
    "sd": AttnProcessor2_0,
    "pixart": AttnProcessor2_0,
    "sd3": JointAttnProcessor2_0,
    "flux": FluxAttnProcessor,
}


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # diffusers' deprecation notes about the tiny schedulers' configs
        yield


def generate(pipe, args: dict, seed: int = 0, **extra) -> np.ndarray:
    with torch.no_grad():
        return pipe(**args, **extra, generator=torch.Generator().manual_seed(seed)).images


def count_matchings(monkeypatch) -> list[int]:
    """Every matching computed (one per merged block and forward that does not reuse a kept merge)."""
    calls: list[int] = []
    original = context_module.match

    def counting(metric, *args, **kwargs):
        calls.append(metric.shape[1])
        return original(metric, *args, **kwargs)

    monkeypatch.setattr(context_module, "match", counting)
    return calls


def turn_on(how: str, pipe, **options) -> None:
    """Turn ToMe on `pipe` in one of the ways a user can."""
    if how == "set_attn_processor":  # the README's first usage
        denoiser(pipe).set_attn_processor(ToMeProcessor(**options))
    elif how == "apply_tome(pipe)":
        tp.apply_tome(pipe, **options)
    elif how == "apply_tome(denoiser)":
        tp.apply_tome(denoiser(pipe), **options)
    elif how == "enable_tome":
        tp.enable_tome(pipe, **options)
    elif how == "mixin":
        pipe.__class__ = type(f"ToMe{type(pipe).__name__}", (ToMeMixin, type(pipe)), {})
        pipe.enable_tome(**options)
    else:
        raise ValueError(how)


HOWS = ["set_attn_processor", "apply_tome(pipe)", "apply_tome(denoiser)", "enable_tome", "mixin"]


# ---------------------------------------------------------------- the README's first usage


@pytest.mark.parametrize("family", FAMILY_PIPELINES)
def test_readme_first_usage_on_every_family(family, tmp_path):
    pipe, args = family_pipeline(family, tmp_path)
    plain = generate(pipe, args)
    reference, _ = family_pipeline(family, tmp_path / "reference")
    tp.apply_tome(reference, ratio=0.5)
    expected = generate(reference, args)

    denoiser(pipe).set_attn_processor(ToMeProcessor(ratio=0.5))  # pipe.unet / pipe.transformer
    first = generate(pipe, args)
    second = generate(pipe, args)
    assert np.isfinite(first).all() and not np.allclose(first, plain, atol=1e-6)
    assert np.array_equal(first, second)
    assert np.array_equal(first, expected)  # what apply_tome gives with the same configuration
    processors = denoiser(pipe).attn_processors.values()
    assert {type(p.inner) for p in processors} == {BUILT_WITH[family]}


# ---------------------------------------------------------------- same seed, same image


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("family", FAMILY_PIPELINES)
def test_same_seed_same_image_on_every_call(family, how, tmp_path, monkeypatch):
    pipe, args = family_pipeline(family, tmp_path)
    args = dict(args, num_inference_steps=3)
    plain = generate(pipe, args)
    turn_on(how, pipe, ratio=0.5, recompute_every=2)
    matchings = count_matchings(monkeypatch)
    images, counts = [], []
    for _ in range(3):
        before = len(matchings)
        images.append(generate(pipe, args))
        counts.append(len(matchings) - before)
    assert not np.allclose(images[0], plain, atol=1e-6)
    assert all(np.array_equal(image, images[0]) for image in images[1:])
    # Each call computes at its steps 0 and 2 and reuses at step 1: the same work, from step 0 each time.
    assert counts[0] > 0 and counts == [counts[0]] * 3


OPTIONS = [
    pytest.param(dict(recompute_every=3), 4, id="recompute_every=3-4_steps"),
    pytest.param(dict(recompute_every=2), 1, id="one_step"),
    pytest.param(dict(recompute_every=2, use_rand=False), 2, id="use_rand=False"),
    pytest.param(dict(recompute_every=2, ratio_start=0.5), 4, id="ratio_start"),
    pytest.param(dict(ratio_start=0.5, use_rand=False), 3, id="ratio_start-no_reuse"),
]


@pytest.mark.parametrize(("options", "steps"), OPTIONS)
@pytest.mark.parametrize("family", FAMILY_PIPELINES)
def test_same_seed_same_image_for_every_option(family, options, steps, tmp_path):
    if family == "pixart" and steps == 1:
        pytest.skip("PixArtAlphaPipeline's one-step path indexes past the scheduler's output (diffusers 0.42.1)")
    pipe, args = family_pipeline(family, tmp_path)
    args = dict(args, num_inference_steps=steps)
    turn_on("set_attn_processor", pipe, ratio=0.5, **options)  # the way that sees least of the pipeline
    first = generate(pipe, args)
    generate(pipe, args, seed=1)  # another image in between: nothing of it may be kept
    generate(pipe, dict(args, num_inference_steps=steps + 1))  # nor of another schedule
    assert np.array_equal(generate(pipe, args), first)


class Stop(Exception):
    pass


def stopping_at_step_0(pipe, error: BaseException) -> dict:
    """Pipeline arguments whose callback raises `error` at the end of the first step."""

    def callback(*args, **kwargs):
        raise error

    if "callback_on_step_end" in inspect.signature(type(pipe).__call__).parameters:
        return dict(callback_on_step_end=callback)
    return dict(callback=callback, callback_steps=1)  # PixArt-alpha's older callback


@pytest.mark.parametrize("error", [Stop("cancelled"), KeyboardInterrupt()], ids=["callback", "KeyboardInterrupt"])
@pytest.mark.parametrize("how", ["set_attn_processor", "enable_tome"])
@pytest.mark.parametrize("family", FAMILY_PIPELINES)
def test_a_call_stopped_midway_leaves_the_next_call_unchanged(family, how, error, tmp_path):
    pipe, args = family_pipeline(family, tmp_path)
    args = dict(args, num_inference_steps=3)
    turn_on(how, pipe, ratio=0.5, recompute_every=2)
    first = generate(pipe, args)
    with pytest.raises(type(error)):
        generate(pipe, args, **stopping_at_step_0(pipe, error))
    assert np.array_equal(generate(pipe, args), first)


@pytest.mark.parametrize("how", ["set_attn_processor", "apply_tome(pipe)"])
@pytest.mark.parametrize("family", FAMILY_PIPELINES)
def test_pipelines_made_with_from_pipe_share_the_denoiser_and_start_afresh(family, how, tmp_path):
    pipe, args = family_pipeline(family, tmp_path)
    args = dict(args, num_inference_steps=3)
    turn_on(how, pipe, ratio=0.5, recompute_every=2, ratio_start=0.5)
    first = generate(pipe, args)
    other = type(pipe).from_pipe(pipe)
    other.set_progress_bar_config(disable=True)
    assert denoiser(other) is denoiser(pipe)
    assert np.array_equal(generate(other, args), first)
    with pytest.raises(Stop):
        generate(other, args, **stopping_at_step_0(other, Stop()))
    assert np.array_equal(generate(pipe, args), first)
    assert np.array_equal(generate(other, args), first)


@pytest.mark.parametrize("how", ["set_attn_processor", "apply_tome(pipe)", "enable_tome"])
@pytest.mark.parametrize("family", ["sd", "flux"])
def test_model_cpu_offload(family, how, tmp_path):
    pipe, args = family_pipeline(family, tmp_path)
    args = dict(args, num_inference_steps=3)
    turn_on(how, pipe, ratio=0.5, recompute_every=2)
    first = generate(pipe, args)
    pipe.enable_model_cpu_offload(device="cpu")  # accelerate's hooks; "cpu" is the only device here
    assert np.array_equal(generate(pipe, args), first)
    with pytest.raises(Stop):
        generate(pipe, args, **stopping_at_step_0(pipe, Stop()))
    assert np.array_equal(generate(pipe, args), first)


# ---------------------------------------------------------------- a loop of one's own


def own_loop(unet, timesteps_of: Callable[[DDIMScheduler], list], text: torch.Tensor | None = None) -> torch.Tensor:
    scheduler = DDIMScheduler(num_train_timesteps=1000, beta_schedule="scaled_linear", clip_sample=False)
    scheduler.set_timesteps(3)
    g = torch.Generator().manual_seed(0)
    latents = torch.randn(2, 4, 16, 16, generator=g)
    made = torch.randn(2, 7, 32, generator=g)
    text = made if text is None else text
    with torch.no_grad():
        for t in timesteps_of(scheduler):
            noise = unet(latents, t, encoder_hidden_states=text).sample
            latents = scheduler.step(noise, t, latents).prev_sample
    return latents


def test_a_loop_over_scheduler_timesteps_starts_afresh_by_itself():
    unet = tiny_unet("sd15")
    unet.set_attn_processor(ToMeProcessor(ratio=0.5, recompute_every=2))
    first = own_loop(unet, lambda scheduler: scheduler.timesteps)
    own_loop(unet, lambda scheduler: scheduler.timesteps[1:])  # another, shorter generation in between
    assert torch.equal(own_loop(unet, lambda scheduler: scheduler.timesteps), first)


def test_new_generation_marks_what_a_loop_cannot_show(monkeypatch):
    unet = tiny_unet("sd15")
    tp.apply_tome(unet, ratio=0.5, recompute_every=2)
    matchings = count_matchings(monkeypatch)

    def made_per_call(scheduler):  # timesteps made for each call view no schedule: no generation is seen
        return [torch.tensor(int(t)) for t in scheduler.timesteps]

    # One text tensor for every generation: nothing tells them apart (new text embeddings would).
    text = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(0))
    first = own_loop(unet, made_per_call, text)
    per_generation = len(matchings)
    own_loop(unet, made_per_call, text)
    assert len(matchings) != 2 * per_generation  # the count went on from the last generation
    tp.new_generation(unet)
    assert torch.equal(own_loop(unet, made_per_call, text), first)
    fresh = own_loop(unet, made_per_call)  # new text embeddings in each: a generation of their own
    assert torch.equal(own_loop(unet, made_per_call), fresh)
    with pytest.raises(ValueError, match="Expected a model with ToMe on it"):
        tp.new_generation(tiny_unet("sd15"))


def test_flux_loop_with_img_ids_of_its_own_starts_afresh():
    model = tiny_flux()
    model.set_attn_processor(ToMeProcessor(ratio=0.5, recompute_every=2))

    def loop() -> torch.Tensor:
        inputs = flux_inputs()
        inputs["img_ids"] = image_ids(6, 8)  # made once per generation, as the Flux pipelines do
        out = inputs["hidden_states"]
        with torch.no_grad():
            for t in (1.0, 0.6, 0.3):
                inputs["timestep"] = torch.full((2,), t)
                out = model(**inputs).sample
                inputs["hidden_states"] = out
        return out

    first = loop()
    assert torch.equal(loop(), first)


# ---------------------------------------------------------------- state that outlives a forward


def test_step_counter_restarts_with_every_generation(tmp_path):
    pipe, args = family_pipeline("sd", tmp_path)
    args = dict(args, num_inference_steps=3)
    pipe.unet.set_attn_processor(ToMeProcessor(ratio=0.5, recompute_every=2))
    generate(pipe, args)
    state = context_of(pipe.unet).model_state
    assert state.step == 2  # kept after the call: nothing ends it there on a UNet
    steps = []
    pipe.unet.register_forward_hook(lambda module, args, output: steps.append(state.step))
    with pytest.raises(Stop):
        generate(pipe, args, **stopping_at_step_0(pipe, Stop()))
    generate(pipe, args)
    assert steps == [0, 0, 1, 2]  # the stopped call's step 0, then the next call from step 0


def test_kept_merges_end_with_their_generation(tmp_path):
    pipe, args = family_pipeline("sd", tmp_path)
    args = dict(args, num_inference_steps=3)
    tp.apply_tome(pipe.unet, ratio=0.5, recompute_every=2)
    generate(pipe, args)
    state = context_of(pipe.unet).model_state
    kept = dict(state.kept)
    assert kept
    first_forward = []
    pipe.unet.register_forward_pre_hook(lambda module, args: first_forward.append(dict(state.kept)), prepend=True)
    pipe.unet.register_forward_hook(lambda module, args, output: first_forward.append(dict(state.kept)))
    generate(pipe, args)
    assert first_forward[0] == kept  # still there when the next call's first forward starts ...
    assert not any(first_forward[1][key] is merge for key, merge in kept.items())  # ... and not reused
    tp.new_generation(pipe)
    assert state.kept == {} and state.step == 0
    tp.remove_tome(pipe)
    assert context_of(pipe.unet) is None


def test_timestep_schedule_is_the_current_generations(tmp_path):
    pipe, args = family_pipeline("sd", tmp_path)
    tp.apply_tome(pipe, ratio=0.5, ratio_start=0.5)
    context = context_of(pipe.unet)
    seen = []
    pipe.unet.register_forward_pre_hook(lambda module, args: seen.append(context.schedule))
    generate(pipe, dict(args, num_inference_steps=2))
    generate(pipe, dict(args, num_inference_steps=3))
    first, second = seen[0], seen[2]
    assert seen == [first, first, second, second, second] and first is not second
    assert second.values == pipe.scheduler.timesteps.tolist()  # taken at the start of its denoising loop
    # A pipeline that shares the UNet but is not watched: the last schedule is no view of its timesteps,
    # so each forward reads its own timestep (the same image as a fresh pipeline's).
    other = type(pipe).from_pipe(pipe)
    other.set_progress_bar_config(disable=True)
    assert "progress_bar" not in vars(other)
    fresh, _ = family_pipeline("sd", tmp_path / "fresh")
    tp.apply_tome(fresh, ratio=0.5, ratio_start=0.5)
    assert np.array_equal(
        generate(other, dict(args, num_inference_steps=4)), generate(fresh, dict(args, num_inference_steps=4))
    )
    tp.remove_tome(pipe)
    assert context_of(pipe.unet) is None and "progress_bar" not in vars(pipe)


def test_cached_tables_are_kept_across_generations_and_change_nothing(tmp_path):
    pipe, args = family_pipeline("sd", tmp_path)
    tp.apply_tome(pipe, ratio=0.5)
    first = generate(pipe, args)
    state = context_of(pipe.unet).model_state
    layouts = dict(state._layouts)
    assert layouts
    assert np.array_equal(generate(pipe, args), first)
    assert all(state._layouts[key] is layout for key, layout in layouts.items())  # built once per grid
    tp.remove_tome(pipe)
    assert context_of(pipe.unet) is None  # the tables go with the context


def test_attach_bookkeeping_ends_with_its_modules(tmp_path):
    pipe, args = family_pipeline("sd", tmp_path)
    processor = ToMeProcessor(ratio=0.5)
    pipe.unet.set_attn_processor(processor)
    vae = tiny_vae()
    vae.set_attn_processor(processor)  # merges nothing there: remembered, with the processor each module runs
    with torch.no_grad():
        vae(torch.randn(1, 3, 32, 32))
    generate(pipe, args)
    assert tp.is_tome_applied(pipe)
    # Every UNet module now holds what apply_tome would have set, not the shared processor.
    assert all(p is not processor and type(p.inner) is AttnProcessor2_0 for p in pipe.unet.attn_processors.values())
    assert len(processor._built._processors) == len(processor._passed_through._modules) > 0
    del vae
    gc.collect()
    assert len(processor._built._processors) == 0 and len(processor._passed_through._modules) == 0
    pipe.unet.set_attn_processor(AttnProcessor2_0())
    generate(pipe, args)
    assert not tp.is_tome_applied(pipe)  # stood down at the first forward without a ToMe processor


def test_the_generation_marker_needs_no_host_sync(tmp_path):
    # Views of the schedule are told apart by host metadata alone: a forward with reuse makes no sync.
    from tome_processors.bench.hostcost import HOST_SYNC_OPS, count_aten_ops

    pipe, args = family_pipeline("sd", tmp_path)
    tp.apply_tome(pipe, ratio=0.5, recompute_every=2)
    generate(pipe, dict(args, num_inference_steps=2))  # tables built
    pipe.scheduler.set_timesteps(2)
    t = pipe.scheduler.timesteps[0]
    sample = torch.randn(2, 4, 16, 16)
    text = torch.randn(2, 16, 32)
    with torch.no_grad():
        _, ops, _ = count_aten_ops(lambda: pipe.unet(sample, t, encoder_hidden_states=text))
    assert not set(ops) & HOST_SYNC_OPS
    assert context_of(pipe.unet).model_state._generation is t
