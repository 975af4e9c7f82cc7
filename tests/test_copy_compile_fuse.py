"""What users do to a model with ToMe on never makes it silently wrong: copies, torch.compile, fused
projections, settings that merge nothing (issue 25)."""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import numpy as np
import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0

import tome_processors as tp
from tome_processors.hooks import context_of

from leftovers import hooks_left, tome_attributes_left
from models import tiny_unet, unet_inputs
from pipelines import family_pipeline
from test_dit import flux_inputs, pixart_inputs, sd3_inputs, tiny_flux, tiny_pixart, tiny_sd3
from test_hunyuanvideo import hunyuanvideo_inputs, tiny_hunyuanvideo
from test_ltx import ltx_inputs, tiny_ltx
from test_ltx2 import ltx2_inputs, tiny_ltx2
from test_new_families import (
    chroma_inputs,
    flux2_inputs,
    qwenimage_inputs,
    tiny_chroma,
    tiny_flux2,
    tiny_qwenimage,
    tiny_zimage,
    zimage_inputs,
)
from test_new_families import run as run_transformer
from test_video import tiny_wan, wan_inputs


def unet_call_inputs(h: int = 16, w: int = 16) -> dict:
    sample, timestep, text, _ = unet_inputs(tiny_unet("sd15"), height=h, width=w)
    return {"sample": sample, "timestep": timestep, "encoder_hidden_states": text}


#: name: (model builder, inputs at a token grid (h, w) of the family's own units)
MODELS = {
    "unet": (lambda: tiny_unet("sd15"), lambda h=16, w=16: unet_call_inputs(h, w)),
    "pixart": (tiny_pixart, lambda h=12, w=16: pixart_inputs(h=h, w=w)),
    "sd3": (tiny_sd3, lambda h=12, w=16: sd3_inputs(h=h, w=w)),
    # SD3 without SD3.5's image-only second attention, which diffusers' fused joint processor cannot run.
    "sd3-single": (lambda: tiny_sd3_single(), lambda h=12, w=16: sd3_inputs(h=h, w=w)),
    "flux": (tiny_flux, lambda h=6, w=8: flux_inputs(h=h, w=w)),
    "flux2": (tiny_flux2, lambda h=6, w=8: flux2_inputs(h=h, w=w)),
    "chroma": (tiny_chroma, lambda h=6, w=8: chroma_inputs(h=h, w=w)),
    "qwenimage": (tiny_qwenimage, lambda h=6, w=8: qwenimage_inputs(h=h, w=w)),
    "zimage": (tiny_zimage, lambda h=6, w=8: zimage_inputs(h=h, w=w)),
    "wan": (tiny_wan, lambda h=8, w=12: wan_inputs(h=h, w=w)),
    "ltx": (tiny_ltx, lambda h=6, w=8: ltx_inputs(h=h, w=w)),
    "ltx2": (tiny_ltx2, lambda h=6, w=8: ltx2_inputs(h=h, w=w)),
    "hunyuanvideo": (tiny_hunyuanvideo, lambda h=6, w=8: hunyuanvideo_inputs(h=h, w=w)),
}
#: One model per family.
FAMILIES = [name for name in sorted(MODELS) if name != "sd3-single"]
#: The families whose token grid is the values of `img_ids`.
IDS_FAMILIES = ("flux", "flux2", "chroma")


def tiny_sd3_single() -> torch.nn.Module:
    model = tiny_sd3()
    torch.manual_seed(0)
    config = {key: value for key, value in model.config.items() if not key.startswith("_")}
    return type(model)(**{**config, "dual_attention_layers": ()}).eval()


