"""Perturbed-Attention Guidance (PAG) pipelines with ToMe on, turned on each way a user does it.

A PAG pipeline assigns its processors straight onto the self-attention modules it perturbs
(`attn.processor = ...`) at the start of every call, and sets the model's processors back at the end.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from diffusers import AnimateDiffPAGPipeline, AutoPipelineForText2Image
from diffusers.models.attention_processor import AttnProcessor2_0, PAGCFGIdentitySelfAttnProcessor2_0

import tome_processors as tp
from tome_processors import ToMeProcessor

from pipelines import TOME_USAGES, denoiser, family_pipeline, tiny_animatediff_pipeline
from test_pipeline import sdxl_pipeline

#: Per family: PAG on the mid block and on a self-attention ToMe merges in (the highest-resolution level).
PAG_LAYERS = {
    "sd": ["mid", "down_blocks.0"],
    "sdxl": ["mid", "up_blocks.0"],
    "sd3": ["transformer_blocks.0"],
    "animatediff": ["mid", "down_blocks.0"],
}


def pag_pipeline(family: str, folder: Path) -> tuple[Any, dict]:
    """A tiny PAG pipeline of `family` and the arguments of a two-step generation with CFG and PAG."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if family == "sdxl":
            base, args = sdxl_pipeline(folder), dict(prompt="a cat", height=32, width=32, output_type="np")
        elif family == "animatediff":
            base = tiny_animatediff_pipeline(folder)
            args = dict(prompt="a cat", height=32, width=32, num_frames=2, output_type="np")
        else:
            base, args = family_pipeline(family, folder)
        if family == "animatediff":
            pipe = AnimateDiffPAGPipeline(**base.components, pag_applied_layers=PAG_LAYERS[family])
        else:
            pipe = AutoPipelineForText2Image.from_pipe(base, enable_pag=True, pag_applied_layers=PAG_LAYERS[family])
    pipe.set_progress_bar_config(disable=True)
    return pipe, {**args, "num_inference_steps": 2, "guidance_scale": 5.0, "pag_scale": 3.0}


def generate(pipe: Any, args: dict) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = pipe(**args, generator=torch.Generator().manual_seed(0))
    return np.asarray(out.frames if hasattr(out, "frames") else out.images)


def turn_on(pipe: Any, how: str) -> None:
    if how == "apply_tome":
        tp.apply_tome(pipe, ratio=0.5)
    elif how == "enable_tome":
        tp.enable_tome(pipe, ratio=0.5)
    else:  # the README's first usage
        denoiser(pipe).set_attn_processor(ToMeProcessor(ratio=0.5))


@pytest.mark.parametrize("how", TOME_USAGES)
@pytest.mark.parametrize("family", ["sd", "sdxl", "sd3", "animatediff"])
def test_pag_pipeline_runs_and_merges_with_tome_on(family, how, tmp_path):
    pipe, args = pag_pipeline(family, tmp_path)
    plain = generate(pipe, args)
    turn_on(pipe, how)
    first, second = generate(pipe, args), generate(pipe, args)
    assert np.isfinite(first).all() and not np.allclose(first, plain, atol=1e-6)  # it merges
    assert np.array_equal(first, second) and tp.is_tome_applied(pipe)
    # The pipeline set the model's processors back after each call: ToMe's, none of PAG's left behind.
    processors = denoiser(pipe).attn_processors.values()
    assert all(isinstance(p, ToMeProcessor) for p in processors), {type(p).__name__ for p in processors}
    tp.disable_tome(pipe) if how == "enable_tome" else tp.remove_tome(pipe)
    assert not tp.is_tome_applied(pipe) and np.array_equal(generate(pipe, args), plain)


def test_pag_layers_merge_under_enable_tome_and_run_as_assigned_under_apply_tome(tmp_path):
    # enable_tome keeps every processor wrapped, the PAG ones assigned during the call too; apply_tome leaves a
    # processor assigned by hand as it is. Both merge everywhere else, so the outputs differ from each other.
    outputs = {}
    for how in ("apply_tome", "enable_tome"):
        pipe, args = pag_pipeline("sd", tmp_path / how)
        turn_on(pipe, how)
        seen: list = []
        attn = pipe.unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1
        hook = attn.register_forward_pre_hook(lambda module, _, seen=seen: seen.append(module.processor))
        outputs[how] = generate(pipe, args)
        hook.remove()
        inner = [p.inner if isinstance(p, ToMeProcessor) else p for p in seen]
        assert all(type(p) is PAGCFGIdentitySelfAttnProcessor2_0 for p in inner)
        assert all(isinstance(p, ToMeProcessor) for p in seen) == (how == "enable_tome")
    assert not np.allclose(outputs["apply_tome"], outputs["enable_tome"], atol=1e-6)


def test_a_processor_assigned_by_hand_replaces_tome_on_that_module_only(tmp_path):
    pipe, args = pag_pipeline("sd", tmp_path)
    tp.apply_tome(pipe, ratio=0.5)
    attn = pipe.unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1
    own = AttnProcessor2_0()
    attn.processor = own  # a plain attribute, as it is without ToMe
    assert attn.processor is own and "processor" not in attn._modules
    assert tp.is_tome_applied(pipe)
    generate(pipe, {**args, "pag_scale": 0.0})
    assert attn.processor is own
    others = [p for name, p in pipe.unet.attn_processors.items() if not name.startswith("down_blocks.0.attentions.0.")]
    assert all(isinstance(p, ToMeProcessor) for p in others)
