"""diffusers' step caches under context parallelism (Ulysses-2), without and with ToMe, on two CPU processes.

Tiny Wan 2.1 (3 blocks, 4 frames of 4 x 4 tokens: two whole frames a rank) and tiny FLUX.1 (2 + 2 blocks, 8 x 8
tokens: 4 rows a rank), `STEPS` denoiser calls in a cache context with the timestep moving, as a pipeline makes
them; and whole tiny pipeline calls (Wan 2.1 with guidance, FLUX.1). Caches: First Block Cache (`threshold=0.5`),
TaylorSeer (`cache_interval=2, disable_cache_before_step=1`, float32 factors; on Wan its identifiers name the
self-attentions, which its defaults miss) and TaylorSeer lite. Every order of `apply_tome`, `enable_parallelism` and
`enable_cache` is run; one spawn of two ranks (`scenarios`, module fixture `ranks`) runs every case, the tests read
its results. `python tests/test_context_parallel_caches.py` prints the figures.

What diffusers 0.42.1 does:
- TaylorSeer computes or predicts by the step count alone: every rank decides alike. Without ToMe the run equals one
  process's; with ToMe it equals one process's cache and ToMe where a rank holds whole frames (Wan).
- First Block Cache decides from the first block's residual, on each rank from the tokens that rank holds, with no
  reduction across ranks: the ranks' ratios differ (and differ from one process's). Where every rank's ratio falls
  on the same side of the threshold, the run goes on as in one process. Where the threshold lies between them, one
  rank skips the remaining blocks while the other runs them and waits in their all-to-alls: the run hangs
  (`test_ranks_that_decide_differently_hang`, slow). The tests' referee (`_record_decisions`) exchanges the ranks'
  decisions and stops both ranks where they differ, so the quick tests show the split without hanging: on the loop
  with a threshold between the ranks' ratios, and on the whole FLUX.1 pipeline call with ToMe at `threshold=0.5`.
- On Wan, whose plan splits the tokens at the first block's input, First Block Cache enabled after
  `enable_parallelism` wraps the split: its first-block hook subtracts the whole input from the rank's output and
  fails, with or without ToMe. Enabled before, it sees the rank's tokens and runs.
"""

from __future__ import annotations

import functools
import queue
import traceback
import warnings
from typing import Any

import numpy as np
import pytest
import torch

from parallel_harness import run_ranks

STEPS = 5
RATIO = {"ratio": 0.5, "use_rand": False}
THRESHOLD = 0.5  # First Block Cache's: above every ratio of the loops, so every step after their first skips
FAMILIES = ("wan", "flux")
CACHES = ("fbc", "taylorseer", "taylorseer-lite")
#: Orders of the calls, without ToMe and with it.
PLAIN_ORDERS = ("cache-parallel", "parallel-cache")
TOME_ORDERS = ("tome-cache-parallel", "tome-parallel-cache", "cache-parallel-tome", "parallel-cache-tome")
#: diffusers' First Block Cache enabled after `enable_parallelism` on Wan: its first-block hook wraps the split.
FAILS = {
    ("wan", "fbc", order) for order in PLAIN_ORDERS + TOME_ORDERS if order.index("parallel") < order.index("cache")
}
#: As in tests/test_context_parallel.py: how far a rank's merges (rows of its own, sources matched over them) may
#: move FLUX.1's output from one process's, beside ToMe's own change.
GLOBAL_MATCHING_BOUND = 1.5
#: A rank's image tokens at the first attention, and with ToMe.
TOKENS = {"wan": 32, "flux": 32}


def _wan():
    from test_video import tiny_wan, wan_inputs

    model = tiny_wan(3)
    model.set_attention_backend("native")
    return model, wan_inputs(batch=1, frames=4, h=8, w=8), lambda m: [m.blocks[0].attn1]


def _flux():
    from test_context_parallel import _flux as flux_case

    from test_dit import tiny_flux

    _, inputs = flux_case()  # 8 x 8 tokens and text of an even length
    model = tiny_flux(2, 2)
    model.set_attention_backend("native")
    return model, inputs, lambda m: [m.transformer_blocks[0].attn]


