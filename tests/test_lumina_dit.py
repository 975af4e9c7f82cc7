"""Lumina 2, Lumina-Next, AuraFlow, DiT, Hunyuan-DiT and FramePack beyond the family table
(tests/family_cases/lumina_dit.py): what each family reads, the options the table does not turn on (`merge_mlp`,
`merge_crossattn`), what is never merged, FramePack's samples one by one, and the shared pieces these families added
(`Layout.JOINT_IMAGE_FIRST_HISTORY`, a self-attention given its own tokens as keys, a keys' rotary table, a
cross-attention's key mask, outputs with a heads axis)."""

from __future__ import annotations

import warnings

import pytest
import torch
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0
from diffusers.models.transformers.transformer_lumina2 import Lumina2AttnProcessor2_0

import tome_processors as tp
from tome_processors.families import (
    AuraFlowFamily,
    DiTFamily,
    HunyuanDiTFamily,
    HunyuanVideoFamily,
    HunyuanVideoFramepackFamily,
    Layout,
    Lumina2Family,
    LuminaNextFamily,
    PixArtFamily,
    Rotary,
    family_of,
)
from tome_processors.joint_attention import _rotary_fits
from tome_processors.merge import TokenMerge

from family_cases.lumina_dit import (
    auraflow_inputs,
    dit_inputs,
    framepack_inputs,
    hunyuandit_inputs,
    lumina2_inputs,
    lumina_next_inputs,
    tiny_auraflow,
    tiny_dit,
    tiny_framepack,
    tiny_hunyuandit,
    tiny_lumina2,
    tiny_lumina_next,
)
from leftovers import hooks_left, tome_attributes_left

#: Each model: its builder, its inputs, its family class, how many block sites the family declares, the grid.
MODELS = {
    "lumina2": (tiny_lumina2, lumina2_inputs, Lumina2Family, 3, (6, 8)),
    "lumina_next": (tiny_lumina_next, lumina_next_inputs, LuminaNextFamily, 2, (6, 8)),
    "auraflow": (tiny_auraflow, auraflow_inputs, AuraFlowFamily, 2, (6, 8)),
    "dit_imagenet": (tiny_dit, dit_inputs, DiTFamily, 2, (6, 6)),
    "hunyuandit": (tiny_hunyuandit, hunyuandit_inputs, HunyuanDiTFamily, 4, (6, 8)),
    "hunyuanvideo_framepack": (tiny_framepack, framepack_inputs, HunyuanVideoFramepackFamily, 2, (2, 6, 8)),
}


def run(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs)[0]


