"""`ToMeConfig(matching="window")`: each source compares itself with its own window's destination only."""

from __future__ import annotations

import pytest
import torch

import tome_processors as tp
from tome_processors import ToMeConfig
from tome_processors.merge import GridLayout, bipartite_soft_matching_2d, match

from test_video import run, tiny_wan, wan_inputs

# (frames, st, h, w, sy, sx): images and clips, with and without tokens outside every full window.
SHAPES = [(1, 1, 4, 6, 2, 2), (1, 1, 5, 7, 2, 2), (4, 2, 4, 6, 1, 1), (5, 2, 5, 4, 2, 2), (3, 3, 3, 5, 1, 2)]


def nearest_window(layout: GridLayout, token: int) -> int:
    """The window of the covered token closest to `token` in every axis (brute force over the windows)."""
    frames, h, w = layout.frames, layout.h, layout.w
    t, y, x = token // (h * w), token // w % h, token % w
    covered_t, covered_y, covered_x = (
        frames // layout.st * layout.st,
        h // layout.sy * layout.sy,
        w // layout.sx * layout.sx,
    )
    t, y, x = min(t, covered_t - 1), min(y, covered_y - 1), min(x, covered_x - 1)
    return int(layout.window_of_token[(t * h + y) * w + x])


@pytest.mark.parametrize(("frames", "st", "h", "w", "sy", "sx"), SHAPES)
def test_every_source_knows_its_window_or_the_nearest_one(frames, st, h, w, sy, sx):
    layout = GridLayout.build(h, w, sx, sy, frames=frames, st=st)
    choice = torch.randint(0, layout.places, (3, layout.windows), generator=torch.Generator().manual_seed(0))
    for partition in [layout.fixed(), *layout.partitions(choice).unbind()]:
        sources = partition.perm[: partition.num_src]
        assert layout.source_window.shape == sources.shape
        for source, window in zip(sources.tolist(), layout.source_window.tolist(), strict=True):
            assert window == nearest_window(layout, source)
        # The destination at a source's window is in that window.
        assert torch.equal(layout.window_of_token[partition.dst_idx[layout.source_window]], layout.source_window)


def reference_window_merge(metric: torch.Tensor, layout: GridLayout, partition, r: int) -> torch.Tensor:
    """Window matching written out per sample: cosine with the own window's destination, the r best merged by mean."""
    merged = []
    for x in metric:
        x = x / x.norm(dim=-1, keepdim=True)
        src = partition.perm[: partition.num_src]
        dst = partition.dst_idx[layout.source_window]
        score = (x[src] * x[dst]).sum(-1)
        best = score.argsort(descending=True)[:r]
        rows = {int(d): [int(d)] for d in partition.dst_idx}
        for i in best.tolist():
            rows[int(dst[i])].append(int(src[i]))
        kept = [rows[int(d)] for d in partition.dst_idx] + [[int(src[i])] for i in score.argsort(descending=True)[r:]]
        merged.append(kept)
    return merged


@pytest.mark.parametrize(("frames", "st", "h", "w", "sy", "sx"), SHAPES)
@pytest.mark.parametrize("batch", [1, 3])
def test_window_matching_merges_the_sources_closest_to_their_own_destination(frames, st, h, w, sy, sx, batch):
    layout = GridLayout.build(h, w, sx, sy, frames=frames, st=st)
    partition = layout.fixed()
    n = frames * h * w
    metric = torch.randn(batch, n, 6, generator=torch.Generator().manual_seed(1))
    r = partition.num_src * 2 // 3
    merge = match(metric, partition, r, source_window=layout.source_window)
    values = torch.randn(batch, n, 4, generator=torch.Generator().manual_seed(2))
    merged = merge.merge(values)
    assert merged.shape == (batch, n - r, 4)
    for b, rows in enumerate(reference_window_merge(metric, layout, partition, r)):
        expected = torch.stack([values[b, tokens].mean(0) for tokens in rows])
        # Rows come in the same order (destinations, then the unmerged sources by rank).
        torch.testing.assert_close(merged[b], expected)


def test_window_matching_never_crosses_windows_where_global_matching_does():
    # Two windows of a 1 x 4 row (destinations 0 and 2): source 1 is most like the other window's destination.
    metric = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [1.0, 1.0]]])
    layout = GridLayout.build(1, 4, 2, 1)
    global_merge = bipartite_soft_matching_2d(metric, 1, 4, 2, 1, r=1)
    window_merge = bipartite_soft_matching_2d(metric, 1, 4, 2, 1, r=1, matching="window")
    values = torch.arange(4.0).view(1, 4, 1)
    assert global_merge.merge(values).flatten().tolist() == [0.0, 1.5, 3.0]  # source 1 into destination 2
    assert window_merge.merge(values).flatten().tolist() == [0.0, 2.5, 1.0]  # source 3 into its own, 2
    assert layout.source_window.tolist() == [0, 1]


def test_matching_is_validated():
    assert ToMeConfig().matching == "global"
    with pytest.raises(ValueError, match='Expected matching to be "global" or "window", but got \'local\''):
        ToMeConfig(matching="local")


@pytest.mark.parametrize(
    "options",
    [
        {"st": 2, "ratio": 0.75},  # across frames, a matching per block
        {"st": 2, "ratio": 0.8, "share_level": True},
        {"ratio": 0.5},  # frame by frame
    ],
)
def test_window_matching_on_a_video_model_runs_reproducibly_and_removes_cleanly(options):
    model = tiny_wan()
    inputs = wan_inputs(frames=5)  # 3 latent frames: with st=2 the last one is left over
    before = run(model, inputs)
    tp.apply_tome(model, matching="window", **options)
    window = run(model, inputs)
    assert torch.isfinite(window).all() and not torch.equal(window, before)
    torch.testing.assert_close(run(model, inputs), window, rtol=0, atol=0)
    tp.apply_tome(model, **options)  # the same merge with global matching differs
    assert not torch.equal(run(model, inputs), window)
    tp.remove_tome(model)
    torch.testing.assert_close(run(model, inputs), before, rtol=0, atol=0)
