"""ToMe together with diffusers' step caches (`enable_cache`): either order, each cache, either one taken off.

Every cache that diffusers offers is checked on every family whose transformer takes caches (FLUX.1, FLUX.2,
Chroma, Qwen-Image, Wan, LTX-Video, HunyuanVideo): First Block Cache, TaylorSeer (default and lite) and MagCache
(given ratios, as after a calibration). Where a cache acts on nothing of a model (TaylorSeer's default
identifiers on some video transformers), the skipping check is skipped with the reason; where it fails on the
model without ToMe too (`FAILS_ALONE`: diffusers' own limits), the pair is skipped and that failure is asserted.
FasterCache fails on FLUX.1 without ToMe too (diffusers marks it experimental), and Pyramid Attention Broadcast
leaves FLUX.1's output unchanged (`test_pyramid_attention_broadcast_does_not_act_on_flux`).
"""

from __future__ import annotations

import pytest
import torch
from diffusers.hooks import (
    FirstBlockCacheConfig,
    MagCacheConfig,
    PyramidAttentionBroadcastConfig,
    TaylorSeerCacheConfig,
)

from tome_processors import apply_tome, is_tome_applied, remove_tome
from tome_processors.bench.caches import (
    CACHES,
    cache_config,
    cache_methods,
    cache_quality,
    cache_quality_table,
    supports_caches,
)
from tome_processors.bench.dit import build_transformer, make_transformer_inputs
from tome_processors.bench.engine import BenchSettings, Method
from tome_processors.bench.generate import time_generations
from tome_processors.bench.methods import baseline_method, ours_methods, preset_methods
from tome_processors.bench.models import build_model
from tome_processors.bench.run import BenchRequest, run_bench
from tome_processors.cli.main import main

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 4
#: (name, config factory): fresh configs each time (a config holds no state, but PAB's callback reads `clock`).
clock = {"t": 1000}
CONFIGS = {
    "fbc": lambda: FirstBlockCacheConfig(threshold=0.5),
    "taylorseer": lambda: TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1),
    # Lite: every block skipped on the predicted steps, only the output projection predicted.
    "taylorseer-lite": lambda: TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1, use_lite_mode=True),
    "magcache": lambda: MagCacheConfig(num_inference_steps=STEPS, mag_ratios=[1.0] * STEPS, threshold=1.0),
}


@pytest.fixture(scope="module")
def flux():
    model = build_transformer("flux", quick=True).eval()
    inputs = make_transformer_inputs(model, "flux", batch=2, resolution=64)
    return model, inputs


#: The transformers whose pipelines users run with a cache (every family whose model has diffusers' `CacheMixin`):
#: FLUX.1, FLUX.2, Chroma, Qwen-Image, and the video transformers Wan, LTX-Video and HunyuanVideo (a clip of 5
#: latent frames). Z-Image's transformer takes no cache (no `CacheMixin`; `test_zimage_takes_no_cache`).
CACHED = {
    "flux": dict(resolution=64),
    "flux2": dict(resolution=64),
    "chroma": dict(resolution=64),
    "qwenimage": dict(resolution=64),
    "wan": dict(resolution=64, frames=17, width=64),
    "ltx": dict(resolution=128, frames=33, width=128),
    "hunyuanvideo": dict(resolution=64, frames=17, width=64),
}


#: (family, cache): the diffusers 0.42.1 caches that fail on the family's model without ToMe, and how. First Block
#: Cache subtracts a list from a tensor on FLUX.2's blocks (they return lists); Chroma's block classes are not in
#: diffusers' `TransformerBlockRegistry`, which First Block Cache and MagCache look their outputs up in.
FAILS_ALONE = {
    ("flux2", "fbc"): (TypeError, "unsupported operand"),
    ("chroma", "fbc"): (ValueError, "not registered"),
    ("chroma", "magcache"): (ValueError, "not registered"),
}


