"""The CPU path's thread count follows the other processes' load (engine/cpu_threads.py)."""
from __future__ import annotations

import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cpu_threads import CpuThreads, CpuTimes, read_cpu_times, threads_for
from engine_fixtures import RAW_PROMPTS, demo_dir


@pytest.mark.parametrize("cores,others,threads", [
    (2, 0.0, 2), (2, 0.49, 2), (2, 0.51, 1), (2, 1.0, 1), (2, 1.9, 1), (2, 5.0, 1),
    (8, 2.4, 6), (8, 2.6, 5), (8, 0.0, 8), (1, 0.9, 1),
])
def test_threads_for_leaves_the_busy_cores(cores, others, threads):
    assert threads_for(cores, others) == threads


class FakeClock:
    """Readings a test writes: per step, wall time advances and other processes and we spend CPU time."""

    def __init__(self):
        self.now, self.reads, self.set_calls = CpuTimes(0.0, 0.0, 0.0), 0, []

    def advance(self, seconds: float, others: float, own: float) -> None:
        """``seconds`` of wall time in which other processes kept ``others`` cores busy and we ``own`` cores."""
        n = self.now
        self.now = CpuTimes(n.wall + seconds, n.busy + seconds * (others + own), n.own + seconds * own)

    def read(self) -> CpuTimes:
        self.reads += 1
        return self.now


def governor(clock: FakeClock, monkeypatch, cores: int = 2) -> CpuThreads:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return CpuThreads(cores, read=clock.read, set_threads=clock.set_calls.append, interval_s=1.0)


def test_a_busy_core_takes_a_thread_away_and_gives_it_back(monkeypatch):
    clock = FakeClock()
    gov = governor(clock, monkeypatch)
    clock.advance(0.5, others=1.0, own=1.0)
    assert gov.update() == 2 and clock.set_calls == []  # less than an interval: no look at the load
    clock.advance(0.6, others=1.0, own=1.0)
    assert gov.update() == 1 and clock.set_calls == [1]  # one core busy elsewhere over the last 1.1 s
    clock.advance(3.0, others=1.0, own=1.0)  # our one thread and their process: the load we see is still theirs
    assert gov.update() == 1 and clock.set_calls == [1]
    clock.advance(1.0, others=0.1, own=1.0)
    assert gov.update() == 2 and clock.set_calls == [1, 2]
    assert gov.threads == 2


def test_our_own_spinning_is_not_load(monkeypatch):
    clock = FakeClock()
    gov = governor(clock, monkeypatch, cores=4)
    clock.advance(2.0, others=0.0, own=4.0)
    assert gov.update() == 4 and clock.set_calls == []
    clock.advance(2.0, others=2.6, own=1.4)  # all 4 cores busy, 2.6 of them by others
    assert gov.update() == 1 and clock.set_calls == [1]


def test_omp_num_threads_fixes_the_count(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    clock = FakeClock()
    gov = CpuThreads(2, read=clock.read, set_threads=clock.set_calls.append, interval_s=1.0)
    clock.advance(5.0, others=2.0, own=2.0)
    assert gov.update() == 2 and (clock.reads, clock.set_calls) == (0, [])


def test_read_cpu_times_counts_our_cpu_time():
    before = read_cpu_times()
    spin_until = time.process_time() + 0.05
    while time.process_time() < spin_until:
        pass
    after = read_cpu_times()
    assert after.wall > before.wall and after.own - before.own >= 0.05 and after.busy >= before.busy


def test_greedy_output_does_not_depend_on_the_thread_count(monkeypatch):
    """What lets the count change mid-request: 1 and 2 threads give the same tokens on the demo model. The engine
    step calls ``update`` (held fixed here by OMP_NUM_THREADS so that the test sets the count itself)."""
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    llm = LLM(demo_dir(), device="cpu")
    updates = []
    monkeypatch.setattr(llm.engine.cpu_threads, "update", lambda: updates.append(1) or 1)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    before = torch.get_num_threads()
    try:
        tokens = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            tokens[threads] = [o.outputs[0].token_ids for o in llm.generate(RAW_PROMPTS, params)]
    finally:
        torch.set_num_threads(before)
    assert tokens[1] == tokens[2] and all(len(t) == 12 for t in tokens[1])
    assert len(updates) >= 12  # once per step