BUILD = {"wan": _wan, "flux": _flux}


def _config(cache: str, family: str, threshold: float):
    from diffusers.hooks import FirstBlockCacheConfig, TaylorSeerCacheConfig

    if cache == "fbc":
        return FirstBlockCacheConfig(threshold=threshold)
    # TaylorSeer's default identifiers (`^blocks.*attn`) miss Wan's `attn1`: name its self-attentions.
    identifiers = [r"^blocks\.\d+\.attn1"] if family == "wan" and cache == "taylorseer" else None
    return TaylorSeerCacheConfig(
        cache_interval=2,
        disable_cache_before_step=1,
        cache_identifiers=identifiers,
        taylor_factors_dtype=torch.float32,
        use_lite_mode=cache == "taylorseer-lite",
    )


class RanksDisagree(RuntimeError):
    """First Block Cache decided differently on the ranks (raised on every rank, in place of the hang)."""


def _record_decisions(model: torch.nn.Module, referee: bool = False) -> tuple[list, list]:
    """Record what the cache hooks decide, per call: First Block Cache's (the ratio its first block's residual
    changed by, or None on the first step; whether the other blocks run), and whether each TaylorSeer hook
    computes (True) or predicts. Only recorded: the hooks decide as they do. `referee` (under context parallelism):
    the ranks also exchange First Block Cache's ratio and decision (an all-gather of the test's own, beside the
    model's), and where they differ every rank raises `RanksDisagree` rather than run on into the hang."""
    fbc_log: list = []
    taylor_log: list = []
    for module in model.modules():
        registry = getattr(module, "_diffusers_hook", None)
        if registry is None:
            continue
        head = registry.hooks.get("fbc_leader_block_hook")
        if head is not None:

            def recorded(residual, hook=head, decide=head._should_compute_remaining_blocks):
                previous = hook.state_manager.get_state().head_block_residual
                ratio = None
                if previous is not None:  # as diffusers computes it
                    ratio = float((residual - previous).abs().mean() / previous.abs().mean())
                decision = decide(residual)
                fbc_log.append((ratio, decision))
                if referee:
                    import torch.distributed as dist

                    every: list = [None] * dist.get_world_size()
                    dist.all_gather_object(every, (ratio, decision))
                    if len({d for _, d in every}) > 1:
                        raise RanksDisagree(f"call {len(fbc_log) - 1}: (ratio, runs the other blocks) {every}")
                return decision

            head._should_compute_remaining_blocks = recorded
        taylor = registry.hooks.get("taylorseer_cache")
        if taylor is not None:

            def measured(measure=taylor._measure_should_compute):
                should_compute, state = measure()
                taylor_log.append(should_compute)
                return should_compute, state

            taylor._measure_should_compute = measured
    return fbc_log, taylor_log


def _steps(model: torch.nn.Module, inputs: dict) -> list[np.ndarray]:
    """`STEPS` calls as a pipeline makes them: in a cache context, the timestep moving."""
    outputs = []
    first = inputs["timestep"]
    with torch.no_grad():
        for step in range(STEPS):
            with model.cache_context("cond"):
                out = model(**dict(inputs, timestep=first * (1.0 - 0.15 * step)), return_dict=False)[0]
            outputs.append(out.numpy())
    return outputs


def _case(family: str, cache: str | None, order: str, threshold: float = THRESHOLD, referee: bool = True) -> dict:
    """`family`'s model with the calls of `order` (`tome`, `parallel`: Ulysses-2, `cache`), run `STEPS` steps: the
    outputs, the cache's decisions, the query tokens of the first attention, ToMe's warnings; and the error where
    one was raised (the decisions and tokens up to it)."""
    from diffusers import ContextParallelConfig

    import tome_processors as tp
    from test_context_parallel import _query_tokens

    model, inputs, attentions = BUILD[family]()
    result: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for call in order.split("-"):
                if call == "tome":
                    tp.apply_tome(model, **RATIO)
                elif call == "parallel":
                    model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
                elif cache is not None:
                    model.enable_cache(_config(cache, family, threshold))
            result["fbc"], result["taylor"] = _record_decisions(model, referee=referee and "parallel" in order)
            result["tokens"], handles = _query_tokens(attentions(model))
            result["out"] = _steps(model, inputs)
            for handle in handles:
                handle.remove()
        except Exception:  # noqa: BLE001 - the tests read it
            result["error"] = traceback.format_exc()
    result["skips"] = [str(w.message) for w in caught if issubclass(w.category, tp.ToMeSkipWarning)]
    return result


