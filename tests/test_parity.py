"""Parity with tomesd 0.1.3, the reference implementation (a test-only oracle)."""

from __future__ import annotations

import pytest
import torch

import tome_processors as tp
from tome_processors.merge import bipartite_soft_matching_2d

from models import run_unet, tiny_unet, unet_inputs

tomesd = pytest.importorskip("tomesd")

FLAGS = [
    pytest.param({}, id="attn"),
    pytest.param({"merge_crossattn": True}, id="crossattn"),
    pytest.param({"merge_mlp": True}, id="mlp"),
    pytest.param({"merge_attn": False, "merge_mlp": True}, id="mlp-only"),
]
SHAPES = [
    pytest.param((2, 16, 16), id="b2-16x16"),
    pytest.param((1, 16, 16), id="b1-16x16"),
    pytest.param((3, 15, 13), id="b3-15x13"),
    pytest.param((2, 12, 20), id="b2-12x20"),
]


@pytest.mark.parametrize("kind", ["sd15", "sd2"])
@pytest.mark.parametrize("flags", FLAGS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("max_downsample", [1, 2])
def test_unet_output_matches_tomesd(kind, flags, shape, max_downsample):
    unet = tiny_unet(kind)
    inputs = unet_inputs(unet, *shape)
    baseline = run_unet(unet, *inputs)

    tomesd.apply_patch(unet, ratio=0.5, use_rand=False, max_downsample=max_downsample, **flags)
    reference = run_unet(unet, *inputs)
    tomesd.remove_patch(unet)

    tp.apply_tome(unet, ratio=0.5, use_rand=False, max_downsample=max_downsample, **flags)
    ours = run_unet(unet, *inputs)
    tp.remove_tome(unet)

    assert (reference - baseline).abs().max() > 1e-3, "the oracle merged nothing: the test would prove nothing"
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("ratio", [0.1, 0.3, 0.5, 0.75])
def test_ratios_match_tomesd(ratio):
    unet = tiny_unet("sd15")
    inputs = unet_inputs(unet)
    tomesd.apply_patch(unet, ratio=ratio, use_rand=False)
    reference = run_unet(unet, *inputs)
    tomesd.remove_patch(unet)
    tp.apply_tome(unet, ratio=ratio, use_rand=False)
    torch.testing.assert_close(run_unet(unet, *inputs), reference, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("h,w,sx,sy,r", [(8, 8, 2, 2, 32), (7, 5, 2, 2, 10), (6, 9, 3, 2, 20), (4, 4, 2, 2, 100)])
def test_merge_functions_match_tomesd(h, w, sx, sy, r):
    g = torch.Generator().manual_seed(h * w + r)
    metric = torch.randn(2, h * w, 16, generator=g)
    x = torch.randn(2, h * w, 5, generator=g)
    ref_merge, ref_unmerge = tomesd.merge.bipartite_soft_matching_random2d(metric, w, h, sx, sy, r, no_rand=True)
    ours = bipartite_soft_matching_2d(metric, h, w, sx, sy, r)

    ref_merged, our_merged = ref_merge(x), ours.merge(x)
    assert our_merged.shape == ref_merged.shape
    # Same merged rows (the order of rows differs: attention does not depend on it).
    sort = lambda t: t.sort(dim=1).values  # noqa: E731
    torch.testing.assert_close(sort(our_merged), sort(ref_merged))
    # Unmerging any per-row result gives the same tokens.
    torch.testing.assert_close(ours.unmerge(our_merged * 2), ref_unmerge(ref_merged * 2))


FULL_CONFIGS = {
    # The real SD1.5 and SD2 UNet architectures (random weights; nothing downloaded).
    "sd15": dict(cross_attention_dim=768, attention_head_dim=8),
    "sd2": dict(cross_attention_dim=1024, attention_head_dim=(5, 10, 20, 20), use_linear_projection=True),
}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["sd15", "sd2"])
def test_full_size_architecture_matches_tomesd(kind):
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    unet = UNet2DConditionModel(block_out_channels=(320, 640, 1280, 1280), **FULL_CONFIGS[kind]).eval()
    g = torch.Generator().manual_seed(0)
    sample = torch.randn(2, 4, 24, 40, generator=g)  # not square
    text = torch.randn(2, 77, unet.config.cross_attention_dim, generator=g)
    inputs = (sample, torch.tensor(700), text)

    tomesd.apply_patch(unet, ratio=0.5, use_rand=False, merge_crossattn=True)
    reference = run_unet(unet, *inputs)
    tomesd.remove_patch(unet)
    tp.apply_tome(unet, ratio=0.5, use_rand=False, merge_crossattn=True)
    ours = run_unet(unet, *inputs)
    torch.testing.assert_close(ours, reference, rtol=1e-4, atol=1e-4)
