"""LTX-2 (`LTX2VideoTransformer3DModel`): packed video and audio tokens; only the video tokens merge, in each block's
video self-attention, with per-sample 3-D rotary tables (interleaved `(B, N, D)` or split `(B, H, N, D)`) that
follow the merged rows. The audio stream, the text and the audio-video cross-attention see every token."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from diffusers import (
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    FlowMatchEulerDiscreteScheduler,
    LTX2Pipeline,
    LTX2VideoTransformer3DModel,
)
from diffusers.models.transformers.transformer_ltx2 import LTX2AudioVideoAttnProcessor, LTX2PerturbedAttnProcessor
from diffusers.pipelines.ltx2 import LTX2TextConnectors
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, GemmaTokenizer

import tome_processors as tp
from tome_processors.apply import inner_processor
from tome_processors.bench.dit import TRANSFORMER_ARCHITECTURES, make_transformer_inputs
from tome_processors.cli.main import main
from tome_processors.config import PRESETS
from tome_processors.context import SLOT_ATTR
from tome_processors.families import LTX2Family, family_of
from tome_processors.hooks import attention_modules

from leftovers import hooks_left, tome_attributes_left
from pipelines import TOME_USAGES, check_pipeline_usage

TEXT_DIM, TEXT_LEN, AUDIO_LEN = 16, 7, 5

#: The attention modules of a block whose tokens are never merged (the video self-attention `attn1` is).
UNMERGED = ("attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")


#: What LTX-2.3 changes in the transformer's config (diffusers' `scripts/convert_ltx2_to_diffusers.py`): gated
#: attention, the text modulating the cross-attention, no caption projection (the connectors project per modality)
#: and every block attention built with `LTX2PerturbedAttnProcessor`, through which STG skips attention.
LTX_2_3 = dict(
    gated_attn=True,
    cross_attn_mod=True,
    audio_gated_attn=True,
    audio_cross_attn_mod=True,
    use_prompt_embeddings=False,
    perturbed_attn=True,
)


def tiny_ltx2(
    num_layers: int = 2, rope_type: str = "split", patch_size: int = 1, channels: int = 4, **config
) -> LTX2VideoTransformer3DModel:
    """diffusers' test size of LTX-2, with the released model's split rotary tables unless told; `config` on top
    (`LTX_2_3`)."""
    torch.manual_seed(0)
    return LTX2VideoTransformer3DModel(
        in_channels=channels * patch_size * patch_size,
        out_channels=channels * patch_size * patch_size,
        patch_size=patch_size,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        audio_in_channels=4,
        audio_out_channels=4,
        audio_num_attention_heads=2,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=8,
        num_layers=num_layers,
        caption_channels=TEXT_DIM,
        rope_double_precision=False,
        rope_type=rope_type,
        **config,
    ).eval()


def ltx2_inputs(
    batch: int = 2, frames: int = 3, h: int = 6, w: int = 8, seed: int = 0, channels: int = 4, patch: int = 1
) -> dict:
    """A packed latent clip of `frames` x `h` x `w` latent pixels (`patch` x `patch` per token), its audio and texts."""
    g = torch.Generator().manual_seed(seed)
    tokens = frames * (h // patch) * (w // patch)
    return {
        "hidden_states": torch.randn(batch, tokens, channels * patch * patch, generator=g),
        "audio_hidden_states": torch.randn(batch, AUDIO_LEN, 4, generator=g),
        "encoder_hidden_states": torch.randn(batch, TEXT_LEN, TEXT_DIM, generator=g),
        "audio_encoder_hidden_states": torch.randn(batch, TEXT_LEN, TEXT_DIM, generator=g),
        "timestep": torch.full((batch,), 500.0),
        "encoder_attention_mask": torch.ones(batch, TEXT_LEN),
        "audio_encoder_attention_mask": torch.ones(batch, TEXT_LEN),
        "num_frames": frames,
        "height": h,
        "width": w,
        "audio_num_frames": AUDIO_LEN,
    }


def run(model: torch.nn.Module, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The video and the audio output."""
    with torch.no_grad():
        out = model(**inputs)
    return out.sample, out.audio_sample


