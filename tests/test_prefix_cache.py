"""Prefix caching: the block manager's hash chain, reuse, reference counts, LRU eviction and leak freedom without a
model; then the engine on the demo model (CPU, exact): a shared system prompt is computed once, the hits are
counted in tokens, and outputs equal cold outputs."""
from __future__ import annotations

import random

import pytest

from engine.block_manager import BlockManager, block_hash
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import Sequence


def seq(tokens, rid: str = "r") -> Sequence:
    return Sequence(rid, 0, list(tokens), SamplingParams())


def cached_bm(num_blocks: int, block_size: int) -> BlockManager:
    return BlockManager(num_blocks, block_size, enable_prefix_caching=True)


# ---- block manager ------------------------------------------------------------------------------------------------
def test_hash_chain_names_full_blocks_by_their_whole_prefix():
    bm = cached_bm(8, 4)
    a = seq(range(10))  # blocks [0..3] [4..7] full, [8, 9] partial
    bm.allocate(a)
    h0 = block_hash(None, (0, 1, 2, 3))
    h1 = block_hash(h0, (4, 5, 6, 7))
    assert [bm.block_hashes[b] for b in a.block_table] == [h0, h1, None]
    assert bm.cached_blocks == {h0: a.block_table[0], h1: a.block_table[1]}
    # the same second block after a different first block is different content
    assert block_hash(block_hash(None, (9, 1, 2, 3)), (4, 5, 6, 7)) != h1
    b = seq([9, 1, 2, 3, 4, 5, 6, 7, 8])
    bm.allocate(b)
    assert b.num_computed_tokens == 0 and not set(a.block_table) & set(b.block_table)
    bm.check([a, b])


def test_new_sequence_reuses_cached_prefix_and_counts_tokens():
    bm = cached_bm(8, 4)
    a = seq(range(10))
    bm.allocate(a)
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (10, 0)
    b = seq([0, 1, 2, 3, 4, 5, 6, 7, 100, 101, 102])
    assert bm.blocks_missing(b) == 1  # 3 blocks needed, 2 shared with a (held, so they cost nothing)
    bm.allocate(b)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] not in a.block_table
    assert b.num_computed_tokens == 8
    assert [bm.ref_counts[x] for x in a.block_table] == [2, 2, 1]
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (21, 8)
    assert bm.num_free_blocks == 8 - 4
    bm.check([a, b])


def test_last_token_is_always_computed():
    bm = cached_bm(8, 4)
    a = seq(range(8))  # exactly two full blocks
    bm.allocate(a)
    b = seq(range(8))  # identical: only the first block may be reused
    bm.allocate(b)
    assert b.num_computed_tokens == 4 and b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[1]
    assert bm.cached_blocks[bm.block_hashes[a.block_table[1]]] == a.block_table[1]  # first holder stays registered
    bm.free(a)  # a's second block stays cached; b's duplicate of it is plain and is freed as such later
    bm.free(b)
    assert bm.block_states().count("c") == 2 and bm.num_cached_blocks == 2
    assert bm.num_free_blocks == 8
    bm.check()


def test_the_kept_block_states_follow_every_change_and_check_catches_a_stale_one():
    """block_states() is kept with each allocation, hit, release and eviction (not rebuilt from the free queue):
    the states after each equal the rule "free queue: cached if registered, else free; the rest used"."""
    bm = cached_bm(4, 2)
    a = seq(range(5))  # blocks for [0 1] [2 3] [4]
    bm.allocate(a)
    assert bm.block_states() == "###."
    bm.free(a)  # two registered blocks stay cached, the partial one is free (at the front of the queue)
    assert sorted(bm.block_states()) == [".", ".", "c", "c"] and bm.num_cached_blocks == 2
    b = seq([0, 1, 9, 9, 9, 9, 9])  # hits the first block, then takes the two free ones and the cached one (evicted)
    bm.allocate(b)
    assert bm.block_states() == "####" and bm.num_cached_blocks == 0 and bm.num_free_blocks == 0
    bm.check([b])
    bm._states[b.block_table[0]] = ord(".")
    with pytest.raises(AssertionError, match="kept block states"):
        bm.check([b])


def test_freed_blocks_stay_cached_and_are_hit_again():
    bm = cached_bm(6, 4)
    a = seq(range(9))
    bm.allocate(a)
    table = list(a.block_table)
    bm.free(a)
    assert a.block_table == [] and a.num_computed_tokens == 0
    states = bm.block_states()
    assert [states[b] for b in table] == ["c", "c", "."]
    assert bm.num_free_blocks == 6 and bm.usage == 0.0 and bm.num_cached_blocks == 2
    b = seq(list(range(8)) + [50, 51])
    bm.allocate(b)  # hits both cached blocks: they leave the free queue with reference count 1
    assert b.block_table[:2] == table[:2] and b.num_computed_tokens == 8
    assert [bm.ref_counts[x] for x in table[:2]] == [1, 1]
    assert bm.num_free_blocks == 3 and bm.num_cached_blocks == 0
    bm.check([b])
    bm.free(b)
    bm.check()
    assert bm.num_free_blocks == 6