@pytest.fixture(scope="module", params=sorted(CACHED))
def denoiser(request):
    model = build_transformer(request.param, quick=True).eval()
    inputs = make_transformer_inputs(model, request.param, batch=2, **CACHED[request.param])
    return request.param, model, inputs


def _skip_if_it_fails_alone(family: str, cache: str) -> None:
    if (family, cache) in FAILS_ALONE:
        pytest.skip(f"{cache} fails on {family} without ToMe too (test_caches_that_fail_without_tome)")


def _steps(model, inputs) -> list[torch.Tensor]:
    """`STEPS` denoiser calls as a pipeline makes them: inside a cache context, the timestep moving."""
    outputs = []
    first_timestep = inputs.kwargs["timestep"]
    try:
        with torch.no_grad():
            for step in range(STEPS):
                clock["t"] = 1000 - 250 * step
                # The timestep moves as in a pipeline, so a step that reuses cached work visibly differs from one
                # that computes it (with one input throughout, reuse would differ only by rounding).
                inputs.kwargs["timestep"] = first_timestep * (1.0 - 0.2 * step)
                with model.cache_context("cond"):
                    outputs.append(inputs.run(model))
    finally:
        inputs.kwargs["timestep"] = first_timestep
    return outputs


def _with(model, inputs, cache: str | None, tome: bool) -> list[torch.Tensor]:
    if tome:
        apply_tome(model, ratio=0.5)
    if cache is not None:
        model.enable_cache(CONFIGS[cache]())
    try:
        return _steps(model, inputs)
    finally:
        if cache is not None:
            model.disable_cache()
        remove_tome(model)


@pytest.mark.parametrize("cache", sorted(CONFIGS))
@pytest.mark.parametrize("tome_first", [True, False])
def test_tome_and_each_cache_in_either_order(denoiser, cache, tome_first):
    family, model, inputs = denoiser
    _skip_if_it_fails_alone(family, cache)
    plain = _with(model, inputs, None, tome=False)
    cache_only = _with(model, inputs, cache, tome=False)
    tome_only = _with(model, inputs, None, tome=True)
    assert not torch.equal(tome_only[0], plain[0])  # ToMe merges on this model

    if tome_first:
        apply_tome(model, ratio=0.5)
        model.enable_cache(CONFIGS[cache]())
    else:
        model.enable_cache(CONFIGS[cache]())
        apply_tome(model, ratio=0.5)
    both = _steps(model, inputs)
    assert all(torch.isfinite(out).all() for out in both)
    assert torch.equal(both[0], tome_only[0])  # the first step runs every block: ToMe's output

    if tome_first:  # take the cache off first: ToMe alone stays
        model.disable_cache()
        assert is_tome_applied(model)
        assert all(torch.equal(a, b) for a, b in zip(_steps(model, inputs), tome_only, strict=True))
        remove_tome(model)
    else:  # take ToMe off first: the cache alone stays, as if ToMe had never been there
        remove_tome(model)
        model._reset_stateful_cache()
        assert all(torch.equal(a, b) for a, b in zip(_steps(model, inputs), cache_only, strict=True))
        model.disable_cache()
    # Both gone: the model is bit for bit the plain one.
    assert all(torch.equal(a, b) for a, b in zip(_steps(model, inputs), plain, strict=True))


@pytest.mark.parametrize("cache", sorted(CONFIGS))
def test_each_cache_skips_work_with_tome_on(denoiser, cache):
    # The configs reuse work early: the steps after the first differ from ToMe alone, so the cache really acts
    # on the merged model.
    family, model, inputs = denoiser
    _skip_if_it_fails_alone(family, cache)
    plain = _with(model, inputs, None, tome=False)
    cache_only = _with(model, inputs, cache, tome=False)
    if all(torch.equal(a, b) for a, b in zip(cache_only, plain, strict=True)):
        pytest.skip(f"{cache} skips nothing on {type(model).__name__} without ToMe either (identifiers, threshold)")
    tome_only = _with(model, inputs, None, tome=True)
    both = _with(model, inputs, cache, tome=True)
    assert torch.equal(both[0], tome_only[0])
    assert any(not torch.equal(a, b) for a, b in zip(both[1:], tome_only[1:], strict=True))


