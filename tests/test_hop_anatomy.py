"""scripts/hop_anatomy.py on hand-built traces (numbers checked by hand): the attention-chain block (medians over the
steps, the chain's end from the slowest group), the step outline and the phase table against the bytes."""
from __future__ import annotations

import importlib.util
import pathlib

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("hop_anatomy", ROOT / "scripts" / "hop_anatomy.py")
hop_anatomy = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hop_anatomy)

LABELS = ["L3.q[0:1].p0", "L3.attn[g0.s0]", "L3.attn[g0.s1]", "L3.attn[g1.s0]", "L3.attn_merge[g0]",
          "L3.attn_merge[g1]", "L3.o_proj[0:16]", "L3.o_proj[16:32]"]
BLOCKS = [0, 1, 2, 3, 4, 5, 6, 7]
# waits met / done in ns, per step (two steps): q starts the layer at 1000 ns, step 1 is step 0 shifted by 500
# ns with group 1's attention 2000 ns slower
T1 = [[1000, 8000, 8000, 8200, 13000, 12500, 15000, 15300]]
T2 = [[7000, 12000, 12500, 11900, 14700, 14000, 20000, 20100]]
T1.append([t + 500 for t in T1[0]])
T2.append([t + 500 + (2000 if i in (3, 5) else 0) for i, t in enumerate(T2[0])])
T1[1][5] += 2000   # group 1's merge then waits for its later attention


def _trace():
    n = len(LABELS)
    return {"t0": np.zeros((2, n), np.int64), "t1": np.array(T1, np.int64), "t2": np.array(T2, np.int64),
            "label": np.array(LABELS), "queue_sm": np.array(BLOCKS)}


def test_chain_reports_groups_merges_and_the_end_of_the_chain():
    d = _trace()
    fam, lay = hop_anatomy.families(d["label"])
    lines = hop_anatomy.chain(d, fam, lay, [3])
    # g0: exec 4.0 and 4.5 in both steps -> median 4.25; g1: 3.7 (step 0) and 5.7 (step 1) -> 4.70
    assert lines[1].split(": ")[1].split() == ["g0", "4.25", "g1", "4.70"]
    # merges: g0 on block 4: 1.70 both steps; g1 on block 5: 1.50 both steps (step 1 waits and ends 2 us later)
    assert lines[2].split(": ")[1].split() == ["g0@4", "1.70", "g1@5", "1.50"]
    # relative to each step's layer start (the q task's waits met: 1.0 / 1.5 us): step 0 last attention done 12.5 -
    # 1.0 = 11.5, last merge 14.7 - 1.0 = 13.7, o_proj met 15.0 - 1.0 = 14.0; step 1 (group 1 late) 14.4 - 1.5 =
    # 12.9, 16.5 - 1.5 = 15.0, 15.5 - 1.5 = 14.0 -> medians 12.20, 14.35, 14.00
    assert lines[3] == "  last attention done 12.20, last merge done 14.35, first o_proj waits met 14.00"


def test_chain_without_attention_says_so():
    d = _trace()
    fam, lay = hop_anatomy.families(d["label"])
    assert hop_anatomy.chain(d, fam, lay, [7]) == ["(no attention tasks in these layers)"]


def test_chain_without_merge_tasks_reports_no_merge():
    d = _trace()
    keep = np.array(["attn_merge" not in s for s in LABELS])   # a program whose o_proj merges (no merge tasks)
    d = {k: (v[:, keep] if v.ndim == 2 else v[keep]) for k, v in d.items()}
    fam, lay = hop_anatomy.families(d["label"])
    lines = hop_anatomy.chain(d, fam, lay, [3])
    assert len(lines) == 3 and not any("merge exec" in ln for ln in lines)
    assert lines[2] == "  last attention done 12.20, last merge done - (no merge tasks), first o_proj waits met 14.00"


