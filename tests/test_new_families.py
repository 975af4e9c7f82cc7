"""The joint text-image families with rotary positions beyond FLUX.1: Qwen-Image (and Edit), FLUX.2, Chroma, Z-Image.

One table of (name, tiny random-weight model, inputs) feeds the same checks: ToMe merges (the output
changes at 0.5), ratio 0 and removal give the plain model's output bit for bit, merged rows keep their
rotary positions per sample (a batch of two equals two batches of one), and the families' grids and
block lists are what the models hold.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
from diffusers import (
    ChromaTransformer2DModel,
    Flux2Transformer2DModel,
    QwenImageTransformer2DModel,
    ZImageTransformer2DModel,
)

import tome_processors as tp
from tome_processors.families import Span, family_of

TEXT = 7  # text tokens: not a multiple of anything, so an off-by-text error shows


def tiny_qwenimage(num_layers: int = 2) -> QwenImageTransformer2DModel:
    torch.manual_seed(0)
    return QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16,
        out_channels=4,
        num_layers=num_layers,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=(8, 4, 4),
    ).eval()


def qwenimage_inputs(batch: int = 2, h: int = 6, w: int = 8, reference: tuple[int, int] | None = None) -> dict:
    """As the Qwen-Image pipelines call the model; with `reference`, Qwen-Image-Edit's appended image."""
    generator = torch.Generator().manual_seed(0)
    tokens = h * w + (reference[0] * reference[1] if reference else 0)
    shapes = [(1, h, w), *([(1, *reference)] if reference else [])]
    return {
        "hidden_states": torch.randn(batch, tokens, 16, generator=generator),
        "encoder_hidden_states": torch.randn(batch, TEXT, 16, generator=generator),
        "encoder_hidden_states_mask": torch.ones(batch, TEXT, dtype=torch.long),
        "timestep": torch.full((batch,), 0.6),
        "img_shapes": [shapes] * batch,
    }


def ids(h: int, w: int, columns: int) -> torch.Tensor:
    """Packed-token ids as the Flux pipelines build them: rows in column 1, columns in column 2."""
    out = torch.zeros(h, w, columns)
    out[..., 1] = torch.arange(h)[:, None]
    out[..., 2] = torch.arange(w)[None]
    return out.view(h * w, columns)


def tiny_flux2(num_layers: int = 1, num_single_layers: int = 2) -> Flux2Transformer2DModel:
    torch.manual_seed(0)
    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=8,
        num_layers=num_layers,
        num_single_layers=num_single_layers,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        timestep_guidance_channels=32,
        axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=False,
    ).eval()


def flux2_inputs(batch: int = 2, h: int = 6, w: int = 8) -> dict:
    generator = torch.Generator().manual_seed(0)
    text_ids = torch.zeros(TEXT, 4)
    text_ids[:, 3] = torch.arange(TEXT)
    return {
        "hidden_states": torch.randn(batch, h * w, 8, generator=generator),
        "encoder_hidden_states": torch.randn(batch, TEXT, 16, generator=generator),
        "timestep": torch.full((batch,), 0.6),
        "img_ids": ids(h, w, 4),
        "txt_ids": text_ids,
    }


def tiny_chroma(num_layers: int = 1, num_single_layers: int = 2) -> ChromaTransformer2DModel:
    torch.manual_seed(0)
    return ChromaTransformer2DModel(
        patch_size=1,
        in_channels=8,
        num_layers=num_layers,
        num_single_layers=num_single_layers,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=16,
        axes_dims_rope=(4, 6, 6),
        approximator_num_channels=8,
        approximator_hidden_dim=16,
        approximator_layers=1,
    ).eval()


def chroma_inputs(batch: int = 2, h: int = 6, w: int = 8, padded: int = 0) -> dict:
    """As ChromaPipeline calls the model; `padded` text tokens masked out (its mask covers text and image)."""
    generator = torch.Generator().manual_seed(0)
    inputs = {
        "hidden_states": torch.randn(batch, h * w, 8, generator=generator),
        "encoder_hidden_states": torch.randn(batch, TEXT, 16, generator=generator),
        "timestep": torch.full((batch,), 0.6),
        "img_ids": ids(h, w, 3),
        "txt_ids": torch.zeros(TEXT, 3),
    }
    if padded:
        mask = torch.ones(batch, TEXT + h * w, dtype=torch.bool)
        mask[:, TEXT - padded : TEXT] = False
        inputs["attention_mask"] = mask
    return inputs


