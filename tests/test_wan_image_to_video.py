"""`WanImageToVideoPipeline` (Wan 2.1 I2V) end to end: a tiny offline pipeline, merged with `apply_tome(pipe)` and
with `pipe.enable_tome()`.

The I2V transformer reads the image's CLIP embedding as extra context tokens in front of the 512 text tokens
(its processor splits them off by position): ToMe merges self-attention only, so cross-attention must still
see every image and text token.
"""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import WanImageToVideoPipeline, WanTransformer3DModel
from diffusers.pipelines.wan import pipeline_wan_i2v
from PIL import Image
from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModelWithProjection

import tome_processors as tp
from tome_processors.context import BlockState

from leftovers import hooks_left, tome_attributes_left
from test_video import RecordingWan, tiny_wan, tiny_wan_pipeline

pytestmark = pytest.mark.usefixtures("one_thread", "ftfy_or_stand_in")

#: The CLIP vision tower: 32 px images in 8 px patches, 16 patch tokens and the class token.
IMAGE_SIDE, IMAGE_PATCH, IMAGE_WIDTH = 32, 8, 24
IMAGE_TOKENS = (IMAGE_SIDE // IMAGE_PATCH) ** 2 + 1
#: Wan's I2V attention takes the last 512 context tokens as the text: the pipeline pads prompts to 512.
TEXT_TOKENS = 512
#: A 64 x 64 clip of 5 frames: 2 latent frames of 8 x 8, 2 x 4 x 4 = 32 tokens.
SIDE, FRAMES, TOKENS = 64, 5, 32


@pytest.fixture
def ftfy_or_stand_in(monkeypatch):
    """The I2V pipeline cleans prompts with ftfy whether it is installed or not (diffusers 0.42.1; the T2V
    pipeline skips it when missing): without it, a stand-in that leaves the prompt as it is."""
    if not hasattr(pipeline_wan_i2v, "ftfy"):
        monkeypatch.setattr(pipeline_wan_i2v, "ftfy", SimpleNamespace(fix_text=lambda text: text), raising=False)


def tiny_wan_i2v_pipeline(tmp_path) -> WanImageToVideoPipeline:
    """The tiny T2V pipeline's tokenizer, UMT5, VAE and scheduler, a CLIP vision encoder and an I2V transformer."""
    t2v = tiny_wan_pipeline(tmp_path)
    torch.manual_seed(0)
    image_encoder = CLIPVisionModelWithProjection(
        CLIPVisionConfig(
            hidden_size=IMAGE_WIDTH,
            intermediate_size=32,
            projection_dim=IMAGE_WIDTH,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=IMAGE_SIDE,
            patch_size=IMAGE_PATCH,
        )
    ).eval()
    with warnings.catch_warnings():  # without torchvision it falls back to the PIL processor, and says so
        warnings.simplefilter("ignore")
        image_processor = CLIPImageProcessor(crop_size=IMAGE_SIDE, size={"shortest_edge": IMAGE_SIDE})
    latent = t2v.vae.config.z_dim
    # The I2V transformer reads the noisy latents, the encoded first frame and a 4-channel frame mask.
    config = {**tiny_wan(image_dim=IMAGE_WIDTH).config, "in_channels": 2 * latent + 4, "out_channels": latent}
    torch.manual_seed(0)
    transformer = WanTransformer3DModel.from_config(config).eval()
    pipe = WanImageToVideoPipeline(
        tokenizer=t2v.tokenizer,
        text_encoder=t2v.text_encoder,
        vae=t2v.vae,
        scheduler=t2v.scheduler,
        image_processor=image_processor,
        image_encoder=image_encoder,
        transformer=transformer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def first_frame() -> Image.Image:
    pixels = np.random.default_rng(0).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def generate(pipe: WanImageToVideoPipeline) -> np.ndarray:
    with torch.no_grad():
        return pipe(
            image=first_frame(),
            prompt="a cat walks",
            negative_prompt="blurry",
            height=SIDE,
            width=SIDE,
            num_frames=FRAMES,
            num_inference_steps=2,
            guidance_scale=5.0,
            generator=torch.Generator().manual_seed(0),
            output_type="np",
        ).frames


@pytest.mark.parametrize("how", ["apply_tome", "enable_tome"])
def test_image_to_video_pipeline_merges_and_comes_back_bit_for_bit(tmp_path, request, how):
    pipe = tiny_wan_i2v_pipeline(tmp_path)
    recorder = RecordingWan()
    pipe.transformer.set_attn_processor(recorder)  # ToMe wraps it: it sees what Wan's processor gets
    baseline = generate(pipe)
    assert baseline.shape == (1, FRAMES, SIDE, SIDE, 3) and np.isfinite(baseline).all()
    hooks_before = hooks_left(pipe.transformer)  # the pipeline's `cache_context` gives it a diffusers hook registry
    merges = []
    original = BlockState.merge_for

    def recording(self, config, *args, **kwargs):
        merge = original(self, config, *args, **kwargs)
        merges.append(merge is not None)
        return merge

    if how == "apply_tome":
        tp.apply_tome(pipe, ratio=0.5, sx=1, sy=1, st=2)
    else:
        tp.patch_pipelines()  # the opt-in that gives every pipeline `enable_tome()`
        request.addfinalizer(tp.unpatch_pipelines)
        pipe.enable_tome(ratio=0.5, sx=1, sy=1, st=2)
    assert tp.is_tome_applied(pipe.transformer)
    assert not tp.is_tome_applied(pipe.image_encoder) and not tp.is_tome_applied(pipe.text_encoder)
    recorder.calls.clear()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BlockState, "merge_for", recording)
        first = generate(pipe)
    second = generate(pipe)
    np.testing.assert_array_equal(first, second)  # same seed, same video
    assert np.isfinite(first).all() and not np.array_equal(first, baseline)
    assert any(merges)
    calls = [(hidden.shape[1], None if context is None else context.shape[1]) for hidden, context, _ in recorder.calls]
    self_attention = [tokens for tokens, context in calls if context is None]
    cross_attention = [(tokens, context) for tokens, context in calls if context is not None]
    assert self_attention and all(tokens < TOKENS for tokens in self_attention)  # every self-attention merged
    # cross-attention: every clip token asks, and sees every image-embedding and text token
    assert cross_attention and set(cross_attention) == {(TOKENS, IMAGE_TOKENS + TEXT_TOKENS)}
    if how == "apply_tome":
        tp.remove_tome(pipe)
    else:
        pipe.disable_tome()
    assert not tp.is_tome_applied(pipe.transformer)
    assert hooks_left(pipe.transformer) == hooks_before and tome_attributes_left(pipe.transformer) == []
    np.testing.assert_array_equal(generate(pipe), baseline)
