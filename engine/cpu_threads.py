"""How many threads the CPU path computes with: the cores torch would use, less the ones other processes keep busy.

Why: torch's CPU ops run on OpenMP threads that spin-wait for each other at the end of every op. When another
process holds one of the cores, one of our threads is descheduled for a whole time slice at each op while the
others spin. On 2 cores beside one busy process, the demo model decoded at 0.8-1.4 tok/s with 2 threads and 8 tok/s
with 1 (14.5 with 2 threads on an idle machine; ``appliance bench``, bench/RESULTS.md, sixteenth session). vLLM's
CPU backend leaves a core to other work for the same reason; here the count follows the load.

Policy (``threads_for``): every ``INTERVAL_S`` of stepping, the other processes' load is the machine's busy CPU time
less this process's, per second of wall time, in cores; the engine keeps ``round(cores - load)`` threads (halves
round up, at least 1, at most ``cores``). Our own threads' spinning counts as ours, so a count we set does not
feed back into the load we measure. ``OMP_NUM_THREADS`` in the environment fixes the count: nothing adapts then.
Greedy output does not depend on the count (tests/test_cpu_threads.py checks 1 against 2 threads on the demo model).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil
import torch

logger = logging.getLogger(__name__)

#: Seconds of stepping between two looks at the load (a look costs tens of microseconds).
INTERVAL_S = 1.0


def threads_for(cores: int, others_load: float) -> int:
    """Threads to compute with on ``cores`` cores while other processes keep ``others_load`` cores busy."""
    return max(1, min(cores, int(cores - others_load + 0.5)))


@dataclass
class CpuTimes:
    """One reading: ``wall`` (s, monotonic), ``busy`` (s of CPU time the machine's usable cores spent outside idle
    and iowait since boot), ``own`` (s of CPU time this process spent, all threads)."""

    wall: float
    busy: float
    own: float


def read_cpu_times() -> CpuTimes:
    """The current ``CpuTimes``, over the cores this process may run on."""
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    per_cpu = psutil.cpu_times(percpu=True)
    cores = [t for i, t in enumerate(per_cpu) if usable is None or i in usable]
    busy = sum(sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0)
               - getattr(t, "guest_nice", 0.0) for t in cores)  # guest time is counted in user time already
    return CpuTimes(time.monotonic(), busy, time.process_time())


class CpuThreads:
    """Adapts torch's CPU thread count to the load of other processes (see the module docstring).

    Call ``update`` from the thread that runs the model (OpenMP's thread count is that thread's setting), before
    each step. ``read`` and ``set_threads`` are injectable for tests.
    """

    def __init__(self, cores: int | None = None, read: Callable[[], CpuTimes] = read_cpu_times,
                 set_threads: Callable[[int], None] = torch.set_num_threads, interval_s: float = INTERVAL_S):
        self.fixed = "OMP_NUM_THREADS" in os.environ
        self.cores = cores or torch.get_num_threads()
        self.threads = self.cores
        self._read, self._set, self._interval = read, set_threads, interval_s
        self._last = None if self.fixed else read()

    def update(self) -> int:
        """Look at the load if ``interval_s`` has passed since the last look; set and return the thread count."""
        if self.fixed:
            return self.threads
        now = self._read()
        elapsed = now.wall - self._last.wall
        if elapsed < self._interval:
            return self.threads
        others = max(0.0, (now.busy - self._last.busy) - (now.own - self._last.own)) / elapsed
        self._last = now
        threads = threads_for(self.cores, others)
        if threads != self.threads:
            logger.info("CPU threads %d -> %d: other processes keep %.1f of %d cores busy (OMP_NUM_THREADS fixes it)",
                        self.threads, threads, others, self.cores)
            self._set(threads)
            self.threads = threads
        return self.threads
