"""bench/consumer_fit.py off the GPU: the free memory its hog leaves makes the tuner pick the intended share, and
its engine process runs every load to the end on the CPU path (a small random model), preempting where the KV
cache is short."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.tuner import GPU_FREE_MARGIN
from bench.consumer_fit import HOG_SLACK, hog_target_free

GIB = 2**30


@pytest.mark.parametrize("total", [int(79.2 * GIB), int(139.8 * GIB)])
@pytest.mark.parametrize("share", [6.6, 10.8, 21.6])
def test_the_hog_leaves_what_makes_the_tuner_pick_the_share_rounded_down(total, share):
    util, free = hog_target_free(share * GIB, total)
    assert util == math.floor(share * GIB / total * 100) / 100 and util * total <= share * GIB
    assert math.floor((free - GPU_FREE_MARGIN) / total * 100) / 100 == util  # appliance.tuner.plan's formula
    assert free - GPU_FREE_MARGIN - util * total == pytest.approx(HOG_SLACK, abs=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from bench.random_model import write_random_awq_model

    return write_random_awq_model(tmp_path_factory.mktemp("tiny"), device="cpu", hidden_size=256,
                                  intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, group_size=64)


@pytest.mark.parametrize("given", [None, dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                                              num_kv_blocks=40)])
def test_the_engine_process_finishes_every_load(tiny, tmp_path, given):
    out = tmp_path / "report.json"
    subprocess.run([sys.executable, "-m", "bench.consumer_fit", "child", str(tiny), str(out), json.dumps(given),
                    "cpu"], check=True, cwd=Path(__file__).parent.parent, timeout=300)
    report = json.loads(out.read_text())
    phases = report["phases"]
    assert list(phases) == ["long", "wide", "prompt logprobs"]
    assert all(p["finished"] == p["requests"] for p in phases.values())
    assert report["free_blocks_after"] == report["num_blocks"]  # nothing leaked
    if given is None:  # the CPU plan: the model's 512 tokens; as many wide requests as the plan's sequences
        assert report["plan"]["max_model_len"] == 512 and phases["long"]["prompt_tokens"] == 512 - 16
        assert phases["wide"]["requests"] == report["plan"]["max_num_seqs"]
    else:  # 40 blocks of 16 = 640 tokens: three 240-token prompts do not fit at once, four 256-token sequences
        assert report["num_blocks"] == 40 and phases["long"]["requests"] == 640 // 240 + 1
        assert phases["long"]["preemptions"] > 0 and phases["wide"]["preemptions"] > 0
