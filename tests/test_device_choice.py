"""engine.model_runner's device choice: "auto" takes an Ampere or newer GPU, else the CPU; a GPU older than the
kernels' compute capability 8.0 named outright is refused with the fix (torch.cuda stood in for: no GPU here).
And the compute dtype "auto" picks for a checkpoint on each device (vLLM's rule on CUDA)."""
import pytest
import torch

from engine.config import checkpoint_dtype, compute_dtype
from engine.model_runner import resolve_device, resolve_dtype, resolve_kv_dtype


@pytest.fixture
def gpu(monkeypatch):
    """A fake CUDA device 0 of the capability set in the returned dict."""
    state = {"capability": (8, 6), "name": "NVIDIA GeForce RTX 3090"}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: state["capability"])
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: state["name"])
    return state


def test_auto_takes_an_ampere_gpu(gpu):
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:0") == torch.device("cuda:0")


def test_turing_gpu_auto_is_cpu_and_cuda_is_refused(gpu):
    gpu.update(capability=(7, 5), name="Tesla T4")
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(RuntimeError, match=r"Tesla T4 has compute capability 7\.5; the kernels need 8\.0\+ "
                                           r"\(Ampere or newer\): use device='cpu'"):
        resolve_device("cuda")


def test_no_cuda_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(RuntimeError, match="sees no CUDA device"):
        resolve_device("cuda")


def test_fp8_kv_needs_ada(gpu):
    assert resolve_kv_dtype("int8", torch.bfloat16, torch.device("cuda")) == torch.int8
    with pytest.raises(ValueError, match=r"fp8 needs compute capability 8\.9\+.*this GPU has 8\.6"):
        resolve_kv_dtype("fp8", torch.bfloat16, torch.device("cuda"))
    gpu.update(capability=(8, 9))
    assert resolve_kv_dtype("fp8", torch.bfloat16, torch.device("cuda")) == torch.float8_e4m3fn


def test_auto_dtype_follows_the_checkpoint_on_cuda_and_is_float32_on_cpu():
    # an AWQ checkpoint as gptqmodel writes it (transformers 5's "dtype"), an older one ("torch_dtype"), a bf16 one
    # inside a multimodal config's text_config, a float32 one and one naming nothing
    configs = [({"dtype": "float16"}, "float16"), ({"torch_dtype": "bfloat16"}, "bfloat16"),
               ({"text_config": {"torch_dtype": "bfloat16"}}, "bfloat16"), ({"torch_dtype": "float32"}, "bfloat16"),
               ({"torch_dtype": "int8"}, "bfloat16"), ({}, "bfloat16")]
    for cfg, on_cuda in configs:
        named = checkpoint_dtype(cfg)
        assert compute_dtype("auto", "cuda", named) == on_cuda, cfg
        assert compute_dtype("auto", "cpu", named) == "float32", cfg
        assert compute_dtype("bfloat16", "cuda", named) == "bfloat16"  # a setting is itself
        assert compute_dtype("float16", "cpu", named) == "float16"
    assert checkpoint_dtype({"torch_dtype": "int8"}) is None and checkpoint_dtype({"dtype": "float32"}) == "float32"
    assert resolve_dtype("auto", torch.device("cuda"), {"dtype": "float16"}) == torch.float16
    assert resolve_dtype("auto", torch.device("cpu"), {"dtype": "float16"}) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cuda"), {"dtype": "float16"}) == torch.bfloat16