def tokens_into(modules: list[torch.nn.Module]) -> tuple[list[int], list]:
    """The tokens each of `modules` gets as its first input, per call, in call order (and the hooks' handles)."""
    seen: list[int] = []

    def record(_module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        x = args[0] if args else next(iter(kwargs.values()))
        seen.append(int(x.shape[1]))

    return seen, [m.register_forward_pre_hook(record, with_kwargs=True) for m in modules]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_each_family_reads_its_blocks_grid_and_timestep(name):
    build, inputs, family_type, blocks, grid = MODELS[name]
    model, call = build(), inputs()
    family = family_of(model)
    assert type(family) is family_type and family.name == name
    assert len(family.blocks(model)) == blocks
    assert family.token_grid(model, (), call) == grid
    timestep = family.timestep((), call)
    torch.testing.assert_close(torch.as_tensor(timestep, dtype=torch.float32), torch.full((2,), 600.0))


def test_framepack_declares_no_feed_forward():
    model = tiny_framepack()
    assert all(site.feed_forward is None for site in family_of(model).blocks(model))


def test_the_refiners_and_text_streams_are_never_declared():
    lumina2 = tiny_lumina2()
    declared = {site.module for site in family_of(lumina2).blocks(lumina2)}
    assert not declared & set(lumina2.context_refiner) and set(lumina2.noise_refiner) <= declared
    framepack = tiny_framepack()
    attentions = {a.module for site in family_of(framepack).blocks(framepack) for a in site.attentions}
    assert not attentions & set(framepack.context_embedder.modules())


def test_the_families_borrow_the_nearest_measured_presets():
    assert Lumina2Family.presets is tp.families.FluxFamily.presets
    assert LuminaNextFamily.presets is HunyuanDiTFamily.presets is DiTFamily.presets is PixArtFamily.presets
    assert AuraFlowFamily.presets is tp.families.SD3Family.presets
    assert HunyuanVideoFramepackFamily.presets is HunyuanVideoFamily.presets
    assert HunyuanVideoFramepackFamily.guidance_in_batch is Lumina2Family.guidance_in_batch is False
    assert DiTFamily.guidance_in_batch and AuraFlowFamily.guidance_in_batch and LuminaNextFamily.guidance_in_batch


#: The feed-forwards each family declares (`merge_mlp`): those that run on the grid's tokens, or on them and others that
#: follow (never on text or history ahead of them, which the feed-forward's merge of the grid's tokens does not cover).
FEED_FORWARDS = {
    "lumina2": lambda m: [b.feed_forward for b in m.noise_refiner],
    "lumina_next": lambda m: [b.feed_forward for b in m.layers],
    "auraflow": lambda m: [b.ff for b in m.joint_transformer_blocks],
    "dit_imagenet": lambda m: [b.ff for b in m.transformer_blocks],
    "hunyuandit": lambda m: [b.ff for b in m.blocks],
}


@pytest.mark.parametrize("name", sorted(FEED_FORWARDS))
def test_merge_mlp_merges_every_declared_feed_forward(name):
    build, inputs, *_ = MODELS[name]
    model, call = build(), inputs()
    feed_forwards = [site.feed_forward for site in family_of(model).blocks(model) if site.feed_forward is not None]
    assert feed_forwards == FEED_FORWARDS[name](model)
    plain_tokens, handles = tokens_into(feed_forwards)
    plain = run(model, call)
    for handle in handles:
        handle.remove()
    tp.apply_tome(model, ratio=0.5, merge_mlp=True)
    merged_tokens, handles = tokens_into(feed_forwards)  # after ToMe's hooks: what the feed-forwards compute on
    merged = run(model, call)
    for handle in handles:
        handle.remove()
    assert all(m < p for p, m in zip(plain_tokens, merged_tokens, strict=True)), (plain_tokens, merged_tokens)
    assert torch.isfinite(merged).all() and not torch.allclose(merged, plain)
    tp.remove_tome(model)
    assert torch.equal(run(model, call), plain) and hooks_left(model) == 0 and not tome_attributes_left(model)


@pytest.mark.parametrize("name", ["lumina_next", "hunyuandit"])
def test_merge_crossattn_merges_the_queries_of_the_cross_attention_and_keeps_each_samples_text(name):
    build, inputs, *_ = MODELS[name]
    model, call = build(), inputs()
    cross = [a.module for site in family_of(model).blocks(model) for a in site.attentions if a.is_cross]
    plain = run(model, call)
    tp.apply_tome(model, ratio=0.5, merge_crossattn=True, use_rand=False)
    queries, handles = tokens_into([attn.to_q for attn in cross])
    both = run(model, call)
    for handle in handles:
        handle.remove()
    assert queries and all(n < 48 for n in queries)
    assert torch.isfinite(both).all() and not torch.allclose(both, plain)
    # The second sample's text is padded: its key mask stays in line with the keys (each sample alone the same).
    for b in range(2):
        one = {k: v[b : b + 1] if isinstance(v, torch.Tensor) and v.shape[:1] == (2,) else v for k, v in call.items()}
        torch.testing.assert_close(run(model, one)[0], both[b], rtol=1e-4, atol=1e-5)
    tp.remove_tome(model)
    assert torch.equal(run(model, call), plain)


def test_lumina2_attention_gets_the_merged_tokens_as_its_keys_too(monkeypatch):
    """Lumina 2's blocks pass their tokens as `hidden_states` and again as `encoder_hidden_states`: both merged."""
    seen: list[tuple[int, int]] = []
    call = Lumina2AttnProcessor2_0.__call__

    def recording(self, attn, hidden_states, encoder_hidden_states, *args, **kwargs):
        seen.append((int(hidden_states.shape[1]), int(encoder_hidden_states.shape[1])))
        assert encoder_hidden_states is hidden_states
        return call(self, attn, hidden_states, encoder_hidden_states, *args, **kwargs)

    monkeypatch.setattr(Lumina2AttnProcessor2_0, "__call__", recording)
    model = tiny_lumina2()
    tp.apply_tome(model, ratio=0.5)
    run(model, lumina2_inputs())
    # The context refiner's 7 caption tokens, the noise refiner's 48 merged to 24, the main layers' 7 + 48 to 7 + 24.
    assert seen == [(7, 7), (24, 24), (31, 31), (31, 31)]


def test_lumina2_captions_of_different_lengths_leave_the_main_layers_unmerged():
    """Padded to the longest caption after the image tokens, each sample's grid sits at its own offset: the main layers
    get a mask and run unmerged (said once); the noise refiner still merges."""
    model = tiny_lumina2()
    queries, handles = tokens_into([block.attn.to_q for block in [*model.noise_refiner, *model.layers]])
    tp.apply_tome(model, ratio=0.5)
    with pytest.warns(UserWarning, match="attention mask"):
        out = run(model, lumina2_inputs(valid=(7, 4)))
    for handle in handles:
        handle.remove()
    assert queries == [24, 55, 55] and torch.isfinite(out).all()


def test_framepack_merges_the_clip_and_passes_the_history_as_rows_of_its_own(monkeypatch):
    seen: list[torch.Tensor] = []
    call = HunyuanVideoAttnProcessor2_0.__call__

    def recording(self, attn, hidden_states, *args, **kwargs):
        seen.append(hidden_states)
        return call(self, attn, hidden_states, *args, **kwargs)

    monkeypatch.setattr(HunyuanVideoAttnProcessor2_0, "__call__", recording)
    model, call_inputs = tiny_framepack(), framepack_inputs()
    history = 16 + 12 + 2 * 48  # 4x: 4 frames of 2 x 2; 2x: 1 of 3 x 4; the first frame and 1x: 2 of 6 x 8
    run(model, call_inputs)
    plain = [x for x in seen if x.shape[1] == history + 96]  # the blocks' (the token refiner's get the text)
    seen.clear()
    tp.apply_tome(model, ratio=0.5)
    run(model, call_inputs)
    merged = [x for x in seen if x.shape[1] == history + 48]
    assert len(plain) == len(merged) == 2
    # The history reaches the first block's attention exactly as it was: its rows pass through the merge.
    assert torch.equal(merged[0][:, :history], plain[0][:, :history])


def test_framepack_samples_keep_their_own_merge_and_text_mask():
    """The table's split would cut the 1-D frame indices of the 2-frame histories: here only the batch axis is cut.
    The second sample's prompt is padded (masked at batch 2, cut off at batch 1)."""
    model, call = tiny_framepack(), framepack_inputs()
    tp.apply_tome(model, ratio=0.5, use_rand=False)
    both = run(model, call)
    batched = {"hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask", "pooled_projections"}
    batched |= {"image_embeds", "guidance", "latents_clean", "latents_history_2x", "latents_history_4x"}
    for b in range(2):
        one = {k: v[b : b + 1] if k in batched else v for k, v in call.items()}
        torch.testing.assert_close(run(model, one)[0], both[b], rtol=1e-4, atol=1e-5)
    tp.remove_tome(model)


@pytest.mark.parametrize("build", [tiny_lumina2, tiny_lumina_next, tiny_auraflow, tiny_hunyuandit, tiny_framepack])
def test_k_v_pooling_is_refused_where_keys_come_with_the_merged_tokens(build):
    with pytest.raises(ValueError, match='mode="merge"'):
        tp.apply_tome(build(), mode="downsample_kv")


def test_dit_pools_keys_and_values_as_pixart_does():
    model, call = tiny_dit(), dit_inputs()
    plain = run(model, call)
    tp.apply_tome(model, mode="downsample_kv", pays_only=False)
    assert torch.isfinite(run(model, call)).all()
    tp.remove_tome(model)
    assert torch.equal(run(model, call), plain)


def test_a_keys_table_of_its_own_leaves_the_attention_unmerged():
    """Only the queries' very table follows the merged keys: another keys' table does not fit."""
    spec = Rotary(name="query_rotary_emb", position=3, batched=True, key_name="key_rotary_emb", key_position=4)
    table = torch.zeros(1, 6, 4, dtype=torch.complex64)
    at = (spec.position, spec.name)
    assert _rotary_fits(spec, at, (), {"query_rotary_emb": table, "key_rotary_emb": table}, 6, 2)
    assert _rotary_fits(spec, at, (), {"query_rotary_emb": table, "key_rotary_emb": None}, 6, 2)
    assert not _rotary_fits(spec, at, (), {"query_rotary_emb": table, "key_rotary_emb": table.clone()}, 6, 2)


def test_unmerge_takes_outputs_with_a_heads_axis():
    merge = TokenMerge(torch.tensor([0, 0, 1, 2, 2, 3]), torch.tensor([[2.0], [1.0], [1.0], [2.0]]), 2, 3, 2)
    y = torch.randn(2, 2, 3, 4)
    flat = merge.unmerge(y.flatten(2))
    assert torch.equal(merge.unmerge(y), flat.unflatten(2, (3, 4)))


def test_the_history_layout_is_declared_only_by_framepack():
    model = tiny_framepack()
    layouts = {a.layout for site in family_of(model).blocks(model) for a in site.attentions}
    assert layouts == {Layout.JOINT_IMAGE_FIRST_HISTORY}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # merging in every block: nothing said
        tp.apply_tome(model, ratio=0.5)
        run(model, framepack_inputs())
    tp.remove_tome(model)


@pytest.mark.parametrize("build,inputs", [(tiny_lumina_next, lumina_next_inputs), (tiny_lumina2, lumina2_inputs)])
def test_a_tome_processor_set_on_each_module_merges_as_apply_tome_does(build, inputs):
    """These models have no `set_attn_processor`: a `ToMeProcessor()` set on each attention module keeps every keyword
    their processors take (Lumina-Next's `base_sequence_length`, its rotary tables), as `apply_tome` does."""
    model, call = build(), inputs()
    tp.apply_tome(model, ratio=0.5)
    applied = run(model, call)
    tp.remove_tome(model)
    for module in model.modules():
        if hasattr(module, "set_processor") and hasattr(module, "processor"):
            module.set_processor(tp.ToMeProcessor(ratio=0.5))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no keyword dropped (diffusers warns), nothing else said
        torch.testing.assert_close(run(model, call), applied)
