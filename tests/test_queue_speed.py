"""scripts/queue_speed.py on a hand-built trace: which queues are slow in every step, by GPC and by L2 partition."""
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


def test_per_l2_partition_from_the_probe_map(tmp_path):
    """--l2map: l2_home_micro.cu's int32 partition per SM id (-1 unused) groups the SMs like the GPCs above."""
    f = tmp_path / "l2_home_sm.bin"
    np.array([-1, -1, -1, -1, 0, 1, 1, 0, 1], np.int32).tofile(f)
    parts = queue_speed.l2_partitions(str(f))
    assert parts == [[4, 7], [5, 6, 8]]
    lines = queue_speed.report(_trace(), None, range(2, 3), parts)
    # partition 0 = SMs 4, 7: step 0 queues 0 (1.0) and 3 (1.0); step 1 queues 0 (1.0) and 4 (1.1) -> +2.5%
    # partition 1 = SMs 5, 6, 8: step 0 queues 1, 2, 4 (1 + 1.03 + 1.1) / 3; step 1 queues 1, 2, 3 (1.0) -> +2.2%
    assert lines[4] == "  per L2 partition (size: mean execution vs the median queue): 2: +2.5%  3: +2.2%"
