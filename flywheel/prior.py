"""The single source of schedule knobs: their choices, defaults and meaning (plus the learned prior in later code).

Defaults are the best measured point (docs/PERF.md, H100, 2026-11-22/23): sm_assignment auto and attn_splits auto
('list_idle' with 4 splits on the llama presets and qwen3-1.7b, 8 on qwen3-0.6b at ctx 512),
prefetch_depth 0, qkv_head_split auto (2 on the presets), wait_prefetch_kb 64, mlp_prefetch_kb 192
(gate rows first),
lm_head_rows auto (tiles of <= 512 rows in whole waves) and auto row tiles (gemv/mlp rows 16/64 on llama-3.2-1b).
With the row tiles and splits (fifth session) llama-3.2-1b bf16 ran at ctx 512 in ~1390 us in an interleaved A/B, vs
2254 us for the first defaults (attn_splits 1, prefetch_depth 2, rows 16/32/64); ~1230 us since the tenth session.
At ctx 8192 / 32768 the auto split (16 on 132 SMs) ran in 1686 / 2407 us vs 1908 / 3311 us with 8 splits and the MLP
prefetch (fifth session).

``ScheduleConfig`` (schedule/ir.py), ``harness.search_space()`` and ``schemas/schedule_config.schema.json`` are all
derived from ``KNOBS``. Every knob changes the lowered program, the kernel build or a launch parameter; tests/schedule/test_knobs.py
proves it knob by knob.
"""
from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Knob:
    name: str
    type: type
    default: Any
    choices: tuple = ()            # allowed values (ints / strings / bools); empty when a range is given
    range: tuple[int, int] | None = None   # inclusive [lo, hi] for ints
    multiple_of: int = 1
    affects: str = "program"       # "program" (lowering), "build" (kernel compile flags) or "launch" (a launch
                                   # parameter of the built kernel: vm.loader.launch_knobs)
    doc: str = ""

    def check(self, value: Any) -> str | None:
        """None if ``value`` is acceptable, else a message naming the knob."""
        if self.type is bool:
            if not isinstance(value, bool):
                return f"{self.name}: expected a boolean, got {type(value).__name__} {value!r}"
            return None
        if self.type is int:
            if isinstance(value, bool) or not isinstance(value, int):
                return f"{self.name}: expected an integer, got {type(value).__name__} {value!r}"
        elif self.type is str and not isinstance(value, str):
            return f"{self.name}: expected a string, got {type(value).__name__} {value!r}"
        if self.choices and value not in self.choices:
            return f"{self.name}: {value!r} is not one of {list(self.choices)}"
        if self.range is not None and not (self.range[0] <= value <= self.range[1]):
            return f"{self.name}: {value} is outside [{self.range[0]}, {self.range[1]}]"
        if self.type is int and self.multiple_of > 1 and value % self.multiple_of:
            return f"{self.name}: {value} is not a multiple of {self.multiple_of}"
        return None


