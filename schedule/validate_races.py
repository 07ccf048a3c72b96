"""Section 5 of the program validator (schedule/validate.py, whose docstring states the rules): race freedom on
ACTIVATION / IO_OUTPUT / KV_CACHE buffers over the happens-before graph, the reads of unwritten scratch, the KV
rules per decode step, claim groups and accumulations. A mixin of ``_Validator``: it uses the graph state that
``_check_graph`` builds (``order``, ``preds``, ``pos``) and the per-task accesses ``acc``."""
from __future__ import annotations

from schedule.ir import BufferKind, name_step

RACE_KINDS = (BufferKind.ACTIVATION, BufferKind.IO_OUTPUT, BufferKind.KV_CACHE)


def _bits(m: int):
    while m:
        low = m & -m
        yield low.bit_length() - 1
        m ^= low


class RaceChecks:
    # -- 5. races --------------------------------------------------------------------------------------------
    def _check_races(self) -> None:
        """Ancestor bitsets indexed by topological rank, computed in topological order and freed once every
        successor has used them. Each access is checked against the overlapping accesses of tasks *earlier* in
        the order (a later task cannot be an ancestor), so every unordered pair is found exactly once."""
        p, n = self.p, len(self.p.tasks)
        task_order = [v for v in self.order if v < n]
        rank = {v: r for r, v in enumerate(task_order)}
        by_buf: dict[int, list] = {}
        for i in range(n):
            for a in self.acc[i]:
                if self.kinds[a.buffer] in RACE_KINDS:
                    by_buf.setdefault(a.buffer, []).append((i, a.lo, a.hi, a.write, a.write and a.acc))
        # (buffer, lo, hi, write, accumulate, conflict mask, writer mask). An accumulation (y += v, atomic) reads and
        # writes; it conflicts with plain writes and reads, not with other accumulations (their order only moves
        # the rounding)
        per_task: list[list] = [[] for _ in range(n)]
        gmask: dict[int, int] = {}   # claim counter -> its members' rank bits (their writes may overlap)
        for i, c in getattr(self, "claim_group", {}).items():
            gmask[c] = gmask.get(c, 0) | 1 << rank[i]
        # a multi-step launch (steps_per_launch): a KV access is at the row of the 'pos' IO buffer its task reads
        # (pos@s for step s); KV rules that are per step compare accesses of one step only
        kstep = self._kv_steps()
        smask: dict[int, int] = {}   # step -> rank bits of its KV-accessing tasks
        for i, st in kstep.items():
            smask[st] = smask.get(st, 0) | 1 << rank[i]
        before = {st: sum(m for t, m in smask.items() if t < st) for st in smask}   # rank bits of earlier steps
        self.wranges: dict[int, dict[int, list]] = {}    # buffer -> rank -> written ranges
        flagged = self.flagged
        for b in flagged & set(by_buf):   # a flagged element: one write per launch (its tag names the launch only)
            ws = sorted((lo, hi, i) for i, lo, hi, wr, _ in by_buf[b] if wr)
            for (lo0, hi0, i0), (lo1, hi1, i1) in zip(ws, ws[1:]):
                if lo1 < hi0:
                    self.err("flag-rewrite", f"{self.T(i0)} and {self.T(i1)} both write the data-flagged "
                                             f"{self.B(b)} around [{lo1}, {min(hi0, hi1)}): a flagged element may be "
                                             f"written once per launch (a reader cannot tell two writes apart)")
        for b, accs in by_buf.items():
            groups: dict[tuple[int, int], list[int]] = {}    # (lo, hi) -> [writer, reader, accumulator mask]
            wr_b = self.wranges.setdefault(b, {})
            for i, lo, hi, wr, ac in accs:
                groups.setdefault((lo, hi), [0, 0, 0])[2 if ac else 0 if wr else 1] |= 1 << rank[i]
                if wr and not ac:
                    wr_b.setdefault(rank[i], []).append((lo, hi))
            keys = sorted(groups)
            ov = {k: list(groups[k]) for k in keys}        # OR over overlapping ranges, the range itself included
            for x, kx in enumerate(keys):                  # sorted by lo: scan right until lo >= kx's hi
                y = x + 1
                while y < len(keys) and keys[y][0] < kx[1]:
                    ky = keys[y]
                    for z in (0, 1, 2):
                        ov[kx][z] |= groups[ky][z]
                        ov[ky][z] |= groups[kx][z]
                    y += 1
            for i, lo, hi, wr, ac in accs:
                w, r, a = ov[(lo, hi)]
                g = gmask.get(self.claim_group.get(i, -1), 0) if wr and not ac else 0   # fellow members' writes
                per_task[i].append((b, lo, hi, wr, ac, (w | r) if ac else ((w & ~g) | r | a) if wr else (w | a), w))
                same = w & smask.get(kstep.get(i, 0), -1) & ~(1 << rank[i])   # this step's other writers
                if wr and self.kinds[b] == BufferKind.KV_CACHE and same:
                    o = task_order[(same & -same).bit_length() - 1]
                    if o > i:   # report each pair once
                        self.err("kv-clobber", f"{self.T(i)} and {self.T(o)} both write {self.B(b)} around "
                                               f"[{lo}, {hi}) in one step: the cache persists, so one write is lost "
                                               f"to later steps (two layers sharing a cache?)")
        for b in (b for b in range(len(p.buffers)) if self.kinds[b] == BufferKind.IO_OUTPUT):
            gap = _first_gap(0, self.numel[b], [r for rs in self.wranges.get(b, {}).values() for r in rs])
            if gap is not None:
                self.err("uninit", f"{self.B(b)}: output element {gap} is never written in the step")
        uses = [len(s) for s in self.succ]
        # anc: happens-before ancestors for memory (data waits are no edge: the producer's release is not acquired);
        # full: every dependency edge -- a flagged read is ordered after its writer by polling, which terminates
        # only if the writer is a dependency ancestor of the reader
        anc: dict[int, int] = {}
        full: dict[int, int] = {}
        data = self.data_waits
        self.read_after_write: set[tuple[int, int]] = set()   # (task, buffer): some read has an earlier writer
        memo: dict[tuple, int | None] = {}
        reported: set[tuple[int, int, int]] = set()
        checked = 0
        for v in self.order:
            m = mf = 0
            for u in self.preds[v]:
                bit = 1 << rank[u] if u < n else 0
                if data:
                    mf |= full[u] | bit
                if not (u >= n and (v, u - n) in data):
                    m |= anc[u] | bit
                uses[u] -= 1
                if not uses[u]:
                    del anc[u]
                    full.pop(u, None)
            if uses[v]:
                anc[v] = m
                if data:
                    full[v] = mf
            if not data:
                mf = m
            if v >= n or not per_task[v]:
                continue
            r = rank[v]
            unordered = ((1 << r) - 1) & ~m        # earlier in the order and not an ancestor
            for b, lo, hi, wr, ac, conf, wmask in per_task[v]:
                checked += 1
                if b in flagged and not wr:   # a flagged read: its writers must be dependency ancestors
                    late = wmask & ~mf
                    if late:
                        u = task_order[(late & -late).bit_length() - 1]
                        self.err("flag-order", f"{self.T(v)} polls the data-flagged {self.B(b)} around [{lo}, {hi}),"
                                               f" which {self.T(u)} writes without being a dependency ancestor of "
                                               f"it: the poll could wait forever")
                    conf &= ~(wmask & mf)
                if not wr or ac:   # an accumulation reads what it adds to
                    aw = wmask & (mf if b in flagged else m)
                    if self.kinds[b] == BufferKind.KV_CACHE and v in kstep:
                        aw &= smask[kstep[v]]   # the row at pos: this step's append
                        late = wmask & before[kstep[v]] & ~m   # the history rows earlier steps of the launch append
                        if late:
                            self.err("race", f"{self.T(v)} reads {self.B(b)} around [{lo}, {hi}) at a later step "
                                             f"than {self.T(task_order[(late & -late).bit_length() - 1])}, which "
                                             f"appends to it, without being ordered after it")
                    if aw:
                        self.read_after_write.add((v, b))
                    key = (b, lo, hi, aw)
                    if key not in memo:
                        memo[key] = _first_gap(lo, hi, [x for u in _bits(aw) for x in self.wranges[b][u]])
                    if memo[key] is not None:
                        what = ("a slot this step's K/V append has not written" if self.kinds[b] == BufferKind.KV_CACHE
                                else "NaN-poisoned scratch")
                        self.err("uninit", f"{self.T(v)} reads element {memo[key]} of {self.B(b)} (range [{lo}, "
                                           f"{hi})) that no task ordered before it writes in this step: {what}")
                bad = conf & unordered
                if bad:
                    u = task_order[(bad & -bad).bit_length() - 1]
                    if (u, v, b) not in reported:
                        reported.add((u, v, b))
                        self._report_race(b, v, u, lo, hi, wr, rank, ac)
        self.stats["race_accesses_checked"] = checked

    def _kv_steps(self) -> dict[int, int]:
        """Task -> the decode step of the KV row it accesses, for tasks with a KV_CACHE access: the step of the
        'pos' IO_INPUT buffer it reads ('pos' 0, 'pos@s' s; step_io in schedule/lower.py). A task reading no such
        buffer counts as step 0."""
        steps = {b.id: name_step(b.name, "pos") for b in self.p.buffers
                 if self.kinds.get(b.id) == BufferKind.IO_INPUT and name_step(b.name, "pos") is not None}
        out = {}
        for i in range(len(self.p.tasks)):
            if any(self.kinds.get(a.buffer) == BufferKind.KV_CACHE for a in self.acc[i]):
                out[i] = next((steps[a.buffer] for a in self.acc[i] if a.buffer in steps), 0)
        return out

    def _report_race(self, b: int, v: int, u: int, lo: int, hi: int, v_writes: bool, rank: dict,
                     v_acc: bool = False) -> None:
        where = f"{self.B(b)} around [{lo}, {hi})"
        u_writes = any(x[0] < hi and lo < x[1] for x in self.wranges[b].get(rank[u], ()))
        u_acc = any(a.write and a.acc and a.buffer == b and a.lo < hi and lo < a.hi for a in self.acc[u])
        if v_acc or u_acc:
            acc_t, other = (v, u) if v_acc else (u, v)
            self.err("race", f"race: {self.T(acc_t)} accumulates into {where} with no happens-before order "
                             f"against {self.T(other)}, which reads or writes it (accumulations may only be unordered "
                             f"among themselves)")
            return
        if v_writes and u_writes:
            self.err("race", f"race: unordered writers {self.T(u)} and {self.T(v)} both write {where}")
            return
        writer, reader = (v, u) if v_writes else (u, v)
        if (reader, b) in self.read_after_write:
            self.err("race", f"race: write-after-read on reused scratch: {self.T(writer)} overwrites {where} "
                             f"without being ordered after {self.T(reader)}, which reads it")
        else:
            self.err("race", f"race: read not ordered after its write: {self.T(reader)} reads {where}, which "
                             f"{self.T(writer)} writes, with no happens-before order between them")


def _first_gap(lo: int, hi: int, ranges: list[tuple[int, int]]) -> int | None:
    """The first element of [lo, hi) not covered by ``ranges`` (None if covered)."""
    cur = lo
    for a, b in sorted(ranges):
        if a > cur:
            break
        cur = max(cur, b)
        if cur >= hi:
            return None
    return cur if cur < hi else None
