"""Cosmos, MiniMax-H3, Allegro, EasyAnimate and Latte (`families/video_more.py`) beyond the family table's checks:
MiniMax-H3's grid read from its packed layout, its keyframes and audio never merged, each family's timestep, Allegro's
rotary positions following the merged rows, and Cosmos 3 and Mochi refused with their reasons."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from diffusers import Cosmos3OmniTransformer, MochiTransformer3DModel
from diffusers.models.attention_processor import AllegroAttnProcessor2_0

import tome_processors as tp
from test_family_table import AttentionRecorder
from tome_processors.bench.dit import TRANSFORMER_ARCHITECTURES
from tome_processors.cli.main import main
from tome_processors.families import FAMILIES, REFUSED, family_of, find_family

from family_cases.video_more import (
    allegro_inputs,
    cosmos_inputs,
    minimax_h3_inputs,
    tiny_allegro,
    tiny_minimax_h3,
)


def tiny_cosmos3() -> Cosmos3OmniTransformer:
    torch.manual_seed(0)
    return Cosmos3OmniTransformer(
        head_dim=8, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_hidden_layers=1,
        num_key_value_heads=1, patch_latent_dim=16, latent_channel=4, vocab_size=32, rope_axes_dim=(2, 1, 1),
    )  # fmt: skip


def tiny_mochi() -> MochiTransformer3DModel:
    """diffusers' own test config."""
    torch.manual_seed(0)
    return MochiTransformer3DModel(
        patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=2, pooled_projection_dim=16,
        in_channels=4, text_embed_dim=16, time_embed_dim=4, max_sequence_length=16,
    )  # fmt: skip


@pytest.mark.parametrize(
    "build, why",
    [
        (tiny_cosmos3, "ToMe cannot reach the video.s tokens"),
        (tiny_mochi, "cannot put its processor in place of Mochi's"),
    ],
    ids=["cosmos3", "mochi"],
)
def test_cosmos3_and_mochi_are_refused_with_the_reason(build, why):
    model = build()
    assert find_family(model) is None and type(model) in REFUSED
    with pytest.raises(ValueError, match=why):
        tp.apply_tome(model, ratio=0.5)
    with pytest.raises(ValueError, match=why):
        tp.explain_tome(model, 256, 256, print_table=False)
    assert not tp.is_tome_applied(model)


def _queries(model: torch.nn.Module, inputs: dict) -> list[int]:
    recorder = AttentionRecorder()
    with torch.no_grad(), recorder:
        model(**inputs)
    return [queries for queries, _ in recorder.calls]


@pytest.mark.parametrize("keyframes", [(), ("first",), ("first", "last")], ids=["t2va", "fl2va-first", "fl2va"])
def test_minimax_h3_merges_the_generated_video_alone_in_each_layout(keyframes):
    # The packed sequence: 7 text rows, 48 rows a keyframe, 6 audio rows, then the video's 2 frames of 6 x 8.
    model, inputs = tiny_minimax_h3(), minimax_h3_inputs(keyframes=keyframes)
    family = family_of(model)
    assert family.token_grid(model, (), inputs) == (2, 6, 8)
    plain = _queries(model, inputs)
    tp.apply_tome(model, ratio=0.5)
    merged = _queries(model, inputs)
    tp.remove_tome(model)
    whole = 7 + 48 * len(keyframes) + 6 + 96
    assert plain == [7, 7, whole, whole]  # the text refiner's 2 blocks, then the 2 blocks over the whole sequence
    assert merged == [7, 7, whole - 48, whole - 48]  # half the video's tokens; text, keyframes and audio whole


