"""`tome-processors bench`: the engine and the CLI end to end on tiny architectures (no timing assertions)."""

from __future__ import annotations

import json
import logging
import math
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from PIL import Image

import tome_processors
from tome_processors import ToMeConfig
from tome_processors.bench import engine, meta
from tome_processors.bench.engine import (
    BenchSettings,
    Method,
    Row,
    _schedule,
    record_block_inputs,
    run_benchmark,
    shared_weight_copy,
)
from tome_processors.bench.hostcost import count_aten_ops, measure_host_cost
from tome_processors.bench.methods import (
    MODES,
    _ours_overhead,
    baseline_method,
    mode_methods,
    ours_methods,
    pick_methods,
    tomesd_methods,
)
from tome_processors.bench.models import build_model
from tome_processors.bench.quality import DIT_EPS_CHANGE, DIT_PSNR_DROP, TRAINED_EPS_CHANGE, TRAINED_PSNR_DROP
from tome_processors.bench.report import format_number, json_safe, markdown_table, save_json
from tome_processors.bench.unet import build_unet, make_inputs
from tome_processors.cli import bench_command
from tome_processors.cli.main import build_parser, main
from tome_processors.config import PRESETS
from tome_processors.context import BlockState
from tome_processors.families import find_family

from pipelines import tiny_sd_pipeline
from test_dit import flux_inputs, tiny_flux

