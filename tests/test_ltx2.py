"""LTX-2 (`LTX2VideoTransformer3DModel`): packed video and audio tokens; only the video tokens merge, in each block's
video self-attention, with per-sample 3-D rotary tables (interleaved `(B, N, D)` or split `(B, H, N, D)`) that
follow the merged rows. The audio stream, the text and the audio-video cross-attention see every token."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from diffusers import LTX2VideoTransformer3DModel
from diffusers.models.transformers.transformer_ltx2 import LTX2AudioVideoAttnProcessor

import tome_processors as tp
from tome_processors.bench.dit import TRANSFORMER_ARCHITECTURES, make_transformer_inputs
from tome_processors.cli.main import main
from tome_processors.config import PRESETS
from tome_processors.context import SLOT_ATTR
from tome_processors.families import LTX2Family, family_of

from leftovers import hooks_left, tome_attributes_left

TEXT_DIM, TEXT_LEN, AUDIO_LEN = 16, 7, 5

#: The attention modules of a block whose tokens are never merged (the video self-attention `attn1` is).
UNMERGED = ("attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")


def tiny_ltx2(
    num_layers: int = 2, rope_type: str = "split", patch_size: int = 1, channels: int = 4
) -> LTX2VideoTransformer3DModel:
    """diffusers' test size of LTX-2, with the released model's split rotary tables unless told."""
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
    """Each attention call of the model, by module: `(query tokens, key tokens, query rotary table shape)`."""
    calls: dict[torch.nn.Module, list] = {}
    original = LTX2AudioVideoAttnProcessor.__call__

    def recording(
        self,
        attn,
        hidden_states,
        encoder_hidden_states=None,
        attention_mask=None,
        query_rotary_emb=None,
        key_rotary_emb=None,
    ):
        keys = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        table = None if query_rotary_emb is None else tuple(query_rotary_emb[0].shape)
        calls.setdefault(attn, []).append((hidden_states.shape[1], keys.shape[1], table, query_rotary_emb))
        return original(
            self, attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb, key_rotary_emb
        )

    monkeypatch.setattr(LTX2AudioVideoAttnProcessor, "__call__", recording)
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
    assert sorted(rows) == ["baseline", "ours balanced r=0.5", "ours r=0.5"]
    for name, row in rows.items():
        if name != "baseline":
            assert 0 < row["rel_error"] < 1