def test_minimax_h3_merges_nothing_where_the_sequence_does_not_close_with_a_video_grid():
    model, inputs = tiny_minimax_h3(), minimax_h3_inputs()
    shuffled = dict(inputs, position_ids=inputs["position_ids"].flip(0))  # the video's rows in no grid order
    assert family_of(model).token_grid(model, (), shuffled) is None
    plain = _queries(model, shuffled)
    tp.apply_tome(model, ratio=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert _queries(model, shuffled) == plain
    assert any("form no such grid" in str(w.message) for w in caught)
    tp.remove_tome(model)


def test_minimax_h3_grid_is_read_once_per_layout():
    family, model = FAMILIES["minimax_h3"](), tiny_minimax_h3()
    inputs = minimax_h3_inputs()
    assert family.token_grid(model, (), inputs) == (2, 6, 8)
    inputs["position_ids"] = inputs["position_ids"].clone()
    inputs["position_ids"][-48:, 1] *= -1.0  # the last frame's rows upside down: no grid
    with pytest.warns(UserWarning, match="form no such grid"):
        assert family.token_grid(model, (), inputs) is None  # a new tensor: read again
    inputs["position_ids"][-48:, 1] *= -1.0  # changed back in place: its version tells
    assert family.token_grid(model, (), inputs) == (2, 6, 8)


def test_minimax_h3_timestep_is_the_video_rows_noise_and_its_clip_its_vaes():
    family, inputs = FAMILIES["minimax_h3"](), minimax_h3_inputs()
    # The rows' distinct timesteps are video 0.4, audio 0.6 and the keyframe's 0.999, t = 1 - sigma.
    torch.testing.assert_close(family.timestep((), inputs), torch.tensor([600.0]))
    # 124 frames (the pipeline's default) are 7 chunks of 17 and 5: 37 latent frames; 120 is snapped up to 124.
    assert [family.latent_frames(n) for n in (124, 120, 22)] == [37, 37, 7]


def test_cosmos_timestep_is_the_noisiest_frames_per_sample():
    family, inputs = FAMILIES["cosmos"](), cosmos_inputs()
    # Image to world: the first latent frame clean (1e-4), the others at sigma 0.7 and 0.4.
    torch.testing.assert_close(family.timestep((), inputs), torch.tensor([700.0, 400.0]))
    one_per_sample = dict(inputs, timestep=torch.tensor([0.7, 0.4]))
    torch.testing.assert_close(family.timestep((), one_per_sample), torch.tensor([700.0, 400.0]))


def test_allegro_rows_are_rotated_at_their_kept_tokens_positions(monkeypatch):
    model, inputs = tiny_allegro(), allegro_inputs()
    tables, positions = inputs["image_rotary_emb"]
    seen = []
    original = AllegroAttnProcessor2_0.__call__

    def recording(self, attn, hidden_states, *args, **kwargs):
        if kwargs.get("image_rotary_emb") is not None and not attn.is_cross_attention:
            seen.append((hidden_states.shape[1], kwargs["image_rotary_emb"]))
        return original(self, attn, hidden_states, *args, **kwargs)

    tp.apply_tome(model, ratio=0.5)
    monkeypatch.setattr(AllegroAttnProcessor2_0, "__call__", recording)
    with torch.no_grad():
        model(**inputs)
    tp.remove_tome(model)
    grid = {tuple(p) for p in torch.stack([p[0] for p in positions], dim=1).tolist()}  # every token's (t, h, w)
    assert len(seen) == 2
    for rows, (got_tables, got_positions) in seen:
        assert rows == 48 and got_tables is tables  # the tables as the pipeline made them
        assert all(p.shape == (2, rows) for p in got_positions)  # one row of indices per sample
        for b in range(2):
            kept = [tuple(p) for p in torch.stack([p[b] for p in got_positions], dim=1).tolist()]
            assert len(set(kept)) == rows and set(kept) <= grid  # each row at a token of its own


def test_allegro_positions_of_a_shape_tome_does_not_know_are_not_merged():
    # Positions per sample, (B, N): the model takes them, ToMe does not know whose rows they are and leaves it whole.
    model, inputs = tiny_allegro(), allegro_inputs()
    tables, positions = inputs["image_rotary_emb"]
    inputs["image_rotary_emb"] = (tables, tuple(p.expand(2, -1) for p in positions))
    with torch.no_grad():
        plain = model(**inputs).sample
    tp.apply_tome(model, ratio=0.5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            merged = model(**inputs).sample
    tp.remove_tome(model)
    assert torch.equal(merged, plain)
    assert any("rotary tables of a shape ToMe does not know" in str(w.message) for w in caught)


#: Each bench architecture's width and depth fields and their published (or inferred) values.
PUBLISHED = {
    "cosmos": ({"num_attention_heads": 16, "attention_head_dim": 128, "num_layers": 28}, 512),
    "minimax_h3": ({"num_attention_heads": 56, "attention_head_dim": 128, "hidden_size": 5376, "num_layers": 50}, 256),
    "allegro": ({"num_attention_heads": 24, "attention_head_dim": 96, "num_layers": 32}, 512),
    "easyanimate": ({"num_attention_heads": 48, "attention_head_dim": 64, "num_layers": 48}, 256),
    "latte": ({"num_attention_heads": 16, "attention_head_dim": 72, "num_layers": 28}, 120),
}


@pytest.mark.parametrize("arch", sorted(PUBLISHED))
def test_bench_architectures_run_quick_at_one_block(arch, tmp_path):
    shape, text = PUBLISHED[arch]
    full = TRANSFORMER_ARCHITECTURES[arch]
    assert {name: full[name] for name in shape} == shape
    from tome_processors.bench.dit import TEXT_TOKENS

    assert TEXT_TOKENS[arch] == text
    path = tmp_path / f"{arch}.json"
    argv = ["bench", "--quick", "--rounds", "1", "--no-progress", "--no-memory", "--no-trained-quality"]
    argv += ["--no-host-cost", "--arch", arch, "--presets", "balanced", "--layers", "1"]
    assert main([*argv, "--json", str(path)]) == 0
    rows = {row["name"]: row for row in json.loads(path.read_text())["rows"]}
    balanced = "ours balanced r=0.4" if arch == "latte" else "ours balanced r=0.75"  # PixArt's presets, Wan's
    assert sorted(rows) == ["baseline", balanced]
    assert 0 < rows[balanced]["rel_error"] < 1  # merged, and no more than that
