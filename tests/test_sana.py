"""Sana and Sana-Video beyond the family table (tests/family_cases/sana.py): what merges and what never does (the
Mix-FFN, whose convolution needs the whole grid), K/V pooling through the linear attention, Sana-Sprint's timestep,
the released sizes explained from pixels, the bench architectures; and Sana-WM and its refiner refused with the reason.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from diffusers import SanaWMLTX2RefinerTransformer3DModel, SanaWMTransformer3DModel

import tome_processors as tp
from tome_processors.bench.archs import ARCHS
from tome_processors.bench.dit import build_transformer, make_transformer_inputs
from tome_processors.families import REFUSED, family_of, find_family

from family_cases.sana import H, W, sana_inputs, sana_video_inputs, tiny_sana, tiny_sana_video


def forward(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample


def tokens_into(modules: list[torch.nn.Module]) -> tuple[list, list]:
    """Pre-hooks recording the shape of every input of `modules`; returns (shapes, handles)."""
    shapes: list = []
    handles = [m.register_forward_pre_hook(lambda m, args: shapes.append(tuple(args[0].shape))) for m in modules]
    return shapes, handles


@pytest.mark.parametrize("video", [False, True], ids=["sana", "sana_video"])
def test_only_the_self_attention_merges_and_the_mix_ffn_gets_every_token(video):
    model = tiny_sana_video() if video else tiny_sana()
    inputs = sana_video_inputs() if video else sana_inputs()
    grid = 2 * H * W if video else H * W
    plain = forward(model, inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # merge_mlp has nothing to merge here: the family declares no feed-forward
        tp.apply_tome(model, ratio=0.5, merge_mlp=True)
    blocks = model.transformer_blocks
    queries, q_handles = tokens_into([block.attn1.to_q for block in blocks])
    convolved, ff_handles = tokens_into([block.ff for block in blocks])
    merged = forward(model, inputs)
    for handle in q_handles + ff_handles:
        handle.remove()
    assert all(shape[1] < grid for shape in queries) and len(queries) == len(blocks)
    # Sana's Mix-FFN gets the `(B, C, h, w)` grid, Sana-Video's `(B, F, h, w, C)`: every token, in its place.
    whole = (2, 2, H, W, 24) if video else (2, 8, H, W)
    assert convolved == [whole] * len(blocks)
    tp.remove_tome(model)
    tp.apply_tome(model, ratio=0.5)
    assert torch.equal(forward(model, inputs), merged)  # merge_mlp changed nothing
    assert not torch.allclose(merged, plain, atol=1e-5)
    tp.remove_tome(model)


def test_cross_attention_queries_merge_with_merge_crossattn():
    model, inputs = tiny_sana(), sana_inputs()
    queries, handles = tokens_into([block.attn2.to_q for block in model.transformer_blocks])
    tp.apply_tome(model, ratio=0.5)
    forward(model, inputs)
    assert [shape[1] for shape in queries] == [H * W] * 2  # not by default
    queries.clear()
    tp.apply_tome(model, ratio=0.5, merge_crossattn=True)
    out = forward(model, inputs)
    assert all(shape[1] < H * W for shape in queries) and torch.isfinite(out).all()
    for handle in handles:
        handle.remove()
    tp.remove_tome(model)


def test_kv_pooling_passes_the_pooled_tokens_as_the_linear_attentions_keys():
    model, inputs = tiny_sana(), sana_inputs()
    plain = forward(model, inputs)
    attn = model.transformer_blocks[0].attn1
    queries, q_handles = tokens_into([attn.to_q])
    keys, k_handles = tokens_into([attn.to_k])
    tp.apply_tome(model, mode="downsample_kv", kv_factor=2)
    pooled = forward(model, inputs)
    for handle in q_handles + k_handles:
        handle.remove()
    tp.remove_tome(model)
    assert queries == [(2, H * W, 8)] and keys == [(2, (H // 2) * (W // 2), 8)]
    assert torch.isfinite(pooled).all() and not torch.allclose(pooled, plain, atol=1e-5)
    # Sana-Video rotates each key with its token's row: pooled keys cannot pass.
    with pytest.raises(ValueError, match='mode="merge"'):
        tp.apply_tome(tiny_sana_video(), mode="downsample_kv")


def test_sana_sprint_timestep_is_put_on_the_noise_scale():
    family = family_of(tiny_sana())
    t = torch.tensor([0.25, 0.25])
    assert torch.equal(family.timestep((), {"timestep": t, "guidance": torch.tensor([4.5, 4.5])}), t * 1000)
    assert torch.equal(family.timestep((), {"timestep": 750 * t}), 750 * t)  # SanaPipeline: the scheduler's 0..1000
    video = family_of(tiny_sana_video())  # its pipelines: the scheduler's 0..1000 whatever they pass
    assert torch.equal(video.timestep((), {"timestep": 750 * t, "guidance": torch.tensor([4.5, 4.5])}), 750 * t)


def test_explain_tome_counts_the_released_models_tokens_from_pixels():
    # Sana: 32 px a token (DC-AE's 32x, patch 1); Sana-Video 480p: Wan's VAE (8x, 4 frames a latent frame), patch 2.
    rows = tp.explain_tome(tiny_sana(), 1024, 1024, preset="balanced", print_table=False)
    assert {row.tokens for row in rows} == {32 * 32}
    video = tiny_sana_video()
    rows = tp.explain_tome(video, 480, 832, num_frames=81, preset="balanced", print_table=False)
    assert {row.tokens for row in rows} == {21 * 30 * 52}


@pytest.mark.parametrize("arch", ["sana", "sana_video"])
def test_bench_builds_each_architecture_with_fewer_layers(arch):
    model = build_transformer(arch, quick=True, layers=1)
    assert family_of(model).name == arch and model.config.num_layers == 1
    resolution = 64 if arch == "sana_video" else 256
    inputs = make_transformer_inputs(model, arch, batch=2, resolution=resolution, quick=True)
    plain = inputs.run(model)
    tp.apply_tome(model, ratio=0.5)
    merged = inputs.run(model)
    tp.remove_tome(model)
    assert merged.shape == plain.shape and torch.isfinite(merged).all() and not torch.equal(merged, plain)


def test_bench_declares_the_released_widths():
    sana, video = ARCHS["sana"].full, ARCHS["sana_video"].full
    # Sana 1.6B: 2240 wide in both attentions (70 x 32 linear, 20 x 112 cross); Sana-Video 2B: 20 x 112.
    assert sana["num_attention_heads"] * sana["attention_head_dim"] == 2240 == sana["cross_attention_dim"]
    assert sana["num_cross_attention_heads"] * sana["cross_attention_head_dim"] == 2240
    assert video["num_attention_heads"] * video["attention_head_dim"] == 2240 == video["cross_attention_dim"]
    assert ARCHS["sana"].space_stride == 32 and (sana["num_layers"], video["num_layers"]) == (20, 20)


# ---------------------------------------------------------------- Sana-WM and its refiner: refused


def tiny_sana_wm() -> SanaWMTransformer3DModel:
    """diffusers' test-size Sana-WM: a GDN block and a softmax block."""
    torch.manual_seed(0)
    return SanaWMTransformer3DModel(
        in_channels=4, num_layers=2, hidden_size=32, num_attention_heads=2, patch_size=(1, 1, 1), softmax_every_n=2,
        linear_head_dim=16, caption_channels=8, mlp_ratio=2.0, chunk_plucker_channels=8,
        chunk_plucker_post_attn_blocks=2,
    ).eval()  # fmt: skip


