"""How many threads the CPU path computes with: torch's count, less a thread for each core other processes keep busy.

Why: torch's CPU ops run on OpenMP threads that spin-wait for each other at the end of every op. When another
process holds one of the cores, one of our threads is descheduled for a whole time slice at each op while the
others spin. On 2 cores beside one busy process, the demo model decoded at 0.8-1.4 tok/s with 2 threads and 8 tok/s
with 1 (14.5 with 2 threads on an idle machine; ``appliance bench``, bench/RESULTS.md, sixteenth session).

Policy (``CpuThreads.update``), once per ``INTERVAL_S`` of wall time while the engine steps:

* the other processes' load is the busy CPU time of the CPUs this process may run on, less this process's own, per
  second, in cores; the free cores are those CPUs less that load;
* the count drops to the free cores rounded (halves up) when that is below it, and rises to the free cores less 0.1
  rounded when that is above it: a load between 0.4 and 0.5 of a core moves nothing either way (no flapping);
* a process that takes whatever CPU we leave it (a niced batch job) looks like load only while we leave it a core,
  so every ``PROBE_S`` a reduced count tries torch's full count again for one interval and keeps it if the load
  then measured allows it;
* at least 1 thread, at most torch's count at start (``torch.get_num_threads()``, one per physical core), and at
  most the CPUs a cgroup quota grants, rounded down (``docker --cpus 2`` on a 16-core host: 2; torch does not read
  quotas, and 16 threads in a 2-CPU quota are throttled in turn while the others spin; :func:`cgroup_cpu_limit`);
* the engine calls ``pause`` when it runs out of work: the next look at a step only starts a new window (a
  wait is not judged there, however long a step takes);
* while a server waits for requests it calls ``idle_look`` about once per ``INTERVAL_S`` and as it wakes: each
  judges the time since the last idle look (or the pause; short steps between short waits included, at least half
  an interval) the same way, with niced CPU time left out (a niced job yields its cores once we step); it never
  starts a probe and puts the next one a full period away; so a request that is one step long (a prompt with
  ``max_tokens`` 1) beside a busy process starts at the reduced count (without it such requests were never
  judged and each ran with every thread: 5-16 s against 0.2-0.6 s for a one-token chat answer of the demo model
  beside a busy loop, the README trial of the twenty-third session);
* a change is logged at INFO at most once a minute (the rest at DEBUG); a probe that keeps the full count always,
  and so is a return to the full count after an INFO line gave a lower one; a count other than the last INFO line
  gave is told at the first look a minute after that line (so the log never leaves a stale count standing: a
  trial user read a drop at INFO, with its return at DEBUG, as the engine stuck on one thread);
* ``OMP_NUM_THREADS`` in the environment fixes the count, and so does a failure to read the CPU times (logged).

Greedy tokens of the demo model are the same with 1 and 2 threads (tests/test_cpu_threads.py); other models may
round differently with another count, so a request's tokens can depend on the machine's load.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

logger = logging.getLogger(__name__)

#: Seconds of wall time between two looks at the load (a look costs tens of microseconds).
INTERVAL_S = 1.0
#: Seconds between two tries of the full count while it is reduced.
PROBE_S = 30.0
#: Seconds between two INFO lines about the count.
LOG_EVERY_S = 60.0


def threads_for(cores: int, free: float, current: int) -> int:
    """The thread count to use next, at most ``cores``, when ``free`` cores are left by other processes and
    ``current`` threads run now: down to ``round(free)`` (halves up), up to ``round(free - 0.1)``."""
    down, up = int(free + 0.5), int(free + 0.4)
    target = down if down < current else up if up > current else current
    return max(1, min(cores, target))


@dataclass
class CpuTimes:
    """One reading: ``wall`` (s, monotonic), ``busy`` (s of CPU time the CPUs this process may use spent outside
    idle and iowait since boot), ``own`` (s of CPU time this process spent, all threads), ``cpus`` (how many CPUs
    this process may use), ``nice`` (s of ``busy`` spent in niced processes)."""

    wall: float
    busy: float
    own: float
    cpus: int
    nice: float = 0.0


def _quota(directory: Path) -> float | None:
    """CPUs the cgroup ``directory``'s own quota grants: v2 ``cpu.max`` ("max 100000" or "200000 100000"), v1
    ``cpu.cfs_quota_us`` (-1: none) over ``cpu.cfs_period_us``; None without one."""
    if (directory / "cpu.max").is_file():
        quota, period = (directory / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    if (directory / "cpu.cfs_quota_us").is_file():
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        return None if quota < 0 else quota / int((directory / "cpu.cfs_period_us").read_text())
    return None


def cgroup_cpu_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs this process's cgroup quotas grant (quota / period, the smallest on its cgroup's path up to the
    hierarchy's root: a container's ``--cpus``), or None when none is set or it cannot be read. cgroup v2 (the
    ``0::`` line of ``proc_cgroup``; mounted at ``root``, or at ``root``/unified beside v1) and v1 (the hierarchy
    whose controllers include cpu, mounted at ``root``/<its controllers>). Source: the kernel's cgroup-v2 and
    cfs-bandwidth documentation."""
    base = Path(root)
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
        limits = []
        for line in lines:
            _, controllers, path = line.split(":", 2)
            if controllers == "":
                mount = base if (base / "cgroup.controllers").is_file() else base / "unified"
            elif "cpu" in controllers.split(","):
                mount = base / controllers if (base / controllers).is_dir() else base / "cpu"
            else:
                continue
            directory = mount / path.lstrip("/")
            while True:
                quota = _quota(directory)
                if quota is not None:
                    limits.append(quota)
                if directory == mount or mount not in directory.parents:
                    break
                directory = directory.parent
        return min(limits) if limits else None
    except (OSError, ValueError):
        return None