@pytest.fixture
def seen(monkeypatch) -> dict:
    """Each attention call of the model, by module: `(query tokens, key tokens, query rotary table shape)`, under
    either of LTX-2's processors (LTX-2.3's perturbed one too)."""
    calls: dict[torch.nn.Module, list] = {}

    def record(attn, hidden_states, encoder_hidden_states, query_rotary_emb) -> None:
        keys = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        table = None if query_rotary_emb is None else tuple(query_rotary_emb[0].shape)
        calls.setdefault(attn, []).append((hidden_states.shape[1], keys.shape[1], table, query_rotary_emb))

    original = LTX2AudioVideoAttnProcessor.__call__
    perturbed = LTX2PerturbedAttnProcessor.__call__

    def recording(
        self,
        attn,
        hidden_states,
        encoder_hidden_states=None,
        attention_mask=None,
        query_rotary_emb=None,
        key_rotary_emb=None,
    ):
        record(attn, hidden_states, encoder_hidden_states, query_rotary_emb)
        return original(
            self, attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb, key_rotary_emb
        )

    def recording_perturbed(
        self,
        attn,
        hidden_states,
        encoder_hidden_states=None,
        attention_mask=None,
        query_rotary_emb=None,
        key_rotary_emb=None,
        perturbation_mask=None,
        all_perturbed=None,
    ):
        record(attn, hidden_states, encoder_hidden_states, query_rotary_emb)
        return perturbed(
            self,
            attn,
            hidden_states,
            encoder_hidden_states,
            attention_mask,
            query_rotary_emb,
            key_rotary_emb,
            perturbation_mask,
            all_perturbed,
        )

    monkeypatch.setattr(LTX2AudioVideoAttnProcessor, "__call__", recording)
    monkeypatch.setattr(LTX2PerturbedAttnProcessor, "__call__", recording_perturbed)
    return calls


def shapes(calls: dict, module: torch.nn.Module) -> list:
    return [call[:3] for call in calls.get(module, [])]


def test_the_family_reads_the_grid_and_finds_every_block():
    model = tiny_ltx2()
    family = family_of(model)
    assert isinstance(family, LTX2Family) and family.video and family.name == "ltx2"
    sites = family.blocks(model)
    assert [site.module for site in sites] == list(model.transformer_blocks)
    for site, block in zip(sites, model.transformer_blocks, strict=True):
        assert [a.module for a in site.attentions] == [block.attn1, block.attn2]
        assert [a.is_cross for a in site.attentions] == [False, True]
        assert site.feed_forward is block.ff
    assert family.token_grid(model, (), ltx2_inputs(frames=3, h=6, w=8)) == (3, 6, 8)
    wrong = dict(ltx2_inputs(frames=3, h=6, w=8), num_frames=2)  # 2 x 6 x 8 != the 144 tokens given
    assert family.token_grid(model, (), wrong) is None
    no_grid = {k: v for k, v in ltx2_inputs().items() if k not in ("num_frames", "height", "width")}
    assert family.token_grid(model, (), no_grid) is None
    assert family.timestep((), ltx2_inputs()).tolist() == [500.0, 500.0]
    patched = tiny_ltx2(patch_size=2)  # the latent's 12 x 16 in 2 x 2 patches: 6 x 8 tokens a frame
    assert family.token_grid(patched, (), ltx2_inputs(h=12, w=16, patch=2)) == (3, 6, 8)


@pytest.mark.parametrize("rope_type", ["split", "interleaved"])
def test_only_the_video_self_attention_merges(rope_type, seen):
    model, inputs = tiny_ltx2(rope_type=rope_type), ltx2_inputs()
    plain_video, plain_audio = run(model, inputs)
    plain = {m: shapes(seen, m) for m in seen}
    seen.clear()
    tp.apply_tome(model, ratio=0.5)
    video, audio = run(model, inputs)
    assert video.shape == plain_video.shape and torch.isfinite(video).all() and torch.isfinite(audio).all()
    assert not torch.allclose(video, plain_video, atol=1e-4)
    for block in model.transformer_blocks:
        ((queries, keys, table),) = shapes(seen, block.attn1)
        assert queries == keys < 3 * 6 * 8  # the video tokens, merged
        assert table[-2 if rope_type == "split" else 1] == queries  # each row's rotation
        for name in UNMERGED:  # the text, the audio and both audio-video cross-attentions: every token
            assert shapes(seen, getattr(block, name)) == plain[getattr(block, name)], name
    # Only attn1 and attn2 (cross-attention, merged with merge_crossattn alone) hold a ToMe slot.
    slotted = {name for name, m in model.named_modules() if SLOT_ATTR in vars(m)}
    assert slotted == {f"transformer_blocks.{i}.{a}" for i in range(2) for a in ("attn1", "attn2")}
    # The audio output changes only through the audio-video cross-attention (video keys), which sees the
    # unmerged video; with it off (isolate_modalities) the audio output is the plain model's.
    tp.remove_tome(model)
    alone = run(model, {**inputs, "isolate_modalities": True})[1]
    tp.apply_tome(model, ratio=0.5)
    assert torch.equal(run(model, {**inputs, "isolate_modalities": True})[1], alone)