def test_lru_eviction_order():
    bm = cached_bm(4, 2)
    x, y, z = seq([1, 2]), seq([3, 4]), seq([5, 6])
    for s in (x, y, z):
        bm.allocate(s)
    ids = {name: s.block_table[0] for name, s in zip("xyz", (x, y, z))}
    for s in (x, z, y):  # least recently used first: x, z, y
        bm.free(s)
    bm.check()
    assert list(bm.free_block_ids) == [3, ids["x"], ids["z"], ids["y"]]  # never-cached blocks come first
    w = seq([7, 8])
    bm.allocate(w)
    assert w.block_table == [3] and bm.num_cached_blocks == 3  # a free block: no eviction
    v = seq([9, 10])
    bm.allocate(v)
    assert v.block_table == [ids["x"]]  # the least recently used cached block is evicted
    assert block_hash(None, (1, 2)) not in bm.cached_blocks
    hit_z = seq([5, 6, 0])
    bm.allocate(hit_z)  # reuses z; its second block evicts y, the least recently used cached block left
    assert hit_z.block_table == [ids["z"], ids["y"]] and hit_z.num_computed_tokens == 2
    assert bm.cached_blocks == {block_hash(None, (5, 6)): ids["z"], block_hash(None, (7, 8)): 3,
                                block_hash(None, (9, 10)): ids["x"]}
    miss_x = seq([1, 2, 0])
    assert bm._prefix_hits(miss_x) == [] and bm.blocks_missing(miss_x) == 2
    bm.free(hit_z)
    bm.check([w, v])
    assert list(bm.free_block_ids) == [ids["y"], ids["z"]]  # the plain block first, then z (cached, just used)
    assert bm.block_states()[ids["z"]] == "c" and bm.block_states()[ids["y"]] == "."


def test_tail_blocks_are_evicted_before_their_prefix():
    bm = cached_bm(3, 2)
    a = seq([1, 2, 3, 4, 5, 6])
    bm.allocate(a)
    table = list(a.block_table)
    bm.free(a)
    assert list(bm.free_block_ids) == table[::-1]  # the last block is released first: evicted first
    bm.allocate(seq([9, 9]))
    assert bm._prefix_hits(seq([1, 2, 3, 4, 0])) == table[:2]


def test_disabled_prefix_caching_is_plain_paging():
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    a = seq([1, 2, 3, 4])
    bm.allocate(a)
    bm.free(a)
    b = seq([1, 2, 3, 4, 5])
    bm.allocate(b)
    assert b.num_computed_tokens == 0 and bm.cached_blocks == {} and "c" not in bm.block_states()
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (0, 0)


def test_no_leaks_under_random_traffic():
    """Sequences sharing prefixes arrive, decode, get preempted and finish in a random order; the invariants
    hold after every operation and every block is free (or cached) at the end."""
    rng = random.Random(4)
    bm = cached_bm(14, 4)
    sched = Scheduler(bm, max_num_seqs=6, max_num_batched_tokens=10_000)
    system = [rng.randrange(50) for _ in range(9)]
    all_seqs = []
    for i in range(40):
        prefix = system[:rng.choice([0, 4, 8, 9])]
        s = seq(prefix + [rng.randrange(50) for _ in range(rng.randrange(1, 10))], str(i))
        all_seqs.append(s)
        sched.add(s)
    target = {s.request_id: rng.randrange(1, 20) for s in all_seqs}
    finished = 0
    while sched.has_unfinished():
        batch = sched.schedule()
        assert batch is not None
        bm.check(list(sched.running))
        for s in batch.seqs:
            s.num_computed_tokens = len(s)
            s.token_ids.append(rng.randrange(50))
            if s.num_output_tokens >= target[s.request_id] or len(s) >= 28:
                sched.finish(s, "length")
                finished += 1
        bm.check(list(sched.running))
    assert finished == 40
    assert bm.num_free_blocks == bm.num_blocks and all(c == 0 for c in bm.ref_counts)
    assert sorted(bm.free_block_ids) == list(range(bm.num_blocks))
    assert "#" not in bm.block_states()
    assert bm.prefix_cache_hits > 0 and sched.num_preemptions > 0
    assert bm.prefix_cache_queries == sum(s.num_prompt_tokens for s in all_seqs)


def test_preempted_sequence_resumes_from_its_cached_blocks():
    bm = cached_bm(4, 2)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=4096)
    old, new = seq([1, 2, 3], "old"), seq([4, 5, 6], "new")
    sched.add(old)
    sched.add(new)
    assert sched.schedule().seqs == [old, new]
    for s in (old, new):
        s.num_computed_tokens = len(s)
        s.token_ids.append(7)  # 4 tokens: two full blocks each, no third needed yet
    assert sched.schedule().seqs == [old, new]
    for s in (old, new):
        s.num_computed_tokens = len(s)
        s.token_ids.append(8)  # 5 tokens: a third block each; only old gets it
    assert sched.schedule().seqs == [old] and sched.num_preemptions == 1
    assert "c" in bm.block_states()
    old.num_computed_tokens = len(old)
    sched.finish(old, "stop")
    batch = sched.schedule()
    assert batch.is_prefill and batch.seqs == [new]
    # new's tail block [6, 7] was released first, so it was the one evicted for old's third block; [4, 5] is a hit
    assert new.num_computed_tokens == 2 and bm.prefix_cache_hits == 0  # a resumed sequence is not a new query
    bm.check([new])
    sched.finish(new, "stop")
    assert bm.num_free_blocks == 4
    bm.check()


