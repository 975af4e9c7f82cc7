"""LTX-2, HunyuanVideo, HunyuanVideo 1.5, ChronoEdit and Helios under diffusers' context parallelism, with and without
ToMe, on two CPU processes.

diffusers 0.42.1's own plan for LTX-2 (`LTX2VideoTransformer3DModel._cp_plan`) does not run: it splits the video
tokens but not the rotary tables of the audio-video cross-attention (`cross_attn_rope`), and it splits the
self-attention's tables on dim 1 of a 3-D tensor, which the released model's `rope_type="split"` tables, 4-D
`(B, H, N, D)`, are not (diffusers then leaves them whole, with a warning). `LTX2_PLAN` is the plan that runs;
with a text mask (the pipeline passes one) it runs under ring attention, not Ulysses (the attention repeats the mask
over every head, and Ulysses leaves each rank a share of them).
HunyuanVideo has no plan in diffusers: `HUNYUANVIDEO_PLAN` is a user's, equal to one process where the prompt has no
padding. HunyuanVideo 1.5 fails under Ulysses with any plan that splits its tokens (its processor builds a query by
key mask, and diffusers' Ulysses gathers a mask along the keys only).
ChronoEdit and Helios run diffusers' own plans: ChronoEdit's is Wan's (the tokens split at the first block), Helios's
splits each attention's and feed-forward's input and gathers their outputs (`helios_plan`: its entries for the blocks a
model has; diffusers names the 40 of the released model, and fails on fewer). Helios's blocks get its history's tokens
ahead of the clip's, split with them as one sequence: there a rank's tokens form no grid of the clip, and ToMe merges
nothing and says so.

MiniMax-H3 runs diffusers' own plan, which splits its packed sequence (text, audio, then the video) at the first block:
a rank's tokens are a share of the video behind the text and audio on one rank and video alone on the other, unequal
shares; every rank merges as many of its last video tokens as the first rank holds, so the collectives stay equal.

Every scenario runs in one spawn of two ranks (`scenarios`, module fixture `ranks`); the tests read its results.
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import pytest
import torch
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

from test_context_parallel import GLOBAL_MATCHING_BOUND, RATIO, _change, _first_attention, _query_tokens

from parallel_harness import run_ranks


def _split(dim: int, dims: int, output: bool = False) -> ContextParallelInput:
    return ContextParallelInput(split_dim=dim, expected_dims=dims, split_output=output)


#: LTX-2 (the released model's split rotary tables, `(B, H, N, D)`): the video tokens and the text at the model's
#: input, the video self-attention's and the audio-video cross-attention's video tables on their sequence dim, and a
#: per-token timestep where the pipeline passes one (image to video); the audio is not split.
LTX2_PLAN = {
    "": {
        "hidden_states": _split(1, 3),
        "encoder_hidden_states": _split(1, 3),
        "encoder_attention_mask": _split(1, 2),
        "timestep": _split(1, 2),
    },
    "rope": {0: _split(2, 4, True), 1: _split(2, 4, True)},
    "cross_attn_rope": {0: _split(2, 4, True), 1: _split(2, 4, True)},
    "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
}

#: LTX-2 with `rope_type="interleaved"` (diffusers' default config): its tables are `(B, N, D)`, split on dim 1.
LTX2_INTERLEAVED_PLAN = {
    **LTX2_PLAN,
    "rope": {0: _split(1, 3, True), 1: _split(1, 3, True)},
    "cross_attn_rope": {0: _split(1, 3, True), 1: _split(1, 3, True)},
}

#: HunyuanVideo: the video tokens after the patch embedding, the text after its token refiner (which attends over
#: the whole text), the rotary tables `(N, D)` on dim 0.
HUNYUANVIDEO_PLAN = {
    "x_embedder": {0: _split(1, 3, True)},
    "context_embedder": {0: _split(1, 3, True)},
    "rope": {0: _split(0, 2, True), 1: _split(0, 2, True)},
    "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
}

#: HunyuanVideo 1.5: as HunyuanVideo, its text (and the text's mask) split at the first block's input, after the
#: model has put each sample's text together.
HUNYUANVIDEO15_PLAN = {
    "x_embedder": {0: _split(1, 3, True)},
    "rope": {0: _split(0, 2, True), 1: _split(0, 2, True)},
    "transformer_blocks.0": {"encoder_hidden_states": _split(1, 3), "attention_mask": _split(1, 2)},
    "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
}

#: The video tokens a rank holds: 2 frames of 8 x 8 tokens (HunyuanVideo: patch 2), one whole frame a rank; 3 frames,
#: 12 rows of 8 a rank (the middle frame split between them).
WHOLE_FRAMES = {
    "ltx2": 64,
    "ltx2-masks-ring": 64,
    "ltx2-token-timestep": 64,
    "hunyuanvideo": 64,
    "chronoedit": 64,
    "helios": 64,
}
TOKENS = {**WHOLE_FRAMES, "ltx2-mid-frame": 96, "hunyuanvideo-mid-frame": 96}


def _ltx2(rope_type: str = "split", frames: int = 2):
    from test_ltx2 import ltx2_inputs, tiny_ltx2

    model, inputs = tiny_ltx2(rope_type=rope_type), ltx2_inputs(batch=1, frames=frames, h=8, w=8)
    for key in ("encoder_hidden_states", "audio_encoder_hidden_states"):
        inputs[key] = inputs[key][:, :6]  # an even text length, which the plan splits between the ranks
    # diffusers' Ulysses attention gathers no (B, 1, T) text mask (it fails with or without ToMe)
    inputs["encoder_attention_mask"] = inputs["audio_encoder_attention_mask"] = None
    return model, inputs


def _ltx2_token_timestep():
    """As the image-to-video pipeline calls it: a timestep per video token (the first frame's 0, a conditioning
    frame)."""
    model, inputs = _ltx2()
    timestep = torch.full((1, inputs["hidden_states"].shape[1]), 500.0)
    timestep[:, :64] = 0.0
    inputs["audio_timestep"], inputs["timestep"] = inputs["timestep"], timestep
    return model, inputs


def _ltx2_text_masks():
    """With the text masks the pipeline passes: all ones (its text connectors put registers where the prompt's
    padding was)."""
    model, inputs = _ltx2()
    inputs["encoder_attention_mask"] = inputs["audio_encoder_attention_mask"] = torch.ones(1, 6)
    return model, inputs


def _hunyuanvideo(padded: int = 0, frames: int = 2):
    from test_hunyuanvideo import hunyuanvideo_inputs, tiny_hunyuanvideo

    inputs = hunyuanvideo_inputs(batch=1, frames=frames, h=8, w=8, padded=padded)
    inputs["encoder_hidden_states"] = inputs["encoder_hidden_states"][:, 1:]  # 6 text tokens: 3 a rank
    inputs["encoder_attention_mask"] = inputs["encoder_attention_mask"][:, 1:]
    return tiny_hunyuanvideo(), inputs


def _hunyuanvideo15():
    from test_hunyuanvideo import hunyuanvideo15_inputs, tiny_hunyuanvideo15

    return tiny_hunyuanvideo15(), hunyuanvideo15_inputs(batch=1, frames=2, h=8, w=8)


def _chronoedit():
    from family_cases.wan_derived import chronoedit_inputs, tiny_chronoedit

    return tiny_chronoedit(), chronoedit_inputs(batch=1, frames=2, h=16, w=16)


def helios_plan(model: torch.nn.Module) -> dict:
    """Diffusers' plan for Helios (`HeliosTransformer3DModel._cp_plan`) less its entries for blocks `model` lacks."""
    blocks = len(model.blocks)
    return {
        name: entry
        for name, entry in type(model)._cp_plan.items()
        if not (name.split(".")[1].isdigit() and int(name.split(".")[1]) >= blocks)
    }