@pytest.mark.parametrize(("family", "cache"), sorted(FAILS_ALONE))
def test_caches_that_fail_without_tome(family, cache):
    # diffusers' own failures, with no ToMe anywhere: the reason the tests above skip these pairs. If one starts
    # working (a newer diffusers), this fails and the pair must be tested with ToMe.
    model = build_transformer(family, quick=True).eval()
    inputs = make_transformer_inputs(model, family, batch=2, **CACHED[family])
    error, message = FAILS_ALONE[(family, cache)]
    with pytest.raises(error, match=message):
        _with(model, inputs, cache, tome=False)


def test_zimage_takes_no_cache():
    # Z-Image's transformer has no `enable_cache` (no CacheMixin): the bench refuses --cache on it.
    assert not supports_caches(build_transformer("zimage", quick=True))


def test_cache_rows_of_the_bench(tmp_path):
    bench = build_model(arch="flux", quick=True, pipeline=True, resolution=64)
    assert supports_caches(bench.model)
    presets = preset_methods(["balanced"], bench.model, auto_downsample=1)
    methods = [baseline_method(), *presets, *cache_methods("fbc", bench.pipe, presets)]
    assert [m.name for m in methods[2:]] == ["FirstBlockCache", "FirstBlockCache + ours balanced r=0.5"]
    settings = BenchSettings(rounds=1, measure_memory=False, host_cost=False, progress=False)
    run = time_generations(bench.pipe, methods, "a cat", steps=3, resolution=64, settings=settings)
    changes = {row.name: row.image_change for row in run.rows}
    assert changes["baseline"] == 0.0
    assert all(0 <= change < 1 for change in changes.values())
    # Every method was taken off again: the pipeline's denoiser is plain.
    assert not is_tome_applied(bench.model) and bench.model._cache_config is None


def test_pyramid_attention_broadcast_acts_on_flux(flux):
    # diffusers' Pyramid Attention Broadcast reuses FLUX.1's attention on the steps in its window: the outputs
    # after the first step differ from the plain model's once the timestep moves.
    model, inputs = flux
    plain = _with(model, inputs, None, tome=False)
    model.enable_cache(
        PyramidAttentionBroadcastConfig(
            spatial_attention_block_skip_range=2,
            spatial_attention_timestep_skip_range=(0, 1001),
            current_timestep_callback=lambda: clock["t"],
        )
    )
    try:
        steps = _steps(model, inputs)
    finally:
        model.disable_cache()
    assert torch.equal(steps[0], plain[0])
    assert any(not torch.equal(a, b) for a, b in zip(steps[1:], plain[1:], strict=True))


@pytest.mark.parametrize("cache", ["fbc", "taylorseer-lite"])
def test_cache_quality_on_the_trained_flux_shaped_model(cache):
    balanced = preset_methods(["balanced"], "flux", auto_downsample=1)
    bound = ours_methods([0.5], auto_downsample=1)  # ToMe at 0.5: the bound `balanced` is held to
    rows = cache_quality(cache, balanced, steps=6, references=bound)
    label = CACHES[cache].label
    by_name = {row["method"]: row["image_change"] for row in rows}
    assert list(by_name) == ["ours r=0.5", "ours balanced r=0.5", label, f"{label} + ours balanced r=0.5"]
    assert all(change > 0 for change in by_name.values())  # each changes the trajectory
    assert by_name[f"{label} + ours balanced r=0.5"] != by_name[label]
    # The issue's target: the cache with `balanced` stays within `balanced`'s bound on whole sampling runs.
    assert by_name[f"{label} + ours balanced r=0.5"] < by_name["ours r=0.5"]
    table = cache_quality_table(rows)
    assert table.count("\n") == 5 and f"{label} + ours balanced" in table


