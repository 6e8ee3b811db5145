"""Ready the SmolLM2 demo checkpoint for the GPU suite's ``smollm2_rows``: the CPU engine's greedy tokens
(``expected.json``: fp32, and bf16 as the rule's control) and the checkpoint in two parts, each small enough for
one device call (64 MiB a call).

    python bench/smollm2_parts.py [AWQ_DIR]   # default: the checkpoint `appliance install` quantized last

AWQ_DIR is a quantized checkpoint folder (``appliance install --yes`` leaves one under
``$XDG_DATA_HOME/appliance/models/``). Writes ``.cache/smolA`` and ``.cache/smolB`` (git-ignored) and prints the
two device commands: the first carries part A to ``/tmp/smol`` on the GPU machine, the second (within the
machine's idle window) carries part B, joins the weights and runs the rows (bench/RESULTS.md, run 62). It also
prints what room each call leaves: the structured-output rows need xgrammar there, whose wheels
(:data:`XGRAMMAR_WHEELS`, about 7.1 MiB) fit beside part A only (the first call then installs them into
``/tmp/site``, which the second finds while the machine stays warm).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: The prompts of the rows (8 x 32 greedy tokens, issue 3).
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def fibonacci(n):",
           "Explain what a GPU does in one sentence.", "List three colors:", "Once upon a time,",
           "The quick brown fox", "What is 12 times 7?"]
#: The structured-output check (issue 3 asks for greedy equality; structured outputs ride on it): chat questions
#: answered under :data:`SCHEMA`, greedy, up to 64 tokens.
QUESTIONS = ["Is Paris in France? Answer in JSON.", "Is the sea dry? Answer in JSON.",
             "Can a cat fly? Give your answer and a short reason.", "Is 12 times 7 equal to 84?"]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "enum": ["yes", "no"]},
                                           "reason": {"type": "string", "maxLength": 60}},
          "required": ["answer", "reason"], "additionalProperties": False}
PART_BYTES = 57_000_000  # part A's share of model.safetensors; part B takes the rest and tokenizer.json
CARRY_LIMIT = 64 << 20  # what one device call carries: the files that travel and the carried paths
CALL_BYTES = CARRY_LIMIT - (2 << 20)  # what one part may take: the repository's files travel with it
#: The wheels the structured-output rows need on the GPU machine (its image has none of them; versions as pip
#: resolves them here, downloaded with the device README's recipe into a git-ignored folder)
XGRAMMAR_WHEELS = ("xgrammar", "apache-tvm-ffi", "pydantic", "pydantic-core", "annotated-types", "typing-inspection",
                   "typing-extensions")


def travel_bytes(root: Path = ROOT) -> int:
    """Bytes of the files a device call sends from the repository at ``root`` besides its carried paths: the
    tracked files and the untracked ones git does not ignore (as they are on disk). CalledProcessError if ``root``
    is not a git work tree."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         check=True, capture_output=True).stdout
    files = {root / name for name in out.decode().split("\0") if name}
    return sum(f.stat().st_size for f in files if f.is_file())


def folder_bytes(folder: Path) -> int:
    """Bytes of the files under ``folder`` (0 if it does not exist)."""
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def latest_checkpoint() -> Path:
    """The newest SmolLM2 ``*-awq-*`` folder the installer wrote (its data folder: ``appliance.config.data_dir``,
    the user's or the system's). Raises SystemExit when there is none."""
    from appliance import config as cfgmod
    found = []
    for base in {cfgmod.data_dir() / "models", cfgmod.data_dir(system=True) / "models"}:
        found += base.glob("SmolLM2-*-awq-*")
    found.sort(key=lambda p: p.stat().st_mtime)
    base = cfgmod.data_dir() / "models"
    if not found:
        raise SystemExit(f"no SmolLM2 AWQ checkpoint under {base}: run `appliance install --yes` first, or pass one")
    return found[-1]


def expected_tokens(model: Path) -> dict:
    """The CPU engine's (fp32) greedy tokens for :data:`PROMPTS`, 32 each, and at each step its two largest raw
    logits (``top_logits``: what ``engine_bench.divergence_report`` measures a near-tie by), one prompt at a time
    so that each LM-head call is that prompt's step."""
    import torch

    from engine import LLM, SamplingParams
    llm = LLM(str(model), device="cpu")
    model_ = llm.engine.runner.model
    real = model_.compute_logits
    tokens, tops = [], []
    for prompt in PROMPTS:
        seen: list[list[float]] = []

        def watched(hidden: torch.Tensor, seen=seen) -> torch.Tensor:
            logits = real(hidden)
            seen.append(torch.topk(logits[-1], 2).values.tolist())
            return logits

        model_.compute_logits = watched
        try:
            out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))[0]
        finally:
            del model_.compute_logits
        tokens.append(out.outputs[0].token_ids)
        tops.append(seen)
    assert all(len(t) == 32 for t in tops), [len(t) for t in tops]
    return {"prompts": PROMPTS, "tokens": tokens, "top_logits": tops, "structured": structured_tokens(llm),
            "bf16_cpu": bf16_control(model)}


