"""bench/gpu_check.py: the prepared GPU run, exercised on the CPU with small sizes."""

from __future__ import annotations

import json

import pytest
import torch

from bench import gpu_check

pytestmark = pytest.mark.model


def test_dry_run_on_cpu_reports_every_level(tmp_path):
    argv = ["--device", "cpu", "--levels", "1,3", "--ctx", "16", "--steps", "2"]
    argv += ["--prompt-len", "8", "--output-len", "3", "--n-batch", "64", "--copy-mib", "16"]
    report = gpu_check.main(argv + ["--out", str(tmp_path)])
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == report
    assert [row["concurrency"] for row in report["levels"]] == [1, 3]
    per_cell = report["levels"][1]["bytes_per_step"] - report["weight_bytes"]
    assert per_cell == 3 * 17 * 2 * 30 * 3 * 64 * 2  # 3 seqs x 17 cells of bf16 K/V, SmolLM2
    for row in report["levels"]:
        assert row["output_tokens"] == row["concurrency"] * 3  # ignore_eos: exact lengths
        assert row["decode_step_ms"] > 0 and row["bandwidth_share"] > 0
    assert report["copy_bandwidth_gb_s"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_refuses_without_cuda():
    with pytest.raises(SystemExit, match="no CUDA"):
        gpu_check.main(["--levels", "1"])
