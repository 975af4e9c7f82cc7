"""Host cost of one forward per family: aten ops without ToMe, with ToMe at 0.5 (merging everywhere), the added ops
per merged block, and host-sync ops; on the test suite's tiny models (run from the repository root):

    python scripts/host_cost_families.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

import test_host_cost as tables  # noqa: E402
import tome_processors as tp  # noqa: E402
from tome_processors.bench.hostcost import measure_host_cost  # noqa: E402
from tome_processors.families import find_family  # noqa: E402

COLUMNS = ("family", "aten ops plain", "aten ops ToMe 0.5", "merged blocks", "added ops per merged block",
           "sync ops plain", "sync ops ToMe")  # fmt: skip


def _cost(model: torch.nn.Module, kwargs: dict) -> object:
    model(**kwargs)  # warm: the first forward attaches and builds per-grid caches
    return measure_host_cost(lambda: model(**kwargs), torch.device("cpu"))[1]


def main() -> None:
    torch.set_num_threads(1)
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for name, (build, inputs) in {**tables.FAMILIES, **tables.NEW_FAMILIES}.items():
        model = build()
        kwargs = inputs(model)
        with torch.no_grad():
            plain = _cost(model, kwargs)
            tp.apply_tome(model, ratio=0.5, pays_only=False)
            tome = _cost(model, kwargs)
        blocks = len(find_family(model).blocks(model))
        added = (tome.aten_ops - plain.aten_ops) / blocks
        cells = (name, plain.aten_ops, tome.aten_ops, blocks, f"{added:.1f}", plain.sync_ops, tome.sync_ops)
        print("| " + " | ".join(str(cell) for cell in cells) + " |")


if __name__ == "__main__":
    main()
