"""ToMe on video diffusion transformers: tiny random-weight Wan 2.1 / 2.2 models (no downloads)."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline, WanTransformer3DModel
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from transformers import UMT5Config, UMT5EncoderModel

import tome_processors as tp
from tome_processors import ToMeConfig, ToMeProcessor
from tome_processors.bench import run as bench_run
from tome_processors.bench.dit import build_transformer, make_transformer_inputs
from tome_processors.bench.methods import pick_methods
from tome_processors.bench.pipelines import write_t5_tokenizer
from tome_processors.bench.quality import VIDEO_EPS_CHANGE, VIDEO_FLICKER
from tome_processors.cli.main import main
from tome_processors.context import BlockState
from tome_processors.families import WanFamily, family_of
from tome_processors.merge import GridLayout, bipartite_soft_matching_2d, fold_frames, match

from leftovers import hooks_left, tome_attributes_left

TEXT_DIM, TEXT_LEN = 16, 7


def tiny_wan(num_layers: int = 2, image_dim: int | None = None) -> WanTransformer3DModel:
    """Wan-shaped (patch (1, 2, 2), 3-D rotary embeddings, qk RMS norm); `image_dim` makes it image-to-video."""
    torch.manual_seed(0)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=12,
        in_channels=4,
        out_channels=4,
        text_dim=TEXT_DIM,
        freq_dim=32,
        ffn_dim=32,
        num_layers=num_layers,
        rope_max_seq_len=32,
        image_dim=image_dim,
        added_kv_proj_dim=None if image_dim is None else 24,
    ).eval()


def wan_inputs(batch: int = 2, frames: int = 5, h: int = 8, w: int = 12, seed: int = 0) -> dict:
    """A latent clip of `frames` x `h` x `w` (a token grid of frames x h/2 x w/2)."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(batch, 4, frames, h, w, generator=generator),
        "timestep": torch.full((batch,), 500),
        "encoder_hidden_states": torch.randn(batch, TEXT_LEN, TEXT_DIM, generator=generator),
    }