KNOBS: tuple[Knob, ...] = (
    Knob("gemv_rows", int, 0, choices=(0, 4, 8, 16, 32, 64, 128),
         doc="output rows per GEMV task for o_proj and down_proj (smaller = more, finer tasks); 0 = auto: the "
             "smallest warp-friendly count whose tiles fit one wave of SMs (16 on llama-3.2-1b, 8 on qwen3-0.6b)"),
    Knob("mlp_rows", int, 0, choices=(0, 4, 8, 16, 32, 64, 128),
         doc="output rows per fused gate/up (SiLU*up) task; 0 = auto, as for gemv_rows (64 on llama-3.2-1b)"),
    Knob("lm_head_rows", int, 0, choices=(0, 16, 32, 64, 128, 256, 512),
         doc="vocabulary rows per LM-head task; 0 = auto: at most 512; a head of more tiles than SMs becomes one "
             "wave of one tile per SM where those are at most 2048 rows (on 132 SMs the llama presets: 132 tiles of "
             "972 rows, H100 -0.2..-0.4%; qwen3: 1152 rows, -1.0%), else its tile count rounded up to whole waves of "
             "SMs (sizes within one row)"),
    Knob("dyn_mlp_rows", int, 0, choices=(0, 1, 4, 8, 16, 32),
         doc="gate/up as one claim group instead of static row tiles: a task on every SM computes its own rows "
             "(dyn_mlp_static), then draws tickets for chunks of this many rows until none is left, so SMs that "
             "stream slower take fewer rows (in some processes the 16 SMs of one H100 GPC stream gate/up ~13% "
             "slower in every step, docs/PERF.md thirty-sixth session); 1 = each warp draws its own one-row tickets "
             "(no block barrier), larger = block-wide chunks, each ending in a barrier. 0 = static tiles (mlp_rows). "
             "Not with fuse_down. Off by default: H100, llama-3.2-1b, in a process without the slow GPC, 1 with "
             "dyn_mlp_static 100 measured equal (+0.2%), 90 +0.9%; block chunks 16 / 8 / 4 +1.0% / +4.9% / +20%"),
    Knob("dyn_mlp_static", int, 0, choices=(0, 50, 75, 85, 90, 100),
         doc="with dyn_mlp_rows: the rows each member computes as its own static tile before it draws tickets, in % "
             "of an even share (rounded down to 4 rows; llama-3.2-1b: 100 = 60 of 62 rows); the rest go out by "
             "ticket. 0 = the own tile is one chunk too"),
    Knob("balance_tiles", bool, False, choices=(False, True),
         doc="round the tile counts of o_proj, down, gate/up and the LM head up to a multiple of the SM count "
             "(tile sizes then differ by at most one row): no SM idles in the last wave of a phase"),
    Knob("qkv_heads", int, 1, choices=(1, 2, 4, 8),
         doc="query heads per QKV task (a task never straddles a KV group); K and V are one head per task"),
    Knob("qkv_head_split", int, 0, choices=(0, 1, 2, 4, 8),
         doc="QKV tasks per head (each takes a slice of the head's RoPE pairs) so the QKV phase uses more SMs; "
             "only with qkv_heads=1 and where it divides head_dim/2. With QK-norm (Qwen3) the split tasks write the "
             "raw rows and one QK_NORM_ROPE task per KV group applies QK-norm and RoPE (one more hop). 0 = auto: "
             "the largest split whose QKV tasks fit one wave of SMs next to the attention tasks the idle "
             "placement puts beside them (sm_assignment auto / list_idle, few splits), else in one wave alone: 2 on "
             "the presets (qwen3-0.6b: 4 before, 1.7-3.4% slower on the H100 and H200, docs/PERF.md twenty-fourth "
             "session)"),
    Knob("attn_splits", int, 0, range=(0, 64),
         doc="split-KV: the sequence of each KV head is split across this many tasks, merged by online softmax; "
             "0 = auto: for KV caches of up to 2048 positions the most of 8 and 4 whose n_kv_heads x splits tasks "
             "fit the SMs the QKV phase leaves idle, where sm_assignment is 'auto' or 'list_idle' (8 only next to "
             "QKV tasks of at most 128 KiB: 8 on qwen3-0.6b, 4 on qwen3-1.7b and the llama presets), else 8; "
             "beyond, SMs // n_kv_heads (one wave of attention tasks, at least 8)"),
    Knob("flag_hops", str, "off", choices=("off", "all", "residual", "residual_attn"),
         doc="data-flagged activations (schedule/flags.py): buffers stored as 8-byte words (value | the launch's tag) "
             "without a fence, which the GEMV-family tasks reading them poll instead of spinning on the producers' "
             "counter (data and readiness in one round trip). 'residual' = the residual stream (the hops o_proj -> "
             "gate/up and down -> QKV / LM head), 'residual_attn' + the merged attention output (merge -> o_proj), "
             "'all' + the MLP's h (gate/up -> down). A buffer whose accesses are not all ones the kernel implements "
             "flagged (vm.abi.FLAG_SLOTS) keeps its counter, and a choice whose program the validator refuses (a "
             "multi-step launch with 'all') is REJECTED. The kernel's flag code is compiled in only for flagged "
             "programs: in every build it cost 3.1%. Off by default: H100, llama-3.2-1b ctx 512, against the default "
             "program in the flag build 'residual' +0.6%, 'all' +2.7% (against the default build +3.7% / +5.8%); "
             "qwen3-0.6b 'all' +1.0%, ctx 8192 +0.3% (docs/PERF.md, forty-seventh session)"),
    Knob("fuse_attn_merge", bool, False, choices=(False, True),
         doc="with split-KV attention, merge the partials inside each o_proj task while it stages its input "
             "instead of in one ATTN_MERGE task per KV head (one dependent hop fewer per layer; every o_proj task "
             "then reads all partials); ATTN_MERGE tasks stay where the partials do not fit the o_proj task's "
             "shared memory. Off by default: equal or slower on an H100 (docs/PERF.md, ninth session)"),
    Knob("fold_qk_norm", bool, True, choices=(True, False),
         doc="QK-norm models (Qwen3) whose QKV tasks are split below whole heads: the attention tasks finish the "
             "RAW q rows themselves (QK-norm + RoPE of their group's G heads) and the task whose keys end at pos "
             "finishes the group's new K row into the cache, instead of one QK_NORM_ROPE task per KV group between "
             "the QKV tiles and attention (one dependent hop fewer per layer; the same bits). No effect on other "
             "models. qwen3-0.6b on an H100: ctx 512 -2.4% (both code layouts faster), ctx 8192 +0.4% (one layout, "
             "noise level) (docs/PERF.md, thirty-eighth session)"),
    Knob("o_proj_by_group", bool, False, choices=(False, True),
         doc="o_proj split by KV group (split-K): each o_proj task merges only its KV group's split-KV partials "
             "and adds W_o[rows, group's columns] . merged into the layer's residual stream x in place (atomic fp32 "
             "adds), so it starts when its group's attention is done and no ATTN_MERGE hop remains; the weight is "
             "stored as one contiguous column block per group; implies attn_wait 'layer' (every QKV task has read x "
             "before any o_proj task adds to it). Sums in whatever order the tasks finish: not bit-reproducible. Off by "
             "default: slower on an H100 (llama-3.2-1b +1.6%, qwen3-0.6b +1.0%, ctx 8192 +0.5%; the layer-wide "
             "attention wait costs more than the merge hop it removes, docs/PERF.md, eighteenth session)"),
    Knob("fuse_down", bool, False, choices=(False, True),
         doc="down_proj split-K into the MLP tiles: each gate/up task keeps its SiLU*up rows on chip and adds "
             "W_down[:, its rows] . h into the next layer's residual stream (atomic fp32 adds; the o_proj tiles seed "
             "it with their output rows), so no h buffer and no down-proj hop remain; W_down is stored as one "
             "contiguous column block per tile. Only with fuse_residual and without o_proj_by_group (they leave no whole "
             "o_proj rows to seed it; the down tiles stay then). Sums in whatever order "
             "the tasks finish: not bit-reproducible. Off by default: on an H100 qwen3-0.6b -1.1%, llama-3.2-1b "
             "-0.1% to +2% (build noise), llama-3.1-8b +4.6% (docs/PERF.md, nineteenth session)"),
    Knob("attn_wait", str, "group", choices=("group", "layer"),
         doc="what a layer's attention tasks wait for: their own KV group's QKV tasks ('group': each group's "
             "attention starts as soon as its q, K and V rows are written) or every QKV task of the layer ('layer': "
             "one counter; attention then reads q after the QKV phase has stopped streaming). 'layer' measured equal on "
             "llama-3.2-1b, H100 (docs/PERF.md, seventeenth session)"),
    Knob("sm_assignment", str, "auto", choices=("auto", "list", "list_idle", "lpt", "round_robin"),
         doc="task->SM policy: 'list' = dependency-aware earliest finish (ties to the lowest SM index), "
             "'list_idle' = the same with ties to the SM idle longest and each layer's QKV tasks placed before its "
             "attention, so attention lands on the SMs the QKV phase leaves idle and (early_kv hint) loads its KV "
             "before its wait, 'lpt' = balance bytes greedily, 'round_robin' = task i on SM i mod n; 'auto' = "
             "'list_idle' where a layer's attention tasks fit those idle SMs (the presets at ctx <= 2048, with "
             "attn_splits auto), else 'list'"),
    Knob("early_kv", str, "auto", choices=("auto", "on", "off", "ahead"),
         doc="the early_kv hint of attention tasks (the kernel then issues the KV history rows of their first tiles "
             "before their wait): 'on' = every attention task, 'off' = none, 'auto' = a layer's attention tasks when "
             "the list policies estimate that every one of them idles on its SM at least as long as its KV takes to "
             "stream (what the idle placement of sm_assignment gives; right behind a QKV task the copies measured "
             "1.4% slower, docs/PERF.md, thirteenth session); at ctx 8192 / 32768, where auto hints none, 'on' "
             "measured -0.2..-1.1% on llama presets but +0.9% on qwen3-0.6b at 8192 (twenty-fifth session); "
             "'ahead' = every attention task queued right behind a weight tile (QKV, GEMV without merged "
             "partials, gate/up) gets its KV history issued by that task, at its start (into a stage region at the "
             "top of shared memory that no other op uses), the others as 'auto'. Not in 'auto': with the attention "
             "stages 128-byte aligned it measured equal to 'auto' (H100, llama-3.2-1b ctx 8192 / 32768 +0.0% / "
             "+0.1%; before the alignment its region's aligned stages were what gained; thirty-seventh session)"),
    Knob("split_argmax", bool, True, choices=(True, False),
         doc="the next token's argmax in two steps: one ARGMAX_PARTIAL per LM-head tile (right after it) and one "
             "ARGMAX_MERGE over the tiles' winners, instead of one ARGMAX task reading the whole vocabulary on one "
             "SM after the last tile"),
    Knob("argmax_in_lm_head", bool, True, choices=(True, False),
         doc="with split_argmax: each LM-head tile computes its own (max, index) pair in its epilogue (GEMV "
             "has_argmax) and one ARGMAX_PAIRS task merges the pairs in one round trip, instead of an "
             "ARGMAX_PARTIAL task behind every tile re-reading its logits and an ARGMAX_MERGE gathering the "
             "candidates' logits (two round trips). H100, interleaved: llama-3.2-1b -1.1%, qwen3-0.6b -0.8%, "
             "llama-3.2-3b -0.3% (docs/PERF.md, twenty-second session)"),
    Knob("steps_per_launch", int, 1, range=(1, 16),
         doc="greedy decode steps per launch: the step's task graph repeated, step s+1's embedding waiting on step "
             "s's argmax and reading its token on the device, at position pos + s (the kernel's last block "
             "advances pos by this many). One launch's end (the launch gap, the argmax tail, the embedding, layer "
             "0's cold start) is paid once per this many tokens. The logits of every step are kept (logits, "
             "logits@1, ...); a step() returns the first's. Default 1: 8 measured -1.5..-1.7% on llama-3.2-1b at "
             "ctx 512, -1.9% at 8192, -1.1% at 32768, -0.2% on qwen3-0.6b, +0.5% on llama-3.2-3b (H100; docs/PERF.md, "
             "forty-second session)"),
    Knob("step_placement", str, "continue", choices=("continue", "replicate"),
         doc="with steps_per_launch > 1: where the later steps' tasks run. 'continue' = the SM assignment policy "
             "runs on over all steps (a later step's task lands where the estimate frees an SM first: on "
             "llama-3.2-1b with 4 steps 6% of the later steps' tasks move), 'replicate' = every step's task on the SM of step "
             "0's copy of it (step 0 placed as the one-step program is; a queue holds its step-0 tasks, then the "
             "same tasks of step 1, ...). Measured equal with 8 steps (H100, ctx 512: llama-3.2-1b -1.5% / -1.4% "
             "against one step, llama-3.2-3b -0.0% / +0.1%; docs/PERF.md, forty-third session). No effect with one "
             "step"),
    Knob("num_sms", int, 0, range=(0, 1024),
         doc="SMs (persistent blocks) to use; 0 = all SMs of the target"),
    Knob("fuse_norm", bool, True, choices=(True, False),
         doc="recompute RMSNorm inside each consuming GEMV task instead of a separate RMSNORM task"),
    Knob("fuse_residual", bool, True, choices=(True, False),
         doc="add the residual inside the o_proj/down_proj tile instead of separate ADD tasks"),
    Knob("threads_per_block", int, 512, range=(128, 1024), multiple_of=32, affects="build",
         doc="threads per persistent block (kernel build flag and launch)"),
    Knob("wait_prefetch_kb", int, 64, choices=(0, 32, 64, 128, 256), affects="launch",
         doc="KB of a task's own weights asked into L2 when it must wait on a counter (0 = off): HBM works while "
             "the SM waits; tasks that need not wait prefetch nothing"),
    Knob("wait_prefetch_next_kb", int, 0, choices=(0, 64, 128, 256, 512), affects="launch",
         doc="KB of the NEXT queued task's weights also asked into L2 while a task waits (after its own "
             "wait_prefetch_kb; 0 = off): an SM idle during the attention hops fetches the head of its next tile. "
             "Off by default: 64-512 KB measured 0.6-6.6% slower on llama-3.2-1b (H100, H200; seventeenth session)"),
    Knob("wait_prefetch_pace_kb", int, 0, choices=(0, 4, 8, 16, 32), affects="launch",
         doc="KB of a waiting task's L2 prefetches (wait_prefetch_kb + wait_prefetch_next_kb) requested per poll "
             "of its wait (about one per microsecond); 0 = all at once when the wait begins. 0 by default: 16 KB per "
             "poll measured 1.6% slower on llama-3.2-1b (H100)"),
    Knob("preload_kb", int, 0, choices=(0, 64, 128, 160, 192), affects="launch",
         doc="KB of shared memory for the whole-tile weight preload (sm_90+, 0 = off; > 0 also selects the kernel "
             "build with the preload path): GEMV-family tasks whose tile fits are bulk-copied into it before they "
             "wait, while the block runs the tasks in between"),
    Knob("mlp_prefetch_kb", int, 192, choices=(0, 64, 128, 192, 256, 384, 512),
         doc="KB of each gate/up tile asked into L2 by an L2_PREFETCH task while the attention hops leave HBM "
             "mostly idle (which rows: mlp_prefetch_from; 0 = no prefetch tasks). Emitted only where the attention "
             "tasks leave at least half of the SMs idle (n_kv_heads x splits <= SMs / 2). 192 with 'gate' measured "
             "1.1-2.2% faster than 64 with 'both' on llama-3.2-1b, 0.7% on llama-3.2-3b, 0.2% on llama-3.1-8b, "
             "within noise on qwen3-0.6b (H100); 0.6% slower on the H200 (twentieth session)"),
    Knob("mlp_prefetch_at", str, "qkv", choices=("layer", "qkv", "attn"),
         doc="what releases the L2_PREFETCH tasks of a layer: its input ready ('layer'), its last KV group's QKV "
             "tiles (and QK_NORM_ROPE task) done ('qkv'), or attention done ('attn'); only with mlp_prefetch_kb > 0"),
    Knob("mlp_prefetch_spread", bool, False, choices=(False, True),
         doc="with mlp_prefetch_from 'gate': at most one L2_PREFETCH task per SM free when the layer's last QKV "
             "group is done (its QKV SMs less those given a merge); the gate/up tiles past that many are cut into "
             "row ranges and each task asks for its own tile's head plus one range, so no SM runs two prefetch "
             "tasks in front of its o_proj tile (whose loads queue behind the requests). Off by default: H100, "
             "ctx 512, llama-3.2-1b -0.7% / -0.2% / -0.2% / -0.6% in four A/Bs, "
             "llama-3.2-3b +0.2%, qwen3-0.6b -0.1% (docs/PERF.md, forty-first session). Only with "
             "mlp_prefetch_kb > 0"),
    Knob("mlp_prefetch_from", str, "gate", choices=("gate", "both"),
         doc="which rows of a gate/up tile the L2_PREFETCH task asks for: its gate rows first, then its up rows "
             "('gate'), or equal heads of both ('both'). A warp loads a gate row and its up row together, so with "
             "'gate' every load pairs an L2 hit with an HBM read and the HBM keeps streaming; with 'both' the first "
             "rows of every warp come from L2 while the HBM idles (192 KB on llama-3.2-1b, H100: 'both' measured "
             "equal to the old 64 KB, 'gate' 2.2% faster). Only with mlp_prefetch_kb > 0"),
    Knob("mlp_prefetch_delay_ns", int, 0, choices=(0, 500, 1000, 1500, 2000, 3000),
         doc="ns an L2_PREFETCH task waits before its requests go out (released with the attention tasks, its "
             "misses may queue in front of their q loads). H100, mlp_prefetch_kb 192: llama-3.2-1b 1000 equal, "
             "1500 +0.9%, 2000 +2.2%, 3000 +4.4%; qwen3-0.6b 1500 equal, 2000 -1.0% (twenty-first session); "
             "only with mlp_prefetch_kb > 0"),
    Knob("prefetch_depth", int, 0, range=(0, 4), affects="build",
         doc="how many queued tasks ahead each block prefetches weights into L2 (0 = no prefetch)"),
    Knob("ring_stages", int, 0, choices=(0, 2, 3, 4, 6, 8, 12), affects="build",
         doc="stages of the sm_90+ bulk-copy weight ring (0 = off: the register streaming path, the default; "
             "ignored before sm_90): a producer warp streams every GEMV-family tile's rows into shared memory "
             "from the launch's start (vm/csrc/stream.cuh). Shrunk with a warning where the stages do not fit next "
             "to the largest op area. Off by default: on llama-3.2-1b it measured 31-32% slower than the register "
             "path (H200, 8 x 16 KB; docs/PERF.md, forty-fifth session)"),
    Knob("ring_stage_kb", int, 16, choices=(8, 16, 32, 64), affects="build",
         doc="KB per weight-ring stage (a stage holds whole rows of each of a task's matrices; tasks whose rows do "
             "not fit a stage take the register path); only with ring_stages > 0"),
    Knob("ring_window", int, 0, range=(0, 11), affects="build",
         doc="weight-ring copies in flight at most (issued, not landed), below ring_stages; 0 = auto: 2 (1 with 2 "
             "stages). A deep ring with few bytes in flight keeps the hops' small loads from queueing behind it "
             "(scripts/pipe_micro.cu: window 2 of 12 x 16 KB 811 us against 930 with no window); only with "
             "ring_stages > 0"),
)
KNOB_BY_NAME = {k.name: k for k in KNOBS}


