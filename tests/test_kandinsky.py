"""Kandinsky 5 and 6 beyond the family table (tests/family_cases/kandinsky.py): their rotary tables (one tensor of
2x2 rotation matrices per token, Kandinsky 6's passed again for the keys) follow the merged rows per sample, and
block-sparse (NABLA) attention is refused with its reason: Kandinsky 5 configured with it at apply time, a
forward given `sparse_params` by merging nothing, Kandinsky 6's super-resolution model always."""

from __future__ import annotations

import warnings

import pytest
import torch
from diffusers import Kandinsky5T2VPipeline, Kandinsky6SRTransformer3DModel
from diffusers.models.attention_dispatch import AttentionBackendName
from diffusers.models.transformers.transformer_kandinsky6 import Kandinsky6AttnProcessor

import tome_processors as tp
from tome_processors.families import Layout, family_of, find_family
from tome_processors.merge import bipartite_soft_matching_2d
from tome_processors.pays import attention_width
from tome_processors.rotary_attention import merged_rotations
from tome_processors.skips import ToMeSkipWarning

from family_cases import CASES
from family_cases.kandinsky import (
    FRAMES,
    TEXT,
    H,
    W,
    kandinsky5_inputs,
    kandinsky6_inputs,
    tiny_kandinsky5,
    tiny_kandinsky5_video_pipeline,
    tiny_kandinsky6,
)


def forward(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample


def one_sample(inputs: dict, b: int) -> dict:
    def one(value):
        return value[b : b + 1] if isinstance(value, torch.Tensor) and value.ndim and value.shape[0] == 2 else value

    return {key: one(value) for key, value in inputs.items()}


@pytest.mark.parametrize("name", ["kandinsky5", "kandinsky5-image"])
def test_kandinsky5_each_sample_keeps_its_own_merge_and_rotations(name):
    # The table's check at Kandinsky 5's own precision: its processor rounds the rotated queries and keys to
    # bfloat16, so the plain model's batch of two differs from two batches of one by up to 6e-5; a sample rotated
    # with another sample's rows (or merged with its merge) would differ by far more.
    case = CASES[name]
    model = case.build()
    tp.apply_tome(model, ratio=0.5, use_rand=False)
    inputs = case.inputs(batch=2)
    both = forward(model, inputs)
    for b in range(2):
        torch.testing.assert_close(forward(model, one_sample(inputs, b))[0], both[b], rtol=1e-3, atol=1e-3)
    tp.remove_tome(model)


def test_families_find_the_blocks_grid_and_timestep():
    k5, k6 = tiny_kandinsky5(), tiny_kandinsky6()
    for model, inputs, blocks in (
        (k5, kandinsky5_inputs(), k5.visual_transformer_blocks),
        (k6, kandinsky6_inputs(reference=True), k6.visual_transformer_blocks),
    ):
        family = family_of(model)
        sites = family.blocks(model)
        assert [site.module for site in sites] == list(blocks)
        assert [(a.layout, a.is_cross) for a in sites[0].attentions] == [(Layout.ROTARY, False), (Layout.IMAGE, True)]
        assert family.timestep((), inputs) is inputs["timestep"]  # the scheduler's 0..1000, as passed
        frames = inputs["hidden_states"].shape[1]
        assert family.token_grid(model, (), inputs) == (frames, H, W)
    # Kandinsky 6's video stream only: its audio stream and the video-audio cross-attentions are never wrapped.
    video = k6.visual_transformer_blocks[0].video_dec_block
    assert [a.module for a in family_of(k6).blocks(k6)[0].attentions] == [video.self_attention, video.cross_attention]
    assert family_of(k6).blocks(k6)[0].feed_forward is video.feed_forward
    assert attention_width(video.self_attention) == 32  # the pays rule reads Kandinsky's `to_query`


class RecordingProcessor(Kandinsky6AttnProcessor):
    """Kandinsky 6's processor, noting the queries and rotary tables each call gets."""

    calls: list

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, rotary_emb=None, rotary_emb_kv=None, **kw):
        self.calls.append((hidden_states.shape[1], rotary_emb, rotary_emb_kv))
        return super().__call__(attn, hidden_states, encoder_hidden_states, rotary_emb, rotary_emb_kv, **kw)


def test_kandinsky6_keys_table_follows_the_merged_rows_as_the_queries_does():
    model = tiny_kandinsky6()
    recorder = RecordingProcessor()
    recorder.calls = []
    attention = model.visual_transformer_blocks[0].video_dec_block.self_attention
    attention.set_processor(recorder)
    tp.apply_tome(model, ratio=0.5)
    forward(model, kandinsky6_inputs())
    tp.remove_tome(model)
    ((queries, rotation, key_rotation),) = recorder.calls
    tokens = FRAMES * H * W
    assert queries < tokens  # merged
    assert rotation.shape == (2, queries, 1, 8, 2, 2)  # a row per merged row and sample (D/2 = 8 channel pairs)
    assert key_rotation is rotation  # the one table, gathered once


def test_merged_rotations_take_each_samples_rows():
    merge = bipartite_soft_matching_2d(torch.randn(2, 8, 4), 2, 4, 2, 1, 2, with_row_token=True)
    table = torch.randn(8, 1, 3, 2, 2)
    torch.testing.assert_close(merged_rotations(table, merge), table[merge.row_token], rtol=0, atol=0)
    batched = torch.randn(2, 8, 1, 3, 2, 2)
    rows = merged_rotations(batched, merge, batched=True)
    for b in range(2):
        torch.testing.assert_close(rows[b], batched[b, merge.row_token[b]], rtol=0, atol=0)
    assert merged_rotations(batched, merge, batched=True) is rows  # kept on the merge for the same table


