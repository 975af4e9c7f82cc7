"""`tome-processors eval`: offline, on a tiny pipeline and a tiny CLIP."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

import tome_processors as tp
from tome_processors.cli.main import main
from tome_processors.evaluate.engine import (
    ClipScorer,
    EvalRow,
    EvalSettings,
    default_prompts,
    eval_configs,
    image_change,
    load_prompts,
    run_eval,
)
from tome_processors.evaluate.report import write_reports

from pipelines import save_tiny_clip, tiny_sd_pipeline

PROMPTS = ["a red cat", "a blue dog", "a green tree"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny pipeline and a tiny CLIP saved to folders, as a user's would be."""
    root = tmp_path_factory.mktemp("eval-models")
    tiny_sd_pipeline(root).save_pretrained(root / "pipeline")
    save_tiny_clip(root / "clip")
    (root / "prompts.txt").write_text("# a comment\n" + "\n".join(PROMPTS) + "\n\n", encoding="utf-8")
    return root


def test_run_eval_measures_every_image_and_writes_reports(tmp_path, saved):
    pipe = tiny_sd_pipeline(tmp_path)
    settings = EvalSettings(PROMPTS[:2], [0, 1], eval_configs([0.3, 0.6]), steps=2, height=32, width=32)
    rows = run_eval(pipe, settings, tmp_path / "out", clip_scorer=ClipScorer(str(saved / "clip")), progress=False)
    assert len(rows) == 2 * 2 * 3
    for row in rows:
        assert (tmp_path / "out" / row.image_path).is_file()
        assert row.seconds > 0 and 0.0 <= row.clip_score <= 100.0
        if row.config == "baseline":
            assert row.psnr is None and row.ssim is None
        else:
            assert row.psnr > 10 and math.isfinite(row.psnr) and 0 < row.ssim <= 1
    paths = write_reports(rows, settings.configs, tmp_path / "out", {"model": "tiny"})
    with paths["csv"].open() as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == 12 and {"prompt", "seed", "config", "seconds", "clip_score", "psnr", "ssim"} <= set(table[0])
    summary = json.loads(paths["json"].read_text())["summary"]
    assert [s["config"] for s in summary] == ["baseline", "tome 0.3", "tome 0.6"]
    assert all(s["images"] == 4 for s in summary) and summary[0]["speedup"] == 1.0
    report = paths["report"].read_text()
    assert "tome 0.6" in report and "grids/prompt_001.png" in report
    grid = Image.open(paths["grid_000"])
    # a column per configuration, a row per seed; 32 px images drawn at 160 px, two label lines under each
    assert grid.size == (3 * 160, 2 * (160 + 2 * 14 + 6))
    # ToMe was taken away again: the pipeline's UNet is untouched.
    assert not tp.is_tome_applied(pipe.unet)


def test_cli_on_saved_folders(tmp_path, saved):
    out = tmp_path / "cli"
    code = main(  # the `tome-processors eval` console entry
        ["eval", "--model", str(saved / "pipeline"), "--prompts", str(saved / "prompts.txt"), "--ratios", "0.5",
         "--seeds", "3", "--steps", "2", "--height", "32", "--width", "32", "--clip-model", str(saved / "clip"),
         "--out", str(out), "--limit", "2"]
    )  # fmt: skip
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["meta"]["prompts"] == 2 and summary["meta"]["processes"] == 1
    assert {row["prompt"] for row in summary["rows"]} == set(PROMPTS[:2])


def test_cli_rejects_bad_ratio(tmp_path, saved, capsys):
    assert main(["eval", "--model", str(saved / "pipeline"), "--ratios", "0.9", "--out", str(tmp_path)]) == 2
    assert "Expected ratios" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("accelerate") is None, reason="needs the accelerate launcher")
def test_accelerate_launch_two_processes_does_every_prompt_once(tmp_path, saved):
    out = tmp_path / "dist"
    command = [
        "accelerate", "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29517",
        "-m", "tome_processors", "eval",
        "--model", str(saved / "pipeline"), "--prompts", str(saved / "prompts.txt"), "--ratios", "0.5",
        "--seeds", "0", "1", "--steps", "2", "--height", "32", "--width", "32", "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    payload = json.loads((out / "summary.json").read_text())
    assert payload["meta"]["processes"] == 2
    assert payload["meta"]["tome_processors"] == tp.__version__
    done = [(r["prompt_index"], r["seed"], r["config"]) for r in payload["rows"]]
    assert len(done) == len(set(done)) == len(PROMPTS) * 2 * 2
    assert {r["process"] for r in payload["rows"]} == {0, 1}


def test_prompts_default_file_and_errors(tmp_path):
    defaults = default_prompts()
    assert len(defaults) >= 10 and all(p.strip() == p and p for p in defaults)
    assert load_prompts(None) == defaults
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="at least one prompt"):
        load_prompts(empty)


def test_image_change_and_settings_validation():
    image = np.zeros((8, 8, 3), dtype=np.uint8)
    assert image_change(image, image) == (math.inf, 1.0)
    other = image.copy()
    other[0, 0] = 255
    psnr, ssim = image_change(other, image)
    assert psnr == pytest.approx(10 * math.log10(64)) and ssim < 1  # 3 of 192 values off by 255
    with pytest.raises(ValueError, match="same shape"):
        image_change(image[:4], image)
    with pytest.raises(ValueError, match="baseline"):
        EvalSettings(["p"], [0], eval_configs([0.5])[1:])
    with pytest.raises(ValueError, match="seed"):
        EvalSettings(["p"], [], eval_configs([0.5]))
    assert sys.modules["tome_processors.evaluate.engine"]  # the engine imports without a GPU or a display


def test_reports_write_infinite_psnr_as_inf(tmp_path):
    # Identical images have infinite PSNR: "inf" in the JSON and the CSV, as in the bench's JSON.
    Image.new("RGB", (8, 8), "red").save(tmp_path / "a.png")
    configs = eval_configs([0.5])
    rows = [
        EvalRow(0, "p", 0, config.name, ratio, 1.0, None, psnr, ssim, "a.png")
        for config, ratio, psnr, ssim in zip(configs, (0.0, 0.5), (None, math.inf), (None, 1.0), strict=True)
    ]
    paths = write_reports(rows, configs, tmp_path, {"model": "none"})
    payload = json.loads(paths["json"].read_text())
    assert [row["psnr"] for row in payload["rows"]] == [None, "inf"]
    assert payload["summary"][1]["psnr_mean"] is None  # means are over finite values only
    with paths["csv"].open() as handle:
        assert [row["psnr"] for row in csv.DictReader(handle)] == ["", "inf"]
