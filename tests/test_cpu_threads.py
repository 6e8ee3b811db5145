"""The CPU path's thread count follows the other processes' load (engine/cpu_threads.py)."""
from __future__ import annotations

import logging
import os
import time

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cpu_threads import CpuThreads, CpuTimes, cgroup_cpu_limit, read_cpu_times, threads_for
from engine_fixtures import RAW_PROMPTS, demo_dir


@pytest.mark.parametrize("cores,free,current,threads", [
    (2, 2.0, 2, 2), (2, 1.55, 2, 2), (2, 1.51, 2, 2), (2, 1.45, 2, 1), (2, 0.0, 2, 1),  # down at round(free)
    (2, 1.45, 1, 1), (2, 1.55, 1, 1), (2, 1.65, 1, 2), (2, 2.0, 1, 2),  # up at round(free - 0.1)
    (4, 7.0, 4, 4), (4, 4.0, 4, 4), (4, 2.4, 4, 2), (4, 2.6, 2, 3), (1, 0.2, 1, 1),
])
def test_threads_for_down_above_half_a_core_up_only_below_0_4(cores, free, current, threads):
    assert threads_for(cores, free, current) == threads


class FakeCpu:
    """Readings a test writes: wall time advances while other processes and we keep some cores busy."""

    def __init__(self, cpus: int = 2):
        self.now, self.reads, self.set_calls = CpuTimes(100.0, 0.0, 0.0, cpus), 0, []

    def advance(self, seconds: float, others: float, own: float) -> None:
        """``seconds`` of wall time in which other processes kept ``others`` cores busy and we ``own`` cores."""
        n = self.now
        self.now = CpuTimes(n.wall + seconds, n.busy + seconds * (others + own), n.own + seconds * own, n.cpus)

    def read(self) -> CpuTimes:
        self.reads += 1
        return self.now

    def governor(self, monkeypatch, cores: int = 2) -> CpuThreads:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        return CpuThreads(cores, read=self.read, set_threads=self.set_calls.append, clock=lambda: self.now.wall,
                          interval_s=1.0, probe_s=30.0, cpu_limit=lambda: None)

    def run(self, gov: CpuThreads, seconds: int, others: float) -> list[int]:
        """Step once a second for ``seconds`` (our threads keep ``gov.threads`` cores busy); the counts seen."""
        counts = []
        for _ in range(seconds):
            self.advance(1.0, others, max(0.1, min(gov.threads, self.now.cpus - others)))
            counts.append(gov.update())
        return counts


def test_a_busy_core_takes_a_thread_away_and_gives_it_back(monkeypatch):
    cpu = FakeCpu()
    gov = cpu.governor(monkeypatch)
    cpu.advance(0.5, others=1.0, own=1.0)
    reads = cpu.reads
    assert gov.update() == 2 and cpu.reads == reads  # less than an interval: not even read
    cpu.advance(0.6, others=1.0, own=1.0)
    assert gov.update() == 1 and cpu.set_calls == [1]  # one core busy elsewhere over the last 1.1 s
    assert cpu.run(gov, 5, others=1.0) == [1] * 5 and cpu.set_calls == [1]
    assert cpu.run(gov, 2, others=0.1) == [2, 2] and cpu.set_calls == [1, 2]


def test_cpus_beyond_torchs_threads_are_free_cores(monkeypatch):
    """4 threads (one per physical core) on 8 CPUs: a job on 4 of them leaves ours alone; one on 5 does not."""
    cpu = FakeCpu(cpus=8)
    gov = cpu.governor(monkeypatch, cores=4)
    assert cpu.run(gov, 3, others=4.0) == [4, 4, 4]
    assert cpu.run(gov, 1, others=5.0) == [3]


def test_a_load_near_half_a_core_does_not_flap(monkeypatch):
    cpu = FakeCpu()
    gov = cpu.governor(monkeypatch)
    assert cpu.run(gov, 6, others=0.45) == [2] * 6
    cpu.run(gov, 1, others=1.0)
    assert cpu.run(gov, 6, others=0.45) == [1] * 6 and cpu.set_calls == [1]