@pytest.mark.parametrize("options", [{"ratio": 0.5}, {"ratio": 0.5, "merge_mlp": True, "merge_crossattn": True}])
def test_removal_and_ratio_zero_give_the_plain_outputs_bit_for_bit(options):
    model, inputs = tiny_ltx2(), ltx2_inputs()
    plain_video, plain_audio = run(model, inputs)
    tp.apply_tome(model, **options)
    video, audio = run(model, inputs)
    assert not torch.allclose(video, plain_video, atol=1e-4)
    assert torch.equal(run(model, inputs)[0], video)
    tp.remove_tome(model)
    assert all(torch.equal(a, b) for a, b in zip(run(model, inputs), (plain_video, plain_audio), strict=True))
    assert hooks_left(model) == 0 and tome_attributes_left(model) == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp.apply_tome(model, ratio=0.0)
    assert all(torch.equal(a, b) for a, b in zip(run(model, inputs), (plain_video, plain_audio), strict=True))


def test_merge_mlp_and_merge_crossattn_merge_the_video_feed_forward_and_text_queries(seen):
    model, inputs = tiny_ltx2(), ltx2_inputs()
    default = run(model, {**inputs})
    tp.apply_tome(model, ratio=0.5)
    merged = run(model, inputs)
    tp.apply_tome(model, ratio=0.5, merge_mlp=True, merge_crossattn=True)
    seen.clear()
    both = run(model, inputs)
    assert not torch.allclose(both[0], merged[0], atol=1e-5) and not torch.allclose(both[0], default[0], atol=1e-4)
    for block in model.transformer_blocks:
        ((queries, keys, _),) = shapes(seen, block.attn2)
        assert queries < 3 * 6 * 8 and keys == TEXT_LEN  # merged video queries, every text token
        ((queries, keys, _),) = shapes(seen, block.audio_to_video_attn)
        assert (queries, keys) == (3 * 6 * 8, AUDIO_LEN)  # never merged
        ((queries, keys, _),) = shapes(seen, block.video_to_audio_attn)
        assert (queries, keys) == (AUDIO_LEN, 3 * 6 * 8)  # the video as keys and values: whole


@pytest.mark.parametrize("rope_type", ["split", "interleaved"])
def test_rotary_tables_follow_each_samples_merged_rows(rope_type, seen, monkeypatch):
    model, inputs = tiny_ltx2(num_layers=1, rope_type=rope_type), ltx2_inputs(batch=2, seed=3)
    run(model, inputs)
    full = seen[model.transformer_blocks[0].attn1][0][3]
    seen.clear()
    tp.apply_tome(model, ratio=0.5)
    merges = []
    original_merge_for = tp.context.BlockState.merge_for

    def recording(self, config, *args, **kwargs):
        merge = original_merge_for(self, config, *args, **kwargs)
        merges.append(merge)
        return merge

    monkeypatch.setattr(tp.context.BlockState, "merge_for", recording)
    run(model, inputs)
    tables = seen[model.transformer_blocks[0].attn1][0][3]
    merge = next(m for m in merges if m is not None)
    rows = merge.row_token  # (B, M): each row's kept token, per sample
    for table, original in zip(tables, full, strict=True):
        for b in range(2):
            if rope_type == "split":  # (B, H, N, D)
                assert torch.equal(table[b], original[b][:, rows[b]])
            else:  # (B, N, D)
                assert torch.equal(table[b], original[b, rows[b]])
    assert not torch.equal(rows[0], rows[1])  # each sample has its own merge