FAST = ["--quick", "--threads", "1", "--rounds", "1", "--no-progress", "--no-trained-quality", "--presets", "none"]
NUMBERS = ("seconds", "speedup", "rel_error", "peak_memory_mib", "memory_before_mib")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One in-process `bench --quick` run with JSON and plot, shared by the checks below."""
    out = tmp_path_factory.mktemp("bench")
    argv = ["bench", *FAST, "--ratios", "0.3", "0.5", "0.7", "--modes", "kv-avg", "bf16"]
    code = main([*argv, "--json", str(out / "b.json"), "--plot", str(out / "b.png")])
    assert code == 0
    return json.loads((out / "b.json").read_text()), out


def test_quick_json_has_every_row_with_finite_numbers(quick_run):
    data, _ = quick_run
    names = [row["name"] for row in data["rows"]]
    expected = ["baseline"] + [f"{who} r={r}" for who in ("ours", "tomesd") for r in (0.3, 0.5, 0.7)]
    expected += ["ours kv-avg"] + [f"ours bf16-sim r={r}" for r in (0.3, 0.5, 0.7)]
    assert names == expected
    for row in data["rows"]:
        assert all(math.isfinite(row[key]) for key in NUMBERS), row
        assert row["seconds"] > 0 and row["speedup"] > 0
        # one round: one run per method; the baseline before, between groups of three, and after
        assert len(row["times"]) == (1 + math.ceil((len(names) - 1) / 3) if row["name"] == "baseline" else 1)
        if row["family"] != "baseline":
            assert math.isfinite(row["overhead_share"]) and row["overhead_share"] > 0
            # the time columns and the speed-up come from the same round
            assert row["pair_baseline_seconds"] / row["pair_seconds"] == pytest.approx(row["speedup"])
            assert row["speedup_min"] <= row["speedup"] <= row["speedup_max"]
    assert data["meta"]["batch"] == 2 and data["meta"]["tomesd"] and "bench --quick" in data["meta"]["command"]
    assert data["meta"]["wall_seconds"] > 0 and data["meta"]["rounds"] == 1


def test_quick_fidelity(quick_run):
    rows = {row["name"]: row for row in quick_run[0]["rows"]}
    assert rows["baseline"]["rel_error"] == 0.0 and rows["baseline"]["speedup"] == 1.0
    assert rows["baseline"]["overhead_share"] is None
    for name, row in rows.items():
        if name != "baseline":
            assert 0.0 < row["rel_error"] < 1.0, name  # merging changes the output, but not wildly


def test_plot_is_a_png(quick_run):
    with Image.open(quick_run[1] / "b.png") as image:
        assert image.format == "PNG" and image.size[0] > 300


def test_python_dash_m_entry(tmp_path):
    path = tmp_path / "m.json"
    args = [*FAST, "--ratios", "0.5", "--modes", "none", "--no-tomesd", "--no-memory", "--json", str(path)]
    done = subprocess.run(
        [sys.executable, "-m", "tome_processors", "bench", *args], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "| ours r=0.5 |" in done.stdout
    rows = json.loads(path.read_text())["rows"]
    assert [r["name"] for r in rows] == ["baseline", "ours r=0.5"] and rows[1]["peak_memory_mib"] is None


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--ratios", "0.9"], "--ratios between 0"),
        (["--ratios", "0"], "--ratios between 0"),
        (["--modes", "fastest"], "--modes among"),
        (["--modes", "none", "kv-avg"], "--modes among"),
        (["--resolution", "100"], "multiple of 8"),
        (["--rounds", "0"], "--rounds >= 1"),
        (["--pipeline", "--compile"], "without --compile"),
        (["--arch", "sd4"], "invalid choice"),
        (["--model", "somewhere", "--arch", "sd15"], "either --model or --arch"),
        (["--device", "cuda:0"] if not torch.cuda.is_available() else ["--device", "nowhere"], "--device"),
    ],
)
def test_bad_options_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "error:" in err and message in err


def test_sdxl_shaped_quick(tmp_path):
    path = tmp_path / "xl.json"
    assert main(["bench", *FAST, "--arch", "sdxl", "--ratios", "0.5", "--modes", "none", "--json", str(path)]) == 0
    rows = {r["name"]: r for r in json.loads(path.read_text())["rows"]}
    # merging acts at downsample 2, SDXL's first level with attention, for both libraries
    assert rows["ours r=0.5"]["rel_error"] > 0 and rows["tomesd r=0.5"]["rel_error"] > 0


def test_trained_quality_columns_and_plot(tmp_path):
    path, plot = tmp_path / "q.json", tmp_path / "q.png"
    fast = [arg for arg in FAST if arg != "--no-trained-quality"]
    argv = ["bench", *fast, "--no-tomesd", "--ratios", "0.5", "--modes", "kv-avg", "--no-memory"]
    assert main([*argv, "--json", str(path), "--plot", str(plot), "--plot-error", "trained"]) == 0
    rows = {r["name"]: r["extra"] for r in json.loads(path.read_text())["rows"]}
    assert rows["baseline"] == {TRAINED_EPS_CHANGE: 0.0, TRAINED_PSNR_DROP: 0.0}
    for name in ("ours r=0.5", "ours kv-avg"):
        assert 0 < rows[name][TRAINED_EPS_CHANGE] < 100 and math.isfinite(rows[name][TRAINED_PSNR_DROP])
    with Image.open(plot) as image:
        assert image.format == "PNG"


def test_transformer_rows_get_the_trained_dit_columns(tmp_path):
    path, plot = tmp_path / "d.json", tmp_path / "d.png"
    fast = [arg for arg in FAST if arg != "--no-trained-quality"]
    argv = ["bench", *fast, "--arch", "sd3", "--ratios", "0.5", "--modes", "share", "--no-memory", "--no-host-cost"]
    assert main([*argv, "--json", str(path), "--plot", str(plot), "--plot-error", "trained"]) == 0
    rows = {r["name"]: r["extra"] for r in json.loads(path.read_text())["rows"]}
    assert sorted(rows) == ["baseline", "ours r=0.5", "ours share-level r=0.5"]
    assert rows["baseline"] == {DIT_EPS_CHANGE: 0.0, DIT_PSNR_DROP: 0.0}  # not the UNet's columns
    for name in ("ours r=0.5", "ours share-level r=0.5"):
        assert 0 < rows[name][DIT_EPS_CHANGE] < 100 and math.isfinite(rows[name][DIT_PSNR_DROP])
    assert rows["ours r=0.5"][DIT_EPS_CHANGE] != rows["ours share-level r=0.5"][DIT_EPS_CHANGE]
    with Image.open(plot) as image:
        assert image.format == "PNG"


def test_pipeline_grid_on_a_saved_tiny_pipeline(tmp_path):
    tiny_sd_pipeline(tmp_path).save_pretrained(tmp_path / "pipe")
    grid, path = tmp_path / "grid.png", tmp_path / "p.json"
    argv = ["bench", "--model", str(tmp_path / "pipe"), "--pipeline", "--resolution", "32", "--steps", "2"]
    argv += ["--ratios", "0.5", "--modes", "kv-avg", "--presets", "none", "--rounds", "1", "--threads", "1"]
    argv += ["--no-progress"]
    assert main([*argv, "--grid", str(grid), "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [row["name"] for row in rows] == ["baseline", "ours r=0.5", "tomesd r=0.5", "ours kv-avg"]
    assert all(row["seconds_per_image"] > 0 and row["seconds_per_step"] > 0 for row in rows)
    assert rows[0]["image_change"] == 0.0 and all(row["image_change"] > 0 for row in rows[1:])
    with Image.open(grid) as image:
        assert image.size[0] == 4 * 160 and image.size[1] > 160


def test_engine_extra_metrics_column():
    torch.set_num_threads(1)
    unet = build_unet("tiny")
    inputs = make_inputs(unet, batch=2, resolution=64)
    methods = [
        baseline_method(),
        *ours_methods([0.5], 1),
        *tomesd_methods([0.5], 1),
        *mode_methods(["share"], [0.5], 1),
    ]
    settings = BenchSettings(rounds=2, measure_memory=False, progress=False)
    rows = run_benchmark(unet, methods, inputs.run, settings, extra_metrics=lambda m: {"quality": 1.5})
    assert all(row.extra == {"quality": 1.5} for row in rows)
    # one timed run per round; the baseline before and after the one group of three: 2 x 2
    assert [len(row.times) for row in rows] == [4, 2, 2, 2]
    table = markdown_table(rows)
    assert table.splitlines()[0].endswith("| quality |") and "| 1.5 |" in table
    # every method was taken off again: the baseline output is back
    assert not any("ToMe" in type(p).__name__ for p in unet.attn_processors.values())


def test_two_level_mode_reaches_the_second_attention_level():
    # From the model's first attention level: SD1.5 (1) pools levels 1-2, SDXL (2) levels 2-4.
    (sd15,) = mode_methods(["kv-avg-2lv"], [0.5], auto_downsample=1)
    (sdxl,) = mode_methods(["kv-avg-2lv"], [0.5], auto_downsample=2)
    assert (sd15.settings["max_downsample"], sdxl.settings["max_downsample"]) == (2, 4)
    assert sd15.settings["mode"] == "downsample_kv" and sd15.name == "ours kv-avg 2 levels"


def test_matching_modes_set_window_matching_and_the_feed_forward():
    window, shared, mlp, video = mode_methods(["window", "window-share", "mlp-share", "temporal-window"], [0.7], 1)
    assert window.settings == {"ratio": 0.7, "matching": "window"} and window.name == "ours window r=0.7"
    assert shared.settings == {"ratio": 0.7, "share_level": True, "matching": "window"}
    assert mlp.settings == {"ratio": 0.7, "merge_mlp": True, "share_level": True}
    assert video.settings == {"ratio": 0.7, "st": 2, "matching": "window"}


def test_rounds_bracket_every_method_with_baseline_runs():
    for round_index in range(4):
        order = _schedule(8, round_index, 3, timed=True)
        assert order[0] == 0 and order[-1] == 0 and sorted(i for i in order if i) == list(range(1, 8))
        gaps = [len(group) for group in "".join("|" if i == 0 else "x" for i in order).strip("|").split("|")]
        assert max(gaps) <= 3
    assert _schedule(8, 1, 3, timed=True)[1] == 2  # rotated by one place per round
    assert _schedule(7, 0, 3, timed=True) == [0, 1, 2, 3, 0, 4, 5, 6, 0]  # a multiple of the group size
    assert _schedule(1, 2, 3, timed=True) == [0]  # the baseline alone
    with pytest.raises(ValueError, match="baseline_every"):
        BenchSettings(baseline_every=0)


def test_each_method_is_paired_with_the_baseline_runs_around_it(monkeypatch):
    # A fake clock that drifts by 10% per forward; every method runs in half the baseline's time at
    # that moment. With one method per group, the mean of the two baseline runs around a method is
    # the baseline's time at the method's own moment, so every paired speed-up is exactly 2.
    clock = {"calls": 0, "factor": 1.0}

    def fake_timed(call, device):
        out = call()
        clock["calls"] += 1
        clock["last"] = (1 + 0.1 * clock["calls"]) * clock["factor"]
        return out, clock["last"]

    def halved(unet):
        clock["factor"] = 0.5

    def restored(unet):
        clock["factor"] = 1.0

    monkeypatch.setattr(engine, "timed", fake_timed)
    unet = torch.nn.Linear(2, 2)
    methods = [baseline_method()] + [Method(f"half {i}", "half", None, halved, restored) for i in range(3)]
    settings = BenchSettings(rounds=3, measure_memory=False, progress=False, baseline_every=1)

    def inner() -> float:  # a second measure of each run: a quarter of it
        return clock["last"] / 4

    rows = run_benchmark(unet, methods, lambda model: model(torch.ones(1, 2)), settings, inner_seconds=inner)
    assert [row.speedup for row in rows] == pytest.approx([1.0, 2.0, 2.0, 2.0])
    assert [len(row.times) for row in rows] == [12, 3, 3, 3]  # 4 baseline runs per round
    # The second measure is paired by the same rule.
    assert [row.inner_speedup for row in rows] == pytest.approx([1.0, 2.0, 2.0, 2.0])
    assert [row.inner_times for row in rows] == [[t / 4 for t in row.times] for row in rows]
    assert all(row.inner_seconds == pytest.approx(row.seconds / 4) for row in rows)


def test_time_columns_and_speed_up_come_from_one_round_with_the_spread_of_all(monkeypatch):
    # The baseline takes 1 s; the method a different share of it in each round (after its warm-up forward):
    # ratios 2, 4, 1.25, 2.5. The row's speed-up is one round's ratio (the lower middle one of four: 2), its
    # two times are that round's, and the lowest and highest ratios are kept.
    shares = iter([0.5, 0.5, 0.25, 0.8, 0.4])
    state = {"share": 1.0}

    def fake_timed(call, device):
        return call(), state["share"]

    def applied(unet):
        state["share"] = next(shares)

    def removed(unet):
        state["share"] = 1.0

    monkeypatch.setattr(engine, "timed", fake_timed)
    methods = [baseline_method(), Method("half", "half", None, applied, removed)]
    settings = BenchSettings(rounds=4, measure_memory=False, host_cost=False, progress=False)
    baseline, row = run_benchmark(torch.nn.Linear(2, 2), methods, lambda model: model(torch.ones(1, 2)), settings)
    assert row.times == [0.5, 0.25, 0.8, 0.4] and row.seconds == pytest.approx(0.45)  # the median of its runs
    assert (row.speedup, row.pair_seconds, row.pair_baseline_seconds) == pytest.approx((2.0, 0.5, 1.0))
    assert (row.speedup_min, row.speedup_max) == pytest.approx((1.25, 4.0))
    assert (baseline.speedup, baseline.speedup_min, baseline.pair_seconds) == (1.0, None, baseline.seconds)
    cells = [cell.strip() for cell in markdown_table([baseline, row]).splitlines()[3].strip("|").split("|")]
    assert cells[2:6] == ["0.500", "1.000", "2.00x", "1.25-4.00x"]


def test_host_cost_is_counted_on_a_forward_that_finds_the_caches_filled():
    # Like ours (per-grid tables), this method does extra work on its first forward after being applied.
    handles = []

    def fill_once(model):
        filled = []

        def pre_hook(module, args):
            if not filled:
                filled.append(torch.arange(8).cumsum(0).sum())  # the cache fill: aten ops on the first forward only

        handles.append(model.register_forward_pre_hook(pre_hook))

    def remove(model):
        handles.pop().remove()

    calls = []

    def forward(model):
        calls.append(1)
        return model(torch.ones(1, 2))

    methods = [baseline_method(), Method("cached", "cached", None, fill_once, remove)]
    settings = BenchSettings(rounds=2, warmup=1, measure_memory=False, progress=False)
    base, cached = run_benchmark(torch.nn.Linear(2, 2), methods, forward, settings)
    assert cached.aten_ops == base.aten_ops and not handles
    # Reference, the warm-up round with each method's inspection right after its warm-up forward, two rounds
    # of baseline-method-baseline: no separate forward to fill the caches before counting.
    assert len(calls) == 1 + 2 * 2 + 2 * 3


def test_short_forwards_are_timed_in_runs_of_several():
    calls = []

    def forward(model):
        calls.append(1)
        time.sleep(0.002)  # a forward of about 2 ms
        return model(torch.ones(1, 2))

    methods = [baseline_method(), Method("same", "same", None, lambda m: None, lambda m: None)]
    settings = BenchSettings(rounds=2, measure_memory=False, host_cost=False, progress=False, min_run_seconds=0.05)
    base, same = run_benchmark(torch.nn.Linear(2, 2), methods, forward, settings)
    repeats = base.forwards_per_run
    assert repeats == same.forwards_per_run and 2 <= repeats <= 25  # 50 ms of forwards of 2 ms or more
    # Reference, one warm-up forward each, the forward that sizes the runs, then per round baseline-method-baseline.
    assert len(calls) == 1 + 2 + 1 + 2 * 3 * repeats
    assert len(same.times) == 2 and all(t >= 0.002 for t in same.times)  # a run's time: the mean of its forwards
    with pytest.raises(ValueError, match="min_run_seconds"):
        BenchSettings(min_run_seconds=-1)


def test_quick_rows_count_host_cost(quick_run):
    rows = {row["name"]: row for row in quick_run[0]["rows"]}
    for row in rows.values():
        assert isinstance(row["aten_ops"], int) and isinstance(row["sync_ops"], int), row["name"]
        assert row["cuda_kernels"] is None and row["cuda_syncs"] is None and row["compiles"] is None  # CPU, eager
    base = rows["baseline"]["aten_ops"]
    assert base > 100 and rows["baseline"]["sync_ops"] == 0
    for name in ("ours r=0.5", "tomesd r=0.5", "ours kv-avg"):
        assert rows[name]["aten_ops"] > base, name  # matching, merging or pooling adds operators
    assert rows["tomesd r=0.5"]["sync_ops"] == 0 and rows["tomesd r=0.5"]["sync_op_names"] == {}
    assert all(sum(row["sync_op_names"].values()) == row["sync_ops"] for row in rows.values())


def test_host_cost_counts_worked_examples():
    _, ops, syncs = count_aten_ops(lambda: torch.ones(2, 2) @ torch.ones(2, 2))
    assert dict(ops) == {"ones": 2, "mm": 1} and not syncs
    value, cost = measure_host_cost(lambda: torch.ones(3).sum().item(), torch.device("cpu"))
    assert value == 3.0 and (cost.aten_ops, cost.sync_ops) == (3, 1)
    assert cost.sync_op_names == {"_local_scalar_dense": 1} and cost.cuda_kernels is None
    x = torch.arange(6.0)
    _, cost = measure_host_cost(lambda: x[x > 2] + torch.tensor([1.0]), torch.device("cpu"))
    assert cost.sync_op_names == {"index (bool mask)": 1, "lift_fresh": 1} and cost.aten_ops == 4  # gt, index, +
    _, cost = measure_host_cost(lambda: x[torch.tensor([0, 2])].sum() > 1 and x.nonzero(), torch.device("cpu"))
    assert cost.sync_op_names == {"_local_scalar_dense": 1, "lift_fresh": 1, "nonzero": 1}
    _, cost = measure_host_cost(lambda: x.view(2, 3).t().contiguous(), torch.device("cpu"))
    assert (cost.aten_ops, cost.sync_ops) == (3, 0)  # views count: view, t, clone


def test_markdown_shows_host_columns_only_when_measured():
    plain = Row("baseline", "baseline", None, 1.5, 1.0, 0.0)
    assert "aten ops" not in markdown_table([plain])
    counted = Row("baseline", "baseline", None, 1.5, 1.0, 0.0, aten_ops=362, sync_ops=0, compiles=0)
    header, _, line = markdown_table([counted]).splitlines()
    assert header.endswith("| aten ops | sync ops | compiles |") and "CUDA kernels" not in header
    assert line.endswith("| 362 | 0 | 0 |")


def test_json_writes_infinity_as_a_string_and_nan_as_null(tmp_path):
    row = Row("x", "ours", 0.5, 1.0, 1.0, math.inf, overhead_share=math.nan, extra={"psnr": -math.inf})
    data = json.loads(save_json([row], {"note": math.inf}, tmp_path / "r.json").read_text())
    assert data["meta"] == {"note": "inf"}
    assert (data["rows"][0]["rel_error"], data["rows"][0]["overhead_share"]) == ("inf", None)
    assert data["rows"][0]["extra"] == {"psnr": "-inf"}
    assert json_safe((1, torch.float16)) == [1, "torch.float16"]
    assert [format_number(v) for v in (None, math.inf, -math.inf, math.nan, 12345.6, 3)] == [
        "-", "inf", "-inf", "nan", "12346", "3"
    ]  # fmt: skip


def test_overhead_replay_draws_the_merges_of_a_real_forward(monkeypatch):
    # The replay goes through the library's per-block path (ModelState / BlockState), so on the block
    # inputs of a forward it must compute exactly the merges that forward computed.
    unet = build_unet("tiny")
    inputs = make_inputs(unet, batch=2, resolution=128)
    seen: list[tuple[int, torch.Tensor]] = []
    merge_for = BlockState.merge_for

    def spy(self, config):
        merge = merge_for(self, config)
        if merge is not None:
            seen.append((self.index, merge.token_row.clone()))
        return merge

    monkeypatch.setattr(BlockState, "merge_for", spy)
    for method in [*ours_methods([0.5], auto_downsample=1), *mode_methods(["share"], [0.7], auto_downsample=1)]:
        method.apply(unet)
        try:
            recording = record_block_inputs(unet, lambda: inputs.run(unet))
        finally:
            method.remove(unet)
        in_forward, seen[:] = list(seen), []
        method.overhead(recording)()
        assert len(in_forward) >= 2 and [i for i, _ in seen] == [i for i, _ in in_forward], method.name
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(seen, in_forward, strict=True)), method.name
        seen.clear()


def test_compiled_run_keeps_each_method_on_a_shared_weight_copy():
    torch.set_num_threads(1)
    unet = build_unet("tiny")
    inputs = make_inputs(unet, batch=2, resolution=64)
    copy = shared_weight_copy(unet)
    assert copy is not unet and copy.conv_in.weight is unet.conv_in.weight
    methods = [baseline_method(), *ours_methods([0.5], 1), *mode_methods(["kv-avg"], [0.5], 1)]
    settings = BenchSettings(rounds=2, measure_memory=False, progress=False, compile="default")
    settings.compile_backend = "eager"  # dynamo traces, no code generation: seconds, not minutes
    rows = run_benchmark(unet, methods, inputs.run, settings)
    # warm-up settled every compiled graph: the timed runs reused them, for every method
    assert [row.compiles for row in rows] == [0, 0, 0]
    assert rows[0].rel_error == 0.0 and all(0.0 < row.rel_error < 1.0 for row in rows[1:])
    assert all(row.aten_ops > 0 for row in rows)
    assert not any("ToMe" in type(p).__name__ for p in unet.attn_processors.values())


def test_keep_applied_times_later_forwards_on_copies_and_leaves_the_model_plain():
    applied: list[torch.nn.Module] = []
    firsts: list[torch.nn.Module] = []

    def apply(model):
        applied.append(model)
        model.register_forward_pre_hook(
            lambda module, args: firsts.append(module) if not firsts.count(module) else None
        )

    def remove(model):
        model._forward_pre_hooks.clear()

    model = torch.nn.Linear(2, 2)
    methods = [baseline_method(), Method("hooked", "hooked", None, apply, remove)]
    settings = BenchSettings(rounds=3, warmup=1, measure_memory=False, host_cost=False, progress=False)
    base, hooked = run_benchmark(model, methods, lambda m: m(torch.ones(1, 2)), replace(settings, keep_applied=True))
    # Applied once, on a copy that shares the weights; the model itself never held the method.
    assert len(applied) == 1 and applied[0] is not model and applied[0].weight is model.weight
    assert not model._forward_pre_hooks and hooked.rel_error == 0.0
    # Without it: applied again before every forward of the method, on the model itself.
    applied.clear()
    run_benchmark(model, methods, lambda m: m(torch.ones(1, 2)), settings)
    assert len(applied) > 1 and all(m is model for m in applied)


def test_compile_option_on_the_cli(tmp_path):
    path = tmp_path / "c.json"
    argv = ["bench", *FAST, "--ratios", "0.5", "--modes", "none", "--no-tomesd", "--no-memory", "--rounds", "1"]
    assert main([*argv, "--compile", "--compile-backend", "eager", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["meta"]["compile"] == "default (eager)"
    assert [row["compiles"] for row in data["rows"]] == [0, 0]
    args = build_parser().parse_args(["bench", "--compile", "reduce-overhead"])
    assert args.compile == "reduce-overhead"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "--compile", "fastest"])


def test_default_and_full_grids():
    args = build_parser().parse_args(["bench"])
    bench_command._resolve_defaults(args)
    assert (args.ratios, args.modes, args.presets, args.rounds) == ([], [], list(PRESETS), 3)
    args = build_parser().parse_args(["bench", "--full"])
    bench_command._resolve_defaults(args)
    assert args.ratios == [0.3, 0.5, 0.7] and args.modes == list(MODES) and args.rounds == 5
    assert args.presets == list(PRESETS)
    args = build_parser().parse_args(["bench", "--full", "--ratios", "0.4", "--rounds", "2"])
    bench_command._resolve_defaults(args)
    assert (args.ratios, args.rounds) == ([0.4], 2)
    unet = build_unet("tiny")
    methods, notes = pick_methods(unet, find_family(unet))
    names = ["baseline", "ours exact r=0.5", "ours balanced", "ours fast", "tomesd r=0.5"]
    assert [m.name for m in methods] == names and notes == []


def test_the_command_loads_no_pipeline_class_until_it_builds_a_pipeline():
    # diffusers' pipeline classes import transformers' image processors, which warn at start-up where
    # torchvision is missing; only `bench --pipeline` needs them.
    code = (
        "import sys, tome_processors.cli.main\n"
        "from tome_processors.bench.pipelines import build_pipeline\n"
        "print(sorted(k for k in sys.modules if k.startswith('diffusers.pipelines.') and k.count('.') >= 3))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]"
    assert "requires torchvision" not in result.stderr


def test_half_precision_model_builds_without_the_float32_warning():
    # diffusers' library logger may not propagate to the root logger (caplog), so listen on it directly.
    records: list[logging.LogRecord] = []
    listener = logging.Handler()
    listener.emit = records.append
    diffusers_logger = logging.getLogger("diffusers")
    diffusers_logger.addHandler(listener)
    try:
        for arch in ("sd15", "pixart"):
            build_model(arch=arch, quick=True, dtype=torch.float16)
        assert not [r for r in records if "kept in float32" in r.getMessage()]
        build_unet("tiny").to(torch.float16)  # diffusers' own cast does warn: the check above can fail
        assert [r for r in records if "kept in float32" in r.getMessage()]
    finally:
        diffusers_logger.removeHandler(listener)


def test_the_reported_version_is_the_running_code_and_the_distribution_is_built_from_it():
    # One source: pyproject reads the version from tome_processors.__version__, so a source tree reports the
    # same version as the installed distribution, and the bench's metadata shows it.
    assert meta.versions()["tome_processors"] == tome_processors.__version__
    installed = meta.package_version("tome-processors")
    assert installed in (None, tome_processors.__version__)
    pyproject = (Path(__file__).parents[1] / "pyproject.toml").read_text(encoding="utf-8")
    assert 'dynamic = ["version"]' in pyproject and 'attr = "tome_processors.__version__"' in pyproject


def test_flux_overhead_replay_records_row_tokens_as_a_real_forward_does():
    model, inputs = tiny_flux(), flux_inputs(batch=1)
    recording = record_block_inputs(model, lambda: model(**inputs))
    assert recording.needs_row_token
    merges = []
    merge_for = BlockState.merge_for

    def spy(self, config):
        merge = merge_for(self, config)
        merges.append(merge)
        return merge

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(BlockState, "merge_for", spy)
        _ours_overhead(ToMeConfig(ratio=0.5), auto_downsample=1)(recording)()
    assert merges and all(m is not None and m.row_token is not None for m in merges)
