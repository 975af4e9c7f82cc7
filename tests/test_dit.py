"""ToMe on diffusion transformers: tiny random-weight PixArt, SD3 and Flux models (no downloads)."""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from diffusers import (
    FluxTransformer2DModel,
    PixArtTransformer2DModel,
    PriorTransformer,
    SD3Transformer2DModel,
)
from diffusers.models.attention_dispatch import AttentionBackendName
from diffusers.models.attention_processor import AttnProcessor2_0, JointAttnProcessor2_0
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

import tome_processors as tp
from tome_processors import ToMeConfig, ToMeProcessor
from tome_processors.bench.methods import preset_methods
from tome_processors.cli.main import main
from tome_processors.config import PRESETS
from tome_processors.families import grid_from_ids
from tome_processors.hooks import context_of
from tome_processors.merge import bipartite_soft_matching_2d, grid_partition
from tome_processors.pipeline import disable_tome, enable_tome, tome_config_of

from leftovers import hooks_left, tome_attributes_left
from pipelines import family_pipeline

TEXT_DIM, TEXT_LEN, POOLED_DIM = 12, 5, 10


def tiny_pixart(num_layers: int = 2) -> PixArtTransformer2DModel:
    torch.manual_seed(0)
    return PixArtTransformer2DModel(
        num_attention_heads=2,
        attention_head_dim=8,
        in_channels=4,
        out_channels=8,
        num_layers=num_layers,
        cross_attention_dim=16,
        sample_size=8,
        patch_size=2,
        caption_channels=TEXT_DIM,
        use_additional_conditions=False,
    ).eval()


def tiny_sd3(num_layers: int = 2) -> SD3Transformer2DModel:
    torch.manual_seed(0)
    return SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=num_layers,  # the last block is context_pre_only
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=TEXT_DIM,
        caption_projection_dim=16,
        pooled_projection_dim=POOLED_DIM,
        out_channels=4,
        pos_embed_max_size=16,
        dual_attention_layers=(0,),  # SD3.5's second, image-only attention in block 0
    ).eval()


def tiny_flux(num_layers: int = 1, num_single_layers: int = 1) -> FluxTransformer2DModel:
    torch.manual_seed(0)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=16,
        num_layers=num_layers,
        num_single_layers=num_single_layers,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=TEXT_DIM,
        pooled_projection_dim=POOLED_DIM,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6),
    ).eval()


def image_ids(h: int, w: int) -> torch.Tensor:
    """Flux's `img_ids`: (0, row, column) per token, row-major, as the Flux pipelines build them."""
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.view(h * w, 3)


@dataclass
class Arch:
    build: Callable[[], torch.nn.Module]
    inputs: Callable[..., dict]
    tokens: Callable[[int, int], int]  # image tokens of an (h, w) input


def pixart_inputs(batch: int = 2, h: int = 12, w: int = 16, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(batch, 4, h, w, generator=g),
        "encoder_hidden_states": torch.randn(batch, TEXT_LEN, TEXT_DIM, generator=g),
        "timestep": torch.full((batch,), 500),
        "added_cond_kwargs": None,
    }


def sd3_inputs(batch: int = 2, h: int = 12, w: int = 16, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(batch, 4, h, w, generator=g),
        "encoder_hidden_states": torch.randn(batch, TEXT_LEN, TEXT_DIM, generator=g),
        "pooled_projections": torch.randn(batch, POOLED_DIM, generator=g),
        "timestep": torch.full((batch,), 500.0),
    }


def flux_inputs(batch: int = 2, h: int = 6, w: int = 8, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "hidden_states": torch.randn(batch, h * w, 16, generator=g),
        "encoder_hidden_states": torch.randn(batch, TEXT_LEN, TEXT_DIM, generator=g),
        "pooled_projections": torch.randn(batch, POOLED_DIM, generator=g),
        "timestep": torch.full((batch,), 0.5),
        "img_ids": image_ids(h, w),
        "txt_ids": torch.zeros(TEXT_LEN, 3),
        "guidance": torch.full((batch,), 3.5),
    }


