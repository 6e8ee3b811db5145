"""Programmatic dependent launch (kernels/_triton.py): when kernels launch with it, and that every kernel that can
be launched with it waits for the previous kernel before it writes anything or enters its loop, and lets the next
one launch once, after its main loop. On a GPU the kernel tests and the engine's graphs = eager = torch reference rows
run with PDL on (bench/gpu_suite.py)."""
import ast
import inspect
import textwrap
from types import SimpleNamespace

import pytest
import torch

from kernels import _triton, activation, kv_cache, norm, paged_attention, rotary, split_k, w4a16, w4a16_mma

MODULES = (activation, kv_cache, norm, paged_attention, rotary, split_k, w4a16, w4a16_mma)
WRITES = {"store", "atomic_add", "atomic_xchg", "atomic_cas", "atomic_max", "atomic_min", "_store_tile", "_store"}
# the W4A16 kernels' loads of x; the loads of split-K partial sums (the product before)
ACTIVATION_READS = {"_load_x", "_load_x_f32", "_fetch_x", "_fetch_xs", "sum_splits", "load_splits", "load_pair"}


def _kernels():
    return [(m.__name__, name, obj) for m in MODULES for name, obj in vars(m).items()
            if isinstance(obj, _triton.Kernel)]


def test_pdl_needs_hopper_a_cuda_tensor_and_no_opt_out(monkeypatch):
    on_gpu = SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.delenv("APPLIANCE_PDL", raising=False)
    monkeypatch.setattr(_triton, "_cuda_capability", lambda index: (9, 0))
    assert _triton.pdl(on_gpu) is True
    assert _triton.pdl(torch.zeros(1)) is False  # CPU: interpreted
    monkeypatch.setenv("APPLIANCE_PDL", "0")
    assert _triton.pdl(on_gpu) is False
    monkeypatch.delenv("APPLIANCE_PDL")
    monkeypatch.setattr(_triton, "_cuda_capability", lambda index: (8, 9))  # Ada: no griddepcontrol
    assert _triton.pdl(on_gpu) is False


def test_early_trigger_needs_pdl_and_no_opt_out(monkeypatch):
    on_gpu = SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.delenv("APPLIANCE_PDL", raising=False)
    monkeypatch.delenv("APPLIANCE_PDL_TRIGGER", raising=False)
    monkeypatch.setattr(_triton, "_cuda_capability", lambda index: (9, 0))
    assert _triton.early_trigger(on_gpu) is True
    with _triton.without_early_trigger():
        assert _triton.early_trigger(on_gpu) is False
        assert _triton.pdl(on_gpu) is True  # the wait stays
    assert _triton.early_trigger(on_gpu) is True
    with _triton.without_pdl():
        assert _triton.early_trigger(on_gpu) is False
    assert _triton.early_trigger(torch.zeros(1)) is False


@pytest.mark.parametrize("before", [None, "1"])
def test_without_pdl_turns_it_off_and_restores_the_variable(monkeypatch, before):
    on_gpu = SimpleNamespace(device=torch.device("cuda", 0))
    monkeypatch.setattr(_triton, "_cuda_capability", lambda index: (9, 0))
    if before is None:
        monkeypatch.delenv("APPLIANCE_PDL", raising=False)
    else:
        monkeypatch.setenv("APPLIANCE_PDL", before)
    with _triton.without_pdl():
        assert _triton.pdl(on_gpu) is False
    assert _triton.os.environ.get("APPLIANCE_PDL") == before
    assert _triton.pdl(on_gpu) is True


class _Recorder:
    """Stands in for a compiled Triton kernel: records the launch options it is given."""

    def __init__(self):
        self.meta = None

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.meta = meta
        return launch


@pytest.mark.parametrize("flag", [True, False])
def test_launch_pdl_follows_the_pdl_constexpr(flag):
    pytest.importorskip("triton")
    kernel = _triton.Kernel(lambda x, PDL: None)
    kernel._compiled = _Recorder()
    kernel[(1,)](3, PDL=flag)  # no CPU tensor among the arguments: the compiled path
    assert kernel._compiled.meta.get("launch_pdl", False) is flag
    assert kernel._compiled.meta["PDL"] is flag