def test_a_batch_of_two_equals_two_batches_of_one():
    model = tiny_ltx2()
    tp.apply_tome(model, ratio=0.5, use_rand=False)
    inputs = ltx2_inputs(batch=2)
    both = run(model, inputs)
    for b in range(2):
        one = {k: v[b : b + 1] if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        for single, batched in zip(run(model, one), both, strict=True):
            torch.testing.assert_close(single[0], batched[b], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_applies_and_merges(preset, seen):
    model, inputs = tiny_ltx2(), ltx2_inputs(frames=4)
    plain = run(model, inputs)
    tp.apply_tome(model, preset=preset)
    seen.clear()
    merged = run(model, inputs)
    assert not torch.allclose(merged[0], plain[0], atol=1e-4) and torch.isfinite(merged[0]).all()
    assert all(shapes(seen, block.attn1)[0][0] < 4 * 6 * 8 for block in model.transformer_blocks)
    tp.remove_tome(model)
    assert torch.equal(run(model, inputs)[0], plain[0])


def test_temporal_windows_merge_across_frames():
    model, inputs = tiny_ltx2(), ltx2_inputs(frames=4)
    plain = run(model, inputs)[0]
    tp.apply_tome(model, st=2, sx=1, sy=1, ratio=0.5)
    across = run(model, inputs)[0]
    tp.apply_tome(model, st=2, ratio=0.5)
    windows = run(model, inputs)[0]
    tp.apply_tome(model, ratio=0.5)
    per_frame = run(model, inputs)[0]
    assert torch.isfinite(across).all() and torch.isfinite(windows).all()
    assert not torch.allclose(across, plain, atol=1e-4) and not torch.allclose(across, per_frame, atol=1e-4)
    assert not torch.allclose(windows, per_frame, atol=1e-4)


def test_patches_of_two_merge_on_the_token_grid(seen):
    model, inputs = tiny_ltx2(patch_size=2), ltx2_inputs(h=12, w=16, patch=2)
    plain = run(model, inputs)[0]
    tp.apply_tome(model, ratio=0.5)
    seen.clear()
    merged = run(model, inputs)[0]
    assert not torch.allclose(merged, plain, atol=1e-4)
    assert shapes(seen, model.transformer_blocks[0].attn1)[0][0] < 3 * 6 * 8


def test_a_video_self_attention_mask_leaves_attention_unmerged(seen):
    # IC-LoRA's `video_self_attention_mask` is over every pair of video tokens: merged tokens would not fit it.
    model, inputs = tiny_ltx2(), ltx2_inputs()
    masked = {**inputs, "video_self_attention_mask": torch.ones(2, 3 * 6 * 8, 3 * 6 * 8).tril()}
    plain = run(model, masked)
    tp.apply_tome(model, ratio=0.5)
    seen.clear()
    assert all(torch.equal(a, b) for a, b in zip(run(model, masked), plain, strict=True))
    assert shapes(seen, model.transformer_blocks[0].attn1)[0][0] == 3 * 6 * 8


def test_k_v_pooling_is_refused_before_anything_changes():
    model = tiny_ltx2()
    with pytest.raises(ValueError, match='mode="merge"'):
        tp.apply_tome(model, mode="downsample_kv")
    assert hooks_left(model) == 0 and tome_attributes_left(model) == []


def test_set_attn_processor_merges_as_apply_tome():
    model, inputs = tiny_ltx2(), ltx2_inputs()
    plain = run(model, inputs)
    tp.apply_tome(model, ratio=0.5)
    expected = run(model, inputs)
    tp.remove_tome(model)
    model.set_attn_processor(tp.ToMeProcessor(ratio=0.5))  # the README's first usage
    assert all(torch.equal(a, b) for a, b in zip(run(model, inputs), expected, strict=True))
    assert not torch.allclose(expected[0], plain[0], atol=1e-4)


def ltx2_3_inputs() -> dict:
    """`ltx2_inputs` as an LTX-2.3 pipeline passes them: the audio text at the audio width (its connector projects
    it), `sigma`, and STG at block 1 for the first sample (the second unperturbed)."""
    inputs = ltx2_inputs()
    audio_text = torch.randn(2, TEXT_LEN, 8, generator=torch.Generator().manual_seed(1))
    stg = {"spatio_temporal_guidance_blocks": [1], "perturbation_mask": torch.tensor([0.0, 1.0])}
    return {**inputs, "audio_encoder_hidden_states": audio_text, "sigma": inputs["timestep"], **stg}


def test_ltx2_3_attention_runs_its_perturbed_processor_under_set_attn_processor():
    # LTX-2.3 builds every block attention with LTX2PerturbedAttnProcessor (not LTX2Attention's default): a
    # `ToMeProcessor()` must run that one, with STG's keywords, in the modules it merges in and in the others.
    model, inputs = tiny_ltx2(**LTX_2_3), ltx2_3_inputs()
    modules = attention_modules(model)
    assert {type(attn.processor) for attn in modules} == {LTX2PerturbedAttnProcessor}
    assert all(family_of(model).built_processor(model, attn) is LTX2PerturbedAttnProcessor for attn in modules)
    plain = run(model, inputs)
    assert not torch.allclose(run(model, {**inputs, "spatio_temporal_guidance_blocks": None})[0], plain[0])
    tp.apply_tome(model, ratio=0.5)
    expected = run(model, inputs)
    tp.remove_tome(model)
    model.set_attn_processor(tp.ToMeProcessor(ratio=0.5))
    assert all(torch.equal(a, b) for a, b in zip(run(model, inputs), expected, strict=True))
    assert {type(inner_processor(model, attn)) for attn in modules} == {LTX2PerturbedAttnProcessor}
    tp.remove_tome(model)
    assert {type(attn.processor) for attn in modules} == {LTX2PerturbedAttnProcessor}
    assert all(torch.equal(a, b) for a, b in zip(run(model, inputs), plain, strict=True))


# ---------------------------------------------------------------- the pipeline (tiny, offline)

#: The tiny pipeline's versions: LTX-2.0 (diffusers' test config) and LTX-2.3 (`LTX_2_3`, per-modality text
#: connectors with gated attention).
VERSIONS = ("2.0", "2.3")
#: 5 frames at 32 x 32 px through the tiny VAE (2 x 2 x 2 compression): 3 latent frames of 16 x 16 tokens.
PIPELINE_TOKENS = 3 * 16 * 16


def write_gemma_tokenizer(folder: Path) -> GemmaTokenizer:
    """A Gemma BPE tokenizer over single letters and the word boundary (no merges), saved to `folder` and loaded."""
    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4, "\u2581": 5}
    vocab |= {letter: len(vocab) + i for i, letter in enumerate("abcdefghijklmnopqrstuvwxyz")}
    GemmaTokenizer(vocab=vocab, merges=[]).save_pretrained(folder)
    return GemmaTokenizer.from_pretrained(folder)


def tiny_gemma3(vocab_size: int) -> Gemma3ForConditionalGeneration:
    """Gemma 3 with a vision tower, as LTX-2's pipelines take it: 16 wide, 2 layers (3 hidden states a token)."""
    torch.manual_seed(0)
    text = dict(vocab_size=vocab_size, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
                sliding_window=16)  # fmt: skip
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=16,
                  patch_size=8)  # fmt: skip
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=vocab_size)
    return Gemma3ForConditionalGeneration(config).eval()