def _helios(history: bool = False):
    """2 frames of 8 x 8 tokens; with `history`, the history's 160 tokens ahead of them (the pipeline's sizes)."""
    from family_cases.wan_derived import helios_inputs, tiny_helios

    return tiny_helios(), helios_inputs(batch=1, frames=2, h=16, w=16, history=history)


def _minimax_h3():
    """t2va: 8 text rows, 6 audio rows, then 2 frames of 6 x 8 video rows: 110 rows, 55 a rank."""
    from family_cases.video_more import minimax_h3_inputs, tiny_minimax_h3

    return tiny_minimax_h3(), minimax_h3_inputs(batch=1, keyframes=(), text=8)


def _forward(model: torch.nn.Module, inputs: dict) -> np.ndarray:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0].numpy()


def _plain(build, plan) -> dict:
    """One process, then the same model under Ulysses-2 with `plan` (None: diffusers' own), without ToMe; the error
    where it fails."""
    from diffusers import ContextParallelConfig

    model, inputs = build()
    model.set_attention_backend("native")
    solo = _forward(model, inputs)
    try:
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2), cp_plan=plan)
        return dict(solo=solo, out=_forward(model, inputs), error=None)
    except Exception as error:  # noqa: BLE001 - reported to the test
        return dict(solo=solo, out=None, error=f"{type(error).__name__}: {error}")