def _step_trace():
    """Two steps of a two-layer program (ns): step 1 is step 0 one us later, with layer 1 two us longer."""
    labels = ["embed", "L0.q[0:1].p0", "L0.down[0:16]", "L1.q[0:1].p0", "L1.down[0:16]", "lm_head[0:10]",
              "lm_head[10:20]", "argmax"]
    t1 = [500, 3000, 20000, 62000, 100000, 121000, 121500, 211000]
    t2 = [2000, 9000, 60000, 70000, 120000, 200000, 210000, 212000]
    late = [0, 0, 0, 0, 2000, 2000, 2000, 2000]   # step 1: what follows layer 1's start, two us later
    T1 = [t1, [t + 1000 + dl for t, dl in zip(t1, late)]]
    T2 = [t2, [t + 1000 + dl for t, dl in zip(t2, late)]]
    n = len(labels)
    t0 = np.zeros((2, n), np.int64)
    t0[1] += 1000
    return {"t0": t0, "t1": np.array(T1, np.int64), "t2": np.array(T2, np.int64), "label": np.array(labels)}


def test_step_outline_by_hand():
    d = _step_trace()
    fam, lay = hop_anatomy.families(d["label"])
    lines = hop_anatomy.step_outline(d, fam, lay)
    # step 0 / 1 (us from each step's first entry): embed done 2.0 / 2.0, layer 0 at 3.0 / 3.0; layer 0 spans
    # 62 - 3 = 59 both; layer 1 to the LM head's first waits met 121 - 62 = 59 / 123 - 62 = 61 -> median 60
    assert lines[1] == "  embed done 2.00, layer 0 starts 3.00"
    assert lines[2] == "  layer spans: 59.0 60.0"
    assert lines[3] == "  layers: 119.0 in all; first 59.00, last (to the LM head) 60.00, the others 59.50 each"
    # LM head: first met 121 / 123 -> 122; exec 79 and 88.5 in both steps -> 83.75; last done 210 / 212 -> 211
    assert lines[4] == "  LM head: first waits met 122.00, median task exec 83.75, last done 211.00 (window 89.00)"
    assert lines[5] == "  argmax done 213.00, last task done 213.00; after the LM head 2.00"


def test_step_outline_needs_the_lm_head():
    d = _step_trace()
    keep = np.array(["lm_head" not in s for s in d["label"]])
    d = {k: (v[:, keep] if v.ndim == 2 else v[keep]) for k, v in d.items()}
    fam, lay = hop_anatomy.families(d["label"])
    assert hop_anatomy.step_outline(d, fam, lay) == ["(no layers or no LM head in this trace)"]


def _phase_trace(with_hbm: bool = True):
    """Two steps of one layer (L3) and the next layer's first q task (ns); step 1 is step 0 one us later with its
    down tile two us longer. hbm_bytes: q 3 MB, attention 0.6 MB, o_proj 3, gate/up 15, down 9 (and L4's q 3)."""
    labels = ["L3.q[0:1].p0", "L3.attn[g0.s0]", "L3.attn_merge[g0]", "L3.o_proj[0:16]", "L3.gate_up[0:64]",
              "L3.down[0:16]", "L4.q[0:1].p0"]
    t1 = [1000, 8000, 11500, 13000, 17500, 35500, 46000]
    t2 = [7000, 11000, 12500, 17000, 35000, 45000, 50000]
    T1 = [t1, [t + 1000 + (2000 if i == 6 else 0) for i, t in enumerate(t1)]]
    T2 = [t2, [t + 1000 + (2000 if i >= 5 else 0) for i, t in enumerate(t2)]]
    d = {"t0": np.zeros((2, len(labels)), np.int64), "t1": np.array(T1, np.int64), "t2": np.array(T2, np.int64),
         "label": np.array(labels), "est_bytes": np.array([4, 1, 1, 4, 16, 10, 4], np.int64) * 10**6}
    if with_hbm:
        d["hbm_bytes"] = np.array([3e6, 6e5, 0, 3e6, 15e6, 9e6, 3e6], np.int64)
    return d


