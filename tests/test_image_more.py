"""Bria, Bria Fibo and Fibo 2, GLM-Image, Ideogram 4, Nucleus-MoE-Image, PRX and Ovis-Image (`families/image_more.py`).

What the family table (`tests/test_family_table.py`) does not check on them: the grids, block lists and timesteps the
families read; each sample's own merge where the inputs hold lists of batched tensors (Bria Fibo's text layers, Bria
Fibo 2's context images); Bria Fibo 2's padded gist batch (merges nothing), GLM-Image's KV cache of condition images,
Nucleus-MoE-Image's cached text keys under a mask, Ideogram 4's ids that form no grid; PRX's head-first rotary tables;
the bench architectures.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from diffusers.models.transformers.transformer_bria_fibo2 import compute_gist_count
from diffusers.models.transformers.transformer_glm_image import GlmImageKVCache

import tome_processors as tp
from test_family_table import AttentionRecorder
from tome_processors.families import Layout, Rotary, Span, family_of, image_more
from tome_processors.joint_attention import _gathered_rows

from family_cases.image_more import (
    TEXT,
    bria_fibo2_inputs,
    bria_fibo_inputs,
    bria_inputs,
    glm_image_inputs,
    ideogram4_inputs,
    nucleusmoe_inputs,
    ovis_inputs,
    prx_inputs,
    tiny_bria,
    tiny_bria_fibo,
    tiny_bria_fibo2,
    tiny_glm_image,
    tiny_ideogram4,
    tiny_nucleusmoe,
    tiny_ovis,
    tiny_prx,
)

GRID = 6 * 8
KEPT = GRID - int(GRID * 0.5)

#: name: (builder, inputs, the blocks the family declares, their layouts)
MODELS = {
    "bria": (tiny_bria, bria_inputs, [Layout.JOINT, Layout.TEXT_FIRST, Layout.TEXT_FIRST]),
    "ovis_image": (tiny_ovis, ovis_inputs, [Layout.JOINT, Layout.TEXT_FIRST, Layout.TEXT_FIRST]),
    "bria_fibo": (tiny_bria_fibo, bria_fibo_inputs, [Layout.JOINT, Layout.TEXT_FIRST, Layout.TEXT_FIRST]),
    "bria_fibo2": (tiny_bria_fibo2, bria_fibo2_inputs, [Layout.IMAGE_FIRST, Layout.TEXT_FIRST, Layout.TEXT_FIRST]),
    "glm_image": (tiny_glm_image, glm_image_inputs, [Layout.JOINT] * 2),
    "ideogram4": (tiny_ideogram4, ideogram4_inputs, [Layout.TEXT_FIRST] * 2),
    "nucleusmoe_image": (tiny_nucleusmoe, nucleusmoe_inputs, [Layout.JOINT_IMAGE_FIRST] * 2),
    "prx": (tiny_prx, prx_inputs, [Layout.JOINT] * 2),
}


def run(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


def queries(model: torch.nn.Module, inputs: dict) -> list[int]:
    """The query tokens of every attention kernel call of one forward."""
    recorder = AttentionRecorder()
    with recorder:
        run(model, inputs)
    return [q for q, _ in recorder.calls]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_families_find_the_blocks_grid_and_timestep(name):
    build, inputs, layouts = MODELS[name]
    model = build()
    family = family_of(model)
    assert family.name == name
    assert [site.attentions[0].layout for site in family.blocks(model)] == layouts
    assert family.token_grid(model, (), inputs()) == (6, 8)
    # Every pipeline's timestep, on the 0..1000 noise scale (GLM-Image's is the scheduler's less one).
    assert float(family.timestep((), inputs())[0]) == pytest.approx(599.0 if name == "glm_image" else 600.0)


def _split(value: object, b: int) -> object:
    """Sample `b` of a batched input, reaching into lists and dicts of batched tensors."""
    if isinstance(value, torch.Tensor):
        return value[b : b + 1] if value.ndim and value.shape[0] == 2 else value
    if isinstance(value, list):
        return [_split(item, b) for item in value]
    if isinstance(value, dict):
        return {key: _split(item, b) for key, item in value.items()}
    return value


@pytest.mark.parametrize(
    "build, inputs",
    [(tiny_bria_fibo, bria_fibo_inputs), (tiny_bria_fibo2, lambda: bria_fibo2_inputs(context=(8, 8)))],
    ids=["bria_fibo", "bria_fibo2_context"],
)
def test_each_sample_keeps_its_own_merge_with_lists_of_batched_inputs(build, inputs):
    # The table's check, for inputs that hold lists of batched tensors (Fibo's text layers, Fibo 2's context images).
    model = build()
    tp.apply_tome(model, ratio=0.5, use_rand=False)
    both = run(model, inputs())
    for b in range(2):
        one = {key: _split(value, b) for key, value in inputs().items()}
        torch.testing.assert_close(run(model, one)[0], both[b], rtol=1e-4, atol=1e-5)


def test_bria_fibo2_passes_the_context_images_through():
    # The refiner sees the image then the context image's 16 tokens; the main blocks the gist (8 tokens for a prompt of
    # 7), the image and the context. Only the image's 48 tokens are merged; the Perceiver's attentions (8 gist queries)
    # and the injection block's cross-attention (every token of the stream) are not wrapped.
    model, inputs = tiny_bria_fibo2(), bria_fibo2_inputs(context=(8, 8))
    family = family_of(model)
    assert family.trailing_tokens((), inputs, (6, 8)) == 16
    assert [site.span for site in family.blocks(model)] == [Span.LEADING, Span.TRAILING, Span.TRAILING]
    assert queries(model, inputs) == [GRID + 16, 8, 8, 8 + GRID + 16, 8 + GRID + 16, 8 + GRID + 16]
    tp.apply_tome(model, ratio=0.5)
    assert queries(model, inputs) == [KEPT + 16, 8, 8, 8 + KEPT + 16, 8 + KEPT + 16, 8 + GRID + 16]


def test_bria_fibo2_merges_nothing_where_the_batch_pads_its_gist(monkeypatch):
    # Prompts of 4 and 16 tokens get 4 and 8 gist tokens: the model puts the gist last, after the image, and masks its
    # padding; the forward gives no grid (the gist first, as the blocks are declared, no longer holds).
    model = tiny_bria_fibo2()
    family = family_of(model)
    inputs = bria_fibo2_inputs()
    inputs["encoder_hidden_states"] = torch.randn(2, 2, 16, 24, generator=torch.Generator().manual_seed(1))
    inputs["encoder_attention_mask"] = torch.ones(2, 16, dtype=torch.bool)
    inputs["encoder_attention_mask"][0, 4:] = False
    assert family.token_grid(model, (), inputs) is None
    tp.apply_tome(model, ratio=0.5)
    with pytest.warns(UserWarning, match="no token grid"):
        plain_shapes = queries(model, inputs)
    tp.remove_tome(model)
    assert queries(model, inputs) == plain_shapes
    # Prompts whose gist counts agree (7 and 5 tokens: 8 each) keep the gist first and merge; the mask is read once.
    reads = []

    def counting(lengths, **config):
        reads.append(lengths)
        return compute_gist_count(lengths, **config)

    monkeypatch.setattr(image_more, "compute_gist_count", counting)
    equal = bria_fibo2_inputs(mask=True)
    assert family.token_grid(model, (), equal) == (6, 8) and family.token_grid(model, (), equal) == (6, 8)
    assert reads == [[TEXT, TEXT - 2]]


def test_glm_image_merges_with_the_condition_images_kv_cache():
    # Image editing: the pipeline runs the model on the condition image first (the cache's write mode, no text), then
    # each step reads the cached keys and values ahead of its own. Both forwards merge their image tokens.
    model = tiny_glm_image()
    inputs = glm_image_inputs()
    del inputs["attention_mask"]  # (the model's processor cannot take a text mask beside cached keys)
    generator = torch.Generator().manual_seed(3)
    condition = {
        "hidden_states": torch.randn(1, 4, 8, 8, generator=generator),
        "encoder_hidden_states": inputs["encoder_hidden_states"][:1, :0],
        "prior_token_id": torch.randint(0, 32, (1, 16), generator=generator),
        "prior_token_drop": torch.zeros(1, 16, dtype=torch.bool),
        "timestep": torch.zeros(1),
        "target_size": torch.tensor([[64.0, 64.0]]),
        "crop_coords": torch.zeros(1, 2),
    }

    def edit() -> tuple[torch.Tensor, list[tuple[int, int]]]:
        cache = GlmImageKVCache(num_layers=2)
        cache.set_mode("write")
        recorder = AttentionRecorder()
        with recorder:
            run(model, {**condition, "kv_caches": cache})
            cache.next_sample()
            cache.set_mode("read")
            out = run(model, {**inputs, "kv_caches": cache})
        return out, recorder.calls

    plain, plain_calls = edit()
    tp.apply_tome(model, ratio=0.5)
    merged, merged_calls = edit()
    tp.remove_tome(model)
    assert plain_calls == [(16, 16)] * 2 + [(TEXT + GRID, 16 + TEXT + GRID)] * 2
    assert merged_calls == [(8, 8)] * 2 + [(TEXT + KEPT, 8 + TEXT + KEPT)] * 2  # the cache holds the merged keys
    assert torch.isfinite(merged).all() and not torch.allclose(merged, plain, atol=1e-5)
    assert torch.equal(edit()[0], plain)


def test_glm_image_marks_a_generation_by_its_prior_token_drop():
    family = family_of(tiny_glm_image())
    inputs = glm_image_inputs()
    assert family.generation_marker((), inputs) is inputs["prior_token_drop"]


def test_nucleusmoe_merges_nothing_with_cached_text_keys_under_a_mask():
    model = tiny_nucleusmoe()
    family = family_of(model)
    cached = {**nucleusmoe_inputs(), "attention_kwargs": {"cached_txt_key": torch.zeros(2, TEXT, 2, 16)}}
    assert family.token_grid(model, (), cached) is None  # the module would get no text, its mask the text's part
    unmasked = {**cached, "encoder_hidden_states_mask": None}
    assert family.token_grid(model, (), unmasked) == (6, 8)


def test_nucleusmoe_and_prx_keep_padded_text_masked():
    # The second prompt's last two tokens are padding: what they hold changes nothing, with ToMe as without.
    for build, inputs in ((tiny_nucleusmoe, nucleusmoe_inputs), (tiny_prx, prx_inputs)):
        model = build()
        tp.apply_tome(model, ratio=0.5)
        out = run(model, inputs())
        changed = inputs()
        changed["encoder_hidden_states"][1, TEXT - 2 :] += 5.0
        torch.testing.assert_close(run(model, changed), out, rtol=1e-4, atol=1e-5)


def test_ideogram4_reads_its_grid_from_the_trailing_image_ids():
    model = tiny_ideogram4()
    family = family_of(model)
    assert family.token_grid(model, (), ideogram4_inputs(text=0)) == (6, 8)  # the unconditional model's call
    inputs = ideogram4_inputs()
    inputs["position_ids"] = inputs["position_ids"].flip(1)  # the image's rows first: no grid closing the sequence
    fresh = family_of(model)
    with pytest.warns(UserWarning, match="ToMe merges nothing"):
        assert fresh.token_grid(model, (), inputs) is None
    assert float(family.timestep((), {"timestep": torch.tensor([1.0])})[0]) == 0.0  # the clean image


def test_prx_gathers_its_head_first_rotations_along_the_tokens():
    table = torch.randn(2, 1, 5, 3, 2, 2)  # (B, 1, N, D/2, 2, 2)
    row_token = torch.tensor([[0, 4, 2], [3, 3, 1]])
    samples = torch.arange(2).view(2, 1)
    gathered = _gathered_rows(table, samples, row_token, Rotary(batched=True, sequence_dim=2))
    assert gathered.shape == (2, 1, 3, 3, 2, 2)
    assert all(torch.equal(gathered[b, 0], table[b, 0, row_token[b]]) for b in range(2))


def test_apply_tome_refuses_k_v_pooling():
    for build, _, _ in MODELS.values():
        with pytest.raises(ValueError, match='Expected mode="merge"'):
            tp.apply_tome(build(), mode="downsample_kv")


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_bench_architectures_build_and_merge_as_their_pipelines_call_them(arch):
    from tome_processors.bench.dit import build_transformer, make_transformer_inputs

    model = build_transformer(arch, quick=True)
    family = family_of(model)
    assert family.name == arch
    inputs = make_transformer_inputs(model, arch, batch=2, resolution=96, text_tokens=9)  # 6 x 6 tokens
    assert family.token_grid(model, (), inputs.kwargs) == (6, 6)
    recorder = AttentionRecorder()
    with recorder:
        plain = inputs.run(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every attention ToMe is asked to merge in merges
        tp.apply_tome(model, ratio=0.5, pays_only=False)
        merged_recorder = AttentionRecorder()
        with merged_recorder:
            merged = inputs.run(model)
    assert merged.shape == plain.shape and torch.isfinite(merged).all()
    blocks = len(family.blocks(model))
    assert sum(p != m for p, m in zip(recorder.calls, merged_recorder.calls, strict=True)) == blocks