def tiny_zimage(n_layers: int = 2) -> ZImageTransformer2DModel:
    torch.manual_seed(0)
    return ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=4,
        dim=32,
        n_layers=n_layers,
        n_refiner_layers=1,
        n_heads=2,
        n_kv_heads=2,
        cap_feat_dim=16,
        axes_dims=[8, 4, 4],
        axes_lens=[256, 32, 32],
    ).eval()


def zimage_inputs(batch: int = 2, h: int = 6, w: int = 8, text: tuple[int, ...] | None = None) -> dict:
    """As ZImagePipeline calls the model: a latent `(C, 1, H, W)` and a caption per sample, `t` in 0..1."""
    generator = torch.Generator().manual_seed(0)
    lengths = text or (TEXT,) * batch
    return {
        "x": [torch.randn(4, 1, 2 * h, 2 * w, generator=generator) for _ in range(batch)],
        "t": torch.full((batch,), 0.4),
        "cap_feats": [torch.randn(n, 16, generator=generator) for n in lengths],
    }


class Case(NamedTuple):
    build: Callable[[], torch.nn.Module]
    inputs: Callable[..., dict]
    family: str
    merged_blocks: int  # blocks whose attention merges in one forward of the tiny model


CASES = {
    "qwenimage": Case(tiny_qwenimage, qwenimage_inputs, "qwenimage", 2),
    "qwenimage-edit": Case(tiny_qwenimage, lambda **k: qwenimage_inputs(reference=(4, 4), **k), "qwenimage", 2),
    "flux2": Case(tiny_flux2, flux2_inputs, "flux2", 3),
    "chroma": Case(tiny_chroma, chroma_inputs, "chroma", 3),
    "chroma-masked": Case(tiny_chroma, lambda **k: chroma_inputs(padded=3, **k), "chroma", 3),
    "zimage": Case(tiny_zimage, zimage_inputs, "zimage", 3),
    "zimage-masked": Case(tiny_zimage, lambda **k: zimage_inputs(text=(TEXT, 40), **k), "zimage", 3),
}


def run(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs, return_dict=False)[0]
    return torch.stack(out) if isinstance(out, list) else out


def count_merges(model: torch.nn.Module, inputs: dict) -> int:
    """Attention calls that ran on merged tokens in one forward."""
    from tome_processors import joint_attention

    calls = []
    original = joint_attention._call

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(joint_attention, "_call", counting)
        run(model, inputs)
    return len(calls)


@pytest.mark.parametrize("case", sorted(CASES))
def test_merges_and_removal_restores_the_model_bit_for_bit(case):
    build, make_inputs, _, merged_blocks = CASES[case]
    model, inputs = build(), make_inputs()
    plain = run(model, inputs)
    tp.apply_tome(model, ratio=0.5)
    assert count_merges(model, inputs) == merged_blocks
    merged = run(model, inputs)
    assert merged.shape == plain.shape and torch.isfinite(merged).all()
    assert not torch.allclose(merged, plain, atol=1e-4), "ToMe at 0.5 changed nothing"
    tp.remove_tome(model)
    assert torch.equal(run(model, inputs), plain)


@pytest.mark.parametrize("case", sorted(CASES))
def test_ratio_zero_is_the_plain_model(case):
    build, make_inputs, _, _ = CASES[case]
    model, inputs = build(), make_inputs()
    plain = run(model, inputs)
    tp.apply_tome(model, ratio=0.0)
    assert torch.equal(run(model, inputs), plain)


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_sample_keeps_its_own_merge_and_rotary_positions(case):
    # A batch of two (each sample merged on its own, its rows at their own positions) equals two batches of
    # one; `use_rand=False` so both calls draw the same partition.
    build, make_inputs, _, _ = CASES[case]
    model = build()
    tp.apply_tome(model, ratio=0.5, use_rand=False)
    both = run(model, make_inputs(batch=2))
    if case == "zimage-masked":  # the samples' captions differ in length: each alone has its own
        pytest.skip("samples of different caption lengths are padded only in a batch")
    single = make_inputs(batch=2)
    for b in range(2):
        one = {k: _sample(v, b) for k, v in single.items()}
        torch.testing.assert_close(run(model, one)[0], both[b], rtol=1e-4, atol=1e-5)


