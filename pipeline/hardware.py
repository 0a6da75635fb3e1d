"""What the machine computes fast: CPU model and flags, the dtype to use (`auto`), cores and thread pinning.

`dtype: auto` (the recipes' default) is bfloat16 only where matrix products in bf16 are native — a CUDA GPU, or a CPU
with AVX-512 BF16 or AMX — and float32 elsewhere. On an AVX2-only CPU bf16 products are emulated: measured on an AMD
EPYC (Qwen2.5-Coder-1.5B, 2 threads) a 400-token prefill took 64 s in bf16 and 11.6 s in fp32. Every benchmark and
manifest records `machine()` so a figure always says which CPU produced it, and on a CUDA machine which GPU, driver
and CUDA build (`gpu_info`).
"""

from __future__ import annotations

import os
import platform
from functools import lru_cache

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
REPORTED_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8", "fma")


@lru_cache(maxsize=1)
def cpu_info() -> dict:
    """CPU model name and the flags that matter for matrix products (Linux /proc/cpuinfo; elsewhere what is known)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model in ("", platform.machine(), platform.processor()):
                    model = value.strip()
                    break
    except OSError:
        pass
    flags = cpu_flags()
    return {"model": model, "flags": sorted(f for f in REPORTED_FLAGS if f in flags), "cores": len(available_cores())}


def cpu_flags() -> set[str]:
    """Every flag /proc/cpuinfo lists for the first CPU (empty where there is no such file)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


# ggml's instruction-set options and the /proc/cpuinfo flag each needs (its CMake names, GGML_NATIVE=OFF builds)
GGML_ISA = (("GGML_AVX", "avx"), ("GGML_AVX2", "avx2"), ("GGML_FMA", "fma"), ("GGML_F16C", "f16c"),
            ("GGML_AVX_VNNI", "avx_vnni"), ("GGML_AVX512", "avx512f"), ("GGML_AVX512_VBMI", "avx512vbmi"),
            ("GGML_AVX512_VNNI", "avx512_vnni"), ("GGML_AVX512_BF16", "avx512_bf16"))


def llamacpp_cmake_args(flags: set[str]) -> tuple[str, str]:
    """(CMAKE_ARGS for llama-cpp-python's build, why). A CPU with AMX gets every instruction set it has except AMX:
    ggml's AMX kernels (the buffer that Q4_K/Q8_0 weights are repacked into) crash on the first decode of a quantized
    GGUF on such machines (llama.cpp issue 20824: SIGSEGV in ggml_backend_amx_mul_mat), while the AVX-512 CPU repack
    stays; any other CPU builds for its native instruction sets (ggml's default)."""
    amx = sorted(f for f in flags if f.startswith("amx"))
    if not amx:
        return "", "native build (no AMX on this CPU)"
    isa = [f"-D{opt}={'ON' if flag in flags else 'OFF'}" for opt, flag in GGML_ISA]
    args = " ".join(["-DGGML_NATIVE=OFF", *isa, "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"])
    return args, f"this CPU has {' '.join(amx)}: ggml's AMX kernels left out (they crash on quantized GGUFs), " \
                 "its AVX-512 kernels and CPU repack kept"


def torch_capability() -> str | None:
    try:
        import torch

        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001 - older torch or no torch: not known
        return None


def native_bf16(device: str = "cpu") -> bool:
    """Whether bf16 matrix products are native on `device` (a CUDA GPU with compute capability >= 8, or a CPU flag)."""
    if str(device).startswith("cuda"):
        import torch

        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8
    return any(f in cpu_info()["flags"] for f in NATIVE_BF16_FLAGS)


def resolve_dtype(dtype: str | None, device: str = "cpu") -> str:
    """'auto' (or None) -> 'bfloat16' where native, else 'float32'; any other name is returned unchanged."""
    if dtype in (None, "auto"):
        return "bfloat16" if native_bf16(device) else "float32"
    return dtype


def torch_dtype(dtype, device: str = "cpu"):
    """A torch dtype from a name ("auto" = bf16 where native, else float32) or a torch dtype (returned as is); None
    stays None (from_pretrained then keeps the checkpoint's dtype). An unknown name is a ValueError."""
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    name = resolve_dtype(dtype, device)
    if not isinstance(getattr(torch, str(name), None), torch.dtype):
        raise ValueError(f"dtype {dtype!r}: expected auto or a torch dtype name (float32, bfloat16, float64)")
    return getattr(torch, name)


