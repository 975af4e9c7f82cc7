"""`explain_tome` counts tokens with the pipeline's VAE factor, and says what a real forward then does.

The tiny SD pipeline's VAE has two blocks: 2 pixels per latent pixel (`pipe.vae_scale_factor == 2`), so a
128 px image is a 64 x 64 latent, 4096 tokens at the first level, where the presets merge on the CPU.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import tome_processors as tp
from tome_processors import explain_tome

from pipelines import tiny_sd_pipeline

SIZE = 128


def level_modules(unet: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """The first self-attention module of each down level with attention, by downsample level."""
    return {1: unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1,
            2: unet.down_blocks[1].attentions[0].transformer_blocks[0].attn1}  # fmt: skip


def forward_tokens(pipe, preset: str) -> dict[int, dict[str, int]]:
    """Per level, the tokens of one real pipeline call with `preset`: what the attention module gets, and what
    its query and key projections get (fewer where ToMe merges or pools)."""
    seen: dict[int, dict[str, int]] = {}
    handles = []
    for level, attn in level_modules(pipe.unet).items():
        counts = seen.setdefault(level, {})
        for name, module in (("input", attn), ("query", attn.to_q), ("key", attn.to_k)):

            def count(module, args, kwargs, counts=counts, name=name):
                tokens = args[0] if args else kwargs["hidden_states"]
                counts.setdefault(name, tokens.shape[1])

            handles.append(module.register_forward_pre_hook(count, with_kwargs=True))
    tp.apply_tome(pipe, preset=preset)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            pipe("a cat", height=SIZE, width=SIZE, num_inference_steps=1, output_type="latent")
    finally:
        tp.remove_tome(pipe)
        for handle in handles:
            handle.remove()
    return seen


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    pipe = tiny_sd_pipeline(tmp_path_factory.mktemp("explain"))
    assert pipe.vae_scale_factor == 2
    return pipe


@pytest.mark.parametrize("preset", ["exact", "balanced", "fast"])
@pytest.mark.pays_rule  # the real table, as users run it
def test_explain_on_a_factor_2_pipeline_says_what_the_forward_does(pipe, preset):
    rows = {row.level: row for row in explain_tome(pipe, SIZE, SIZE, batch=2, preset=preset, print_table=False)}
    for level, counts in forward_tokens(pipe, preset).items():
        row = rows[level]
        assert row.tokens == counts["input"], (level, row, counts)
        merged = counts["query"] < counts["input"] or counts["key"] < counts["input"]
        assert row.merges == merged, (level, row, counts)
        if row.kv_factor:  # K/V pooled over kv_factor x kv_factor windows
            assert counts["key"] * row.kv_factor**2 == counts["input"]
    assert rows[1].tokens == (SIZE // 2) ** 2 and rows[1].merges  # every preset merges 4096 tokens on the CPU


def test_a_bare_model_takes_the_factor_or_the_familys_usual_one(pipe):
    usual = explain_tome(pipe.unet, SIZE, SIZE, preset="fast", print_table=False)
    assert usual[0].tokens == (SIZE // 8) ** 2  # a released SD VAE: 8 px per latent pixel
    given = explain_tome(pipe.unet, SIZE, SIZE, preset="fast", vae_scale_factor=2, print_table=False)
    assert given == explain_tome(pipe, SIZE, SIZE, preset="fast", print_table=False)
    with pytest.raises(ValueError, match="vae_scale_factor to be a positive int"):
        explain_tome(pipe.unet, SIZE, SIZE, vae_scale_factor=0)