def run(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample


class RecordingWan(WanAttnProcessor):
    """Wan's processor, recording what each call gets."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[torch.Tensor, torch.Tensor | None, object]] = []

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        self.calls.append((hidden_states, encoder_hidden_states, rotary_emb))
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)


OPTIONS = [
    pytest.param({}, id="per-frame"),
    pytest.param({"use_rand": False}, id="per-frame-fixed"),
    pytest.param({"st": 2}, id="st2"),
    pytest.param({"st": 2, "sx": 1, "sy": 1}, id="temporal-only"),
    pytest.param({"st": 2, "share_level": True, "merge_mlp": True}, id="st2-shared-mlp"),
    pytest.param({"merge_crossattn": True, "recompute_every": 2}, id="crossattn"),
]


def test_wan_is_a_video_family_found_by_its_class():
    model = tiny_wan()
    family = family_of(model)
    assert isinstance(family, WanFamily) and family.video and family.needs_row_token
    assert [site.module for site in family.blocks(model)] == list(model.blocks)
    assert family.token_grid(model, (), wan_inputs(frames=5, h=8, w=12)) == (5, 4, 6)
    assert family.token_grid(model, (torch.zeros(1, 4, 8, 8),), {}) is None  # not a clip


@pytest.mark.parametrize("options", OPTIONS)
def test_changes_output_no_nan_and_removal_is_bit_exact(options):
    model, inputs = tiny_wan(), wan_inputs()
    processors = dict(model.attn_processors)
    baseline = run(model, inputs)

    tp.apply_tome(model, **options)
    assert all(isinstance(p, ToMeProcessor) for p in model.attn_processors.values())
    merged = run(model, inputs)
    assert torch.isfinite(merged).all()
    assert not torch.allclose(merged, baseline, atol=1e-4)
    assert torch.equal(run(model, inputs), merged)  # reproducible

    tp.remove_tome(model)
    assert torch.equal(run(model, inputs), baseline)
    assert hooks_left(model) == 0 and tome_attributes_left(model) == []
    assert all(model.attn_processors[k] is p for k, p in processors.items())


def test_ratio_zero_equals_the_plain_model():
    model, inputs = tiny_wan(), wan_inputs()
    baseline = run(model, inputs)
    with pytest.warns(UserWarning, match="merges nothing"):
        tp.apply_tome(model, ratio=0.0)
    assert torch.equal(run(model, inputs), baseline)


@pytest.mark.parametrize(
    ("options", "kept"),
    [
        # 5 frames of 4 x 6 tokens: 120, 60 merged away (12 per frame).
        ({}, 60),
        ({"st": 2}, 60),
        ({"st": 2, "sx": 1, "sy": 1, "ratio": 0.3}, 120 - 36),
    ],
)
def test_self_attention_sees_the_merged_tokens_with_their_kept_tokens_rotations(options, kept):
    model, inputs = tiny_wan(1), wan_inputs(frames=5, h=8, w=12)
    recorder = RecordingWan()
    model.set_attn_processor(recorder)
    cos_full, sin_full = model.rope(inputs["hidden_states"])  # (1, 120, 1, D) each
    tp.apply_tome(model, **options)
    run(model, inputs)
    (self_states, self_text, (cos, sin)), (cross_states, cross_text, cross_rotary) = recorder.calls
    assert self_text is None and self_states.shape[:2] == (2, kept)
    assert cos.shape == (2, kept, 1, cos_full.shape[-1])
    # Cross-attention: every text token, queries merged only with merge_crossattn; no rotation.
    assert cross_text.shape[1] == TEXT_LEN and cross_states.shape[1] == 120 and cross_rotary is None
    # Every row rotated exactly as one real token of the clip, each token's rotation used at most once.
    full = torch.cat([cos_full, sin_full], -1)[0, :, 0]
    for rows in torch.cat([cos, sin], -1)[:, :, 0]:
        same = (rows[:, None] == full[None]).all(-1)
        assert (same.sum(1) >= 1).all()


def test_per_frame_merging_keeps_every_row_inside_one_frame():
    # exact: tomesd frame by frame, as many tokens merged in every frame.
    model, inputs = tiny_wan(1), wan_inputs(frames=3, h=8, w=12)
    merges = []
    original = BlockState.merge_for

    def recording(self, config, *args, **kwargs):
        merge = original(self, config, *args, **kwargs)
        merges.append(merge)
        return merge

    tp.apply_tome(model, ratio=0.5)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BlockState, "merge_for", recording)
        run(model, inputs)
    merge = merges[0]
    frame_rows = merge.num_rows // 3
    assert merge.num_rows == 36 and merge.num_tokens == 72
    token_frame = torch.arange(72) // 24
    for b in range(2):
        rows = merge.token_rows[b] - b * merge.num_rows
        assert torch.equal(rows // frame_rows, token_frame)
        assert torch.equal(merge.row_token[b] // 24, torch.arange(36) // frame_rows)  # kept in its own frame


def test_fold_frames_matches_merging_each_frame_on_its_own():
    metric = torch.randn(2 * 3, 4 * 6, 8, generator=torch.Generator().manual_seed(3))
    per_frame = bipartite_soft_matching_2d(metric, 4, 6, 2, 2, 10, with_row_token=True)
    clip = fold_frames(per_frame, batch=2, frames=3)
    x = torch.randn(2, 3 * 24, 5)
    merged = clip.merge(x)
    assert merged.shape == (2, 3 * 14, 5)
    for b in range(2):
        for f in range(3):
            frame = per_frame.merge(x[b : b + 1, f * 24 : (f + 1) * 24].expand(6, -1, -1))[b * 3 + f]
            torch.testing.assert_close(merged[b, f * 14 : (f + 1) * 14], frame)
    torch.testing.assert_close(clip.unmerge(merged), per_frame.unmerge(merged.view(6, 14, 5)).view(2, 72, 5))
    with pytest.raises(ValueError, match="Expected a merge of 4 frames"):
        fold_frames(per_frame, batch=2, frames=2)


@pytest.mark.parametrize(("frames", "st", "sy", "sx"), [(3, 2, 2, 2), (4, 2, 1, 1), (5, 3, 2, 1), (2, 1, 2, 2)])
def test_windows_span_st_frames_and_leftovers_are_sources(frames, st, sy, sx):
    h, w = 5, 4
    layout = GridLayout.build(h, w, sx, sy, frames=frames, st=st)
    partition = layout.fixed()
    windows = (frames // st) * (h // sy) * (w // sx)
    assert partition.num_dst == windows and partition.num_src == frames * h * w - windows
    assert sorted(partition.perm.tolist()) == list(range(frames * h * w))
    # A window's tokens: st consecutive frames, sy rows, sx columns; its destination is one of them.
    window = layout.window_of_token.view(frames, h, w)
    f, y, x = torch.meshgrid(torch.arange(frames), torch.arange(h), torch.arange(w), indexing="ij")
    inside = (f < frames // st * st) & (y < h // sy * sy) & (x < w // sx * sx)
    expected = ((f // st) * (h // sy) + y // sy) * (w // sx) + x // sx
    assert torch.equal(window[inside], expected[inside])
    assert set(layout.edges.tolist()) == set(torch.arange(frames * h * w)[~inside.reshape(-1)].tolist())
    choice = torch.randint(0, st * sy * sx, (1, windows), generator=torch.Generator().manual_seed(0))
    destinations = layout.partitions(choice).unbind()[0].dst_idx
    assert torch.equal(layout.window_of_token[destinations], torch.arange(windows))


def test_temporal_merging_collapses_a_static_clip_across_time():
    # Every frame the same: with windows across two frames (and none inside a frame), every token merges
    # into its own place in another frame, and merging then unmerging gives the clip back.
    frame = torch.randn(1, 1, 4 * 6, 8, generator=torch.Generator().manual_seed(1))
    metric = frame.expand(1, 4, 24, 8).reshape(1, 96, 8)
    layout = GridLayout.build(4, 6, 1, 1, frames=4, st=2)
    merge = match(metric, layout.fixed(), 48, with_row_token=True)
    kept_at = merge.row_token[0][merge.token_rows[0]]  # the token each token's row is kept at
    assert torch.equal(kept_at % 24, torch.arange(96) % 24)  # the same place, another frame
    assert torch.equal(merge.row_token[0] // 24, torch.tensor([0] * 24 + [2] * 24))  # kept at the first of a pair
    merged = merge.merge(metric)
    assert merged.shape == (1, 48, 8)
    torch.testing.assert_close(merge.unmerge(merged), metric)


def test_st_is_validated_and_refused_on_image_models():
    with pytest.raises(ValueError, match="Expected st to be an integer >= 1"):
        ToMeConfig(st=0)
    assert ToMeConfig(st=2).max_ratio == 0.875
    with pytest.raises(ValueError, match=r"cap 1 - 1/\(st\*sx\*sy\) for st=2, sx=1, sy=1"):
        ToMeConfig(st=2, sx=1, sy=1, ratio=0.6)
    from test_dit import tiny_pixart

    pixart = tiny_pixart()
    processors = dict(pixart.attn_processors)
    with pytest.raises(ValueError, match="Expected st=1 on PixArtTransformer2DModel"):
        tp.apply_tome(pixart, st=2)
    assert hooks_left(pixart) == 0 and dict(pixart.attn_processors) == processors


def test_k_v_pooling_is_refused_on_wan():
    with pytest.raises(ValueError, match='Expected mode="merge" on WanTransformer3DModel'):
        tp.apply_tome(tiny_wan(), mode="downsample_kv")


def test_samples_of_a_batch_are_merged_independently():
    model = tiny_wan()
    pair = wan_inputs(batch=2)
    tp.apply_tome(model, st=2, use_rand=False)
    both = run(model, pair)
    for b in range(2):
        alone = {k: v[b : b + 1] for k, v in pair.items()}
        torch.testing.assert_close(run(model, alone)[0], both[b], rtol=1e-4, atol=1e-5)


def test_image_to_video_cross_attention_sees_every_text_and_image_token():
    model = tiny_wan(1, image_dim=20)
    inputs = {**wan_inputs(), "encoder_hidden_states_image": torch.randn(2, 3, 20)}
    # Wan's I2V processor takes the last 512 context tokens as text: a 512-token prompt, as the pipeline pads.
    inputs["encoder_hidden_states"] = torch.randn(2, 512, TEXT_DIM)
    recorder = RecordingWan()
    model.set_attn_processor(recorder)
    baseline = run(model, inputs)
    tp.apply_tome(model)
    merged = run(model, inputs)
    assert torch.isfinite(merged).all() and not torch.allclose(merged, baseline, atol=1e-4)
    cross = recorder.calls[-1]
    assert cross[1].shape[1] == 3 + 512 and cross[0].shape[1] == 5 * 4 * 6
    tp.remove_tome(model)
    assert torch.equal(run(model, inputs), baseline)


def test_set_attn_processor_matches_apply_tome():
    model, inputs = tiny_wan(), wan_inputs()
    config = ToMeConfig(ratio=0.5, st=2)
    tp.apply_tome(model, config=config)
    expected = run(model, inputs)
    tp.remove_tome(model)
    model.set_attn_processor(ToMeProcessor(WanAttnProcessor(), config))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(run(model, inputs), expected)
    tp.remove_tome(model)
    assert hooks_left(model) == 0 and tome_attributes_left(model) == []


def test_presets_and_defaults():
    model, inputs = tiny_wan(), wan_inputs()
    assert ToMeConfig.for_model(model) == ToMeConfig(**WanFamily.defaults)
    baseline = run(model, inputs)
    for preset in ("exact", "balanced", "fast"):
        tp.apply_tome(model, preset=preset)
        out = run(model, inputs)
        assert torch.isfinite(out).all() and not torch.allclose(out, baseline, atol=1e-4)
    assert ToMeConfig.from_preset("exact", "wan").st == 1


# Pipelines: tiny offline WanPipeline (Wan 2.1: one transformer; Wan 2.2: `transformer` for the noisy steps,
# `transformer_2` for the rest), random weights, a character tokenizer written locally.


def tiny_wan_pipeline(tmp_path, two_experts: bool = False) -> WanPipeline:
    tokenizer = write_t5_tokenizer(tmp_path / "tokenizer-files")
    torch.manual_seed(0)
    text_encoder = UMT5EncoderModel(
        UMT5Config(
            vocab_size=len(tokenizer), d_model=TEXT_DIM, d_kv=8, d_ff=24, num_layers=2, num_heads=2, pad_token_id=0
        )
    ).eval()
    torch.manual_seed(0)
    vae = AutoencoderKLWan(
        base_dim=3,
        z_dim=4,
        dim_mult=[1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.0] * 4,
        latents_std=[1.0] * 4,
    ).eval()
    second = tiny_wan() if two_experts else None
    if second is not None:
        with torch.no_grad():  # another expert: other weights
            for parameter in second.parameters():
                parameter.mul_(1.1)
    pipe = WanPipeline(
        tokenizer=tokenizer,
        text_encoder=text_encoder,
        vae=vae,
        scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        transformer=tiny_wan(),
        transformer_2=second,
        boundary_ratio=0.5 if two_experts else None,
    )
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generate(pipe: WanPipeline) -> np.ndarray:
    with torch.no_grad():
        return pipe(
            prompt="a cat walks",
            negative_prompt="blurry",
            height=32,
            width=32,
            num_frames=9,  # 3 latent frames of 2 x 2 tokens
            num_inference_steps=4,
            guidance_scale=5.0,
            max_sequence_length=16,
            generator=torch.Generator().manual_seed(0),
            output_type="np",
        ).frames


@pytest.mark.parametrize(
    ("two_experts", "how"),
    [
        pytest.param(False, "apply_tome", id="wan2.1-apply_tome"),
        pytest.param(False, "enable_tome", id="wan2.1-enable_tome", marks=pytest.mark.slow),
        pytest.param(True, "apply_tome", id="wan2.2-apply_tome"),
        pytest.param(True, "enable_tome", id="wan2.2-enable_tome"),
    ],
)
def test_wan_pipelines_generate_the_same_video_twice_and_cover_both_experts(tmp_path, request, two_experts, how):
    pipe = tiny_wan_pipeline(tmp_path, two_experts)
    models = [pipe.transformer] + ([pipe.transformer_2] if two_experts else [])
    calls = {id(model): 0 for model in models}
    merged = {id(model): 0 for model in models}
    for model in models:
        model.register_forward_pre_hook(lambda module, args: calls.__setitem__(id(module), calls[id(module)] + 1))
    baseline = generate(pipe)
    original = BlockState.merge_for

    def recording(self, config, *args, **kwargs):
        merge = original(self, config, *args, **kwargs)
        if merge is not None:
            for model in models:
                if any(block is self for block in tp.hooks.context_of(model).blocks):
                    merged[id(model)] += 1
        return merge

    if how == "apply_tome":
        tp.apply_tome(pipe, ratio=0.5, sx=1, sy=1, st=2)
    else:
        tp.patch_pipelines()  # the opt-in that gives every pipeline `enable_tome()`
        request.addfinalizer(tp.unpatch_pipelines)
        pipe.enable_tome(ratio=0.5, sx=1, sy=1, st=2)
    assert all(tp.is_tome_applied(model) for model in models)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BlockState, "merge_for", recording)
        first = generate(pipe)
    second = generate(pipe)
    assert first.shape == baseline.shape == (1, 9, 32, 32, 3) and np.isfinite(first).all()
    np.testing.assert_array_equal(first, second)  # same seed, same video
    assert not np.array_equal(first, baseline)
    assert all(calls[id(model)] > 0 and merged[id(model)] > 0 for model in models)  # each expert ran merged
    if how == "apply_tome":
        tp.remove_tome(pipe)
    else:
        pipe.disable_tome()
    assert not any(tp.is_tome_applied(model) for model in models)
    np.testing.assert_array_equal(generate(pipe), baseline)


def test_bench_rows_for_wan_show_attention_share_and_the_trained_video_columns(tmp_path, capsys, monkeypatch):
    pytest.importorskip("skimage")
    # The trained video model's columns on a cheaper probe than the bench's (one clip per motion, one level).
    metrics = bench_run.trained_quality_metrics
    monkeypatch.setattr(bench_run, "trained_quality_metrics", lambda name: metrics(name, timesteps=(300,), per_image=1))
    path = tmp_path / "wan.json"
    argv = ["bench", "--quick", "--arch", "wan", "--rounds", "1", "--no-progress", "--no-memory", "--no-host-cost"]
    assert main([*argv, "--ratios", "0.5", "--modes", "temporal", "--presets", "balanced", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    rows = {row["name"]: row for row in data["rows"]}
    assert sorted(rows) == ["baseline", "ours balanced r=0.75", "ours r=0.5", "ours st=2 r=0.5"]
    for name, row in rows.items():
        assert 0 < row["extra"]["attention %"] < 100
        changed = [row["extra"][column] > 0 for column in (VIDEO_EPS_CHANGE, VIDEO_FLICKER)]
        assert changed == [name != "baseline"] * 2  # each row on the trained video model too
        if name != "baseline":
            assert 0 < row["rel_error"] < 1 and row["overhead_share"] > 0  # block inputs recorded on the clip
    out = capsys.readouterr().out
    assert "attention %" in out and VIDEO_FLICKER in out


def test_bench_builds_wan_at_the_real_width_and_clip(capsys):
    model = build_transformer("wan", layers=1)
    assert len(model.blocks) == 1 and model.config.ffn_dim == 8960 and model.blocks[0].attn1.heads == 12
    inputs = make_transformer_inputs(model, "wan", 1, 480, frames=33, width=832)
    assert inputs.kwargs["hidden_states"].shape == (1, 16, 9, 60, 104)  # 9 x 30 x 52 = 14,040 tokens
    assert inputs.kwargs["encoder_hidden_states"].shape == (1, 512, 4096)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--arch", "pixart", "--frames", "33"], "only with a video --arch"),
        (["--arch", "wan", "--frames", "32"], "4k + 1"),
        (["--arch", "wan", "--layers", "0"], "--layers >= 1"),
        (["--arch", "wan", "--width", "100"], "multiple of 16"),
    ],
)
def test_bench_video_options_are_checked(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_video_modes_are_left_out_on_image_models():
    from test_dit import tiny_pixart

    pixart = tiny_pixart()
    methods, notes = pick_methods(pixart, family_of(pixart), [0.5], ["temporal", "bf16"], False, [])
    assert [m.name for m in methods] == ["baseline", "ours r=0.5", "ours bf16-sim r=0.5"]
    assert any("need a video model" in note for note in notes)


def test_video_probe_measures_change_and_flicker(capsys):
    from tome_processors.bench.video_probe import main, probe

    rows = probe(quick=True, sigmas=(0.5,), settings={"none": {"ratio": 0.0}, "exact": {}, "temporal": {"st": 2}})
    by_name = {row["setting"]: row for row in rows}
    assert by_name["none"]["change"] == 0 and by_name["none"]["flicker"] == 0
    assert by_name["exact"]["change"] > 0 and by_name["temporal"]["flicker"] > 0
    assert main(["--quick"]) == 0 and "| 0.3 | st=2 1x1 r=0.5 |" in capsys.readouterr().out
