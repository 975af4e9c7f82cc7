"""Are merged forwards bit-identical run after run on this device? `python scripts/gpu_determinism.py [--device cuda]`

Prints, for the row sums a merge makes (`index_add`, accumulating `index_put`, `index_reduce`-free variants) and for
whole SD1.5-architecture UNet forwards with ToMe, how many distinct outputs N runs of one input gave, and the time of
each sum; then whether `torch.use_deterministic_algorithms(True)` lets a merged forward run.
"""

from __future__ import annotations

import argparse
import functools
import time

import torch

from tome_processors import apply_tome, remove_tome
from tome_processors.bench.unet import build_unet, make_inputs


def distinct(outputs: list[torch.Tensor]) -> int:
    seen: list[torch.Tensor] = []
    for out in outputs:
        if not any(torch.equal(out, s) for s in seen):
            seen.append(out)
    return len(seen)


def timed(fn, device, runs: int = 20) -> tuple[float, list[torch.Tensor]]:
    outs = [fn() for _ in range(3)]
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    outs = [fn() for _ in range(runs)]
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / runs * 1e3, outs


def sums(device: torch.device) -> None:
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float16, torch.float32):
        for tokens, channels in ((4096, 320), (16384, 320), (65536, 320)):
            rows = tokens // 2
            x = torch.randn(2 * tokens, channels, generator=g).to(device, dtype)
            index = torch.randint(0, 2 * rows, (2 * tokens,), generator=g).to(device)
            zeros = torch.zeros(2 * rows, channels, device=device, dtype=dtype)
            for name, fn in (
                ("index_add", functools.partial(zeros.index_add, 0, index, x)),
                ("index_put(accumulate)", functools.partial(zeros.index_put, (index,), x, accumulate=True)),
            ):
                ms, outs = timed(fn, device)
                print(f"sum {name:22s} {str(dtype):14s} tokens {tokens:6d}: {distinct(outs)} distinct of {len(outs)}, "
                      f"{ms:.3f} ms")


def forwards(device: torch.device, deterministic: bool) -> None:
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    unet = build_unet("sd15").to(device, dtype)
    inputs = make_inputs(unet, batch=2, resolution=512, device=device, dtype=dtype)
    # Explicit options: a preset merges only where it pays, and at this size `exact` would merge nothing.
    for preset in ("exact", "balanced"):
        apply_tome(unet, preset=preset, seed=0, pays_only=False)
        torch.use_deterministic_algorithms(deterministic)
        try:
            with torch.no_grad():
                outs = [unet(inputs.sample, inputs.timestep, inputs.encoder_hidden_states).sample for _ in range(6)]
            print(f"UNet sd15 512 b2 {preset:9s} deterministic_algorithms={deterministic}: "
                  f"{distinct(outs)} distinct of {len(outs)}")
        except Exception as error:  # noqa: BLE001 - reported, the probe goes on
            print(f"UNet sd15 512 b2 {preset:9s} deterministic_algorithms={deterministic}: raised "
                  f"{type(error).__name__}: {str(error)[:300]}")
        finally:
            torch.use_deterministic_algorithms(False)
            remove_tome(unet)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda")
    device = torch.device(parser.parse_args().device)
    print(torch.__version__, torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
    sums(device)
    forwards(device, deterministic=False)
    forwards(device, deterministic=True)


if __name__ == "__main__":
    main()
