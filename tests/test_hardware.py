"""pipeline/hardware.py's build choice for llama.cpp: on a CPU with AMX, every instruction set it has but AMX (ggml's
AMX kernels crash on quantized GGUFs there); elsewhere the native build."""

import subprocess
import sys

from pipeline.hardware import GGML_ISA, llamacpp_cmake_args

SAPPHIRE_RAPIDS = {"avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512vbmi", "avx512_vnni", "avx512_bf16",
                   "amx_tile", "amx_int8", "amx_bf16"}


def test_an_amx_cpu_builds_without_amx_and_keeps_its_avx512():
    args, why = llamacpp_cmake_args(SAPPHIRE_RAPIDS)
    opts = dict(a.removeprefix("-D").split("=") for a in args.split())
    assert opts["GGML_NATIVE"] == "OFF"
    assert opts["GGML_AMX_TILE"] == opts["GGML_AMX_INT8"] == opts["GGML_AMX_BF16"] == "OFF"
    assert all(opts[opt] == "ON" for opt, _ in GGML_ISA)  # this CPU has every one of them
    assert "amx_bf16 amx_int8 amx_tile" in why


def test_an_avx2_only_amx_cpu_gets_no_avx512_and_other_cpus_build_natively():
    opts = dict(a.removeprefix("-D").split("=") for a in llamacpp_cmake_args({"avx", "avx2", "fma", "f16c",
                                                                                "amx_tile"})[0].split())
    assert opts["GGML_AVX2"] == "ON" and opts["GGML_AVX512"] == "OFF" and opts["GGML_AMX_INT8"] == "OFF"
    assert llamacpp_cmake_args({"avx2", "avx512f", "avx512_bf16"}) == ("", "native build (no AMX on this CPU)")


def test_the_command_line_prints_the_args_and_says_why():
    done = subprocess.run([sys.executable, "-m", "pipeline.hardware", "llamacpp-cmake-args"], capture_output=True,
                          text=True, check=True)
    assert done.stderr.startswith("setup-llamacpp: ")
