"""The Triton penalty kernel against its torch reference (bit for bit), and the reference against a plain per-row
loop written from vLLM's ``apply_penalties``, on random batches: repeated ids, rows that leave their prompt out,
pending tokens (and -1), ids outside the vocabulary, -inf logits, several slices of V and rows of more ids than one
loop step takes."""
import pytest
import torch
from kernels_testenv import on_device  # noqa: F401 (autouse fixture)

from kernels import penalties


def _batch(rows_total: int, width: int, picked: list[int], lengths: list[tuple[int, int]], pending: bool):
    """Random inputs in the kernel's layout (see kernels/penalties.py) and the per-row id lists they hold. The first
    penalised row always has penalties, an output id past the vocabulary (when it has outputs) and, with
    ``pending``, a pending token; with more rows the last is neutral (1, 0, 0) with a pending token past the
    vocabulary, and with three or more the second has none (-1)."""
    logits = torch.randn(rows_total, width) * 4
    logits[0, :7] = float("-inf")  # masked by min_tokens
    prompts = [torch.randint(-3, width + 3, (p,), dtype=torch.int32) for p, _ in lengths]  # some ids out of range
    outputs = [torch.randint(0, min(width, 40), (o,), dtype=torch.int32) for _, o in lengths]  # repeats likely
    if len(outputs[0]):
        outputs[0][-1] = width + 1
    ids = torch.cat([t for pair in zip(prompts, outputs) for t in pair])
    sizes = torch.tensor([len(t) for pair in zip(prompts, outputs) for t in pair], dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), sizes.cumsum(0)]).to(torch.int32)
    params = torch.stack([torch.rand(len(picked)) + 0.5, torch.rand(len(picked)) - 0.2,
                          torch.rand(len(picked)) - 0.2]).float()
    tokens = torch.randint(0, width, (rows_total,), dtype=torch.int64) if pending else None
    if pending:
        tokens[picked[0]] = 3
    if len(picked) > 1:
        params[:, -1] = torch.tensor([1.0, 0.0, 0.0])
        if pending:  # counted, it would be written past the scratch's last row
            tokens[picked[-1]] = width + 5
    if len(picked) > 2 and pending:
        tokens[picked[1]] = -1
    rows = torch.tensor(picked, dtype=torch.int32)
    return logits, rows, offsets, ids, params, tokens, prompts, outputs


def _loop(logits, rows, params, tokens, prompts, outputs):
    """vLLM's apply_penalties, one row at a time with Python sets and counts."""
    out = logits.clone()
    width = logits.shape[1]
    for r, row in enumerate(rows.tolist()):
        rep, freq, pres = params[:, r].tolist()
        produced = [t for t in outputs[r].tolist() if 0 <= t < width]
        if tokens is not None and 0 <= tokens[row] < width:
            produced.append(int(tokens[row]))
        seen = {t for t in prompts[r].tolist() if 0 <= t < width} | set(produced)
        line = out[row]
        for t in seen:
            line[t] = line[t] / rep if line[t] > 0 else line[t] * rep
        for t in set(produced):
            line[t] = line[t] - freq * produced.count(t)
            line[t] = line[t] - pres
    return out


CASES = [  # (rows in the batch, vocabulary, penalised rows, (prompt, output) ids per penalised row, pending)
    (1, 50, [0], [(5, 3)], False),
    (3, 100, [0, 2], [(9, 0), (0, 12)], True),
    (4, 5000, [3, 1, 0, 2], [(2500, 30), (0, 1100), (17, 0), (5, 5)], True),  # 3 slices; rows over a loop step
    (2, 64, [1], [(0, 0)], True),  # only the pending token
]


@pytest.mark.parametrize("slice_", [{}, {"slice_": 1024}, {"slice_": 4096}])
@pytest.mark.parametrize("rows_total,width,picked,lengths,pending", CASES)
def test_kernel_equals_reference_bit_for_bit(rows_total, width, picked, lengths, pending, slice_):
    logits, rows, offsets, ids, params, tokens, _, _ = _batch(rows_total, width, picked, lengths, pending)
    want = penalties.apply_penalties_ref(logits.clone(), rows, offsets, ids, params, tokens)
    got = penalties.apply_penalties(logits.clone(), rows, offsets, ids, params, tokens, **slice_)
    assert torch.equal(got, want)
    assert not torch.equal(got[picked[0]], logits[picked[0]])  # the first penalised row did change
    untouched = [r for r in range(rows_total) if r not in picked]
    assert torch.equal(got[untouched], logits[untouched])


@pytest.mark.parametrize("rows_total,width,picked,lengths,pending", CASES)
def test_reference_equals_a_row_loop(rows_total, width, picked, lengths, pending):
    logits, rows, offsets, ids, params, tokens, prompts, outputs = _batch(rows_total, width, picked, lengths, pending)
    got = penalties.apply_penalties_ref(logits.clone(), rows, offsets, ids, params, tokens)
    torch.testing.assert_close(got, _loop(logits, rows, params, tokens, prompts, outputs), rtol=1e-6, atol=1e-6)


def test_kernel_rejects_half_logits():
    logits = torch.zeros(1, 8, dtype=torch.float16)
    one = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="float32"):
        penalties.apply_penalties(logits, one, torch.zeros(3, dtype=torch.int32), one[:0], torch.ones(3, 1))


def test_no_rows_is_a_no_op():
    logits = torch.randn(2, 8)
    empty = torch.zeros(0, dtype=torch.int32)
    assert penalties.apply_penalties(logits, empty, torch.zeros(1, dtype=torch.int32), empty,
                                     torch.ones(3, 0)) is logits
    assert penalties.apply_penalties_ref(logits, empty, torch.zeros(1, dtype=torch.int32), empty,
                                         torch.ones(3, 0)) is logits
