"""`tome-processors bench --arch hunyuanvideo15|wan-i2v`: HunyuanVideo 1.5 and Wan2.1 image-to-video in the bench,
and `--pipeline --arch wan-i2v` (a random-weight `WanImageToVideoPipeline`).

The real configs are checked on the meta device (8.3 B and 16.4 B parameters: nothing is allocated); the runs
are `--quick` (tiny models), one round, no timing assertions.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from diffusers import WanImageToVideoPipeline
from diffusers.pipelines.wan import pipeline_wan_i2v
from transformers import CLIPVisionModel

from tome_processors.bench.dit import (
    TRANSFORMER_ARCHITECTURES,
    VIDEO_DEFAULTS,
    build_transformer,
    make_transformer_inputs,
)
from tome_processors.bench.models import build_model
from tome_processors.bench.pipelines import SMALL_TEXT_LAYERS
from tome_processors.bench.video_pipelines import build_video_pipeline
from tome_processors.cli.main import main
from tome_processors.families import family_of

pytestmark = pytest.mark.usefixtures("one_thread")

FAST = ["--quick", "--rounds", "1", "--no-progress", "--no-memory", "--no-trained-quality", "--no-host-cost"]


def meta_model(arch: str) -> torch.nn.Module:
    """The architecture's real config on the meta device: shapes and no weights."""
    with torch.device("meta"):
        return build_transformer(arch)


def test_hunyuanvideo15s_published_480p_config_and_clip():
    model = meta_model("hunyuanvideo15")
    config = model.config
    assert (config.num_layers, config.num_attention_heads, config.attention_head_dim) == (54, 16, 128)
    assert (config.in_channels, config.out_channels, config.patch_size, config.patch_size_t) == (65, 32, 1, 1)
    assert (config.text_embed_dim, config.text_embed_2_dim, config.image_embed_dim) == (3584, 1472, 1152)
    assert (config.target_size, config.task_type) == (640, "t2v")
    assert sum(p.numel() for p in model.parameters()) == 8_326_608_160
    assert VIDEO_DEFAULTS["hunyuanvideo15"] == (480, 848, 121)
    inputs = make_transformer_inputs(model, "hunyuanvideo15", 2, 480).kwargs  # the default clip
    assert inputs["hidden_states"].shape == (2, 65, 31, 30, 53)  # 121 frames: 31 latent frames of 30 x 53
    assert inputs["encoder_hidden_states"].shape == (2, 1000, 3584)
    assert inputs["encoder_hidden_states_2"].shape == (2, 256, 1472) and not inputs["encoder_attention_mask_2"].any()
    assert inputs["image_embeds"].shape == (2, 729, 1152) and not inputs["image_embeds"].any()  # text to video
    assert family_of(model).token_grid(model, (), inputs) == (31, 30, 53)


def test_wan_i2vs_published_480p_config_and_clip():
    model = meta_model("wan-i2v")
    config = model.config
    shape = (config.num_layers, config.num_attention_heads, config.attention_head_dim, config.ffn_dim)
    assert shape == (40, 40, 128, 13824)
    assert (config.in_channels, config.out_channels, config.image_dim, config.added_kv_proj_dim) == (36, 16, 1280, 5120)
    assert sum(p.numel() for p in model.parameters()) == 16_394_878_784
    inputs = make_transformer_inputs(model, "wan-i2v", 1, 480).kwargs  # the default clip: 480 x 832, 81 frames
    assert inputs["hidden_states"].shape == (1, 36, 21, 60, 104)
    assert inputs["encoder_hidden_states"].shape == (1, 512, 4096)
    assert inputs["encoder_hidden_states_image"].shape == (1, 257, 1280)
    assert family_of(model).name == "wan" and family_of(model).token_grid(model, (), inputs) == (21, 30, 52)


def test_quick_wan_i2v_keeps_512_text_tokens_and_layers_shortens_it():
    # Wan's I2V attention takes the last 512 context tokens as the text: --quick's short text would break it.
    bench = build_model(arch="wan-i2v", quick=True, layers=1, batch=1, frames=5, width=64, resolution=32)
    assert len(bench.model.blocks) == 1 and bench.model.config.image_dim == 16
    output = bench.forward(bench.model)
    assert output.shape == (1, 4, 2, 4, 8) and torch.isfinite(output).all()


