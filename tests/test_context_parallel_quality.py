"""The presets' quality bounds under context parallelism, on the shipped trained models that have a plan in diffusers.

The FLUX-shaped model (`FluxTransformer2DModel`) and the video model (`WanTransformer3DModel`) are measured as
tests/test_trained_shapes.py measures them in one process (the same held-out crops and clips, noise, timesteps and
metric: the relative change of the noise prediction, and on clips the flicker), here with the model under
`ContextParallelConfig(ulysses_degree=2)` on two CPU ranks, each merging the tokens it holds. The bounds are the
one-process tests': "balanced" changes the prediction no more than ToMe at 0.5 (tomesd's algorithm; on the video
model frame by frame, the "exact" preset) and, on the video model, flickers no more; "fast" changes it at most
twice as much. The reference is measured the same way: under context parallelism for the bound under it.

Cases (all split evenly between the two ranks): FLUX 64 x 64 crops, 32 rows of 32 tokens (16 rows a rank, the 8
text tokens 4 a rank); the video model's 8-frame clips (4 whole frames a rank) and the same clips cut to 7 frames
(56 rows of 16 a rank, the fourth frame split between the ranks: the common real case, as Wan's odd latent frame
counts). One spawn of two ranks measures every case (`ulysses`); one process and ring attention
(`ring_degree=2`) are the slow sweep (`sweep`, a second spawn).

`python tests/test_context_parallel_quality.py [--ring]` prints the figures as a markdown table.
"""

from __future__ import annotations

import functools
import sys
import time
from typing import Any

import pytest

from parallel_harness import run_ranks

#: One spawn of two ranks measuring the trained models for a minute or more: the heavy part (`-m slow`); the quick run
#: keeps the presets' bounds in one process (tests/test_trained_shapes.py) and merging under context parallelism
#: (tests/test_context_parallel.py).
pytestmark = pytest.mark.slow

pytest.importorskip("skimage")

#: The probe of tests/test_trained_shapes.py: two held-out crops per photo (two clips per photo and motion).
PROBE = {"timesteps": (100, 300), "per_image": 2, "seed": 0}
#: case: (shipped denoiser, family whose presets it measures, frames of the clips or None for images)
CASES: dict[str, tuple[str, str, int | None]] = {
    "flux": ("flux", "flux", None),
    "video-8": ("video", "wan", 8),
    "video-7": ("video", "wan", 7),
}
#: Which rank measures a case in one process (before the ranks join for the parallel runs): the work split evenly.
SOLO_RANK = {"flux": 0, "video-7": 0, "video-8": 1}
METHODS = ("reference", "balanced", "fast")
REFERENCE = "ToMe at 0.5"
#: The bounds: a method's change of the noise prediction at most this many times the reference's.
EPS_BOUND = {"balanced": 1.0, "fast": 2.0}


def _configs(family: str) -> dict[str, Any]:
    from tome_processors import ToMeConfig

    return {
        "reference": ToMeConfig(ratio=0.5),
        "balanced": ToMeConfig.from_preset("balanced", family),
        "fast": ToMeConfig.from_preset("fast", family),
    }


def _probe(case: str):
    """The one-process tests' probe (`QualityProbe.default(denoiser=..., **PROBE)`), its clips cut to the case's
    frames."""
    from tome_processors.bench.quality import QualityProbe, heldout_samples, load_denoiser

    denoiser, _, frames = CASES[case]
    model, scheduler = load_denoiser(denoiser)
    samples = heldout_samples(denoiser, PROBE["per_image"], seed=PROBE["seed"])
    if frames is not None:
        samples = samples[:, :, :frames].contiguous()
    return QualityProbe(model, scheduler.alphas_cumprod, samples, PROBE["timesteps"], PROBE["seed"])


