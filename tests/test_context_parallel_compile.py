"""torch.compile of a model under diffusers' context parallelism (Ulysses-2), with and without ToMe, on two CPU
processes: a tiny Wan 2.1, native attention, 4 frames of 4 x 4 tokens (two whole frames a rank).

One spawn of two ranks (`scenarios`, module fixture `ranks`) runs every case; the tests read its results. Graphs
are counted by a counting backend (`CompileCounterWithBackend`: dynamo's capture, run by the `eager` backend, one
case by `aot_eager`, one by `inductor`), over three forwards at three timesteps, after one eager pass over the same
timesteps (the reference outputs). `python tests/test_context_parallel_compile.py` prints what each rank saw.

What diffusers' context parallelism does under dynamo, without ToMe (diffusers 0.42.1):
- its split hook warns through `logger.warning_once` where an input has fewer dimensions than its plan expects: Wan
  2.1's timestep, one per sample (`(B,)`; the plan splits a `(B, N)` one). dynamo cannot trace a logger call: a graph
  break by default, an error with `fullgraph=True`, unless `torch._dynamo.config.ignore_logging_functions` holds
  `logging.Logger.warning_once`;
- on a model's first call its hooks read the forward's signature (`inspect.signature`), which dynamo cannot trace:
  a model compiled before any eager call raises with `fullgraph=True` (and breaks its graph otherwise).
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch

from parallel_harness import run_ranks

#: One spawn of two ranks compiling a dozen cases for a minute or more: the heavy part (`-m slow`); the quick run keeps
#: merging under context parallelism (tests/test_context_parallel.py) and compiling in one process
#: (tests/test_host_cost.py, tests/test_copy_compile_fuse.py).
pytestmark = pytest.mark.slow

TIMESTEPS = (900, 600, 300)
GRID = (4, 8, 8)  # latent frames, height, width: 4 x 4 x 4 tokens
#: A rank's run starting mid-row: 3 frames of 3 x 4 tokens, 18 a rank (4 rows of 4, and 2 merged as edges).
MID_ROW_GRID = (3, 6, 8)


def _wan(grid: tuple[int, int, int], parallel: bool, **tome: Any):
    from diffusers import ContextParallelConfig

    import tome_processors as tp

    from test_video import tiny_wan, wan_inputs

    model = tiny_wan(2)
    model.set_attention_backend("native")
    if parallel:
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
    if tome:
        tp.apply_tome(model, **tome)
    frames, h, w = grid
    return model, wan_inputs(batch=1, frames=frames, h=h, w=w)


def _forward(model: Any, inputs: dict, t: int) -> np.ndarray:
    with torch.no_grad():
        return model(**{**inputs, "timestep": torch.full((1,), t)}, return_dict=False)[0].numpy()


def _ignoring_warning_once():
    import torch._dynamo

    return torch._dynamo.config.patch(ignore_logging_functions={logging.Logger.warning_once})


def _compiled(
    model: torch.nn.Module,
    inputs: dict,
    backend: str = "eager",
    fullgraph: bool = True,
    method: bool = False,
    ignore_warning_once: bool = True,
) -> dict:
    """Compile `model` (`torch.compile(model)`, or `model.compile()` where `method`) and run it at each timestep:
    the graphs counted after each forward, the graph breaks (their reasons), the outputs, or the error raised."""
    import contextlib

    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend(backend)
    if method:
        model.compile(backend=counter, fullgraph=fullgraph)
        compiled = model
    else:
        compiled = torch.compile(model, backend=counter, fullgraph=fullgraph)
    graphs, outputs, error = [], [], None
    with _ignoring_warning_once() if ignore_warning_once else contextlib.nullcontext():
        try:
            for t in TIMESTEPS:
                outputs.append(_forward(compiled, inputs, t))
                graphs.append(counter.frame_count)
        except torch._dynamo.exc.Unsupported as exc:
            error = str(exc)
    breaks = [reason for reason, count in counters["graph_break"].items() for _ in range(count)]
    result = dict(graphs=graphs, breaks=breaks, outputs=outputs, error=error)
    torch._dynamo.reset()
    return result


def _case(grid, parallel: bool, backend: str = "eager", method: bool = False, **tome: Any) -> dict:
    """One model: its eager outputs at each timestep, then compiled (after that eager pass) at each timestep."""
    model, inputs = _wan(grid, parallel, **tome)
    eager = [_forward(model, inputs, t) for t in TIMESTEPS]
    return dict(eager=eager, **_compiled(model, inputs, backend=backend, method=method))


def scenarios(rank: int, world_size: int) -> dict:
    from tome_processors.pays import ALWAYS, pays_table

    with pays_table(ALWAYS):  # as conftest.py sets for every test: presets merge on tiny models too
        return _scenarios()


def _scenarios() -> dict:
    import tome_processors as tp

    results: dict[str, Any] = {}
    # Without ToMe: fullgraph (the logger call ignored); the default (the logger call a graph break); fullgraph with
    # the logger call; fullgraph before any eager call.
    results["plain"] = _case(GRID, True)
    model, inputs = _wan(GRID, True)
    _forward(model, inputs, TIMESTEPS[0])
    results["plain-default"] = _compiled(model, inputs, fullgraph=False, ignore_warning_once=False)
    results["plain-logger"] = _compiled(model, inputs, ignore_warning_once=False)
    model, inputs = _wan(GRID, True)
    results["plain-first-call"] = _compiled(model, inputs)
    # With ToMe, applied before compiling, after one eager pass: random destinations (the default), a preset
    # through `model.compile()`, a run from mid-row (2 tokens after its rows), and the preset in one process to compare.
    results["ratio"] = _case(GRID, True, ratio=0.5)
    results["balanced"] = _case(GRID, True, method=True, preset="balanced")
    results["mid-row"] = _case(MID_ROW_GRID, True, backend="aot_eager", ratio=0.5, use_rand=False)
    results["ratio-default"] = _ratio_default()
    # ToMe's first call compiled (diffusers' hooks past theirs: one eager forward before `apply_tome`).
    for name, tome in [("ratio-first-call", {"ratio": 0.5}), ("balanced-first-call", {"preset": "balanced"})]:
        model, inputs = _wan(GRID, True)
        _forward(model, inputs, TIMESTEPS[0])
        tp.apply_tome(model, **tome)
        results[name] = _compiled(model, inputs)
    results["one-process-ratio"] = _case(GRID, False, ratio=0.5)
    results["one-process-balanced"] = _case(GRID, False, method=True, preset="balanced")
    results["inductor"] = _case(GRID, True, backend="inductor", ratio=0.5)
    for result in results.values():  # what every test reads, small
        result["outputs"] = [np.asarray(o) for o in result.get("outputs", [])]
    return results


def _ratio_default() -> dict:
    """ToMe without `fullgraph` and with the logger call left in: as many graphs as without ToMe."""
    model, inputs = _wan(GRID, True, ratio=0.5)
    _forward(model, inputs, TIMESTEPS[0])
    return _compiled(model, inputs, fullgraph=False, ignore_warning_once=False)


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run_ranks(scenarios)


def _max_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    assert len(a) == len(b) == len(TIMESTEPS)
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def test_context_parallel_compiles_in_one_graph_without_tome_once_its_logger_call_is_ignored(ranks):
    for rank in ranks:
        plain = rank["plain"]
        assert plain["error"] is None and plain["breaks"] == []
        assert plain["graphs"] == [1, 1, 1]  # one graph, no recompile at the second and third timestep
        assert _max_difference(plain["outputs"], plain["eager"]) <= 1e-6
    np.testing.assert_array_equal(ranks[0]["plain"]["outputs"][0], ranks[1]["plain"]["outputs"][0])


def test_diffusers_context_parallel_breaks_the_graph_at_its_logger_call_and_on_a_first_call(ranks):
    for rank in ranks:
        default = rank["plain-default"]
        assert default["error"] is None and default["graphs"] == [1, 1, 1]
        assert default["breaks"] and all("logging.Logger" in reason for reason in default["breaks"])
        assert "split will not be applied" in " ".join(default["breaks"])
        assert _max_difference(default["outputs"], rank["plain"]["eager"]) <= 1e-6
        logger = rank["plain-logger"]["error"]
        assert logger is not None and "logging.Logger" in logger and "warning_once" in logger
        first = rank["plain-first-call"]["error"]  # the hooks' `inspect.signature` of the forward, on a first call
        assert first is not None and "hasattr" in first and "__wrapped__" in first


def test_tome_under_context_parallelism_compiles_in_as_many_graphs_as_one_process_and_equals_eager(ranks):
    for rank in ranks:
        plain_graphs = rank["plain"]["graphs"]
        for name, one_process in [("ratio", "one-process-ratio"), ("balanced", "one-process-balanced")]:
            case = rank[name]
            assert case["error"] is None and case["breaks"] == [], name
            count = case["graphs"][0]
            assert case["graphs"] == [count] * 3, name  # no recompile at the second and third timestep
            assert count == rank[one_process]["graphs"][0], name  # as in one process
            assert _max_difference(case["outputs"], case["eager"]) <= 1e-6, name
            assert _max_difference(case["eager"], rank["plain"]["eager"]) > 1e-3, name  # ToMe merged
        assert rank["ratio"]["graphs"] == plain_graphs  # the ratio: one graph, as without ToMe
        # The preset's `pays_only` rule reads the input's device in the model's pre-hook: a graph of its own, as in
        # one process.
        assert rank["balanced"]["graphs"] == [2, 2, 2]
        default = rank["ratio-default"]
        assert default["error"] is None and default["graphs"] == rank["plain-default"]["graphs"]
        assert len(default["breaks"]) == len(rank["plain-default"]["breaks"])
        assert _max_difference(default["outputs"], rank["ratio"]["eager"]) <= 1e-6
    for name in ("ratio", "balanced"):  # every rank returns the same gathered output
        np.testing.assert_array_equal(ranks[0][name]["outputs"][0], ranks[1][name]["outputs"][0])


def test_tome_compiles_where_a_rank_starts_mid_row_and_under_inductor(ranks):
    for rank in ranks:
        for name, tolerance in [("mid-row", 1e-6), ("inductor", 1e-5)]:
            case = rank[name]
            assert case["error"] is None and case["breaks"] == [], name
            assert case["graphs"] == [1, 1, 1], name
            assert _max_difference(case["outputs"], case["eager"]) <= tolerance, name


#: The eager outputs each case without its own is compared with.
REFERENCE = {
    "plain-default": "plain",
    "ratio-default": "ratio",
    "ratio-first-call": "ratio",
    "balanced-first-call": "balanced",
}


def test_tome_compiled_on_its_first_call_reads_the_shard_in_the_graph_and_a_preset_recompiles_once(ranks):
    # ToMe's first forward traced: the parallel config, the shard and its grid are read while tracing. With the
    # ratio, one graph; with a preset, the model pre-hook's graph (the `pays_only` decision, which its first call
    # stores) is traced again at the second forward, once. After one eager forward: no recompile.
    for rank in ranks:
        for name, graphs, reference in [
            ("ratio-first-call", [1, 1, 1], "ratio"),
            ("balanced-first-call", [2, 3, 3], "balanced"),
        ]:
            case = rank[name]
            assert case["error"] is None and case["breaks"] == [], name
            assert case["graphs"] == graphs, name
            assert _max_difference(case["outputs"], rank[reference]["eager"]) <= 1e-6, name


def main() -> None:
    """Print each case's graph counts, graph breaks and largest difference from eager, per rank."""
    for index, rank in enumerate(run_ranks(scenarios)):
        for name, case in rank.items():
            eager = case.get("eager", rank[REFERENCE[name]]["eager"] if name in REFERENCE else None)
            ran = eager is not None and len(case["outputs"]) == len(TIMESTEPS)
            difference = f"{_max_difference(case['outputs'], eager):.1e}" if ran else "-"
            error = case["error"].splitlines()[0] if case["error"] else "-"
            print(
                f"rank {index} {name}: graphs after each forward {case['graphs']}, graph breaks "
                f"{len(case['breaks'])}, max |compiled - eager| {difference}, error: {error}"
            )


if __name__ == "__main__":
    main()
