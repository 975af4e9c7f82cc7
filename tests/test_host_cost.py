"""What a forward costs the host: no host-device syncs, few ops per merged block, one compiled graph.

On a GPU, eager diffusion is bound by the host, so a plugin's cost is its op count and its syncs. These
tests count aten ops with a `TorchDispatchMode` on CPU (deterministic: no timing). A host sync shows up as
`_local_scalar_dense`, `item`, `nonzero`, `is_nonzero`, `equal` or `lift_fresh` (a tensor made from
Python data, a blocking copy on CUDA).
"""

from __future__ import annotations

import collections
import contextlib
from typing import NamedTuple

import numpy as np
import pytest
import torch
from diffusers import (
    DDIMScheduler,
    EulerDiscreteScheduler,
    FlowMatchEulerDiscreteScheduler,
    HeunDiscreteScheduler,
    StableDiffusionImg2ImgPipeline,
    UNet2DConditionModel,
)
from torch.utils._python_dispatch import TorchDispatchMode

import tome_processors as tp
from tome_processors import context as context_module
from tome_processors.hooks import context_of

from models import CROSS_DIM, unet_inputs
from pipelines import svd_inputs, tiny_sd_pipeline, tiny_svd_unet
from test_dit import flux_inputs, pixart_inputs, sd3_inputs, tiny_flux, tiny_pixart, tiny_sd3
from test_hunyuanvideo import hunyuanvideo15_inputs, hunyuanvideo_inputs, tiny_hunyuanvideo, tiny_hunyuanvideo15
from test_ltx import ltx_inputs, tiny_ltx
from test_ltx2 import ltx2_inputs, tiny_ltx2
from test_new_families import (
    chroma_inputs,
    flux2_inputs,
    qwenimage_inputs,
    tiny_chroma,
    tiny_flux2,
    tiny_qwenimage,
    tiny_zimage,
    zimage_inputs,
)
from test_video import tiny_wan, wan_inputs

SYNC_OPS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "lift_fresh"}


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched inside it, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def unet(blocks_per_level: int = 1) -> UNet2DConditionModel:
    """SD1.5-shaped; `blocks_per_level=2` has SD1.5's five merged blocks at the first level."""
    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=16,
        layers_per_block=blocks_per_level,
        norm_num_groups=8,
        cross_attention_dim=CROSS_DIM,
        block_out_channels=(32, 48, 64),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=8,
    ).eval()


def unet_call_inputs(model: UNet2DConditionModel, timestep=500) -> dict:
    sample, _, text, _ = unet_inputs(model, batch=2, height=32, width=32)
    return {"sample": sample, "timestep": torch.tensor(timestep), "encoder_hidden_states": text}


FAMILIES = {
    # name: (model builder, inputs, timestep key)
    "unet": (unet, lambda model: unet_call_inputs(model)),
    "pixart": (tiny_pixart, lambda model: pixart_inputs()),
    "sd3": (tiny_sd3, lambda model: sd3_inputs()),
    "flux": (tiny_flux, lambda model: flux_inputs()),
    # One video of 3 frames with guidance: the spatial blocks' batch is 2 x 3.
    "svd": (tiny_svd_unet, lambda model: svd_inputs(batch=2, frames=3)),
    "wan": (tiny_wan, lambda model: wan_inputs()),
    "ltx": (tiny_ltx, lambda model: ltx_inputs()),
    # LTX-2 with the released model's split rotary tables, its audio and both texts.
    "ltx2": (tiny_ltx2, lambda model: ltx2_inputs()),
    # With the model's mask over the text's padding (cut to the merged sequence).
    "hunyuanvideo": (tiny_hunyuanvideo, lambda model: hunyuanvideo_inputs()),
}

#: The families whose token grid is the values of `img_ids`, which a compiled graph cannot read.
IDS_FAMILIES = ("flux", "flux2", "chroma")

#: The joint families with rotary positions beyond FLUX.1 (tests/test_new_families.py), as their pipelines call
#: them: Qwen-Image's edit variant with its reference image, Chroma with its text-padding mask, Z-Image with
#: its classifier-free guidance batch (captions of different lengths: a mask).
NEW_FAMILIES = {
    "qwenimage": (tiny_qwenimage, lambda model: qwenimage_inputs()),
    "qwenimage-edit": (tiny_qwenimage, lambda model: qwenimage_inputs(reference=(4, 4))),
    "flux2": (tiny_flux2, lambda model: flux2_inputs()),
    "chroma": (tiny_chroma, lambda model: chroma_inputs(padded=3)),
    "zimage": (tiny_zimage, lambda model: zimage_inputs(text=(7, 40))),
    # HunyuanVideo 1.5 with its per-sample text padding (its forward's own boolean indexing syncs and breaks a
    # graph without ToMe: its blocks have a compiled-graph test of their own).
    "hunyuanvideo15": (tiny_hunyuanvideo15, lambda model: hunyuanvideo15_inputs()),
}

