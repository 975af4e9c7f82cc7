"""What Qwen-Image 2.1 and ERNIE-Image need beyond the family table (tests/family_cases/qwen_ernie.py).

Qwen-Image 2.1: its pipeline's KV cache (the first step caches the prompt's keys and values, the later steps run the
generated image's tokens alone against them), its flex processor's `BlockMask` (not cut: not merged), its key mask
`key_valid` (cut as the attention mask is, or refused). ERNIE-Image: the sequence-first block input (the metric is
its batch-first view) and its feed-forward, which `merge_mlp` leaves alone.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage21 import (
    QwenImage21AttnProcessor,
    QwenImage21FlexAttnProcessor,
    QwenImage21KVCache,
)

import tome_processors as tp
from test_family_table import AttentionRecorder, merged_calls
from tome_processors import joint_attention
from tome_processors.families import ErnieImageFamily, QwenImage21Family, family_of
from tome_processors.hooks import context_of

from family_cases.qwen_ernie import ernie_image_inputs, qwenimage21_inputs, tiny_ernie_image, tiny_qwenimage21


def steps(
    model: torch.nn.Module, inputs: dict, record: bool = True, modes: tuple[str, ...] = ("extract", "cached")
) -> tuple:
    """The pipeline's first step (`"extract"`) and a later one (`"cached"`): their outputs, the cache, and each
    step's attention kernel calls (`record`)."""
    cache = QwenImage21KVCache(len(model.transformer_blocks))
    records = []
    outputs = []
    for mode in modes:
        recorder = AttentionRecorder() if record else contextlib.nullcontext()
        with torch.no_grad(), recorder:
            outputs.append(model(**inputs, kv_cache=cache, kv_cache_mode=mode).sample)
        records.append(recorder)
    return *outputs, *([None] * (2 - len(outputs))), cache, records


def cached_keys(cache: QwenImage21KVCache) -> list[torch.Tensor]:
    return [t for layer in cache.layer_caches for t in layer.get()]


@pytest.mark.parametrize("padded", [0, 3])
def test_qwenimage21_merges_every_step_and_caches_the_prompt_as_it_was(padded):
    model, inputs = tiny_qwenimage21(), qwenimage21_inputs(padded=padded)
    first, later, cache, plain = steps(model, inputs)
    tp.apply_tome(model, ratio=0.5, use_rand=False)
    merged_first, merged_later, merged_cache, merged = steps(model, inputs)
    # The prompt attends to itself alone: its keys and values, cached, are the plain model's bit for bit.
    assert all(torch.equal(a, b) for a, b in zip(cached_keys(cache), cached_keys(merged_cache), strict=True))
    # Each step merges the generated image's call in both blocks (a padded prompt's key mask cut along).
    assert [merged_calls(p, m) for p, m in zip(plain, merged, strict=True)] == [2, 2]
    for out, reference in ((merged_first, first), (merged_later, later)):
        assert torch.isfinite(out).all() and not torch.allclose(out, reference, atol=1e-5)
    # The prompt's outputs in the first step are the plain model's: only the image's rows changed.
    prefix = first.shape[1] - later.shape[1]
    torch.testing.assert_close(merged_first[:, :prefix], first[:, :prefix])
    # A batch of two, each sample with its own merge and rotary rows, equals two batches of one, cached steps too.
    for b in range(2):
        one = {k: v[b : b + 1] if isinstance(v, (torch.Tensor, list)) else v for k, v in inputs.items()}
        _, alone, _, _ = steps(model, one)
        torch.testing.assert_close(alone[0], merged_later[b], rtol=1e-4, atol=1e-5)
    tp.remove_tome(model)
    assert torch.equal(steps(model, inputs)[1], later)