def test_taylorseer_acts_on_the_trained_flux_shaped_model():
    # TaylorSeer's default identifiers are FLUX's block names: it acts on this model too.
    taylor = cache_quality("taylorseer", [], steps=6)
    assert [row["method"] for row in taylor] == ["TaylorSeer"] and taylor[0]["image_change"] > 0


def test_cache_quality_says_when_a_cache_acts_on_no_block():
    table = cache_quality_table([{"method": "TaylorSeer", "image_change": None, "psnr_drop": None}])
    assert "n/a: acts on none of the model's blocks" in table


def test_unknown_cache_and_models_without_caches_are_refused(tmp_path, capsys):
    with pytest.raises(ValueError, match="Expected a cache among"):
        cache_config("deepcache", None)
    with pytest.raises(ValueError, match="Expected a cache among"):
        cache_methods("deepcache", None, [])
    unet_row = cache_methods("fbc", None, [])[0]
    assert isinstance(unet_row, Method) and sorted(CACHES) == ["fbc", "taylorseer", "taylorseer-lite"]
    with pytest.raises(ValueError, match="CacheMixin"):
        unet_row.apply(torch.nn.Linear(1, 1))
    request = BenchRequest(arch="sd15", quick=True, pipeline=True, cache="fbc", with_tomesd=False, rounds=1)
    with pytest.raises(ValueError, match="CacheMixin"):
        run_bench(request)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--quick", "--cache", "fbc"])
    assert exit_info.value.code == 2
    assert "--cache only with --pipeline" in capsys.readouterr().err


@pytest.mark.parametrize("cache", ["fbc", "taylorseer", "taylorseer-lite"])
def test_a_pipeline_with_tome_and_a_cache_gives_the_same_image_twice(cache):
    pipe = build_model(arch="flux", quick=True, pipeline=True, resolution=64).pipe

    def generate() -> torch.Tensor:
        generator = torch.Generator().manual_seed(0)
        return pipe("a cat", num_inference_steps=3, height=64, width=64, generator=generator, output_type="pt").images

    plain = generate()
    apply_tome(pipe, ratio=0.5)
    pipe.transformer.enable_cache(CONFIGS[cache]())
    first, second = generate(), generate()
    assert torch.isfinite(first).all() and torch.equal(first, second)
    assert not torch.equal(first, plain)
    pipe.transformer.disable_cache()
    remove_tome(pipe)
    assert torch.equal(generate(), plain)


@pytest.mark.parametrize("tome_first", [True, False])
@pytest.mark.parametrize("arch", sorted(CACHED))
def test_group_offloading_and_tome_in_either_order(arch, tome_first):
    # diffusers' group offloading moves each block's weights in with hooks of its own registry; here both
    # devices are the CPU, so the hooks run and the output must be ToMe's, bit for bit.
    model = build_transformer(arch, quick=True).eval()  # a model of its own: offloading stays on it
    inputs = make_transformer_inputs(model, arch, batch=2, **CACHED[arch])
    plain = _with(model, inputs, None, tome=False)
    tome_only = _with(model, inputs, None, tome=True)
    cpu = torch.device("cpu")
    if tome_first:
        apply_tome(model, ratio=0.5)
    model.enable_group_offload(
        onload_device=cpu, offload_device=cpu, offload_type="block_level", num_blocks_per_group=1
    )
    if not tome_first:
        apply_tome(model, ratio=0.5)
    assert is_tome_applied(model)
    assert all(torch.equal(a, b) for a, b in zip(_steps(model, inputs), tome_only, strict=True))
    remove_tome(model)  # the offloading stays and the model is the plain one again
    assert all(torch.equal(a, b) for a, b in zip(_steps(model, inputs), plain, strict=True))