ARCHS = {
    "pixart": Arch(tiny_pixart, pixart_inputs, lambda h, w: (h // 2) * (w // 2)),
    "sd3": Arch(tiny_sd3, sd3_inputs, lambda h, w: (h // 2) * (w // 2)),
    "flux": Arch(tiny_flux, flux_inputs, lambda h, w: h * w),
}


def run(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_changes_output_no_nan_and_removal_is_bit_exact(arch):
    model, inputs = ARCHS[arch].build(), ARCHS[arch].inputs()
    processors = dict(model.attn_processors)
    baseline = run(model, inputs)

    tp.apply_tome(model, ratio=0.5)
    assert all(isinstance(p, ToMeProcessor) for p in model.attn_processors.values())
    merged = run(model, inputs)
    assert torch.isfinite(merged).all()
    assert not torch.allclose(merged, baseline, atol=1e-4)
    assert torch.equal(run(model, inputs), merged)  # reproducible

    tp.remove_tome(model)
    assert torch.equal(run(model, inputs), baseline)
    assert hooks_left(model) == 0 and tome_attributes_left(model) == []
    assert all(model.attn_processors[k] is p for k, p in processors.items())


@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("options", [{"merge_mlp": True}, {"use_rand": False, "ratio": 0.75}, {"share_level": True}])
def test_other_configurations_run_finite_and_differ(arch, options):
    model, inputs = ARCHS[arch].build(), ARCHS[arch].inputs()
    baseline = run(model, inputs)
    tp.apply_tome(model, **options)
    merged = run(model, inputs)
    assert torch.isfinite(merged).all() and not torch.allclose(merged, baseline, atol=1e-4)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_family_defaults_are_used_without_a_config(arch):
    model, inputs = ARCHS[arch].build(), ARCHS[arch].inputs()
    assert ToMeConfig.for_model(model) == ToMeConfig.for_model(arch)  # by model or by family name
    assert ToMeConfig.for_model(model) != ToMeConfig()  # the defaults of this family are its own

    tp.apply_tome(model, config=ToMeConfig.for_model(model))
    expected = run(model, inputs)
    tp.apply_tome(model)
    assert torch.equal(run(model, inputs), expected)
    tp.apply_tome(model, config=ToMeConfig())
    assert not torch.equal(run(model, inputs), expected)
    tp.apply_tome(model, seed=5)  # keyword options override the family's defaults
    assert context_of(model).model_state.config == ToMeConfig.for_model(model, seed=5)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_samples_of_a_batch_are_merged_independently(arch):
    # Without random destinations, a batch of two gives what each sample gives alone: nothing of one
    # sample's merge (nor, on Flux, its rotary positions) leaks into the other.
    model = ARCHS[arch].build()
    tp.apply_tome(model, ratio=0.5, use_rand=False)
    pair = run(model, ARCHS[arch].inputs(batch=2, seed=1))
    first, second = ARCHS[arch].inputs(batch=2, seed=1), ARCHS[arch].inputs(batch=2, seed=1)
    for inputs, index in ((first, 0), (second, 1)):
        for key, value in inputs.items():
            if isinstance(value, torch.Tensor) and key not in ("img_ids", "txt_ids"):
                inputs[key] = value[index : index + 1]
    alone = torch.cat([run(model, first), run(model, second)])
    torch.testing.assert_close(pair, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_token_grid_follows_the_input_size(arch):
    model = ARCHS[arch].build()
    tp.apply_tome(model, ratio=0.5)
    for h, w in ((12, 16), (8, 10), (10, 6)):
        run(model, ARCHS[arch].inputs(batch=1, h=h, w=w))
        state = context_of(model).model_state
        assert state.latent_hw[0] * state.latent_hw[1] == ARCHS[arch].tokens(h, w)
        assert state.latent_hw == ((h // 2, w // 2) if arch != "flux" else (h, w))


class RecordingJoint(JointAttnProcessor2_0):
    """SD3's joint processor, recording what it is given and what it returns."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[int, int | None, object]] = []

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        out = super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs)
        text = None if encoder_hidden_states is None else encoder_hidden_states.shape[1]
        self.calls.append((hidden_states.shape[1], text, out))
        return out


def test_sd3_merges_image_tokens_only_and_returns_the_text_output_untouched():
    model, inputs = tiny_sd3(), sd3_inputs(batch=2, h=12, w=16)
    recorder = RecordingJoint()
    model.set_attn_processor(recorder)
    tp.apply_tome(model, ratio=0.5)
    seen = []
    for block in model.transformer_blocks:
        block.attn.register_forward_hook(lambda m, a, k, out: seen.append(out), with_kwargs=True)
    run(model, inputs)

    image_tokens = 6 * 8
    joint = [call for call in recorder.calls if call[1] is not None]
    assert len(joint) == len(model.transformer_blocks) == len(seen)
    for (tokens, text, inner_out), (image_out, text_out) in zip(joint, seen, strict=True):
        assert tokens == image_tokens - int(image_tokens * 0.5)  # merged image tokens in
        assert text == TEXT_LEN  # every text token in
        assert text_out is inner_out[1]  # the text output is passed on as the inner processor made it
        assert image_out.shape[1] == image_tokens  # the image output unmerged
    # SD3.5's image-only second attention is merged too.
    assert any(call[1] is None and call[0] < image_tokens for call in recorder.calls)
    for block in model.transformer_blocks:
        block.attn._forward_hooks.clear()


class RecordingFlux(FluxAttnProcessor):
    """Flux's processor, recording the tokens and rotary tables it is given."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[torch.Tensor, torch.Tensor | None, tuple | None]] = []

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        self.calls.append((hidden_states, encoder_hidden_states, image_rotary_emb))
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


@pytest.mark.parametrize("batch", [1, 2])
def test_flux_rotary_embeddings_follow_the_merged_tokens(batch):
    model, inputs = tiny_flux(), flux_inputs(batch=batch, h=6, w=8)
    recorder = RecordingFlux()
    model.set_attn_processor(recorder)
    tp.apply_tome(model, ratio=0.5)
    run(model, inputs)

    image_tokens = 6 * 8
    kept = image_tokens - int(image_tokens * 0.5)
    ids = torch.cat([inputs["txt_ids"], inputs["img_ids"]])
    cos_full, sin_full = model.pos_embed(ids)
    double, single = recorder.calls[:batch], recorder.calls[batch:]
    assert len(single) == batch  # one call per sample: rotary tables differ per sample
    for hidden_states, text, (cos, sin) in double + single:
        text_len = TEXT_LEN if text is not None else 0
        assert hidden_states.shape[:2] == (1, kept + TEXT_LEN - text_len)
        if text is not None:
            assert text.shape[1] == TEXT_LEN  # text passed whole
        assert cos.shape[0] == TEXT_LEN + kept
        # Text positions unchanged; every merged row rotated exactly as one real image position,
        # each position used at most once.
        torch.testing.assert_close(cos[:TEXT_LEN], cos_full[:TEXT_LEN], rtol=0, atol=0)
        match = (cos[TEXT_LEN:, None] == cos_full[None, TEXT_LEN:]).all(-1) & (
            sin[TEXT_LEN:, None] == sin_full[None, TEXT_LEN:]
        ).all(-1)
        assert (match.sum(1) == 1).all() and (match.sum(0) <= 1).all()


def test_flux_single_blocks_leave_the_text_part_of_the_output_in_place():
    # With ratio 0 nothing is merged: the single-block path must give back exactly the original output.
    model, inputs = tiny_flux(), flux_inputs()
    baseline = run(model, inputs)
    with pytest.warns(UserWarning, match="merges nothing"):
        tp.apply_tome(model, ratio=0.0)
    assert torch.equal(run(model, inputs), baseline)


def test_flux_timestep_is_read_on_the_thousand_scale():
    model = tiny_flux()
    tp.apply_tome(model, ratio=0.5, ratio_start=0.1)  # a schedule reads the timestep
    run(model, flux_inputs(batch=1))
    assert context_of(model).model_state.timestep == pytest.approx(500.0)


def test_flux_inputs_without_a_grid_are_not_merged_and_warn():
    model, inputs = tiny_flux(), flux_inputs(batch=1)
    inputs["img_ids"] = inputs["img_ids"].flip(0)  # not row-major
    baseline = run(model, inputs)
    tp.apply_tome(model, ratio=0.5)
    with pytest.warns(UserWarning, match="img_ids"):
        assert torch.equal(run(model, inputs), baseline)


def test_grid_from_ids():
    assert grid_from_ids(image_ids(3, 5), 15) == (3, 5)
    assert grid_from_ids(image_ids(3, 5), 16) is None
    assert grid_from_ids(torch.cat([image_ids(2, 2), image_ids(2, 2)]), 8) is None  # Kontext-style extra image


def test_pixart_downsample_kv_runs_but_joint_attention_refuses_it():
    model, inputs = tiny_pixart(), pixart_inputs()
    baseline = run(model, inputs)
    tp.apply_tome(model, mode="downsample_kv")
    pooled = run(model, inputs)
    assert torch.isfinite(pooled).all() and not torch.allclose(pooled, baseline, atol=1e-4)

    for build in (tiny_sd3, tiny_flux):
        model = build()
        processors = dict(model.attn_processors)
        with pytest.raises(ValueError, match=f'Expected mode="merge" on {type(model).__name__}'):
            tp.apply_tome(model, mode="downsample_kv")
        assert hooks_left(model) == 0 and dict(model.attn_processors) == processors


def test_unsupported_model_family_is_named_and_nothing_changes():
    torch.manual_seed(0)
    # unCLIP's prior: `BasicTransformerBlock`s over embeddings, no image tokens.
    prior = PriorTransformer(
        num_attention_heads=2, attention_head_dim=4, num_layers=1, embedding_dim=8, num_embeddings=7,
        additional_embeddings=4,
    )  # fmt: skip
    processors = {name: m.processor for name, m in prior.named_modules() if hasattr(m, "processor")}
    with pytest.raises(ValueError, match="but got PriorTransformer"):
        tp.apply_tome(prior)
    assert hooks_left(prior) == 0
    assert processors and all(prior.get_submodule(name).processor is p for name, p in processors.items())


@pytest.mark.parametrize(
    ("arch", "inner"), [("pixart", AttnProcessor2_0), ("sd3", JointAttnProcessor2_0), ("flux", FluxAttnProcessor)]
)
def test_set_attn_processor_matches_apply_tome(arch, inner):
    model, inputs = ARCHS[arch].build(), ARCHS[arch].inputs()
    config = ToMeConfig(ratio=0.5)
    tp.apply_tome(model, config=config)
    expected = run(model, inputs)
    tp.remove_tome(model)

    model.set_attn_processor(ToMeProcessor(inner(), config))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: the first forward (keyword call) merges
        assert torch.equal(run(model, inputs), expected)
    assert tp.is_tome_applied(model)
    assert torch.equal(run(model, inputs), expected)
    tp.remove_tome(model)
    assert hooks_left(model) == 0 and tome_attributes_left(model) == []


def test_pixart_positional_call_is_merged_from_the_first_forward():
    # The pipeline passes the latents by position and the timestep by keyword: both are read from
    # the call itself, so the random destinations (keyed by the timestep) match too.
    model, inputs = tiny_pixart(), pixart_inputs()
    baseline = run(model, inputs)
    tp.apply_tome(model, config=ToMeConfig(use_rand=True))
    expected = run(model, inputs)
    assert not torch.equal(expected, baseline)
    tp.remove_tome(model)
    model.set_attn_processor(ToMeProcessor(use_rand=True))
    hidden_states = inputs.pop("hidden_states")
    with torch.no_grad():
        assert torch.equal(model(hidden_states, **inputs).sample, expected)


def test_set_attention_backend_reaches_the_inner_processor():
    model, inputs = tiny_flux(), flux_inputs()
    baseline = run(model, inputs)
    tp.apply_tome(model, ratio=0.0 + 0.5)
    merged = run(model, inputs)
    model.set_attention_backend("native")
    wrappers = list(model.attn_processors.values())
    assert all(w.inner._attention_backend == AttentionBackendName.NATIVE for w in wrappers)
    assert all(w._attention_backend == AttentionBackendName.NATIVE for w in wrappers)
    assert "_attention_backend" not in wrappers[0].__dict__
    torch.testing.assert_close(run(model, inputs), merged)
    model.reset_attention_backend()
    assert all(w.inner._attention_backend is None for w in wrappers)
    tp.remove_tome(model)
    assert torch.equal(run(model, inputs), baseline)

    pixart = tiny_pixart()  # processors without a backend attribute are left alone
    tp.apply_tome(pixart)
    assert not any(hasattr(p, "_attention_backend") for p in pixart.attn_processors.values())


class FakePipeline:
    def __init__(self, transformer: torch.nn.Module) -> None:
        self.transformer = transformer


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_pipeline_with_a_transformer(arch):
    model, inputs = ARCHS[arch].build(), ARCHS[arch].inputs()
    baseline = run(model, inputs)
    pipe = FakePipeline(model)
    assert tp.apply_tome(pipe) is pipe and tp.is_tome_applied(pipe)
    assert not torch.allclose(run(model, inputs), baseline, atol=1e-4)
    tp.remove_tome(pipe)
    assert torch.equal(run(model, inputs), baseline)

    assert enable_tome(pipe) is pipe and tp.is_tome_applied(pipe)
    assert tome_config_of(pipe) == ToMeConfig.for_model(model)
    merged = run(model, inputs)
    assert not torch.allclose(merged, baseline, atol=1e-4)
    # Processors replaced while enabled (here: the same inner ones set again) are wrapped again.
    model.set_attn_processor({name: proc.inner for name, proc in model.attn_processors.items()})
    assert all(isinstance(proc, tp.ToMeProcessor) for proc in model.attn_processors.values())
    assert torch.equal(run(model, inputs), merged)
    disable_tome(pipe)
    assert torch.equal(run(model, inputs), baseline) and hooks_left(model) == 0


@pytest.mark.parametrize(("h", "w", "r"), [(4, 6, 10), (5, 7, 0), (6, 6, 27)])
def test_row_token_is_a_token_of_its_row_and_the_destination_of_merged_rows(h, w, r):

    metric = torch.randn(3, h * w, 8, generator=torch.Generator().manual_seed(h * w + r))
    merge = bipartite_soft_matching_2d(metric, h, w, 2, 2, r, with_row_token=True)
    assert bipartite_soft_matching_2d(metric, h, w, 2, 2, r).row_token is None or r == 0
    rows = merge.token_row.view(3, h * w)
    dst, _ = grid_partition(h, w, 2, 2)
    assert merge.row_token.shape == (3, merge.num_rows)
    for b in range(3):
        own_rows = rows[b].index_select(0, merge.row_token[b]) - b * merge.num_rows
        assert torch.equal(own_rows, torch.arange(merge.num_rows))  # each kept token lies in its row
        merged_rows = (merge.row_size.view(3, merge.num_rows)[b] > 1).nonzero().squeeze(1)
        assert torch.isin(merge.row_token[b, merged_rows], dst).all()  # rows with several tokens: the destination


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_bench_rows_for_transformer_architectures(arch, tmp_path, capsys):

    path = tmp_path / f"{arch}.json"
    argv = ["bench", "--quick", "--arch", arch, "--rounds", "1", "--no-progress", "--no-memory", "--ratios", "0.5"]
    assert main([*argv, "--modes", "kv-avg", "bf16", "--json", str(path)]) == 0
    rows = {row["name"]: row for row in json.loads(path.read_text())["rows"]}
    pooled = ["ours kv-avg"] if arch == "pixart" else []  # joint attention has no K/V pooling
    presets = [m.name for m in preset_methods(PRESETS, arch, auto_downsample=1)]
    assert sorted(rows) == sorted(["baseline", "ours r=0.5", "ours bf16-sim r=0.5", *presets, *pooled])  # no tomesd
    assert len(set(presets)) == 3 and all(rows[name]["rel_error"] > 0 for name in presets)
    for name in ("ours r=0.5", "ours bf16-sim r=0.5"):
        assert 0.0 < rows[name]["rel_error"] < 1.0
        assert rows[name]["overhead_share"] > 0  # the block inputs were recorded on the patch grid
    if not pooled:
        assert "left out" in capsys.readouterr().err


def test_flux_pipelines_reset_the_context_at_the_end_of_a_call(tmp_path):
    pipe, args = family_pipeline("flux", tmp_path)
    tp.apply_tome(pipe, recompute_every=2)
    model = pipe.transformer
    state = context_of(model).model_state
    seen = []
    handle = model.register_forward_hook(lambda *_: seen.append((state.latent_hw, bool(state.kept))))
    pipe(**args, num_inference_steps=2, generator=torch.Generator().manual_seed(0))
    assert seen and all(hw is not None and kept for hw, kept in seen)  # merged during the call
    # Every call ends with `maybe_free_model_hooks()`, which ToMe's pipeline watch follows.
    assert state.latent_hw is None and state.kept == {} and state.step == 0
    assert context_of(model).grid_hint is None
    tp.remove_tome(pipe)
    handle.remove()
    # diffusers' own pipeline call leaves a hook registry on the transformer: count torch hooks only.
    assert sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()) == 0
    assert tome_attributes_left(model) == [] and "maybe_free_model_hooks" not in vars(pipe)


def test_flux_under_inference_mode_with_inference_tensors():
    model = tiny_flux()
    tp.apply_tome(model, ratio=0.5)
    expected = run(model, flux_inputs())
    with torch.inference_mode():  # img_ids made here are inference tensors (no version counter)
        inputs = flux_inputs()
        for _ in range(2):
            assert torch.equal(model(**inputs).sample, expected)
