"""`tome-processors bench` and `tome-processors quality`: the tooling that measures the library.

Nothing in the library imports this package. Modules, in the order a run uses them:

- `models`: the model to measure and its fixed inputs (`unet`: UNet architectures, `dit`: diffusion
  transformers), built with random weights or loaded;
- `methods`: the rows (baseline, this library, tomesd, modes), each with its overhead replay;
- `engine`: paired interleaved rounds, fidelity, overhead, memory; `hostcost`: aten ops, host syncs,
  CUDA kernels of one forward;
- `quality`: the shipped trained denoiser, its probe and the bench's trained-model columns;
- `report`: markdown table, JSON, plot, image grid; `generate`: whole generations timed (`--pipeline`),
  on a random-weight pipeline from `pipelines` or a loaded one;
- `meta`: device, dtype, versions and machine of a run.

`run` puts them together: `run_bench(BenchRequest(...))` is one whole `tome-processors bench`.
"""

from .engine import BenchSettings, Method, Row, run_benchmark

__all__ = ["BenchSettings", "Method", "Row", "run_benchmark"]