def _tuple_output(model) -> None:
    """Call `model` with `return_dict=False` (as diffusers' pipelines do) and wrap its output as the probe reads
    it: FLUX's plan gathers the model's output only as a tensor or a tuple."""
    from diffusers.models.modeling_outputs import Transformer2DModelOutput

    forward = model.forward

    def tuple_forward(*args, return_dict: bool = True, **kwargs):
        return Transformer2DModelOutput(sample=forward(*args, return_dict=False, **kwargs)[0])

    model.forward = tuple_forward


def _figures(probe, family: str) -> dict[str, dict[str, float]]:
    from tome_processors import apply_tome, remove_tome

    rows = {}
    for name, config in _configs(family).items():
        row = probe.measure(lambda model, config=config: apply_tome(model, config), remove_tome)
        rows[name] = {key: row[key] for key in ("eps_rel_change", "flicker", "psnr_drop") if key in row}
    return rows


def measure(rank: int, world_size: int, solo: bool = False, modes: tuple[str, ...] = ("ulysses",)) -> dict:
    """On each rank: with `solo`, its share of the one-process figures (`SOLO_RANK`); then every case under each
    of `modes` (`"ulysses"`, `"ring"`: degree `world_size`). Returns {case: {"solo": rows or None, mode: rows}}
    with the seconds each took and, for the cases the rank measured alone, how far the unmerged prediction under
    each mode is from one process's (`{mode}_unmerged_change`)."""
    import torch
    from diffusers import ContextParallelConfig

    from tome_processors.bench.engine import relative_error

    results: dict[str, dict] = {case: {"solo": None} for case in CASES}
    solo_base = {}
    for case, (_, family, _) in CASES.items():
        if solo and SOLO_RANK[case] % world_size == rank:
            start = time.perf_counter()
            probe = _probe(case)
            results[case]["solo"] = _figures(probe, family)
            results[case]["solo_s"] = time.perf_counter() - start
            solo_base[case] = probe.baseline()
    for mode in modes:
        config = ContextParallelConfig(**{f"{mode}_degree": world_size})
        for case, (_, family, _) in CASES.items():
            torch.distributed.barrier()
            start = time.perf_counter()
            probe = _probe(case)
            probe.model.set_attention_backend("native")
            probe.model.enable_parallelism(config=config)
            _tuple_output(probe.model)
            results[case][mode] = _figures(probe, family)
            results[case][f"{mode}_s"] = time.perf_counter() - start
            if case in solo_base:
                results[case][f"{mode}_unmerged_change"] = relative_error(probe.baseline(), solo_base[case])
    return results


def measure_all(solo: bool, modes: tuple[str, ...]) -> tuple[list[dict], dict]:
    """One spawn of two ranks measuring every case; the ranks' results and, merged, each case's figures (the
    one-process ones from the rank that measured them, the parallel ones from rank 0)."""
    per_rank = run_ranks(functools.partial(measure, solo=solo, modes=modes))
    merged = {}
    for case in CASES:
        merged[case] = dict(per_rank[0][case])
        for result in per_rank:
            for key, value in result[case].items():
                if key == "solo" or key.startswith("solo_") or key.endswith("_unmerged_change"):
                    merged[case][key] = value if value is not None else merged[case].get(key)
    return per_rank, merged


def holds(rows: dict[str, dict[str, float]], method: str) -> bool:
    """Whether `method` meets its bound against the reference measured the same way: its change of the noise
    prediction at most `EPS_BOUND[method]` times the reference's and, for "balanced" on clips, its flicker at most
    the reference's."""
    row, reference = rows[method], rows["reference"]
    eps_holds = 0.0 < row["eps_rel_change"] <= EPS_BOUND[method] * reference["eps_rel_change"]
    if method != "balanced" or "flicker" not in row:
        return eps_holds
    return eps_holds and 0.0 < row["flicker"] <= reference["flicker"]


def _cases() -> list:
    """(case, method) for every preset."""
    return [pytest.param(case, method, id=f"{case}-{method}") for case in CASES for method in EPS_BOUND]