def _pipeline_case(family: str, cache: str, parallel: bool = True) -> dict:
    """A whole tiny pipeline call, twice with one seed, with `cache` enabled, then Ulysses-2 (unless `parallel` is
    False), then ToMe: the outputs, the cache's decisions, the query tokens of the first attention; and the same
    call with the cache alone first (the reference ToMe's change is measured from)."""
    import tempfile
    from pathlib import Path

    from diffusers import ContextParallelConfig

    import tome_processors as tp
    from test_context_parallel import _query_tokens

    if family == "wan":
        from test_video import generate, tiny_wan_pipeline

        pipe = tiny_wan_pipeline(Path(tempfile.mkdtemp()))  # 3 latent frames of 2 x 2 tokens: 6 a rank
        attention = pipe.transformer.blocks[0].attn1
    else:
        from pipelines import family_pipeline

        pipe, call = family_pipeline("flux", tempfile.mkdtemp())  # 4 x 4 tokens: 2 rows a rank
        attention = pipe.transformer.transformer_blocks[0].attn

        def generate(pipe):
            with torch.no_grad():
                return pipe(**call, num_inference_steps=STEPS, generator=torch.Generator().manual_seed(0)).images

    pipe.transformer.set_attention_backend("native")
    pipe.transformer.enable_cache(_config(cache, family, THRESHOLD))
    if parallel:
        pipe.transformer.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
    fbc, taylor = _record_decisions(pipe.transformer, referee=parallel)
    result: dict[str, Any] = dict(fbc=fbc, taylor=taylor)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result["cache_only"] = generate(pipe)
            tp.apply_tome(pipe, ratio=0.5)
            result["tome_from_call"] = len(fbc)  # First Block Cache's decisions of the calls with ToMe start here
            tokens, handles = _query_tokens([attention])
            result["first"], result["second"] = generate(pipe), generate(pipe)
            for handle in handles:
                handle.remove()
            result["tokens"] = tokens
        except RanksDisagree as error:
            result["disagree"] = str(error)
    result["skips"] = [str(w.message) for w in caught if issubclass(w.category, tp.ToMeSkipWarning)]
    return result


def _midway(results: dict, family: str) -> float:
    """Halfway between the ranks' First Block Cache ratios at the second step (`fbc-ratios`)."""
    import torch.distributed as dist

    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, results[family, "fbc-ratios", "cache-parallel"]["fbc"][1][0])
    return sum(every) / len(every)


def scenarios(rank: int, world_size: int) -> dict:
    from tome_processors.pays import ALWAYS, pays_table

    with pays_table(ALWAYS):  # as conftest.py sets for every test
        results = {}
        for family in FAMILIES:
            for cache in CACHES:
                for order in PLAIN_ORDERS + TOME_ORDERS:
                    results[family, cache, order] = _case(family, cache, order)
                results[family, cache, "one-process"] = _case(family, cache, "cache")
                results[family, cache, "one-process-tome"] = _case(family, cache, "tome-cache")
            # First Block Cache that never skips (every ratio is above -1): each step's ratio on each rank.
            results[family, "fbc-ratios", "cache-parallel"] = _case(family, "fbc", "cache-parallel", threshold=-1.0)
            results[family, "fbc-ratios", "one-process"] = _case(family, "fbc", "cache", threshold=-1.0)
            # A threshold between the ranks' first ratios: the ranks decide differently at the second step.
            results[family, "fbc", "midway"] = _case(
                family, "fbc", "cache-parallel", threshold=_midway(results, family)
            )
            for cache in ("fbc", "taylorseer"):
                results[family, cache, "pipeline"] = _pipeline_case(family, cache)
                results[family, cache, "pipeline-one-process"] = _pipeline_case(family, cache, parallel=False)
        return results


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(scenarios, world_size=2, timeout=300)


