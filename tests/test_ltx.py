"""LTX-Video (`LTXVideoTransformer3DModel`): packed video tokens, the grid from `num_frames` / `height` / `width`,
per-sample 3-D rotary tables that follow the merged rows, and whole `LTXPipeline` calls."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLLTXVideo, FlowMatchEulerDiscreteScheduler, LTXPipeline, LTXVideoTransformer3DModel
from diffusers.models.transformers.transformer_ltx import LTXVideoAttnProcessor
from transformers import T5Config, T5EncoderModel

import tome_processors as tp
from tome_processors.bench.pipelines import write_t5_tokenizer
from tome_processors.families import LTXVideoFamily, family_of

from leftovers import hooks_left, tome_attributes_left
from pipelines import TOME_USAGES, check_pipeline_usage

TEXT_DIM, TEXT_LEN = 16, 7


def tiny_ltx(num_layers: int = 2, channels: int = 4, text_dim: int = TEXT_DIM) -> LTXVideoTransformer3DModel:
    torch.manual_seed(0)
    return LTXVideoTransformer3DModel(
        in_channels=channels,
        out_channels=channels,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        num_layers=num_layers,
        caption_channels=text_dim,
    ).eval()


def ltx_inputs(batch: int = 2, frames: int = 3, h: int = 6, w: int = 8, seed: int = 0, positional: bool = False):
    """A packed latent clip of `frames` x `h` x `w` tokens (LTX-Video's patch size is 1)."""
    g = torch.Generator().manual_seed(seed)
    kwargs = {
        "hidden_states": torch.randn(batch, frames * h * w, 4, generator=g),
        "encoder_hidden_states": torch.randn(batch, TEXT_LEN, TEXT_DIM, generator=g),
        "timestep": torch.full((batch,), 500),
        "encoder_attention_mask": torch.ones(batch, TEXT_LEN),
        "num_frames": frames,
        "height": h,
        "width": w,
    }
    return kwargs


def run(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample


def test_the_family_reads_the_grid_and_finds_every_block():
    model = tiny_ltx()
    family = family_of(model)
    assert isinstance(family, LTXVideoFamily) and family.video
    assert [site.module for site in family.blocks(model)] == list(model.transformer_blocks)
    assert family.token_grid(model, (), ltx_inputs(frames=3, h=6, w=8)) == (3, 6, 8)
    wrong = dict(ltx_inputs(frames=3, h=6, w=8), num_frames=2)  # 2 x 6 x 8 != the 144 tokens given
    assert family.token_grid(model, (), wrong) is None
    no_grid = {k: v for k, v in ltx_inputs().items() if k not in ("num_frames", "height", "width")}
    assert family.token_grid(model, (), no_grid) is None


@pytest.mark.parametrize("options", [{"ratio": 0.5}, {"preset": "balanced"}, {"preset": "fast"}])
def test_merges_and_removal_restores_the_model_bit_for_bit(options):
    model, inputs = tiny_ltx(), ltx_inputs()
    plain = run(model, inputs)
    tp.apply_tome(model, **options)
    merged = run(model, inputs)
    assert merged.shape == plain.shape and torch.isfinite(merged).all()
    assert not torch.allclose(merged, plain, atol=1e-4)
    assert torch.equal(run(model, inputs), merged)
    tp.remove_tome(model)
    assert torch.equal(run(model, inputs), plain)
    assert hooks_left(model) == 0 and tome_attributes_left(model) == []


def test_ratio_zero_is_the_plain_model():
    model, inputs = tiny_ltx(), ltx_inputs()
    plain = run(model, inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp.apply_tome(model, ratio=0.0)
    assert torch.equal(run(model, inputs), plain)


def test_rotary_tables_follow_each_samples_merged_rows(monkeypatch):
    model, inputs = tiny_ltx(num_layers=1), ltx_inputs(batch=2, seed=3)
    seen = []
    original = LTXVideoAttnProcessor.__call__

    def spying(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        if encoder_hidden_states is None:  # attn1
            seen.append((hidden_states.shape, image_rotary_emb))
        return original(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)

    monkeypatch.setattr(LTXVideoAttnProcessor, "__call__", spying)
    run(model, inputs)
    ((shape, full),) = seen
    tp.apply_tome(model, ratio=0.5)
    merges = []
    original_merge_for = tp.context.BlockState.merge_for

    def recording(self, config, *args, **kwargs):
        merge = original_merge_for(self, config, *args, **kwargs)
        merges.append(merge)
        return merge

    monkeypatch.setattr(tp.context.BlockState, "merge_for", recording)
    seen.clear()
    run(model, inputs)
    ((merged_shape, tables),) = seen
    merge = next(m for m in merges if m is not None)
    assert merged_shape[1] == merge.num_rows < shape[1]
    rows = merge.row_token  # (B, M): each row's kept token, per sample
    for table, original_table in zip(tables, full, strict=True):
        assert table.shape == (2, merge.num_rows, original_table.shape[-1])
        for b in range(2):
            assert torch.equal(table[b], original_table[b, rows[b]])
    assert not torch.equal(rows[0], rows[1])  # each sample has its own merge


def test_temporal_windows_merge_across_frames():
    model, inputs = tiny_ltx(), ltx_inputs(frames=4)
    plain = run(model, inputs)
    tp.apply_tome(model, st=2, sx=1, sy=1, ratio=0.5)
    across = run(model, inputs)
    tp.apply_tome(model, ratio=0.5)
    per_frame = run(model, inputs)
    assert not torch.allclose(across, plain, atol=1e-4) and not torch.allclose(across, per_frame, atol=1e-4)


def test_k_v_pooling_is_refused():
    with pytest.raises(ValueError, match='mode="merge"'):
        tp.apply_tome(tiny_ltx(), mode="downsample_kv")


def tiny_ltx_pipeline(tmp_path) -> LTXPipeline:
    tokenizer = write_t5_tokenizer(tmp_path / "tokenizer-files")
    torch.manual_seed(0)
    text_encoder = T5EncoderModel(
        T5Config(vocab_size=len(tokenizer), d_model=32, d_kv=8, d_ff=37, num_layers=2, num_heads=4)
    ).eval()
    torch.manual_seed(0)
    vae = AutoencoderKLLTXVideo(
        latent_channels=8,
        block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False),  # decodes what it encodes: 4 x 4 x 4
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        patch_size=1,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    ).eval()
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    pipe = LTXPipeline(
        transformer=tiny_ltx(channels=8, text_dim=32),
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(),
        text_encoder=text_encoder,
        tokenizer=tokenizer,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe: LTXPipeline) -> np.ndarray:
    """A whole generation up to the denoised latents (the VAE merges nothing; decoded in test_video_compositions)."""
    with torch.no_grad():
        return pipe(
            prompt="a cat walks",
            negative_prompt="",
            height=32,
            width=32,
            num_frames=9,  # 3 latent frames of 8 x 8 tokens (this VAE compresses 4 x 4 x 4)
            num_inference_steps=2,
            guidance_scale=3.0,
            max_sequence_length=16,
            generator=torch.Generator().manual_seed(0),
            output_type="latent",
        ).frames.numpy()


@pytest.mark.parametrize("how", TOME_USAGES)
def test_ltx_pipeline_generates_the_same_video_twice_with_tome(how, tmp_path):
    check_pipeline_usage(tiny_ltx_pipeline, generate, how, tmp_path)
