"""Reuse across steps (`recompute_every`) through whole pipeline calls that run classifier-free guidance as two
model calls per step (Qwen-Image, Qwen-Image-Edit, Chroma: the prompt's call and the negative prompt's, each with
a timestep tensor of its own), FLUX.2 with a reference image (its `img_ids` made anew at every step) and Wan (two
calls per step with one timestep tensor): steps are counted per denoising step, each call reuses its own merges,
and one seed gives one image on every call.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import tome_processors as tp
from tome_processors import context as context_module

import test_new_families as new_families
import test_video as video

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 4


def flux2_edit(tmp_path: Path):
    pipe, args = new_families.tiny_flux2_pipeline(tmp_path)
    pixels = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    return pipe, {**args, "image": Image.fromarray(pixels)}


def image_call(builder):
    def build(tmp_path: Path):
        pipe, args = builder(tmp_path)
        args = {"height": 32, "width": 32, **args, "num_inference_steps": STEPS, "output_type": "np"}
        return pipe, lambda: np.asarray(pipe(**args, generator=torch.Generator().manual_seed(0)).images)

    return build


def wan(tmp_path: Path):
    pipe = video.tiny_wan_pipeline(tmp_path)
    return pipe, lambda: np.asarray(video.generate(pipe))  # 4 steps


#: name: (build(tmp_path) -> (pipeline, generate()), model calls per denoising step)
CASES = {
    "qwenimage": (image_call(new_families.tiny_qwenimage_pipeline), 2),
    "qwenimage-edit": (image_call(new_families.tiny_qwenimage_edit_pipeline), 2),
    "chroma": (image_call(new_families.tiny_chroma_pipeline), 2),
    "flux2-edit": (image_call(flux2_edit), 1),
    "wan": (wan, 2),  # 2 x 2 tokens a frame: one window, so reusing changes nothing in its output
}


def matchings_per_call(monkeypatch, model, generate) -> tuple[np.ndarray, list[int]]:
    """The output of `generate()` and the matchings computed in each call of `model` (one per merged block that did
    not reuse a kept merge)."""
    calls: list[int] = []
    per_call: list[int] = []
    original = context_module.match

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    def ended(module, args, output):
        per_call.append(len(calls) - sum(per_call))

    monkeypatch.setattr(context_module, "match", counting)
    handle = model.register_forward_hook(ended)
    out = generate()
    handle.remove()
    monkeypatch.setattr(context_module, "match", original)
    return out, per_call


@pytest.mark.parametrize("name", sorted(CASES))
def test_reuse_counts_denoising_steps_not_model_calls(name, tmp_path, monkeypatch):
    build, calls_per_step = CASES[name]
    pipe, generate = build(tmp_path)
    model = pipe.transformer
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp.apply_tome(pipe, ratio=0.5)
        every_step, computed_every_step = matchings_per_call(monkeypatch, model, generate)
        tp.apply_tome(pipe, ratio=0.5, recompute_every=2)
        reused, computed_reusing = matchings_per_call(monkeypatch, model, generate)
        again, _ = matchings_per_call(monkeypatch, model, generate)
    assert len(computed_every_step) == STEPS * calls_per_step and min(computed_every_step) > 0
    assert np.isfinite(reused).all()
    # Every call of steps 0 and 2 computes its own merges (as many as without reuse); steps 1 and 3 reuse them.
    steps = [call // calls_per_step for call in range(len(computed_reusing))]
    assert computed_reusing == [n if step % 2 == 0 else 0 for n, step in zip(computed_every_step, steps, strict=True)]
    if name != "wan":  # reuse happened: another image than recomputing every step
        assert not np.array_equal(reused, every_step)
    assert np.array_equal(again, reused)  # and one seed gives one image on every call
