"""The CogVideoX lineage beyond the family table (tests/family_cases/cog.py): what each family reads from its
model's call, CogView 4's mask over the text, the feed-forwards `merge_mlp` leaves alone, CogView 4's host-made
rotary tables, `explain_tome` on CogVideoX 1.5's two latent frames a token, and the bench's architectures (their
published configs checked at the real size on the meta device)."""

from __future__ import annotations

import warnings

import pytest
import torch

import tome_processors as tp
from tome_processors.batched_rotary import SampleTables, sample_tables
from tome_processors.bench.archs import ARCHS
from tome_processors.bench.dit import build_transformer, make_transformer_inputs
from tome_processors.families import Layout, family_of
from tome_processors.joint_attention import _merged_rotary
from tome_processors.merge import bipartite_soft_matching_2d

from family_cases import CASES
from family_cases.cog import (
    FRAMES,
    HEAD_DIM,
    HEADS,
    TEXT,
    H,
    W,
    cogvideox_inputs,
    cogview_inputs,
    tiny_cogvideox,
    tiny_cogview4,
)


def forward(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample


@pytest.mark.parametrize(
    ("name", "grid", "in_batch"),
    [
        ("cogvideox", (FRAMES, H, W), True),
        ("cogvideox-2b", (FRAMES, H, W), True),
        ("cogvideox15", (FRAMES, H, W), True),  # 4 latent frames, 2 a token
        ("consisid", (FRAMES, H, W), True),
        ("cogview3plus", (H, W), True),
        ("cogview4", (H, W), False),
    ],
)
def test_each_family_reads_its_grid_blocks_and_timestep(name, grid, in_batch):
    case = CASES[name]
    model = case.build()
    family = family_of(model)
    inputs = case.inputs()
    assert family.token_grid(model, (), inputs) == grid
    assert family.video == (len(grid) == 3) and family.guidance_in_batch is in_batch
    sites = family.blocks(model)
    assert [site.module for site in sites] == list(model.transformer_blocks)
    for site, block in zip(sites, model.transformer_blocks, strict=True):
        (attention,) = site.attentions
        assert attention.module is block.attn1 and attention.layout is Layout.JOINT and not attention.is_cross
        assert site.feed_forward is None  # over text and image together, or called on each apart: never merged
    assert torch.equal(family.timestep((), inputs), inputs["timestep"])  # the scheduler's 0..1000, as it is
    assert family.merge_only
    with pytest.raises(ValueError, match='Expected mode="merge"'):
        tp.apply_tome(model, mode="downsample_kv")


def test_cogview4_mask_over_the_text_passes_as_it_is():
    # The processor takes a (B, text) mask and opens the image tokens itself: a mask of every text token merges as
    # no mask does (a wrongly cut mask would not fit the processor's text).
    model = tiny_cogview4()
    inputs = cogview_inputs()
    tp.apply_tome(model, ratio=0.5, use_rand=False)
    unmasked = forward(model, inputs)
    masked = forward(model, {**inputs, "attention_mask": torch.ones(2, TEXT, dtype=torch.long)})
    tp.remove_tome(model)
    assert torch.allclose(masked, unmasked, atol=1e-6)
    assert not torch.allclose(forward(model, inputs), unmasked, atol=1e-5)  # and it merged


@pytest.mark.parametrize("name", ["cogvideox", "cogview3plus", "cogview4"])
def test_merge_mlp_leaves_the_feed_forward_alone_and_says_nothing(name):
    # CogVideoX's and CogView 3 Plus's feed-forward runs on text and image together; CogView 4's on each apart.
    case = CASES[name]
    model = case.build()
    inputs = case.inputs()
    tp.apply_tome(model, ratio=0.5, use_rand=False)
    attention_only = forward(model, inputs)
    tp.remove_tome(model)
    tp.apply_tome(model, ratio=0.5, use_rand=False, merge_mlp=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(forward(model, inputs), attention_only)
    tp.remove_tome(model)


def test_cogview4_tables_made_on_the_host_are_gathered_on_the_merges_device():
    # CogView 4 builds its rotary tables on the host whatever the model's device: the merged rows' positions are not
    # read back to gather them (here the merge's device is `meta`, which holds no values to read).
    cos, sin = tiny_cogview4().rope(cogview_inputs()["hidden_states"])
    assert cos.device.type == "cpu" and cos.shape == (H * W, 8)
    row_token = torch.randint(0, H * W, (2, 20), device="meta")
    gathered = sample_tables((cos, sin), row_token)
    assert all(isinstance(t, SampleTables) and t.table.device.type == "meta" for t in gathered)
    assert gathered[0].table.shape == (2, 20, 8)


def test_cogview4_tables_per_sample_follow_the_merge_for_other_processors():
    # A processor not known to take a table per sample gets each sample's rows, gathered on the merge's device.
    cos, sin = tiny_cogview4().rope(cogview_inputs()["hidden_states"])
    spec = family_of(tiny_cogview4()).rotary
    metric = torch.randn(2, H * W, 8)
    merge = bipartite_soft_matching_2d(metric, H, W, 2, 2, H * W // 2, with_row_token=True)
    per_sample = _merged_rotary(spec, (cos, sin), merge)
    assert len(per_sample) == 2
    for b, (cos_b, sin_b) in enumerate(per_sample):
        assert torch.equal(cos_b, cos[merge.row_token[b]]) and torch.equal(sin_b, sin[merge.row_token[b]])
    on_meta = bipartite_soft_matching_2d(metric.to("meta"), H, W, 2, 2, H * W // 2, with_row_token=True)
    assert all(t.device.type == "meta" for tables in _merged_rotary(spec, (cos, sin), on_meta) for t in tables)


@pytest.mark.parametrize(("num_frames", "token_frames"), [(13, 2), (9, 2), (17, 3)])
def test_explain_counts_cogvideox15_token_frames(num_frames, token_frames):
    # 1 + (F - 1) / 4 latent frames, padded to an even number by the pipelines, 2 a token.
    model = tiny_cogvideox(patch_size_t=2)
    rows = tp.explain_tome(model, 16 * H, 16 * W, num_frames=num_frames, preset="balanced", print_table=False)
    assert {row.tokens for row in rows if row.level == 1} == {token_frames * H * W}
    inputs = cogvideox_inputs(patch_size_t=2)
    assert family_of(model).token_grid(model, (), inputs) == (FRAMES, H, W)
    one_zero = tiny_cogvideox()  # 1.0: one latent frame a token
    rows = tp.explain_tome(one_zero, 16 * H, 16 * W, num_frames=num_frames, preset="balanced", print_table=False)
    assert {row.tokens for row in rows if row.level == 1} == {(1 + (num_frames - 1) // 4) * H * W}


@pytest.mark.parametrize("arch", ["cogvideox", "consisid", "cogview3plus", "cogview4"])
def test_bench_architectures_build_and_merge_as_their_pipelines_call_them(arch):
    model = build_transformer(arch, quick=True)
    family = family_of(model)
    assert family.name == arch and len(family.blocks(build_transformer(arch, quick=True, layers=1))) == 1
    inputs = make_transformer_inputs(model, arch, batch=2, resolution=96, width=128, frames=5, text_tokens=9)
    assert family.token_grid(model, (), inputs.kwargs)[-2:] == ((6, 8) if family.video else (6, 6))
    plain = inputs.run(model)
    tp.apply_tome(model, ratio=0.5)
    merged = inputs.run(model)
    assert merged.shape == plain.shape and torch.isfinite(merged).all() and not torch.allclose(merged, plain)


@pytest.mark.parametrize(
    ("arch", "tokens", "text"),
    [("cogvideox", 13 * 30 * 45, 226), ("consisid", 13 * 30 * 45, 226), ("cogview4", 64 * 64, 256)],
)
def test_bench_full_configs_take_their_pipelines_inputs_at_the_real_size(arch, tokens, text):
    # On the meta device (shapes only): the real width, 480 x 720 px and 49 frames (13 latent frames) for the videos,
    # 1024 px for CogView 4; ToMe at 0.5 halves the image tokens every joint attention gets after the prompt's.
    model = build_transformer(arch, layers=2, device="meta")
    assert model.config.num_attention_heads * model.config.attention_head_dim in (3072, 4096)
    inputs = make_transformer_inputs(model, arch, 2, 480 if family_of(model).video else 1024, device="meta")
    assert int(torch.tensor(family_of(model).token_grid(model, (), inputs.kwargs)).prod()) == tokens
    tp.apply_tome(model, ratio=0.5)
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, value, *args, **kwargs):
        calls.append(int(query.shape[-2]))
        return sdpa(query, key, value, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
        out = inputs.run(model)
    assert out.shape[0] == 2 and calls == [text + tokens // 2] * 2


def test_consisid_bench_config_keeps_a_perceiver_for_every_block_that_calls_one():
    # The model calls a perceiver after blocks 0, interval, 2 x interval, ... and makes num_layers // interval of them.
    arch = ARCHS["consisid"]
    assert arch.derived(arch.full) == arch.full and arch.full["num_layers"] % arch.full["cross_attn_interval"] == 0
    assert arch.derived(dict(arch.full, num_layers=3))["cross_attn_interval"] == 1
    model = build_transformer("consisid", quick=True, layers=1)
    assert len(model.perceiver_cross_attention) == 1


def test_cogvideox_fused_projections_keep_merging_the_whole_batch_in_one_call():
    # `fuse_qkv_projections()` (diffusers' advice for CogVideoX's speed) sets FusedCogVideoXAttnProcessor2_0, which
    # ToMe wraps again and gives a rotary table per sample: one attention call a block for the batch, as unfused.
    model, inputs = tiny_cogvideox(), cogvideox_inputs()
    tp.apply_tome(model, ratio=0.5, use_rand=False)
    unfused = forward(model, inputs)
    model.fuse_qkv_projections()
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(query, key, value, *args, **kwargs):
        calls.append(tuple(query.shape))
        return sdpa(query, key, value, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
        fused = forward(model, inputs)
    assert calls == [(2, HEADS, TEXT + FRAMES * H * W // 2, HEAD_DIM)] * 2
    torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-5)
    model.unfuse_qkv_projections()
    tp.remove_tome(model)
