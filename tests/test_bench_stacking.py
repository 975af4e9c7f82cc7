"""`tome-processors bench --pipeline --stack deepcache`: DeepCache alone, ToMe alone and both, per image.

Every run here is `--quick` (tiny components) at 64 px, one round: a few seconds each. No timing assertions: the
rows, the summary against the product of the two speed-ups, the JSON fields and the skip without DeepCache.
"""

from __future__ import annotations

import json
import math
import sys

import pytest

from tome_processors.bench.engine import BenchSettings
from tome_processors.bench.generate import time_generations
from tome_processors.bench.methods import baseline_method, preset_methods
from tome_processors.bench.models import build_model
from tome_processors.bench.stacking import generations_in_run, stack_methods, stacking_summary
from tome_processors.cli.main import main

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = ["--pipeline", "--quick", "--resolution", "64", "--rounds", "1", "--threads", "1", "--no-progress"]
ROWS = ["baseline", "ours balanced", "DeepCache", "DeepCache + ours balanced"]


def run_cli(tmp_path, *argv: str) -> dict:
    path = tmp_path / "s.json"
    assert main(["bench", *FAST, *argv, "--json", str(path), "--grid", str(tmp_path / "grid.png")]) == 0
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def stack_run(tmp_path_factory):
    pytest.importorskip("DeepCache", reason="DeepCache is in the bench and test extras")
    return run_cli(tmp_path_factory.mktemp("stack"), "--stack", "deepcache", "--steps", "6")


def test_rows_are_the_baseline_tome_deepcache_and_both(stack_run):
    rows = {row["name"]: row for row in stack_run["rows"]}
    assert list(rows) == ROWS  # --stack's default rows: balanced, no tomesd
    for row in rows.values():
        assert all(math.isfinite(row[key]) and row[key] > 0 for key in ("seconds_per_image", "speedup_per_image"))
        assert row["denoiser_calls"] == 7  # PNDM: one more than the 6 steps, DeepCache or not
    assert rows["baseline"]["image_change"] == 0.0
    # Each changes the image, and the pair differently from either alone.
    changes = [rows[name]["image_change"] for name in ROWS[1:]]
    assert all(change > 0 for change in changes) and len(set(changes)) == 3
    assert rows["DeepCache"]["settings"]["cache_interval"] == 3
    assert rows["DeepCache + ours balanced"]["settings"]["mode"] == rows["ours balanced"]["settings"]["mode"]


def test_summary_sets_the_pair_beside_the_product_of_the_two(stack_run):
    meta = stack_run["meta"]
    assert meta["stack"].startswith("DeepCache, cache interval 3") and meta["steps"] == 6
    assert meta["steps_picked"] is None  # --steps given: nothing picked
    rows = {row["name"]: row for row in stack_run["rows"]}
    (entry,) = meta["stacking"]
    assert (entry["pair"], entry["tome"], entry["accelerator"]) == (ROWS[3], ROWS[1], ROWS[2])
    for unit in ("image", "step"):
        tome = rows["ours balanced"][f"speedup_per_{unit}"]
        deepcache = rows["DeepCache"][f"speedup_per_{unit}"]
        pair = rows["DeepCache + ours balanced"][f"speedup_per_{unit}"]
        assert entry[f"product_per_{unit}"] == pytest.approx(tome * deepcache)
        assert entry[f"pair_per_{unit}"] == pair
        assert entry[f"ratio_per_{unit}"] == pytest.approx(pair / (tome * deepcache))
    assert entry["pair_change"] == rows["DeepCache + ours balanced"]["image_change"]
    assert entry["accelerator_change"] == rows["DeepCache"]["image_change"]


def test_the_table_is_printed(tmp_path, capsys):
    pytest.importorskip("DeepCache", reason="DeepCache is in the bench and test extras")
    run_cli(tmp_path, "--stack", "deepcache", "--steps", "3", "--no-memory")
    out = capsys.readouterr().out
    assert "| pair | per | ToMe alone | accelerator alone | product of the two | pair | pair / product" in out
    assert "| DeepCache + ours balanced | image |" in out and "| DeepCache + ours balanced | step |" in out


def test_without_deepcache_its_rows_are_skipped_with_a_message(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "DeepCache", None)  # import DeepCache now fails, as when it is not installed
    data = run_cli(tmp_path, "--stack", "deepcache", "--steps", "2", "--no-memory")
    out = capsys.readouterr().out
    assert 'note: DeepCache is not installed: pip install "tome-processors[bench]"' in out
    assert "the DeepCache rows are skipped" in out and "| pair | per |" not in out
    assert [row["name"] for row in data["rows"]] == ["baseline", "ours balanced"]
    assert data["meta"]["stacking"] == []


def test_without_steps_the_size_and_step_count_are_picked_and_printed(tmp_path, capsys):
    pytest.importorskip("DeepCache", reason="DeepCache is in the bench and test extras")
    data = run_cli(tmp_path, "--stack", "deepcache", "--no-memory", "--presets", "fast")
    out = capsys.readouterr().out
    # The tiny pipeline takes milliseconds: its own size and the most steps the picker offers (the default).
    assert "size and steps picked: 64 px, 20 steps: a plain generation is costed at" in out
    assert "which fits 15 min" in out
    assert data["meta"]["steps"] == 20 and data["meta"]["steps_picked"].startswith("64 px, 20 steps")
    assert data["meta"]["resolution"] == 64
    assert [row["name"] for row in data["rows"]][2:] == ["DeepCache", "DeepCache + ours fast"]


def test_generations_in_run_counts_what_the_engine_runs():
    pytest.importorskip("DeepCache", reason="DeepCache is in the bench and test extras")
    bench = build_model(arch="sd15", quick=True, pipeline=True)
    tome = preset_methods(["balanced"], "unet", auto_downsample=1)
    methods = [baseline_method(), *tome, *stack_methods("deepcache", bench.pipe, tome)]
    decodes = []
    bench.pipe.vae.decoder.register_forward_pre_hook(lambda *_: decodes.append(1))
    for settings in (
        BenchSettings(rounds=2, warmup=1, measure_memory=True, progress=False),
        BenchSettings(rounds=1, warmup=2, measure_memory=False, progress=False),
    ):
        decodes.clear()
        time_generations(bench.pipe, methods, "a cat", steps=2, resolution=64, settings=settings)
        assert len(decodes) == generations_in_run(len(methods), settings)


def test_a_pair_without_its_tome_row_is_left_out():
    rows = [
        {"name": "DeepCache", "speedup_per_image": 2.0, "speedup_per_step": 2.0, "image_change": 0.1},
        {"name": "DeepCache + ours fast", "speedup_per_image": 3.0, "speedup_per_step": 3.0, "image_change": 0.2},
    ]
    assert stacking_summary(rows, "DeepCache") == []
    assert stacking_summary(rows[1:], "DeepCache") == []


def test_stack_methods_refuses_a_transformer_pipeline():
    pytest.importorskip("DeepCache", reason="DeepCache is in the bench and test extras")
    bench = build_model(arch="pixart", quick=True, pipeline=True)
    with pytest.raises(ValueError, match="Expected a pipeline with a UNet2DConditionModel"):
        stack_methods("deepcache", bench.pipe, [])
    with pytest.raises(ValueError, match="Expected a stack among"):
        stack_methods("tgate", bench.pipe, [])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--stack", "deepcache"], "with --pipeline"),
        (["--pipeline", "--hires", "--stack", "deepcache"], "without --hires"),
        (["--pipeline", "--arch", "flux", "--stack", "deepcache"], "a UNet pipeline"),
    ],
)
def test_bad_stack_options_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
