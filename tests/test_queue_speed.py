"""scripts/queue_speed.py on a hand-built trace: which queues are slow in every step, and by GPC."""
from __future__ import annotations

import numpy as np

from scripts import queue_speed


def _trace():
    """Two steps, one layer (L2), gate/up on 5 queues: queue 4 is 10% slower in both steps, queue 2 3% slower in
    step 0. Blocks 3 and 4 swap SMs 7 <-> 8 between the steps; GPCs {4, 5, 6} and {7, 8}."""
    labels = np.array([f"L2.gate_up[{16 * q}:{16 * q + 16}]" for q in range(5)] + ["L2.down[0:8]"])
    ex = np.array([[10.0, 10.0, 10.3, 10.0, 11.0, 5.0], [10.0, 10.0, 10.0, 10.0, 11.0, 5.0]]) * 1e3   # ns
    t1 = np.zeros((2, 6), np.int64) + 1000
    t2 = (t1 + ex).astype(np.int64)
    smid = np.array([[4, 5, 6, 7, 8, 4], [4, 5, 6, 8, 7, 4]])
    return {"t0": t1.copy(), "t1": t1, "t2": t2, "label": labels, "queue_sm": np.array([0, 1, 2, 3, 4, 0]),
            "smid": smid}


def test_strip_marks_slow_queues_by_step():
    lines = queue_speed.report(_trace(), None, range(2, 3))
    assert lines[0].startswith("gate_up:")
    assert lines[1] == "  step 0: ..+.#"      # medians 10.0: 10.3 is +3%, 11.0 +10%
    assert lines[2] == "  step 1: ....#"
    assert lines[3] == "  median queue 10.00 us; slow queues (1): 4 (+10%, SM 7/8)"
    assert lines[5] == "  step 0: .    "      # down: one queue, the others run none
    assert lines[-1] == "  median queue 5.00 us; slow queues (0): none"


def test_per_gpc_mean():
    lines = queue_speed.report(_trace(), [[4, 5, 6], [7, 8]], range(2, 3))
    # GPC {4,5,6}: queues 0-2, step 0 (1 + 1 + 1.03) / 3, step 1 1.0 -> +0.5%; GPC {7,8}: queues 3, 4: (1 + 1.1) / 2
    assert lines[4] == "  per GPC (size: mean execution vs the median queue): 3: +0.5%  2: +5.0%"
