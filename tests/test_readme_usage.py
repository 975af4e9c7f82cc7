"""The README's first usage, `pipe.<denoiser>.set_attn_processor(ToMeProcessor(ratio=0.5))`, on the pipelines of
the families beyond SD, PixArt, SD3 and FLUX.1 (those: tests/test_generations.py): whole calls, twice, merging
as `apply_tome(pipe)` does, and `remove_tome(pipe)` gives the plain output back. The usage is set on a new
pipeline, before its first call. Wan 2.2's pipeline gets it on `transformer` and `transformer_2`, as the README
says; FLUX.2 runs text to image and with a reference image (`flux2-edit`).

LTX-Video, LTX-2 (2.0 and 2.3), HunyuanVideo and HunyuanVideo 1.5 run the same check on their tiny pipelines in
their own files (`check_pipeline_usage(..., "set_attn_processor")` in tests/test_ltx.py, tests/test_ltx2.py and
tests/test_hunyuanvideo.py). Z-Image's transformer has no `set_attn_processor` (the README says to use
`apply_tome` there; tests/test_new_families.py runs its pipeline with it).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import StableDiffusionPipeline
from PIL import Image

import tome_processors as tp
from tome_processors import ToMeProcessor

import test_new_families as new_families
import test_video as video
import test_video_unet as video_unet
import test_wan_image_to_video as wan_i2v
from models import tiny_unet
from pipelines import tiny_animatediff_pipeline, tiny_sd_pipeline, tiny_svd_pipeline
from test_pipeline import sdxl_pipeline
from test_wan_image_to_video import ftfy_or_stand_in  # noqa: F401  (a fixture: the I2V pipeline's prompt cleaning)

pytestmark = pytest.mark.usefixtures("one_thread", "ftfy_or_stand_in")

Build = Callable[[Path], tuple[Any, Callable[[Any], np.ndarray]]]


def _new_family(name: str) -> Build:
    def build(tmp_path: Path) -> tuple[Any, Callable[[Any], np.ndarray]]:
        pipe, args = new_families.PIPELINES[name](tmp_path)
        return pipe, lambda p: new_families.generate(p, args).numpy()

    return build


def _images(builder: Callable[[Path], tuple[Any, dict]]) -> Build:
    """A builder of `(pipeline, call arguments)`: two-step generations with a seed, returned as an array."""

    def build(tmp_path: Path) -> tuple[Any, Callable[[Any], np.ndarray]]:
        pipe, args = builder(tmp_path)
        args = {"num_inference_steps": 2, "output_type": "np", **args}

        def generate(p: Any) -> np.ndarray:
            with torch.no_grad():
                return np.asarray(p(**args, generator=torch.Generator().manual_seed(0)).images)

        return pipe, generate

    return build


def _unet_pipeline(make: Callable[[Path], Any]) -> Callable[[Path], tuple[Any, dict]]:
    return lambda tmp_path: (make(tmp_path), {"prompt": "a cat", "height": 32, "width": 32})


def tiny_flux2_edit_pipeline(tmp_path: Path) -> tuple[Any, dict]:
    """`tiny_flux2_pipeline` given a reference image (64 x 64 px, the pipeline's least: 32 x 32 tokens)."""
    pipe, args = new_families.tiny_flux2_pipeline(tmp_path)
    pixels = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    return pipe, {**args, "image": Image.fromarray(pixels)}


def tiny_sd2_pipeline(tmp_path: Path) -> StableDiffusionPipeline:
    """`tiny_sd_pipeline` with an SD2-shaped UNet (linear projections, heads per level)."""
    pipe = StableDiffusionPipeline(**{**tiny_sd_pipeline(tmp_path).components, "unet": tiny_unet("sd2")})
    pipe.set_progress_bar_config(disable=True)
    return pipe


#: name: tmp_path -> (pipeline, generate(pipeline) -> images or frames)
PIPELINES: dict[str, Build] = {
    "sd2": _images(_unet_pipeline(tiny_sd2_pipeline)),
    "sdxl": _images(_unet_pipeline(sdxl_pipeline)),
    "chroma": _new_family("chroma"),
    "qwenimage": _new_family("qwenimage"),
    "qwenimage-edit": _images(new_families.tiny_qwenimage_edit_pipeline),
    "flux2": _images(new_families.tiny_flux2_pipeline),
    "flux2-edit": _images(tiny_flux2_edit_pipeline),
    "wan2.1": lambda tmp_path: (video.tiny_wan_pipeline(tmp_path), video.generate),
    "wan2.2": lambda tmp_path: (video.tiny_wan_pipeline(tmp_path, two_experts=True), video.generate),
    "wan-i2v": lambda tmp_path: (wan_i2v.tiny_wan_i2v_pipeline(tmp_path), wan_i2v.generate),
    "svd": lambda tmp_path: (tiny_svd_pipeline(), lambda p: np.asarray(video_unet.svd_frames(p))),
    "animatediff": lambda tmp_path: (
        tiny_animatediff_pipeline(tmp_path),
        lambda p: np.asarray(video_unet.animatediff_frames(p)),
    ),
}


def denoiser(pipe: Any) -> Any:
    return pipe.unet if hasattr(pipe, "unet") else pipe.transformer


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_readme_first_usage_on_the_other_families(name, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # diffusers' deprecation notes about the tiny components' configs
        pipe, generate = PIPELINES[name](tmp_path / "a")
        denoiser(pipe).set_attn_processor(ToMeProcessor(ratio=0.5))  # the README's first usage, on a new pipeline
        if getattr(pipe, "transformer_2", None) is not None:  # Wan 2.2: "`transformer_2` too"
            pipe.transformer_2.set_attn_processor(ToMeProcessor(ratio=0.5))
        first, second = generate(pipe), generate(pipe)
        applied = tp.is_tome_applied(pipe)

        reference, _ = PIPELINES[name](tmp_path / "b")
        plain = generate(reference)
        tp.apply_tome(reference, ratio=0.5)
        expected = generate(reference)

        tp.remove_tome(pipe)  # the README: "bit-identical to never having applied it"
        removed = generate(pipe)
    assert np.isfinite(first).all() and not np.allclose(first, plain, atol=1e-6)
    assert np.array_equal(first, second) and applied
    np.testing.assert_allclose(first, expected, rtol=0, atol=1e-6)  # as apply_tome merges
    assert not tp.is_tome_applied(pipe) and np.array_equal(removed, plain)