def test_a_probe_finds_that_the_load_was_ours_to_take(monkeypatch):
    """A niced job takes the core we leave it (load 1.0 at 1 thread) and yields it at 2 (load 0.05): every
    30 s the full count is tried again, and kept when the load measured with it allows it."""
    cpu = FakeCpu()
    gov = cpu.governor(monkeypatch)
    assert cpu.run(gov, 1, others=1.0) == [1]
    assert cpu.run(gov, 29, others=1.0) == [1] * 29  # within PROBE_S of the drop
    assert cpu.run(gov, 1, others=1.0) == [2]  # the probe
    assert cpu.run(gov, 3, others=0.05) == [2, 2, 2] and cpu.set_calls == [1, 2]


def test_a_probe_against_a_busy_core_goes_back_and_waits_again(monkeypatch):
    cpu = FakeCpu()
    gov = cpu.governor(monkeypatch)
    counts = cpu.run(gov, 63, others=0.67)  # a busy process's fair share beside our 2 spinning threads
    assert counts[:3] == [1, 1, 1] and counts.count(2) == 2 and counts[30:32] == counts[61:63] == [2, 1]
    assert cpu.set_calls == [1, 2, 1, 2, 1]


def test_idle_time_is_not_judged_however_long_a_step_takes(monkeypatch):
    """After ``pause`` (the engine ran out of work) the next look only starts a window; slow steps (10 s each, a
    big model beside a busy process) are judged like fast ones."""
    cpu = FakeCpu()
    gov = cpu.governor(monkeypatch)
    gov.pause()
    cpu.advance(600.0, others=1.5, own=0.0)  # the engine idle for 10 minutes while others worked
    assert gov.update() == 2 and cpu.set_calls == []
    assert cpu.run(gov, 2, others=0.0) == [2, 2] and cpu.set_calls == []
    cpu.advance(10.0, others=1.0, own=1.0)
    assert gov.update() == 1
    for _ in range(4):  # one probe after 30 s, judged 10 s later: back to 1
        cpu.advance(10.0, others=1.0, own=1.0)
        gov.update()
    assert cpu.set_calls == [1, 2, 1]


def test_idle_looks_follow_the_load_of_a_wait(monkeypatch):
    """While a server waits (idle looks once a second): a busy process takes a thread away before the next
    request, one step long perhaps; its end gives it back; the first look judges the wait since the pause."""
    cpu = FakeCpu()
    gov = cpu.governor(monkeypatch)
    gov.pause()
    cpu.advance(1.0, others=1.0, own=0.0)
    gov.pause()  # the engine loop asks again: the wait's window still starts at the first pause
    assert gov.idle_look() == 1 and cpu.set_calls == [1]
    cpu.advance(1.0, others=0.0, own=0.0)
    assert gov.idle_look() == 2 and cpu.set_calls == [1, 2]
    cpu.advance(0.3, others=1.0, own=0.0)
    assert gov.idle_look() == 2  # under half an interval: not judged yet (the window goes on)
    cpu.advance(0.3, others=1.0, own=0.0)
    assert gov.idle_look() == 1  # 0.6 s, one core busy elsewhere


def test_idle_looks_leave_a_niced_job_out_and_never_probe(monkeypatch):
    """A niced job that fills the cores while we wait yields them once we step: not load. A count reduced by a
    busy process stays reduced over a wait longer than the probe period (no probe while nothing steps)."""
    cpu = FakeCpu()
    gov = cpu.governor(monkeypatch)
    gov.pause()
    for _ in range(5):  # a nice-19 job on both cores
        n = cpu.now
        cpu.now = CpuTimes(n.wall + 1.0, n.busy + 2.0, n.own, n.cpus, n.nice + 2.0)
        assert gov.idle_look() == 2
    for _ in range(40):  # then a normal one on a core, for longer than PROBE_S
        cpu.advance(1.0, others=1.0, own=0.0)
        gov.idle_look()
    assert gov.threads == 1 and cpu.set_calls == [1]


