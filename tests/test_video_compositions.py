"""ToMe with what video users also turn on, on whole pipeline calls: VAE tiling, a step cache
(`transformer.enable_cache`) and group offloading, each in either order.

The pipelines are the tiny offline ones of the family tests (random weights; builders and calls imported): Wan 2.1
text to video, Wan 2.2 (two experts), Wan 2.1 image to video, LTX-Video, HunyuanVideo and HunyuanVideo 1.5. ToMe is
`apply_tome(pipe, preset="balanced")` (2x2x2 windows across frames: every tiny clip has at least 2 latent frames),
which merges on each of them (`test_balanced_tome_merges_on_each_pipeline`).

- **VAE tiling**: tiles small enough that the tiny clip really is decoded (and, image to video, encoded) in tiles.
  Two calls give the same video, it differs from tiling alone, the VAE is never touched by ToMe (no ToMe processor,
  hook or attribute on any of its modules), and `remove_tome` gives tiling alone back bit for bit.
- **Step caches**: First Block Cache, TaylorSeer (default and lite) and MagCache, on every denoiser of the pipeline
  (both Wan 2.2 experts); each of these pipelines opens cache contexts (`test_each_pipeline_opens_cache_contexts`).
  Finite, the same video twice, the cache acts on the merged model (the video differs from ToMe alone); taking the
  cache off leaves ToMe alone's video, putting it back gives the composed video again, taking ToMe off leaves the
  cache alone's video, and with both off the plain video comes back bit for bit. Where a cache does not act or fails
  without ToMe (diffusers 0.42.1), that is asserted instead: `TAYLORSEER_IDLE`, `FAILS_ALONE`.
- **Group offloading** (CPU to CPU, block level one block a group, and leaf level), on every denoiser: the video is
  ToMe alone's bit for bit, and after `remove_tome` the plain video's.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from diffusers.hooks import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

import tome_processors as tp
from tome_processors import ToMeProcessor

from leftovers import hooks_left, tome_attributes_left
from test_hunyuanvideo import generate as hunyuanvideo_generate
from test_hunyuanvideo import generate15 as hunyuanvideo15_generate
from test_hunyuanvideo import tiny_hunyuanvideo15_pipeline, tiny_hunyuanvideo_pipeline
from test_ltx import generate as ltx_generate
from test_ltx import tiny_ltx_pipeline
from test_video import generate as wan_generate
from test_video import tiny_wan_pipeline
from test_wan_image_to_video import (
    ftfy_or_stand_in,  # noqa: F401  (a fixture: the I2V pipeline calls ftfy)
    tiny_wan_i2v_pipeline,
)
from test_wan_image_to_video import generate as wan_i2v_generate

pytestmark = pytest.mark.usefixtures("one_thread", "ftfy_or_stand_in")

#: name: (build(folder), generate(pipe), the steps each denoiser of `denoisers(pipe)` runs in one call: MagCache's
#: `num_inference_steps`). The calls stop at the latents where the family test does (LTX-Video, HunyuanVideo, 1.5);
#: the tiling tests decode them (`decoded`). Wan 2.2's second expert takes the last of the 4 steps (t < 500).
PIPELINES: dict[str, tuple[Callable[[Path], Any], Callable[[Any], Any], tuple[int, ...]]] = {
    "wan": (tiny_wan_pipeline, wan_generate, (4,)),
    "wan2.2": (partial(tiny_wan_pipeline, two_experts=True), wan_generate, (3, 1)),
    "wan-i2v": (tiny_wan_i2v_pipeline, wan_i2v_generate, (2,)),
    "ltx": (tiny_ltx_pipeline, ltx_generate, (2,)),
    "hunyuanvideo": (tiny_hunyuanvideo_pipeline, hunyuanvideo_generate, (2,)),
    "hunyuanvideo1.5": (tiny_hunyuanvideo15_pipeline, hunyuanvideo15_generate, (2,)),
}

#: Tiles of 16 px, 8 px apart: smaller than the Wan, LTX-Video clips (32 x 32 px; image to video 64 x 64).
_SMALL_TILES = {
    "tile_sample_min_height": 16,
    "tile_sample_min_width": 16,
    "tile_sample_stride_height": 8,
    "tile_sample_stride_width": 8,
}
#: `pipe.vae.enable_tiling(**TILES[name])`: each tiny clip decoded in several tiles (HunyuanVideo's is 96 x 128 px,
#: HunyuanVideo 1.5's VAE takes latent tile sizes instead of strides).
TILES: dict[str, dict[str, int]] = {
    "wan": _SMALL_TILES,
    "wan2.2": _SMALL_TILES,
    "wan-i2v": _SMALL_TILES,
    "ltx": _SMALL_TILES,
    "hunyuanvideo": {
        "tile_sample_min_height": 32,
        "tile_sample_min_width": 32,
        "tile_sample_stride_height": 16,
        "tile_sample_stride_width": 16,
    },
    "hunyuanvideo1.5": {
        "tile_sample_min_height": 16,
        "tile_sample_min_width": 16,
        "tile_latent_min_height": 4,
        "tile_latent_min_width": 4,
    },
}


def _magcache(steps: int) -> MagCacheConfig:
    return MagCacheConfig(num_inference_steps=steps, mag_ratios=[1.0] * steps, threshold=1.0)


#: cache: config factory(steps of one call), as tests/test_caches.py builds them.
CACHES: dict[str, Callable[[int], Any]] = {
    "fbc": lambda steps: FirstBlockCacheConfig(threshold=0.5),
    "taylorseer": lambda steps: TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1),
    "taylorseer-lite": lambda steps: TaylorSeerCacheConfig(
        cache_interval=2, disable_cache_before_step=1, use_lite_mode=True
    ),
    "magcache": _magcache,
}

#: TaylorSeer's default identifiers (`^blocks.*attn`, `^transformer_blocks.*attn`, ...) must match a module name
#: whole: Wan's and LTX-Video's attention modules are `attn1` / `attn2`, so it hooks none of them and the video is
#: the plain one (`test_default_taylorseer_acts_on_no_wan_or_ltx_attention`); its lite mode acts on them.
TAYLORSEER_IDLE = {("wan", "taylorseer"), ("wan2.2", "taylorseer"), ("wan-i2v", "taylorseer"), ("ltx", "taylorseer")}
#: diffusers 0.42.1 refuses these without ToMe: HunyuanVideo 1.5's block class is not in its
#: `TransformerBlockRegistry`, which First Block Cache and MagCache look block outputs up in.
FAILS_ALONE = {("hunyuanvideo1.5", "fbc"), ("hunyuanvideo1.5", "magcache")}
CACHE_CASES = [
    (name, cache) for name in PIPELINES for cache in CACHES if (name, cache) not in TAYLORSEER_IDLE | FAILS_ALONE
]

ORDER = pytest.mark.parametrize("tome_first", [True, False], ids=["tome-first", "tome-last"])


def build(name: str, tmp_path: Path) -> Any:
    with warnings.catch_warnings():  # tokenizer and image-processor fallbacks of the tiny builders
        warnings.simplefilter("ignore")
        return PIPELINES[name][0](tmp_path / name)


def video(name: str, pipe: Any) -> np.ndarray:
    """One whole call, as the family test makes it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return np.asarray(PIPELINES[name][1](pipe))