def _sample(value, b: int):
    if isinstance(value, torch.Tensor) and value.ndim >= 1 and value.shape[0] == 2:
        return value[b : b + 1]
    if isinstance(value, list) and len(value) == 2:
        return value[b : b + 1]
    return value


@pytest.mark.parametrize("case", sorted(CASES))
def test_presets_apply_and_merge(case):
    build, make_inputs, family, _ = CASES[case]
    model, inputs = build(), make_inputs()
    plain = run(model, inputs)
    for preset in ("exact", "balanced", "fast"):
        tp.apply_tome(model, preset=preset)
        out = run(model, inputs)
        assert torch.isfinite(out).all() and not torch.equal(out, plain), preset
    assert family_of(model).name == family


def test_families_find_the_blocks_grid_and_timestep():
    qwen = family_of(tiny_qwenimage())
    assert len(qwen.blocks(tiny_qwenimage())) == 2
    assert qwen.token_grid(None, (), qwenimage_inputs(h=6, w=8, reference=(4, 4))) == (6, 8)
    assert float(qwen.timestep((), qwenimage_inputs(batch=1))[0]) == pytest.approx(600.0)
    chroma = family_of(tiny_chroma())
    sites = chroma.blocks(tiny_chroma())
    assert [s.span for s in sites] == [Span.WHOLE, Span.TRAILING, Span.TRAILING]
    assert chroma.token_grid(tiny_chroma(), (), chroma_inputs(h=5, w=9)) == (5, 9)
    assert family_of(tiny_flux2()).token_grid(tiny_flux2(), (), flux2_inputs(h=3, w=4)) == (3, 4)
    zimage = family_of(tiny_zimage())
    assert len(zimage.blocks(tiny_zimage())) == 3  # the noise refiner's and the main layers; not the caption's
    assert zimage.token_grid(None, (), zimage_inputs(h=5, w=7)) == (5, 7)
    # Z-Image's t rises towards the clean image: ToMe's timestep is the noise level on 0..1000.
    assert float(zimage.timestep((), zimage_inputs(batch=1))[0]) == pytest.approx(600.0)


def test_qwenimage_edit_never_merges_the_reference_image():
    # The reference image's tokens pass through as rows of their own: each comes out of merge and unmerge
    # as it went in, whatever the generated image's tokens do.
    from tome_processors import joint_attention

    model, inputs = tiny_qwenimage(), qwenimage_inputs(reference=(4, 4))
    tp.apply_tome(model, ratio=0.5)
    seen = []
    original = joint_attention._call

    def recording(inner, attn, merged, args, kwargs, merge, spec, at):
        seen.append((merged.shape[1], merge))
        return original(inner, attn, merged, args, kwargs, merge, spec, at)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(joint_attention, "_call", recording)
        run(model, inputs)
    assert seen
    reference = inputs["hidden_states"][:, 48:]
    for rows, merge in seen:
        assert rows == 48 - int(48 * 0.5) + 16
        x = torch.randn(2, 64, 5)
        x[:, 48:, :1] = reference[..., :1]
        out = merge.unmerge(merge.merge(x))
        assert torch.equal(out[:, 48:], x[:, 48:])
        assert not torch.equal(out[:, :48], x[:, :48])


def test_a_text_mask_is_cut_to_the_merged_sequence():
    # Chroma masks the prompt's padding: with ToMe the padded text stays masked. Changing what sits in the
    # masked text tokens must not change the output, with or without ToMe.
    model = tiny_chroma()
    tp.apply_tome(model, ratio=0.5)
    inputs = chroma_inputs(padded=3)
    out = run(model, inputs)
    changed = dict(inputs, encoder_hidden_states=inputs["encoder_hidden_states"].clone())
    changed["encoder_hidden_states"][:, TEXT - 3 :] += 5.0
    torch.testing.assert_close(run(model, changed), out, rtol=1e-4, atol=1e-5)


def test_apply_tome_refuses_k_v_pooling_on_the_joint_families():
    for build in (tiny_qwenimage, tiny_flux2, tiny_chroma, tiny_zimage):
        with pytest.raises(ValueError, match='Expected mode="merge"'):
            tp.apply_tome(build(), mode="downsample_kv")
