"""The README's first usage, `pipe.<denoiser>.set_attn_processor(ToMeProcessor(ratio=0.5))`, on the pipelines of
the families beyond SD, PixArt, SD3 and FLUX.1 (those: tests/test_generations.py): whole calls, twice, merging
as `apply_tome(pipe)` does. Z-Image's transformer has no `set_attn_processor` (the README says to use
`apply_tome` there; tests/test_new_families.py runs its pipeline)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import tome_processors as tp
from tome_processors import ToMeProcessor

import test_new_families as new_families
import test_video as video
import test_video_unet as video_unet
from pipelines import tiny_animatediff_pipeline, tiny_svd_pipeline

pytestmark = pytest.mark.usefixtures("one_thread")


def _new_family(name: str) -> Callable[[Path], tuple[Any, Callable[[Any], np.ndarray]]]:
    def build(tmp_path: Path) -> tuple[Any, Callable[[Any], np.ndarray]]:
        pipe, args = new_families.PIPELINES[name](tmp_path)
        return pipe, lambda p: new_families.generate(p, args).numpy()

    return build


#: name: tmp_path -> (pipeline, generate(pipeline) -> images or frames)
PIPELINES = {
    "chroma": _new_family("chroma"),
    "qwenimage": _new_family("qwenimage"),
    "wan": lambda tmp_path: (video.tiny_wan_pipeline(tmp_path), video.generate),
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
        plain = generate(pipe)
        reference, _ = PIPELINES[name](tmp_path / "b")
        tp.apply_tome(reference, ratio=0.5)
        expected = generate(reference)

        denoiser(pipe).set_attn_processor(ToMeProcessor(ratio=0.5))  # the README's first usage
        first, second = generate(pipe), generate(pipe)
    assert np.isfinite(first).all() and not np.allclose(first, plain, atol=1e-6)
    assert np.array_equal(first, second) and tp.is_tome_applied(pipe)
    np.testing.assert_allclose(first, expected, rtol=0, atol=1e-6)  # as apply_tome merges
