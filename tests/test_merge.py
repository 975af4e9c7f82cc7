"""Merge math with worked-out values."""

from __future__ import annotations

import pytest
import torch

from tome_processors import _similarity
from tome_processors import merge as merge_module
from tome_processors._similarity import _pair_scores, _use_cpu_gemm, best_match, cpu_path
from tome_processors.merge import (
    GridLayout,
    bipartite_soft_matching_2d,
    grid_partition,
    level_downsample,
    match,
    window_choice,
    window_mix,
)


def test_grid_partition_top_left_and_leftovers():
    dst, src = grid_partition(3, 5, sx=2, sy=2)  # 1 x 2 full windows; last row and column are sources
    assert dst.tolist() == [0, 2]
    assert sorted(dst.tolist() + src.tolist()) == list(range(15))


def test_grid_partition_with_choice():
    choice = torch.tensor([[3, 1]])  # bottom-right of window 0, top-right of window 1
    dst, _ = grid_partition(2, 4, sx=2, sy=2, choice=choice)
    assert dst.tolist() == [5, 3]  # in window order


def test_a_layout_is_built_inside_one_compiled_graph():
    # A model compiled before its first call (fullgraph, or one compiled block: `compile_repeated_blocks`) builds
    # its layouts inside the graph: no size may depend on a tensor's values (the edges of a 5 x 7 grid of three
    # frames with 2 x 2 x 2 windows: the last row and column of the first two frames and the whole third).
    import torch._dynamo

    def build() -> tuple[torch.Tensor, torch.Tensor]:
        layout = GridLayout.build(5, 7, 2, 2, frames=3, st=2)
        return layout.edges, layout.partitions(torch.zeros(1, layout.windows, dtype=torch.long)).perm

    torch._dynamo.reset()
    try:
        edges, perm = torch.compile(build, fullgraph=True, backend="eager")()
    finally:
        torch._dynamo.reset()
    expected = [t for t in range(105) if t >= 70 or t % 35 >= 28 or t % 7 == 6]
    assert edges.tolist() == expected and torch.equal(perm, build()[1])


