"""`merge_mlp=True` with the feed-forward chunked (`unet.enable_forward_chunking()`), through whole pipeline calls."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import tome_processors as tp
from tome_processors.merge import TokenMerge

from pipelines import tiny_animatediff_pipeline, tiny_sd_pipeline
from test_video_unet import animatediff_frames

pytestmark = pytest.mark.usefixtures("one_thread")


def generate(pipe) -> np.ndarray:
    args = dict(prompt="a cat", height=32, width=32, num_inference_steps=2, output_type="np")
    return pipe(**args, generator=torch.Generator().manual_seed(0)).images


def chunk_feed_forwards(unet, chunk_size: int | None, dim: int = 0) -> None:
    """What `enable_forward_chunking` does on the UNets that have it (`UNet2DConditionModel` has none)."""
    for module in unet.modules():
        if hasattr(module, "set_chunk_feed_forward"):
            module.set_chunk_feed_forward(chunk_size, dim=dim)


def test_a_merge_of_some_samples_merges_them_as_the_whole_merge_does():
    torch.manual_seed(0)
    token_rows = torch.tensor([[0, 0, 1, 2], [0, 1, 2, 1], [2, 1, 0, 0]])
    sizes = torch.stack([torch.bincount(row, minlength=3) for row in token_rows]).float().view(-1, 1)
    flat = (token_rows + torch.arange(3).view(3, 1) * 3).view(-1)
    merge = TokenMerge(flat, sizes, 3, 4, 3)
    x = torch.randn(3, 4, 5)
    whole = merge.merge(x)
    for start, stop in ((0, 1), (1, 2), (2, 3), (1, 3)):
        part = merge.samples(start, stop)
        assert torch.equal(part.merge(x[start:stop]), whole[start:stop])
        assert torch.equal(part.unmerge(whole[start:stop]), merge.unmerge(whole)[start:stop])


@pytest.mark.parametrize("chunk_size", [1, 2])
def test_merge_mlp_merges_a_feed_forward_chunked_over_the_batch(chunk_size, tmp_path):
    pipe = tiny_sd_pipeline(tmp_path)
    tp.apply_tome(pipe, ratio=0.5, merge_mlp=False)
    attention_only = generate(pipe)
    tp.apply_tome(pipe, ratio=0.5, merge_mlp=True)
    merged_mlp = generate(pipe)
    assert not np.allclose(merged_mlp, attention_only, atol=1e-5)

    chunk_feed_forwards(pipe.unet, chunk_size, dim=0)  # diffusers' default: over the batch (CFG's 2 samples)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        chunked = generate(pipe)
    np.testing.assert_allclose(chunked, merged_mlp, rtol=0, atol=1e-5)
    assert not np.allclose(chunked, attention_only, atol=1e-5)
    chunk_feed_forwards(pipe.unet, None)
    assert np.array_equal(generate(pipe), merged_mlp)


def test_merge_mlp_with_enable_forward_chunking_on_animatediff(tmp_path):
    pipe = tiny_animatediff_pipeline(tmp_path)
    tp.apply_tome(pipe, ratio=0.5, merge_mlp=False)
    attention_only = animatediff_frames(pipe)
    tp.apply_tome(pipe, ratio=0.5, merge_mlp=True)
    merged_mlp = animatediff_frames(pipe)
    pipe.unet.enable_forward_chunking()  # chunks of one sample (a frame of a CFG half)
    chunked = animatediff_frames(pipe)
    np.testing.assert_allclose(chunked, merged_mlp, rtol=0, atol=1e-5)
    assert not np.allclose(chunked, attention_only, atol=1e-5)


def test_merge_mlp_warns_once_where_chunks_split_the_tokens(tmp_path):
    pipe = tiny_sd_pipeline(tmp_path)
    tp.apply_tome(pipe, ratio=0.5, merge_mlp=False)
    attention_only = generate(pipe)
    tp.apply_tome(pipe, ratio=0.5, merge_mlp=True)
    chunk_feed_forwards(pipe.unet, 4, dim=1)  # 256, 64 and 16 tokens at the levels: chunks of 4
    with pytest.warns(UserWarning, match="merge_mlp=True merges nothing in a feed-forward chunked over the tokens"):
        chunked = generate(pipe)
    np.testing.assert_allclose(chunked, attention_only, rtol=0, atol=1e-5)  # the attention still merges
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        generate(pipe)  # said once
