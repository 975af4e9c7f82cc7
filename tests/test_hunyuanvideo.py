"""HunyuanVideo (`HunyuanVideoTransformer3DModel`): double- and single-stream blocks over a `(frames, h, w)` grid of
video tokens and the text, rotary tables over the video alone, the model's mask over the text's padding, and whole
`HunyuanVideoPipeline` calls; HunyuanVideo 1.5 (`HunyuanVideo15Transformer3DModel`) and whole
`HunyuanVideo15Pipeline` calls."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from diffusers import (
    AutoencoderKLHunyuanVideo,
    AutoencoderKLHunyuanVideo15,
    FlowMatchEulerDiscreteScheduler,
    HunyuanVideo15Pipeline,
    HunyuanVideo15Transformer3DModel,
    HunyuanVideoPipeline,
    HunyuanVideoTransformer3DModel,
)
from diffusers.guiders import ClassifierFreeGuidance
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0
from transformers import (
    ByT5Tokenizer,
    CLIPTextConfig,
    CLIPTextModel,
    LlamaConfig,
    LlamaModel,
    Qwen2_5_VLTextConfig,
    Qwen2_5_VLTextModel,
    T5Config,
    T5EncoderModel,
)

import tome_processors as tp
from tome_processors import joint_attention
from tome_processors.bench.dit import build_transformer, make_transformer_inputs
from tome_processors.bench.pipelines import write_clip_tokenizer
from tome_processors.cli.main import main
from tome_processors.context import SLOT_ATTR
from tome_processors.families import HunyuanVideo15Family, HunyuanVideoFamily, Layout, family_of

from leftovers import hooks_left, tome_attributes_left
from pipelines import TOME_USAGES, check_pipeline_usage
from test_new_families import write_qwen_tokenizer

TEXT_DIM, POOLED_DIM, TEXT = 16, 8, 7  # text tokens: not a multiple of anything, so an off-by-text error shows


def tiny_hunyuanvideo(
    num_layers: int = 1,
    num_single_layers: int = 2,
    channels: int = 4,
    text_dim: int = TEXT_DIM,
    image_condition_type: str | None = None,
) -> HunyuanVideoTransformer3DModel:
    torch.manual_seed(0)
    return HunyuanVideoTransformer3DModel(
        in_channels=channels,
        out_channels=channels,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=num_layers,
        num_single_layers=num_single_layers,
        num_refiner_layers=1,
        patch_size=2,
        patch_size_t=1,
        text_embed_dim=text_dim,
        pooled_projection_dim=POOLED_DIM,
        rope_axes_dim=(4, 6, 6),
        image_condition_type=image_condition_type,
    ).eval()


def hunyuanvideo_inputs(
    batch: int = 2, frames: int = 3, h: int = 6, w: int = 8, padded: int = 2, seed: int = 0
) -> dict:
    """As HunyuanVideoPipeline calls the model: a latent `(B, C, F, 2h, 2w)` (patch 2), the prompt's last `padded`
    tokens masked, the timestep on 0..1000 and the distilled guidance."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, TEXT, dtype=torch.long)
    mask[:, TEXT - padded :] = 0
    return {
        "hidden_states": torch.randn(batch, 4, frames, 2 * h, 2 * w, generator=g),
        "timestep": torch.full((batch,), 500.0),
        "encoder_hidden_states": torch.randn(batch, TEXT, TEXT_DIM, generator=g),
        "encoder_attention_mask": mask,
        "pooled_projections": torch.randn(batch, POOLED_DIM, generator=g),
        "guidance": torch.full((batch,), 6000.0),
    }