# ---- engine (demo model, CPU) -----------------------------------------------------------------------------------
SYSTEM = ("You are a careful assistant for a small appliance. Answer in one short sentence, name the source of "
          "every fact, and never invent numbers.")
QUESTIONS = ["What is the capital of France?", "Name a prime number.", "What colour is the sky?"]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1)  # logprobs: bit-exact check


@pytest.fixture(scope="module")
def cold(demo_model):
    from engine import LLM
    return LLM(str(demo_model), device="cpu", max_num_seqs=8, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def warm(demo_model):
    from engine import LLM
    return LLM(str(demo_model), device="cpu", max_num_seqs=8)


def chats(tokenizer, system: str = SYSTEM) -> list[list[int]]:
    texts = [tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}],
                                           add_generation_prompt=True, tokenize=False) for q in QUESTIONS]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def expected_hits(prompts: list[list[int]], block_size: int) -> int:
    """Prefix-cache hits, in tokens, of ``prompts`` run in order on a cache holding none of them: each one's
    longest prefix shared with an earlier one, in whole blocks, the last token's block always computed."""
    return sum(min(max(common_prefix(q, p) for q in prompts[:i]), len(p) - 1) // block_size * block_size
               for i, p in enumerate(prompts) if i)


def tokens_of(outputs) -> list[tuple[list[int], list]]:
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outputs]


def assert_nothing_held(engine) -> None:
    bm = engine.block_manager
    bm.check()
    assert bm.num_free_blocks == bm.num_blocks and "#" not in bm.block_states()
    assert not engine.scheduler.running and not engine.scheduler.waiting and not engine.requests


def test_shared_system_prompt_is_computed_once(cold, warm):
    prompts = chats(warm.get_tokenizer())
    bs = warm.engine.block_manager.block_size
    shared = common_prefix(prompts[0], prompts[1])
    assert shared >= 2 * bs  # the system prompt spans several blocks
    expected_cold = tokens_of(cold.generate(prompts, GREEDY))
    before = warm.engine.get_stats()
    first = tokens_of(warm.generate(prompts[:1], GREEDY))
    rest = tokens_of(warm.generate(prompts[1:], GREEDY))  # both hit the first request's cached blocks
    stats = warm.engine.get_stats()
    assert first + rest == expected_cold
    hits = sum(common_prefix(prompts[0], p) // bs * bs for p in prompts[1:])
    assert stats.prefix_cache_hits_total - before.prefix_cache_hits_total == hits
    assert stats.prefix_cache_queries_total - before.prefix_cache_queries_total == sum(map(len, prompts))
    assert stats.num_cached_blocks > 0 and stats.block_states.count("c") == stats.num_cached_blocks
    assert stats.kv_cache_usage == 0.0
    assert_nothing_held(warm.engine)
    cold_stats = cold.engine.get_stats()
    assert (cold_stats.prefix_cache_queries_total, cold_stats.num_cached_blocks) == (0, 0)


def test_requests_in_one_batch_share_the_prefix(cold, warm):
    """Arriving together, the later requests hit the blocks the first one fills in the same prefill step (a system
    prompt no earlier test cached: each hit is this batch's own)."""
    tok = warm.get_tokenizer()
    prompts = chats(tok, "Reply like a patient teacher of a small class; keep every answer to one short sentence, "
                         "and say so when you do not know.")
    bs = warm.engine.block_manager.block_size
    before = warm.engine.get_stats()
    assert tokens_of(warm.generate(prompts, GREEDY)) == tokens_of(cold.generate(prompts, GREEDY))
    stats = warm.engine.get_stats()
    hits = expected_hits(prompts, bs)
    assert hits >= 2 * 2 * bs  # the system prompt spans blocks
    assert stats.prefix_cache_hits_total - before.prefix_cache_hits_total == hits
    assert_nothing_held(warm.engine)


def test_repeated_prompt_and_n_greater_than_one_match_cold(cold, warm):
    """The same prompt again reuses every block but the last token's; n = 2 shares the prompt's blocks."""
    prompt = chats(warm.get_tokenizer())[0]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, n=2, logprobs=1)
    want = [(o.token_ids, o.logprobs) for o in cold.generate([prompt], params)[0].outputs]
    bs = warm.engine.block_manager.block_size
    for _ in range(2):
        out = warm.generate([prompt], params)[0]
        assert [(o.token_ids, o.logprobs) for o in out.outputs] == want
    assert out.num_cached_tokens == (len(prompt) - 1) // bs * bs  # all but the last token's block
    assert want[0] == want[1]
    assert_nothing_held(warm.engine)