@pytest.fixture(scope="module")
def ulysses() -> dict:
    """Every case under Ulysses-2, in one spawn of two ranks."""
    per_rank, merged = measure_all(solo=False, modes=("ulysses",))
    for case in CASES:  # every rank holds the gathered prediction, so every rank measures the same figures
        assert per_rank[0][case]["ulysses"] == per_rank[1][case]["ulysses"], case
    return merged


@pytest.fixture(scope="module")
def sweep() -> dict:
    """One process, Ulysses-2 and ring-2: the slow sweep's one spawn."""
    return measure_all(solo=True, modes=("ulysses", "ring"))[1]


@pytest.mark.parametrize(("case", "method"), _cases())
def test_presets_meet_their_bound_under_ulysses(ulysses, case, method):
    assert holds(ulysses[case]["ulysses"], method), ulysses[case]["ulysses"]


@pytest.mark.slow
@pytest.mark.parametrize(("case", "method"), _cases())
def test_presets_meet_their_bound_under_ring(sweep, case, method):
    assert holds(sweep[case]["ring"], method), sweep[case]["ring"]


@pytest.mark.slow
@pytest.mark.parametrize(("case", "method"), _cases())
def test_presets_meet_their_bound_in_one_process_on_the_same_inputs(sweep, case, method):
    assert holds(sweep[case]["solo"], method), sweep[case]["solo"]


@pytest.mark.slow
def test_the_unmerged_model_under_parallelism_predicts_as_one_process(sweep):
    for case in CASES:
        for mode in ("ulysses", "ring"):
            assert sweep[case][f"{mode}_unmerged_change"] < 1e-5, (case, mode)


@pytest.mark.slow
def test_whole_frames_a_rank_merge_the_reference_as_one_process(sweep):
    """8 frames, 4 a rank, merged frame by frame: ToMe at 0.5 gives one process's figures."""
    for mode in ("ulysses", "ring"):
        for key, value in sweep["video-8"]["solo"]["reference"].items():
            assert sweep["video-8"][mode]["reference"][key] == pytest.approx(value, rel=1e-4), (mode, key)


def table(merged: dict, modes: tuple[str, ...]) -> str:
    """The figures as a markdown table: per case and method, the change of the noise prediction (and flicker) in
    one process and under each mode, and whether the bound holds under each."""
    labels = {"ulysses": "Ulysses-2", "ring": "ring-2"}
    header = ["model", "tokens (per rank)", "method", "bound", "one process"] + [labels[m] for m in modes]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    shapes = {
        "flux": "64x64 crops: 32 x 32 (16 rows)",
        "video-8": "8 frames of 16 x 16 (4 frames)",
        "video-7": "7 frames of 16 x 16 (56 rows: frame 4 split)",
    }
    for case, (denoiser, _, _) in CASES.items():
        model = "FLUX-shaped" if denoiser == "flux" else "Wan-shaped video"
        for method in METHODS:
            bound = {"reference": "-", "balanced": "<= reference", "fast": "<= 2 x reference"}[method]
            if method == "balanced" and denoiser == "video":
                bound += ", flicker too"
            cells = []
            for source in ("solo", *modes):
                row = merged[case][source][method]
                cell = f"{100 * row['eps_rel_change']:.2f}%"
                if "flicker" in row:
                    cell += f" ({100 * row['flicker']:.2f}%)"
                if method != "reference" and not holds(merged[case][source], method):
                    cell += " **fails**"
                cells.append(cell)
            name = REFERENCE if method == "reference" else method
            lines.append("| " + " | ".join([model, shapes[case], name, bound, *cells]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    modes = ("ulysses", "ring") if "--ring" in sys.argv else ("ulysses",)
    started = time.perf_counter()
    _, figures = measure_all(solo=True, modes=modes)
    print(table(figures, modes))
    print(f"\n{time.perf_counter() - started:.0f} s")