def available_cores() -> list[int]:
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def pin(cores: list[int]) -> None:
    """Run this process on `cores` with one torch thread per core."""
    import torch

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))


def machine(dtype: str | None = None, threads: int | None = None) -> dict:
    """What a benchmark row or manifest records about the hardware it ran on."""
    out = {"cpu": cpu_info(), "torch_cpu_capability": torch_capability(), "platform": platform.platform()}
    try:
        import torch

        out["torch"] = torch.__version__
        out["threads"] = threads or torch.get_num_threads()
        gpu = gpu_info(torch.cuda)
        if gpu:
            out["gpu"] = gpu
    except Exception:  # noqa: BLE001
        pass
    if dtype is not None:
        out["dtype"] = resolve_dtype(dtype)
    return out


def nvidia_driver() -> str | None:
    """The NVIDIA driver version `nvidia-smi` reports (None where it is absent or fails)."""
    import subprocess

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = out.stdout.strip().splitlines()
    return lines[0].strip() if out.returncode == 0 and lines else None


def gpu_info(cuda, driver=nvidia_driver) -> dict | None:
    """The GPU a row ran beside: model, count, memory, compute capability, driver and torch's CUDA version (`cuda`:
    `torch.cuda` or a stand-in); None on a machine without CUDA, so CPU rows and headers stay as they were."""
    if not cuda.is_available():
        return None
    import torch

    props = cuda.get_device_properties(0)
    major, minor = cuda.get_device_capability(0)
    return {"model": cuda.get_device_name(0), "count": cuda.device_count(),
            "memory_gib": round(props.total_memory / 2**30, 1), "capability": f"{major}.{minor}",
            "driver": driver(), "cuda": torch.version.cuda}


def gpu_line(gpu) -> str:
    """One phrase for a report: "GPU NVIDIA H100 80GB HBM3 (driver 550.54, CUDA 12.8)"; "" without a GPU (rows before
    the GPU was a dict recorded its name only)."""
    if not gpu:
        return ""
    if isinstance(gpu, str):
        return f"GPU {gpu}"
    count = f"{gpu['count']} x " if (gpu.get("count") or 1) > 1 else ""
    return f"GPU {count}{gpu.get('model', '?')} (driver {gpu.get('driver') or '?'}, CUDA {gpu.get('cuda') or '?'})"


def cpu_sample() -> dict:
    """A reading of the clocks a benchmark row is judged by: wall time, this process's CPU time (every thread), the
    whole machine's busy and steal CPU seconds (/proc/stat) and its 1-minute load (/proc/loadavg)."""
    import time

    out = {"t": time.perf_counter(), "own_cpu_s": time.process_time(), "busy_s": None, "steal_s": None, "load": None}
    try:
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        hz = os.sysconf("SC_CLK_TCK")
        # user nice system idle iowait irq softirq steal ...: busy = everything but idle and iowait
        out["busy_s"] = (sum(fields[:8]) - fields[3] - fields[4]) / hz
        out["steal_s"] = fields[7] / hz if len(fields) > 7 else 0.0
        with open("/proc/loadavg") as f:
            out["load"] = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    return out


def cpu_usage(start: dict, end: dict) -> dict:
    """What happened between two `cpu_sample()`s: wall, own CPU, the machine's busy and steal seconds, load."""
    out = {"wall_s": end["t"] - start["t"], "cpu_s": end["own_cpu_s"] - start["own_cpu_s"],
           "machine_cpu_s": None, "steal_s": None, "load_start": start["load"], "load_end": end["load"]}
    if start["busy_s"] is not None and end["busy_s"] is not None:
        out["machine_cpu_s"] = end["busy_s"] - start["busy_s"]
        out["steal_s"] = end["steal_s"] - start["steal_s"]
    return out


__all__ = ["cpu_info", "cpu_flags", "llamacpp_cmake_args", "cpu_sample", "cpu_usage", "native_bf16", "resolve_dtype", "torch_dtype", "available_cores", "pin", "machine"]


if __name__ == "__main__":  # `python -m pipeline.hardware llamacpp-cmake-args`: what make setup-llamacpp builds with
    import sys

    if sys.argv[1:] == ["llamacpp-cmake-args"]:
        args, why = llamacpp_cmake_args(cpu_flags())
        print(f"setup-llamacpp: {why}{': ' + args if args else ''}", file=sys.stderr)
        print(args)
    else:
        sys.exit("usage: python -m pipeline.hardware llamacpp-cmake-args")
