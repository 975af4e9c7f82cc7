"""`tome-processors bench`: the CLI end to end on tiny architectures (no timing assertions)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from PIL import Image

from pipelines import tiny_sd_pipeline
from tome_processors.bench_methods import baseline_method, mode_methods, ours_methods, tomesd_methods
from tome_processors.bench_models import build_unet, make_inputs
from tome_processors.bench_quality import TRAINED_EPS_CHANGE, TRAINED_PSNR_DROP
from tome_processors.bench_report import markdown_table
from tome_processors.benchmark import BenchSettings, run_benchmark
from tome_processors.cli.main import main

FAST = ["--quick", "--threads", "1", "--rounds", "1", "--no-progress", "--no-trained-quality"]
NUMBERS = ("seconds", "speedup", "rel_error", "peak_memory_mib", "memory_before_mib")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One in-process `bench --quick` run with JSON and plot, shared by the checks below."""
    out = tmp_path_factory.mktemp("bench")
    code = main(
        ["bench", *FAST, "--modes", "kv-avg", "bf16", "--json", str(out / "b.json"), "--plot", str(out / "b.png")]
    )
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
    assert data["meta"]["batch"] == 2 and data["meta"]["tomesd"] and "bench --quick" in data["meta"]["command"]


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
        (["--pipeline"], "--model with --pipeline"),
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


def test_pipeline_grid_on_a_saved_tiny_pipeline(tmp_path):
    tiny_sd_pipeline(tmp_path).save_pretrained(tmp_path / "pipe")
    grid, path = tmp_path / "grid.png", tmp_path / "p.json"
    argv = ["bench", "--model", str(tmp_path / "pipe"), "--pipeline", "--resolution", "32", "--steps", "2"]
    argv += ["--ratios", "0.5", "--modes", "kv-avg", "--rounds", "1", "--threads", "1", "--no-progress"]
    assert main([*argv, "--grid", str(grid), "--json", str(path)]) == 0
    assert len(json.loads(path.read_text())["rows"]) == 4  # baseline, ours, tomesd, kv-avg
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
    rows = run_benchmark(unet, methods, lambda: inputs.run(unet), settings, extra_metrics=lambda m: {"quality": 1.5})
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


def test_rounds_bracket_every_method_with_baseline_runs():
    from tome_processors.benchmark import _schedule  # noqa: PLC0415

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
    from tome_processors import benchmark  # noqa: PLC0415
    from tome_processors.benchmark import Method  # noqa: PLC0415

    clock = {"calls": 0, "factor": 1.0}

    def fake_timed(call, device):
        out = call()
        clock["calls"] += 1
        return out, (1 + 0.1 * clock["calls"]) * clock["factor"]

    def halved(unet):
        clock["factor"] = 0.5

    def restored(unet):
        clock["factor"] = 1.0

    monkeypatch.setattr(benchmark, "_timed", fake_timed)
    unet = torch.nn.Linear(2, 2)
    methods = [baseline_method()] + [Method(f"half {i}", "half", None, halved, restored) for i in range(3)]
    settings = BenchSettings(rounds=3, measure_memory=False, progress=False, baseline_every=1)
    rows = run_benchmark(unet, methods, lambda: unet(torch.ones(1, 2)), settings)
    assert [row.speedup for row in rows] == pytest.approx([1.0, 2.0, 2.0, 2.0])
    assert [len(row.times) for row in rows] == [12, 3, 3, 3]  # 4 baseline runs per round
