"""``python -m engine.server`` options: every EngineConfig field, bools with a --no- form (vLLM's)."""
from __future__ import annotations

import argparse

from engine.server.__main__ import _engine_options


def parse(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    _engine_options(parser)
    return vars(parser.parse_args(["--model", "/m", *argv]))


def test_defaults_are_the_engine_configs():
    args = parse()
    assert args["enable_prefix_caching"] is True and args["enable_chunked_prefill"] is True
    assert args["enforce_eager"] is False and args["max_num_seqs"] == 64 and args["swap_space"] == 0.0


def test_true_by_default_flags_can_be_turned_off_and_others_on():
    args = parse("--no-enable-prefix-caching", "--no-enable-chunked-prefill", "--enforce-eager",
                 "--max-num-batched-tokens", "512", "--swap-space", "2.5")
    assert args["enable_prefix_caching"] is False and args["enable_chunked_prefill"] is False
    assert args["enforce_eager"] is True and args["max_num_batched_tokens"] == 512 and args["swap_space"] == 2.5