@pytest.mark.parametrize(
    ("h", "w", "frames", "st", "extra"),
    [(3, 4, 1, 1, 3), (4, 4, 2, 2, 9), (2, 4, 3, 2, 5)],
    ids=["rows-and-part-of-a-row", "frames-and-part-of-a-frame", "odd-frames-and-part-of-a-frame"],
)
def test_tokens_after_the_box_are_edges_that_merge_into_the_window_at_their_place(h, w, frames, st, extra):
    # A context-parallel rank's run that ends inside a row (frame): the tokens after the last whole one continue
    # the grid, and each may merge only into the window at its own place a row (frame) earlier.
    layout = GridLayout.build(h, w, 2, 2, frames=frames, st=st, extra=extra)
    box = GridLayout.build(h, w, 2, 2, frames=frames, st=st)
    whole = frames * h * w
    assert layout.edges.tolist() == box.edges.tolist() + list(range(whole, whole + extra))
    for j, window in enumerate(layout.source_window[-extra:].tolist()):
        # the covered token at the same place, one row (frame) back, clamped into the full windows
        if frames == 1:
            above = (2 * (h // 2) - 1) * w + j  # the last covered row
            assert window == box.window_of_token[above].item()
        else:
            last = (frames // st) * st - 1
            assert window == box.window_of_token[last * h * w + j].item()
    metric = torch.randn(2, whole + extra, 8)
    partition = layout.fixed(2)
    r = whole // 2
    merged = match(metric, partition, r, source_window=layout.source_window)
    assert merged.num_rows == whole + extra - r
    rows = merged.token_rows
    for b in range(2):
        for position, window in zip(range(whole, whole + extra), layout.source_window[-extra:].tolist(), strict=True):
            destination = partition.dst_idx[window].item()
            own_row = rows[b, position].item()
            assert own_row == rows[b, destination].item() or own_row >= layout.windows  # merged there, or kept alone


def test_more_extra_tokens_than_a_row_or_frame_is_an_error():
    with pytest.raises(ValueError, match="fewer extra tokens than a row"):
        GridLayout.build(2, 4, 2, 2, extra=4)
    with pytest.raises(ValueError, match="fewer extra tokens than a frame"):
        GridLayout.build(2, 4, 2, 2, frames=2, st=2, extra=8)


def test_worked_example_merge_and_unmerge():
    # 1 x 4 grid, windows of 2: destinations are tokens 0 and 2.
    metric = torch.tensor([[[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.2, 1.0]]])
    x = torch.tensor([[[0.0], [2.0], [10.0], [20.0]]])
    m = bipartite_soft_matching_2d(metric, h=1, w=4, sx=2, sy=1, r=1)
    # Token 1 is closest to token 0 (cosine 0.994 > token 3's 0.981 to token 2): it is merged.
    assert m.merge(x).flatten().tolist() == [1.0, 10.0, 20.0]  # destinations first, then unmerged sources
    assert m.unmerge(m.merge(x)).flatten().tolist() == [1.0, 1.0, 10.0, 20.0]


def test_r_zero_is_identity():
    x = torch.randn(2, 12, 3)
    m = bipartite_soft_matching_2d(x, 3, 4, 2, 2, 0)
    assert torch.equal(m.merge(x), x) and torch.equal(m.unmerge(x), x)


def test_level_downsample_matches_tomesd_formula():
    assert level_downsample(64 * 64, 64 * 64) == 1
    assert level_downsample(64 * 64, 32 * 32) == 2
    assert level_downsample(63 * 47, 32 * 24) == 2
    assert level_downsample(63 * 47, 8 * 6) == 8


def test_window_choice_is_deterministic_in_range_and_spread():
    key = torch.tensor([12345])
    mix = window_mix(blocks=2, windows=32 * 32, seed=0)
    a, b = window_choice(mix, key, 4)[0], window_choice(mix, key, 4)[0]
    assert torch.equal(a, b) and a.min() >= 0 and a.max() <= 3
    counts = torch.bincount(a.flatten(), minlength=4)
    assert counts.min() > 200  # 1024 windows, about 256 each
    assert not torch.equal(a, window_choice(mix, key + 1, 4)[0])
    assert not torch.equal(a, window_choice(mix, key, 4)[1])  # another block, another choice
    assert not torch.equal(a, window_choice(window_mix(2, 32 * 32, seed=1), key, 4)[0])  # another seed


def test_low_precision_similarity_scores_chosen_pairs_exactly():
    g = torch.Generator().manual_seed(0)
    metric = torch.randn(2, 64, 16, generator=g)
    exact = bipartite_soft_matching_2d(metric, 8, 8, 2, 2, 24)
    fast = bipartite_soft_matching_2d(metric, 8, 8, 2, 2, 24, similarity_dtype=torch.bfloat16)
    assert fast.num_rows == exact.num_rows
    # On well-separated random vectors the choice is the same.
    assert (fast.token_row == exact.token_row).float().mean() > 0.95


def test_best_match_agrees_with_plain_matmul():
    # Many source rows, a channels-first view as the block input is, and both dtypes the CPU GEMM path
    # takes: the same best destination and score as `matmul` then `max`.

    g = torch.Generator().manual_seed(1)
    src = torch.randn(2, 40, 589, generator=g).transpose(1, 2)
    dst = torch.randn(2, 33, 40, generator=g)
    if not _use_cpu_gemm(src, torch.float32):
        pytest.skip("oneDNN's CPU GEMM is not available here: only the plain path runs")
    score, index = best_match(src, dst)
    plain = (src @ dst.transpose(-1, -2)).max(dim=-1)
    assert torch.equal(index, plain.indices)
    torch.testing.assert_close(score, plain.values, rtol=1e-5, atol=1e-5)
    low_score, low_index = best_match(src.bfloat16(), dst.bfloat16())
    plain_low = (src.bfloat16() @ dst.bfloat16().transpose(-1, -2)).max(dim=-1)
    assert low_score.dtype == torch.bfloat16 and torch.equal(low_index, plain_low.indices)
    # Choosing in bfloat16 and re-scoring in float32: the plain path's choice, exactly re-scored.
    chosen_score, chosen = best_match(src, dst, torch.bfloat16)
    assert torch.equal(chosen, plain_low.indices)
    torch.testing.assert_close(chosen_score, _pair_scores(src, dst, chosen), rtol=1e-5, atol=1e-5)
    assert _use_cpu_gemm(src[:0], torch.float32) is False  # an empty batch takes `matmul`
    assert best_match(src[:0], dst[:0])[0].shape == (0, src.shape[1])


def test_cpu_gemm_path_and_plain_matmul_choose_the_same_merge(monkeypatch):

    g = torch.Generator().manual_seed(2)
    metric = torch.randn(2, 40, 32 * 32, generator=g).transpose(1, 2)  # channels-first, as in a UNet
    fast = bipartite_soft_matching_2d(metric, 32, 32, 2, 2, 400)
    monkeypatch.setattr(_similarity, "_onednn_linear_works", lambda dtype: False)
    plain = bipartite_soft_matching_2d(metric, 32, 32, 2, 2, 400)
    assert torch.equal(fast.token_row, plain.token_row)
    # With oneDNN switched off (the GPU's ops, as the host-cost tests count them), the GPU's path throughout.
    with torch.backends.mkldnn.flags(enabled=False):
        assert not cpu_path(metric)
        assert torch.equal(bipartite_soft_matching_2d(metric, 32, 32, 2, 2, 400).token_row, fast.token_row)
        gpu_merged = fast.merge(metric)  # `index_add`, as on a GPU
    # The CPU path sums with an accumulating `index_put`: the same means, and the same round trip.
    assert cpu_path(metric)
    torch.testing.assert_close(fast.merge(metric), gpu_merged)
    torch.testing.assert_close(fast.unmerge(fast.merge(metric)), fast.unmerge(gpu_merged))


def test_every_similarity_dtype_runs_on_cpu_and_mostly_agrees():
    # float16 is not among oneDNN's CPU GEMM dtypes here: it must fall back to `matmul`, not fail.
    g = torch.Generator().manual_seed(3)
    metric = torch.randn(2, 44 * 25, 16, generator=g)
    exact = bipartite_soft_matching_2d(metric, 44, 25, 2, 2, 300)
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        fast = bipartite_soft_matching_2d(metric, 44, 25, 2, 2, 300, similarity_dtype=dtype)
        assert (fast.token_row == exact.token_row).float().mean() > 0.8
        # A bfloat16 metric (a bfloat16 model on CPU) takes every similarity dtype too.
        low = bipartite_soft_matching_2d(metric.bfloat16(), 44, 25, 2, 2, 300, similarity_dtype=dtype)
        assert low.num_rows == exact.num_rows
        assert low.merge(metric.bfloat16()).shape == (2, exact.num_rows, 16)


@pytest.mark.parametrize(("h", "w", "sx", "sy"), [(8, 8, 2, 2), (5, 7, 2, 2), (5, 4, 3, 1), (3, 7, 1, 3)])
def test_random_destinations_match_tomesd_given_the_same_choice(h, w, sx, sy, monkeypatch):
    tomesd = pytest.importorskip("tomesd")
    # tomesd draws each window's destination with torch.randint; fed the choice the hooks draw, its merge
    # must equal ours on the batched partitions every block of a forward gets (edges and sx != sy too).
    g = torch.Generator().manual_seed(h * w)
    batch, windows = 2, (h // sy) * (w // sx)
    metric, x = torch.randn(batch, h * w, 8, generator=g), torch.randn(batch, h * w, 5, generator=g)
    layout = GridLayout.build(h, w, sx, sy)
    choice = window_choice(window_mix(3, windows, seed=7), torch.tensor(123 * 16), sx * sy)
    partitions = layout.partitions(choice, batch).unbind()
    for block, partition in enumerate(partitions):
        monkeypatch.setattr(
            torch, "randint", lambda *args, block=block, **kwargs: choice[block].view(h // sy, w // sx, 1)
        )
        for r in (1, h * w // 3, h * w - windows):
            reference_merge, reference_unmerge = tomesd.merge.bipartite_soft_matching_random2d(
                metric, w, h, sx, sy, r, no_rand=False, generator=torch.Generator()
            )
            ours = match(metric, partition, r)
            torch.testing.assert_close(ours.unmerge(ours.merge(x)), reference_unmerge(reference_merge(x)))


def test_window_mix_is_the_same_for_a_block_however_many_blocks_are_drawn():
    few, many = window_mix(2, 64, seed=3), window_mix(5, 64, seed=3)
    assert all(torch.equal(a, b[:2]) for a, b in zip(few, many, strict=True))
    assert (few[0] % 2 == 1).all()  # odd multipliers


@pytest.mark.parametrize("seed", [0, 5, 2**31 - 1, 2**40 + 7])
def test_window_mix_keeps_every_seed_bit_and_values_below_2_to_32(seed):
    multiplier, offset = window_mix(3, 50, seed)
    other, _ = window_mix(3, 50, seed + 2**31)  # seeds that differ only above bit 31 differ too
    assert not torch.equal(multiplier, other)
    assert 0 <= int(multiplier.min()) and int(multiplier.max()) < 2**32 and int(offset.max()) < 2**32


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("random", [False, True])
def test_text_rows_pass_the_text_through_and_merge_the_grid_as_without_them(batch, random):
    # Flux's single blocks merge text + image tokens at once, each text token a row of its own: exactly
    # what cutting the text off, merging the image tokens and putting the text back gives, with positions
    # (for rotary tables) that count the text first.
    h, w, text, r = 5, 7, 4, 12
    g = torch.Generator().manual_seed(batch + 2 * random)
    metric, x = torch.randn(batch, h * w, 8, generator=g), torch.randn(batch, text + h * w, 5, generator=g)
    layout = GridLayout.build(h, w, 2, 2)
    if random:
        choice = window_choice(window_mix(2, layout.windows, seed=1), torch.tensor(7), layout.places)
        base = layout.partitions(choice, batch).unbind()[1]
    else:
        base = layout.fixed(batch)
    plain = match(metric, base, r, with_row_token=True)
    joint = match(metric, layout.with_text(base, batch, text, 0, lead=True), r, with_row_token=True)
    positions = torch.cat([torch.arange(text).expand(batch, text), plain.row_token + text], dim=1)
    assert torch.equal(joint.token_row, plain.token_row) and torch.equal(joint.row_token, positions)
    direct = match(metric, layout.with_text(base, batch, text, text, lead=True), r, with_row_token=True)
    y = torch.randn(batch, text + plain.num_rows, 5, generator=g)
    for merge in (direct, joint.with_text_rows(text), plain.with_text_rows(text)):
        assert (merge.num_tokens, merge.num_rows, merge.text_rows) == (text + h * w, text + plain.num_rows, text)
        assert torch.equal(merge.merge(x), torch.cat([x[:, :text], plain.merge(x[:, text:])], dim=1))
        assert torch.equal(merge.unmerge(y), torch.cat([y[:, :text], plain.unmerge(y[:, text:])], dim=1))
        assert torch.equal(merge.row_token, positions)
    assert joint.with_text_rows(text) is joint.with_text_rows(text)  # extended once, kept


def test_merging_sums_into_kept_zeros_without_writing_them():
    # The merge and the row sizes sum out of place (`index_add`, or on the CPU path an accumulating `index_put`)
    # into zero tensors kept per shape: a merge must never write into them, and few are kept (they can be large).
    metric = torch.randn(2, 64, 8)
    merge = bipartite_soft_matching_2d(metric, 8, 8, 2, 2, r=20)
    first = merge.merge(metric)
    second = merge.merge(metric * 3)
    torch.testing.assert_close(second, first * 3)  # nothing was left behind in the summing tensor
    assert merge_module._ZEROS and all(not z.any() for z in merge_module._ZEROS.values())
    for channels in range(1, 20):  # many shapes: the oldest are dropped
        merge.merge(torch.randn(2, 64, channels))
    assert len(merge_module._ZEROS) <= 8