def test_phase_excess_by_hand():
    d = _phase_trace()
    fam, lay = hop_anatomy.families(d["label"])
    lines = hop_anatomy.excess(d, fam, lay, [3], 3000.0)
    assert "hbm_bytes" in lines[0] and "3000 GB/s" in lines[0]
    rows = {ln[:16].strip(): [float(x) for x in ln[16:].split()] for ln in lines[2:-1]}
    assert lines[-1] == "scripts/ring_projection.py --layer qkv=6.00,chain=6.00,o_proj=4.00,gate_up=17.50,down=10.50"
    # QKV 1.0 -> 7.0 us; chain 7.0 -> o_proj's waits met 13.0; o_proj 13 -> 17; gate/up 17.5 -> 35; down 35.5 -> 45
    # (step 1: 36.5 -> 48, median 10.5); the next layer starts 45 / 47 us after this one's -> 46; gaps 46 - (6 + 6 +
    # 4 + 17.5 + 10.5) = 2; bytes at 3000 GB/s: 3 MB per us
    assert rows["QKV"] == [6.0, 3.0, 1.0, 5.0]
    assert rows["attention chain"] == [6.0, 0.6, 0.2, 5.8]
    assert rows["o_proj"] == [4.0, 3.0, 1.0, 3.0]
    assert rows["gate/up"] == [17.5, 15.0, 5.0, 12.5]
    assert rows["down"] == [10.5, 9.0, 3.0, 7.5]
    assert rows["gaps"] == [2.0, 2.0]
    assert rows["layer"] == [46.0, 30.6, 10.2, 35.8]


def test_phase_excess_of_an_older_trace_uses_est_bytes():
    d = _phase_trace(with_hbm=False)
    fam, lay = hop_anatomy.families(d["label"])
    lines = hop_anatomy.excess(d, fam, lay, [3], 2000.0)
    assert "est_bytes" in lines[0]
    assert lines[2].split()[1:] == ["6.00", "4.00", "2.00", "+4.00"]   # QKV: 4 MB at 2 MB per us
    assert hop_anatomy.excess(d, fam, lay, [7], 2000.0) == ["(no complete layer in these layers: no phase table)"]


def test_families_keep_step_zero_of_a_multi_step_trace():
    """A multi-step launch's later steps ('s1.' labels) are left out of the layer analysis; trace_breakdown.family
    counts them as their step-0 twins."""
    fam, lay = hop_anatomy.families(["L3.q[0:1]", "s1.L3.q[0:1]", "lm_head[0:8]", "s2.argmax"])
    assert fam.tolist() == ["q", "?", "lm_head", "?"] and lay.tolist() == [3, -1, -1, -1]
    assert hop_anatomy.family("s1.L3.gate_up[0:64]") == ("gate_up", 3)


def test_segments_and_ring_producer_marks(tmp_path):
    """A marks trace of a ring build (six marks per task): the four op segments count tasks by their first four
    marks only, and the producer's first / last stage issued are reported against each task's waits met, a
    one-stage task (no mark 5) counting its first stage as its last."""
    d = _trace()
    n = len(LABELS)
    marks = np.full((2, n, 6), -1, np.int64)
    for s in range(2):
        for i in (0, 6, 7):   # the q task and the two o_proj tasks ran with op marks 100 ns apart
            marks[s, i, :4] = [d["t1"][s, i] + 100 * (k + 1) for k in range(4)]
        for i in (6, 7):      # o_proj streamed: first stage 3 us before its waits met; task 6's last 1 us before
            marks[s, i, 4] = d["t1"][s, i] - 3000
        marks[s, 6, 5] = d["t1"][s, 6] - 1000
    np.savez(tmp_path / "t.npz", marks=marks, **d)
    z = np.load(tmp_path / "t.npz")
    fam, _ = hop_anatomy.families(z["label"])
    lines = hop_anatomy.segments(z, fam)
    q = next(ln for ln in lines if ln.startswith("q "))
    assert q.split()[1:5] == ["0.10", "0.10", "0.10", "0.10"]   # entry, stage, main loop, closing barrier
    i = next(k for k, ln in enumerate(lines) if "ring producer" in ln)
    rows = {ln.split()[0]: ln.split()[1:] for ln in lines[i + 1:]}
    # first stage: -3.00 in every o_proj task; last: task 6 -1.00, task 7 (one stage) -3.00 -> median -2.00
    assert rows == {"o_proj": ["-3.00", "-2.00"]}