def run(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample


def count_merges(model: torch.nn.Module, inputs: dict) -> int:
    """Attention calls that ran on merged tokens in one forward."""
    calls = []
    original = joint_attention._call

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(joint_attention, "_call", counting)
        run(model, inputs)
    return len(calls)


def test_the_family_reads_the_grid_and_finds_every_block_but_the_token_refiners():
    model = tiny_hunyuanvideo()
    family = family_of(model)
    assert isinstance(family, HunyuanVideoFamily) and family.video
    sites = family.blocks(model)
    assert [site.module for site in sites] == [*model.transformer_blocks, *model.single_transformer_blocks]
    assert all(a.layout is Layout.JOINT_IMAGE_FIRST and a.built_with is HunyuanVideoAttnProcessor2_0 for s in sites
               for a in s.attentions)  # fmt: skip
    refiners = set(model.context_embedder.modules())
    assert not any(a.module in refiners for s in sites for a in s.attentions)
    assert [s.feed_forward for s in sites] == [model.transformer_blocks[0].ff, None, None]
    assert family.token_grid(model, (), hunyuanvideo_inputs(frames=3, h=6, w=8)) == (3, 6, 8)
    assert family.token_grid(model, (torch.zeros(1, 4, 12, 16),), {}) is None  # not a 5-D latent
    assert float(family.timestep((), hunyuanvideo_inputs(batch=1))[0]) == pytest.approx(500.0)


@pytest.mark.parametrize("options", [{"ratio": 0.5}, {"ratio": 0.5, "merge_mlp": True}])
def test_merges_in_every_block_and_removal_restores_the_model_bit_for_bit(options):
    model, inputs = tiny_hunyuanvideo(), hunyuanvideo_inputs()
    plain = run(model, inputs)
    tp.apply_tome(model, **options)
    assert count_merges(model, inputs) == 3  # the double-stream block and both single-stream blocks
    merged = run(model, inputs)
    assert merged.shape == plain.shape and torch.isfinite(merged).all()
    assert not torch.allclose(merged, plain, atol=1e-4), "ToMe at 0.5 changed nothing"
    assert torch.equal(run(model, inputs), merged)
    tp.remove_tome(model)
    assert torch.equal(run(model, inputs), plain)
    assert hooks_left(model) == 0 and tome_attributes_left(model) == []


def test_ratio_zero_is_the_plain_model():
    model, inputs = tiny_hunyuanvideo(), hunyuanvideo_inputs()
    plain = run(model, inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp.apply_tome(model, ratio=0.0)
    assert torch.equal(run(model, inputs), plain)


def test_each_sample_keeps_its_own_merge_and_rotary_positions():
    # A batch of two (each sample merged on its own, its rows rotated at their own positions) equals two batches
    # of one; `use_rand=False` so both calls draw the same partition.
    model = tiny_hunyuanvideo()
    tp.apply_tome(model, ratio=0.5, use_rand=False)
    inputs = hunyuanvideo_inputs(batch=2, seed=3)
    both = run(model, inputs)
    for b in range(2):
        one = {k: v[b : b + 1] for k, v in inputs.items()}
        torch.testing.assert_close(run(model, one)[0], both[b], rtol=1e-4, atol=1e-5)


def test_rotary_tables_follow_each_samples_merged_rows(monkeypatch):
    model, inputs = tiny_hunyuanvideo(num_layers=1, num_single_layers=0), hunyuanvideo_inputs(batch=2, seed=3)
    seen = []
    original = HunyuanVideoAttnProcessor2_0.__call__

    def spying(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        seen.append((hidden_states.shape, image_rotary_emb, attention_mask))
        return original(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)

    monkeypatch.setattr(HunyuanVideoAttnProcessor2_0, "__call__", spying)
    run(model, inputs)
    ((shape, full, full_mask),) = seen
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
    ((merged_shape, tables, mask),) = seen  # the whole batch in one call
    merge = next(m for m in merges if m is not None)
    assert merged_shape[1] == merge.num_rows < shape[1]
    rows = merge.row_token  # (B, M): each row's kept token, per sample
    for table, original_table in zip(tables, full, strict=True):  # cos and sin, each over the video alone
        per_sample = table[None, :, None, :]  # the view diffusers' apply_rotary_emb takes
        assert per_sample.shape == (2, merge.num_rows, 1, original_table.shape[-1])
        for b in range(2):
            assert torch.equal(per_sample[b, :, 0], original_table[rows[b]])
    assert not torch.equal(rows[0], rows[1])  # each sample has its own merge
    # The mask (video, then text) loses as many video positions as were merged; the text's padding stays masked.
    assert mask.shape[-1] == full_mask.shape[-1] - (shape[1] - merged_shape[1])
    assert torch.equal(mask[..., -TEXT:], full_mask[..., -TEXT:]) and mask[..., :-TEXT].all()


def test_the_masked_text_padding_stays_masked():
    # Changing what sits in the masked text tokens must not change the output, with ToMe as without.
    model = tiny_hunyuanvideo()
    tp.apply_tome(model, ratio=0.5)
    inputs = hunyuanvideo_inputs(padded=3)
    out = run(model, inputs)
    changed = dict(inputs, encoder_hidden_states=inputs["encoder_hidden_states"].clone())
    changed["encoder_hidden_states"][:, TEXT - 3 :] += 5.0
    torch.testing.assert_close(run(model, changed), out, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("preset", ["exact", "balanced", "fast"])
def test_presets_apply_and_merge(preset):
    model, inputs = tiny_hunyuanvideo(), hunyuanvideo_inputs(frames=4)
    plain = run(model, inputs)
    tp.apply_tome(model, preset=preset)
    assert count_merges(model, inputs) == 3
    out = run(model, inputs)
    assert torch.isfinite(out).all() and not torch.equal(out, plain)


def test_temporal_windows_merge_across_frames():
    model, inputs = tiny_hunyuanvideo(), hunyuanvideo_inputs(frames=4)
    plain = run(model, inputs)
    tp.apply_tome(model, st=2, sx=1, sy=1, ratio=0.5)
    across = run(model, inputs)
    assert count_merges(model, inputs) == 3
    tp.apply_tome(model, ratio=0.5)
    per_frame = run(model, inputs)
    assert not torch.allclose(across, plain, atol=1e-4) and not torch.allclose(across, per_frame, atol=1e-4)


def test_image_to_video_token_replace_blocks_merge_per_sample_and_are_removed_exactly():
    # HunyuanVideo-I2V's `token_replace` blocks (other classes, the same attention call) merge as the others.
    model, inputs = tiny_hunyuanvideo(image_condition_type="token_replace"), hunyuanvideo_inputs()
    plain = run(model, inputs)
    tp.apply_tome(model, ratio=0.5, use_rand=False)
    assert count_merges(model, inputs) == 3
    both = run(model, inputs)
    assert torch.isfinite(both).all() and not torch.allclose(both, plain, atol=1e-4)
    for b in range(2):
        one = {k: v[b : b + 1] for k, v in inputs.items()}
        torch.testing.assert_close(run(model, one)[0], both[b], rtol=1e-4, atol=1e-5)
    tp.remove_tome(model)
    assert torch.equal(run(model, inputs), plain)


def test_k_v_pooling_is_refused():
    with pytest.raises(ValueError, match='mode="merge"'):
        tp.apply_tome(tiny_hunyuanvideo(), mode="downsample_kv")


# ---------------------------------------------------------------- the pipeline (tiny, offline)


def tiny_hunyuanvideo_pipeline(tmp_path: Path) -> HunyuanVideoPipeline:
    """Random weights: a Llama text encoder over a byte-level tokenizer, a CLIP text encoder for the pooled
    projection, a tiny VAE (only its compression ratios are read: the generations stop at the latents)."""
    tokenizer = write_qwen_tokenizer(tmp_path / "llama")
    torch.manual_seed(0)
    text_encoder = LlamaModel(
        LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=37, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    ).eval()  # fmt: skip
    tokenizer_2 = write_clip_tokenizer(tmp_path / "clip", max_length=77)  # the pipeline pads to 77
    torch.manual_seed(0)
    text_encoder_2 = CLIPTextModel(
        CLIPTextConfig(vocab_size=len(tokenizer_2), hidden_size=POOLED_DIM, intermediate_size=16, num_hidden_layers=1,
                       num_attention_heads=2, max_position_embeddings=77, bos_token_id=0, eos_token_id=1,
                       pad_token_id=1)
    ).eval()  # fmt: skip
    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo(
        latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=4,
        spatial_compression_ratio=8, temporal_compression_ratio=4,
    ).eval()  # fmt: skip
    pipe = HunyuanVideoPipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=tiny_hunyuanvideo(text_dim=16),
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe: HunyuanVideoPipeline) -> torch.Tensor:
    """A whole generation up to the denoised latents (3 latent frames of 6 x 8 tokens)."""
    with torch.no_grad():
        return pipe(
            prompt="a cat walks",
            prompt_template={"template": "{}", "crop_start": 0},
            height=96,
            width=128,
            num_frames=9,
            num_inference_steps=2,
            max_sequence_length=16,  # the short prompt padded: the model masks the padding
            generator=torch.Generator().manual_seed(0),
            output_type="latent",
        ).frames


@pytest.mark.parametrize("how", TOME_USAGES)
def test_pipeline_generates_the_same_video_twice_with_tome(how, tmp_path):
    check_pipeline_usage(tiny_hunyuanvideo_pipeline, generate, how, tmp_path)


# ---------------------------------------------------------------- the bench


def test_bench_builds_hunyuanvideo_at_the_real_width_and_clip():
    model = build_transformer("hunyuanvideo", layers=1)
    assert (model.config.num_layers, model.config.num_single_layers) == (1, 1)
    assert model.transformer_blocks[0].attn.heads == 24 and model.config.attention_head_dim == 128
    inputs = make_transformer_inputs(model, "hunyuanvideo", 1, 544, frames=33, width=960)
    assert inputs.kwargs["hidden_states"].shape == (1, 16, 9, 68, 120)  # 9 x 34 x 60 = 18,360 tokens
    assert inputs.kwargs["encoder_hidden_states"].shape == (1, 256, 4096)
    assert family_of(model).token_grid(model, (), inputs.kwargs) == (9, 34, 60)


def test_bench_runs_the_quick_hunyuanvideo_with_its_presets(tmp_path):
    path = tmp_path / "hunyuanvideo.json"
    argv = ["bench", "--quick", "--arch", "hunyuanvideo", "--rounds", "1", "--no-progress", "--no-memory"]
    argv += ["--no-trained-quality"]  # the trained video model's columns: tests/test_video.py
    assert main([*argv, "--ratios", "0.5", "--presets", "balanced", "--json", str(path)]) == 0
    rows = {row["name"]: row for row in json.loads(path.read_text())["rows"]}
    assert sorted(rows) == ["baseline", "ours balanced r=0.75", "ours r=0.5"]
    for name, row in rows.items():
        if name != "baseline":
            assert 0 < row["rel_error"] < 1


# ---------------------------------------------------------------- HunyuanVideo 1.5


def tiny_hunyuanvideo15(num_layers: int = 2, in_channels: int = 4) -> HunyuanVideo15Transformer3DModel:
    torch.manual_seed(0)
    return HunyuanVideo15Transformer3DModel(
        in_channels=in_channels,
        out_channels=4,
        num_attention_heads=2,
        attention_head_dim=16,
        num_layers=num_layers,
        num_refiner_layers=1,
        patch_size=1,
        patch_size_t=1,
        text_embed_dim=TEXT_DIM,
        text_embed_2_dim=8,
        image_embed_dim=12,
        rope_axes_dim=(4, 6, 6),
    ).eval()


def hunyuanvideo15_inputs(batch: int = 2, frames: int = 3, h: int = 6, w: int = 8, seed: int = 0) -> dict:
    """As HunyuanVideo15Pipeline calls the model for text-to-video (zero image embeddings): the Qwen text with its
    last two tokens padding, the ByT5 text (the second sample's last token padding)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, TEXT, dtype=torch.long)
    mask[:, TEXT - 2 :] = 0
    mask_2 = torch.ones(batch, 4, dtype=torch.long)
    mask_2[1:, 3:] = 0
    return {
        "hidden_states": torch.randn(batch, 4, frames, h, w, generator=g),
        "timestep": torch.full((batch,), 500.0),
        "encoder_hidden_states": torch.randn(batch, TEXT, TEXT_DIM, generator=g),
        "encoder_attention_mask": mask,
        "encoder_hidden_states_2": torch.randn(batch, 4, 8, generator=g),
        "encoder_attention_mask_2": mask_2,
        "image_embeds": torch.zeros(batch, 3, 12),
    }


def test_hunyuanvideo15_family_reads_the_grid_and_finds_every_block():
    model = tiny_hunyuanvideo15()
    family = family_of(model)
    assert isinstance(family, HunyuanVideo15Family) and family.video and family.name == "hunyuanvideo15"
    sites = family.blocks(model)
    assert [site.module for site in sites] == list(model.transformer_blocks)
    assert [s.feed_forward for s in sites] == [block.ff for block in model.transformer_blocks]
    refiners = set(model.context_embedder.modules())
    assert not any(a.module in refiners for s in sites for a in s.attentions)
    assert family.token_grid(model, (), hunyuanvideo15_inputs(frames=3, h=6, w=8)) == (3, 6, 8)


@pytest.mark.parametrize("options", [{"ratio": 0.5}, {"preset": "balanced"}, {"preset": "fast"}])
def test_hunyuanvideo15_merges_and_removal_restores_the_model_bit_for_bit(options):
    model, inputs = tiny_hunyuanvideo15(), hunyuanvideo15_inputs(frames=4)
    plain = run(model, inputs)
    tp.apply_tome(model, **options)
    assert count_merges(model, inputs) == 2
    merged = run(model, inputs)
    assert merged.shape == plain.shape and torch.isfinite(merged).all()
    assert not torch.allclose(merged, plain, atol=1e-4)
    tp.remove_tome(model)
    assert torch.equal(run(model, inputs), plain)
    assert hooks_left(model) == 0 and tome_attributes_left(model) == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp.apply_tome(model, ratio=0.0)
    assert torch.equal(run(model, inputs), plain)


def test_hunyuanvideo15_samples_keep_their_own_merge_and_the_text_mask(monkeypatch):
    # Each sample has its own text padding (the model reorders valid tokens first): a batch of two equals two
    # batches of one. The blocks' mask covers the text alone (the processor pads it over the video): it reaches
    # the processor as it is, with the merged video tokens.
    model = tiny_hunyuanvideo15()
    tp.apply_tome(model, ratio=0.5, use_rand=False)
    inputs = hunyuanvideo15_inputs(seed=3)
    seen = []
    original = HunyuanVideo15AttnProcessor2_0.__call__

    def spying(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        seen.append((hidden_states.shape[1], attention_mask))
        return original(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)

    with monkeypatch.context() as patch:
        patch.setattr(HunyuanVideo15AttnProcessor2_0, "__call__", spying)
        both = run(model, inputs)
    tokens, text = 3 * 6 * 8, TEXT + 4 + 3  # the video; Qwen, ByT5 and image-embedding tokens
    assert [rows for rows, _ in seen] == [tokens - int(tokens * 0.5)] * 2
    assert all(mask.shape == (2, text) and not mask.all() for _, mask in seen)
    for b in range(2):
        one = {k: v[b : b + 1] for k, v in inputs.items()}
        torch.testing.assert_close(run(model, one)[0], both[b], rtol=1e-4, atol=1e-5)


def test_hunyuanvideo15_temporal_windows_merge_across_frames():
    model, inputs = tiny_hunyuanvideo15(), hunyuanvideo15_inputs(frames=4)
    tp.apply_tome(model, st=2, sx=1, sy=1, ratio=0.5)
    across = run(model, inputs)
    assert count_merges(model, inputs) == 2
    tp.apply_tome(model, ratio=0.5)
    assert not torch.allclose(across, run(model, inputs), atol=1e-4)


def tiny_hunyuanvideo15_pipeline(folder: Path) -> HunyuanVideo15Pipeline:
    """Text to video, random weights: Qwen2.5-VL's text model over a byte-level tokenizer, ByT5 (its tokenizer
    needs no files), diffusers' test-size VAE (4 x 4 x 2 compression), `tiny_hunyuanvideo15` taking the latents,
    the conditioning latents and their mask (4 + 4 + 1 channels), and classifier-free guidance (two model calls
    a step). The pipeline's text lengths are shortened on the instance (1,000 Qwen tokens after a 108-token system
    prompt, 256 ByT5 tokens and 729 image-embedding tokens otherwise): a short system prompt, cropped as the
    pipeline crops its own, 16 Qwen and 16 ByT5 tokens, 4 image-embedding tokens."""
    tokenizer = write_qwen_tokenizer(folder / "qwen")
    torch.manual_seed(0)
    text_encoder = Qwen2_5_VLTextModel(
        Qwen2_5_VLTextConfig(vocab_size=len(tokenizer), hidden_size=TEXT_DIM, intermediate_size=16,
                             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                             rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default"},
                             bos_token_id=len(tokenizer) - 1, eos_token_id=len(tokenizer) - 1)
    ).eval()  # fmt: skip
    tokenizer_2 = ByT5Tokenizer()
    torch.manual_seed(0)
    text_encoder_2 = T5EncoderModel(
        T5Config(vocab_size=len(tokenizer_2), d_model=8, d_kv=4, d_ff=16, num_layers=1, num_heads=2)
    ).eval()
    torch.manual_seed(0)
    vae = AutoencoderKLHunyuanVideo15(
        latent_channels=4, block_out_channels=(16, 16), layers_per_block=1, spatial_compression_ratio=4,
        temporal_compression_ratio=2, downsample_match_channel=False, upsample_match_channel=False,
    ).eval()  # fmt: skip
    pipe = HunyuanVideo15Pipeline(
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=tiny_hunyuanvideo15(in_channels=9),
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        guider=ClassifierFreeGuidance(guidance_scale=6.0),
    )
    pipe.set_progress_bar_config(disable=True)
    pipe.system_message = "Describe the video."
    pipe.prompt_template_encode_start_idx = len(tokenizer(pipe.system_message).input_ids)
    pipe.tokenizer_max_length, pipe.tokenizer_2_max_length, pipe.vision_num_semantic_tokens = 16, 16, 4
    return pipe


def generate15(pipe: HunyuanVideo15Pipeline) -> torch.Tensor:
    """A whole generation up to the denoised latents (3 latent frames of 8 x 8 tokens; the tiny VAE's decode
    merges nothing). The prompt quotes a text, so ByT5 encodes it; both prompts are padded and masked."""
    with torch.no_grad():
        return pipe(
            prompt='a "hi" sign',
            height=32,
            width=32,
            num_frames=5,
            num_inference_steps=2,
            generator=torch.Generator().manual_seed(0),
            output_type="latent",
        ).frames


@pytest.mark.parametrize("how", TOME_USAGES)
def test_hunyuanvideo15_pipeline_generates_the_same_video_twice_with_tome(how, tmp_path):
    check_pipeline_usage(tiny_hunyuanvideo15_pipeline, generate15, how, tmp_path)


def test_hunyuanvideo15_pipeline_merges_in_the_double_stream_blocks_only(tmp_path, monkeypatch):
    pipe = tiny_hunyuanvideo15_pipeline(tmp_path)
    tp.apply_tome(pipe, ratio=0.5)
    calls = []
    original = joint_attention._call

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(joint_attention, "_call", counting)
    generate15(pipe)
    assert len(calls) == 2 * 2 * 2  # two steps, two guidance calls, two blocks
    slotted = {
        f"{name}.{path}"
        for name, component in pipe.components.items()
        if isinstance(component, torch.nn.Module)
        for path, m in component.named_modules()
        if SLOT_ATTR in vars(m)
    }
    assert slotted == {f"transformer.transformer_blocks.{i}.attn" for i in range(2)}  # not the token refiner
