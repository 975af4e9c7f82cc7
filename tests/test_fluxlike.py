"""The FLUX-like successors (`families/fluxlike.py`): Krea 2, FLUX.3, LongCat-Image and -Edit.

What the family table (`tests/test_family_table.py`) does not check on them: the grids, block lists and timesteps
the families read; that reference tokens (FLUX.3's, LongCat-Image-Edit's) and the text pass through the merge
untouched; that Krea 2's padded text stays masked; that FLUX.3's per-mode feed-forward merges with `merge_mlp`.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import Krea2Transformer2DModel

import tome_processors as tp
from tome_processors.families import Layout, Span, Stack, family_of
from tome_processors.families.flux import grid_from_ids, leading_grid_from_ids

from family_cases.fluxlike import (
    TEXT,
    flux3_inputs,
    grid_ids,
    krea2_inputs,
    longcat_inputs,
    tiny_flux3,
    tiny_krea2,
    tiny_longcat,
)

GRID = 6 * 8
KEPT = GRID - int(GRID * 0.5)


def run(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


def test_families_find_the_blocks_grid_and_timestep():
    krea2 = tiny_krea2()
    family = family_of(krea2)
    assert family.name == "krea2" and len(family.blocks(krea2)) == 2  # not the text fusion's blocks
    assert family.token_grid(krea2, (), krea2_inputs()) == (6, 8)  # from position_ids' last 48 rows
    assert float(family.timestep((), krea2_inputs())[0]) == pytest.approx(600.0)
    assert family.generation_marker((), krea2_inputs()) is not None  # position_ids, made once per call

    flux3 = tiny_flux3()
    family = family_of(flux3)
    sites = family.blocks(flux3)
    assert [site.module for site in sites] == [*flux3.mode_blocks["image"], *flux3.single_transformer_blocks]
    assert [site.attentions[0].layout for site in sites] == [Layout.IMAGE_FIRST, Layout.TEXT_FIRST, Layout.TEXT_FIRST]
    assert family.token_grid(flux3, (), flux3_inputs()) == (6, 8)
    reference = flux3_inputs(reference=(4, 4))
    assert family.token_grid(flux3, (), reference) == (6, 8) and family.trailing_tokens((), reference, (6, 8)) == 16
    assert family.trailing_tokens((), flux3_inputs(), (6, 8)) == 0
    assert float(family.timestep((), flux3_inputs())[0]) == pytest.approx(600.0)

    longcat = tiny_longcat()
    family = family_of(longcat)
    assert [site.span for site in family.blocks(longcat)] == [Span.LEADING] * 3
    assert family.token_grid(longcat, (), longcat_inputs()) == (6, 8)  # ids from row and column 512
    edit = longcat_inputs(reference=True)  # the generated image's grid (time 1); the reference's 48 tokens trail
    assert family.token_grid(longcat, (), edit) == (6, 8) and family.trailing_tokens((), edit, (6, 8)) == GRID
    assert float(family.timestep((), longcat_inputs())[0]) == pytest.approx(600.0)


def test_a_stack_reaches_blocks_through_a_dotted_path():
    model = tiny_flux3()
    assert [site.module for site in Stack("mode_blocks.image", Layout.IMAGE).sites(model)] == list(
        model.mode_blocks["image"]
    )
    assert Stack("mode_blocks.video", Layout.IMAGE).sites(model) == []  # no such list: no blocks


def test_grids_from_ids_with_an_offset_and_a_generated_time():
    ids = grid_ids(3, 5, 3, start=512, time=1.0)
    assert grid_from_ids(ids, 15) == (3, 5)
    assert grid_from_ids(torch.cat([ids, ids]), 30) is None  # two images at the same positions: no one grid
    edit = torch.cat([ids, grid_ids(2, 2, 3, time=2.0)])
    assert leading_grid_from_ids(edit, 19, time=1.0) == (3, 5)
    assert leading_grid_from_ids(edit, 19) is None  # no leading tokens at time 0 (FLUX.2's generated image)


def _merges_of_a_forward(model: torch.nn.Module, inputs: dict) -> list:
    """`(rows the attention saw, the merge)` of every merged attention call of one forward with ToMe at 0.5."""
    from tome_processors import joint_attention

    tp.apply_tome(model, ratio=0.5)
    seen = []
    original = joint_attention._call

    def recording(inner, attn, merged, args, kwargs, merge, spec, at):
        seen.append((merged.shape[1], merge))
        return original(inner, attn, merged, args, kwargs, merge, spec, at)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(joint_attention, "_call", recording)
        run(model, inputs)
    tp.remove_tome(model)
    return seen


def _passes_through(merge, lead: int, tail: int) -> None:
    """The `lead` tokens ahead of the grid's and the `tail` after it come out of merge and unmerge as they went in;
    the grid's do not."""
    x = torch.randn(2, lead + GRID + tail, 5)
    out = merge.unmerge(merge.merge(x))
    assert torch.equal(out[:, :lead], x[:, :lead]) and torch.equal(out[:, lead + GRID :], x[:, lead + GRID :])
    assert not torch.equal(out[:, lead : lead + GRID], x[:, lead : lead + GRID])