def defaults() -> dict[str, Any]:
    return {k.name: k.default for k in KNOBS}


def search_space() -> list[dict]:
    """Every knob with its choices or range, default, and one-line meaning (documented in HARNESS.md)."""
    out = []
    for k in KNOBS:
        d = {"name": k.name, "type": k.type.__name__, "default": k.default, "affects": k.affects, "doc": k.doc}
        if k.choices:
            d["choices"] = list(k.choices)
        if k.range:
            d["range"] = list(k.range)
        if k.multiple_of > 1:
            d["multiple_of"] = k.multiple_of
        out.append(d)
    return out


# -- the learned prior: sensible discrete values, random samples, neighbour mutations, the best corpus point ------
# Range knobs (attn_splits 1..64, num_sms 0..1024, threads 128..1024) are too wide to sample uniformly: most of
# num_sms's range does not exist on any GPU. ``candidate_values`` turns every knob into a short ordered list
# (clipped to the target's caps) that both the random explorer and the neighbour mutation walk.
def candidate_values(knob: Knob | str, target: Any = None) -> list:
    """An ordered list of values worth trying for ``knob`` (its choices, or a coarse grid of its range)."""
    k = KNOB_BY_NAME[knob] if isinstance(knob, str) else knob
    if k.choices:
        return list(k.choices)
    lo, hi = k.range
    m = k.multiple_of
    if k.name == "num_sms" and target is not None:
        n = int(target.sm_count)
        vals = {0} | {max(1, n * f // 8) for f in (1, 2, 4, 6, 7)}
        return sorted(v for v in vals if lo <= v <= min(hi, n))
    if k.name == "threads_per_block" and target is not None:
        hi = min(hi, int(target.max_threads_per_block))
    if (hi - lo) // m <= 8:            # narrow: every value
        vals = set(range(lo + (-lo) % m, hi + 1, m))
    elif m > 1:                         # wide with a multiple (threads): a grid of 4 warps
        step = max(m, 128)
        vals = {lo, hi} | set(range(lo + (-lo) % step, hi + 1, step))
    else:                               # wide: both ends and the powers of two between
        vals = {lo, hi} | {2 ** e for e in range(hi.bit_length()) if lo <= 2 ** e <= hi}
    if lo <= k.default <= hi:
        vals.add(k.default)
    return sorted(v for v in vals if k.check(v) is None)


def ring_window_too_big(cfg: dict[str, Any]) -> bool:
    """The one rule between knobs: a weight ring's window (copies in flight; 0 = auto) must be below its stages."""
    return bool(cfg.get("ring_stages", 0)) and cfg.get("ring_window", 0) >= cfg["ring_stages"]


def consistent(cfg: dict[str, Any]) -> list[str]:
    """Move knobs a sampler set against each other back into agreement, in place (ScheduleConfig refuses the
    combination when a user writes it): the weight ring's window below its stages. Returns what moved."""
    if not ring_window_too_big(cfg):
        return []
    moved = f"ring_window {cfg['ring_window']}->{cfg['ring_stages'] - 1} (below ring_stages)"
    cfg["ring_window"] = cfg["ring_stages"] - 1
    return [moved]


def random_config(rng, target: Any = None) -> dict[str, Any]:
    """One uniformly random point of the discretised space (``rng`` is a ``random.Random``)."""
    cfg = {k.name: rng.choice(candidate_values(k, target)) for k in KNOBS}
    consistent(cfg)
    return cfg


def mutate(config: dict[str, Any], rng, target: Any = None, n_changes: int | None = None) -> tuple[dict, list[str]]:
    """Move 1-2 knobs of ``config`` to a neighbouring candidate value. Returns (new config, descriptions)."""
    cfg = {**defaults(), **config}
    n = n_changes if n_changes is not None else rng.choice((1, 1, 2))
    names = rng.sample([k.name for k in KNOBS], min(n, len(KNOBS)))
    changed = []
    for name in names:
        vals = candidate_values(name, target)
        if len(vals) < 2:
            continue
        cur = cfg[name]
        if cur in vals:
            i = vals.index(cur)
        else:  # off-grid value (hand-written config): start from the nearest grid point
            i = min(range(len(vals)), key=lambda j: abs(vals[j] - cur) if not isinstance(cur, str) else 0)
        if isinstance(cur, (bool, str)):  # unordered: any other choice is a neighbour
            new = rng.choice([v for v in vals if v != cur])
        else:
            j = i + rng.choice((-1, 1))
            j = 1 if j < 0 else (len(vals) - 2 if j >= len(vals) else j)
            new = vals[j] if vals[j] != cur else vals[i]
        if new != cur:
            cfg[name] = new
            changed.append(f"{name} {cur}->{new}")
    changed += consistent(cfg)
    return cfg, changed


def _rank_key(rec: dict) -> tuple:
    v = rec.get("verdict", {})
    measured = v.get("latency_kind") == "measured-gpu"
    return (0 if measured else 1, float(v.get("latency_us") or float("inf")), int(v.get("tasks") or 0))


def best_corpus_point(model: str, gpu: str, corpus_path: str, require_correct: bool = True) -> dict | None:
    """The best kept corpus record for ``model`` + ``gpu`` ({"config", "verdict", ...}), or None.

    Measured-GPU points beat predicted ones; then lower latency, then fewer tasks. Records whose config no longer
    passes the current KNOBS (a knob renamed or removed since) are skipped.
    """
    from flywheel.log import read_corpus
    best = None
    for rec in read_corpus(corpus_path, model=model, gpu=gpu):
        v, cfg = rec.get("verdict") or {}, rec.get("config")
        if not isinstance(cfg, dict) or v.get("latency_us") is None:
            continue
        if require_correct and v.get("correct") is not True:
            continue
        if any(k not in KNOB_BY_NAME or KNOB_BY_NAME[k].check(x) for k, x in cfg.items()):
            continue
        if best is None or _rank_key(rec) < _rank_key(best):
            best = rec
    return best