def bf16_control(model: Path) -> dict:
    """The same greedy run on the CPU torch reference in bfloat16: how far bf16 arithmetic alone moves the tokens
    from the fp32 ones (the yardstick of the near-tie rule; ``engine_bench.control_row``): {"tokens", "top_logprobs"
    (each step's two largest logprobs)}."""
    from engine import LLM, SamplingParams
    llm = LLM(str(model), device="cpu", dtype="bfloat16")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2))
    return {"tokens": [o.outputs[0].token_ids for o in outs],
            "top_logprobs": [[sorted(step.values(), reverse=True)[:2] for step in o.outputs[0].logprobs]
                             for o in outs]}


def structured_tokens(llm) -> dict:
    """The CPU engine's greedy outputs for :data:`QUESTIONS` (chat-formatted here, the texts stored) under
    :data:`SCHEMA`, one question at a time, and at each step the two largest logits the grammar allows (after
    ``apply_masks``: a near-tie between two valid tokens is what ``engine_bench.divergence_report`` allows; the
    second is -inf where the grammar allowed one token, written as JSON's non-standard -Infinity, which Python's
    json reads back): {"schema", "prompts", "tokens", "texts", "top_logits"}."""
    import torch

    from engine import SamplingParams, StructuredOutputsParams
    from engine import model_runner
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
               for q in QUESTIONS]
    params = SamplingParams(temperature=0, max_tokens=64, structured_outputs=StructuredOutputsParams(json=SCHEMA))
    real = model_runner.apply_masks
    outs, tops = [], []
    for prompt in prompts:
        seen: list[list[float]] = []

        def watched(logits: torch.Tensor, matchers: list, vocab_size: int, seen=seen) -> None:
            real(logits, matchers, vocab_size)
            seen.append(torch.topk(logits[0], 2).values.tolist())

        model_runner.apply_masks = watched
        try:
            outs.append(llm.generate([prompt], params)[0].outputs[0])
        finally:
            model_runner.apply_masks = real
        tops.append(seen)
    assert all(len(t) == len(o.token_ids) for t, o in zip(tops, outs)), [len(t) for t in tops]
    return {"schema": SCHEMA, "prompts": prompts, "tokens": [o.token_ids for o in outs],
            "texts": [o.text for o in outs], "top_logits": tops}


def main() -> None:
    model = Path(sys.argv[1]) if len(sys.argv) > 1 else latest_checkpoint()
    if not (model / "model.safetensors").is_file():
        raise SystemExit(f"{model}: no model.safetensors (a sharded checkpoint is not handled)")
    weights = (model / "model.safetensors").read_bytes()
    if len(weights) - PART_BYTES + (model / "tokenizer.json").stat().st_size > CALL_BYTES:
        raise SystemExit(f"{model}: {len(weights)} bytes of weights do not fit two device calls of {CALL_BYTES}")
    part_a, part_b = ROOT / ".cache" / "smolA", ROOT / ".cache" / "smolB"
    for part in (part_a, part_b):
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
    (part_a / "model.safetensors.part0").write_bytes(weights[:PART_BYTES])
    (part_b / "model.safetensors.part1").write_bytes(weights[PART_BYTES:])
    for f in model.iterdir():
        if f.is_file() and f.name not in ("model.safetensors", "tokenizer.json", "quant_log.csv"):
            shutil.copy(f, part_a / f.name)
    shutil.copy(model / "tokenizer.json", part_b / "tokenizer.json")
    (part_a / "expected.json").write_text(json.dumps(expected_tokens(model)))
    md5 = hashlib.md5(weights).hexdigest()
    repo = travel_bytes()
    mib = 1 << 20
    for name, part in (("call 1", part_a), ("call 2", part_b)):
        part_bytes = folder_bytes(part)
        print(f"{name} carries {(repo + part_bytes) / mib:.1f} MiB ({part_bytes / mib:.1f} of them the part): "
              f"{(CARRY_LIMIT - repo - part_bytes) / mib:.1f} MiB left for wheels")
    print(f"for the structured-output rows, carry the wheels of {', '.join(XGRAMMAR_WHEELS)} (about 7.1 MiB) "
          "with call 1 and start it with the device README's pip install into /tmp/site; call 2 then sets "
          "PYTHONPATH=/tmp/site")
    print(f"{model} -> {part_a}, {part_b} (model.safetensors md5 {md5})\n"
          f"device call 1 (carry .cache/smolA): mkdir -p /tmp/smol/awq && cp .cache/smolA/* /tmp/smol/awq/ && "
          f"mv /tmp/smol/awq/expected.json /tmp/smol/\n"
          f"device call 2 (carry .cache/smolB, within 30 s): cat /tmp/smol/awq/model.safetensors.part0 "
          f".cache/smolB/model.safetensors.part1 > /tmp/smol/awq/model.safetensors && rm "
          f"/tmp/smol/awq/model.safetensors.part0 && cp .cache/smolB/tokenizer.json /tmp/smol/awq/ && "
          f"md5sum /tmp/smol/awq/model.safetensors && ENGINE_ROWS=smollm2_rows python bench/gpu_suite.py --only "
          f"engine --skip-tests")


if __name__ == "__main__":
    main()