def read_cpu_times() -> CpuTimes:
    """The current ``CpuTimes``. Raises OSError or psutil.Error when the counters cannot be read."""
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    per_cpu = psutil.cpu_times(percpu=True)
    cpus = [t for i, t in enumerate(per_cpu) if usable is None or i in usable]
    busy = sum(sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0)
               - getattr(t, "guest_nice", 0.0) for t in cpus)  # guest time is counted in user time already
    nice = sum(getattr(t, "nice", 0.0) for t in cpus)
    return CpuTimes(time.monotonic(), busy, time.process_time(), len(cpus), nice)


class CpuThreads:
    """Adapts torch's CPU thread count to the load of other processes (see the module docstring).

    Call ``update`` from the thread that runs the model (OpenMP's thread count is that thread's setting), before
    each step. ``read``, ``set_threads`` and ``clock`` are injectable for tests.
    """

    def __init__(self, cores: int | None = None, read: Callable[[], CpuTimes] = read_cpu_times,
                 set_threads: Callable[[int], None] = torch.set_num_threads,
                 clock: Callable[[], float] = time.monotonic, interval_s: float = INTERVAL_S,
                 probe_s: float = PROBE_S, cpu_limit: Callable[[], float | None] = cgroup_cpu_limit):
        self.cores = cores or torch.get_num_threads()
        self._read, self._set, self._clock = read, set_threads, clock
        self._interval, self._probe_every = interval_s, probe_s
        self.fixed = "OMP_NUM_THREADS" in os.environ
        limit = None if self.fixed else cpu_limit()
        if limit is not None and int(limit) < self.cores:
            logger.info("CPU threads %d -> %d: the cgroup's CPU quota grants %.2f CPUs (OMP_NUM_THREADS fixes it)",
                        self.cores, max(1, int(limit)), limit)
            self.cores = max(1, int(limit))
            self._set(self.cores)
        self.threads = self.cores
        self._last: CpuTimes | None = None if self.fixed else self._safe_read()
        self._next_probe: float | None = None  # while the count is reduced: when to try the full count again
        self._probe_from: int | None = None  # the count a running probe came from
        self._logged = float("-inf")  # when the last INFO line went out
        self._announced = self.cores  # the count the last INFO line gave (the start's full count before any)
        self._idle_last: CpuTimes | None = None  # the last idle look's reading, while the engine waits

    def _safe_read(self) -> CpuTimes | None:
        try:
            return self._read()
        except (OSError, psutil.Error) as e:
            logger.warning("cannot read the CPU times (%s): the CPU thread count stays at %d", e, self.threads)
            self.fixed = True
            return None

    def pause(self) -> None:
        """The engine has no work: the next ``update`` starts a new window instead of judging the idle time; the
        wait's window for ``idle_look`` starts here (once per wait)."""
        self._last = None
        if self._idle_last is None and not self.fixed:
            self._idle_last = self._safe_read()

    def idle_look(self) -> int:
        """While the engine waits (paused; call about every INTERVAL_S): judge the wait since the last idle look
        (or the pause), niced time left out, without probes; set and return the thread count."""
        if self.fixed:
            return self.threads
        now, last = self._safe_read(), self._idle_last
        if now is None or last is None or now.wall - last.wall < self._interval / 2:
            self._idle_last = last or now  # a window too short to judge goes on
            return self.threads
        self._idle_last = now
        spent = (now.busy - last.busy) - (now.nice - last.nice) - (now.own - last.own)
        others = max(0.0, spent) / (now.wall - last.wall)
        threads = threads_for(self.cores, now.cpus - others, self.threads)
        # measured without our threads competing: the next probe is a full period away
        self._next_probe = None if threads >= self.cores else now.wall + self._probe_every
        probing, self._probe_from = self._probe_from, None  # a probe running when the engine went idle ends here
        if probing is not None and threads == self.threads:  # its full count is kept: told as update() tells it
            self._log(f"stays at {threads}", threads, others, now, quiet=False, always=True)
        return self._apply(threads, others, now, quiet=probing is not None)

    def _apply(self, threads: int, others: float, now: CpuTimes, quiet: bool) -> int:
        """Set the count to ``threads`` if it changes (logged, :meth:`_log`); else, where the last INFO line gave
        another count (a change told at DEBUG) and a minute has passed since it, tell the count at INFO. Return the
        count."""
        if threads != self.threads:
            self._log(f"{self.threads} -> {threads}", threads, others, now, quiet)
            self._set(threads)
            self.threads = threads
        elif threads != self._announced and not quiet and now.wall - self._logged >= LOG_EVERY_S:
            self._log(f"now {threads}", threads, others, now, quiet)  # a change told at DEBUG only, told again
        return self.threads

    def update(self) -> int:
        """Look at the load if an interval has passed since the last look; set and return the thread count."""
        if self.fixed:
            return self.threads
        if self._last is None:  # paused: this look starts a window
            self._last = self._safe_read()
            return self.threads
        if self._clock() - self._last.wall < self._interval:
            return self.threads
        now = self._safe_read()
        if now is None:
            return self.threads
        last, self._last = self._last, now
        self._idle_last = None  # a window of steps judged: a later wait starts its own
        others = max(0.0, (now.busy - last.busy) - (now.own - last.own)) / (now.wall - last.wall)
        threads = threads_for(self.cores, now.cpus - others, self.threads)
        ended, self._probe_from = self._probe_from, None
        if threads >= self.cores:
            self._next_probe = None
        elif self._next_probe is None or ended is not None:
            self._next_probe = now.wall + self._probe_every
        elif threads == self.threads and now.wall >= self._next_probe:
            threads, self._probe_from = self.cores, self.threads  # a probe: the next look decides at full count
        if ended is not None and threads == self.threads:  # the probe's full count is kept: the load went away
            self._log(f"stays at {threads}", threads, others, now, quiet=False, always=True)
        return self._apply(threads, others, now, quiet=self._probe_from is not None or threads == ended)

    def _log(self, what: str, to: int, others: float, now: CpuTimes, quiet: bool, always: bool = False) -> None:
        """A probe and its return are DEBUG; a probe that keeps the full count is INFO, and so is a return to the
        full count after an INFO line gave a lower one; other changes to ``to`` threads are INFO at most once a
        ``LOG_EVERY_S`` (DEBUG in between)."""
        back = to == self.cores and self._announced != self.cores
        info = always or (not quiet and (back or now.wall - self._logged >= LOG_EVERY_S))
        if info:
            self._logged, self._announced = now.wall, to
        (logger.info if info else logger.debug)(
            "CPU threads %s: other processes keep %.1f of %d CPUs busy%s (OMP_NUM_THREADS fixes it)", what, others,
            now.cpus, "; trying the full count" if self._probe_from else "")
