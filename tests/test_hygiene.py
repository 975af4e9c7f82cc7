"""State hygiene: no stale state between forwards, after errors, across models and threads."""

from __future__ import annotations

import threading

import psutil
import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor2_0

from tome_processors import apply_tome, remove_tome
from tome_processors import merge as merge_module
from tome_processors.hooks import context_of

from models import run_unet, tiny_unet, unet_inputs

SHAPES = [(2, 16, 16), (1, 16, 16), (3, 15, 13), (2, 9, 7), (1, 63, 47), (1, 12, 20), (2, 16, 16)]


def fresh_result(unet, shape, **options):
    apply_tome(unet, **options)
    out = run_unet(unet, *unet_inputs(unet, *shape))
    remove_tome(unet)
    return out


def assert_no_tensors_held(unet):
    context = context_of(unet)
    for block in context.blocks:
        assert block.metric is None and block.merge is None and block.merged_config is None and block.ff_merge is None


@pytest.mark.usefixtures("one_thread")  # bit-for-bit across runs: two threads under load reorder some sums
def test_alternating_sizes_and_batches_match_fresh_runs():
    unet = tiny_unet("sd15")
    options = dict(ratio=0.5, merge_mlp=True, merge_crossattn=True)
    expected = [fresh_result(unet, shape, **options) for shape in SHAPES]
    baseline = run_unet(unet, *unet_inputs(unet))
    apply_tome(unet, **options)
    for _ in range(2):
        for shape, want in zip(SHAPES, expected, strict=True):
            assert torch.equal(run_unet(unet, *unet_inputs(unet, *shape)), want)
            assert_no_tensors_held(unet)
    remove_tome(unet)
    assert torch.equal(run_unet(unet, *unet_inputs(unet)), baseline)


class FlakyProcessor(AttnProcessor2_0):
    """An inner processor that raises while armed."""

    armed = False

    def __call__(self, attn, hidden_states, *args, **kwargs):
        if FlakyProcessor.armed:
            raise RuntimeError("inner processor failed")
        return super().__call__(attn, hidden_states, *args, **kwargs)


def test_inner_processor_raising_mid_forward_leaves_nothing_stale():
    unet = tiny_unet("sd15")
    inputs = unet_inputs(unet)
    baseline = run_unet(unet, *inputs)
    unet.set_attn_processor(FlakyProcessor())
    apply_tome(unet, ratio=0.5, merge_mlp=True)
    expected = run_unet(unet, *inputs)
    FlakyProcessor.armed = True
    try:
        with pytest.raises(RuntimeError, match="inner processor failed"):
            run_unet(unet, *unet_inputs(unet, 3, 12, 20))
    finally:
        FlakyProcessor.armed = False
    assert_no_tensors_held(unet)
    assert torch.equal(run_unet(unet, *inputs), expected)
    remove_tome(unet)
    assert torch.equal(run_unet(unet, *inputs), baseline)


def test_many_forwards_do_not_grow_memory():
    unet = tiny_unet("sd15")
    apply_tome(unet, ratio=0.5, merge_mlp=True)
    inputs = unet_inputs(unet, 2, 8, 8)
    process = psutil.Process()
    for _ in range(100):  # warm up allocator caches
        run_unet(unet, *inputs)
    before = process.memory_info().rss
    for _ in range(500):
        run_unet(unet, *inputs)
    growth = process.memory_info().rss - before
    assert growth < 32 * 2**20, f"resident memory grew by {growth / 2**20:.1f} MiB over 500 forwards"
    assert_no_tensors_held(unet)


def test_removal_lets_the_merge_buffers_go():
    # Merges sum into kept zero tensors (device memory on a GPU); removing ToMe lets them go, and the next
    # application's merges make their own again with the same output.
    unet = tiny_unet("sd15")
    inputs = unet_inputs(unet, 2, 8, 8)
    apply_tome(unet, ratio=0.5)
    first = run_unet(unet, *inputs)
    assert merge_module._ZEROS
    remove_tome(unet)
    assert not merge_module._ZEROS
    apply_tome(unet, ratio=0.5)
    torch.testing.assert_close(run_unet(unet, *inputs), first, rtol=0, atol=0)
    remove_tome(unet)


def test_two_models_with_different_configs_do_not_interfere():
    first, second = tiny_unet("sd15", seed=1), tiny_unet("sd2", seed=2)
    inputs_a, inputs_b = unet_inputs(first, 2, 16, 16), unet_inputs(second, 3, 12, 20)
    expected_a = fresh_result(first, (2, 16, 16), ratio=0.3)
    expected_b = fresh_result(second, (3, 12, 20), ratio=0.7, max_downsample=2)
    apply_tome(first, ratio=0.3)
    apply_tome(second, ratio=0.7, max_downsample=2)
    for _ in range(2):
        assert torch.equal(run_unet(first, *inputs_a), expected_a)
        assert torch.equal(run_unet(second, *inputs_b), expected_b)


def test_two_threads_two_models_at_once():
    models = [tiny_unet("sd15", seed=1), tiny_unet("sd15", seed=2)]
    configs = [dict(ratio=0.3), dict(ratio=0.6, merge_mlp=True)]
    shapes = [(2, 16, 16), (3, 15, 13)]
    expected = [fresh_result(m, s, **c) for m, s, c in zip(models, shapes, configs, strict=True)]
    for model, config in zip(models, configs, strict=True):
        apply_tome(model, **config)
    errors: list[str] = []

    def worker(i: int) -> None:
        inputs = unet_inputs(models[i], *shapes[i])
        for _ in range(8):
            if not torch.equal(run_unet(models[i], *inputs), expected[i]):
                errors.append(f"model {i} differed")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