def tiny_ltx2_pipeline(folder: Path, version: str = "2.0") -> LTX2Pipeline:
    """Text to video with audio, random weights: Gemma 3, the text connectors, diffusers' test-size video and
    audio VAEs and vocoder, and `tiny_ltx2` (with `LTX_2_3` for version "2.3")."""
    tokenizer = write_gemma_tokenizer(folder / "gemma")
    text_encoder = tiny_gemma3(len(tokenizer))
    latest = version == "2.3"
    torch.manual_seed(0)
    connectors = LTX2TextConnectors(
        caption_channels=16, text_proj_in_factor=3, video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, video_gated_attn=latest, audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=4 if latest else 8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, audio_gated_attn=latest, connector_rope_base_seq_len=32,
        rope_double_precision=False, rope_type="split", per_modality_projections=latest, video_hidden_dim=16,
        audio_hidden_dim=8, proj_bias=latest,
    ).eval()  # fmt: skip
    torch.manual_seed(0)
    vae = AutoencoderKLLTX2Video(
        latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,), layers_per_block=(1,),
        decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,), decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False), downsample_type=("spatial",), upsample_residual=(False,),
        upsample_factor=(1,), patch_size=1, patch_size_t=1, encoder_causal=True, decoder_causal=False,
    ).eval()  # fmt: skip
    vae.use_framewise_encoding = vae.use_framewise_decoding = False
    torch.manual_seed(0)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, resolution=32, latent_channels=2,
        mel_bins=8,
    ).eval()  # fmt: skip
    torch.manual_seed(0)
    vocoder = LTX2Vocoder(
        in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2],
        resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]], output_sampling_rate=16000,
    ).eval()  # fmt: skip
    pipe = LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        audio_vae=audio_vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        connectors=connectors,
        transformer=tiny_ltx2(**(LTX_2_3 if latest else {})),
        vocoder=vocoder,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate_ltx2(pipe: LTX2Pipeline) -> np.ndarray:
    """A whole generation under the pipeline's default guidance, decoded: the video's frames, then the audio's
    waveform. Three transformer calls a step: text guidance (batch 2), STG at block 1 (the default block 28 is
    past the tiny model) and the modalities isolated (batch 1 each)."""
    with torch.no_grad():
        out = pipe(
            prompt="a cat walks",
            negative_prompt="",
            height=32,
            width=32,
            num_frames=5,
            frame_rate=25.0,
            num_inference_steps=2,
            max_sequence_length=16,
            spatio_temporal_guidance_blocks=[1],
            generator=torch.Generator().manual_seed(0),
            output_type="pt",
        )
    return np.concatenate([out.frames.numpy().ravel(), out.audio.numpy().ravel()])


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("how", TOME_USAGES)
def test_ltx2_pipeline_generates_the_same_video_and_audio_twice_with_tome(how, version, tmp_path):
    check_pipeline_usage(lambda folder: tiny_ltx2_pipeline(folder, version), generate_ltx2, how, tmp_path)


