"""`tome-processors bench --pipeline --arch wan|ltx`: whole videos on a random-weight `WanPipeline` / `LTXPipeline`.

Every run here is `--quick` (tiny components), 2 steps, a 64 px clip of a few frames: seconds each. No
timing assertions: quick-CPU timings of tiny models are host-bound.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from diffusers import (
    AutoencoderKLLTXVideo,
    AutoencoderKLWan,
    FlowMatchEulerDiscreteScheduler,
    LTXPipeline,
    UniPCMultistepScheduler,
    WanPipeline,
)
from PIL import Image
from transformers import T5EncoderModel, T5Tokenizer, UMT5EncoderModel

from tome_processors.bench import run as bench_run
from tome_processors.bench.dit import build_transformer
from tome_processors.bench.generate import first_output, generation_table
from tome_processors.bench.models import build_model
from tome_processors.bench.pipelines import SMALL_TEXT_LAYERS
from tome_processors.bench.video_pipelines import build_video_pipeline, clip_of
from tome_processors.cli.main import main

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = ["--pipeline", "--quick", "--arch", "wan", "--steps", "2", "--rounds", "1", "--threads", "1"]
FAST += ["--no-progress", "--no-memory"]
SECONDS = ("seconds_per_image", "speedup_per_image", "seconds_per_step", "speedup_per_step")


@pytest.fixture(scope="module")
def wan_run(tmp_path_factory):
    """One `bench --pipeline --quick --arch wan` on a 64 x 96 clip of 5 frames: the baseline and `balanced`."""
    folder = tmp_path_factory.mktemp("wan")
    path, grid = folder / "wan.json", folder / "grid.png"
    argv = ["bench", *FAST, "--resolution", "64", "--width", "96", "--frames", "5", "--presets", "balanced"]
    assert main([*argv, "--json", str(path), "--grid", str(grid)]) == 0
    with Image.open(grid) as image:
        assert image.format == "PNG"
    return json.loads(path.read_text())


def test_rows_time_whole_videos_and_the_preset_merges(wan_run):
    rows = wan_run["rows"]
    assert [row["name"] for row in rows] == ["baseline", "ours balanced r=0.75"]
    for row in rows:
        assert all(math.isfinite(row[key]) and row[key] > 0 for key in SECONDS), row["name"]
        # guidance: a conditional and an unconditional forward per step, batch 1 each
        assert row["denoiser_calls"] == 4 and row["denoiser_batch"] == 1
        assert row["seconds_per_step"] < row["seconds_per_image"] and len(row["image_times"]) >= 1
    assert rows[0]["speedup_per_image"] == 1.0 and rows[0]["image_change"] == 0.0
    assert 0.0 < rows[1]["image_change"] < 1.0  # the preset merged: the video changed, not wildly


def test_meta_says_what_was_built(wan_run):
    meta = wan_run["meta"]
    assert meta["pipeline"] == "WanPipeline" and meta["output"] == "video"
    assert (meta["height"], meta["width"], meta["frames"], meta["resolution"]) == (64, 96, 5, 64)
    assert meta["steps"] == 2 and meta["denoiser_calls"] == 4 and meta["seconds"].startswith("per video")
    components = meta["components"]
    assert set(components) == {"transformer", "text_encoder", "tokenizer", "vae", "scheduler"}
    assert components["text_encoder"].startswith("UMT5EncoderModel, tiny")
    assert components["vae"].startswith("AutoencoderKLWan") and components["scheduler"].startswith("UniPC")


def test_the_table_says_seconds_per_video(tmp_path, capsys):
    argv = ["bench", *FAST, "--resolution", "32", "--frames", "5", "--presets", "fast", "--no-tomesd"]
    assert main([*argv, "--steps", "1", "--grid", str(tmp_path / "g.png")]) == 0
    out = capsys.readouterr().out
    assert "| method | ratio | s/video | speed-up/video |" in out and "video change %" in out
    assert "| ours fast" in out and "(the first frame of each video)" in out


def test_quick_video_pipeline_generates_the_asked_clip():
    bench = build_model(arch="wan", quick=True, pipeline=True, resolution=32, width=48, frames=5)
    assert isinstance(bench.pipe, WanPipeline) and bench.model is bench.pipe.transformer
    assert bench.call_kwargs == {"height": 32, "width": 48, "num_frames": 5, "max_sequence_length": 16}
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        output = bench.pipe("a cat", num_inference_steps=1, generator=generator, output_type="pt", **bench.call_kwargs)
    assert tuple(first_output(output).shape) == (5, 3, 32, 48)
    shortened = build_model(arch="ltx", quick=True, pipeline=True, layers=1)  # --layers shortens it here too
    assert len(shortened.pipe.transformer.transformer_blocks) == 1 and isinstance(shortened.pipe, LTXPipeline)


def _full(arch: str = "wan", text_encoders: str = "full"):
    """The full-size pipeline on the meta device: shapes only, no memory, no weights."""
    with torch.device("meta"):
        return build_video_pipeline(build_transformer(arch), arch, text_encoders=text_encoders)


def test_full_size_components_are_wan21s_and_fit_the_transformer():
    built = _full()
    pipe, config = built.pipe, built.pipe.transformer.config
    assert isinstance(pipe.text_encoder, UMT5EncoderModel) and isinstance(pipe.tokenizer, T5Tokenizer)
    text = pipe.text_encoder.config
    assert (text.d_model, text.num_layers, text.num_heads, text.d_ff) == (4096, 24, 64, 10240)
    assert text.d_model == config.text_dim
    assert isinstance(pipe.vae, AutoencoderKLWan) and pipe.vae.config.z_dim == config.in_channels == 16
    assert (pipe.vae.config.scale_factor_temporal, pipe.vae.config.scale_factor_spatial) == (4, 8)
    scheduler = pipe.scheduler
    assert isinstance(scheduler, UniPCMultistepScheduler) and scheduler.config.flow_shift == 3.0
    assert scheduler.config.use_flow_sigmas and scheduler.config.prediction_type == "flow_prediction"
    assert built.call_kwargs == {"height": 480, "width": 832, "num_frames": 33, "max_sequence_length": 512}
    assert "UMT5-XXL encoder shape (24 layers, width 4096)" in built.components["text_encoder"]
    small = _full("wan", "small").pipe.text_encoder.config
    assert small.d_model == 4096 and small.num_layers == SMALL_TEXT_LAYERS


def test_full_size_ltx_components_are_ltx_videos_and_fit_the_transformer():
    built = _full("ltx")
    pipe, config = built.pipe, built.pipe.transformer.config
    assert isinstance(pipe, LTXPipeline) and isinstance(pipe.text_encoder, T5EncoderModel)
    text = pipe.text_encoder.config
    assert (text.d_model, text.num_layers) == (4096, 24) and text.d_model == config.caption_channels
    assert isinstance(pipe.vae, AutoencoderKLLTXVideo) and pipe.vae.config.latent_channels == config.in_channels == 128
    assert (pipe.vae.temporal_compression_ratio, pipe.vae.spatial_compression_ratio) == (8, 32)
    scheduler = pipe.scheduler.config
    assert isinstance(pipe.scheduler, FlowMatchEulerDiscreteScheduler) and scheduler.use_dynamic_shifting
    assert (scheduler.base_shift, scheduler.max_shift, scheduler.shift_terminal) == (0.95, 2.05, 0.1)
    assert built.call_kwargs == {"height": 512, "width": 768, "num_frames": 121, "max_sequence_length": 128}
    assert _full("ltx", "small").pipe.text_encoder.config.num_layers == SMALL_TEXT_LAYERS


def test_ltx_pipeline_times_whole_videos(tmp_path, capsys):
    path = tmp_path / "ltx.json"
    argv = ["bench", *FAST[:2], "--arch", "ltx", *FAST[4:], "--resolution", "64", "--width", "96", "--frames", "9"]
    argv += ["--presets", "fast", "--json", str(path), "--grid", str(tmp_path / "g.png")]
    assert main(argv) == 0
    data = json.loads(path.read_text())
    meta, rows = data["meta"], data["rows"]
    assert meta["pipeline"] == "LTXPipeline" and (meta["height"], meta["width"], meta["frames"]) == (64, 96, 9)
    assert components_start(meta, "AutoencoderKLLTXVideo, tiny", "T5EncoderModel, tiny")
    assert [row["name"] for row in rows] == ["baseline", "ours fast r=0.85"]
    assert rows[0]["image_change"] == 0.0 and 0.0 < rows[1]["image_change"] < 1.0  # the preset merged
    assert rows[0]["denoiser_calls"] == 2 and rows[0]["denoiser_batch"] == 2  # LTX batches the guidance
    assert "s/video" in capsys.readouterr().out


def components_start(meta: dict, vae: str, text_encoder: str) -> bool:
    components = meta["components"]
    return components["vae"].startswith(vae) and components["text_encoder"].startswith(text_encoder)


def test_clip_defaults():
    assert clip_of("wan", False, None, None, None) == (480, 832, 33)
    assert clip_of("wan", False, 720, 1280, 81) == (720, 1280, 81)
    assert clip_of("wan", True, None, None, None) == (128, 128, 9)
    assert clip_of("ltx", False, None, None, None) == (512, 768, 121)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"arch": "pixart"}, "arch among"),
        ({"text_encoders": "huge"}, "text_encoders among"),
        ({"frames": 8}, r"4k \+ 1"),
        ({"height": 72}, "multiples of 16"),
        ({"width": 40}, "multiples of 16"),
        ({"arch": "ltx", "frames": 5}, r"8k \+ 1"),
        ({"arch": "ltx", "height": 48}, "multiples of 32"),
    ],
)
def test_build_video_pipeline_refuses_bad_input(kwargs, message):
    arch = kwargs.pop("arch", "wan")
    with pytest.raises(ValueError, match=message):
        build_video_pipeline(torch.nn.Identity(), arch, quick=True, **kwargs)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--arch", "wan", "--frames", "8"], "4k + 1"),
        (["--arch", "wan", "--resolution", "72"], "--resolution to be a multiple of 16 for the wan pipeline"),
        (["--arch", "wan", "--width", "72"], "multiple of 16"),
        (["--arch", "ltx", "--frames", "9", "--width", "48"], "--width to be a multiple of 32 for the ltx pipeline"),
        (["--arch", "ltx", "--frames", "5"], "8k + 1"),
        (["--arch", "wan", "--compile"], "without --compile"),
        (["--arch", "wan", "--quick", "--text-encoders", "small"], "not with --model or --quick"),
        (["--arch", "svd"], "got --arch svd"),
        (["--arch", "hunyuanvideo"], "got --arch hunyuanvideo"),
        (["--arch", "ltx2"], "got --arch ltx2"),
    ],
)
def test_bad_video_pipeline_options_exit_2_before_anything_is_built(argv, message, capsys, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("built a model for options that should have been refused")

    monkeypatch.setattr(bench_run, "build_model", refuse)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--pipeline", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_generation_table_names_the_unit():
    assert "s/image" in generation_table([]) and "s/video" in generation_table([], unit="video")