def forward(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    return run_transformer(model, dict(inputs))


def scale_weights(model: torch.nn.Module, factor: float) -> None:
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(factor)


# ---------------------------------------------------------------- 1. copies


@pytest.mark.parametrize("ratio", [0.5, 0.0])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_deep_copy_runs_its_own_weights_merged_like_the_original(family, ratio):
    build, make_inputs = MODELS[family]
    model, inputs = build(), make_inputs()
    reference = copy.deepcopy(model)  # a plain copy, to get the same weights with ToMe applied afresh
    plain = forward(model, inputs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ratio 0 warns that it merges nothing
        tp.apply_tome(model, ratio=ratio)
    merged = forward(model, inputs)
    assert torch.equal(merged, plain) == (ratio == 0)

    clone = copy.deepcopy(model)
    assert tp.is_tome_applied(clone) and torch.equal(forward(clone, inputs), merged)
    scale_weights(clone, 0.9)  # the copy's own weights: the original's output must not move
    scale_weights(reference, 0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tp.apply_tome(reference, ratio=ratio)
    torch.testing.assert_close(forward(clone, inputs), forward(reference, inputs), rtol=0, atol=0)
    assert torch.equal(forward(model, inputs), merged)

    tp.remove_tome(model)  # removing from one leaves the other as it was
    assert torch.equal(forward(model, inputs), plain) and hooks_left(model) == 0
    assert tp.is_tome_applied(clone) and torch.equal(forward(clone, inputs), forward(reference, inputs))
    tp.remove_tome(clone)
    tp.remove_tome(reference)
    assert torch.equal(forward(clone, inputs), forward(reference, inputs)) and hooks_left(clone) == 0
    assert tome_attributes_left(clone) == []


@pytest.mark.parametrize("family", ["unet", "flux", "wan"])
def test_removing_tome_from_the_copy_leaves_the_original_merging(family):
    build, make_inputs = MODELS[family]
    model, inputs = build(), make_inputs()
    plain = forward(model, inputs)
    tp.apply_tome(model, ratio=0.5)
    merged = forward(model, inputs)
    clone = copy.deepcopy(model)
    tp.remove_tome(clone)
    assert torch.equal(forward(clone, inputs), plain) and hooks_left(clone) == 0
    assert tp.is_tome_applied(model) and torch.equal(forward(model, inputs), merged)


@pytest.mark.parametrize("family", ["unet", "pixart", "flux", "qwenimage", "wan"])
def test_pickle_and_torch_save_keep_tome(family):
    build, make_inputs = MODELS[family]
    model, inputs = build(), make_inputs()
    plain = forward(model, inputs)
    tp.apply_tome(model, ratio=0.5, recompute_every=2)
    merged = forward(model, inputs)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for loaded in (torch.load(buffer, weights_only=False), pickle.loads(pickle.dumps(model))):
        assert tp.is_tome_applied(loaded)
        assert context_of(loaded).model_state.kept == {}  # a copy starts its own generation
        assert torch.equal(forward(loaded, inputs), merged)
        tp.remove_tome(loaded)
        assert torch.equal(forward(loaded, inputs), plain) and hooks_left(loaded) == 0
    assert torch.equal(forward(model, inputs), merged)


def test_a_copy_of_a_pipeline_model_keeps_its_methods_bound_to_itself(tmp_path):
    pipe, args = family_pipeline("pixart", tmp_path)
    tp.enable_tome(pipe, ratio=0.5)
    model = pipe.transformer
    clone = copy.deepcopy(model)
    clone.fuse_qkv_projections()  # the wrapped method must act on the copy
    assert any(getattr(m, "fused_projections", False) for m in clone.modules())
    assert not any(getattr(m, "fused_projections", False) for m in model.modules())
    assert tp.is_tome_applied(clone) and all(isinstance(p, tp.ToMeProcessor) for p in clone.attn_processors.values())
    tp.disable_tome(pipe)
    assert hooks_left(model) == 0 and tp.is_tome_applied(clone)


# ---------------------------------------------------------------- 2. torch.compile


def sized_inputs(family: str, h: int, w: int, seed: int) -> dict:
    inputs = MODELS[family][1](h, w)
    generator = torch.Generator().manual_seed(seed)
    name = next(key for key in ("hidden_states", "sample", "x") if key in inputs)
    value = inputs[name]
    if isinstance(value, list):  # Z-Image: one latent per sample
        inputs[name] = [torch.randn(v.shape, generator=generator) for v in value]
    else:
        inputs[name] = torch.randn(value.shape, generator=generator)
    return inputs


#: Per family: sizes in its inputs' units, portrait and landscape of one token count (where a stale grid would
#: go unnoticed), then another count where the grid is read from values a graph cannot hold.
COMPILE_SIZES = {
    **{name: [(5, 9), (9, 5), (7, 3)] for name in IDS_FAMILIES},
    "qwenimage": [(5, 9), (9, 5)],
    **{name: [(12, 16), (16, 12)] for name in ("pixart", "sd3")},
    "unet": [(16, 24), (24, 16)],
    "zimage": [(6, 10), (10, 6)],
    "wan": [(8, 12), (12, 8)],
    "ltx": [(6, 8), (8, 6)],
    "ltx2": [(6, 8), (8, 6)],
    "hunyuanvideo": [(6, 8), (8, 6)],
}


@pytest.mark.parametrize("family", sorted(COMPILE_SIZES))
def test_compiled_tome_equals_eager_tome_at_every_size_with_no_eager_call_first(family):
    import torch._dynamo

    build, _ = MODELS[family]
    sizes = COMPILE_SIZES[family]
    eager_model, compiled_model = build(), build()
    tp.apply_tome(eager_model, ratio=0.5)
    tp.apply_tome(compiled_model, ratio=0.5)
    plain_model = build()
    torch._dynamo.reset()
    compiled = torch.compile(compiled_model, backend="eager")
    for seed, (h, w) in enumerate(sizes):
        inputs = sized_inputs(family, h, w, seed)
        expected = forward(eager_model, inputs)
        assert not torch.allclose(expected, forward(plain_model, inputs), atol=1e-5)
        torch.testing.assert_close(forward(compiled, inputs), expected, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()


def test_compiled_flux_in_a_pipeline_merges_on_each_calls_grid_in_one_graph(tmp_path):
    import torch._dynamo

    pipe, args = family_pipeline("flux", tmp_path)
    tp.apply_tome(pipe, ratio=0.5)
    sizes = [(48, 80), (80, 48)]  # 3 x 5 and 5 x 3 tokens: one token count

    def generate(height: int, width: int) -> np.ndarray:
        call = {**args, "height": height, "width": width}
        return pipe(**call, num_inference_steps=2, generator=torch.Generator().manual_seed(0)).images

    eager = [generate(*size) for size in sizes]
    model = pipe.transformer
    torch._dynamo.reset()
    pipe.transformer = torch.compile(model, backend="eager", fullgraph=True)  # a graph break would raise
    try:
        for size, expected in zip(sizes, eager, strict=True):
            np.testing.assert_allclose(generate(*size), expected, atol=1e-5)
        assert context_of(model).grid_hint is None  # forgotten at the end of the call
    finally:
        pipe.transformer = model
        torch._dynamo.reset()


def test_set_token_grid_refuses_bad_input_and_models_without_tome():
    model = tiny_flux()
    with pytest.raises(ValueError, match="with ToMe applied"):
        tp.set_token_grid(model, (6, 8))
    tp.apply_tome(model, ratio=0.5)
    for bad in [(6,), (6, 0), [6, 8], (6.0, 8)]:
        with pytest.raises(ValueError, match=r"Expected grid to be \(h, w\)"):
            tp.set_token_grid(model, bad)
    assert context_of(model).grid_hint is None
    tp.set_token_grid(model, (6, 8))
    assert context_of(model).grid_hint == (6, 8)
    tp.new_generation(model)
    assert context_of(model).grid_hint is None


# ---------------------------------------------------------------- 3. fused projections and processor swaps


@pytest.mark.parametrize("family", ["unet", "pixart", "sd3-single", "flux"])
def test_tome_stays_on_through_fuse_and_unfuse_after_apply_tome(family):
    build, make_inputs = MODELS[family]
    model, inputs = build(), make_inputs()
    model.fuse_qkv_projections()
    fused_plain = forward(model, inputs)
    model.unfuse_qkv_projections()
    tp.apply_tome(model, ratio=0.5)
    merged = forward(model, inputs)
    model.fuse_qkv_projections()
    assert tp.is_tome_applied(model)
    fused = forward(model, inputs)
    assert not torch.allclose(fused, fused_plain, atol=1e-5)  # still merging
    torch.testing.assert_close(fused, merged, rtol=1e-4, atol=1e-4)  # the same merge on fused weights
    model.unfuse_qkv_projections()
    torch.testing.assert_close(forward(model, inputs), merged, rtol=1e-5, atol=1e-5)
    tp.remove_tome(model)
    assert hooks_left(model) == 0 and not any(name in vars(model) for name in ("fuse_qkv_projections",))


def test_set_default_attn_processor_keeps_tome_and_set_attn_processor_turns_it_off():
    build, make_inputs = MODELS["unet"]
    model, inputs = build(), make_inputs()
    plain = forward(model, inputs)
    tp.apply_tome(model, ratio=0.5)
    merged = forward(model, inputs)
    model.set_default_attn_processor()  # diffusers' own end: ToMe around AttnProcessor
    assert {type(p.inner) for p in model.attn_processors.values()} == {AttnProcessor}
    torch.testing.assert_close(forward(model, inputs), merged, rtol=1e-4, atol=1e-5)
    model.set_attn_processor(AttnProcessor2_0())  # the user's own switch: ToMe off at once
    assert not tp.is_tome_applied(model)
    assert torch.equal(forward(model, inputs), plain)
    assert hooks_left(model) == 0 and tome_attributes_left(model) == []


# ---------------------------------------------------------------- 4. settings that merge nothing


def caught(action) -> list[str]:
    with warnings.catch_warnings(record=True) as found:
        warnings.simplefilter("always")
        action()
    return [str(w.message) for w in found if issubclass(w.category, UserWarning)]


@pytest.mark.parametrize("family", ["pixart", "sd3", "flux", "qwenimage", "wan"])
def test_level_ratios_without_the_models_level_warn(family):
    model = MODELS[family][0]()
    messages = caught(lambda: tp.apply_tome(model, level_ratios={2: 0.5}))
    assert any("level_ratios={2: 0.5} merges nothing" in m and "[1]" in m for m in messages)
    assert not [m for m in caught(lambda: tp.apply_tome(model, level_ratios={1: 0.5})) if "ToMe" in m]


def test_level_ratios_missing_every_unet_level_warn():
    model = tiny_unet("sd15")
    assert any("merges nothing" in m for m in caught(lambda: tp.apply_tome(model, level_ratios={8: 0.5})))
    assert not [m for m in caught(lambda: tp.apply_tome(model, level_ratios={2: 0.5})) if "ToMe" in m]


@pytest.mark.parametrize(
    "family, has_cross",
    [
        ("sd3", False),
        ("flux", False),
        ("qwenimage", False),
        ("hunyuanvideo", False),
        ("pixart", True),
        ("unet", True),
        ("wan", True),
    ],
)
def test_merge_crossattn_warns_where_there_is_no_cross_attention(family, has_cross):
    model = MODELS[family][0]()
    messages = [m for m in caught(lambda: tp.apply_tome(model, merge_crossattn=True)) if "merge_crossattn" in m]
    assert bool(messages) != has_cross


def test_a_grid_too_small_for_the_windows_warns_once_and_merges_nothing():
    model = tiny_flux()
    plain = forward(model, flux_inputs(h=1, w=9))
    tp.apply_tome(model, ratio=0.5)
    messages = caught(lambda: [forward(model, flux_inputs(h=1, w=9)) for _ in range(2)])
    assert len([m for m in messages if "1x9 token grid" in m]) == 1
    assert torch.equal(forward(model, flux_inputs(h=1, w=9)), plain)
    assert not caught(lambda: forward(model, flux_inputs(h=6, w=8)))


def test_a_processor_the_user_set_stays_through_diffusers_own_swaps():
    build = MODELS["pixart"][0]
    model = build()
    tp.apply_tome(model, ratio=0.5)
    model.set_attn_processor(AttnProcessor2_0())  # off, before any forward notices it
    model.set_default_attn_processor()  # diffusers' own swap must not bring ToMe back
    assert not tp.is_tome_applied(model)
    assert not any(isinstance(p, tp.ToMeProcessor) for p in model.attn_processors.values())

    model = build()
    tp.apply_tome(model, ratio=0.5)
    first = next(m for m in model.modules() if hasattr(m, "processor"))
    first.set_processor(AttnProcessor2_0())  # one module turned off by hand
    model.fuse_qkv_projections()
    assert not isinstance(first.processor, tp.ToMeProcessor) and tp.is_tome_applied(model)


def test_copying_or_saving_one_block_does_not_take_the_model_along():
    model = MODELS["flux"][0]()
    tp.apply_tome(model, ratio=0.5)
    block = model.transformer_blocks[0]
    size = sum(p.numel() for p in block.parameters())
    assert sum(p.numel() for p in copy.deepcopy(block).parameters()) == size
    loaded = pickle.loads(pickle.dumps(block))
    assert sum(p.numel() for p in loaded.parameters()) == size


def test_the_processor_signature_behaves_as_inspect_s_own():
    import functools
    import inspect

    processor = tp.ToMeProcessor(AttnProcessor2_0(), ratio=0.5)
    signature = inspect.signature(processor.__call__)
    assert list(signature.parameters)[:2] == ["attn", "hidden_states"]
    assert signature.replace(return_annotation=int).return_annotation is int
    assert pickle.loads(pickle.dumps(signature)) == signature
    assert "attn" not in inspect.signature(functools.partial(processor.__call__, None)).parameters
    signature.parameters.pop("attn")  # a caller's copy: the signature diffusers reads is unchanged
    assert "attn" in signature.parameters