OPTIONS = [
    pytest.param({}, id="default"),
    pytest.param({"use_rand": False}, id="fixed"),
    pytest.param({"share_level": True}, id="share_level"),
    pytest.param({"recompute_every": 2}, id="recompute_every"),
    pytest.param({"merge_mlp": True, "merge_crossattn": True}, id="all-flags"),
    pytest.param({"level_ratios": {1: 0.5, 2: 0.3}}, id="level_ratios"),
    pytest.param({"similarity_dtype": "bfloat16"}, id="bf16"),
]


def forward(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample


def count_ops(model: torch.nn.Module, inputs: dict) -> tuple[collections.Counter[str], int]:
    """Aten ops of one forward, and how many blocks merged in it (oneDNN off: the GPU's code path)."""
    merged: set[int] = set()
    original = context_module.BlockState.merge_for

    def recording(self, config, *args, **kwargs):
        merge = original(self, config, *args, **kwargs)
        if merge is not None:
            merged.add(id(self))
        return merge

    with pytest.MonkeyPatch.context() as patch, torch.backends.mkldnn.flags(enabled=False):
        patch.setattr(context_module.BlockState, "merge_for", recording)
        with OpCounter() as counter:
            forward(model, inputs)
    return counter.ops, len(merged)


@contextlib.contextmanager
def cuda_sync_errors():
    """Where CUDA is present, any synchronising CUDA call raises (the dispatch count is the CPU's proxy)."""
    if torch.cuda.is_available():
        torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")


DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def on_device(model: torch.nn.Module, inputs: dict, device: str) -> tuple[torch.nn.Module, dict]:
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    return model.to(device), moved


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("family", sorted({**FAMILIES, **NEW_FAMILIES}))
@pytest.mark.parametrize("options", OPTIONS)
def test_no_host_sync_in_a_forward(family, options, device, one_thread):
    build, make_inputs = {**FAMILIES, **NEW_FAMILIES}[family]
    model = build()
    model, inputs = on_device(model, make_inputs(model), device)
    baseline_ops, _ = count_ops(model, inputs)
    if device == "cuda":
        try:
            with cuda_sync_errors():
                forward(model, inputs)
        except RuntimeError as error:  # the sync would not be ToMe's
            pytest.skip(f"the {family} model syncs on CUDA without ToMe: {error}")
    tp.apply_tome(model, **options)
    forward(model, inputs)  # the first forward may fill caches
    with cuda_sync_errors():
        for _ in range(2):  # a computing step and, with recompute_every, a reusing one
            ops, merged = count_ops(model, inputs)
            assert merged > 0 or options.get("recompute_every"), "nothing merged: the test would prove nothing"
            syncs = {name: ops[name] - baseline_ops[name] for name in SYNC_OPS if ops[name] > baseline_ops[name]}
            assert syncs == {}, f"host syncs in a {family} forward with {options}: {syncs}"


def test_no_host_sync_with_k_v_pooling(one_thread):
    model = unet()
    inputs = unet_call_inputs(model)
    tp.apply_tome(model, mode="downsample_kv")
    forward(model, inputs)
    ops, _ = count_ops(model, inputs)
    assert not any(ops[name] for name in SYNC_OPS)


def test_ratio_schedule_without_a_pipeline_reads_the_timestep_once_per_forward(one_thread):
    # The fallback: a model called on its own has no schedule on the host, so a ratio that follows the
    # timestep (and changes the merged shape with it) reads the timestep, once per forward.
    model = unet()
    inputs = unet_call_inputs(model)
    baseline_ops, _ = count_ops(model, inputs)
    tp.apply_tome(model, ratio_start=0.6)
    forward(model, inputs)
    ops, _ = count_ops(model, inputs)
    assert ops["_local_scalar_dense"] - baseline_ops["_local_scalar_dense"] == 1
    assert not any(ops[name] > baseline_ops[name] for name in SYNC_OPS - {"_local_scalar_dense"})


class Forward(NamedTuple):
    syncs: int  # host-sync ops from before ToMe's model pre-hook to the end of the forward
    timestep: float | None  # the timestep value ToMe's `ratio_start` used
    rows: tuple[int, ...]  # merged rows of every merged block (the ratio's trace)


@contextlib.contextmanager
def recording_forwards(model: torch.nn.Module):
    """Every forward of `model` inside: a `Forward` each (oneDNN off: the GPU's code path)."""
    records: list[Forward] = []
    counters: list[OpCounter] = []
    rows: list[int] = []
    original = context_module.BlockState.merge_for

    def merge_for(self, config, *args, **kwargs):
        merge = original(self, config, *args, **kwargs)
        if merge is not None:
            rows.append(merge.num_rows - merge.text_rows)
        return merge

    def pre_hook(module, args, kwargs):
        rows.clear()
        counters.append(OpCounter())
        counters[-1].__enter__()

    def hook(module, args, kwargs, output):
        counter = counters.pop()
        counter.__exit__(None, None, None)
        state = context_of(module).model_state
        records.append(Forward(sum(counter.ops[name] for name in SYNC_OPS), state.timestep_value, tuple(rows)))

    handles = [
        model.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=True),  # before ToMe's
        model.register_forward_hook(hook, with_kwargs=True),
    ]
    try:
        with pytest.MonkeyPatch.context() as patch, torch.backends.mkldnn.flags(enabled=False):
            patch.setattr(context_module.BlockState, "merge_for", merge_for)
            yield records
    finally:
        for handle in handles:
            handle.remove()


