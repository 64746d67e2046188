"""A process's own memory figures."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest

from geofm.memory import peak_resident_bytes

MIB = 2**20


def _own_peaks() -> dict[str, float]:
    """Every memory figure the project reports, read in a fresh process, in MiB."""
    import torch

    from benchmarks.common import peak_rss_mib
    from geofm.fl.client_round import peak_memory_bytes

    return {
        "geofm.memory": peak_resident_bytes() / MIB,
        "bench": peak_rss_mib(),
        "client round": peak_memory_bytes(torch.device("cpu")) / MIB,
    }


@pytest.mark.slow  # starts a process
def test_a_spawned_child_reports_its_own_peak_not_its_parents():
    held = b"\x01" * (2048 * MIB)  # every page written: resident
    parent = peak_resident_bytes() / MIB
    assert parent >= 2048
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        child = pool.submit(_own_peaks).result()
    del held
    # The child holds an interpreter and torch (about 0.9 GiB with its libraries), far below the parent's
    # 2 GiB; ru_maxrss, carried across exec, would read at least the parent's peak.
    assert all(peak < parent - 1024 for peak in child.values()), (parent, child)