def _change(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    """The norm of the difference of two runs' outputs, every step."""
    return float(np.linalg.norm(np.stack(a) - np.stack(b)))


def _largest(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return float(np.abs(np.stack(a) - np.stack(b)).max())


def _skipped(result: dict) -> int:
    """Calls where the cache skipped work: First Block Cache's skipped steps, TaylorSeer's predicted modules."""
    return sum(not decision for _, decision in result["fbc"]) + sum(not computed for computed in result["taylor"])


def _ran(ranks: list[dict], key: tuple) -> list[dict]:
    results = [rank[key] for rank in ranks]
    for result in results:
        assert "error" not in result, result["error"]
    return results


PLAIN_CASES = [(f, c, o) for f in FAMILIES for c in CACHES for o in PLAIN_ORDERS if (f, c, o) not in FAILS]
TOME_CASES = [(f, c, o) for f in FAMILIES for c in CACHES for o in TOME_ORDERS if (f, c, o) not in FAILS]


@pytest.mark.parametrize(("family", "cache", "order"), PLAIN_CASES)
def test_each_cache_under_ulysses_without_tome_equals_one_process(ranks, family, cache, order):
    results = _ran(ranks, (family, cache, order))
    solo = ranks[0][family, cache, "one-process"]
    for result in results:
        assert _skipped(result) > 0
        # The same decisions as one process (First Block Cache: here every ratio is far below the threshold).
        assert [d for _, d in result["fbc"]] == [d for _, d in solo["fbc"]]
        assert result["taylor"] == solo["taylor"]
        assert _largest(result["out"], solo["out"]) < 1e-5
        assert set(result["tokens"]) == {TOKENS[family]}
    for a, b in zip(results[0]["out"], results[1]["out"], strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(("family", "cache", "order"), TOME_CASES)
def test_tome_and_each_cache_under_ulysses_in_every_order(ranks, family, cache, order):
    results = _ran(ranks, (family, cache, order))
    solo, solo_tome = ranks[0][family, cache, "one-process"], ranks[0][family, cache, "one-process-tome"]
    for result in results:
        assert _skipped(result) > 0
        assert [d for _, d in result["fbc"]] == [d for _, d in solo_tome["fbc"]]
        assert result["taylor"] == solo_tome["taylor"]
        # Every call of the first attention on this rank merged half of its tokens.
        assert result["tokens"] and set(result["tokens"]) == {TOKENS[family] // 2}
        assert not result["skips"]
        if family == "wan":  # whole frames a rank, matched frame by frame: one process's cache and ToMe
            assert _largest(result["out"], solo_tome["out"]) < 1e-5
        else:
            bound = GLOBAL_MATCHING_BOUND * _change(solo_tome["out"], solo["out"])
            assert _change(result["out"], solo_tome["out"]) < bound
    for a, b in zip(results[0]["out"], results[1]["out"], strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("order", sorted(o for _, _, o in FAILS))
def test_first_block_cache_enabled_after_enable_parallelism_fails_on_wan(ranks, order):
    # diffusers' own limit, with or without ToMe: Wan's plan splits the tokens at `blocks.0`'s input; a hook added
    # after the split wraps it and sees the whole input, then the first block's output of the rank's half.
    for rank in ranks:
        error = rank["wan", "fbc", order]["error"]
        assert "The size of tensor a (32) must match the size of tensor b (64)" in error
        assert "first_block_cache.py" in error


@pytest.mark.parametrize("family", FAMILIES)
def test_first_block_cache_decides_on_each_ranks_tokens(ranks, family):
    # The ratio First Block Cache compares with its threshold is each rank's own: the ranks' differ from each other
    # and from one process's, so a threshold between them makes the ranks decide differently (the run then hangs:
    # test_ranks_that_decide_differently_hang).
    ratios = [[r for r, _ in rank[family, "fbc-ratios", "cache-parallel"]["fbc"][1:]] for rank in ranks]
    solo = [r for r, _ in ranks[0][family, "fbc-ratios", "one-process"]["fbc"][1:]]
    assert len(ratios[0]) == len(ratios[1]) == STEPS - 1
    for step in range(STEPS - 1):
        assert ratios[0][step] != ratios[1][step]
        between = (ratios[0][step] + ratios[1][step]) / 2
        assert (ratios[0][step] > between) != (ratios[1][step] > between)
        assert solo[step] not in (ratios[0][step], ratios[1][step])


#: (family, cache) of the whole pipeline calls that run on both ranks; First Block Cache on the FLUX.1 pipeline
#: does not (`test_first_block_cache_on_the_flux_pipeline_decides_differently_on_the_ranks`).
PIPELINES = [("wan", "fbc"), ("wan", "taylorseer"), ("flux", "taylorseer")]
#: The pipelines' tokens a rank at the first attention, merged by half: Wan's 3 latent frames of 2 x 2 (6 a rank,
#: the middle frame split: merged as 3 rows of 2), FLUX.1's 4 x 4 (2 rows of 4 a rank).
PIPELINE_MERGED = {"wan": 3, "flux": 4}
#: How far the pipelines' output under Ulysses with ToMe may be from one process's, in units of ToMe's own change:
#: Wan's ranks start mid-frame (rows merged where one process merges frames; the bound tests/test_context_parallel.py
#: holds such a shard to), FLUX.1's match over their own rows.
PIPELINE_BOUND = {"wan": 2.0, "flux": GLOBAL_MATCHING_BOUND}


@pytest.mark.parametrize(("family", "cache"), PIPELINES)
def test_a_pipeline_with_a_cache_and_tome_under_ulysses(ranks, family, cache):
    results = [rank[family, cache, "pipeline"] for rank in ranks]
    solo = ranks[0][family, cache, "pipeline-one-process"]
    for result in results:
        assert "disagree" not in result, result["disagree"]
        assert _skipped(result) > 0
        assert result["tokens"] and set(result["tokens"]) == {PIPELINE_MERGED[family]}
        assert not result["skips"]
        np.testing.assert_array_equal(result["first"], result["second"])  # the same output twice with one seed
        # The cache alone: one process's output.
        assert _largest([result["cache_only"]], [solo["cache_only"]]) < 1e-5
        toms_change = _change([solo["first"]], [solo["cache_only"]])
        assert 0 < _change([result["first"]], [solo["first"]]) < PIPELINE_BOUND[family] * toms_change
    np.testing.assert_array_equal(results[0]["first"], results[1]["first"])


def test_first_block_cache_on_the_flux_pipeline_decides_differently_on_the_ranks(ranks):
    # The whole FLUX.1 pipeline call with First Block Cache (threshold 0.5) under Ulysses-2: the call with the cache
    # alone ran (every rank's ratio below the threshold, at every step); in the call after ToMe was turned on, one
    # rank's ratio fell below the threshold and the other's above it, so one rank would skip the remaining blocks
    # and the other run them (the hang; here the test's referee stops both ranks there).
    results = [rank["flux", "fbc", "pipeline"] for rank in ranks]
    assert results[0]["disagree"] == results[1]["disagree"]
    for result in results:
        call = len(result["fbc"]) - 1
        assert call >= result["tome_from_call"] == STEPS
        assert all(decision == (ratio is None) for ratio, decision in result["fbc"][:STEPS])
    ratios = sorted(result["fbc"][-1][0] for result in results)
    assert ratios[0] < THRESHOLD < ratios[1]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_threshold_between_the_ranks_ratios_splits_their_decision(ranks, family):
    # Where the threshold lies between the ranks' ratios, one rank decides to skip the remaining blocks and the other
    # to run them, at the second step (the test's referee stops both there; without it the run hangs).
    for rank in ranks:
        error = rank[family, "fbc", "midway"]["error"]
        assert "RanksDisagree: call 1:" in error
        decisions = [d for _, d in rank[family, "fbc", "midway"]["fbc"]]
        assert decisions[0] is True and len(decisions) == 2
    assert {rank[family, "fbc", "midway"]["fbc"][1][1] for rank in ranks} == {True, False}


def _wan_first_block_cache(threshold: float, rank: int, world_size: int) -> dict:
    return _case("wan", "fbc", "cache-parallel", threshold=threshold, referee=False)


@pytest.mark.slow
def test_ranks_that_decide_differently_hang(ranks):
    # A threshold between the two ranks' first ratios: one rank skips the last two blocks and waits in the output's
    # gather, the other runs them and waits in their all-to-all. Neither returns.
    first = [rank["wan", "fbc-ratios", "cache-parallel"]["fbc"][1][0] for rank in ranks]
    with pytest.raises(queue.Empty):
        run_ranks(functools.partial(_wan_first_block_cache, sum(first) / 2), world_size=2, timeout=30)


def main() -> None:
    ranks = run_ranks(scenarios, world_size=2, timeout=300)
    for family in FAMILIES:
        ratios = [[round(r, 4) for r, _ in rank[family, "fbc-ratios", "cache-parallel"]["fbc"][1:]] for rank in ranks]
        solo = [round(r, 4) for r, _ in ranks[0][family, "fbc-ratios", "one-process"]["fbc"][1:]]
        print(
            f"{family}: First Block Cache ratios, steps 1-{STEPS - 1}: rank 0 {ratios[0]}, rank 1 {ratios[1]}, "
            f"one process {solo}"
        )
    for (family, cache, order), result in ranks[0].items():
        if order.startswith(("one-process", "pipeline")) or cache == "fbc-ratios":
            continue
        if "error" in result:
            print(f"{family} {cache} {order}: error: {result['error'].strip().splitlines()[-1]}")
            continue
        other = ranks[1][family, cache, order]
        solo = ranks[0][family, cache, "one-process-tome" if "tome" in order else "one-process"]
        line = (
            f"{family} {cache} {order}: skipped {_skipped(result)}/{_skipped(other)} (rank 0/1), "
            f"queries {sorted(set(result['tokens']))}/{sorted(set(other['tokens']))}, "
            f"ranks equal {all(np.array_equal(a, b) for a, b in zip(result['out'], other['out'], strict=True))}, "
            f"largest difference from one process {_largest(result['out'], solo['out']):.2g}"
        )
        if "tome" in order:
            reference = _change(solo["out"], ranks[0][family, cache, "one-process"]["out"])
            line += f", {_change(result['out'], solo['out']) / reference:.2f}x ToMe's own change"
        print(line)
    for family, cache in [*PIPELINES, ("flux", "fbc")]:
        result, other = (rank[family, cache, "pipeline"] for rank in ranks)
        solo = ranks[0][family, cache, "pipeline-one-process"]
        ratios = [[None if r is None else round(r, 3) for r, _ in rank["fbc"]] for rank in (result, other, solo)]
        line = f"{family} pipeline, {cache}: "
        if cache == "fbc":
            line += (
                f"First Block Cache ratios by call, rank 0 {ratios[0]}, rank 1 {ratios[1]}, one process {ratios[2]}; "
            )
        if "disagree" in result:
            print(line + f"ranks decide differently at {result['disagree']}")
            continue
        toms_change = _change([solo["first"]], [solo["cache_only"]])
        print(
            line + f"skipped {_skipped(result)}/{_skipped(other)}, "
            f"queries {sorted(set(result['tokens']))}/{sorted(set(other['tokens']))}, "
            f"ranks equal {np.array_equal(result['first'], other['first'])}, "
            f"same twice {np.array_equal(result['first'], result['second'])}, cache alone from one process "
            f"{_largest([result['cache_only']], [solo['cache_only']]):.2g}, with ToMe "
            f"{_change([result['first']], [solo['first']]) / toms_change:.2f}x ToMe's own change"
        )


if __name__ == "__main__":
    main()