def test_segments_without_producer_marks_has_no_ring_block(tmp_path):
    d = _trace()
    marks = np.full((2, len(LABELS), 4), -1, np.int64)
    marks[:, 0, :] = 5000
    np.savez(tmp_path / "t.npz", marks=marks, **d)
    z = np.load(tmp_path / "t.npz")
    fam, _ = hop_anatomy.families(z["label"])
    assert not any("ring producer" in ln for ln in hop_anatomy.segments(z, fam))


def test_ring_warp_stamps(tmp_path):
    """-DAMK_DBG_RING_STAMPS=1 traces (70 marks): per streamed task, each compute warp's first stage wait over
    (marks 38 + w) and items done (6 + w) after the input staged (mark 1); warps of a smaller build stay unset."""
    d = _trace()
    marks = np.full((2, len(LABELS), 70), -1, np.int64)
    for s in range(2):
        for i in (6, 7):
            t = int(d["t1"][s, i])
            marks[s, i, :4] = [t + 100, t + 1100, t + 9000, t + 9500]     # input staged at t + 1.1 us
            marks[s, i, 38:41] = [t + 2100, t + 2600, t + 3100]          # three warps: waits over 1.0 / 1.5 / 2.0
            marks[s, i, 6:9] = [t + 5100, t + 7100, t + 8100]            # items done 4.0 / 6.0 / 7.0
    np.savez(tmp_path / "t.npz", marks=marks, **d)
    z = np.load(tmp_path / "t.npz")
    fam, _ = hop_anatomy.families(z["label"])
    lines = hop_anatomy.segments(z, fam)
    i = next(k for k, ln in enumerate(lines) if "ring warps" in ln)
    # closing: main loop done (t + 9.0) - last warp's items (t + 8.1) = 0.90
    assert lines[i + 1].split() == ["o_proj", "1.00", "1.50", "2.00", "|", "4.00", "6.00", "7.00", "|", "0.90"]


def test_gaps_between_tasks_and_the_phases_last_tile():
    # queue 0: q -> L2_PREFETCH -> o_proj; queue 1: attention -> o_proj (ns: reached / waits met / done, one step)
    labels = ["L3.q[0:1].p0", "L3.prefetch[0:64]", "L3.o_proj[0:16]", "L3.attn[g0.s0]", "L3.o_proj[16:32]"]
    d = {"label": np.array(labels), "queue_sm": np.array([0, 0, 0, 1, 1]), "queue_pos": np.array([0, 1, 2, 0, 1]),
         "t0": np.array([[0, 7500, 11000, 0, 12600]]), "t1": np.array([[1000, 8000, 11500, 8000, 13000]]),
         "t2": np.array([[7000, 9000, 16000, 12000, 15000]])}
    fam, lay = hop_anatomy.families(d["label"])
    lines = hop_anatomy.gaps(d, fam, lay, [3])
    # gaps, largest first: prefetch -> o_proj 11.0 - 9.0 = 2.00; attn -> o_proj 12.6 - 12.0 = 0.60; q -> prefetch
    # 7.5 - 7.0 = 0.50
    assert [ln.split()[:4] for ln in lines[1:4]] == [["prefetch", "->", "o_proj", "2.00"],
                                                     ["attn", "->", "o_proj", "0.60"],
                                                     ["q", "->", "prefetch", "0.50"]]
    # o_proj's last tile (done 16.0) ran after the prefetch task; its waits met 11.5 against the median 12.25
    assert "  o_proj     prefetch 1 (-0.75)" in lines
