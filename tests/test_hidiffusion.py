"""ToMe with HiDiffusion's window attention: the windows `attn1` gets are merged (or pooled) inside each window.

HiDiffusion (0.1.10) hands `attn1` of the top level's blocks four windows per sample, `(4B, N/4)`: each window a
whole quarter of the level's grid (maybe rolled first). On diffusers 0.42 it needs one import shim: the module it
imports `MultiControlNetModel` from moved to `diffusers.models.controlnets`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import diffusers.models.controlnets.multicontrolnet as _multicontrolnet
import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from diffusers.models.attention_processor import AttnProcessor2_0

import tome_processors as tp
from tome_processors import ToMeConfig
from tome_processors.bench.pipelines import write_clip_tokenizer
from tome_processors.pays import ALWAYS, pays_table

from models import CROSS_DIM
from pipelines import TOKENS, tiny_text_encoder, tiny_vae

sys.modules.setdefault("diffusers.pipelines.controlnet.multicontrolnet", _multicontrolnet)
hidiffusion = pytest.importorskip("hidiffusion")

#: The top level's transformer blocks HiDiffusion gives window attention on SD1.5.
WINDOW_BLOCKS = (
    "down_blocks.0.attentions.0.transformer_blocks.0",
    "down_blocks.0.attentions.1.transformer_blocks.0",
    "up_blocks.3.attentions.0.transformer_blocks.0",
    "up_blocks.3.attentions.1.transformer_blocks.0",
    "up_blocks.3.attentions.2.transformer_blocks.0",
)
#: 32 px through the factor-2 tiny VAE: a 16 x 16 latent, four 8 x 8 windows at the top level.
SIDE, WINDOW_TOKENS = 32, 8 * 8


class CountingProcessor(AttnProcessor2_0):
    """SDPA that records the query and key token counts of every call."""

    def __init__(self, log: list[tuple[int, int, int]]) -> None:
        super().__init__()
        self.log = log

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        temb: torch.Tensor | None = None,
        *args,
        **kwargs,
    ) -> torch.Tensor:
        keys = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        self.log.append((hidden_states.shape[0], hidden_states.shape[1], keys.shape[1]))
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, temb, *args, **kwargs)


def hidiffusion_pipeline(tmp_path: Path) -> tuple[StableDiffusionPipeline, list]:
    """A tiny pipeline with SD1.5's module layout (HiDiffusion recognises SD1.5 by its module names), HiDiffusion
    applied, and a `CountingProcessor` on the window blocks' `attn1` (its log is returned)."""
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=16,
        layers_per_block=2,
        norm_num_groups=8,
        cross_attention_dim=CROSS_DIM,
        block_out_channels=(16, 32, 48, 48),  # distinct widths: the shortcut convolutions SD1.5 has
        attention_head_dim=8,
    ).eval()
    tokenizer = write_clip_tokenizer(tmp_path / "tokenizer", max_length=TOKENS)
    scheduler = DDIMScheduler(beta_schedule="scaled_linear", clip_sample=False, steps_offset=1)
    pipe = StableDiffusionPipeline(
        vae=tiny_vae(),
        text_encoder=tiny_text_encoder(len(tokenizer)),
        tokenizer=tokenizer,
        unet=unet,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    pipe.register_to_config(_name_or_path="")  # HiDiffusion reads it as a string
    log: list[tuple[int, int, int]] = []
    for name in WINDOW_BLOCKS:
        unet.get_submodule(name).attn1.set_processor(CountingProcessor(log))
    hidiffusion.apply_hidiffusion(pipe)
    return pipe, log


def generate(pipe: StableDiffusionPipeline) -> np.ndarray:
    # HiDiffusion draws each window block's roll from torch's global generator: seeded too.
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    return pipe("a cat", height=SIDE, width=SIDE, num_inference_steps=2, generator=generator, output_type="np").images


@pytest.mark.parametrize("preset", [None, "balanced", "fast"])
def test_tome_merges_inside_hidiffusion_windows(tmp_path, preset, one_thread):
    pipe, log = hidiffusion_pipeline(tmp_path)
    alone = generate(pipe)
    assert log and {entry for entry in log} == {(2 * 4, WINDOW_TOKENS, WINDOW_TOKENS)}  # windows, as expected
    log.clear()

    with tp.strict_skips(), pays_table(ALWAYS):  # no attention left unmerged for a cause nobody chose
        if preset is None:
            tp.apply_tome(pipe, ratio=0.5)
        else:
            tp.apply_tome(pipe, preset=preset)
        first = generate(pipe)
        seen = set(log)
        second = generate(pipe)

    if preset is None:  # each window loses half its tokens: the level's ratio inside each 8 x 8 window
        assert seen == {(2 * 4, WINDOW_TOKENS // 2, WINDOW_TOKENS // 2)}
    else:  # keys pooled inside each window with the top level's factor (not the next level's)
        factor = ToMeConfig.from_preset(preset, "unet").kv_factor_at(1)
        assert seen == {(2 * 4, WINDOW_TOKENS, WINDOW_TOKENS // factor**2)}
    assert np.isfinite(first).all() and not np.array_equal(first, alone)
    np.testing.assert_array_equal(first, second)  # one seed, one image

    tp.remove_tome(pipe)
    np.testing.assert_array_equal(generate(pipe), alone)


def test_window_shape_splits_a_grid_into_whole_sub_grids():
    from tome_processors.context import _window_shape

    assert _window_shape(16, 16, 4) == (8, 8)  # HiDiffusion's 2 x 2
    assert _window_shape(6, 8, 2) == (3, 8)  # on a tie, rows of windows
    assert _window_shape(5, 8, 2) == (5, 4)
    assert _window_shape(5, 7, 4) is None  # no whole split: said as a skip, not merged
