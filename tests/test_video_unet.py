"""UNet video models: Stable Video Diffusion (`UNetSpatioTemporalConditionModel`) and AnimateDiff (`UNetMotionModel`).

Both merge frame by frame: their spatial blocks see `(batch * frames, h * w, C)` tokens, and the blocks that
attend across frames (SVD's `TemporalBasicTransformerBlock`s, AnimateDiff's motion modules) never merge.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from diffusers import UNetMotionModel
from diffusers.models.attention import BasicTransformerBlock, TemporalBasicTransformerBlock
from diffusers.models.transformers.transformer_temporal import TransformerSpatioTemporalModel

import tome_processors as tp
from tome_processors import ToMeConfig, ToMeProcessor
from tome_processors import context as context_module
from tome_processors.context import SLOT_ATTR
from tome_processors.families import family_of
from tome_processors.hooks import context_of

from pipelines import svd_inputs, tiny_animatediff_pipeline, tiny_svd_pipeline, tiny_svd_unet

pytestmark = pytest.mark.usefixtures("one_thread")


def run(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample


class MergeRecorder:
    """Every merge computed in the forwards inside: `(block index, batch, tokens)`."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.merges: list[tuple[int, int, int]] = []
        original = context_module.BlockState.merge_for

        def merge_for(block, config, *args, **kwargs):
            merge = original(block, config, *args, **kwargs)
            if merge is not None:
                self.merges.append((block.index, merge.batch, merge.num_tokens))
            return merge

        monkeypatch.setattr(context_module.BlockState, "merge_for", merge_for)


# ---- Stable Video Diffusion: the model ------------------------------------------------------------------


def test_svd_family_holds_the_spatial_blocks_only():
    unet = tiny_svd_unet()
    family = family_of(unet)
    spatial = [b for m in unet.modules() if isinstance(m, TransformerSpatioTemporalModel) for b in m.transformer_blocks]
    temporal = [m for m in unet.modules() if isinstance(m, TemporalBasicTransformerBlock)]
    assert family.name == "svd" and len(spatial) == len(temporal) == 6
    assert [site.module for site in family.blocks(unet)] == spatial
    assert all(isinstance(b, BasicTransformerBlock) for b in spatial)
    assert family.auto_downsample(unet) == 1

    tp.apply_tome(unet)
    assert all(isinstance(p, ToMeProcessor) for p in unet.attn_processors.values())
    temporal_attention = [a for block in temporal for a in (block.attn1, block.attn2) if a is not None]
    assert temporal_attention and not any(SLOT_ATTR in vars(a) for a in temporal_attention)
    assert all(SLOT_ATTR in vars(block.attn1) for block in spatial)


def test_svd_merges_each_frame_and_never_a_temporal_block(monkeypatch):
    # 2 videos x 3 frames of a 16x24 latent (not square): the five level-1 blocks merge 6 frames of 384
    # tokens each; the level-2 block (mid) is above the default max_downsample; nothing else merges.
    unet = tiny_svd_unet()
    inputs = svd_inputs(batch=2, frames=3, height=16, width=24)
    baseline = run(unet, inputs)
    tp.apply_tome(unet)
    recorder = MergeRecorder(monkeypatch)
    merged = run(unet, inputs)
    # Module order: two down blocks, three up blocks, then the mid block (5), which is at level 2.
    assert sorted(index for index, _, _ in recorder.merges) == [0, 1, 2, 3, 4]
    assert {(batch, tokens) for _, batch, tokens in recorder.merges} == {(6, 16 * 24)}
    assert torch.isfinite(merged).all() and not torch.allclose(merged, baseline, atol=1e-4)
    assert torch.equal(run(unet, inputs), merged)  # reproducible
    tp.remove_tome(unet)
    assert torch.equal(run(unet, inputs), baseline)