@contextmanager
def _decoding(pipe: Any) -> Iterator[None]:
    """The pipeline's calls return decoded frames (`output_type="pt"`) whatever the family's call asks for."""
    call = type(pipe).__call__
    with mock.patch.object(type(pipe), "__call__", lambda self, *a, **k: call(self, *a, **{**k, "output_type": "pt"})):
        yield


def decoded(name: str, pipe: Any) -> np.ndarray:
    """One whole call up to the frames the VAE decodes."""
    with _decoding(pipe):
        return video(name, pipe)


def denoisers(pipe: Any) -> list[torch.nn.Module]:
    """The transformers a call runs: Wan 2.2's second expert too."""
    return [m for m in (pipe.transformer, getattr(pipe, "transformer_2", None)) if m is not None]


def tome_on(pipe: Any) -> None:
    tp.apply_tome(pipe, preset="balanced")
    assert all(tp.is_tome_applied(model) for model in denoisers(pipe))


def cache_on(pipe: Any, name: str, cache: str) -> None:
    models, steps = denoisers(pipe), PIPELINES[name][2]
    assert len(models) == len(steps)
    for model, model_steps in zip(models, steps, strict=True):
        model.enable_cache(CACHES[cache](model_steps))


def cache_off(pipe: Any) -> None:
    for model in denoisers(pipe):
        model.disable_cache()


def assert_vae_untouched(vae: torch.nn.Module) -> None:
    """No ToMe processor, hook or attribute anywhere in the VAE (its attention included)."""
    assert not any(isinstance(getattr(m, "processor", None), ToMeProcessor) for m in vae.modules())
    assert not tp.is_tome_applied(vae)
    assert hooks_left(vae) == 0 and tome_attributes_left(vae) == []


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_balanced_tome_merges_on_each_pipeline(name, tmp_path):
    pipe = build(name, tmp_path)
    plain = video(name, pipe)
    tome_on(pipe)
    merged = video(name, pipe)
    assert np.isfinite(merged).all() and not np.array_equal(merged, plain)
    tp.remove_tome(pipe)
    assert np.array_equal(video(name, pipe), plain)


# ---------------------------------------------------------------- VAE tiling


@ORDER
@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_vae_tiling_and_tome(name, tome_first, tmp_path):
    pipe = build(name, tmp_path)
    untiled = decoded(name, pipe)
    pipe.vae.enable_tiling(**TILES[name])
    tiled = decoded(name, pipe)
    assert tiled.shape == untiled.shape and not np.array_equal(tiled, untiled)  # the clip really is tiled
    if tome_first:
        pipe.vae.disable_tiling()
        tome_on(pipe)
        pipe.vae.enable_tiling(**TILES[name])
    else:
        tome_on(pipe)
    first, second = decoded(name, pipe), decoded(name, pipe)
    assert np.isfinite(first).all() and np.array_equal(first, second)
    assert not np.array_equal(first, tiled)
    assert_vae_untouched(pipe.vae)
    tp.remove_tome(pipe)
    assert np.array_equal(decoded(name, pipe), tiled)


