"""Sampling penalties on the logits of the penalised rows of a batch: the torch reference and the Triton kernel.

Semantics of vLLM's ``apply_penalties`` (``vllm/model_executor/layers/utils.py``; the presence and frequency
penalties of the OpenAI API reference, the repetition penalty of Keskar et al. 2019, "CTRL"): for every token seen
in the row's prompt or output the repetition penalty divides a positive logit and multiplies a non-positive one;
then the frequency penalty times the token's count in the output, and the presence penalty for a token present in
the output, are subtracted.

Inputs (R penalised rows of a batch of S rows, V the logits width):

- ``logits``: float32 [S, V], changed in place (and returned); rows not in ``rows`` are left as they are.
- ``rows``: int32 [R], the logits row of penalised row r.
- ``offsets``: int32 [2R + 1], into ``token_ids``: row r's prompt ids are ``token_ids[offsets[2r]:offsets[2r+1]]``
  and its output ids ``token_ids[offsets[2r+1]:offsets[2r+2]]`` (a row without a repetition penalty may leave its
  prompt out: only that penalty reads it).
- ``token_ids``: int32 [N]. Ids outside [0, V) are ignored.
- ``params``: float32 [3, R], each row's repetition, frequency and presence penalties (1, 0, 0: none).
- ``pending``: int64 [S] or None, the output token of logits row s that is still on the device (sampled by the
  step launched before, not yet read back; async scheduling), or -1. Counted as one more output id.

The reference builds [R, V] counts with scatter-adds (about 20 launches); the kernel is one launch, one program per
(row, slice of V), which counts the row's ids that fall in its slice (atomics on a scratch slice, zeroed first),
then rewrites its slice of the logits. Both round alike: a correctly rounded division, then ``l - f n``, then
``- p``, each rounded (no fused multiply-add), so they agree bit for bit.
"""
from __future__ import annotations

import torch

from ._triton import cdiv, jit, tl

#: bit of a count word marking "seen in the prompt" (the output count sits below it)
PROMPT_BIT = 1 << 30


