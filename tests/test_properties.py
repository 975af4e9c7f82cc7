"""Property tests of the merge math (hypothesis): any batch, grid, window, ratio and dtype."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tome_processors.merge import bipartite_soft_matching_2d, grid_partition, window_choice, window_mix

DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16])


def random_choice_grid(h: int, w: int, sx: int, sy: int, seed: int) -> torch.Tensor:
    """A `(h // sy, w // sx)` destination place per window, drawn as the hooks draw it."""
    mix = window_mix(1, (h // sy) * (w // sx), seed)
    return window_choice(mix, torch.tensor([seed]), sx * sy).view(h // sy, w // sx)


@st.composite
def merge_cases(draw):
    batch = draw(st.integers(1, 3))
    h, w = draw(st.integers(1, 11)), draw(st.integers(1, 11))
    sx, sy = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    channels = draw(st.integers(1, 6))
    r = draw(st.integers(0, h * w))
    seed = draw(st.integers(0, 2**16))
    zeros = draw(st.booleans())
    random_choice = draw(st.booleans())
    return batch, h, w, sx, sy, channels, r, seed, zeros, random_choice


def build(case, dtype=torch.float32):
    batch, h, w, sx, sy, channels, r, seed, zeros, random_choice = case
    g = torch.Generator().manual_seed(seed)
    metric = torch.randn(batch, h * w, channels, generator=g)
    if zeros:  # zero vectors (and exact duplicates) in the metric
        metric[:, ::2] = 0
    x = torch.randn(batch, h * w, channels + 1, generator=g)
    choice = None
    if random_choice and h // sy and w // sx:
        choice = window_choice(window_mix(1, (h // sy) * (w // sx), seed), torch.tensor([seed]), sx * sy).view(
            h // sy, w // sx
        )
    merge = bipartite_soft_matching_2d(metric.to(dtype), h, w, sx, sy, r, choice)
    return merge, x.to(dtype)


@settings(max_examples=150, deadline=None)
@given(merge_cases())
def test_row_count_and_groups(case):
    batch, h, w, sx, sy, _, r, *_ = case
    merge, x = build(case)
    num_src = h * w - (h // sy) * (w // sx)
    expected_removed = min(r, num_src) if (h // sy and w // sx and r > 0) else 0
    assert merge.num_rows == h * w - expected_removed
    merged = merge.merge(x)
    assert merged.shape == (batch, merge.num_rows, x.shape[-1])
    # Every row holds at least one token, and each row is the mean of its tokens.
    rows = merge.token_row.view(batch, h * w)
    for b in range(batch):
        sizes = torch.bincount(rows[b] - b * merge.num_rows, minlength=merge.num_rows)
        assert (sizes > 0).all()
        for m in range(merge.num_rows):
            members = x[b, rows[b] == b * merge.num_rows + m]
            torch.testing.assert_close(merged[b, m], members.mean(0), rtol=1e-5, atol=1e-5)


@settings(max_examples=150, deadline=None)
@given(merge_cases())
def test_unmerge_restores_unmerged_tokens_exactly(case):
    merge, x = build(case)
    restored = merge.unmerge(merge.merge(x))
    singleton = (merge.row_size.view(-1) == 1)[merge.token_row].view(x.shape[:2])
    assert torch.equal(restored[singleton], x[singleton])
    # Merged tokens all receive their row's value.
    torch.testing.assert_close(merge.merge(restored), merge.merge(x))


@settings(max_examples=60, deadline=None)
@given(merge_cases())
def test_r_zero_is_identity(case):
    merge, x = build((*case[:6], 0, *case[7:]))
    assert torch.equal(merge.merge(x), x) and torch.equal(merge.unmerge(x), x)


@settings(max_examples=80, deadline=None)
@given(merge_cases(), DTYPES)
def test_finite_in_every_dtype(case, dtype):
    merge, x = build(case, dtype)
    merged = merge.merge(x)
    assert merged.dtype == dtype
    assert torch.isfinite(merged).all() and torch.isfinite(merge.unmerge(merged)).all()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.integers(1, 12), st.integers(1, 3), st.integers(1, 3), st.integers(0, 2**20))
def test_partition_covers_every_token_once(h, w, sx, sy, key):
    choice = (
        window_choice(window_mix(1, (h // sy) * (w // sx), key), torch.tensor([key]), sx * sy).view(h // sy, w // sx)
        if h // sy and w // sx
        else None
    )
    dst, src = grid_partition(h, w, sx, sy, choice)
    assert sorted(dst.tolist() + src.tolist()) == list(range(h * w))
    assert dst.numel() == (h // sy) * (w // sx)
    # One destination per full window.
    windows = {(int(i) // w // sy, int(i) % w // sx) for i in dst}
    assert len(windows) == dst.numel()
