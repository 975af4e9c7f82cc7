"""HunyuanImage 2.1 and HiDream-I1 beyond the family table (tests/family_cases/hyimage_hidream.py).

HiDream pads a non-square grid to `max_resolution`'s token count and masks the padding's keys: the mask each merged
attention gets lines up with the merged rows (ones over the grid's kept rows, zeros over the padding, ones over the
text), and the padding and the text pass through as rows of their own. Its rotary tables cover the image then the
text: merged rows take their kept token's rows, the text its own. Each sample keeps its own merge (the Llama stack's
batch is its second axis, which the table's split does not cut). HunyuanImage's mask keeps the prompt's padding
masked. The families read the grid, the timestep and the blocks the models hold.
"""

from __future__ import annotations

import pytest
import torch

import tome_processors as tp
from tome_processors import joint_attention
from tome_processors.bench.archs import ARCHS
from tome_processors.bench.dit import build_transformer, make_transformer_inputs
from tome_processors.families import Layout, Span, family_of

from family_cases.hyimage_hidream import (
    HD_LLAMA,
    TEXT,
    hidream_inputs,
    hunyuanimage_inputs,
    hunyuanimage_refiner_inputs,
    tiny_hidream,
    tiny_hunyuanimage,
    tiny_hunyuanimage_refiner,
)

GRID, PADDED = 6 * 8, 64  # the 6 x 8 grid's tokens, and `tiny_hidream`'s `max_resolution` (16 x 16 px over 2 x 2)
HD_TEXT = TEXT + 2 * HD_LLAMA  # T5's, the last Llama layer's and each block's own Llama tokens
KEPT = GRID - int(GRID * 0.5)


