"""ToMe under context parallelism on four CPU processes: Ulysses x ring (2 x 2) and ring over 4, whole frames, rows
from mid-frame and from mid-row, a preset, and FLUX.1's rows. One spawn of four ranks; marked slow (the quick run's
two-rank file covers each path once)."""

from __future__ import annotations

import numpy as np
import pytest

from test_context_parallel import GLOBAL_MATCHING_BOUND, RATIO, _case, _change, _even_text, _wan

from parallel_harness import run_ranks

pytestmark = pytest.mark.slow


def _flux_four_rows_a_rank():
    from test_dit import flux_inputs, tiny_flux

    model = tiny_flux()
    model.set_attention_backend("native")
    return model, _even_text(flux_inputs(batch=1, h=8, w=8), length=4)  # text and 8 rows of 8 split by 4


def scenarios(rank: int, world_size: int) -> dict:
    from diffusers import ContextParallelConfig

    from tome_processors.pays import ALWAYS, pays_table

    def wan_attn1(model):
        return [block.attn1 for block in model.blocks]

    def flux_attn(model):
        return [model.transformer_blocks[0].attn]

    both = ContextParallelConfig(ulysses_degree=2, ring_degree=2)
    ring = ContextParallelConfig(ring_degree=4)
    with pays_table(ALWAYS):
        return {
            # 8 frames of 4 x 4: two whole frames a rank.
            "frames": _case(lambda: _wan(8, 8, 8), both, True, wan_attn1, **RATIO),
            # 5 frames of 4 x 4: 20 tokens a rank, 5 rows, from mid-frame.
            "mid-frame": _case(lambda: _wan(5, 8, 8), ring, False, wan_attn1, preset="balanced", use_rand=False),
            # 3 frames of 3 x 4: 9 tokens a rank, 2 rows and 1 after them, from mid-row.
            "mid-row": _case(lambda: _wan(3, 6, 8), both, True, wan_attn1, **RATIO),
            "flux": _case(_flux_four_rows_a_rank, ring, True, flux_attn, **RATIO),
        }


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(scenarios, world_size=4)


def _agree(ranks: list[dict], name: str) -> None:
    for other in ranks[1:]:
        np.testing.assert_array_equal(ranks[0][name]["out"], other[name]["out"])


def test_whole_frames_under_ulysses_and_ring_equal_one_process(ranks):
    for result in (rank["frames"] for rank in ranks):
        assert set(result["tokens"]) == {16}  # 32 a rank, half merged
        np.testing.assert_allclose(result["out"], result["solo_tome"], atol=1e-5)
        assert not result["skips"]
    _agree(ranks, "frames")


@pytest.mark.parametrize("name, tokens", [("mid-frame", None), ("mid-row", 5), ("flux", 8)])
def test_rows_merge_alike_on_four_ranks(ranks, name, tokens):
    for result in (rank[name] for rank in ranks):
        seen = set(result["tokens"])
        assert len(seen) == 1 and (seen == {tokens} if tokens else max(seen) < 20), seen
        assert not result["skips"]
        own = _change(result["solo_tome"], result["plain"])
        assert _change(result["out"], result["solo_tome"]) < GLOBAL_MATCHING_BOUND * own
    _agree(ranks, name)
