"""Same input, same output: merged forwards are bit-identical run after run at the thread count users run."""

from __future__ import annotations

import pytest
import torch

from tome_processors import apply_tome, remove_tome
from tome_processors.merge import TokenMerge

from models import run_unet, tiny_unet, unet_inputs


def test_merge_sums_in_one_order_at_two_threads(two_threads):
    # Rows whose tokens lie far apart in the token order (as global matching makes them), large enough that CPU
    # kernels split the tokens across both threads: a sum whose order follows the threads differs run to run.
    g = torch.Generator().manual_seed(0)
    batch, tokens, rows, channels = 2, 4096, 2048, 320
    token_row = torch.randint(0, batch * rows, (batch * tokens,), generator=g)
    row_size = torch.zeros(batch * rows, 1).index_add(0, token_row, torch.ones(batch * tokens, 1)).clamp(min=1)
    token_merge = TokenMerge(token_row, row_size, batch, tokens, rows)
    x = torch.randn(batch, tokens, channels, generator=g)
    first = token_merge.merge(x)
    for _ in range(10):
        assert torch.equal(token_merge.merge(x), first)


@pytest.mark.parametrize("preset", [None, "balanced"])
def test_unet_forwards_are_bit_identical_at_two_threads(two_threads, preset):
    unet = tiny_unet("sd15")
    sample, timestep, text, added = unet_inputs(unet, batch=2, height=40, width=24)
    options = {"ratio": 0.5, "use_rand": False} if preset is None else {"preset": preset}
    apply_tome(unet, **options)
    outputs = [run_unet(unet, sample, timestep, text, added) for _ in range(4)]
    remove_tome(unet)
    for output in outputs[1:]:
        assert torch.equal(output, outputs[0])
