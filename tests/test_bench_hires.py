"""High resolution in the bench: UNet proxies, `--width`, and the hires-fix workflow (`--pipeline --hires`).

No timing assertions: what is checked is what is built, run and reported.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from diffusers import StableDiffusionImg2ImgPipeline
from diffusers.models.attention import BasicTransformerBlock

from tome_processors import ToMeProcessor, apply_tome, remove_tome
from tome_processors.bench.engine import BenchSettings
from tome_processors.bench.hires import hires_table, time_hires, upscale_latents
from tome_processors.bench.methods import baseline_method, ours_methods, preset_methods
from tome_processors.bench.models import build_model
from tome_processors.bench.run import PROXY_HEADER, BenchRequest, choose_proxy
from tome_processors.bench.unet import UNetProxy, build_unet, default_proxy, make_inputs, proxy_config
from tome_processors.cli.main import main

from pipelines import tiny_sd_pipeline

QUIET = ["--threads", "1", "--rounds", "1", "--no-progress", "--no-trained-quality", "--no-host-cost", "--no-memory"]
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def _block_tokens(unet: torch.nn.Module, inputs) -> list[tuple[int, int]]:
    """(tokens, channels) of every transformer block's input in one forward."""
    seen: list[tuple[int, int]] = []
    handles = [
        module.register_forward_pre_hook(lambda m, args: seen.append(tuple(args[0].shape[1:])))
        for module in unet.modules()
        if isinstance(module, BasicTransformerBlock)
    ]
    inputs.run(unet)
    for handle in handles:
        handle.remove()
    return seen


def test_proxy_config_keeps_the_first_levels_at_their_real_width():
    sd15 = proxy_config("sd15", UNetProxy(levels=2, layers=1))
    assert sd15["block_out_channels"] == (320, 640) and sd15["mid_block_type"] is None
    assert sd15["down_block_types"] == ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D")
    assert sd15["up_block_types"] == ("CrossAttnUpBlock2D", "CrossAttnUpBlock2D")
    assert sd15["layers_per_block"] == 1 and sd15["cross_attention_dim"] == 768 and sd15["attention_head_dim"] == 8
    xl = proxy_config("sdxl", UNetProxy(levels=3, layers=1))
    assert xl["transformer_layers_per_block"] == (1, 1, 1) and xl["attention_head_dim"] == (5, 10, 20)
    assert proxy_config("sdxl", UNetProxy(levels=3))["transformer_layers_per_block"] == (1, 2, 10)
    sd2 = proxy_config("sd2", UNetProxy(levels=1))
    assert sd2["attention_head_dim"] == (5,) and sd2["layers_per_block"] == 2
    assert default_proxy("sd15") == default_proxy("sd2") == UNetProxy(levels=2, layers=1)
    assert default_proxy("sdxl") == UNetProxy(levels=3, layers=1)  # its attention starts at the second level
    with pytest.raises(ValueError, match="at most 4 levels"):
        proxy_config("sd15", UNetProxy(levels=5))
    with pytest.raises(ValueError, match="levels >= 1"):
        UNetProxy(levels=0)


