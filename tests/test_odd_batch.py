"""tomesd's odd-batch rule, per family, through whole pipeline calls.

tomesd turns random destinations (`use_rand`) off at an odd batch, which cannot hold a classifier-free guidance's
two halves. It applies on the families whose pipelines batch those halves (the UNets, as tomesd: an SD call at
batch 1 merges as with `use_rand=False`). The pipelines of FLUX.1, FLUX.2, Chroma, Qwen-Image (and Edit), Wan and
HunyuanVideo call the model at batch 1 (once per guidance branch, or without guidance): there the destinations are
random at every batch size, as the presets were measured.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import test_reuse_across_steps as reuse
import tome_processors as tp
from tome_processors.families import family_of

import test_hunyuanvideo as hunyuan
import test_video as video
from pipelines import family_pipeline, tiny_sd_pipeline

pytestmark = pytest.mark.usefixtures("one_thread")


def flux(tmp_path):
    pipe, args = family_pipeline("flux", tmp_path)
    return pipe, lambda: np.asarray(
        pipe(**args, num_inference_steps=2, generator=torch.Generator().manual_seed(0)).images
    )


def hunyuanvideo(tmp_path):
    pipe = hunyuan.tiny_hunyuanvideo_pipeline(tmp_path)
    return pipe, lambda: hunyuan.generate(pipe).numpy()


#: The pipelines that call their model at batch 1: name -> build(tmp_path) -> (pipeline, generate()).
BATCH_ONE = {
    "flux": flux,
    "flux2": reuse.image_call(reuse.new_families.tiny_flux2_pipeline),
    "flux2-edit": reuse.image_call(reuse.flux2_edit),
    "chroma": reuse.image_call(reuse.new_families.tiny_chroma_pipeline),
    "qwenimage": reuse.image_call(reuse.new_families.tiny_qwenimage_pipeline),
    "qwenimage-edit": reuse.image_call(reuse.new_families.tiny_qwenimage_edit_pipeline),
    "wan": lambda tmp_path: (lambda pipe: (pipe, lambda: np.asarray(video.generate(pipe))))(
        video.tiny_wan_pipeline(tmp_path)
    ),
    "hunyuanvideo": hunyuanvideo,
}


def with_and_without_random(pipe, generate) -> tuple[np.ndarray, np.ndarray, list[int]]:
    batches: list[int] = []
    model = pipe.transformer
    model.register_forward_pre_hook(lambda module, args, kwargs: batches.append(_batch(args, kwargs)), with_kwargs=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp.apply_tome(pipe, ratio=0.5, use_rand=True)
        random = generate()
        tp.apply_tome(pipe, ratio=0.5, use_rand=False)
        fixed = generate()
    return random, fixed, batches


def _batch(args: tuple, kwargs: dict) -> int:
    x = kwargs.get("hidden_states", args[0] if args else None)
    return int(x.shape[0])


@pytest.mark.parametrize("name", sorted(BATCH_ONE))
def test_batch_one_pipelines_choose_random_destinations(name, tmp_path):
    pipe, generate = BATCH_ONE[name](tmp_path)
    assert not family_of(pipe.transformer).guidance_in_batch
    random, fixed, batches = with_and_without_random(pipe, generate)
    assert set(batches) == {1}  # every call of the model at batch 1
    assert np.isfinite(random).all() and not np.array_equal(random, fixed)


def test_unet_pipelines_keep_tomesds_rule_at_batch_one(tmp_path):
    pipe = tiny_sd_pipeline(tmp_path)
    args = dict(prompt="a cat", height=32, width=32, num_inference_steps=2, output_type="np")

    def generate(guidance_scale: float) -> np.ndarray:
        return pipe(**args, guidance_scale=guidance_scale, generator=torch.Generator().manual_seed(0)).images

    tp.apply_tome(pipe, ratio=0.5, use_rand=True)
    random_one, random_two = generate(1.0), generate(7.5)  # batch 1 (no guidance) and batch 2
    tp.apply_tome(pipe, ratio=0.5, use_rand=False)
    assert np.array_equal(generate(1.0), random_one)  # the odd batch chose fixed destinations
    assert not np.array_equal(generate(7.5), random_two)
