"""`parallel.local_grid` where the split sequence opens with tokens ahead of the grid (MiniMax-H3: text, audio)."""

from __future__ import annotations

from tome_processors.parallel import Shards, local_grid


def test_every_rank_merges_as_many_of_its_last_grid_tokens():
    # 14 leading tokens and 2 frames of 6 x 8: 110 tokens, 55 a rank; rank 0 holds 41 of the grid, rank 1 55.
    first, second = (local_grid((2, 6, 8), Shards(2, rank), lead=14) for rank in (0, 1))
    assert first.tokens == second.tokens == 41
    assert (first.lead, second.lead) == (14, 14)  # rank 1's first 14 grid tokens pass through
    assert first.run == second.run == 55
    assert (first.start, second.start) == (0, 55)
    assert (first.h, first.w, first.extra) == (5, 8, 1)


def test_no_grid_where_a_rank_would_hold_less_than_a_row_or_none():
    assert local_grid((1, 2, 8), Shards(2, 0), lead=14) is None  # 15 a rank: rank 0 holds 1 grid token
    assert local_grid((1, 2, 8), Shards(2, 0), lead=20) is None  # rank 0 holds no grid token
    assert local_grid((1, 2, 8), Shards(2, 0), lead=3) is None  # 19 tokens do not split over 2 ranks