def test_nabla_kandinsky5_is_refused_at_apply_time_with_the_reason():
    model = tiny_kandinsky5()
    model.register_to_config(attention_type="nabla")  # Kandinsky 5.0 Video Pro's and Lite 10 s's attention
    with pytest.raises(ValueError, match="NABLA"):
        tp.apply_tome(model)
    assert not tp.is_tome_applied(model)
    model.set_attn_processor(tp.ToMeProcessor(ratio=0.5))
    with pytest.raises(ValueError, match="NABLA"):
        forward(model, kandinsky5_inputs())


def test_nabla_kandinsky5_pipeline_is_refused_before_anything_changes(tmp_path):
    pipe = tiny_kandinsky5_video_pipeline(tmp_path)
    pipe.transformer.register_to_config(attention_type="nabla")
    with pytest.raises(ValueError, match="NABLA"):
        tp.apply_tome(pipe)
    tp.patch_pipelines()
    try:
        with pytest.raises(ValueError, match="NABLA"):
            pipe.enable_tome()
    finally:
        tp.unpatch_pipelines()
    assert not tp.is_tome_applied(pipe)


def test_a_kandinsky5_forward_given_sparse_params_merges_nothing_and_says_so():
    # Its tokens then come in 8x8 blocks and attend through a NABLA block mask: no grid ToMe can merge on. Called so
    # on a model configured with regular attention (apply_tome accepts it), on the flex backend NABLA needs.
    model = tiny_kandinsky5()
    for block in model.visual_transformer_blocks:  # (`set_attention_backend` would set it for every later test too)
        block.self_attention.processor._attention_backend = AttentionBackendName.FLEX
    frames, h, w = 2, 8, 8  # whole 8x8 blocks of tokens
    sta = Kandinsky5T2VPipeline.fast_sta_nabla(frames, h // 8, w // 8, 3, 3, 3, device="cpu")
    sparse = {"sta_mask": sta[None, None], "to_fractal": True, "P": 0.9}
    inputs = kandinsky5_inputs(frames=frames) | {"sparse_params": sparse}
    inputs["hidden_states"] = torch.randn(2, frames, 2 * h, 2 * w, inputs["hidden_states"].shape[-1])
    inputs["visual_rope_pos"] = [torch.arange(frames), torch.arange(h), torch.arange(w)]
    assert family_of(model).token_grid(model, (), inputs) is None
    assert family_of(model).token_grid(model, (), {**inputs, "sparse_params": None}) == (frames, h, w)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex.*", category=UserWarning)  # torch: flex run eagerly
        plain = forward(model, inputs)
        tp.apply_tome(model, ratio=0.5)
        with pytest.warns(ToMeSkipWarning, match="no token grid"):
            assert torch.equal(forward(model, inputs), plain)
    tp.remove_tome(model)


def tiny_kandinsky6_sr() -> Kandinsky6SRTransformer3DModel:
    torch.manual_seed(0)
    return Kandinsky6SRTransformer3DModel(
        in_visual_dim=4, out_visual_dim=4, time_dim=16, model_dim=32, ff_dim=32, num_visual_blocks=1,
        axes_dims=(4, 6, 6), nabla_window=(3, 3, 3),
    ).eval()  # fmt: skip


def test_kandinsky6_super_resolution_is_refused_with_the_reason(tmp_path):
    model = tiny_kandinsky6_sr()
    assert find_family(model) is None  # no family: what ToMe cannot merge in is refused, saying why
    for options in ({"ratio": 0.5}, {"preset": "balanced"}, {}):
        with pytest.raises(ValueError, match="block-sparse"):
            tp.apply_tome(model, **options)
        assert not tp.is_tome_applied(model)
    with pytest.raises(ValueError, match="block-sparse"):
        tp.ToMeConfig.from_preset("fast", model)
    with pytest.raises(ValueError, match="block-sparse"):
        tp.explain_tome(model, 512, 512, print_table=False)
    # A ToMeProcessor set on it alone merges nothing, and says so once: the model's own output.
    inputs = {"hidden_states": torch.randn(1, 1, 8, 8, 9), "timestep": torch.tensor([500.0])}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex.*")  # diffusers: flex attention run eagerly on the CPU
        plain = forward(model, inputs)
        model.set_attn_processor(tp.ToMeProcessor(ratio=0.5))
        with pytest.warns(UserWarning, match="ToMe merges nothing in Kandinsky6SRTransformer3DModel"):
            assert torch.equal(forward(model, inputs), plain)


def test_kandinsky6_text_mask_covers_the_keys_alone_and_merges_with_cross_attention():
    # The cross-attention's `attn_mask` is the text padding mask, over the keys: merged queries line up with it.
    model = tiny_kandinsky6()
    inputs = kandinsky6_inputs(reference=True)
    assert inputs["encoder_attention_mask"].shape == (2, TEXT)
    plain = forward(model, inputs)
    tp.apply_tome(model, ratio=0.5, merge_crossattn=True)
    merged = forward(model, inputs)
    tp.remove_tome(model)
    assert torch.isfinite(merged).all() and not torch.allclose(merged, plain, atol=1e-5)
