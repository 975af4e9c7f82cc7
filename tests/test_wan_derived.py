"""Wan-Animate, ChronoEdit and Helios beyond the family table (tests/family_cases/wan_derived.py): what each family
leaves whole, Helios's other block configurations and table layouts, and Wan-Animate 2's refusal."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from diffusers import WanAnimate2Transformer3DModel
from diffusers.models.transformers.transformer_wan_animate import WanAnimateFaceBlockAttnProcessor

import tome_processors as tp
from tome_processors.bench.dit import TRANSFORMER_ARCHITECTURES
from tome_processors.cli.main import main
from tome_processors.families import ChronoEditFamily, HeliosFamily, Layout, WanAnimateFamily, WanFamily, family_of

from family_cases.wan_derived import (
    helios_inputs,
    tiny_chronoedit,
    tiny_helios,
    tiny_wan_animate,
    wan_animate_inputs,
)
from leftovers import hooks_left, tome_attributes_left


def run(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample


def query_tokens(modules: list[torch.nn.Module]) -> tuple[list[int], list]:
    """The tokens each of `modules` projects to queries (`to_q`), per call, in call order."""
    seen: list[int] = []
    handles = [m.to_q.register_forward_pre_hook(lambda _, args: seen.append(int(args[0].shape[1]))) for m in modules]
    return seen, handles


def test_the_families_are_wans_with_its_presets():
    for build, family_type in (
        (tiny_wan_animate, WanAnimateFamily),
        (tiny_chronoedit, ChronoEditFamily),
        (tiny_helios, HeliosFamily),
    ):
        family = family_of(build())
        assert type(family) is family_type and isinstance(family, WanFamily) and family.video
        assert family.presets == WanFamily.presets and family.defaults == WanFamily.defaults
    assert WanAnimateFamily.extra_latent_frames == 1 and HeliosFamily.extra_latent_frames == 0


def test_wan_animate_grid_counts_the_reference_frame_and_explain_does_too():
    model, inputs = tiny_wan_animate(), wan_animate_inputs(clip_frames=2)
    assert family_of(model).token_grid(model, (), inputs) == (3, 6, 8)
    # 5 pixel frames: 2 latent frames and the reference image's, of 32 / 16 = 2 x 2 tokens.
    rows = tp.explain_tome(model, 32, 32, num_frames=5, preset="balanced", print_table=False)
    assert {row.tokens for row in rows} == {3 * 2 * 2}


def test_wan_animate_face_adapter_gets_every_token_and_its_own_processor():
    model, inputs = tiny_wan_animate(), wan_animate_inputs()
    adapter = model.face_adapter[0]
    blocks = [site.module for site in family_of(model).blocks(model)]
    assert blocks == list(model.blocks) and all(adapter not in b.modules() for b in blocks)
    seen, handles = query_tokens([model.blocks[0].attn1, adapter])
    model.set_attn_processor(tp.ToMeProcessor(ratio=0.5))
    with warnings.catch_warnings():
        warnings.simplefilter("error", tp.ToMeSkipWarning)
        run(model, inputs)
    for handle in handles:
        handle.remove()
    assert seen == [72, 144]  # the block's self-attention merged, the adapter's queries all 3 frames x 48
    # The adapter runs its own processor, on every token, as without ToMe.
    hidden = torch.randn(2, 144, 24, generator=torch.Generator().manual_seed(1))
    motion = torch.randn(2, 3, 3, 24, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        wrapped = adapter(hidden, motion)
        adapter.set_processor(WanAnimateFaceBlockAttnProcessor())
        assert torch.equal(adapter(hidden, motion), wrapped)
    tp.remove_tome(model)
    assert hooks_left(model) == 0 and tome_attributes_left(model) == []


def test_helios_merges_only_the_clip_after_its_history():
    model, inputs = tiny_helios(), helios_inputs()
    family = family_of(model)
    sites = family.blocks(model)
    assert [[(a.module, a.layout, a.is_cross) for a in site.attentions] for site in sites] == [
        [(block.attn1, Layout.TEXT_FIRST, False), (block.attn2, Layout.IMAGE, True)] for block in model.blocks
    ]
    assert family.token_grid(model, (), inputs) == (2, 6, 8)
    baseline = run(model, inputs)
    seen, handles = query_tokens([model.blocks[0].attn1, model.blocks[0].attn2])
    tp.apply_tome(model, ratio=0.5, merge_crossattn=True)
    merged = run(model, inputs)
    for handle in handles:
        handle.remove()
    # 124 history tokens (16 + 12 + 96) whole, the clip's 96 halved; the cross-attention gets the clip's alone.
    assert seen == [124 + 48, 48]
    assert torch.isfinite(merged).all() and not torch.allclose(merged, baseline, atol=1e-4)
    tp.remove_tome(model)
    assert torch.equal(run(model, inputs), baseline)


def test_helios_rotary_tables_for_the_whole_batch_or_per_sample_give_one_output():
    # The pipeline passes frame indices of batch 1 (one table for the batch); per-sample indices make (B, S, 2D).
    model, inputs = tiny_helios(), helios_inputs(batch=2)
    per_sample = {k: v.expand(2, -1) if k.startswith("indices") else v for k, v in inputs.items()}
    tp.apply_tome(model, ratio=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error", tp.ToMeSkipWarning)
        torch.testing.assert_close(run(model, inputs), run(model, per_sample), rtol=0, atol=1e-6)
    tp.remove_tome(model)


def test_helios_clip_alone_merges_as_its_grid():
    model, inputs = tiny_helios(), helios_inputs(history=False)
    seen, handles = query_tokens([model.blocks[1].attn1])
    tp.apply_tome(model, ratio=0.5)
    out = run(model, inputs)
    for handle in handles:
        handle.remove()
    tp.remove_tome(model)
    assert seen == [48] and torch.isfinite(out).all()


def test_helios_cross_attention_over_history_and_clip_merges_the_clip():
    # Without `guidance_cross_attn` the block's cross-attention gets the history too: declared like attn1.
    model, inputs = tiny_helios(guidance_cross_attn=False), helios_inputs()
    layouts = [[a.layout for a in site.attentions] for site in family_of(model).blocks(model)]
    assert layouts == [[Layout.TEXT_FIRST, Layout.TEXT_FIRST]] * 2
    baseline = run(model, inputs)
    seen, handles = query_tokens([model.blocks[0].attn2])
    tp.apply_tome(model, ratio=0.5, merge_crossattn=True)
    merged = run(model, inputs)
    for handle in handles:
        handle.remove()
    assert seen == [124 + 48] and not torch.allclose(merged, baseline, atol=1e-4)
    tp.remove_tome(model)


def test_helios_amplified_history_keys_leave_the_self_attention_whole():
    # Its processor finds the history as the tokens before the last `original_context_length` (the clip's unmerged
    # count): merged, it would scale other keys. Such blocks' attn1 is not declared.
    model, inputs = tiny_helios(is_amplify_history=True), helios_inputs()
    sites = family_of(model).blocks(model)
    assert [[a.module for a in site.attentions] for site in sites] == [[block.attn2] for block in model.blocks]
    baseline = run(model, inputs)
    tp.apply_tome(model, ratio=0.5)
    assert torch.equal(run(model, inputs), baseline)  # nothing else is merged by default
    tp.remove_tome(model)


def test_wan_animate_2_is_refused_by_name():
    # Its self-attention builds rotary positions from `grid_sizes`, caches the reference's keys and scatters the
    # queries frame by frame into a flex-attention buffer (families/wan_derived.py): no family.
    torch.manual_seed(0)
    model = WanAnimate2Transformer3DModel(
        in_dim=8, dim=24, ffn_dim=32, freq_dim=32, text_dim=16, out_dim=4, num_heads=2, num_layers=1, use_img_emb=False
    )
    with pytest.raises(ValueError, match="WanAnimate2Transformer3DModel"):
        tp.apply_tome(model)
    assert hooks_left(model) == 0


@pytest.mark.parametrize("arch", ["wan-animate", "chronoedit", "helios"])
def test_bench_architectures_run_quick_at_one_block(arch, tmp_path):
    full = TRANSFORMER_ARCHITECTURES[arch]
    fields = ("num_layers", "num_attention_heads", "attention_head_dim", "ffn_dim", "text_dim")
    assert [full[name] for name in fields] == [40, 40, 128, 13824, 4096]  # the 14 B Wan shape
    path = tmp_path / f"{arch}.json"
    argv = ["bench", "--quick", "--rounds", "1", "--no-progress", "--no-memory", "--no-trained-quality"]
    argv += ["--no-host-cost", "--arch", arch, "--presets", "balanced", "--frames", "5", "--layers", "1"]
    assert main([*argv, "--json", str(path)]) == 0
    rows = {row["name"]: row for row in json.loads(path.read_text())["rows"]}
    assert sorted(rows) == ["baseline", "ours balanced r=0.75"]
    assert 0 < rows["ours balanced r=0.75"]["rel_error"] < 1