@pytest.mark.parametrize("reference", [None, (4, 4)], ids=["text-to-image", "reference"])
def test_flux3_merges_the_image_alone(reference):
    # The image's per-mode block sees the image alone; the single-stream blocks the text, the image and the
    # reference image's tokens, of which only the image's are merged.
    tail = reference[0] * reference[1] if reference else 0
    seen = _merges_of_a_forward(tiny_flux3(), flux3_inputs(reference=reference))
    assert [rows for rows, _ in seen] == [KEPT, TEXT + KEPT + tail, TEXT + KEPT + tail]
    for index, (_, merge) in enumerate(seen):
        _passes_through(merge, 0 if index == 0 else TEXT, 0 if index == 0 else tail)


def test_longcat_edit_never_merges_the_reference_image():
    seen = _merges_of_a_forward(tiny_longcat(), longcat_inputs(reference=True))
    assert [rows for rows, _ in seen] == [KEPT + GRID, TEXT + KEPT + GRID, TEXT + KEPT + GRID]  # 1 double, 2 single
    for index, (_, merge) in enumerate(seen):
        _passes_through(merge, 0 if index == 0 else TEXT, GRID)


def test_krea2_merges_the_image_after_the_text():
    seen = _merges_of_a_forward(tiny_krea2(), krea2_inputs())
    assert [rows for rows, _ in seen] == [TEXT + KEPT] * 2
    for _, merge in seen:
        _passes_through(merge, TEXT, 0)


def test_krea2_keeps_padded_text_masked():
    # The second prompt's last two tokens are padding: what they hold changes nothing, with ToMe as without.
    model = tiny_krea2()
    tp.apply_tome(model, ratio=0.5)
    inputs = krea2_inputs()
    out = run(model, inputs)
    changed = dict(inputs, encoder_hidden_states=inputs["encoder_hidden_states"].clone())
    changed["encoder_hidden_states"][1, TEXT - 2 :] += 5.0
    torch.testing.assert_close(run(model, changed), out, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(out, _plain(model, inputs), atol=1e-5)


def _plain(model: Krea2Transformer2DModel, inputs: dict) -> torch.Tensor:
    tp.remove_tome(model)
    return run(model, inputs)


def test_flux3_merges_the_per_mode_feed_forward_with_merge_mlp():
    # The image's per-mode feed-forward takes the attention's input: with `merge_mlp` it runs on the merged rows.
    model, inputs = tiny_flux3(), flux3_inputs()
    plain = run(model, inputs)
    tp.apply_tome(model, ratio=0.5, merge_mlp=True)
    seen = []  # after ToMe's own pre-hook: what the feed-forward gets
    handle = model.mode_blocks["image"][0].ff.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    try:
        merged = run(model, inputs)
    finally:
        handle.remove()
    tp.remove_tome(model)
    assert seen == [KEPT] and not torch.allclose(merged, plain, atol=1e-5)
    assert torch.equal(run(model, inputs), plain)


def test_apply_tome_refuses_k_v_pooling():
    for build in (tiny_krea2, tiny_flux3, tiny_longcat):
        with pytest.raises(ValueError, match='Expected mode="merge"'):
            tp.apply_tome(build(), mode="downsample_kv")


@pytest.mark.parametrize("arch", ["krea2", "flux3", "longcat_image"])
def test_bench_architectures_build_and_merge_as_their_pipelines_call_them(arch):
    from tome_processors.bench.dit import TEXT_TOKENS, build_transformer, make_transformer_inputs

    assert TEXT_TOKENS[arch] == 512
    model = build_transformer(arch, quick=True)
    family = family_of(model)
    assert family.name == arch and len(family.blocks(build_transformer(arch, quick=True, layers=1))) < len(
        family.blocks(model)
    )
    inputs = make_transformer_inputs(model, arch, batch=2, resolution=96, text_tokens=9)  # 6 x 6 tokens
    assert family.token_grid(model, (), inputs.kwargs) == (6, 6)
    plain = inputs.run(model)
    tp.apply_tome(model, ratio=0.5)
    merged = inputs.run(model)
    assert merged.shape == plain.shape and torch.isfinite(merged).all() and not torch.allclose(merged, plain)