@pytest.mark.parametrize("given", [None, False])
def test_compiled_launches_fuse_fp_unless_the_kernel_says_not(given):
    """Triton 3.10 turns its FP-fusion default off: compiled launches ask for it explicitly (the rounding every
    kernel was measured with), and a launch that passes False (the torch-rounding kernels) keeps False."""
    pytest.importorskip("triton")
    kernel = _triton.Kernel(lambda x: None)
    kernel._compiled = _Recorder()
    kernel[(1,)](3, **({} if given is None else {"enable_fp_fusion": given}))
    assert kernel._compiled.meta["enable_fp_fusion"] is (given is None)


def _is_wait(stmt) -> bool:
    return (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
            and getattr(stmt.value.func, "id", None) == "pdl_wait"
            and [getattr(a, "id", None) for a in stmt.value.args] == ["PDL"])


def _is_exit(stmt) -> bool:
    """``if <condition>: return``, nothing else: the program leaves, having written nothing."""
    return (isinstance(stmt, ast.If) and not stmt.orelse and len(stmt.body) == 1
            and isinstance(stmt.body[0], ast.Return) and stmt.body[0].value is None)


def _called(node) -> set[str]:
    return {getattr(n.func, "attr", getattr(n.func, "id", None)) for n in ast.walk(node) if isinstance(n, ast.Call)}


def _wait_problem(fn: ast.FunctionDef) -> str | None:
    """Why ``fn``'s pdl_wait is misplaced, or None: one statement of the body, with no write, branch, loop or read
    of x (a previous kernel's output, through the helpers in ACTIVATION_READS) before it; but a program with nothing
    to do may leave before it (``if <condition>: return``). That a plain ``tl.load`` before the wait reads only
    step inputs is the kernel's own claim (kernels/_triton.py), not checked here."""
    if "PDL" not in [a.arg for a in fn.args.args]:
        return "no PDL constexpr"
    waits = [i for i, stmt in enumerate(fn.body) if _is_wait(stmt)]
    if len(waits) != 1:
        return "pdl_wait(PDL) must be one statement of the kernel's body"
    for stmt in fn.body[:waits[0]]:
        if _is_exit(stmt):
            stmt = stmt.test
        if any(isinstance(n, (ast.For, ast.While, ast.If, ast.Return)) for n in ast.walk(stmt)):
            return f"a branch or loop before the wait (line {stmt.lineno})"
        if _called(stmt) & WRITES:
            return f"a write before the wait (line {stmt.lineno})"
        if _called(stmt) & ACTIVATION_READS:
            return f"x (a previous kernel's output) read before the wait (line {stmt.lineno})"
    return None


def _kernel_def(kernel) -> ast.FunctionDef:
    """The parsed ``def`` of a kernel's Python source."""
    return ast.parse(textwrap.dedent(inspect.getsource(kernel.fn))).body[0]


@pytest.mark.parametrize("module,name,kernel", _kernels(), ids=[f"{m}.{n}" for m, n, _ in _kernels()])
def test_each_kernel_waits_at_top_level_before_any_write_branch_or_loop(module, name, kernel):
    problem = _wait_problem(_kernel_def(kernel))
    assert problem is None, f"{module}.{name}: {problem}"


@pytest.mark.parametrize("body,problem", [
    ("n = tl.load(n_ptr)\nif n == 0:\n    return\npdl_wait(PDL)\ntl.store(y_ptr, n)", None),  # an early exit
    ("n = tl.load(n_ptr)\nif n == 0:\n    tl.store(y_ptr, n)\npdl_wait(PDL)",
     "a branch or loop before the wait (line 3)"),
    ("n = tl.load(n_ptr)\nif n == 0:\n    return\nelse:\n    n = 1\npdl_wait(PDL)",
     "a branch or loop before the wait (line 3)"),
    ("if tl.atomic_add(n_ptr, 1) == 0:\n    return\npdl_wait(PDL)", "a write before the wait (line 2)"),
    ("if _load_x(x_ptr) == 0:\n    return\npdl_wait(PDL)",
     "x (a previous kernel's output) read before the wait (line 2)"),
    ("tl.store(y_ptr, 1)\npdl_wait(PDL)", "a write before the wait (line 2)"),
    ("n = tl.load(n_ptr)\nif n == 0:\n    pdl_wait(PDL)", "pdl_wait(PDL) must be one statement of the kernel's body"),
])
def test_the_wait_rule_allows_only_early_exits_before_the_wait(body, problem):
    fn = ast.parse("def k(x_ptr, n_ptr, y_ptr, PDL):\n" + textwrap.indent(body, "    ")).body[0]
    assert _wait_problem(fn) == problem


