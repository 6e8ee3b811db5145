"""appliance.hardware: no driver -> "cpu"; a (fake) NVML with a GPU -> its name, memory, capability, driver."""
import os
from types import SimpleNamespace

import psutil
import pynvml

from appliance import hardware

GIB = 2**30


def test_no_driver_reports_cpu(monkeypatch):
    def missing():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", missing)
    hw = hardware.detect()
    assert hw.kind == "cpu"
    assert hw.gpus == [] and hw.gpu is None and hw.driver is None
    assert "NVML library was not found" in hw.reason
    assert (hw.cpu_cores, hw.total_memory) == (len(os.sched_getaffinity(0)), psutil.virtual_memory().total)


def test_driver_not_loaded_reports_cpu(monkeypatch):
    def not_loaded():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)

    monkeypatch.setattr(pynvml, "nvmlInit", not_loaded)
    hw = hardware.detect()
    assert hw.kind == "cpu" and "NVML failed to start" in hw.reason


class FakeNVML:
    """pynvml's functions for one H200-like GPU; the error classes are pynvml's own."""

    NVMLError = pynvml.NVMLError
    NVMLError_LibraryNotFound = pynvml.NVMLError_LibraryNotFound

    def __init__(self, count=1):
        self.count = count
        self.shut_down = False

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        self.shut_down = True

    def nvmlDeviceGetCount(self):
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H200"

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=141 * GIB, free=140 * GIB, used=GIB)

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return (9, 0)

    def nvmlSystemGetDriverVersion(self):
        return "580.65.06"

    def nvmlSystemGetCudaDriverVersion(self):
        return 13000


def test_gpu_fields_from_nvml():
    nvml = FakeNVML()
    hw = hardware.detect(nvml)
    assert hw.kind == "cuda"
    assert hw.gpu == hardware.GPU(index=0, name="NVIDIA H200", total_memory=141 * GIB, free_memory=140 * GIB,
                                  compute_capability="9.0")
    assert (hw.driver, hw.cuda_driver, hw.reason) == ("580.65.06", "13.0", None)
    assert nvml.shut_down
    assert hw.to_dict()["gpus"][0]["name"] == "NVIDIA H200"


def test_driver_without_gpu_is_cpu():
    hw = hardware.detect(FakeNVML(count=0))
    assert hw.kind == "cpu" and hw.driver == "580.65.06" and "no GPU" in hw.reason


class TuringNVML(FakeNVML):
    def nvmlDeviceGetName(self, h):
        return b"Tesla T4"

    def nvmlDeviceGetCudaComputeCapability(self, h):
        return (7, 5)


def test_gpu_older_than_ampere_is_cpu_with_the_reason():
    """The kernels need compute capability 8.0 (ptxas refuses them for sm_75: tests/test_compile_targets.py): a
    Turing GPU is listed, but the machine serves on the CPU, and the report says why."""
    hw = hardware.detect(TuringNVML())
    assert hw.kind == "cpu" and hw.gpu.name == "Tesla T4"
    assert hw.reason == "Tesla T4 has compute capability 7.5; the engine's kernels need 8.0+ (Ampere or newer)"


ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 avx512_vnni
processor\t: 1
flags\t\t: fpu
"""
SKYLAKE = "model name\t: Intel(R) Xeon(R) Gold 6148\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_vnni\n"
SAPPHIRE_RAPIDS = "flags\t\t: avx512f amx_bf16 amx_tile amx_int8\n"
GRAVITON3 = "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd sve bf16 i8mm\n"
GRAVITON2 = "processor\t: 0\nFeatures\t: fp asimd aes crc32 atomics\n"


def test_bf16_instructions_are_read_from_cpuinfo():
    """Exact flag names only: avx512_vnni or a "bf16" inside another word is not bfloat16 support."""
    assert hardware.cpu_bf16_flags(ZEN4) and hardware.cpu_bf16_flags(SAPPHIRE_RAPIDS)
    assert hardware.cpu_bf16_flags(GRAVITON3)
    assert not hardware.cpu_bf16_flags(SKYLAKE) and not hardware.cpu_bf16_flags(GRAVITON2)
    assert not hardware.cpu_bf16_flags("flags\t\t: fpu avx512_bf16x\n")
    assert not hardware.cpu_bf16_flags("")  # no /proc/cpuinfo


def test_the_host_report_carries_the_cpus_bf16_support(monkeypatch):
    monkeypatch.setattr(hardware, "_cpuinfo", lambda: ZEN4)
    assert hardware.host()["cpu_bf16"] is True and hardware.host()["cpu_name"] == "AMD EPYC 9R14"
    monkeypatch.setattr(hardware, "_cpuinfo", lambda: SKYLAKE)
    assert hardware.host()["cpu_bf16"] is False