@pytest.mark.parametrize("arch", ["hunyuanvideo15", "wan-i2v"])
def test_quick_runs_show_the_rows_and_attentions_share(arch, tmp_path):
    path = tmp_path / f"{arch}.json"
    argv = ["bench", *FAST, "--arch", arch, "--ratios", "0.5", "--presets", "balanced", "--json", str(path)]
    assert main([*argv, "--frames", "5", "--layers", "1"]) == 0
    data = json.loads(path.read_text())
    rows = {row["name"]: row for row in data["rows"]}
    assert sorted(rows) == ["baseline", "ours balanced r=0.75", "ours r=0.5"]
    for name, row in rows.items():
        assert 0 < row["extra"]["attention %"] < 100
        if name != "baseline":
            assert 0 < row["rel_error"] < 1
    assert data["meta"]["model"] == f"{arch} (tiny) architecture, 1 blocks per block list, random weights"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--arch", "hunyuanvideo15", "--pipeline"], "no random-weight pipeline"),
        (["--arch", "hunyuanvideo15", "--resolution", "40"], "multiple of 16 for --arch hunyuanvideo15"),
        (["--arch", "hunyuanvideo15", "--frames", "8"], "4k + 1"),
        (["--arch", "wan-i2v", "--frames", "32"], "4k + 1"),
        (["--arch", "wan-i2v", "--layers", "0"], "--layers >= 1"),
    ],
)
def test_bad_options_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_both_are_video_architectures_of_the_bench():
    assert {"hunyuanvideo15", "wan-i2v"} <= set(TRANSFORMER_ARCHITECTURES)


# ---------------------------------------------------------------- --pipeline --arch wan-i2v


@pytest.fixture
def ftfy_or_stand_in(monkeypatch):
    """The I2V pipeline cleans prompts with ftfy (diffusers 0.42.1): without it, a stand-in that leaves them as
    they are (as tests/test_wan_image_to_video.py does)."""
    if not hasattr(pipeline_wan_i2v, "ftfy"):
        monkeypatch.setattr(pipeline_wan_i2v, "ftfy", SimpleNamespace(fix_text=lambda text: text), raising=False)


def full_i2v_pipeline(text_encoders: str = "full"):
    """The full-size pipeline on the meta device: shapes only, no memory, no weights."""
    with torch.device("meta"):
        return build_video_pipeline(build_transformer("wan-i2v"), "wan-i2v", text_encoders=text_encoders)


@pytest.mark.usefixtures("ftfy_or_stand_in")
def test_full_size_i2v_pipeline_has_clip_vit_h_and_the_480p_clip():
    built = full_i2v_pipeline()
    pipe, config = built.pipe, built.pipe.transformer.config
    assert isinstance(pipe, WanImageToVideoPipeline) and isinstance(pipe.image_encoder, CLIPVisionModel)
    vision = pipe.image_encoder.config
    assert (vision.hidden_size, vision.num_hidden_layers, vision.num_attention_heads) == (1280, 32, 16)
    assert (vision.image_size, vision.patch_size) == (224, 14)  # 16 x 16 patches and the class token: 257
    assert vision.hidden_size == config.image_dim and pipe.vae.config.z_dim == config.out_channels == 16
    assert pipe.text_encoder.config.d_model == config.text_dim == 4096
    image = built.call_kwargs.pop("image")
    assert image.size == (832, 480)
    assert built.call_kwargs == {"height": 480, "width": 832, "num_frames": 81, "max_sequence_length": 512}
    assert "257 image tokens" in built.components["image_encoder"]
    assert full_i2v_pipeline("small").pipe.image_encoder.config.num_hidden_layers == SMALL_TEXT_LAYERS


@pytest.mark.usefixtures("ftfy_or_stand_in")
def test_quick_i2v_pipeline_times_whole_videos_from_a_first_frame(tmp_path):
    path = tmp_path / "i2v.json"
    argv = ["bench", "--pipeline", "--quick", "--arch", "wan-i2v", "--steps", "2", "--rounds", "1", "--threads", "1"]
    argv += ["--no-progress", "--no-memory", "--resolution", "32", "--width", "48", "--frames", "5"]
    assert main([*argv, "--presets", "balanced", "--json", str(path), "--grid", str(tmp_path / "grid.png")]) == 0
    data = json.loads(path.read_text())
    rows = {row["name"]: row for row in data["rows"]}
    assert sorted(rows) == ["baseline", "ours balanced r=0.75"]
    assert all(row["denoiser_calls"] == 4 for row in rows.values())  # 2 steps with guidance
    meta = data["meta"]
    assert meta["pipeline"] == "WanImageToVideoPipeline" and (meta["frames"], meta["width"]) == (5, 48)
    assert meta["call_arguments"]["image"] == "an RGB image of 48 x 32 px"
    assert meta["call_arguments"]["max_sequence_length"] == 512  # its attention's split, --quick too
    assert meta["components"]["image_encoder"].startswith("CLIPVisionModel, tiny (5 image tokens)")


def test_i2v_pipeline_without_ftfy_is_refused_before_anything_is_built(monkeypatch, capsys):
    monkeypatch.delattr(pipeline_wan_i2v, "ftfy", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--pipeline", "--quick", "--arch", "wan-i2v"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "Expected ftfy" in err and "for the wan-i2v pipeline" in err