def test_svd_temporal_attention_sees_every_token(monkeypatch):
    # The temporal blocks' attention gets (batch * h * w, frames, C) tokens, merged or not.
    unet = tiny_svd_unet()
    inputs = svd_inputs(batch=1, frames=4)
    seen: dict[str, list] = {"plain": [], "tome": []}
    temporal = [m.attn1 for m in unet.modules() if isinstance(m, TemporalBasicTransformerBlock)]
    spatial = [site.attentions[0].module for site in family_of(unet).blocks(unet)]
    key = "plain"

    def record(module, args, kwargs):
        seen[key].append(tuple(kwargs.get("hidden_states", args[0] if args else None).shape))

    handles = [a.register_forward_pre_hook(record, with_kwargs=True) for a in temporal]
    run(unet, inputs)
    tp.apply_tome(unet)
    key = "tome"
    inner_shapes = []
    for attn in spatial[:1]:  # what the inner processor of a spatial block's self-attention gets: merged tokens
        inner = attn.processor.inner

        def spy(attn_module, hidden_states, *args, _inner=inner, **kwargs):
            inner_shapes.append(tuple(hidden_states.shape))
            return _inner(attn_module, hidden_states, *args, **kwargs)

        attn.processor.inner = spy
    run(unet, inputs)
    for handle in handles:
        handle.remove()
    assert seen["tome"] == seen["plain"] and seen["plain"][0] == (16 * 16, 4, 32)
    assert inner_shapes == [(4, 128, 32)]  # 4 frames of 256 tokens merged by half


def test_svd_cfg_halves_and_frames_share_the_merge():
    # The random destinations are drawn once per block and forward and shared by every row of the
    # batch * frames batch, so a guidance batch (two equal videos) gives two equal outputs.
    unet = tiny_svd_unet()
    single = svd_inputs(batch=1, frames=3)
    double = {k: torch.cat([v, v]) for k, v in single.items() if k != "timestep"} | {"timestep": single["timestep"]}
    tp.apply_tome(unet)
    out = run(unet, double)
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=1e-5)
    # An odd batch * frames (one video of 3 frames, no guidance) takes every window's first token, as
    # tomesd does for odd batches.
    odd = run(unet, single)
    tp.apply_tome(unet, use_rand=False)
    assert torch.equal(run(unet, single), odd)
    tp.apply_tome(unet)
    assert not torch.equal(run(unet, svd_inputs(batch=1, frames=4)), run_fixed(unet, svd_inputs(batch=1, frames=4)))


def run_fixed(unet: torch.nn.Module, inputs: dict) -> torch.Tensor:
    tp.apply_tome(unet, use_rand=False)
    try:
        return run(unet, inputs)
    finally:
        tp.apply_tome(unet)


def test_svd_ratio_zero_equals_plain_and_presets_differ():
    unet = tiny_svd_unet()
    inputs = svd_inputs()
    baseline = run(unet, inputs)
    with pytest.warns(UserWarning, match="merges nothing"):
        tp.apply_tome(unet, ratio=0.0)
    assert torch.equal(run(unet, inputs), baseline)
    outputs = {}
    for preset in ("exact", "balanced", "fast"):
        tp.apply_tome(unet, preset=preset)
        assert context_of(unet).model_state.config == ToMeConfig.from_preset(preset, "svd")
        outputs[preset] = run(unet, inputs)
        assert torch.isfinite(outputs[preset]).all() and not torch.equal(outputs[preset], baseline)
    assert not torch.equal(outputs["balanced"], outputs["fast"])
    tp.remove_tome(unet)
    assert torch.equal(run(unet, inputs), baseline)


def test_svd_refuses_ratio_start_before_changing_anything():
    unet = tiny_svd_unet()
    with pytest.raises(ValueError, match=r"Expected ratio_start=None on UNetSpatioTemporalConditionModel"):
        tp.apply_tome(unet, ratio=0.3, ratio_start=0.6)
    assert context_of(unet) is None
    assert not any(isinstance(p, ToMeProcessor) for p in unet.attn_processors.values())


# ---- Whole pipelines ------------------------------------------------------------------------------------

SVD_IMAGE = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def svd_frames(pipe, seed: int = 0, **kwargs) -> np.ndarray:
    args = dict(height=32, width=32, num_frames=4, num_inference_steps=2, decode_chunk_size=2, output_type="np")
    args |= dict(min_guidance_scale=1.0, max_guidance_scale=2.5)  # guidance: a batch of 2 videos x 4 frames
    with torch.no_grad():
        return pipe(SVD_IMAGE, generator=torch.Generator().manual_seed(seed), **(args | kwargs)).frames


def animatediff_frames(pipe, seed: int = 0, **kwargs) -> np.ndarray:
    args = dict(height=32, width=32, num_frames=4, num_inference_steps=2, output_type="np")
    with torch.no_grad():
        return pipe("a cat", generator=torch.Generator().manual_seed(seed), **(args | kwargs)).frames