def test_qwenimage21_flex_block_mask_is_not_merged_and_its_cached_steps_are(monkeypatch):
    model, inputs = tiny_qwenimage21(), qwenimage21_inputs()
    model.set_attn_processor(QwenImage21FlexAttnProcessor())
    merged = []  # per step: attention calls made on merged tokens (flex_attention is no kernel a recorder sees)
    original = joint_attention._call
    monkeypatch.setattr(joint_attention, "_call", lambda *args, **kwargs: merged.append(1) or original(*args, **kwargs))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*flex_attention.*")  # uncompiled flex on the CPU: said once
        first, later, _, _ = steps(model, inputs, record=False)
        tp.apply_tome(model, ratio=0.5)
        with pytest.warns(UserWarning, match="attention mask"):
            merged_first, _, _, _ = steps(model, inputs, record=False, modes=("extract",))
        assert not merged and torch.equal(merged_first, first)
        _, merged_later, _, _ = steps(model, inputs, record=False)
    # The first step's `BlockMask` cannot be cut to the merged tokens: not merged. The later steps pass a tensor
    # mask over the prompt's padding and merge, in both blocks.
    assert len(merged) == 2
    assert not torch.allclose(merged_later, later, atol=1e-5)
    assert all(isinstance(p, QwenImage21FlexAttnProcessor) for p in model.attn_processors.values())  # wrapped


def test_qwenimage21_key_mask_is_refused_where_masks_may_not_be_cut(monkeypatch):
    monkeypatch.setattr(QwenImage21Family, "masks_text_only", False)
    model = tiny_qwenimage21()
    padded, whole = qwenimage21_inputs(), qwenimage21_inputs(padded=0)
    recorded = {}
    for name, inputs in (("padded", padded), ("whole", whole)):
        tp.remove_tome(model)
        plain = AttentionRecorder()
        with torch.no_grad(), plain:
            model(**inputs)
        tp.apply_tome(model, ratio=0.5)
        merged = AttentionRecorder()
        with torch.no_grad(), merged, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model(**inputs)
        recorded[name] = merged_calls(plain, merged), [str(w.message) for w in caught]
    assert recorded["padded"][0] == 0 and any("attention mask" in m for m in recorded["padded"][1])
    assert recorded["whole"] == (2, [])
    assert all(isinstance(p, QwenImage21AttnProcessor) for p in model.attn_processors.values())  # wrapped


def test_qwenimage21_grid_and_timestep_come_from_the_generated_image():
    model, family = tiny_qwenimage21(), QwenImage21Family()
    inputs = qwenimage21_inputs(h=4, w=6, condition=(2, 4))  # the condition image's shape comes first
    assert family_of(model).name == "qwenimage21"
    assert family.token_grid(model, (), inputs) == (4, 6)
    assert torch.equal(family.timestep((), inputs), torch.full((2,), 600.0))
    assert family.token_grid(model, (), {**inputs, "img_shapes": [[(2, 4, 6)]] * 2}) is None  # frames: no image


def test_ernie_image_metric_is_the_sequence_first_block_input_batch_first():
    model, inputs = tiny_ernie_image(), ernie_image_inputs()
    family = family_of(model)
    assert family.name == "ernie_image" and all(site.sequence_first for site in family.blocks(model))
    tp.apply_tome(model, ratio=0.5)
    block_inputs, metrics = [], []
    context = context_of(model)
    model.layers[0].register_forward_pre_hook(lambda module, args: block_inputs.append(args[0]))
    model.layers[0].self_attention.register_forward_pre_hook(
        lambda module, args, kwargs: metrics.append(context.blocks[0].metric), with_kwargs=True
    )
    with torch.no_grad():
        model(**inputs)
    x = block_inputs[0]  # (S, B, C): the image's 48 tokens, then the text
    assert x.shape[:2] == (48 + 7, 2)
    assert torch.equal(metrics[0], x.transpose(0, 1)[:, :48])
    assert family.token_grid(model, (), inputs) == (6, 8)
    assert torch.equal(family.timestep((), inputs), torch.full((2,), 600.0))  # the scheduler's 0..1000, as is


def test_ernie_image_merge_mlp_leaves_its_sequence_first_feed_forward_alone():
    model, inputs = tiny_ernie_image(), ernie_image_inputs()
    assert all(site.feed_forward is None for site in ErnieImageFamily().blocks(model))
    outputs = []
    for merge_mlp in (False, True):
        tp.apply_tome(model, ratio=0.5, use_rand=False, merge_mlp=merge_mlp)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error")  # and nothing to say
            outputs.append(model(**inputs).sample)
        tp.remove_tome(model)
    assert torch.equal(outputs[0], outputs[1])


def test_a_sequence_first_block_declares_where_its_grid_is():
    from tome_processors.families import BlockSite, Span

    with pytest.raises(ValueError, match="sequence-first"):
        BlockSite(torch.nn.Identity(), (), None, Span.WHOLE, sequence_first=True)