def _counts_ref(rows: torch.Tensor, offsets: torch.Tensor, token_ids: torch.Tensor, width: int,
                pending: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(output counts float32 [R, V], prompt counts float32 [R, V]; only > 0 is read) by scatter-adds, without a
    host sync (a mask would need one: ignored entries add 0 at column 0)."""
    count = len(rows)
    lengths = (offsets[1:] - offsets[:-1]).long()  # [2R]: prompt, output, prompt, output ...
    part = torch.repeat_interleave(torch.arange(2 * count, device=rows.device), lengths,
                                   output_size=len(token_ids))
    ids = token_ids.long()
    ok = (ids >= 0) & (ids < width)
    index = (part // 2) * width + torch.where(ok, ids, 0)
    is_output = (part % 2 == 1)
    outputs = torch.zeros(count * width, dtype=torch.float32, device=rows.device)
    outputs.scatter_add_(0, index, (ok & is_output).to(torch.float32))
    prompts = torch.zeros(count * width, dtype=torch.float32, device=rows.device)
    prompts.scatter_add_(0, index, (ok & ~is_output).to(torch.float32))
    if pending is not None:
        tok = pending[rows.long()]
        ok = (tok >= 0) & (tok < width)
        outputs.scatter_add_(0, torch.arange(count, device=rows.device) * width + torch.where(ok, tok, 0),
                             ok.to(torch.float32))
    return outputs.view(count, width), prompts.view(count, width)


def apply_penalties_ref(logits: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor, token_ids: torch.Tensor,
                        params: torch.Tensor, pending: torch.Tensor | None = None) -> torch.Tensor:
    """The penalties of the module doc on ``logits`` [S, V] float32 in place (returned); no host sync."""
    if not len(rows):
        return logits
    index = rows.long()
    counts, prompts = _counts_ref(rows, offsets, token_ids, logits.shape[1], pending)
    rep, frequency, presence = params[:, :, None]
    part = logits[index]
    seen = (counts > 0) | (prompts > 0)
    part = torch.where(seen, torch.where(part > 0, part / rep, part * rep), part)
    logits[index] = part - frequency * counts - presence * (counts > 0).to(part.dtype)
    return logits


@jit(do_not_specialize=("R",))
def _penalties_kernel(logits_ptr, rows_ptr, off_ptr, ids_ptr, params_ptr, pending_ptr, scratch_ptr, R, V, stride_l,
                      SLICE: tl.constexpr, TOKENS: tl.constexpr, HAS_PENDING: tl.constexpr, BIT: tl.constexpr):
    """Grid (R, cdiv(V, SLICE)): row r, columns [SLICE j, SLICE (j + 1)). The count words of the slice (scratch
    int32 [R, V]: output count, plus ``BIT`` (:data:`PROMPT_BIT`) when seen in the prompt) are zeroed, then every
    id of the row in the slice is counted with an atomic (duplicates add up; a prompt id only sets the bit), then
    the slice's logits are rewritten. The barriers order the three phases between the program's threads; the
    count loads go to L2 (``.cg``), where the atomics landed."""
    r = tl.program_id(0)
    lo = tl.program_id(1) * SLICE
    cols = lo + tl.arange(0, SLICE)
    in_row = cols < V
    words = scratch_ptr + r.to(tl.int64) * V
    tl.store(words + cols, tl.zeros([SLICE], tl.int32), mask=in_row)
    tl.debug_barrier()
    start = tl.load(off_ptr + 2 * r)
    out_start = tl.load(off_ptr + 2 * r + 1)
    end = tl.load(off_ptr + 2 * r + 2)
    for i0 in range(start, end, TOKENS):
        i = i0 + tl.arange(0, TOKENS)
        ids = tl.load(ids_ptr + i, mask=i < end, other=-1)
        mine = (i < end) & (ids >= lo) & (ids < lo + SLICE) & (ids < V)
        tl.atomic_add(words + ids, 1, mask=mine & (i >= out_start), sem="relaxed")
        tl.atomic_or(words + ids, BIT, mask=mine & (i < out_start), sem="relaxed")
    row = tl.load(rows_ptr + r).to(tl.int64)
    if HAS_PENDING:
        tok = tl.load(pending_ptr + row)
        tl.atomic_add(words + tok, 1, mask=(tok >= lo) & (tok < lo + SLICE) & (tok < V), sem="relaxed")
    tl.debug_barrier()
    rep = tl.load(params_ptr + r)
    frequency = tl.load(params_ptr + R + r)
    presence = tl.load(params_ptr + 2 * R + r)
    c = tl.load(words + cols, mask=in_row, other=0, cache_modifier=".cg")
    n = c & (BIT - 1)
    l = tl.load(logits_ptr + row * stride_l + cols, mask=in_row, other=0.0)
    l = tl.where(c != 0, tl.where(l > 0, tl.math.div_rn(l, rep), l * rep), l)
    l = l - frequency * n.to(tl.float32)
    l = l - presence * (n > 0).to(tl.float32)
    tl.store(logits_ptr + row * stride_l + cols, l, mask=in_row)


def apply_penalties(logits: torch.Tensor, rows: torch.Tensor, offsets: torch.Tensor, token_ids: torch.Tensor,
                    params: torch.Tensor, pending: torch.Tensor | None = None, slice_: int = 2048) -> torch.Tensor:
    """Triton :func:`apply_penalties_ref`: one launch, no host sync; bit-identical results. ``slice_``: columns
    per program, a power of two (on an H200 2048 was the fastest of 1024 / 2048 / 4096 at 1 to 256 rows of 32k
    and 152k columns: 2.9 us at one row of 32k, 32 us at 256; bench/RESULTS.md, eighteenth session). Triton
    compiles one variant whatever R is; pass the index tensors 16-byte aligned (as ``engine.sampler`` does), or
    their alignment makes more variants. ValueError unless ``logits`` is float32 with a contiguous last dim."""
    if logits.dtype != torch.float32 or logits.stride(-1) != 1:
        raise ValueError("apply_penalties: logits must be float32 with a contiguous last dim")
    count, width = len(rows), logits.shape[1]
    if not count:
        return logits
    scratch = torch.empty(count, width, dtype=torch.int32, device=logits.device)  # 156 MB at 256 x 152k (cached)
    _penalties_kernel[(count, cdiv(width, slice_))](
        logits, rows, offsets, token_ids, params, pending if pending is not None else rows, scratch, count, width,
        logits.stride(0), SLICE=slice_, TOKENS=1024, HAS_PENDING=pending is not None, BIT=PROMPT_BIT, num_warps=8,
        enable_fp_fusion=False)
    return logits