def test_proxy_blocks_see_the_whole_unets_tokens_and_channels():
    whole, proxy = build_unet("tiny-sdxl"), build_unet("tiny-sdxl", proxy=UNetProxy(levels=2, layers=1))
    full_seen = set(_block_tokens(whole, make_inputs(whole, 1, 64, width=96)))
    proxy_seen = _block_tokens(proxy, make_inputs(proxy, 1, 64, width=96))
    assert proxy_seen and set(proxy_seen) <= full_seen
    assert (8 // 2 * 12 // 2, 64) in proxy_seen  # the first attention level: 4 x 6 tokens of 64 channels
    assert len(proxy_seen) < len(_block_tokens(whole, make_inputs(whole, 1, 64, width=96)))


def test_choose_proxy():
    def chosen(device=CPU, **options):
        return choose_proxy(BenchRequest(**options), device)

    assert chosen(arch="sd15", resolution=1024, batch=1) == UNetProxy(levels=2, layers=1)
    assert chosen(arch="sdxl", resolution=2048, batch=1) == UNetProxy(levels=3, layers=1)
    assert chosen(arch="sd15", resolution=512, batch=2) is None  # the default size: whole
    assert chosen(arch="sdxl", resolution=1024, batch=2) is None
    assert chosen(CUDA, arch="sd15", resolution=2048, batch=1) is None  # whole on a GPU unless asked
    assert chosen(CUDA, arch="sd15", resolution=2048, batch=1, levels=1) == UNetProxy(levels=1)
    assert chosen(arch="sd15", resolution=1024, batch=1, whole=True) is None
    assert chosen(arch="sd15", resolution=1024, batch=1, layers=2) == UNetProxy(levels=4, layers=2)
    assert chosen(arch="sd15", quick=True, resolution=1024) is None
    assert chosen(arch="pixart", resolution=2048) is None
    assert chosen(arch="sd15", pipeline=True, hires=True, batch=None) == UNetProxy(levels=2, layers=1)  # 2nd pass
    assert chosen(arch="sd15", resolution=512, width=1024, batch=1) is None  # 64 x 128 x 1 = 64 x 64 x 2


def test_cli_proxy_header_and_json(tmp_path, capsys, one_thread):
    path = tmp_path / "p.json"
    argv = ["bench", "--arch", "sd15", "--levels", "1", "--layers", "1", "--resolution", "64", "--width", "96"]
    assert main([*argv, "--batch", "1", *QUIET, "--presets", "balanced", "--no-tomesd", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith(PROXY_HEADER + ": the UNet's first 1 of 4 levels (320 channels; 96 tokens)")
    meta = json.loads(path.read_text())["meta"]
    assert "Speed-ups are those of these levels alone" in meta["proxy"] and meta["width"] == 96
    assert "(proxy: the UNet's first 1 of 4 levels" in meta["model"]
    rows = json.loads(path.read_text())["rows"]
    assert [r["name"] for r in rows] == ["baseline", "ours balanced"] and rows[1]["rel_error"] > 0


def test_whole_model_has_no_proxy_line(tmp_path, capsys, one_thread):
    path = tmp_path / "w.json"
    assert main(["bench", "--quick", "--width", "192", *QUIET, "--presets", "none", "--json", str(path)]) == 0
    assert PROXY_HEADER not in capsys.readouterr().out
    meta = json.loads(path.read_text())["meta"]
    assert meta["proxy"] is None and meta["width"] == 192


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--quick", "--levels", "1"], "--levels and --whole only with --arch sd15"),
        (["--arch", "pixart", "--whole"], "--levels and --whole only with --arch sd15"),
        (["--arch", "sd15", "--whole", "--levels", "2"], "either --whole or a proxy"),
        (["--arch", "sdxl", "--levels", "4"], "--levels between 1 and 3"),
        (["--arch", "sd15", "--pipeline", "--width", "768"], "--width only with a video architecture"),
        (["--arch", "sd15", "--width", "100"], "--width to be a multiple of 8"),
        (["--hires"], "--hires with --pipeline"),
        (["--strength", "0.3"], "--strength only with --hires"),
        (["--pipeline", "--hires", "--strength", "1.5"], "--strength in (0, 1]"),
        (["--pipeline", "--hires", "--arch", "sdxl"], "--hires with --arch sd15 or sd2"),
        (["--pipeline", "--hires", "--steps", "1", "--strength", "0.5"], "--steps * --strength >= 1"),
    ],
)
def test_bad_high_resolution_options_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_upscale_latents_doubles_each_side():
    latents = torch.arange(4.0).reshape(1, 1, 2, 2).repeat(1, 4, 1, 1)
    large = upscale_latents(latents)
    assert large.shape == (1, 4, 4, 4) and large[0, 0, 0, 0] == 0 and large[0, 0, -1, -1] == 3


def test_time_hires_merges_in_the_second_pass_only(one_thread):
    bench = build_model(arch="sd15", quick=True, pipeline=True)
    methods = [baseline_method(), *ours_methods([0.5], 1), *preset_methods(["fast"], "unet", auto_downsample=1)]
    settings = BenchSettings(rounds=1, measure_memory=False, host_cost=False, progress=False)
    run = time_hires(bench.pipe, methods, "a cat", steps=2, resolution=64, strength=0.5, settings=settings)
    assert [row.name for row in run.rows] == ["baseline", "ours r=0.5", "ours fast"]
    assert all(row.first_pass_change == 0.0 for row in run.rows)  # the first pass is the baseline's in every row
    assert run.rows[0].image_change == 0.0 and all(row.image_change > 0 for row in run.rows[1:])
    assert all(row.second_pass_calls == 2 for row in run.rows)  # 1 step of PNDM: 2 calls
    assert all(0 < row.second_pass_seconds < row.seconds_per_image for row in run.rows)
    assert len(run.images) == 3 and run.images[0].size == (128, 128)  # the second pass's size
    assert not any(isinstance(p, ToMeProcessor) for p in bench.pipe.unet.attn_processors.values())
    assert hires_table(run.rows).splitlines()[0].startswith("| method | ratio | s/image | speed-up/image |")
    with pytest.raises(ValueError, match="steps \\* strength >= 1"):
        time_hires(bench.pipe, methods, "a cat", steps=1, resolution=64, strength=0.5, settings=settings)


def test_cli_hires_run(tmp_path, capsys, one_thread):
    path, grid = tmp_path / "h.json", tmp_path / "h.png"
    argv = ["bench", "--pipeline", "--hires", "--quick", "--steps", "2", *QUIET, "--presets", "balanced"]
    assert main([*argv, "--no-tomesd", "--json", str(path), "--grid", str(grid)]) == 0
    out = capsys.readouterr().out
    assert "| speed-up 2nd pass |" in out and "| ours balanced |" in out and grid.exists()
    payload = json.loads(path.read_text())
    assert payload["meta"]["second_pass_resolution"] == 256 and payload["meta"]["strength"] == 0.5
    assert [row["name"] for row in payload["rows"]] == ["baseline", "ours balanced"]
    assert payload["rows"][1]["second_pass_speedup"] > 0


# The recipe of docs/usage.md ("High resolution: the hires-fix pass"), at a tiny size.
def hires_fix(pipe, prompt: str, seed: int, size: int = 32):
    generator = torch.Generator().manual_seed(seed)
    latents = pipe(prompt, height=size, width=size, num_inference_steps=4, generator=generator,
                   output_type="latent").images  # fmt: skip
    latents = F.interpolate(latents, scale_factor=2, mode="bilinear")
    second = StableDiffusionImg2ImgPipeline.from_pipe(pipe)
    apply_tome(second, preset="balanced")  # the second pass only
    try:
        return second(prompt, image=latents, strength=0.5, num_inference_steps=4, generator=generator,
                      output_type="np").images[0]  # fmt: skip
    finally:
        remove_tome(second)  # the pipelines share the UNet: the next first pass runs without ToMe


def test_hires_fix_recipe_is_reproducible_and_merges_in_the_second_pass_only(tmp_path, monkeypatch):
    pipe = tiny_sd_pipeline(tmp_path)
    seen: list[tuple[int, int, int]] = []  # (latent side, query length, key length) of every attention in the UNet
    side: list[int] = []
    pipe.unet.register_forward_pre_hook(lambda module, args: side.append(int(args[0].shape[-1])))
    pipe.unet.register_forward_hook(lambda module, args, output: side.clear())
    sdpa = F.scaled_dot_product_attention

    def recording(query, key, value, *args, **kwargs):
        if side:  # inside the UNet (not the text encoder or the VAE)
            seen.append((side[0], int(query.shape[-2]), int(key.shape[-2])))
        return sdpa(query, key, value, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    first = hires_fix(pipe, "a red fox", seed=3)
    calls = len(seen)
    second = hires_fix(pipe, "a red fox", seed=3)
    monkeypatch.setattr(F, "scaled_dot_product_attention", sdpa)
    assert (first == second).all() and seen[calls:] == seen[:calls]

    text = pipe.tokenizer.model_max_length

    def reduced(latent_side: int, queries: int, keys: int) -> bool:  # fewer tokens than the level's, or keys pooled
        level = any(queries == (latent_side >> level) ** 2 for level in range(4))
        return not level or keys not in (queries, text)

    small, large = sorted({latent_side for latent_side, _, _ in seen})  # the two passes' latents
    assert large == 2 * small
    first_pass = [entry for entry in seen[:calls] if entry[0] == small]
    second_pass = [entry for entry in seen[:calls] if entry[0] == large]
    assert first_pass and not any(reduced(*entry) for entry in first_pass)
    assert second_pass and any(reduced(*entry) for entry in second_pass)  # K/V pooled at the first level
    assert not any(isinstance(p, ToMeProcessor) for p in pipe.unet.attn_processors.values())

    plain = StableDiffusionImg2ImgPipeline.from_pipe(pipe)
    generator = torch.Generator().manual_seed(3)
    latents = pipe("a red fox", height=32, width=32, num_inference_steps=4, generator=generator,
                   output_type="latent").images  # fmt: skip
    without = plain("a red fox", image=F.interpolate(latents, scale_factor=2, mode="bilinear"), strength=0.5,
                    num_inference_steps=4, generator=generator, output_type="np").images[0]  # fmt: skip
    assert not (without == first).all()  # ToMe changed the second pass