PIPELINES = {"svd": (tiny_svd_pipeline, svd_frames), "animatediff": (tiny_animatediff_pipeline, animatediff_frames)}


@pytest.fixture(scope="module", params=sorted(PIPELINES))
def video_pipeline(request, tmp_path_factory):
    build, generate = PIPELINES[request.param]
    pipe = build() if request.param == "svd" else build(tmp_path_factory.mktemp("tokenizer"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the tests run (`one_thread`): the plain frames must be bit-comparable
    try:
        plain = generate(pipe)
    finally:
        torch.set_num_threads(threads)
    return request.param, pipe, generate, plain


def test_apply_tome_on_a_video_pipeline_twice_same_frames_and_removal_restores(video_pipeline):
    name, pipe, generate, plain = video_pipeline
    assert isinstance(pipe.unet, UNetMotionModel) == (name == "animatediff")
    tp.apply_tome(pipe)
    first, second = generate(pipe), generate(pipe)
    assert context_of(pipe.unet).family.name == ("svd" if name == "svd" else "unet")
    tp.remove_tome(pipe)
    assert np.isfinite(first).all() and first.shape == plain.shape
    np.testing.assert_array_equal(first, second)
    assert np.abs(first - plain).max() > 1e-4
    np.testing.assert_array_equal(generate(pipe), plain)


def test_enable_tome_on_a_video_pipeline_after_patch_pipelines(video_pipeline):
    name, pipe, generate, plain = video_pipeline
    tp.patch_pipelines()
    try:
        pipe.enable_tome(preset="balanced")
        assert pipe.tome_config == ToMeConfig.from_preset("balanced", pipe.unet)
        first, second = generate(pipe), generate(pipe)
        pipe.disable_tome()
        assert pipe.tome_config is None
    finally:
        tp.unpatch_pipelines()
    np.testing.assert_array_equal(first, second)
    assert np.abs(first - plain).max() > 1e-4
    np.testing.assert_array_equal(generate(pipe), plain)


def test_ratio_zero_on_a_video_pipeline_equals_plain(video_pipeline):
    _, pipe, generate, plain = video_pipeline
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "merges nothing": the point of this test
        tp.apply_tome(pipe, ratio=0.0)
    try:
        np.testing.assert_array_equal(generate(pipe), plain)
    finally:
        tp.remove_tome(pipe)


def test_animatediff_motion_modules_never_merge(tmp_path, monkeypatch):
    pipe = tiny_animatediff_pipeline(tmp_path)
    unet = pipe.unet
    motion = [m for m in unet.modules() if type(m).__name__ == "AnimateDiffTransformer3D"]
    motion_blocks = [b for m in motion for b in m.transformer_blocks]
    assert motion_blocks and all(isinstance(b, BasicTransformerBlock) for b in motion_blocks)
    tp.apply_tome(pipe)
    assert not any(SLOT_ATTR in vars(b.attn1) for b in motion_blocks)
    sites = family_of(unet).blocks(unet)
    assert not {id(b) for b in motion_blocks} & {id(s.module) for s in sites}
    recorder = MergeRecorder(monkeypatch)
    animatediff_frames(pipe)
    tp.remove_tome(pipe)
    # Every merge is of one frame: batch = 2 (guidance) x 4 frames, 16 x 16 latent tokens at level 1.
    assert recorder.merges and {(batch, tokens) for _, batch, tokens in recorder.merges} == {(8, 256)}


def test_svd_vae_decode_chunks_compose_with_tome():
    # ToMe is on the UNet only: decoding the frames in chunks of 1 or all at once gives what it gives
    # without ToMe (the temporal decoder's attention is never wrapped).
    pipe = tiny_svd_pipeline()
    tp.apply_tome(pipe)
    by_one, at_once = svd_frames(pipe, decode_chunk_size=1), svd_frames(pipe, decode_chunk_size=4)
    assert not any(isinstance(p, ToMeProcessor) for p in pipe.vae.attn_processors.values())
    tp.remove_tome(pipe)
    plain_by_one, plain_at_once = svd_frames(pipe, decode_chunk_size=1), svd_frames(pipe, decode_chunk_size=4)
    assert np.abs(by_one - at_once).max() <= np.abs(plain_by_one - plain_at_once).max() + 1e-6
    assert np.abs(by_one - plain_by_one).max() > 1e-4


def test_animatediff_vae_tiling_composes_with_tome(tmp_path):
    pipe = tiny_animatediff_pipeline(tmp_path)
    untiled = animatediff_frames(pipe)
    pipe.vae.enable_tiling()
    pipe.vae.tile_sample_min_size, pipe.vae.tile_latent_min_size = 16, 8  # the tiny VAE halves: 16 px tiles
    plain = animatediff_frames(pipe)
    assert not np.array_equal(plain, untiled)  # the frames are decoded in tiles
    for order in ("tome-first", "tiling-first"):
        if order == "tome-first":
            pipe.vae.disable_tiling()
            tp.apply_tome(pipe)
            pipe.vae.enable_tiling()
        else:
            tp.apply_tome(pipe)
        first, second = animatediff_frames(pipe), animatediff_frames(pipe)
        np.testing.assert_array_equal(first, second)
        assert np.abs(first - plain).max() > 1e-4
        tp.remove_tome(pipe)
        np.testing.assert_array_equal(animatediff_frames(pipe), plain)


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_tomesd_cannot_run_on_video_unets(name, tmp_path):
    # tomesd 0.1.3 reads the latent size from `sample.shape[2:4]`, which on a video UNet are channels or
    # frames and height, and fails in its first merged block: nothing of tomesd's to compare with here.
    tomesd = pytest.importorskip("tomesd")
    build, generate = PIPELINES[name]
    pipe = build() if name == "svd" else build(tmp_path)
    tomesd.apply_patch(pipe, ratio=0.5)
    with pytest.raises(ZeroDivisionError):
        generate(pipe)


# ---- The bench: `tome-processors bench --arch svd` ------------------------------------------------------


def test_bench_builds_svd_with_its_frames():
    from tome_processors.bench.models import build_model

    bench = build_model(arch="svd", quick=True, frames=3, resolution=64)
    assert bench.family.name == "svd" and "frames: 3" in bench.description
    assert tuple(bench.forward(bench.model).shape) == (2, 3, 4, 8, 8)  # batch 2 (guidance) x 3 frames


def test_bench_svd_quick_rows(tmp_path):
    import json

    from tome_processors.cli.main import main

    path = tmp_path / "svd.json"
    argv = ["bench", "--arch", "svd", "--quick", "--frames", "2", "--resolution", "64", "--rounds", "1"]
    argv += ["--warmup", "1", "--threads", "1", "--no-trained-quality", "--no-memory", "--no-progress"]
    assert main([*argv, "--modes", "none", "--json", str(path)]) == 0
    rows = {r["name"]: r for r in json.loads(path.read_text())["rows"]}
    # No tomesd row: it cannot run on SVD (test_tomesd_cannot_run_on_video_unets).
    assert list(rows) == ["baseline", "ours exact r=0.5", "ours balanced", "ours fast"]
    assert all(rows[name]["rel_error"] > 0 and rows[name]["sync_ops"] == 0 for name in list(rows)[1:])


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--frames", "4"], "--frames only with a video --arch"),
        (["--arch", "svd", "--frames", "0"], "--frames >= 1"),
        (["--arch", "svd", "--pipeline"], "whole SVD videos are not built offline"),
    ],
)
def test_bench_svd_bad_options_exit_2(argv, message, capsys):
    from tome_processors.cli.main import main

    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_svd_presets_are_the_unet_presets_per_frame():
    # The same settings (so the same quality on the trained UNet denoiser, docs/options.md); "fast" pools the
    # first two attention levels of SVD's layout (downsample 1 and 2), as on SD1.5.
    unet = tiny_svd_unet()
    for preset in ("exact", "balanced", "fast"):
        assert ToMeConfig.from_preset(preset, "svd") == ToMeConfig.from_preset(preset, "unet")
        assert ToMeConfig.from_preset(preset, unet) == ToMeConfig.from_preset(preset, "unet")
    assert ToMeConfig.from_preset("fast", unet).max_downsample == 2


def test_svd_set_attn_processor_merges_as_apply_tome():
    # The diffusers way: the merge context attaches at the first forward and merges exactly as apply_tome.
    unet = tiny_svd_unet()
    inputs = svd_inputs()
    tp.apply_tome(unet)
    expected = run(unet, inputs)
    tp.remove_tome(unet)
    unet.set_attn_processor(ToMeProcessor())
    assert torch.equal(run(unet, inputs), expected)
    assert context_of(unet).family.name == "svd"
