"""benchmarks/tree_memory.py: the tree's RSS sum counts a page a forked child shares with its parent in both, its PSS
sum once (what the pair takes from the machine), against a hand-made pair: a process that wrote 256 MiB and forked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from benchmarks.tree_memory import TreeSampler, tree_pss, tree_rss

pytestmark = pytest.mark.slow  # starts processes

MIB = 1 << 20
PAIR = ("import os, sys, time\n"
        "b = bytearray(256 << 20)\n"
        "for i in range(0, len(b), 4096): b[i] = 1\n"  # every page written: resident, then shared by the fork
        "if os.fork() == 0:\n"
        "    time.sleep(60); os._exit(0)\n"
        "print('ready', flush=True); sys.stdin.read()\n")


@pytest.fixture
def pair():
    proc = subprocess.Popen([sys.executable, "-c", PAIR], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.2)  # the child forked before the parent printed
        yield proc.pid
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_rss_counts_the_shared_buffer_twice_pss_once(pair):
    rss, rss_parts = tree_rss(pair)
    pss, pss_parts = tree_pss(pair)
    assert len(rss_parts) == len(pss_parts) == 2
    assert rss > 2 * 256 * MIB and all(r > 256 * MIB for _, _, r in rss_parts)  # each process: the whole buffer
    assert 256 * MIB < pss < 256 * MIB + 80 * MIB  # the buffer once (two interpreters' own pages besides)
    assert all(120 * MIB < p < 200 * MIB for _, _, p in pss_parts)  # half the buffer each


def test_the_sampler_keeps_both_peaks(pair):
    with TreeSampler(pair, interval_s=0.05, pss_every=2) as sampler:
        time.sleep(0.4)
    assert sampler.peak.rss > 2 * 256 * MIB and 256 * MIB < sampler.peak_pss.rss < 336 * MIB
    assert len(sampler.peak_pss.parts) == 2