SCHEDULERS = {
    "ddim": lambda config: DDIMScheduler.from_config(config),
    "euler-karras": lambda config: EulerDiscreteScheduler.from_config(config, use_karras_sigmas=True),  # fractional
    "heun": lambda config: HeunDiscreteScheduler.from_config(config),  # order 2: every timestep but the first twice
}


def generation(pipe, img2img: bool, seed: int = 0) -> np.ndarray:
    args = dict(prompt="a cat", num_inference_steps=4, output_type="np", generator=torch.Generator().manual_seed(seed))
    if img2img:  # strength < 1: the loop enters the schedule partway (`timesteps[t_start * order:]`)
        args.update(image=torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(5)), strength=0.6)
    else:
        args.update(height=32, width=32)
    with torch.no_grad():
        return pipe(**args).images


@pytest.mark.parametrize("img2img", [False, True], ids=["txt2img", "img2img"])
@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_ratio_schedule_in_a_pipeline_generation_reads_no_timestep(scheduler, img2img, tmp_path, one_thread):
    # Applied to a pipeline, the timesteps go to the host once per generation (before its loop), and each
    # forward finds its own there: no host sync, and exactly the ratios (merged sizes, images) that reading
    # the timestep back gives, for integer (DDIM), fractional (Karras) and repeated (Heun) timesteps.
    pipe = tiny_sd_pipeline(tmp_path)
    if img2img:
        pipe = StableDiffusionImg2ImgPipeline.from_pipe(pipe)
        pipe.set_progress_bar_config(disable=True)
    pipe.scheduler = SCHEDULERS[scheduler](pipe.scheduler.config)
    options = dict(ratio=0.3, ratio_start=0.7)
    results = {}
    for target in (pipe, pipe.unet):  # the pipeline; the model alone (the read-back fallback)
        tp.apply_tome(target, **options)
        generation(pipe, img2img)  # the first forwards fill the per-grid caches
        with recording_forwards(pipe.unet) as records:
            images = generation(pipe, img2img)
        tp.remove_tome(target)
        results[target is pipe] = (records, images)
    (with_schedule, images), (read_back, expected_images) = results[True], results[False]
    assert [f.syncs for f in with_schedule] == [0] * len(with_schedule)
    assert [f.syncs for f in read_back] == [1] * len(read_back)
    assert [(f.timestep, f.rows) for f in with_schedule] == [(f.timestep, f.rows) for f in read_back]
    assert len({f.rows for f in with_schedule}) > 1, "the ratio must change over the generation"
    if scheduler == "heun":  # repeated timesteps found as themselves
        assert len({f.timestep for f in with_schedule}) < len(with_schedule)
    np.testing.assert_array_equal(images, expected_images)
    assert "progress_bar" not in vars(pipe)


def test_a_schedule_given_to_a_model_serves_every_call_of_a_step(one_thread):
    # Model-only use (`set_timestep_schedule`), with two calls per step as in unbatched classifier-free
    # guidance; a timestep from elsewhere is still read, once.
    model = unet()
    inputs = unet_call_inputs(model)
    scheduler = EulerDiscreteScheduler(beta_schedule="scaled_linear", use_karras_sigmas=True)
    scheduler.set_timesteps(4)
    tp.apply_tome(model, ratio=0.3, ratio_start=0.7)
    forward(model, inputs)
    tp.set_timestep_schedule(model, scheduler.timesteps)
    expected = [value for value in scheduler.timesteps.tolist() for _ in range(2)]
    with recording_forwards(model) as records:
        for t in scheduler.timesteps:
            for _ in range(2):
                forward(model, {**inputs, "timestep": t})
        forward(model, {**inputs, "timestep": torch.tensor(321.5)})
    assert [f.syncs for f in records] == [0] * 8 + [1]
    assert [f.timestep for f in records] == [*expected, 321.5]
    assert expected[2] % 1, "fractional timesteps"
    context_of(model).reset()  # the end of a generation drops the schedule
    with recording_forwards(model) as records:
        forward(model, {**inputs, "timestep": scheduler.timesteps[1]})
    assert records[0].syncs == 1 and records[0].timestep == expected[2]


