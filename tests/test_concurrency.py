"""One model, many requests: generations run in threads at once on one model with ToMe, as a server runs them.

Each request gets its own pipeline from `from_pipe` around the one model, with a scheduler and tokenizers of its own
(as a server must: a scheduler holds one call's steps, a fast tokenizer one call's padding); the threads start
together, at other sizes and prompts, for several rounds. Every image equals the same call run alone, bit for bit,
and no thread raises: what one forward computes (the token grid, the merges, the step) stays with its thread.
"""

from __future__ import annotations

import copy
import threading
import warnings
from typing import Any

import pytest
import torch

import tome_processors as tp
from tome_processors.hooks import context_of

from models import run_unet, tiny_unet, unet_inputs
from pipelines import family_pipeline

#: Three requests per family: (height, width, prompt). Other sizes give other token grids in every block.
REQUESTS = {
    "sd": [(32, 32, "a cat"), (48, 32, "a dog on a beach"), (32, 48, "a red house")],
    "flux": [(64, 64, "a cat"), (96, 64, "a dog on a beach"), (64, 96, "a red house")],
}
ROUNDS = 3


def generate(pipe: Any, args: dict, request: tuple[int, int, str]) -> torch.Tensor:
    height, width, prompt = request
    call = {**args, "prompt": prompt, "height": height, "width": width, "num_inference_steps": 2}
    with torch.no_grad():
        return torch.as_tensor(pipe(**call, generator=torch.Generator().manual_seed(0)).images)


def own_parts(base: Any) -> dict[str, Any]:
    """What a request must not share with the others: a scheduler (it holds one call's steps) and the tokenizers
    (a fast tokenizer's padding and truncation are set on it per call)."""
    parts = {"scheduler": type(base.scheduler).from_config(base.scheduler.config)}
    for name, component in base.components.items():
        if "tokenizer" in name and component is not None:
            parts[name] = copy.deepcopy(component)
    return parts


def run_together(base: Any, args: dict, requests: list[tuple[int, int, str]]) -> list[list[Any]]:
    """Each request in a thread of its own, with its own pipeline from `from_pipe`, `ROUNDS` times, the threads
    starting each round together; each thread's images (or the exception it raised)."""
    barrier = threading.Barrier(len(requests))
    threads = torch.get_num_threads()
    results: list[list[Any]] = [[] for _ in requests]

    def serve(index: int) -> None:
        # The torch thread count is each thread's own (OpenMP's): the one the calls run alone had, so that a sum
        # is split alike.
        torch.set_num_threads(threads)
        pipe = type(base).from_pipe(base, **own_parts(base))
        pipe.set_progress_bar_config(disable=True)
        for _ in range(ROUNDS):
            barrier.wait()
            try:
                results[index].append(generate(pipe, args, requests[index]))
            except Exception as error:  # the test reports what a thread raised
                results[index].append(error)

    workers = [threading.Thread(target=serve, args=(i,)) for i in range(len(requests))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return results


@pytest.fixture(scope="module", params=sorted(REQUESTS))
def served(request, tmp_path_factory) -> tuple[str, Any, dict]:
    family = request.param
    base, args = family_pipeline(family, tmp_path_factory.mktemp(family))
    base.set_progress_bar_config(disable=True)
    return family, base, args


@pytest.mark.parametrize("options", [{"ratio": 0.5}, {"ratio": 0.5, "recompute_every": 2}], ids=["every", "reuse"])
def test_concurrent_generations_equal_each_call_run_alone(served, options, one_thread):
    family, base, args = served
    requests = REQUESTS[family]
    tp.apply_tome(base, **options)
    try:
        alone = [generate(base, args, request) for request in requests]
        results = run_together(base, args, requests)
    finally:
        tp.remove_tome(base)
    for request, expected, images in zip(requests, alone, results, strict=True):
        assert len(images) == ROUNDS
        for image in images:
            assert not isinstance(image, Exception), f"{request}: {image!r}"
            assert torch.equal(image, expected), f"{request}: differs from the call run alone"
    plain = generate(base, args, requests[0])
    assert not torch.equal(plain, alone[0]), "ToMe changed nothing"


def test_without_tome_concurrent_generations_equal_each_call_run_alone(served, one_thread):
    # What the test above holds ToMe to: the pipelines themselves are exact under threads.
    family, base, args = served
    requests = REQUESTS[family]
    alone = [generate(base, args, request) for request in requests]
    for expected, images in zip(alone, run_together(base, args, requests), strict=True):
        assert all(torch.equal(image, expected) for image in images)


def test_a_forward_running_while_another_thread_attaches_merges_as_it_would_alone(one_thread):
    # `set_attn_processor(ToMeProcessor())` attaches the merge context at the first call. A thread whose forward
    # was already running then (its model pre-hook never ran) starts its forward from its own call stack at its
    # next block: it merges as it would alone, and says nothing of a skip.
    unet = tiny_unet("sd15")
    sample, timestep, text, _ = unet_inputs(unet)
    unet.set_attn_processor(tp.ToMeProcessor(ratio=0.5))
    entered, go = threading.Event(), threading.Event()

    def hold(module, args):  # the running thread waits in its first down block while the other attaches
        if threading.current_thread() is not threading.main_thread() and not go.is_set():
            entered.set()
            go.wait(timeout=60)

    handle = unet.down_blocks[0].register_forward_pre_hook(hold)
    results: list[Any] = []

    def running() -> None:
        torch.set_num_threads(1)
        try:
            results.append(run_unet(unet, sample, timestep, text))
        except Exception as error:  # reported below
            results.append(error)

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        thread = threading.Thread(target=running)
        thread.start()
        assert entered.wait(timeout=60)
        attaching = run_unet(unet, sample, timestep, text)  # attaches the context, merges
        go.set()
        thread.join()
    handle.remove()
    assert context_of(unet) is not None and not isinstance(results[0], Exception), results
    assert torch.equal(results[0], attaching), "the running forward did not merge as alone"
    assert torch.equal(run_unet(unet, sample, timestep, text), attaching)
    assert not [w for w in said if issubclass(w.category, tp.ToMeSkipWarning)], [str(w.message) for w in said]
