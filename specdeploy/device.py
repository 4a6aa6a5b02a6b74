"""Where compute runs: `--device auto|cpu|cuda|cuda:N`, and the dtypes that fit the device.

Every stage that computes takes a device through `add_device_arg` and turns it into a
`torch.device` with `resolve_device`; nothing else in the project decides where tensors live.
`auto` is CUDA when torch sees a GPU, else the CPU.
"""

from __future__ import annotations

import argparse
import os
import re
from typing import TYPE_CHECKING

from specdeploy.errors import SpecDeployError

if TYPE_CHECKING:
    import torch

DEVICE_HELP = "where to compute: auto (CUDA when torch sees a GPU, else CPU), cpu, cuda or cuda:N"


def add_device_arg(parser: argparse.ArgumentParser, default: str = "auto") -> None:
    parser.add_argument("--device", default=default, type=check_device_spec, help=DEVICE_HELP)


def check_device_spec(spec: str) -> str:
    """argparse type: the spelling is checked at parse time, availability when resolved."""
    spec = spec.strip().lower()
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", spec):
        raise argparse.ArgumentTypeError(f"'{spec}' is not a device; use auto, cpu, cuda or cuda:N")
    return spec


def resolve_device(spec: "str | torch.device | None" = "auto") -> "torch.device":
    """auto|cpu|cuda|cuda:N (or a torch.device) -> torch.device, refusing a GPU torch cannot see."""
    import torch

    if isinstance(spec, torch.device):
        return spec
    spec = check_device_spec(spec or "auto")
    if spec == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if spec == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SpecDeployError(
            f"--device {spec}: torch {torch.__version__} sees no CUDA device here",
            hint="use --device cpu (or auto), or run on a GPU host with a CUDA build of torch",
        )
    device = torch.device(spec)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        raise SpecDeployError(f"--device {spec}: only {torch.cuda.device_count()} CUDA device(s) are visible",
                              hint="pick an index below that, or check CUDA_VISIBLE_DEVICES")
    return torch.device("cuda", index)


def describe(device: "torch.device") -> str:
    """One line for logs and manifests: 'cuda:0 (NVIDIA H100 80GB HBM3)' / 'cpu (2 threads)'."""
    import torch

    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return f"cpu ({torch.get_num_threads()} threads)"


def announce(stage: str, device: "torch.device") -> str:
    """Print which device a stage computes on (every stage says so) and return the description."""
    import sys

    text = describe(device)
    print(f"specdeploy {stage}: computing on {text}", file=sys.stderr)
    return text


def frozen_dtype(device: "torch.device") -> "torch.dtype":
    """The dtype of a frozen base model that only feeds training/calibration: bf16 on a GPU
    (half the memory of fp32, tensor cores); float32 on the CPU, where the bf16 path is exact
    only at the price of slow kernels on machines without AMX."""
    import torch

    return torch.bfloat16 if device.type == "cuda" else torch.float32


def native_bf16(device: "torch.device") -> bool:
    """Whether `device` multiplies bf16 natively. CUDA (Ampere and newer) and CPUs with AVX512-BF16,
    AMX or Arm's BF16 do; elsewhere torch's CPU bf16 GEMM is emulated: measured on an AVX2-only
    EPYC, a 32-token forward of SmolLM2-135M took 4.3x its fp32 time. SPECDEPLOY_CPU_BF16=1/0
    overrides the CPU check."""
    import torch

    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    forced = os.environ.get("SPECDEPLOY_CPU_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"})


def _cpuinfo() -> str:
    """Linux /proc/cpuinfo ("" elsewhere)."""
    try:
        return open("/proc/cpuinfo", encoding="utf-8", errors="replace").read()
    except OSError:
        return ""


def _cpu_field(text: str, *names: str) -> str:
    found = re.search(rf"^(?:{'|'.join(names)})\s*:(.*)$", text, re.MULTILINE)
    return found.group(1).strip() if found else ""


def cpu_flags() -> set[str]:
    """The CPU's feature flags (x86 "flags", Arm "Features"); empty where there is no cpuinfo."""
    return set(_cpu_field(_cpuinfo(), "flags", "Features").split())


def cpu_amx() -> bool:
    """Whether the CPU multiplies bf16 matrices with Intel AMX (`amx_bf16`): on a Xeon with it a
    1,024 x 576 by 576 x 1,536 bf16 product took 1.8-2.4 ms, 11-20 ms with oneDNN held to AVX512-BF16
    (2026-11-27); a one-row product, a decode step's shape, was the same either way."""
    return "amx_bf16" in cpu_flags()


def mkl_code_path(cpuinfo: str) -> str | None:
    """The MKL_CBWR value for a CPU described by /proc/cpuinfo text, None to leave MKL alone.

    PyTorch's CPU wheel multiplies float32 with Intel MKL, whose default dispatch on an AMD CPU
    takes a slow path for products of a few rows, the shape speculative verification lives on.
    Measured on an AMD EPYC (AVX2, 2 threads), SmolLM2-135M: verifying 4 or 8 tokens took 1.6-2.4x
    a one-token step by default and 1.1-1.4x with MKL_CBWR=AVX2 (MKL's switch to its AVX2 code
    path); the one-token step stayed as it was. Intel CPUs keep MKL's own choice."""
    vendor = _cpu_field(cpuinfo, "vendor_id")
    if vendor in ("AuthenticAMD", "HygonGenuine") and "avx2" in _cpu_field(cpuinfo, "flags").split():
        return "AVX2"
    return None


def tune_cpu_blas(environ: "os._Environ[str] | dict[str, str]" = os.environ) -> None:
    """Set MKL_CBWR (see `mkl_code_path`) unless the user did. MKL reads it once, at its first
    call: specdeploy sets it on import, and the tritonserver it starts inherits it."""
    if "MKL_CBWR" not in environ:
        value = mkl_code_path(_cpuinfo())
        if value:
            environ["MKL_CBWR"] = value


def fast_dtype(device: "torch.device") -> str:
    """The quickest dtype a model can compute in on `device` without losing range: bfloat16 where
    it is native, float32 where bf16 would be emulated."""
    return "bfloat16" if native_bf16(device) else "float32"


def world() -> tuple[int, int]:
    """(rank, world_size) under torchrun / accelerate launch; (0, 1) when run alone."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