class FluxLikePipeline:
    """What the Flux pipelines do around the transformer: `progress_bar` opens the loop, `_current_timestep`
    is set to `t`, and the model gets a new tensor `t / 1000` in every call (two per step with true CFG)."""

    def __init__(self, transformer: torch.nn.Module) -> None:
        self.transformer = transformer
        self.scheduler = FlowMatchEulerDiscreteScheduler()
        self._current_timestep = None

    @contextlib.contextmanager
    def progress_bar(self, total: int | None = None):
        yield None

    def __call__(self, inputs: dict, steps: int = 3) -> list[torch.Tensor]:
        self.scheduler.set_timesteps(steps)
        self.scheduler.set_begin_index(0)
        outputs = []
        with self.progress_bar(total=steps):
            for t in self.scheduler.timesteps:
                self._current_timestep = t
                for _ in range(2):
                    timestep = t.expand(inputs["hidden_states"].shape[0]).to(inputs["hidden_states"].dtype)
                    outputs.append(forward(self.transformer, {**inputs, "timestep": timestep / 1000}))
        self._current_timestep = None
        return outputs


def test_flux_pipeline_timesteps_are_found_through_the_current_timestep(one_thread):
    model = tiny_flux(2, 2)
    inputs = flux_inputs(batch=1)
    pipe = FluxLikePipeline(model)
    results = {}
    for target in (pipe, model):  # the pipeline; the model alone (the read-back fallback)
        tp.apply_tome(target, ratio=0.3, ratio_start=0.7)
        pipe(inputs)
        with recording_forwards(model) as records:
            outputs = pipe(inputs)
        tp.remove_tome(target)
        results[target is pipe] = (records, outputs)
    (with_schedule, outputs), (read_back, expected) = results[True], results[False]
    assert [f.syncs for f in with_schedule] == [0] * 6 and [f.syncs for f in read_back] == [1] * 6
    # The schedule's own values; reading back gives them through `t / 1000 * 1000` in float32.
    assert [f.timestep for f in with_schedule] == [v for v in pipe.scheduler.timesteps.tolist() for _ in range(2)]
    assert [f.timestep for f in with_schedule] == pytest.approx([f.timestep for f in read_back], rel=1e-6)
    assert [f.rows for f in with_schedule] == [f.rows for f in read_back]
    for got, want in zip(outputs, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_pipelines_watch_their_denoising_loop_and_stop_when_tome_goes(tmp_path, one_thread):
    pipe = tiny_sd_pipeline(tmp_path)
    tp.apply_tome(pipe, ratio=0.5)
    assert "progress_bar" in vars(pipe)  # every loop starts a new generation (tests/test_generations.py)
    tp.apply_tome(pipe, ratio=0.5, ratio_start=0.7)
    assert "progress_bar" in vars(pipe)
    tp.remove_tome(pipe)
    assert "progress_bar" not in vars(pipe)
    tp.enable_tome(pipe, ratio=0.5, ratio_start=0.7)
    context = context_of(pipe.unet)
    seen = []
    handle = pipe.unet.register_forward_pre_hook(lambda module, args: seen.append(context.schedule))
    generation(pipe, img2img=False)
    handle.remove()
    assert seen[0] is not None and all(schedule is seen[0] for schedule in seen)  # one copy per generation
    assert seen[0].values == pipe.scheduler.timesteps.tolist()
    assert context.schedule is None  # dropped at the end of the generation
    tp.disable_tome(pipe)
    assert "progress_bar" not in vars(pipe)


# Models with the real number of merged blocks (SD1.5: five at the first level, PixArt-alpha 28, SD3 24,
# Flux 19 + 38), tiny otherwise: what a forward sets up once is shared by as many blocks as in the real one.
REAL_BLOCK_COUNTS = {
    "unet": (lambda: unet(2), unet_call_inputs),
    "pixart": (lambda: tiny_pixart(28), lambda model: pixart_inputs()),
    "sd3": (lambda: tiny_sd3(24), lambda model: sd3_inputs()),
    # Flux as its pipeline runs it: batch 1 (guidance-distilled, no CFG batch), and two images (or true CFG).
    "flux": (lambda: tiny_flux(19, 38), lambda model: flux_inputs(batch=1)),
    "flux-batch2": (lambda: tiny_flux(19, 38), lambda model: flux_inputs(batch=2)),
    # SVD: five spatial blocks at the first level, as in the real one (layers_per_block 2 down, 3 up).
    "svd": (tiny_svd_unet, lambda model: svd_inputs(batch=2, frames=3)),
    # The new families at their real depth, batched as their pipelines run them: Qwen-Image and Chroma call
    # the model once per guidance branch, FLUX.2 is guidance-distilled, Z-Image batches both branches.
    "qwenimage": (lambda: tiny_qwenimage(60), lambda model: qwenimage_inputs(batch=1)),
    "qwenimage-edit": (lambda: tiny_qwenimage(60), lambda model: qwenimage_inputs(batch=1, reference=(4, 4))),
    # Two images per prompt (or a batch of prompts): the whole batch in one attention call, as FLUX.1's.
    "qwenimage-batch2": (lambda: tiny_qwenimage(60), lambda model: qwenimage_inputs(batch=2)),
    "qwenimage-edit-batch2": (lambda: tiny_qwenimage(60), lambda model: qwenimage_inputs(batch=2, reference=(4, 4))),
    "chroma-batch2": (lambda: tiny_chroma(19, 38), lambda model: chroma_inputs(batch=2, padded=3)),
    "flux2-batch2": (lambda: tiny_flux2(8, 48), lambda model: flux2_inputs(batch=2)),
    "flux2": (lambda: tiny_flux2(8, 48), lambda model: flux2_inputs(batch=1)),
    "chroma": (lambda: tiny_chroma(19, 38), lambda model: chroma_inputs(batch=1, padded=3)),
    "zimage": (lambda: tiny_zimage(30), lambda model: zimage_inputs(batch=2, text=(7, 40))),
    # Wan2.1-1.3B's 30 blocks, batch 1 as its pipelines run it (the guidance is a second call).
    "wan": (lambda: tiny_wan(30), lambda model: wan_inputs(batch=1)),
    "ltx": (lambda: tiny_ltx(28), lambda model: ltx_inputs(batch=1)),
    # LTX-2's 48 blocks, its guidance batch of two as its pipeline runs it.
    "ltx2": (lambda: tiny_ltx2(48), lambda model: ltx2_inputs(batch=2)),
    # HunyuanVideo's 20 double- and 40 single-stream blocks: batch 1 as its pipeline runs it (guidance-distilled),
    # and two videos (or true CFG batched).
    "hunyuanvideo": (lambda: tiny_hunyuanvideo(20, 40), lambda model: hunyuanvideo_inputs(batch=1)),
    "hunyuanvideo-batch2": (lambda: tiny_hunyuanvideo(20, 40), lambda model: hunyuanvideo_inputs(batch=2)),
    # HunyuanVideo 1.5's 54 double-stream blocks, its guidance batch of two.
    "hunyuanvideo15": (lambda: tiny_hunyuanvideo15(54), lambda model: hunyuanvideo15_inputs(batch=2)),
}

#: The new rotary families at batch 2 (`REAL_BLOCK_COUNTS`).
BATCH2_FAMILIES = ("qwenimage-batch2", "qwenimage-edit-batch2", "chroma-batch2", "flux2-batch2")

BUDGETS = [
    # (family, options, most aten ops per merged block)
    pytest.param("unet", {}, 28, id="unet"),
    pytest.param("pixart", {}, 28, id="pixart"),
    pytest.param("sd3", {}, 28, id="sd3"),
    pytest.param("unet", {"share_level": True}, 15, id="unet-share_level"),
    pytest.param("pixart", {"share_level": True}, 10, id="pixart-share_level"),
    pytest.param("sd3", {"share_level": True}, 10, id="sd3-share_level"),
    # Flux also gathers each merge's rotary tables (the text positions and those of the partition's
    # destinations are made once per partition, not per block) and its single blocks merge the text along
    # as rows of their own instead of cutting it off and putting it back. A batch of several runs in one
    # attention call, each sample rotated by its own table (`batched_rotary`), not one call per sample.
    pytest.param("flux", {}, 28, id="flux"),
    pytest.param("flux", {"share_level": True}, 8, id="flux-share_level"),
    pytest.param("flux-batch2", {}, 30, id="flux-batch2"),
    pytest.param("flux-batch2", {"share_level": True}, 8, id="flux-batch2-share_level"),
    pytest.param("svd", {}, 28, id="svd"),
    pytest.param("svd", {"share_level": True}, 15, id="svd-share_level"),
    # The new joint families: tail tokens (a reference image's, Z-Image's padding and caption) are rows of
    # their own made inside the matching (one op), masks are cut by slicing, Z-Image's batched rotary tables
    # are looked up in one index op.
    *(pytest.param(name, {}, 30, id=name) for name in NEW_FAMILIES),
    *(pytest.param(name, {"share_level": True}, 10, id=f"{name}-share_level") for name in NEW_FAMILIES),
    # The new rotary families at batch 2 (issue 21: at most 30), one attention call for the batch. Measured: Qwen-Image
    # 23.1 / 6.4 (116.5 / 116.5 when it ran one sample at a time), Qwen-Image-Edit 24.9 / 7.2, Chroma 23.7 / 5.6,
    # FLUX.2 21.7 / 3.8.
    *(pytest.param(name, {}, 30, id=name) for name in BATCH2_FAMILIES),
    *(pytest.param(name, {"share_level": True}, 10, id=f"{name}-share_level") for name in BATCH2_FAMILIES),
    # Wan gathers each merge's rotary tables (cos and sin in one gather) and merges frame by frame: the
    # frames are the matching's batch, folded back into the clip's rows (two ops).
    # Wan's pipelines call it at batch 1, where its destinations are random too (no odd-batch rule on its family):
    # every block's destinations drawn once per forward, about one op a block (measured, 30 blocks at batch 1:
    # 28.9 / 25.0 / 7.6; with use_rand=False 28.1 / 24.1 / 6.7).
    pytest.param("wan", {}, 30, id="wan"),
    pytest.param("wan", {"st": 2}, 26, id="wan-st2"),
    pytest.param("wan", {"st": 2, "share_level": True}, 8, id="wan-st2-share_level"),
    # Window matching: one gather and a product per source where global matching multiplies with every
    # destination, the ranked destinations one `take` (measured: as global, 25.0 across frames, 28.9 per frame).
    pytest.param("wan", {"st": 2, "matching": "window"}, 26, id="wan-st2-window"),
    pytest.param("wan", {"matching": "window"}, 30, id="wan-window"),
    pytest.param("flux", {"matching": "window"}, 28, id="flux-window"),
    # LTX-Video as Wan, its rotary tables one per sample (`(B, N, D)`: one gather at (sample, row) positions).
    pytest.param("ltx", {}, 30, id="ltx"),
    pytest.param("ltx", {"st": 2}, 25, id="ltx-st2"),
    pytest.param("ltx", {"st": 2, "share_level": True}, 7, id="ltx-st2-share_level"),
    # LTX-2 (48 blocks, its guidance batch of two) as LTX-Video, its video self-attention alone merged; the released
    # model's split rotary tables, one `(H, N, D)` per sample, take one op more per merge than LTX-Video's (the
    # gathered rows put back heads first). Measured: 29.6 / 25.7 / 7.1 (28.6 with interleaved tables; LTX-Video
    # at batch two 28.9).
    pytest.param("ltx2", {}, 30, id="ltx2"),
    pytest.param("ltx2", {"st": 2}, 28, id="ltx2-st2"),
    pytest.param("ltx2", {"st": 2, "share_level": True}, 8, id="ltx2-st2-share_level"),
    # HunyuanVideo: joint attention over the video then the text, its rotary tables (cos and sin, over the video
    # alone) looked up at the merged rows, its mask cut by slicing; a batch of two in one attention call.
    # Measured: 25.0 / 21.0 / 3.3 at batch 1, 27.8 at batch 2.
    pytest.param("hunyuanvideo", {}, 30, id="hunyuanvideo"),
    pytest.param("hunyuanvideo", {"st": 2}, 25, id="hunyuanvideo-st2"),
    pytest.param("hunyuanvideo", {"st": 2, "share_level": True}, 7, id="hunyuanvideo-st2-share_level"),
    pytest.param("hunyuanvideo-batch2", {}, 30, id="hunyuanvideo-batch2"),
    # HunyuanVideo 1.5 (54 blocks, batch 2; its default and share_level budgets with the new families'): its mask
    # covers the text alone and passes as it is. Measured: 25.5 / 2.9 / 20.6 / 2.9.
    pytest.param("hunyuanvideo15", {"st": 2}, 25, id="hunyuanvideo15-st2"),
    pytest.param("hunyuanvideo15", {"st": 2, "share_level": True}, 7, id="hunyuanvideo15-st2-share_level"),
]


def cost_per_merged_block(family: str, options: dict) -> tuple[float, int, int]:
    """`(aten ops per merged block, merged blocks, host-sync ops)` of a forward after the first, on the
    family's model with its real number of merged blocks."""
    build, make_inputs = REAL_BLOCK_COUNTS[family]
    model = build()
    inputs = make_inputs(model)
    baseline_ops, _ = count_ops(model, inputs)
    tp.apply_tome(model, **options)
    forward(model, inputs)  # the first forward fills the per-grid caches
    ops, merged = count_ops(model, inputs)
    per_block = (sum(ops.values()) - sum(baseline_ops.values())) / max(merged, 1)
    syncs = sum(max(ops[name] - baseline_ops[name], 0) for name in SYNC_OPS)
    return per_block, merged, syncs


@pytest.mark.parametrize(("family", "options", "budget"), BUDGETS)
def test_aten_ops_per_merged_block_stay_within_budget(family, options, budget, one_thread):
    per_block, merged, syncs = cost_per_merged_block(family, options)
    assert merged >= 5 and syncs == 0
    assert per_block <= budget, f"{per_block:.1f} aten ops per merged block, budget {budget}"


FLUX_CALLS: dict[tuple[int, int, int], dict] = {}


def flux_call(h: int, w: int, t: float, batch: int) -> dict:
    """Flux's inputs at timestep `t`; one `img_ids` object per grid, as a pipeline passes (read once)."""
    inputs = FLUX_CALLS.setdefault((h, w, batch), flux_inputs(batch=batch, h=h, w=w))
    return {**inputs, "timestep": torch.full((batch,), t)}


@pytest.mark.parametrize("batch", [1, 2])
def test_flux_cost_and_output_hold_across_timesteps_and_grid_changes(batch, one_thread):
    # What a forward sets up once (partitions, positions, rotary tables) must be right in every forward:
    # each output equals a fresh application's, and the budget holds in every forward of a grid seen before.
    model = tiny_flux(19, 38)
    calls = [(6, 8, 1.0), (6, 8, 0.6), (5, 9, 0.45), (5, 9, 0.3), (6, 8, 0.2), (7, 4, 0.9), (6, 8, 0.1)]
    expected = []
    for h, w, t in calls:
        tp.apply_tome(model)
        expected.append(forward(model, flux_call(h, w, t, batch)))
        tp.remove_tome(model)
    baselines = {(h, w): count_ops(model, flux_call(h, w, 0.5, batch))[0] for h, w, _ in calls}
    tp.apply_tome(model)
    seen, last = set(), None
    for (h, w, t), want in zip(calls, expected, strict=True):
        inputs = flux_call(h, w, t, batch)
        ops, merged = count_ops(model, inputs)
        assert torch.equal(forward(model, inputs), want)
        baseline = baselines[(h, w)]
        if (h, w) == last:  # within a generation (the family reads img_ids again after another grid)
            assert not any(ops[name] > baseline[name] for name in SYNC_OPS)
        if (h, w) in seen:  # the first forward of a grid fills its caches
            per_block = (sum(ops.values()) - sum(baseline.values())) / merged
            assert merged == 57 and per_block <= 30, f"{per_block:.1f} ops per block at {(h, w, t)}"
        seen.add((h, w))
        last = (h, w)


def test_reusing_merges_costs_fewer_ops_than_computing_them(one_thread):
    model = unet(2)
    inputs = unet_call_inputs(model)
    tp.apply_tome(model)
    forward(model, inputs)
    computing = sum(count_ops(model, inputs)[0].values())
    tp.apply_tome(model, recompute_every=3)
    forward(model, inputs)  # step 0 computes; steps 1 and 2 reuse
    reusing = sum(count_ops(model, inputs)[0].values())
    assert reusing < computing - 5 * 15


COMPILED = [
    *((family, {}) for family in sorted(FAMILIES)),
    # Window matching: a gather of each source's window destination instead of the similarity product.
    ("wan", {"st": 2, "ratio": 0.75, "matching": "window"}),
    ("flux", {"matching": "window", "share_level": True}),
    # The presets' rule (`pays_only`, decided in the model pre-hook; conftest's table merges everywhere).
    ("unet", {"pays_only": True, "mode": "downsample_kv", "kv_factor": 4}),
    ("flux", {"pays_only": True, "share_level": True}),
]


@pytest.mark.parametrize(("family", "options"), COMPILED, ids=[f"{f}-{'-'.join(o) or 'default'}" for f, o in COMPILED])
def test_compiles_in_one_graph_without_recompiling_across_steps(family, options, one_thread):
    import torch._dynamo

    build, make_inputs = FAMILIES[family]
    model = build()
    inputs = make_inputs(model)
    tp.apply_tome(model, **options)
    timesteps = [999.0, 750.0, 500.0, 250.0] if family != "flux" else [1.0, 0.75, 0.5, 0.25]
    eager = []
    for t in timesteps:
        inputs["timestep"] = torch.full_like(torch.as_tensor(inputs["timestep"]), t)
        eager.append(forward(model, dict(inputs)))
    torch._dynamo.reset()
    grid = context_of(model).model_state.latent_hw
    if family in IDS_FAMILIES:  # a graph cannot read img_ids: what pipelines note in every call
        tp.set_token_grid(model, grid)
    compiled = torch.compile(model, fullgraph=True, backend="eager")  # graph breaks raise with fullgraph
    with torch._dynamo.config.patch(error_on_recompile=False):
        inputs["timestep"] = torch.full_like(torch.as_tensor(inputs["timestep"]), timesteps[0])
        torch.testing.assert_close(forward(compiled, dict(inputs)), eager[0], rtol=1e-4, atol=1e-5)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for t, expected in zip(timesteps[1:], eager[1:], strict=True):
            inputs["timestep"] = torch.full_like(torch.as_tensor(inputs["timestep"]), t)
            torch.testing.assert_close(forward(compiled, dict(inputs)), expected, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()


def test_hunyuanvideo15_blocks_compile_in_one_graph_without_recompiling_across_steps(one_thread):
    # HunyuanVideo 1.5's forward is no graph, with or without ToMe: it branches on `torch.all(image_embeds == 0)`
    # and reorders each sample's text by its masks. Its blocks compile (regional compilation, as diffusers'
    # `compile_repeated_blocks` does it): 12 blocks, more than torch.compile recompiles one function for (8), in two
    # graphs: the forward's first block, which draws every block's partitions, and one for the eleven others.
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    model = tiny_hunyuanvideo15(12)
    inputs = hunyuanvideo15_inputs()
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match="(?s)image_embeds == 0"):
        torch.compile(model, fullgraph=True, backend="eager")(**inputs)
    tp.apply_tome(model)
    timesteps = [999.0, 750.0, 500.0, 250.0]
    eager = []
    for t in timesteps:
        inputs["timestep"] = torch.full_like(inputs["timestep"], t)
        eager.append(forward(model, dict(inputs)))
    torch._dynamo.reset()
    counter = CompileCounter()
    for block in model.transformer_blocks:
        block.compile(fullgraph=True, backend=counter)  # graph breaks raise with fullgraph
    try:
        inputs["timestep"] = torch.full_like(inputs["timestep"], timesteps[0])
        torch.testing.assert_close(forward(model, dict(inputs)), eager[0], rtol=1e-4, atol=1e-5)
        assert counter.frame_count == 2
        with torch._dynamo.config.patch(error_on_recompile=True):
            for t, expected in zip(timesteps[1:], eager[1:], strict=True):
                inputs["timestep"] = torch.full_like(inputs["timestep"], t)
                torch.testing.assert_close(forward(model, dict(inputs)), expected, rtol=1e-4, atol=1e-5)
        assert counter.frame_count == 2
    finally:
        torch._dynamo.reset()


#: Video families whose self-attention takes one rotary row per token (`rotary_attention`): the default, the
#: balanced preset (`st=2` windows, window matching) and the fast one (`share_level`: one merge, and its gathered
#: tables, for every block of a forward); LTX-2 (twice as slow to trace) with its balanced preset alone.
VIDEO_BLOCK_COMPILES = [
    *(
        pytest.param(family, preset, id=f"{family}-{preset}")
        for family in ("wan", "ltx")
        for preset in ("default", "balanced", "fast")
    ),
    pytest.param("ltx2", "balanced", id="ltx2-balanced"),
]


@pytest.mark.parametrize(("family", "preset"), VIDEO_BLOCK_COMPILES)
def test_video_blocks_compile_in_one_graph_without_recompiling_across_steps(family, preset, one_thread):
    # Regional compilation of Wan, LTX-Video and LTX-2: each block compiled alone, with `fullgraph=True` (a graph
    # break raises). Their rotary tables are gathered once per forward (and per shared merge) and found again by
    # the identity of the `cos` / `sin` tensors, which dynamo guards on; a tuple's identity broke every block's
    # graph. The default compiles each block with `block.compile`, the presets through diffusers'
    # `compile_repeated_blocks` (the same call on every `_repeated_blocks` module): two graphs, the forward's
    # first block (which draws every block's partitions) and one for the others.
    import torch._dynamo
    from torch._dynamo.testing import CompileCounter

    build, make_inputs = FAMILIES[family]
    model = build(3)
    inputs = make_inputs(model)
    plain = forward(model, dict(inputs))
    tp.apply_tome(model, **({} if preset == "default" else {"preset": preset}))
    timesteps = [999.0, 750.0, 500.0]
    eager = []
    for t in timesteps:
        inputs["timestep"] = torch.full_like(inputs["timestep"], t)
        eager.append(forward(model, dict(inputs)))
    assert not torch.allclose(eager[-1], plain, atol=1e-5)  # ToMe merges in this forward
    torch._dynamo.reset()
    counter = CompileCounter()
    if preset == "default":
        for block in getattr(model, context_of(model).family.block_list):
            block.compile(fullgraph=True, backend=counter)
    else:
        model.compile_repeated_blocks(fullgraph=True, backend=counter)
    try:
        inputs["timestep"] = torch.full_like(inputs["timestep"], timesteps[0])
        torch.testing.assert_close(forward(model, dict(inputs)), eager[0], rtol=1e-4, atol=1e-5)
        assert counter.frame_count == 2
        with torch._dynamo.config.patch(error_on_recompile=True):
            for t, expected in zip([*timesteps, timesteps[-1]], [*eager, eager[-1]], strict=True):
                inputs["timestep"] = torch.full_like(inputs["timestep"], t)  # a second call with one timestep too
                torch.testing.assert_close(forward(model, dict(inputs)), expected, rtol=1e-4, atol=1e-5)
        assert counter.frame_count == 2
    finally:
        torch._dynamo.reset()


def main() -> None:
    """Print what one forward costs the host per family and option: `python tests/test_host_cost.py`."""
    torch.set_num_threads(1)
    print("| family | options | aten ops per merged block | merged blocks | host-sync ops per forward |")
    print("|---|---|---|---|---|")
    for family in REAL_BLOCK_COUNTS:
        for options in ({}, {"use_rand": False}, {"share_level": True}, {"recompute_every": 2}):
            per_block, merged, syncs = cost_per_merged_block(family, options)
            print(f"| {family} | {options or 'default'} | {per_block:.1f} | {merged} | {syncs} |")


if __name__ == "__main__":
    main()


@pytest.mark.parametrize("three_d_ids", [False, True])
def test_flux_reads_its_grid_once_under_inference_mode(three_d_ids, one_thread):
    # Inference tensors have no version counter: the same img_ids object must still be read only once.
    model = tiny_flux()
    inputs = flux_inputs(batch=1)
    if three_d_ids:
        inputs["img_ids"] = inputs["img_ids"].unsqueeze(0)
    tp.apply_tome(model)
    with torch.inference_mode():
        inputs = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        model(**inputs)
        with OpCounter() as counter:
            model(**inputs)
    assert not any(counter.ops[name] for name in SYNC_OPS), {name: counter.ops[name] for name in SYNC_OPS}
