"""Incremental detokenization on the demo model's tokenizer: the Rust fast path and transformers' decode give the
same text, step by step, with no half of a multi-byte character ever emitted."""
from __future__ import annotations

import pytest

from engine import detokenizer

TEXT = "Hello 世界! Emoji 😀🎉 and <|im_end|> special. ñandú café\n  two spaces"


@pytest.fixture(scope="module")
def tokenizer(demo_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(demo_model))


def deltas(decode, ids: list[int], skip: bool) -> list[str]:
    state, out = detokenizer.new_state(2), []
    for i in range(3, len(ids) + 1):
        out.append(detokenizer.step(decode, ids[:i], state, skip))
    assert state.text == "".join(out)
    return out


@pytest.mark.parametrize("skip", [True, False])
def test_fast_decoder_equals_transformers_decode(tokenizer, skip):
    ids = tokenizer.encode(TEXT)
    fast = detokenizer.decoder(tokenizer)
    slow = lambda ids, s: tokenizer.decode(ids, skip_special_tokens=s, clean_up_tokenization_spaces=False)  # noqa: E731
    assert fast.__code__.co_names == ("decode",) and "tokenizer" not in fast.__code__.co_freevars  # the Rust path
    got = deltas(fast, ids, skip)
    assert got == deltas(slow, ids, skip)
    assert "".join(got) == slow(ids[2:], skip)
    assert not any("\ufffd" in d for d in got) and "" in got  # a character split over tokens waited for its end


def test_tokenizer_that_overrides_decode_keeps_its_decode(tokenizer):
    class Shouting(type(tokenizer)):
        def decode(self, ids, **kwargs):
            return super().decode(ids, **kwargs).upper()

    tok = Shouting.__new__(Shouting)
    tok.__dict__.update(tokenizer.__dict__)
    assert detokenizer.decoder(tok)([tokenizer.encode("abc")[-1]], True) == tokenizer.decode(
        [tokenizer.encode("abc")[-1]]).upper()