# ---------------------------------------------------------------- step caches


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_each_pipeline_opens_cache_contexts(name, tmp_path):
    # What makes a step cache act in a whole call: the pipeline runs its denoiser inside `cache_context(...)`.
    assert "cache_context(" in inspect.getsource(type(build(name, tmp_path)).__call__)


@ORDER
@pytest.mark.parametrize(("name", "cache"), CACHE_CASES)
def test_step_cache_and_tome(name, cache, tome_first, tmp_path):
    pipe = build(name, tmp_path)
    plain = video(name, pipe)
    tome_on(pipe)
    tome_only = video(name, pipe)
    tp.remove_tome(pipe)
    cache_on(pipe, name, cache)
    cache_only = video(name, pipe)
    cache_off(pipe)
    assert not np.array_equal(cache_only, plain)  # the cache acts on this pipeline without ToMe

    if tome_first:
        tome_on(pipe)
        cache_on(pipe, name, cache)
    else:
        cache_on(pipe, name, cache)
        tome_on(pipe)
    both, again = video(name, pipe), video(name, pipe)
    assert np.isfinite(both).all() and np.array_equal(both, again)
    assert not np.array_equal(both, tome_only)  # the cache acts on the merged denoiser

    cache_off(pipe)  # ToMe alone stays
    assert np.array_equal(video(name, pipe), tome_only)
    cache_on(pipe, name, cache)  # and takes the cache again
    assert np.array_equal(video(name, pipe), both)
    tp.remove_tome(pipe)  # the cache alone stays, as if ToMe had never been there
    assert np.array_equal(video(name, pipe), cache_only)
    cache_off(pipe)
    assert np.array_equal(video(name, pipe), plain)


@pytest.mark.parametrize(("name", "cache"), sorted(TAYLORSEER_IDLE))
def test_default_taylorseer_acts_on_no_wan_or_ltx_attention(name, cache, tmp_path):
    # Why `CACHE_CASES` leaves these out: the video is the plain one, with ToMe or without. If diffusers' default
    # identifiers start matching `attn1` / `attn2`, this fails and the pair must join the tests above.
    pipe = build(name, tmp_path)
    plain = video(name, pipe)
    cache_on(pipe, name, cache)
    assert np.array_equal(video(name, pipe), plain)
    tome_on(pipe)
    merged = video(name, pipe)
    cache_off(pipe)
    assert np.array_equal(video(name, pipe), merged)
    tp.remove_tome(pipe)


@pytest.mark.parametrize(("name", "cache"), sorted(FAILS_ALONE))
def test_caches_that_fail_without_tome(name, cache, tmp_path):
    # diffusers' own refusal, on the plain pipeline; with ToMe on it is the same refusal, nothing of ToMe's.
    pipe = build(name, tmp_path)
    with pytest.raises(ValueError, match="not registered"):
        cache_on(pipe, name, cache)
    tome_on(pipe)
    with pytest.raises(ValueError, match="not registered"):
        cache_on(pipe, name, cache)


# ---------------------------------------------------------------- group offloading


@ORDER
@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_group_offloading_and_tome(name, offload_type, tome_first, tmp_path):
    # Both devices are the CPU: the offloading hooks run (moving nothing), so any difference is a composition bug.
    pipe = build(name, tmp_path)
    plain = video(name, pipe)
    tome_on(pipe)
    tome_only = video(name, pipe)
    tp.remove_tome(pipe)
    assert not np.array_equal(tome_only, plain)

    cpu = torch.device("cpu")
    per_group = {"num_blocks_per_group": 1} if offload_type == "block_level" else {}
    if tome_first:
        tome_on(pipe)
    for model in denoisers(pipe):
        model.enable_group_offload(onload_device=cpu, offload_device=cpu, offload_type=offload_type, **per_group)
    if not tome_first:
        assert np.array_equal(video(name, pipe), plain)  # offloading alone: the plain video
        tome_on(pipe)
    assert np.array_equal(video(name, pipe), tome_only)
    tp.remove_tome(pipe)  # the offloading stays
    assert np.array_equal(video(name, pipe), plain)


def test_wan22_experts_run_the_steps_their_caches_are_given(tmp_path):
    # MagCache resets at its `num_inference_steps`: each expert's count must be the steps it really runs.
    pipe = build("wan2.2", tmp_path)
    calls = {id(model): 0 for model in denoisers(pipe)}
    for model in denoisers(pipe):
        model.register_forward_pre_hook(lambda module, args: calls.__setitem__(id(module), calls[id(module)] + 1))
    video("wan2.2", pipe)
    assert tuple(calls.values()) == tuple(2 * steps for steps in PIPELINES["wan2.2"][2])  # guidance: 2 calls a step
