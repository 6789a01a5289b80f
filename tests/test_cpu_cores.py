"""worker/cpu_cores.py: step cores and reserved cores, and graphs/background_builds.py's
deprioritize on a real child process."""

from __future__ import annotations

import os
import subprocess
import sys

from compiled_engine.graphs.background_builds import deprioritize
from compiled_engine.worker.cpu_cores import split_cores


def test_split_keeps_the_lowest_cores_for_steps_and_at_least_one():
    assert split_cores(1, {3, 0, 2, 1}) == ((0, 1, 2), (3,))
    assert split_cores(0, {4, 5}) == ((4, 5), ())
    assert split_cores(2, {7, 5}) == ((5,), (7,))  # asks for every core: one still runs steps
    assert split_cores(1, {0}) == ((0,), ())
    mine = split_cores(1)
    assert set(mine.step) | set(mine.other) == os.sched_getaffinity(0)


def test_deprioritize_idles_nices_and_pins_a_child_before_it_runs_anything():
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        last = max(os.sched_getaffinity(0))
        deprioritize(child.pid, 19, (last,))
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == 19
        # Idle class: any normal task waking on its core preempts it at once.
        assert os.sched_getscheduler(child.pid) == os.SCHED_IDLE
        assert os.sched_getaffinity(child.pid) == {last}
    finally:
        child.communicate(b"", timeout=30)
    deprioritize(child.pid, 19, (last,))  # it has exited: nothing to do, and no error
