"""Cosmos, MiniMax-H3, Allegro, EasyAnimate, Latte and Mochi (`families/video_more.py`) beyond the family table's
checks: MiniMax-H3's grid read from its packed layout, its keyframes and audio never merged, each family's timestep,
Allegro's and Mochi's rotary positions following the merged rows, Mochi's processor put back as it was, and Cosmos 3
refused with its reason."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from diffusers import Cosmos3OmniTransformer
from diffusers.models.attention_processor import AllegroAttnProcessor2_0, MochiAttention, MochiAttnProcessor2_0

import tome_processors as tp
from test_family_table import AttentionRecorder
from tome_processors.bench.dit import TRANSFORMER_ARCHITECTURES
from tome_processors.cli.main import main
from tome_processors.families import FAMILIES, REFUSED, family_of, find_family

from family_cases.video_more import (
    LATENT_H,
    LATENT_W,
    MOCHI_CLIP,
    SIDE,
    TEXT,
    allegro_inputs,
    cosmos_inputs,
    minimax_h3_inputs,
    mochi_inputs,
    mochi_pipeline,
    tiny_allegro,
    tiny_minimax_h3,
    tiny_mochi,
)


def tiny_cosmos3() -> Cosmos3OmniTransformer:
    torch.manual_seed(0)
    return Cosmos3OmniTransformer(
        head_dim=8, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_hidden_layers=1,
        num_key_value_heads=1, patch_latent_dim=16, latent_channel=4, vocab_size=32, rope_axes_dim=(2, 1, 1),
    )  # fmt: skip


def test_cosmos3_is_refused_with_the_reason():
    model = tiny_cosmos3()
    assert find_family(model) is None and type(model) in REFUSED
    with pytest.raises(ValueError, match="ToMe cannot reach the video.s tokens"):
        tp.apply_tome(model, ratio=0.5)
    with pytest.raises(ValueError, match="ToMe cannot reach the video.s tokens"):
        tp.explain_tome(model, 256, 256, print_table=False)
    assert not tp.is_tome_applied(model)


def test_mochi_merges_and_removal_puts_its_processors_back_bit_for_bit():
    # MochiAttention has no set_processor, and the model no set_attn_processor: ToMe sets the attribute itself.
    model, inputs = tiny_mochi(), mochi_inputs()
    assert type(model) not in REFUSED and family_of(model).name == "mochi"
    attentions = [m for m in model.modules() if isinstance(m, MochiAttention)]
    originals = [attn.processor for attn in attentions]
    assert len(attentions) == 2 and all(type(p) is MochiAttnProcessor2_0 for p in originals)
    with torch.no_grad():
        plain = model(**inputs).sample
        tp.apply_tome(model, ratio=0.5)  # no longer raises
        assert tp.is_tome_applied(model)
        assert all(isinstance(attn.processor, tp.ToMeProcessor) for attn in attentions)
        merged = model(**inputs).sample
        tp.remove_tome(model)
        assert [attn.processor for attn in attentions] == originals  # the very objects
        assert all(attn.processor is p for attn, p in zip(attentions, originals, strict=True))
        assert torch.equal(model(**inputs).sample, plain)
    assert torch.isfinite(merged).all() and not torch.allclose(merged, plain, atol=1e-5)
    assert not tp.is_tome_applied(model)


def test_mochi_rows_are_rotated_at_their_kept_tokens_positions_and_its_text_mask_passes(monkeypatch):
    model, inputs = tiny_mochi(), mochi_inputs()
    grid = 2 * (LATENT_H // 2) * (LATENT_W // 2)
    with torch.no_grad():
        cos, sin = model.rope(model.pos_frequencies, 2, LATENT_H // 2, LATENT_W // 2, dtype=torch.float32)
    assert cos.shape == (grid, 2, 4)  # (N_video, heads, D/2), one table for the batch
    seen = []
    original = MochiAttnProcessor2_0.__call__

    def recording(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb=None):
        seen.append((hidden_states.shape, encoder_hidden_states.shape, attention_mask, image_rotary_emb))
        return original(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)

    tp.apply_tome(model, ratio=0.5)
    monkeypatch.setattr(MochiAttnProcessor2_0, "__call__", recording)
    with torch.no_grad():
        model(**inputs)
    tp.remove_tome(model)
    assert len(seen) == 2  # one call a block: the whole batch
    rows = grid // 2
    for video, text, mask, (got_cos, got_sin) in seen:
        assert tuple(video) == (2, rows, 16) and tuple(text) == (2, TEXT, 16)
        assert mask is inputs["encoder_attention_mask"]  # over the text alone: as it is
        assert got_cos.shape == got_sin.shape == (2, rows, 2, 4)  # a table per sample
        table = torch.cat([cos, sin], dim=-1).flatten(1)  # a token's whole rotation, a row
        for b in range(2):  # each row is a token's own rotation, each at a token of its own
            row = torch.cat([got_cos[b], got_sin[b]], dim=-1).flatten(1)
            match = (row[:, None] == table[None]).all(-1)  # (rows, tokens)
            assert bool(match.any(dim=1).all()) and len(set(match.float().argmax(dim=1).tolist())) == rows


def test_mochi_timestep_is_the_noise_level_its_pipeline_passes(tmp_path):
    # Its scheduler inverts the sigmas: the model gets 1000 (1 - sigma), 0 at the first (pure noise) step.
    pipe = mochi_pipeline(tmp_path)
    family = family_of(pipe.transformer)
    seen = []
    pipe.transformer.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((kwargs["timestep"].clone(), family.timestep(args, kwargs))),
        with_kwargs=True,
    )
    with torch.no_grad():
        pipe(
            prompt="a cat walks", height=SIDE, width=SIDE, num_frames=MOCHI_CLIP, num_inference_steps=2,
            guidance_scale=4.5, max_sequence_length=16, output_type="latent",
        )  # fmt: skip
    (t0, noise0), (t1, noise1) = seen
    torch.testing.assert_close(t0, torch.zeros(2))
    torch.testing.assert_close(noise0, torch.full((2,), 1000.0))
    torch.testing.assert_close(noise1, 1000.0 - t1)
    assert float(noise1[0]) < 1000.0
    # 6 pixel frames a latent frame after the first; 8 px a latent pixel under a 2 x 2 patch.
    assert [family.latent_frames(n) for n in (19, 85, 163)] == [4, 15, 28]
    rows = tp.explain_tome(pipe.transformer, 480, 848, num_frames=19, preset="balanced", print_table=False)
    assert {row.tokens for row in rows if row.level == 1} == {4 * 30 * 53}


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
    "mochi": ({"num_attention_heads": 24, "attention_head_dim": 128, "num_layers": 48, "in_channels": 12}, 256),
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
