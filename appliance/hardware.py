"""Accelerator detection through NVML (nvidia-ml-py's ``pynvml``), with the CPU as the fallback.

Without an NVIDIA driver ``pynvml.nvmlInit()`` raises ``NVMLError_LibraryNotFound`` (or ``DriverNotLoaded``):
the machine is then reported as ``kind == "cpu"`` with the reason, never as an error.
"""
from __future__ import annotations

import os
import platform
from dataclasses import asdict, dataclass, field

import psutil

from engine.config import MIN_CAPABILITY


@dataclass
class GPU:
    index: int
    name: str
    total_memory: int  # bytes
    free_memory: int  # bytes
    compute_capability: str  # "9.0"

    @property
    def capability(self) -> tuple[int, int]:
        """``compute_capability`` as (major, minor), comparable with ``engine.config.MIN_CAPABILITY``."""
        major, minor = self.compute_capability.split(".")
        return int(major), int(minor)


@dataclass
class Hardware:
    """What ``appliance detect`` reports. ``kind`` is "cuda" or "cpu"; ``reason`` says why it is "cpu"."""

    kind: str
    gpus: list[GPU] = field(default_factory=list)
    driver: str | None = None
    cuda_driver: str | None = None
    cpu_name: str = ""
    cpu_cores: int = 1
    total_memory: int = 0  # host RAM, bytes
    available_memory: int = 0
    cpu_bf16: bool = False  # the CPU multiplies bfloat16 in hardware (cpu_bf16_flags)
    reason: str | None = None

    @property
    def gpu(self) -> GPU | None:
        """The GPU the engine uses (the first one)."""
        return self.gpus[0] if self.gpus else None

    def to_dict(self) -> dict:
        return asdict(self)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


#: /proc/cpuinfo flags of CPUs with bfloat16 multiply instructions: x86 AVX512_BF16 (Intel Cooper Lake and
#: Sapphire Rapids on, AMD Zen 4 on) and AMX-BF16 (Sapphire Rapids on); Arm's BF16 extension (Armv8.6-A:
#: Graviton 3, Neoverse V1/N2). Without them oneDNN emulates bf16 matmuls, slower than float32.
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def _cpuinfo() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def _cpu_name(cpuinfo: str) -> str:
    for line in cpuinfo.splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_bf16_flags(cpuinfo: str) -> bool:
    """Whether ``cpuinfo`` (the text of /proc/cpuinfo) lists one of :data:`CPU_BF16_FLAGS` on its first
    ``flags`` (x86) or ``Features`` (Arm) line; False when there is none (not Linux)."""
    for line in cpuinfo.splitlines():
        if line.startswith(("flags", "Features")):
            return any(flag in CPU_BF16_FLAGS for flag in line.split(":", 1)[1].split())
    return False


def host() -> dict:
    """The CPU and host memory part of the report."""
    mem = psutil.virtual_memory()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    info = _cpuinfo()
    return {"cpu_name": _cpu_name(info), "cpu_cores": cores, "total_memory": mem.total,
            "available_memory": mem.available, "cpu_bf16": cpu_bf16_flags(info)}


def detect(nvml=None) -> Hardware:
    """Find the NVIDIA GPUs; ``nvml`` is the ``pynvml`` module (or a stand-in with the same functions, in tests)."""
    if nvml is None:
        import pynvml as nvml
    try:
        nvml.nvmlInit()
    except nvml.NVMLError_LibraryNotFound:
        return Hardware(kind="cpu", reason="no NVIDIA driver: the NVML library was not found", **host())
    except nvml.NVMLError as exc:
        return Hardware(kind="cpu", reason=f"NVML failed to start: {exc}", **host())
    try:
        gpus = []
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
            gpus.append(GPU(index=i, name=_text(nvml.nvmlDeviceGetName(handle)), total_memory=int(mem.total),
                            free_memory=int(mem.free), compute_capability=f"{major}.{minor}"))
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        try:
            cuda = nvml.nvmlSystemGetCudaDriverVersion()
            cuda_driver = f"{cuda // 1000}.{cuda % 1000 // 10}"
        except nvml.NVMLError:
            cuda_driver = None
    except nvml.NVMLError as exc:
        return Hardware(kind="cpu", reason=f"NVML query failed: {exc}", **host())
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass
    if not gpus:
        return Hardware(kind="cpu", driver=driver, cuda_driver=cuda_driver, reason="the driver reports no GPU",
                        **host())
    first = gpus[0]
    if first.capability < MIN_CAPABILITY:
        return Hardware(kind="cpu", gpus=gpus, driver=driver, cuda_driver=cuda_driver,
                        reason=f"{first.name} has compute capability {first.compute_capability}; the engine's "
                               f"kernels need {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}+ (Ampere or newer)", **host())
    return Hardware(kind="cuda", gpus=gpus, driver=driver, cuda_driver=cuda_driver, **host())


def gib(n: int | float) -> str:
    return f"{n / 2**30:.1f} GiB"