def test_short_requests_between_short_waits_are_judged_and_a_wait_defers_the_probe(monkeypatch):
    """Requests of one 0.3 s step every 0.8 s beside a busy core (no wait reaches an interval): the looks as the
    loop wakes judge the steps and waits together. A long wait at the reduced count: no probe at the next steps."""
    cpu = FakeCpu()
    gov = cpu.governor(monkeypatch)
    for _ in range(3):
        gov.update()
        cpu.advance(0.3, others=1.0, own=1.0)
        gov.pause()
        cpu.advance(0.5, others=1.0, own=0.0)
        gov.idle_look()  # the loop wakes for the next request
    assert gov.threads == 1 and cpu.set_calls == [1]
    for _ in range(120):  # a 2-minute wait, looked at every second
        cpu.advance(1.0, others=1.0, own=0.0)
        gov.idle_look()
    assert cpu.run(gov, 5, others=1.0) == [1] * 5 and cpu.set_calls == [1]


def test_logs_say_what_changed_once_a_minute_at_most(monkeypatch, caplog):
    caplog.set_level(logging.DEBUG, logger="engine.cpu_threads")
    cpu = FakeCpu()
    gov = cpu.governor(monkeypatch)
    cpu.run(gov, 1, others=1.0)
    cpu.run(gov, 30, others=1.0)  # a probe at 31 s: DEBUG
    cpu.run(gov, 1, others=0.0)  # the probe's full count is kept: INFO
    for _ in range(10):  # a job that runs 1 s out of 2: the count follows, INFO at most once a minute
        cpu.run(gov, 1, others=1.0)
        cpu.run(gov, 1, others=0.0)
    info = [r.getMessage().split(":")[0] for r in caplog.records if r.levelno == logging.INFO]
    assert info == ["CPU threads 2 -> 1", "CPU threads stays at 2"], info
    assert len(cpu.set_calls) == 1 + 1 + 2 * 10


def test_the_log_never_leaves_a_stale_count_standing(monkeypatch, caplog):
    """A return to the full count after an INFO drop is INFO at once (a trial user read the drop, with its return
    at DEBUG, as the engine stuck on one thread); a change told at DEBUG is told at INFO a minute after the last
    INFO line, while it holds."""
    caplog.set_level(logging.DEBUG, logger="engine.cpu_threads")
    cpu = FakeCpu()
    gov = cpu.governor(monkeypatch)
    cpu.run(gov, 2, others=1.0)  # 2 -> 1: INFO
    cpu.run(gov, 3, others=0.0)  # the job ended: 1 -> 2 at INFO within the minute
    cpu.run(gov, 65, others=1.0)  # 2 -> 1 again within the minute: DEBUG; told at INFO once the minute is up
    cpu.run(gov, 1, others=1.0)
    info = [r.getMessage().split(":")[0] for r in caplog.records if r.levelno == logging.INFO]
    assert info == ["CPU threads 2 -> 1", "CPU threads 1 -> 2", "CPU threads now 1"], info
    debug = [r.getMessage().split(":")[0] for r in caplog.records if r.levelno == logging.DEBUG]
    assert debug[0] == "CPU threads 2 -> 1"


def test_a_probe_that_ends_in_a_wait_and_keeps_the_full_count_is_told(monkeypatch, caplog):
    """The engine goes idle during a probe, the load gone: the idle look keeps the full count, told at INFO (as a
    probe that keeps it while stepping)."""
    caplog.set_level(logging.DEBUG, logger="engine.cpu_threads")
    cpu = FakeCpu()
    gov = cpu.governor(monkeypatch)
    cpu.run(gov, 31, others=1.0)  # 2 -> 1 at 1 s, a probe at 31 s
    assert gov.threads == 2 and cpu.set_calls == [1, 2]
    gov.pause()
    cpu.advance(1.0, others=0.0, own=0.0)
    assert gov.idle_look() == 2
    info = [r.getMessage().split(":")[0] for r in caplog.records if r.levelno == logging.INFO]
    assert info == ["CPU threads 2 -> 1", "CPU threads stays at 2"], info


def test_omp_num_threads_or_unreadable_counters_fix_the_count(monkeypatch, caplog):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    cpu = FakeCpu()
    gov = CpuThreads(2, read=cpu.read, set_threads=cpu.set_calls.append, clock=lambda: cpu.now.wall,
                     cpu_limit=lambda: 1.0)  # not even a quota changes it
    cpu.advance(5.0, others=2.0, own=2.0)
    assert gov.update() == 2 and (cpu.reads, cpu.set_calls) == (0, [])
    monkeypatch.delenv("OMP_NUM_THREADS")

    def broken():
        raise PermissionError("/proc/stat")

    gov = CpuThreads(2, read=broken, set_threads=cpu.set_calls.append, clock=lambda: cpu.now.wall,
                     cpu_limit=lambda: None)
    cpu.advance(5.0, others=2.0, own=2.0)
    assert gov.fixed and gov.update() == 2 and cpu.set_calls == []
    assert "cannot read the CPU times" in caplog.text