def _case(build, plan, ring: bool = False) -> dict:
    """One model: plain and ToMe outputs in one process, then under Ulysses-2 (ring-2 where `ring`) with `plan`:
    plain, with ToMe (twice, the query tokens of the first block's first attention recorded) and after
    `remove_tome`."""
    from diffusers import ContextParallelConfig

    import tome_processors as tp

    model, inputs = build()
    model.set_attention_backend("native")
    solo = copy.deepcopy(model)
    plain = _forward(solo, inputs)
    tp.apply_tome(solo, **RATIO)
    solo_tome = _forward(solo, inputs)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        config = ContextParallelConfig(ring_degree=2) if ring else ContextParallelConfig(ulysses_degree=2)
        model.enable_parallelism(config=config, cp_plan=plan)
        parallel_plain = _forward(model, inputs)
        tp.apply_tome(model, **RATIO)
        seen, handles = _query_tokens(_first_attention(model))
        out = _forward(model, inputs)
        again = _forward(model, inputs)
        for handle in handles:
            handle.remove()
        tp.remove_tome(model)
        removed = _forward(model, inputs)
    skips = [str(w.message) for w in caught if issubclass(w.category, tp.ToMeSkipWarning)]
    return dict(
        plain=plain,
        solo_tome=solo_tome,
        parallel_plain=parallel_plain,
        out=out,
        again=again,
        removed=removed,
        tokens=seen,
        skips=skips,
    )


def scenarios(rank: int, world_size: int) -> dict:
    from tome_processors.pays import ALWAYS, pays_table

    with pays_table(ALWAYS):  # as conftest.py sets for every test
        return {
            "ltx2-diffusers-split": _plain(_ltx2, None),
            "ltx2-diffusers-interleaved": _plain(lambda: _ltx2("interleaved"), None),
            "ltx2": _case(_ltx2, LTX2_PLAN),
            "ltx2-interleaved": _plain(lambda: _ltx2("interleaved"), LTX2_INTERLEAVED_PLAN),
            "ltx2-masks-ulysses": _plain(_ltx2_text_masks, LTX2_PLAN),
            "ltx2-masks-ring": _case(_ltx2_text_masks, LTX2_PLAN, ring=True),
            "ltx2-token-timestep": _case(_ltx2_token_timestep, LTX2_PLAN),
            "hunyuanvideo": _case(_hunyuanvideo, HUNYUANVIDEO_PLAN),
            "ltx2-mid-frame": _case(lambda: _ltx2(frames=3), LTX2_PLAN),
            "hunyuanvideo-mid-frame": _case(lambda: _hunyuanvideo(frames=3), HUNYUANVIDEO_PLAN),
            "hunyuanvideo-padded": _plain(lambda: _hunyuanvideo(padded=2), HUNYUANVIDEO_PLAN),
            "hunyuanvideo15": _plain(_hunyuanvideo15, HUNYUANVIDEO15_PLAN),
            "chronoedit": _case(_chronoedit, None),
            "helios": _case(_helios, helios_plan(_helios()[0])),
            "helios-history": _case(lambda: _helios(history=True), helios_plan(_helios()[0])),
            "minimax_h3": _case(_minimax_h3, None),
        }


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(scenarios, world_size=2)


def test_diffusers_own_ltx2_plan_fails_on_its_rotary_tables_without_tome(ranks):
    for rank in ranks:
        # Split tables (the released model's): left whole, as 4-D, beside the split video tokens.
        assert "must match" in rank["ltx2-diffusers-split"]["error"]
        # Interleaved tables: the self-attention's are split, the audio-video cross-attention's are not (64 of 128).
        error = rank["ltx2-diffusers-interleaved"]["error"]
        assert "(64)" in error and "(128)" in error, error


@pytest.mark.parametrize("name", TOKENS)
def test_the_plans_equal_one_process_without_tome(ranks, name):
    for rank in ranks:
        np.testing.assert_allclose(rank[name]["parallel_plain"], rank[name]["plain"], atol=1e-4)


def test_the_ltx2_plan_for_interleaved_tables_equals_one_process(ranks):
    for rank in ranks:
        result = rank["ltx2-interleaved"]
        assert result["error"] is None, result["error"]
        np.testing.assert_allclose(result["out"], result["solo"], atol=1e-4)