def run(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample


def merged_calls(model: torch.nn.Module, inputs: dict, **options) -> tuple[list, torch.Tensor]:
    """`(kwargs the inner processor got, the merge, rows it got)` of every merged attention call of one forward
    with ToMe at 0.5, and the model's rotary table of that forward."""
    tp.apply_tome(model, ratio=0.5, **options)
    seen, tables = [], []
    handle = model.pe_embedder.register_forward_hook(lambda module, args, out: tables.append(out))
    original = joint_attention._call

    def recording(inner, attn, merged, args, kwargs, merge, spec, at, after=0):
        def called(attn, hidden_states, *args, **kwargs):  # what the inner processor gets
            seen.append((kwargs, merge, hidden_states.shape[1]))
            return inner(attn, hidden_states, *args, **kwargs)

        return original(called, attn, merged, args, kwargs, merge, spec, at, after)

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(joint_attention, "_call", recording)
            run(model, inputs)
    finally:
        handle.remove()
        tp.remove_tome(model)
    return seen, tables[0]


def hidream_sample(inputs: dict, b: int) -> dict:
    """Sample `b` of HiDream's inputs: the Llama stack `(layers, B, tokens, C)` is cut along its second axis."""
    one = {key: value[b : b + 1] for key, value in inputs.items()}
    one["encoder_hidden_states_llama3"] = inputs["encoder_hidden_states_llama3"][:, b : b + 1]
    return one


@pytest.mark.parametrize(("h", "w"), [(6, 8), (6, 6)])
def test_hidream_each_sample_keeps_its_own_merge(h, w):
    # Padded and masked (6 x 8) or not (6 x 6): a batch of two equals two batches of one (`use_rand=False`).
    model, inputs = tiny_hidream(), hidream_inputs(2, h, w)
    tp.apply_tome(model, ratio=0.5, use_rand=False)
    both = run(model, inputs)
    for b in range(2):
        torch.testing.assert_close(run(model, hidream_sample(inputs, b))[0], both[b], rtol=1e-4, atol=1e-5)


def test_hidream_padding_mask_lines_up_with_the_merged_rows():
    model, inputs = tiny_hidream(), hidream_inputs()  # 6 x 8 tokens, padded to 64
    seen, _ = merged_calls(model, inputs)
    rows = KEPT + PADDED - GRID  # the grid's kept rows, then the padding's
    assert [rows for _, _, rows in seen] == [rows, rows + HD_TEXT, rows + HD_TEXT]  # and the text's, single-stream
    double = torch.cat([torch.ones(KEPT), torch.zeros(PADDED - GRID)])
    single = torch.cat([double, torch.ones(HD_TEXT)])
    for (kwargs, merge, rows), expected in zip(seen, (double, single, single), strict=True):
        mask = kwargs["hidden_states_masks"]
        assert mask.shape == (2, rows) and torch.equal(mask, expected.expand(2, -1))
        # The padding (and the text) come out of merge and unmerge as they went in; the grid's tokens do not.
        x = torch.randn(2, merge.num_tokens, 3)
        out = merge.unmerge(merge.merge(x))
        assert torch.equal(out[:, GRID:], x[:, GRID:]) and not torch.equal(out[:, :GRID], x[:, :GRID])


def test_hidream_rotary_rows_follow_the_merged_rows_and_the_text_keeps_its_own():
    model, inputs = tiny_hidream(), hidream_inputs()
    seen, table = merged_calls(model, inputs)
    assert table.shape[:2] == (2, PADDED + HD_TEXT)
    samples = torch.arange(2)[:, None]
    assert [merge.num_tokens for _, merge, _ in seen] == [PADDED, PADDED + HD_TEXT, PADDED + HD_TEXT]
    for kwargs, merge, _ in seen:
        got = kwargs["image_rotary_emb"]
        after = table.shape[1] - merge.num_tokens  # the double-stream text's, after the merged rows
        assert got.shape == (2, merge.num_rows + after, *table.shape[2:])
        # The merged rows: each at its kept token's row of the table (a padded token at its own).
        assert torch.equal(got[:, : merge.num_rows], table[samples, merge.row_token])
        # The text after them: its own rows, as they are.
        assert torch.equal(got[:, merge.num_rows :], table[:, merge.num_tokens :])


def test_hidream_merge_mlp_merges_the_experts_feed_forward_of_both_kinds_of_block():
    model, inputs = tiny_hidream(), hidream_inputs()
    tokens = []
    handles = [  # the gate inside each feed-forward: what the experts get, after ToMe's hook on `ff_i`
        block.block.ff_i.gate.register_forward_pre_hook(lambda module, args: tokens.append(args[0].shape[1]))
        for block in [*model.double_stream_blocks, *model.single_stream_blocks]
    ]
    plain = run(model, inputs)
    assert tokens == [PADDED, PADDED + HD_TEXT, PADDED + HD_TEXT]
    tokens.clear()
    tp.apply_tome(model, ratio=0.5, merge_mlp=True)
    merged = run(model, inputs)
    assert tokens == [KEPT + PADDED - GRID, KEPT + PADDED - GRID + HD_TEXT, KEPT + PADDED - GRID + HD_TEXT]
    assert torch.isfinite(merged).all() and not torch.allclose(merged, plain, atol=1e-5)
    tp.remove_tome(model)
    for handle in handles:
        handle.remove()
    assert torch.equal(run(model, inputs), plain)


def test_hidream_merges_nothing_in_a_patchified_call():
    # `(B, N, C)` tokens with their mask, ids and sizes (the model's own patchify): no latent, no grid to read.
    model = tiny_hidream()
    latent = hidream_inputs()["hidden_states"]
    tokens, masks, sizes, ids = model.patchify(latent)
    inputs = {**hidream_inputs(), "hidden_states": tokens, "hidden_states_masks": masks}
    inputs |= {"img_sizes": sizes, "img_ids": ids}
    plain = run(model, inputs)
    tp.apply_tome(model, ratio=0.5)
    with pytest.warns(UserWarning, match="ToMe"):
        assert torch.equal(run(model, inputs), plain)
    assert family_of(model).token_grid(model, (), inputs) is None


def test_hunyuanimage_keeps_the_prompt_padding_masked():
    # The mask (ones over the image, then the prompt's) is cut at its start: the padded prompt tokens stay masked
    # keys, so what they hold changes nothing, merged or not.
    model, inputs = tiny_hunyuanimage(), hunyuanimage_inputs()
    changed = dict(inputs, encoder_hidden_states=inputs["encoder_hidden_states"].clone())
    changed["encoder_hidden_states"][:, -2:] += 5.0
    torch.testing.assert_close(run(model, changed), run(model, inputs), rtol=1e-4, atol=1e-5)
    tp.apply_tome(model, ratio=0.5)
    out = run(model, inputs)
    torch.testing.assert_close(run(model, changed), out, rtol=1e-4, atol=1e-5)
    tp.remove_tome(model)
    assert not torch.allclose(out, run(model, inputs), atol=1e-5)


def test_families_find_the_blocks_grid_and_timestep():
    model = tiny_hunyuanimage()
    family = family_of(model)
    assert family.name == "hunyuanimage" and family.merge_only and not family.guidance_in_batch
    sites = family.blocks(model)
    assert [s.attentions[0].layout for s in sites] == [Layout.JOINT_IMAGE_FIRST] * 3  # never the token refiner
    assert [s.feed_forward for s in sites] == [model.transformer_blocks[0].ff, None, None]
    assert family.token_grid(model, (), hunyuanimage_inputs(h=5, w=7)) == (5, 7)
    assert float(family.timestep((), hunyuanimage_inputs(batch=1))[0]) == pytest.approx(600.0)
    refiner = tiny_hunyuanimage_refiner()
    assert family.token_grid(refiner, (), hunyuanimage_refiner_inputs(h=5, w=7)) == (5, 7)
    two_frames = hunyuanimage_refiner_inputs()
    two_frames["hidden_states"] = two_frames["hidden_states"].repeat(1, 1, 2, 1, 1)
    assert family.token_grid(refiner, (), two_frames) is None  # an image model: one frame

    model = tiny_hidream()
    family = family_of(model)
    assert family.name == "hidream" and family.merge_only and family.guidance_in_batch
    sites = family.blocks(model)
    blocks = [*model.double_stream_blocks, *model.single_stream_blocks]
    assert [s.module for s in sites] == blocks and [s.span for s in sites] == [Span.LEADING] * 3
    assert [s.attentions[0].module for s in sites] == [b.block.attn1 for b in blocks]
    assert [s.attentions[0].layout for s in sites] == [Layout.JOINT_IMAGE_FIRST, Layout.IMAGE_FIRST, Layout.IMAGE_FIRST]
    assert [s.feed_forward for s in sites] == [b.block.ff_i for b in blocks]
    assert family.token_grid(model, (), hidream_inputs(h=5, w=7)) == (5, 7)
    # Its pipeline passes `timesteps` (a view of the schedule: a generation marker).
    schedule = torch.tensor([1000.0, 600.0])
    call = {"timesteps": schedule[1].expand(2)}
    assert torch.equal(family.timestep((), call), torch.full((2,), 600.0))
    assert family.generation_marker((), call) is call["timesteps"]


@pytest.mark.parametrize("build", [tiny_hunyuanimage, tiny_hidream])
def test_k_v_pooling_is_refused(build):
    with pytest.raises(ValueError, match='Expected mode="merge"'):
        tp.apply_tome(build(), mode="downsample_kv")


@pytest.mark.parametrize("arch", ["hunyuanimage", "hidream"])
def test_bench_builds_each_architecture_with_fewer_layers(arch):
    model = build_transformer(arch, quick=True, layers=1)
    assert family_of(model).name == arch
    assert (model.config.num_layers, model.config.num_single_layers) == (1, 1)
    inputs = make_transformer_inputs(model, arch, batch=2, resolution=128, text_tokens=5, quick=True)
    plain = inputs.run(model)
    tp.apply_tome(model, ratio=0.5)
    merged = inputs.run(model)
    assert merged.shape == plain.shape and torch.isfinite(merged).all() and not torch.equal(merged, plain)


def test_hidream_bench_config_projects_one_llama_layer_per_block():
    # The published config names a Llama layer for each of its 48 blocks; a shallower model keeps the first ones.
    arch = ARCHS["hidream"]
    assert arch.derived(arch.full)["llama_layers"] == arch.full["llama_layers"] and len(arch.full["llama_layers"]) == 48
    capped = dict(arch.full, num_layers=1, num_single_layers=1)
    assert arch.derived(capped)["llama_layers"] == (0, 1)
    assert list(build_transformer("hidream", quick=True, layers=1).config.llama_layers) == [0, 1]


def test_explain_tome_counts_the_released_models_tokens_from_pixels():
    # HunyuanImage 2.1: 32 px per token (its VAE's 32x, patch 1); HiDream-I1: 16 (the FLUX VAE's 8x, patch 2).
    for model, (height, width) in ((tiny_hunyuanimage(), (2048, 1536)), (tiny_hidream(), (1024, 768))):
        rows = tp.explain_tome(model, height, width, preset="balanced", print_table=False)
        assert [(row.tokens, row.blocks) for row in rows] == [(64 * 48, 3)]