def _tree(root, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


@pytest.mark.parametrize("cgroup,files,limit", [
    # cgroup v2: the smallest quota on the way up; "max" is none; the root cgroup has no cpu.max
    ("0::/a/b\n", {"cgroup.controllers": "cpu", "a/cpu.max": "max 100000", "a/b/cpu.max": "150000 100000"}, 1.5),
    ("0::/a/b\n", {"cgroup.controllers": "cpu", "a/cpu.max": "100000 100000", "a/b/cpu.max": "300000 100000"},
     1.0),
    ("0::/a\n", {"cgroup.controllers": "cpu", "a/cpu.max": "max 100000"}, None),
    # v1 beside v2 (hybrid): a container sees its own cgroup at the mount, not at the host's path
    ("4:cpu,cpuacct:/docker/x\n0::/\n", {"cpu,cpuacct/cpu.cfs_quota_us": "200000",
                                         "cpu,cpuacct/cpu.cfs_period_us": "100000", "unified/cgroup.procs": ""}, 2.0),
    ("1:cpu:/\n0::/\n", {"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),
    ("1:cpu:/\n", {"cpu/cpu.cfs_quota_us": "oops", "cpu/cpu.cfs_period_us": "100000"}, None),  # unreadable
])
def test_cgroup_cpu_limit_reads_v1_and_v2_quotas(tmp_path, cgroup, files, limit):
    _tree(tmp_path / "fs", files)
    (tmp_path / "cgroup").write_text(cgroup)
    assert cgroup_cpu_limit(str(tmp_path / "cgroup"), str(tmp_path / "fs")) == limit
    assert cgroup_cpu_limit(str(tmp_path / "missing"), str(tmp_path / "fs")) is None


@pytest.mark.parametrize("limit,cores,calls", [(1.7, 4, [1]), (0.5, 4, [1]), (2.0, 4, [2]), (8.0, 4, []),
                                               (None, 4, [])])
def test_a_cgroup_quota_caps_the_threads(monkeypatch, limit, cores, calls):
    """``docker --cpus``: torch's count per physical core of the host, the quota's CPUs rounded down at most."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpu = FakeCpu(cpus=8)  # an idle 8-CPU host
    gov = CpuThreads(cores, read=cpu.read, set_threads=cpu.set_calls.append, clock=lambda: cpu.now.wall,
                     cpu_limit=lambda: limit)
    assert cpu.set_calls == calls and gov.threads == gov.cores == (calls or [cores])[0]
    cpu.advance(2.0, others=0.0, own=1.0)
    assert gov.update() == gov.cores  # the load rules never go above it


def test_read_cpu_times_sees_our_cpu_time_in_the_busy_time():
    before = read_cpu_times()
    spin_until = time.process_time() + 0.3
    while time.process_time() < spin_until:
        pass
    after = read_cpu_times()
    assert after.cpus == len(os.sched_getaffinity(0))
    own = after.own - before.own
    assert own >= 0.3 and after.busy - before.busy >= 0.8 * own and after.wall > before.wall


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])  # bfloat16: what the installer serves on such CPUs
def test_greedy_output_does_not_depend_on_the_thread_count(monkeypatch, dtype):
    """What lets the count change mid-request: 1 and 2 threads give the same tokens on the demo model. The engine
    step calls ``update`` and an engine out of work ``pause`` (held fixed here by OMP_NUM_THREADS so that the test
    sets the count itself)."""
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    llm = LLM(demo_dir(), device="cpu", dtype=dtype)
    updates, pauses = [], []
    monkeypatch.setattr(llm.engine.cpu_threads, "update", lambda: updates.append(1) or 1)
    monkeypatch.setattr(llm.engine.cpu_threads, "pause", lambda: pauses.append(len(updates)))
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
    assert pauses and pauses[-1] == len(updates)  # idle once the last generate finished
