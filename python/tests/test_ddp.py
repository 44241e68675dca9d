"""examples/ddp.py under torchrun: DistributedDataParallel over fused blocks gives the
gradients and losses of one process on the whole batch (the example checks; this test
runs it and reads its verdict). CPU ranks over gloo everywhere; on a GPU machine, one
rank per GPU over NCCL."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "ddp.py"


def run(nproc: int, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(EXAMPLE),
    ]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, env=env, timeout=600)


def check(out: subprocess.CompletedProcess[str], ranks: int) -> None:
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{ranks} ranks" in out.stdout and "equal one process's" in out.stdout, out.stdout
    assert "grad 0.lin.weight" in out.stdout, out.stdout


def test_ddp_on_cpu_ranks_equals_one_process() -> None:
    check(
        run(2, "--device", "cpu", "--steps", "4", "--batch", "64", "--dims", "32,64,16", "--groups", "8"), 2
    )


@pytest.mark.gpu
def test_ddp_on_every_gpu_equals_one_process() -> None:
    n = torch.cuda.device_count()
    check(run(n, "--device", "cuda", "--steps", "10"), n)
