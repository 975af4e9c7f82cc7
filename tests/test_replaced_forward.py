"""A tool that replaces the attention modules' `forward` (T-GATE) runs no attention processor: ToMe says so.

T-GATE (`tgate` 1.0.0) sets a `forward` of its own on every `Attention` of the UNet at each `pipe.tgate(...)` call,
before the first denoising step, and leaves it there afterwards. Tested with the real package on a tiny SD1.5
pipeline (random weights, offline).
"""

from __future__ import annotations

import functools
import warnings

import numpy as np
import pytest
import torch
from diffusers.models.attention_processor import Attention

import tome_processors as tp
from tome_processors import ToMeProcessor
from tome_processors.hooks import attention_modules
from tome_processors.replaced import replaced_forward

from models import run_unet, tiny_unet, unet_inputs
from pipelines import tiny_sd_pipeline

tgate = pytest.importorskip("tgate")

CALL = dict(
    prompt="a cat",
    height=32,
    width=32,
    num_inference_steps=4,
    gate_step=2,
    sp_interval=1,
    fi_interval=1,
    warm_up=1,
    output_type="np",
)


def run_tgate(pipe) -> np.ndarray:
    with torch.no_grad():
        return pipe.tgate(**CALL, generator=torch.Generator().manual_seed(0)).images


def told(records: list) -> list[str]:
    return [str(w.message) for w in records if "ToMe merges no attention" in str(w.message)]


def test_tgate_replaces_the_forwards_and_tome_says_so_once_at_the_first_call(tmp_path):
    pipe = tgate.TgateSDLoader(tiny_sd_pipeline(tmp_path))
    alone = run_tgate(pipe)
    pipe = tgate.TgateSDLoader(tiny_sd_pipeline(tmp_path / "b"))
    tp.apply_tome(pipe, ratio=0.5)  # before T-GATE replaced anything: nothing to say yet
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        with_tome = run_tgate(pipe)
        again = run_tgate(pipe)
    messages = told(records)
    assert len(messages) == 1  # once per model, at the first forward that finds them replaced
    assert "UNet2DConditionModel" in messages[0] and "attn1" in messages[0]
    assert "an instance attribute `forward`" in messages[0] and "T-GATE" in messages[0]
    # T-GATE's own attention ran, not ToMe's: the images are T-GATE's alone, bit for bit.
    np.testing.assert_array_equal(with_tome, alone)
    np.testing.assert_array_equal(again, alone)
    assert all(replaced_forward(attn) is not None for attn in attention_modules(pipe.unet))


@pytest.mark.parametrize("how", ["apply_tome", "set_attn_processor"])
def test_forwards_replaced_before_tome_attaches_are_named_when_it_attaches(tmp_path, how):
    pipe = tgate.TgateSDLoader(tiny_sd_pipeline(tmp_path))
    run_tgate(pipe)  # T-GATE leaves its forwards in place after its call
    if how == "apply_tome":
        with pytest.warns(UserWarning, match="ToMe merges no attention in .* on UNet2DConditionModel"):
            tp.apply_tome(pipe.unet, ratio=0.5)
    else:
        # No processor runs in the UNet's attention at all: the processor set alone attaches at the first call of
        # any of its modules' processors, which never comes, so nothing merges and nothing is claimed.
        pipe.unet.set_attn_processor(ToMeProcessor(ratio=0.5))
        run_tgate(pipe)
        assert not tp.is_tome_applied(pipe)


def test_wrappers_that_call_the_class_forward_are_no_replacement():
    unet = tiny_unet("sd15")
    inputs = unet_inputs(unet)
    attn = next(m for m in attention_modules(unet) if isinstance(m, Attention))

    def hooked(module, *args, **kwargs):  # as accelerate's and diffusers' hooks wrap a forward
        return module._old_forward(*args, **kwargs)

    attn._old_forward = attn.forward
    attn.forward = functools.update_wrapper(functools.partial(hooked, attn), attn._old_forward)
    assert replaced_forward(attn) is None
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        tp.apply_tome(unet, ratio=0.5)
        run_unet(unet, *inputs)
    attn.forward = lambda hidden_states, *args, **kwargs: hidden_states
    with pytest.warns(UserWarning, match=r"ToMe merges no attention in 1 of the \d+ attention modules"):
        run_unet(unet, *inputs)