def tiny_sana_wm_refiner() -> SanaWMLTX2RefinerTransformer3DModel:
    """diffusers' test-size refiner (LTX-2's blocks, 2 heads x 8)."""
    torch.manual_seed(0)
    return SanaWMLTX2RefinerTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
        audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=2, caption_channels=16,
        rope_double_precision=False,
    ).eval()  # fmt: skip


@pytest.mark.parametrize(
    ("build", "why"),
    [(tiny_sana_wm, "no attention processor for ToMe to wrap"), (tiny_sana_wm_refiner, "KV cache")],
    ids=["sana_wm", "sana_wm_refiner"],
)
def test_sana_wm_and_its_refiner_are_refused_with_the_reason(build, why):
    model = build()
    assert find_family(model) is None and type(model) in REFUSED
    for options in ({"ratio": 0.5}, {"preset": "balanced"}, {}):
        with pytest.raises(ValueError, match=why):
            tp.apply_tome(model, **options)
        assert not tp.is_tome_applied(model)
    with pytest.raises(ValueError, match=why):
        tp.ToMeConfig.from_preset("fast", model)
    with pytest.raises(ValueError, match=why):
        tp.explain_tome(model, 480, 832, num_frames=81, print_table=False)


def test_a_tome_processor_set_on_the_refiner_alone_runs_its_own_attention():
    # Its self-attention is built with the refiner's KV-cache processor, not its class's default: ToMe runs that one.
    model = tiny_sana_wm_refiner()
    rotary = model.build_rotary_emb_for_absolute_positions(
        batch_size=2, frame_positions=[0, 1], height=4, width=4, device="cpu", fps=24.0
    )
    g = torch.Generator().manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(2, 32, 4, generator=g),
        "encoder_hidden_states": torch.randn(2, 8, 16, generator=g),
        "timestep": torch.full((2, 32), 500.0),
        "video_rotary_emb": rotary,
        "encoder_attention_mask": torch.ones(2, 8),
    }
    plain = forward(model, inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # it merges nothing, and says so
        model.set_attn_processor(tp.ToMeProcessor(ratio=0.5))
        assert torch.equal(forward(model, inputs), plain)
