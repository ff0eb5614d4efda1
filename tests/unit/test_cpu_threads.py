"""The CPU's per-step thread choice: a busy machine leaves a core free, an idle one gets every core."""

import os
import subprocess
import sys
import time

import pytest
import torch

from tokenmill.worker import cpu_threads
from tokenmill.worker.cpu_threads import CpuThreads, OthersLoad

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2 or not OthersLoad.readable(),
                                reason="needs two cores and /proc/stat")


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    num_cpus = len(os.sched_getaffinity(0))
    yield CpuThreads(num_cpus, num_cpus - 1)
    torch.set_num_threads(before)


def test_another_busy_process_keeps_a_core_free(threads):
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(cpu_threads.WINDOW_S + 0.2)
        threads.before_step()
    finally:
        spinner.kill()
    assert not threads._others_idle
    assert threads.current == torch.get_num_threads() == threads.fewer


def test_steps_take_every_core_while_the_others_are_idle(threads):
    threads._others_idle, threads._window_end = True, time.monotonic() + 60
    threads.before_step()
    assert torch.get_num_threads() == threads.all_cores
