"""bench/consumer_fit.py off the GPU: the free memory its hog leaves, and its engine process (the tuner's plan,
then the engine with it) running every load to the end on the CPU path with a small random model."""
import json
import subprocess
from pathlib import Path

import pytest

from appliance.tuner import GPU_FREE_MARGIN
from bench.consumer_fit import HOG_SLACK, REPO, _this, hog_free

GIB = 2**30


def test_the_hog_leaves_the_share_and_about_what_the_tuner_keeps_spare():
    assert hog_free(6.88 * GIB) == int(6.88 * GIB) + GPU_FREE_MARGIN + HOG_SLACK
    assert GPU_FREE_MARGIN + HOG_SLACK < 0.6 * GIB


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from bench.random_model import write_random_awq_model

    return write_random_awq_model(tmp_path_factory.mktemp("tiny"), device="cpu", hidden_size=256,
                                  intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, group_size=64)


def test_the_engine_process_finishes_every_load(tiny, tmp_path):
    out = tmp_path / "report.json"
    subprocess.run(_this("child", str(tiny), str(out), "0.5", "cpu"), check=True, cwd=REPO, timeout=300)
    report = json.loads(out.read_text())
    phases, plan = report["phases"], report["plan"]
    assert list(phases) == ["long", "wide", "prompt logprobs"]
    assert all(p["finished"] == p["requests"] for p in phases.values())
    assert report["free_blocks_after"] == report["num_blocks"] == plan["num_kv_blocks"]  # nothing leaked
    # the CPU plan: the model's 512 tokens; as many wide requests as the plan's sequences, one long request more
    # than the cache holds at once (capped by the sequences)
    assert plan["max_model_len"] == 512 and phases["long"]["prompt_tokens"] == 512 - 16
    assert phases["wide"]["requests"] == plan["max_num_seqs"]
    assert phases["long"]["requests"] == min(plan["max_num_seqs"], plan["num_kv_blocks"] * 16 // 496 + 1)