@pytest.mark.parametrize("version", VERSIONS)
def test_ltx2_pipeline_merges_only_the_transformers_video_self_attention(version, seen, tmp_path):
    pipe = tiny_ltx2_pipeline(tmp_path, version)
    generate_ltx2(pipe)
    plain = {module: shapes(seen, module) for module in seen}
    seen.clear()
    tp.apply_tome(pipe, ratio=0.5)
    generate_ltx2(pipe)
    for block in pipe.transformer.transformer_blocks:
        calls = shapes(seen, block.attn1)
        assert len(calls) == 2 * 3  # two steps of three calls (guidance, STG, isolated modalities)
        assert all(queries == keys < PIPELINE_TOKENS for queries, keys, _ in calls)
        for name in UNMERGED:  # the text, the audio and both audio-video cross-attentions: every token
            assert shapes(seen, getattr(block, name)) == plain[getattr(block, name)], name
    connectors = [m for m in pipe.connectors.modules() if m in plain]
    assert connectors and all(shapes(seen, m) == plain[m] for m in connectors)  # the text connectors: whole
    slotted = {
        f"{name}.{path}"
        for name, component in pipe.components.items()
        if isinstance(component, torch.nn.Module)
        for path, m in component.named_modules()
        if SLOT_ATTR in vars(m)
    }
    assert slotted == {f"transformer.transformer_blocks.{i}.{a}" for i in range(2) for a in ("attn1", "attn2")}


# ---------------------------------------------------------------- the bench


def test_bench_builds_ltx2s_published_config_and_its_clip_with_audio():
    with torch.device("meta"):  # 19 B parameters: the config and the inputs' shapes, nothing run
        model = LTX2VideoTransformer3DModel(**TRANSFORMER_ARCHITECTURES["ltx2"])
    config = model.config
    assert (config.num_layers, config.num_attention_heads, config.attention_head_dim) == (48, 32, 128)
    assert (config.audio_num_attention_heads, config.audio_attention_head_dim, config.rope_type) == (32, 64, "split")
    inputs = make_transformer_inputs(model, "ltx2", 2, 512, frames=121, width=768).kwargs
    assert inputs["hidden_states"].shape == (2, 16 * 16 * 24, 128)  # 121 frames: 16 latent frames of 16 x 24
    assert inputs["audio_hidden_states"].shape == (2, 126, 128)  # 121 / 24 s of 25 audio latents a second
    assert inputs["encoder_hidden_states"].shape == inputs["audio_encoder_hidden_states"].shape == (2, 1024, 3840)
    assert family_of(model).token_grid(model, (), inputs) == (16, 16, 24)


def test_bench_runs_the_quick_ltx2_with_its_presets(tmp_path):
    path = tmp_path / "ltx2.json"
    argv = [
        "bench",
        "--quick",
        "--arch",
        "ltx2",
        "--rounds",
        "1",
        "--no-progress",
        "--no-memory",
        "--no-trained-quality",
    ]
    assert main([*argv, "--ratios", "0.5", "--presets", "balanced", "--json", str(path)]) == 0
    rows = {row["name"]: row for row in json.loads(path.read_text())["rows"]}
    assert sorted(rows) == ["baseline", "ours balanced r=0.75", "ours r=0.5"]
    for name, row in rows.items():
        if name != "baseline":
            assert 0 < row["rel_error"] < 1
