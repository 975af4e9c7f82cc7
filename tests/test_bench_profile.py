"""`bench --profile PATH`: one forward per method timed op by op (`bench.profiling`)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from tome_processors.bench.profiling import (
    ForwardProfile,
    OpTime,
    is_attention_op,
    op_times,
    profile_forward,
    profile_report,
)
from tome_processors.bench.run import BenchRequest, run_bench
from tome_processors.cli.main import main

FAST = ["--quick", "--threads", "1", "--rounds", "1", "--no-progress", "--no-trained-quality", "--no-tomesd"]


def test_profile_forward_times_each_op_of_the_call(one_thread):
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def call() -> torch.Tensor:
        return torch.relu(a @ b) @ b

    out, profile = profile_forward(call, torch.device("cpu"), top=3)
    assert torch.equal(out, call())
    assert profile.clock == "cpu" and len(profile.ops) == 3
    by_name = {op.name: op for op in profile.ops}
    assert by_name["aten::mm"].calls == 2  # two products, averaged into one entry
    assert [op.self_ms for op in profile.ops] == sorted((op.self_ms for op in profile.ops), reverse=True)
    assert 0 < sum(op.self_ms for op in profile.ops) <= profile.total_ms + 1e-9


def test_cuda_profiles_rank_ops_by_their_kernels_and_count_each_kernel_once():
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def event(key, device_type, device_us, count=1):
        return SimpleNamespace(key=key, count=count, device_type=device_type, self_device_time_total=device_us)

    averages = [  # as `key_averages()` lists them: the ops (device time of their kernels), then the kernels
        event("aten::mm", cpu, 300.0, count=2),
        event("aten::linear", cpu, 0.0, count=2),  # its kernels are its child's, `mm`'s
        event("aten::index_select", cpu, 100.0),
        event("gemm_kernel", cuda, 300.0, count=2),
        event("index_kernel", cuda, 100.0),
        event("Memcpy HtoD", cuda, 20.0),
    ]
    profile = op_times(averages, cuda=True)
    assert profile.clock == "cuda" and profile.total_ms == pytest.approx(0.42)  # kernels once, copies included
    assert [(op.name, op.calls, op.self_ms) for op in profile.ops] == [
        ("aten::mm", 2, pytest.approx(0.3)),
        ("aten::index_select", 1, pytest.approx(0.1)),
    ]
    assert [op.name for op in op_times(averages, cuda=True, top=1).ops] == ["aten::mm"]
    assert profile.attention_ms == 0.0 and profile.attention_bound == 1.0


def test_attention_kernels_are_summed_beyond_the_top_ops_and_bound_the_speed_up():
    cpu, cuda = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA

    def event(key, device_type, device_us):
        return SimpleNamespace(key=key, count=1, device_type=device_type, self_device_time_total=device_us)

    averages = [
        event("aten::cudnn_convolution", cpu, 500.0),
        event("aten::_cudnn_attention_forward", cpu, 300.0),
        event("aten::_cudnn_attention_backward", cpu, 100.0),  # outside the top 2, still counted
        event("aten::scaled_dot_product_attention", cpu, 0.0),  # dispatches only: its kernels are its child's
        event("kernels", cuda, 1000.0),
    ]
    profile = op_times(averages, cuda=True, top=2)
    assert [op.name for op in profile.ops] == ["aten::cudnn_convolution", "aten::_cudnn_attention_forward"]
    assert profile.attention_ms == pytest.approx(0.4)
    assert profile.attention_bound == pytest.approx(1.0 / 0.6)  # the other 60% of the time stays
    assert "attention kernels: 0.400 ms (40.0%); shortening attention alone gains at most 1.67x" in profile_report(
        [("baseline", profile)]
    )
    assert ForwardProfile("cuda", 1.0, attention_ms=1.0).attention_bound == float("inf")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("aten::_flash_attention_forward", True),
        ("aten::_efficient_attention_backward", True),
        ("aten::_scaled_dot_product_flash_attention_for_cpu", True),
        ("xformers::efficient_attention_forward_cutlass", True),
        ("aten::bmm", False),
        ("aten::native_group_norm", False),
    ],
)
def test_attention_ops_are_told_by_name(name, expected):
    assert is_attention_op(name) is expected


def test_profile_report_gives_each_method_its_section_and_shares():
    report = profile_report(
        [
            ("baseline", ForwardProfile("cuda", 4.0, [OpTime("aten::mm", 2, 3.0), OpTime("a|b", 1, 1.0)])),
            ("ours fast", ForwardProfile("cuda", 2.0, [OpTime("aten::mm", 2, 1.0)])),
        ]
    )
    assert "### baseline: 4.000 ms of op self time on the cuda" in report
    assert "| aten::mm | 2 | 3.000 | 75.0 |" in report and "| a/b | 1 | 1.000 | 25.0 |" in report
    assert "### ours fast: 2.000 ms" in report and "| aten::mm | 2 | 1.000 | 50.0 |" in report


def test_bench_profile_writes_every_methods_top_ops(tmp_path, one_thread):
    profile_path, json_path = tmp_path / "profile.md", tmp_path / "b.json"
    argv = ["bench", *FAST, "--arch", "pixart", "--presets", "balanced", "--ratios", "0.5", "--modes", "none"]
    assert main([*argv, "--profile", str(profile_path), "--json", str(json_path)]) == 0
    rows = json.loads(json_path.read_text())["rows"]
    text = profile_path.read_text()
    assert text.startswith("`tome-processors bench ")  # the command heads the report
    for row in rows:
        assert f"### {row['name']}: " in text
        profile = row["profile"]
        assert profile["clock"] == "cpu" and profile["total_ms"] > 0 and profile["ops"]
        assert profile["ops"][0]["self_ms"] >= profile["ops"][-1]["self_ms"]
        assert 0 < profile["attention_ms"] < profile["total_ms"]  # PixArt's attention runs SDPA's CPU kernel
    # Merging adds its own ops: the gathers of merge and unmerge show up in the merged forwards alone.
    ops = {row["name"]: {op["name"] for op in row["profile"]["ops"]} for row in rows}
    assert len(rows) == 3 and ops["baseline"] != ops[rows[1]["name"]]


def test_bench_without_profile_leaves_rows_unprofiled(tmp_path, one_thread):
    json_path = tmp_path / "b.json"
    argv = ["bench", *FAST, "--arch", "pixart", "--presets", "none", "--ratios", "0.5", "--modes", "none"]
    assert main([*argv, "--json", str(json_path)]) == 0
    assert all(row["profile"] is None for row in json.loads(json_path.read_text())["rows"])


def test_profile_is_refused_with_pipeline(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--quick", "--pipeline", "--profile", str(tmp_path / "p.md")])
    assert exit_info.value.code == 2
    assert "Expected --pipeline without --profile" in capsys.readouterr().err
    with pytest.raises(ValueError, match="only without pipeline=True"):
        run_bench(BenchRequest(quick=True, pipeline=True, profile_path=str(tmp_path / "p.md")))
    assert not (tmp_path / "p.md").exists()