LOADS = {"load", "_load_tile", "_fetch_w", "_kv_tile", "_kv_tiles"} | ACTIVATION_READS  # a kernel's reads of memory


def _trigger_problem(fn: ast.FunctionDef) -> str | None:
    """Why ``fn``'s pdl_trigger is misplaced, or None: it must be one statement of the body, after the wait, right
    after the main loop or the last loads (triggering at the start of each program measured up to 1.6x slower; after
    the stores it would change nothing)."""
    if "TRIG" not in [a.arg for a in fn.args.args]:
        return "no TRIG constexpr"
    calls = [(i, n) for i, stmt in enumerate(fn.body) for n in ast.walk(stmt)
             if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "pdl_trigger"]
    if len(calls) != 1:
        return f"{len(calls)} pdl_trigger calls, not one"
    at, call = calls[0]
    if not (isinstance(fn.body[at], ast.Expr) and fn.body[at].value is call):
        return "pdl_trigger in a branch or loop"
    if [getattr(a, "id", None) for a in call.args] != ["TRIG"]:
        return "not pdl_trigger(TRIG)"
    if not any(_is_wait(stmt) for stmt in fn.body[:at]):
        return "the trigger comes before the wait"
    if not _called(fn.body[at - 1]) & LOADS:
        return "the statement before the trigger is neither the main loop nor a load"
    return None


@pytest.mark.parametrize("module,name,kernel", _kernels(), ids=[f"{m}.{n}" for m, n, _ in _kernels()])
def test_each_kernel_triggers_its_dependents_once_after_its_wait_and_loop(module, name, kernel):
    problem = _trigger_problem(_kernel_def(kernel))
    assert problem is None, f"{module}.{name}: {problem}"


@pytest.mark.parametrize("body,problem", [
    ("pdl_wait(PDL)\nacc = ()\nfor b in tl.static_range(2):\n    acc = acc + (b,)\npdl_trigger(TRIG)\n"
     "for k0 in range(0, 64, 16):\n    acc = acc + (tl.load(x_ptr + k0),)",
     "the statement before the trigger is neither the main loop nor a load"),  # behind a set-up loop
    ("pdl_wait(PDL)\npdl_trigger(TRIG)\nx = tl.load(x_ptr)",
     "the statement before the trigger is neither the main loop nor a load"),
    ("pdl_wait(PDL)\nx = tl.load(x_ptr)\nif SPLIT:\n    pdl_trigger(TRIG)", "pdl_trigger in a branch or loop"),
    ("x = tl.load(x_ptr)\npdl_trigger(TRIG)\npdl_wait(PDL)", "the trigger comes before the wait"),
])
def test_the_trigger_rule_rejects_misplaced_triggers(body, problem):
    fn = ast.parse("def k(x_ptr, SPLIT, PDL, TRIG):\n" + textwrap.indent(body, "    ")).body[0]
    assert _trigger_problem(fn) == problem


def test_the_kernel_list_is_complete_and_every_launch_passes_pdl():
    assert len(_kernels()) == 13
    for module in MODULES:
        src = inspect.getsource(module)
        assert src.count("_kernel[") == src.count("PDL=pdl("), f"{module.__name__}: a launch without PDL=pdl(...)"
        assert src.count("_kernel[") == src.count("TRIG=early_trigger("), \
            f"{module.__name__}: a launch without TRIG=early_trigger(...)"