@pytest.mark.parametrize("name", TOKENS)
def test_each_rank_merges_its_video_tokens_under_the_plan(ranks, name):
    for result in (rank[name] for rank in ranks):
        assert set(result["tokens"]) == {TOKENS[name] // 2}  # half of the rank's video tokens, every call
        assert not result["skips"]
        solo_change = _change(result["solo_tome"], result["plain"])
        assert solo_change > 1e-3  # ToMe changed it
        # Sources match destinations over the rank's own tokens, not the whole clip (`GLOBAL_MATCHING_BOUND`).
        assert _change(result["out"], result["solo_tome"]) < GLOBAL_MATCHING_BOUND * solo_change
        np.testing.assert_array_equal(result["out"], result["again"])
        np.testing.assert_array_equal(result["removed"], result["parallel_plain"])
        if name in WHOLE_FRAMES:  # a whole frame a rank, merged as one process merges it
            np.testing.assert_allclose(result["out"], result["solo_tome"], atol=1e-5)
    assert ranks[0][name]["tokens"] == ranks[1][name]["tokens"]
    np.testing.assert_array_equal(ranks[0][name]["out"], ranks[1][name]["out"])


def test_ltx2_text_masks_fail_under_ulysses_without_tome(ranks):
    # Its attention repeats the text mask over every head; diffusers' Ulysses leaves each rank a share of the heads.
    for rank in ranks:
        assert "broadcast shape" in rank["ltx2-masks-ulysses"]["error"], rank["ltx2-masks-ulysses"]["error"]


def test_hunyuanvideo_plan_differs_from_one_process_where_the_prompt_is_padded(ranks):
    # The model builds its mask in `forward` from the whole prompt's length: the second rank's half of the text is
    # masked as if it began the prompt.
    for rank in ranks:
        result = rank["hunyuanvideo-padded"]
        assert result["error"] is None and np.abs(result["out"] - result["solo"]).max() > 1e-3


def test_hunyuanvideo15_fails_under_ulysses_without_tome(ranks):
    # Its processor masks queries by keys (B, 1, S, S); diffusers' Ulysses gathers a mask along the keys only.
    for rank in ranks:
        assert "must match" in rank["hunyuanvideo15"]["error"], rank["hunyuanvideo15"]["error"]


def test_helios_history_split_with_the_clip_merges_nothing_and_says_so(ranks):
    # Diffusers' plan splits history (160 tokens) and clip (128) as one sequence of 288: 144 a rank, no grid of
    # the clip (rank 0's run is history and the clip's start). Without ToMe the plan equals one process.
    for result in (rank["helios-history"] for rank in ranks):
        np.testing.assert_allclose(result["parallel_plain"], result["plain"], atol=1e-4)
        assert set(result["tokens"]) == {144}
        assert len(result["skips"]) == 1 and "fewer tokens than its block's grid" in result["skips"][0], result["skips"]
        np.testing.assert_array_equal(result["out"], result["parallel_plain"])
        np.testing.assert_array_equal(result["removed"], result["parallel_plain"])


def test_minimax_h3_ranks_merge_as_many_of_their_last_video_tokens(ranks):
    # Diffusers' own plan equals one process. 110 rows, 55 a rank: rank 0 holds the 14 text and audio rows and 41 video
    # rows, rank 1 55 video rows; each merges its last 41 video rows at ratio 0.5 (20 of them), the rest pass through.
    for result in (rank["minimax_h3"] for rank in ranks):
        np.testing.assert_allclose(result["parallel_plain"], result["plain"], atol=1e-4)
        solo_change = _change(result["solo_tome"], result["plain"])
        assert solo_change > 1e-3  # one process merges
        assert set(result["tokens"]) == {55 - int(0.5 * 41)}
        assert not result["skips"]
        assert _change(result["out"], result["parallel_plain"]) > 1e-3
        assert _change(result["out"], result["solo_tome"]) < GLOBAL_MATCHING_BOUND * solo_change
        np.testing.assert_array_equal(result["out"], result["again"])
        np.testing.assert_array_equal(result["removed"], result["parallel_plain"])
    np.testing.assert_array_equal(ranks[0]["minimax_h3"]["out"], ranks[1]["minimax_h3"]["out"])


def _figures(results: list[dict]) -> None:
    """Print, per scenario of rank 0, how far each output is from one process's (the numbers docs/several-gpus.md
    quotes)."""
    for name, result in results[0].items():
        if "parallel_plain" not in result:
            off = "" if result["out"] is None else f", from one process {abs(result['out'] - result['solo']).max():.2e}"
            print(f"{name}: {result['error'] or 'runs'}{off}")
            continue
        plan = abs(result["parallel_plain"] - result["plain"]).max()
        tome = abs(result["out"] - result["solo_tome"]).max()
        ratio = _change(result["out"], result["solo_tome"]) / _change(result["solo_tome"], result["plain"])
        same = np.array_equal(result["out"], results[1][name]["out"])
        print(
            f"{name}: plan vs one process {plan:.2e}; with ToMe: queries at the first attention "
            f"{sorted(set(result['tokens']))}, vs one process's ToMe {tome:.2e} (max), {ratio:.2f} x ToMe's own "
            f"change; ranks equal: {same}"
        )


if __name__ == "__main__":
    _figures(run_ranks(scenarios, world_size=2))
