"""JoyImage-Edit (and Plus), OmniGen, Motif-Video, AnyFlow and DreamLite beyond the family table
(tests/family_cases/edit_more.py): the blocks, grids and timesteps each family reads; reference and input images' tokens
never merge; the rotary tables follow each sample's merged rows as one call per sample with plain tables does; masks
cut to the merged rows still mask what they masked; and AnyFlow's FAR transformer is refused with its reason.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from diffusers import AnyFlowFARTransformer3DModel, DreamLiteTransformer2DModel
from diffusers.models.transformers.transformer_joyimage import JoyImageAttnProcessor
from diffusers.models.transformers.transformer_motif_video import MotifVideoAttnProcessor2_0
from diffusers.models.transformers.transformer_omnigen import OmniGenAttnProcessor2_0

import tome_processors as tp
from tome_processors import joint_attention
from tome_processors.batched_rotary import SampleTables
from tome_processors.families import REFUSED, Layout, family_of
from tome_processors.merge import bipartite_soft_matching_2d
from tome_processors.rotary_attention import merged_rotations

from family_cases.edit_more import (
    TEXT,
    H,
    W,
    anyflow_inputs,
    dreamlite_inputs,
    joyimage_inputs,
    joyimage_plus_inputs,
    motif_video_inputs,
    omnigen_inputs,
    tiny_anyflow,
    tiny_dreamlite,
    tiny_joyimage,
    tiny_joyimage_plus,
    tiny_motif_video,
    tiny_omnigen,
)

GRID = H * W
KEPT = GRID - GRID // 2  # the generated image's rows at ratio 0.5


def run(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample


def test_families_find_the_blocks_grid_and_timestep():
    joy, plus, omnigen = tiny_joyimage(), tiny_joyimage_plus(), tiny_omnigen()
    motif, anyflow, dreamlite = tiny_motif_video(), tiny_anyflow(), tiny_dreamlite()
    image_first = [(Layout.JOINT_IMAGE_FIRST, False)]
    expected = [
        (joy, joyimage_inputs(), "joyimage_edit", list(joy.double_blocks), image_first, (H, W)),
        (plus, joyimage_plus_inputs(), "joyimage_edit_plus", list(plus.double_blocks), image_first, (H, W)),
        (omnigen, omnigen_inputs(), "omnigen", list(omnigen.layers), [(Layout.TEXT_FIRST, False)], (H, W)),
        (motif, motif_video_inputs(), "motif_video", [*motif.transformer_blocks, *motif.single_transformer_blocks],
         image_first, (2, H, W)),
        (anyflow, anyflow_inputs(), "anyflow", list(anyflow.blocks), [(Layout.ROTARY, False), (Layout.IMAGE, True)],
         (2, H, W)),
        (dreamlite, dreamlite_inputs(), "dreamlite", list(dreamlite.transformer_blocks),
         [(Layout.IMAGE, False), (Layout.IMAGE, True)], (H, W)),
    ]  # fmt: skip
    for model, inputs, name, blocks, layouts, grid in expected:
        family = family_of(model)
        sites = family.blocks(model)
        assert family.name == name and [site.module for site in sites] == blocks
        assert all([(a.layout, a.is_cross) for a in site.attentions] == layouts for site in sites), name
        assert family.token_grid(model, (), inputs) == grid, name
    # The timesteps on the 0..1000 noise scale: OmniGen's `t` runs from 0 (noise) to 1; AnyFlow's is one per frame.
    assert family_of(omnigen).timestep((), omnigen_inputs()).tolist() == pytest.approx([600.0, 600.0])
    inputs = anyflow_inputs()
    inputs["timestep"][:, 0] = 0.0  # a video's context frame
    assert family_of(anyflow).timestep((), inputs).tolist() == [500.0, 500.0]
    assert family_of(joy).timestep((), joyimage_inputs()).tolist() == [500.0, 500.0]
    # Motif-Video's shared cross-attention (queries: the block's attention output) is not declared.
    declared = {a.module for site in family_of(motif).blocks(motif) for a in site.attentions}
    assert motif.single_transformer_blocks[0].cross_attn not in declared


def test_joyimage_edit_has_no_grid_for_a_clip_of_several_frames():
    model, inputs = tiny_joyimage(), joyimage_inputs(items=1)
    inputs["hidden_states"] = inputs["hidden_states"].repeat(1, 1, 1, 2, 1, 1)  # 2 frames an item
    assert family_of(model).token_grid(model, (), inputs) is None
    plain = run(model, inputs)
    tp.apply_tome(model, ratio=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ToMe says it merged nothing
        assert torch.equal(run(model, inputs), plain)


def _merges_of_a_forward(model: torch.nn.Module, inputs: dict) -> list:
    """`(rows the attention saw, the merge)` of every merged joint attention call of one forward with ToMe 0.5."""
    tp.apply_tome(model, ratio=0.5)
    seen = []
    original = joint_attention._call

    def recording(inner, attn, merged, args, kwargs, merge, spec, *where):
        seen.append((merged.shape[1], merge))
        return original(inner, attn, merged, args, kwargs, merge, spec, *where)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(joint_attention, "_call", recording)
        run(model, inputs)
    tp.remove_tome(model)
    return seen


@pytest.mark.parametrize("name", ["joyimage_edit", "joyimage_edit_plus", "omnigen_edit"])
def test_reference_tokens_pass_through_as_rows_of_their_own(name):
    # JoyImage-Edit's reference image (after the generated image's 48 tokens), JoyImage-Edit Plus's references and
    # padding patches, OmniGen's input image and prompt (ahead of the generated image's): each comes out of merge and
    # unmerge as it went in, whatever the generated image's tokens do.
    if name == "joyimage_edit":
        model, inputs, lead, tail = tiny_joyimage(), joyimage_inputs(), 0, GRID
    elif name == "joyimage_edit_plus":
        model, inputs = tiny_joyimage_plus(), joyimage_plus_inputs()
        lead, tail = 0, inputs["hidden_states"].shape[1] - GRID
    else:
        model, inputs = tiny_omnigen(), omnigen_inputs(reference=(2, 2))
        lead, tail = TEXT + 4 + 1, 0  # the prompt with the image's 4 tokens, and the time token
    seen = _merges_of_a_forward(model, inputs)
    assert len(seen) == 2  # both blocks
    for rows, merge in seen:
        assert rows == lead + KEPT + tail
        x = torch.randn(2, lead + GRID + tail, 5)
        out = merge.unmerge(merge.merge(x))
        assert torch.equal(out[:, :lead], x[:, :lead]) and torch.equal(out[:, lead + GRID :], x[:, lead + GRID :])
        assert not torch.equal(out[:, lead : lead + GRID], x[:, lead : lead + GRID])


class OwnJoy(JoyImageAttnProcessor):
    """A subclass: not known to take `SampleTables`, so it runs one sample at a time with plain tables."""


class OwnMotif(MotifVideoAttnProcessor2_0):
    pass


class OwnOmniGen(OmniGenAttnProcessor2_0):
    pass


@pytest.mark.parametrize("name", ["joyimage_edit", "joyimage_edit_mrope", "motif_video", "omnigen"])
def test_each_samples_rotary_rows_in_one_call_match_one_call_per_sample(name, one_thread):
    # The batch in one call (`SampleTables`; JoyImage-Edit's nested `((cos, sin), text)`) against the same merges run
    # one sample at a time with each sample's plain tables.
    build, inputs, own = {
        "joyimage_edit": (tiny_joyimage, joyimage_inputs(), OwnJoy),
        "joyimage_edit_mrope": (lambda: tiny_joyimage("mrope"), joyimage_inputs(), OwnJoy),
        "motif_video": (tiny_motif_video, motif_video_inputs(), OwnMotif),
        "omnigen": (tiny_omnigen, omnigen_inputs(), OwnOmniGen),
    }[name]
    model = build()
    tp.apply_tome(model, ratio=0.5, use_rand=False)
    batched = run(model, inputs)
    tp.remove_tome(model)
    plain = run(model, inputs)
    for site in family_of(model).blocks(model):
        for attention in site.attentions:
            attention.module.set_processor(own())
    tp.apply_tome(model, ratio=0.5, use_rand=False)
    torch.testing.assert_close(run(model, inputs), batched, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(batched, plain, atol=1e-4)  # ToMe changed the output: the comparison means something


def test_omnigen_attends_with_the_merged_rows_as_keys_too():
    # OmniGen's blocks call their attention with the same tokens as `hidden_states` and `encoder_hidden_states`: both
    # are the merged rows, so the mask, cut to them, lines up with queries and keys.
    model, inputs = tiny_omnigen(), omnigen_inputs()
    seen = []
    original = OmniGenAttnProcessor2_0.__call__

    def recording(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None):
        seen.append((hidden_states.shape[1], encoder_hidden_states.shape[1], tuple(attention_mask.shape[-2:])))
        return original(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)

    tp.apply_tome(model, ratio=0.5)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(OmniGenAttnProcessor2_0, "__call__", recording)
        run(model, inputs)
    rows = TEXT + 1 + KEPT
    assert seen == [(rows, rows, (rows, rows))] * 2


def test_omnigen_merges_nothing_where_the_mask_does_not_line_up():
    # A mask whose generated image's columns differ within a row (a padding patch masked, as OmniGen's collator does
    # for a smaller image in the batch) cannot be cut: nothing is merged, and a warning says so.
    model, inputs = tiny_omnigen(), omnigen_inputs()
    inputs["attention_mask"][:, :, -1] = 0
    plain = run(model, inputs)
    tp.apply_tome(model, ratio=0.5)
    with pytest.warns(UserWarning, match="ToMe merges nothing in this OmniGenTransformer2DModel call"):
        assert torch.equal(run(model, inputs), plain)


def test_joyimage_edit_plus_mask_still_masks_text_and_padding_patches():
    # The mask covers the image tokens then the text: the second sample's padding patches and its last two text
    # tokens are masked. Cut to the merged rows it must still mask exactly those: changing them changes nothing else.
    model, inputs = tiny_joyimage_plus(), joyimage_plus_inputs()
    tp.apply_tome(model, ratio=0.5)
    out = run(model, inputs)
    changed = {**inputs, "hidden_states": inputs["hidden_states"].clone()}
    changed["encoder_hidden_states"] = inputs["encoder_hidden_states"].clone()
    valid = GRID + 2 * 4  # the second sample's generated image and its 2 x 4 reference
    changed["hidden_states"][1, valid:] += 5.0
    changed["encoder_hidden_states"][1, TEXT - 2 :] += 5.0
    torch.testing.assert_close(run(model, changed)[:, :valid], out[:, :valid], rtol=1e-4, atol=1e-5)


def test_anyflow_gathers_its_query_and_key_tables_once():
    # AnyFlow passes `{"query": f, "key": f}`, one complex `(1, 1, N, D/2)` table twice: each sample's merged rows
    # get their kept tokens' rotations, `(B, 1, M, D/2)`, gathered once for both.
    model, inputs = tiny_anyflow(), anyflow_inputs()
    seen = []
    processor_class = type(model.blocks[0].attn1.processor)
    original = processor_class.__call__

    def recording(self, attn, hidden_states, *args, **kwargs):
        seen.append((hidden_states.shape[1], kwargs.get("rotary_emb")))
        return original(self, attn, hidden_states, *args, **kwargs)

    tp.apply_tome(model, ratio=0.5)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(processor_class, "__call__", recording)
        run(model, inputs)
    assert len(seen) == 2
    tokens = 2 * GRID
    for rows, rotary in seen:
        assert rows < tokens
        assert rotary["query"] is rotary["key"] and tuple(rotary["query"].shape[:3]) == (2, 1, rows)
    table = torch.polar(torch.ones(1, 1, 4, 3), torch.arange(12.0).view(1, 1, 4, 3))
    merge = bipartite_soft_matching_2d(torch.eye(4)[None], 1, 4, 2, 1, 1, with_row_token=True)
    rows = merged_rotations(table, merge, heads_axis=True)
    assert rows.shape == (1, 1, 3, 3) and torch.equal(rows[0, 0], table[0, 0, merge.row_token[0]])


def test_dreamlite_declares_only_the_attentions_a_block_has():
    # DreamLite's "remove self-attention" blocks have no `attn1`: only the cross-attention is declared.
    torch.manual_seed(0)
    model = DreamLiteTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=16, num_layers=1, norm_num_groups=8,
        cross_attention_dim=16, use_self_attention=False,
    ).eval()  # fmt: skip
    (site,) = family_of(model).blocks(model)
    assert [(a.module, a.is_cross) for a in site.attentions] == [(model.transformer_blocks[0].attn2, True)]


def test_joint_families_refuse_k_v_pooling():
    for build in (tiny_joyimage, tiny_joyimage_plus, tiny_omnigen, tiny_motif_video, tiny_anyflow):
        with pytest.raises(ValueError, match='Expected mode="merge"'):
            tp.apply_tome(build(), mode="downsample_kv")


def test_anyflow_far_is_refused_with_its_reason():
    torch.manual_seed(0)
    model = AnyFlowFARTransformer3DModel(
        patch_size=(1, 2, 2), compressed_patch_size=(1, 4, 4), full_chunk_limit=3, num_attention_heads=2,
        attention_head_dim=12, in_channels=4, out_channels=4, text_dim=16, freq_dim=32, ffn_dim=32, num_layers=1,
        rope_max_seq_len=32,
    )  # fmt: skip
    assert "flex attention under a BlockMask" in REFUSED[AnyFlowFARTransformer3DModel]
    for call in (family_of, tp.apply_tome, lambda model: tp.explain_tome(model, 64, 64)):
        with pytest.raises(ValueError, match=r"got AnyFlowFARTransformer3DModel: its causal self-attention"):
            call(model)


def test_sample_tables_refuse_other_views():
    tables = SampleTables(torch.zeros(2, 5, 4))
    assert tables.view(1, 5, 1, 4).shape == (2, 5, 1, 4)
    with pytest.raises(TypeError, match=r"Expected the view \(1, S, 1, D\) .* but got view\(1, 1, 5, 4\)"):
        tables.view(1, 1, 5, 4)


@pytest.mark.parametrize(
    "arch", ["joyimage_edit", "joyimage_edit_plus", "omnigen", "motif_video", "anyflow", "dreamlite"]
)
def test_bench_builds_each_architecture_with_fewer_layers(arch, one_thread):
    from tome_processors.bench.dit import build_transformer, make_transformer_inputs

    model = build_transformer(arch, quick=True, layers=1)
    depth = [getattr(model.config, name) for name in ("num_layers", "num_single_layers") if name in model.config]
    assert depth and all(d == 1 for d in depth)
    assert family_of(model).name == arch
    size = 128 if arch == "dreamlite" else 64  # DreamLite's level: 32 px a token
    inputs = make_transformer_inputs(model, arch, batch=2, resolution=size, text_tokens=5, frames=5, width=size)
    plain = inputs.run(model)
    tp.apply_tome(model, ratio=0.5)
    merged = inputs.run(model)
    assert merged.shape == plain.shape and torch.isfinite(merged).all() and not torch.equal(merged, plain)
