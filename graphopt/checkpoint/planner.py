"""Which activations to keep and which to recompute under a memory budget.

Selection is a knapsack over the nodes of a training graph (:class:`graphopt.cost.activations.ActivationModel`
says what autograd saves and how many bytes, the cost model what recomputing costs): nodes move
to "recompute" cheapest recompute-seconds per byte freed first (views and casts, then norms,
activations and other elementwise ops, then GEMMs/convolutions, attention last) until the plan
fits. The graph is cut into regions; a plan's memory is accounted as its backend runs it: every
kept node's storages cached (:meth:`_Selector.account`, selective checkpoint) or, for the AOT
backend, a walk over the backward in the order it runs with only the values it reads
(:meth:`_Selector.account_needed`). When no one-level plan fits, runs of regions go under an
outer checkpoint (:meth:`_Selector.nest`); if that fails too, ``BudgetError`` states the minimum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from graphopt import ir
from graphopt.cost.activations import ActivationModel, format_bytes, layer_of
from graphopt.errors import BudgetError

from .extract import mutated_args

# region sizes tried (recomputed bytes per region, as shares of the baseline saved bytes)
REGION_SHARES = (0.005, 0.01, 0.02, 0.03, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5)


@dataclass
class Plan:
    keep: set
    regions: list  # lists of body nodes, in order
    saved_bytes: float  # held for backward after the forward (kept outputs, region inputs)
    transient_bytes: float  # beyond saved_bytes at the worst moment of backward (a region recomputed)
    extra_s: float  # predicted recomputation time
    crossing_bytes: float = 0.0
    notes: list = field(default_factory=list)
    recomputed: set | None = None  # the nodes that rerun (AOT accounting: only those backward needs)
    saved_roots: set | None = None  # the storages saved for backward (AOT accounting)
    early: dict = field(default_factory=dict)  # AOT: recomputed nodes rerun early by a recompute chain
    segments: list = field(default_factory=list)  # AOT: (first, last) region runs under an outer checkpoint
    walk: dict | None = None  # AOT: the memory walk nest() reads
    # AOT: what the regions save, by the walk, before outer checkpoints drop any (what the AOT
    # partitions and the regions left as captured save, together; the rewrite compares the two)
    one_level_saved: float | None = None

    @property
    def total_bytes(self) -> float:
        return self.saved_bytes + self.transient_bytes


# attention is recomputed last (its kernel's time per byte freed is close to a GEMM's, but recomputing it
# also reruns the q/k/v chain it reads)
_ATTENTION_OPS = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
                  "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                  "_flash_attention_forward", "_efficient_attention_forward", "_scaled_dot_product_flash_attention_for_cpu"}


def _tier(n: fx.Node) -> int:
    return 1 if isinstance(n.target, torch._ops.OpOverload) and ir.op_name(n) in _ATTENTION_OPS else 0


class _Selector:
    """Chooses what to keep. ``aot``: the plan is realized by the AOT backend, whose backward
    saves exactly the values it needs that are kept (or cross a region boundary) and reruns only
    the recomputed nodes it needs; the accounting then walks back from what backward reads
    (:meth:`account_needed`). Otherwise (selective checkpoint) every kept node's storages are
    cached and every recomputed node reruns (:meth:`account`)."""

    def __init__(self, am: ActivationModel, hints: dict | None = None, keep_random: bool = False,
                 aot: bool = False):
        self.am = am
        self.aot = aot
        body = am.body
        self.index = {n: i for i, n in enumerate(body)}
        self.held_roots = am.saved_roots()
        self.last: dict = {}
        for i, n in enumerate(body):
            for a in n.all_input_nodes:
                r = am.root.get(a, a)
                if r in self.index:
                    self.last[r] = max(self.last.get(r, -1), i)
        for r in am.outputs:
            if r in self.index:
                self.last[r] = len(body)
        # each step, a region copies the buffers it updates in place (for its recomputation)
        mutated = {a for n in body for a in mutated_args(n) if a.op in ("get_attr", "placeholder")}
        self.scratch_bytes = sum(float(ir.concrete(t.nbytes, hints)) for a in mutated for t in ir.infos(a))
        # parameters (that get gradients) each node reads, for a region's gradient transient
        self.params_of: dict = {}
        self.param_bytes: dict = {}
        for n in body:
            for a in n.all_input_nodes:
                if a.op == "get_attr" and isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].requires_grad:
                    self.params_of.setdefault(n, []).append(a.target)
                    self.param_bytes[a.target] = sum(float(ir.concrete(t.nbytes, hints)) for t in ir.infos(a))
        # the backward's working set at each node (as ActivationModel.backward_working_bytes)
        self.work_pos = [am.node_working_bytes(n) for n in body]
        self.working = am.backward_working_bytes()
        # an AOT region's backward may hold the gradients of its outputs until it returns (torch
        # without boxed gradients for custom autograd Functions): priced in the walk
        self.grads_in_held = False
        if aot:
            from .aot import frees_incoming_grads

            self.grads_in_held = not frees_incoming_grads()
        self.forced_recompute = set()
        self.forced_keep = set()
        self.random = {n for n in body if ir.is_random(n)}  # (asked of every region of every plan tried)
        for n in body:
            val = n.meta.get("val")
            makes_tensors = isinstance(val, (torch.Tensor, tuple, list))
            if am.root.get(n) is n and n in am.outputs:
                self.forced_keep.add(n)  # the caller holds it anyway
            elif keep_random and n in self.random and makes_tensors:
                self.forced_keep.add(n)  # the AOT backend never reruns a random op (no RNG replay)
            elif self.cost_bytes(n) <= 0 or mutated_args(n) or not makes_tensors:
                # views/aliases (keeping one would pin its base), buffer updates (rerun on
                # scratch copies), non-tensor values
                self.forced_recompute.add(n)

    def cost_bytes(self, n) -> float:
        """Memory a kept node holds: the selective checkpoint caches every new storage its ops
        return (its output, what it saves, its temporaries)."""
        own = self.am.bytes.get(n, 0.0) if self.am.root.get(n) is n else 0.0
        return max(own + self.am.extra.get(n, 0.0), self.am.made.get(n, 0.0))

    def order(self) -> list:
        """Candidates to recompute, cheapest recompute-seconds per byte freed first (memory-bound
        norms, casts, activations and elementwise ops before GEMMs/convolutions, tiny tensors such
        as a norm's statistics late), attention last."""
        cands = [n for n in self.am.body if n not in self.forced_keep and n not in self.forced_recompute]
        return sorted(cands, key=lambda n: (_tier(n), self.am.seconds[n] / max(self.cost_bytes(n), 1.0),
                                            self.index[n]))

    def evaluate(self, keep: set, cap: float) -> Plan:
        """The plan for a kept set: regions cut where few unkept bytes cross (checkpoint holds a
        region's inputs), each region's recomputed bytes near ``cap``; its memory and time."""
        am, body = self.am, self.am.body
        held = lambda r: r in keep or r in am.outputs  # noqa: E731
        # bytes of unkept tensors live across the boundary after each position
        ends: dict = {}
        live = 0.0
        crossing_at = []
        work_of = []
        for i, n in enumerate(body):
            if am.root.get(n) is n and self.last.get(n, -1) > i and not held(n):
                live += am.bytes.get(n, 0.0)
                ends.setdefault(self.last[n], []).append(n)
            for r in ends.pop(i, []):
                live -= am.bytes.get(r, 0.0)
            crossing_at.append(max(live, 0.0))
            w = 0.0
            if n not in keep:
                if n in self.held_roots and am.root.get(n) is n:
                    w += am.bytes.get(n, 0.0)
                w += am.extra.get(n, 0.0)
            work_of.append(w)
        cuttable = [not isinstance(n.meta.get("val"), (tuple, list)) for n in body]
        regions = []
        s, last = 0, len(body) - 1
        while s <= last:
            work, i = 0.0, s
            while i <= last and work < cap:
                work += work_of[i]
                i += 1
            if i > last:  # the rest fits in one region
                regions.append(body[s:])
                break
            # cut at the cheapest boundary in the second half of this region (latest on ties)
            # (never between a multi-output node and the getitems that unpack it)
            acc, best, j_best = 0.0, None, i - 1
            for j in range(s, i):
                acc += work_of[j]
                if acc >= cap / 2 and cuttable[j] and (best is None or crossing_at[j] <= best):
                    best, j_best = crossing_at[j], j
            while j_best < last and not cuttable[j_best]:
                j_best += 1
            if j_best >= last:
                regions.append(body[s:])
                break
            regions.append(body[s:j_best + 1])
            s = j_best + 1
        return self.account(keep, regions)

    def account_needed(self, keep: set, regions: list) -> Plan:
        """Memory and time of keeping ``keep`` with these region cuts, as the AOT backend runs it:
        from every value backward reads (what autograd saves, and the ops that save something of
        their own), walk back: a kept node's value is saved where it is read (its bytes) and what
        its op saves for its own backward (its extras) always, a value from an earlier region is
        saved (that region's output, this region's input), a graph output or input/parameter is
        held anyway, a value already saved for a later region with no extras is read from there;
        anything else is recomputed (its time) and its inputs are walked. Nodes recomputed but
        never needed cost nothing. The plan keeps what the walk saved and did not rerun: the
        rewrite reruns exactly the rest."""
        am = self.am
        region_of = {n: k for k, region in enumerate(regions) for n in region}
        saved_at = [0.0] * len(regions)  # bytes saved, by the region holding them
        saved_roots: set = set()
        recomputed: set = set()
        extra_s = 0.0

        def save(r, k):
            if r in saved_roots or r in am.outputs:
                return
            saved_roots.add(r)
            saved_at[k] += am.bytes.get(r, 0.0)

        # each saved value is needed in the region of the node whose backward reads it; items are
        # (value, region, position of the backward node reading it, or None: a recomputation reads it,
        # whether only the value's extras are read: what its own op saves, not its output)
        stack = []
        for n in am.body:
            k = region_of.get(n, 0)
            j = self.index[n]
            stack.extend((r, k, j, False) for r in am.saved[n] if r in self.index)
            if am.extra.get(n, 0.0) > 0:
                stack.append((n, k, j, True))
        seen = set()
        read_at: dict = {}  # recomputed node -> positions of the backward nodes that read it
        rc_users: dict = {}  # recomputed node -> the recomputed nodes whose recomputation reads it
        while stack:
            n, k, j, extras = stack.pop()
            if n not in region_of:
                continue  # an input, parameter or buffer: held anyway
            if isinstance(j, fx.Node):  # read by the recomputation of j
                rc_users.setdefault(n, set()).add(j)
            elif j is not None:
                read_at.setdefault(n, []).append(j)
            if (n, k, extras) in seen:
                continue
            seen.add((n, k, extras))
            r = am.root.get(n, n)
            if region_of[n] != k:  # produced by an earlier region: saved as this region's input
                save(r, k)
                continue
            # kept (its extras saved; its output where read), or already saved as a later region's
            # input with nothing of its own to save: read from there, not rerun
            if n in keep or (not extras and r is n and r in saved_roots and n not in recomputed
                             and am.extra.get(n, 0.0) <= 0):
                if extras:
                    saved_at[k] += am.extra[n]
                elif r in region_of:
                    save(r, k)
                continue
            if n not in recomputed:
                recomputed.add(n)
                extra_s += am.seconds.get(n, 0.0)
            stack.extend((a, k, n, False) for a in n.all_input_nodes)
        # The backward runs the forward positions in reverse. At position p it holds: what was
        # saved before p (its later readers' backward has freed the rest); the recomputed values
        # live across p; the backward working set of node p (its output's and inputs' gradients,
        # its parameters' fresh gradients); and, inside an AOT region, the fresh gradients of the
        # region's parameters produced so far (its backward returns them together, when it ends)
        # and, where torch holds them (``grads_in_held``), the gradients the region received.
        # A recomputed value runs when the first backward node needing it runs — directly, or
        # through the recomputation of a later value that reads it (a recomputed residual stream
        # reruns everything it is made of at once) — and is freed after its last reader.
        size = len(am.body) + 2
        diff = [0.0] * size
        need: dict = {}
        early: dict = {}  # recomputed nodes a later recomputation reruns early (positions early)
        for n in sorted(recomputed, key=self.index.get, reverse=True):
            reads = read_at.get(n, [])
            users = [need[u] for u in rc_users.get(n, ()) if u in need]
            hi = max(reads + users, default=None)
            if hi is None:
                continue
            need[n] = hi
            if reads and hi > max(reads):  # rerun before its own readers need it: a recompute chain
                early[n] = hi - max(reads)
            lo = min(reads + users)
            b = (am.bytes.get(n, 0.0) if am.root.get(n) is n else 0.0) + am.extra.get(n, 0.0)
            if b > 0:
                diff[lo] += b
                diff[hi + 1] -= b
        grads_diff = [0.0] * size  # fresh parameter gradients a region's backward holds, by position
        for region in regions:
            if all(n in keep or n in saved_roots for n in region):
                continue  # left as it is (the rewrite skips it): eager's backward accumulates each gradient at once
            made_at: dict = {}
            for n in region:
                for a in self.params_of.get(n, ()):
                    made_at[a] = self.index[n]  # made by its latest reader's backward (counted there as work)
            lo = self.index[region[0]]
            for a, pos in made_at.items():  # then held below it until the region's backward returns
                grads_diff[lo] += self.param_bytes.get(a, 0.0)
                grads_diff[pos] -= self.param_bytes.get(a, 0.0)
            if self.grads_in_held:  # the gradients it receives, held below their outputs until it returns
                for pos, b in self._incoming_grads(region):
                    grads_diff[lo] += b
                    grads_diff[pos] -= b
        for r in saved_roots:
            if r in self.index:
                diff[self.index[r] + 1] += am.bytes.get(r, 0.0)
        for n in am.body:
            if n in keep and n not in recomputed and am.extra.get(n, 0.0) > 0 and n in region_of:
                diff[self.index[n] + 1] += am.extra[n]
        live, grads, peak = 0.0, 0.0, 0.0
        curve = []
        for p, d in enumerate(diff):
            live += d
            grads += grads_diff[p]
            curve.append(live + (self.work_pos[p] if p < len(self.work_pos) else 0.0) + grads)
            peak = max(peak, curve[-1])
        kept_bytes = self.scratch_bytes + sum(saved_at)
        # the step's fixed part (outputs, the largest working set) is budgeted apart: the plan's
        # total is the walk's peak less that working set, so the transient may be negative (the
        # largest working set comes when much of what was saved is already freed)
        peak = self.scratch_bytes + peak - self.working
        # a value saved for a later region is kept, unless its own region's backward reruns it:
        # that is how the walk priced it (a max-pool's indices, a norm's statistics not saved),
        # and the rewrite reruns what the plan does not keep
        keep = set(keep) | {n for n in saved_roots if n in region_of and n not in recomputed}
        plan = Plan(keep, regions, kept_bytes, peak - kept_bytes, extra_s)
        plan.recomputed, plan.saved_roots = recomputed, saved_roots
        plan.early = early
        plan.one_level_saved = sum(saved_at)
        # what nest() needs: the memory walk, and the bytes saved per (region of the value, region
        # of its last forward reader) -- a segment covering both drops them until its backward
        pairs: dict = {}
        for r in saved_roots:
            if r in self.index and r in region_of:
                last = self.last.get(r, len(am.body))
                key = (region_of[r], max(region_of[am.body[last]] if last < len(am.body) else len(regions), region_of[r]))
                pairs[key] = pairs.get(key, 0.0) + am.bytes.get(r, 0.0)
        for n in am.body:
            if n in keep and n not in recomputed and am.extra.get(n, 0.0) > 0 and n in region_of:
                k = region_of[n]
                pairs[(k, k)] = pairs.get((k, k), 0.0) + am.extra[n]
        plan.walk = {"curve": curve, "pairs": pairs}
        return plan

    def _incoming_grads(self, region: list) -> list:
        """(position, bytes) of the gradients a region's backward receives: one per storage of
        its outputs that later nodes read and that need a gradient (a view and its base share
        one), at the latest such output; a graph output's gradient is the caller's."""
        am, members = self.am, set(region)
        out: dict = {}
        for n in region:
            if not am.grad.get(n) or all(u in members for u in n.users):
                continue
            r = am.root.get(n, n)
            if r not in members or r in am.outputs:
                continue  # a view of an input (no gradient of its own), or a graph output
            pos, b = out.get(r, (0, 0.0))
            out[r] = (max(pos, self.index[n]), max(b, am.obytes.get(n, 0.0)))
        return list(out.values())

    def _region_reads(self, region: list, saved: set) -> list:
        """(activation, bytes) a region's nodes read that the plan frees after the forward (not
        saved, not a graph output), in first-read order."""
        am, out = self.am, {}
        for n in region:
            for x in n.all_input_nodes:
                x = am.root.get(x, x)
                if x in self.index and x not in saved and x not in am.outputs and am.bytes.get(x, 0.0) > 0:
                    out.setdefault(x, am.bytes[x])
        return list(out.items())

    def nest(self, plan: Plan, budget: float, max_len: int = 16) -> Plan | None:
        """Two-level recomputation for a plan that does not fit: runs of consecutive regions
        (segments) go under an outer checkpoint, which keeps only the segment's inputs through the
        forward and, when the backward reaches the segment, reruns the segment's forward (its
        regions' forward graphs) to get back what those regions save; their own backwards then
        recompute as before. A segment frees, for every moment of the backward before it is
        reached, the bytes its regions save for themselves, for one more forward of its nodes.
        Segments are chosen greedily by memory above the budget removed per second of forward
        rerun, then trimmed while the plan still fits. None when no segmentation fits."""
        walk = plan.walk
        if not walk or not plan.regions:
            return None
        am, regions = self.am, plan.regions
        R = len(regions)
        # what depends on the plan alone is kept in its walk across calls (select() bisects the
        # budget over the same plans)
        memo_all = walk.setdefault("nest_memo", {})
        if not memo_all:
            memo_all.update(
                curve=torch.tensor(walk["curve"], dtype=torch.float64),
                lo=[self.index[r[0]] for r in regions], hi=[self.index[r[-1]] for r in regions],
                secs=[sum(am.seconds.get(n, 0.0) for n in r) for r in regions],
                biggest=[max((am.bytes.get(n, 0.0) for n in r if am.root.get(n) is n), default=0.0) for r in regions],
                reads=[self._region_reads(r, plan.saved_roots or set()) for r in regions],
                inputs={}, own={}, effect={}, span={})
        curve, lo, hi, secs, biggest, reads = (memo_all[k] for k in ("curve", "lo", "hi", "secs", "biggest", "reads"))
        inputs_memo, own_memo, memo, span_memo = (memo_all[k] for k in ("inputs", "own", "effect", "span"))
        limit = budget - self.scratch_bytes + self.working
        pairs = walk["pairs"]
        n_pos = curve.shape[0]

        def held_inputs(a: int, b: int) -> list:
            """Activations the segment reads from before it that the plan frees after the forward:
            the outer checkpoint holds every input of its segment until the segment's backward."""
            if (a, b) in inputs_memo:
                return inputs_memo[(a, b)]
            out = {}
            for k in range(a, b + 1):
                for x, v in reads[k]:
                    if self.index[x] < lo[a]:
                        out[x] = v
            inputs_memo[(a, b)] = list(out.items())
            return inputs_memo[(a, b)]

        def own(a: int, b: int) -> float:
            """Bytes the segment's regions save for themselves (made and last read inside it): the
            pairs (region made i, region last read j) with a <= i and j <= b, from a table of their
            sums (bytes are whole numbers: the float sums are exact in any order)."""
            if "table" not in own_memo:
                by_pair = torch.zeros(R + 1, R + 1, dtype=torch.float64)
                for (i, j), v in pairs.items():
                    by_pair[i, min(j, R)] += v
                own_memo["table"] = by_pair.flip(0).cumsum(0).flip(0).cumsum(1).tolist()
            return own_memo["table"][a][b]

        def drop(a: int, b: int) -> float:
            """What the segment takes off the bytes held after the forward."""
            return own(a, b) - sum(v for _, v in held_inputs(a, b))

        def effect(a: int, b: int) -> torch.Tensor:
            """The change to the walk of segment a..b: its regions' own saved bytes gone after its
            end (the backward reaches it later); its forward rerun as the backward enters it."""
            if (a, b) not in memo:
                d = torch.zeros(n_pos, dtype=torch.float64)
                d[hi[b] + 1:] -= own(a, b)
                for x, v in held_inputs(a, b):  # held from where it is made on
                    d[self.index[x] + 1:] += v
                d[hi[b]] += max(biggest[a:b + 1])
                memo[(a, b)] = d
            return memo[(a, b)]

        def span_s(a: int, b: int) -> float:
            """Seconds of the forward rerun of regions a..b."""
            if (a, b) not in span_memo:
                span_memo[(a, b)] = sum(secs[a:b + 1])
            return span_memo[(a, b)]

        def excess(c: torch.Tensor) -> float:
            return float((c - limit).clamp(min=0).sum())

        # every candidate segment (a, b), its effect on the walk and its rerun seconds, as one matrix:
        # each greedy step prices all of them with a few tensor operations
        key = ("candidates", max_len)
        if key not in memo_all:
            cands = [(a, b) for a in range(R) for b in range(a, min(R, a + max_len))]
            # effect() for all of them at once: its steps as a difference along the walk, summed
            rows_at, cols_at, vals = [], [], []
            for k, (a, b) in enumerate(cands):
                rows_at.append(k), cols_at.append(hi[b] + 1), vals.append(-own(a, b))
                for x, v in held_inputs(a, b):
                    rows_at.append(k), cols_at.append(self.index[x] + 1), vals.append(v)
            steps = torch.zeros(len(cands), n_pos + 1, dtype=torch.float64)
            steps.index_put_((torch.tensor(rows_at), torch.tensor(cols_at)), torch.tensor(vals, dtype=torch.float64),
                             accumulate=True)
            effects = steps.cumsum(1)[:, :n_pos].contiguous()
            effects[torch.arange(len(cands)), torch.tensor([hi[b] for _, b in cands])] += torch.tensor(
                [max(biggest[a:b + 1]) for a, b in cands], dtype=torch.float64)
            memo.update({c: effects[k] for k, c in enumerate(cands)})
            memo_all[key] = (cands, torch.tensor([c[0] for c in cands]), torch.tensor([c[1] for c in cands]),
                             effects, torch.tensor([span_s(a, b) for a, b in cands], dtype=torch.float64))
        cands, first, last, effects, spans = memo_all[key]
        rows = 1 + (1 << 22) // max(n_pos, 1)  # candidates priced at once (a temporary of 32 MB at most)

        segs: list = []
        cur = curve.clone()
        kept = plan.saved_bytes  # held after the forward
        while float(cur.max()) > limit:
            base_ex = excess(cur)
            # a candidate holds the segments inside it (their effects replaced by its own); one that
            # overlaps a segment partly, or is one, is not a candidate
            valid = torch.ones(len(cands), dtype=torch.bool)
            inside = torch.zeros(len(cands), len(segs), dtype=torch.float64)
            for j, (sa, sb) in enumerate(segs):
                holds = (first <= sa) & (sb <= last)
                valid &= holds | (sb < first) | (sa > last)
                valid &= ~((first == sa) & (last == sb))
                inside[:, j] = holds.double()
            seg_effects = torch.stack([effect(*t) for t in segs]) if segs else torch.zeros(0, n_pos, dtype=torch.float64)
            seg_spans = torch.tensor([span_s(*t) for t in segs], dtype=torch.float64)
            gain = torch.empty(len(cands), dtype=torch.float64)
            for lo_k in range(0, len(cands), rows):
                trial = cur + effects[lo_k:lo_k + rows] - inside[lo_k:lo_k + rows] @ seg_effects
                gain[lo_k:lo_k + rows] = base_ex - (trial - limit).clamp(min=0).sum(dim=1)
            dt = spans - inside @ seg_spans
            score = torch.where(valid & (gain > 0), gain / dt.clamp(min=1e-9), float("-inf"))
            k = int(score.argmax())  # (the first of equal scores, as the candidates are listed)
            if score[k] == float("-inf"):
                return None
            seg = cands[k]
            held = [t for j, t in enumerate(segs) if inside[k, j]]
            cur = cur + effects[k] - inside[k] @ seg_effects
            kept = kept - drop(*seg) + sum(drop(*t) for t in held)
            segs = sorted([t for t in segs if t not in held] + [seg])
        # trim: shrink each segment from either end while the plan still fits
        changed = True
        while changed:
            changed = False
            for k, (a, b) in enumerate(list(segs)):
                for na, nb in ((a + 1, b), (a, b - 1)):
                    if na > nb:
                        trial, trial_kept = cur - effect(a, b), kept + drop(a, b)
                    else:
                        trial = cur - effect(a, b) + effect(na, nb)
                        trial_kept = kept + drop(a, b) - drop(na, nb)
                    if float(trial.max()) <= limit:
                        cur, kept = trial, trial_kept
                        segs[k] = (na, nb)
                        changed = True
                        break
            segs = [s for s in segs if s[0] <= s[1]]
        peak = self.scratch_bytes + float(cur.max()) - self.working
        out = Plan(plan.keep, regions, kept, peak - kept, plan.extra_s + sum(sum(secs[a:b + 1]) for a, b in segs),
                   plan.crossing_bytes, list(plan.notes), plan.recomputed, plan.saved_roots, plan.early)
        out.segments = segs
        out.one_level_saved = plan.one_level_saved
        out.notes.append(f"two-level recomputation: {len(segs)} segment(s) of consecutive regions run under an outer "
                         "checkpoint (their forward reruns once more in backward) to fit the budget")
        return out

    def account(self, keep: set, regions: list) -> Plan:
        """Memory and time of keeping ``keep`` with these region cuts."""
        if self.aot:
            return self.account_needed(keep, regions)
        am, body = self.am, self.am.body
        held = lambda r: r in keep or r in am.outputs  # noqa: E731
        # what crosses a cut is held by checkpoint as the next region's input anyway: keep it
        # (no more memory, less recomputation)
        keep = set(keep)
        crossing = 0.0
        for region in regions[:-1]:
            j = self.index[region[-1]]
            for r in region:
                if am.root.get(r) is r and self.last.get(r, -1) > j and not held(r):
                    keep.add(r)
                    crossing += am.bytes.get(r, 0.0)
            # (a tensor from an earlier region that is still live crossed that region's cut too)
        # backward runs the regions last to first: while region k is recomputed, what regions
        # 0..k keep is still held and what later regions kept has been freed
        kept_bytes, peak = self.scratch_bytes, 0.0
        for region in regions:
            kept_bytes += sum(self.cost_bytes(n) for n in region
                              if n in keep and not (am.root.get(n) is n and n in am.outputs))
            work = sum(am.bytes.get(n, 0.0) if (n not in keep and n in self.held_roots and am.root.get(n) is n) else 0.0
                       for n in region) + sum(am.extra.get(n, 0.0) for n in region if n not in keep)
            peak = max(peak, kept_bytes + work)
        extra_s = sum(am.seconds[n] for n in body if n not in keep)
        return Plan(keep, regions, kept_bytes, max(peak - kept_bytes, 0.0), extra_s, crossing)

    def random_consistent(self, plan: Plan, cap: float) -> Plan:
        """A region's random ops are all kept or all recomputed (RNG replay then matches)."""
        keep = set(plan.keep)
        changed = False
        for region in plan.regions:
            rnd = [n for n in region if n in self.random]
            if rnd and any(n in keep for n in rnd) and any(n not in keep for n in rnd):
                keep.difference_update(rnd)
                changed = True
        if not changed:
            return plan
        out = self.account(keep, plan.regions)  # same cuts
        out.notes.append("random ops of a region recomputed together so the replayed RNG matches")
        return out

    def refine(self, plan: Plan, budget: float, tries: int = 64) -> Plan:
        """The cheapest-per-byte order can overshoot: keep again the costliest recomputed
        nodes that still fit (same region cuts). First (AOT), break recompute chains: a node a
        later recomputation reruns long before its own readers need it is kept where that costs
        no memory and no time (the chain's transient goes), which leaves room to keep GEMMs."""
        for _ in range(4 if self.aot else 0):
            changed = False
            for n in sorted(plan.early, key=lambda n: -plan.early[n] * self.cost_bytes(n))[:tries]:
                if n in plan.keep or n in self.random or n in self.forced_recompute:
                    continue
                trial = self.account(plan.keep | {n}, plan.regions)
                if trial.total_bytes <= plan.total_bytes and trial.extra_s <= plan.extra_s:
                    trial.notes, trial.crossing_bytes = plan.notes, plan.crossing_bytes
                    plan, changed = trial, True
            if not changed:
                break
        recomputed = [n for n in self.order() if n not in plan.keep and self.am.seconds[n] > 0]
        for n in sorted(recomputed, key=lambda n: -self.am.seconds[n])[:tries]:
            if n in self.random:  # a region's random ops stay together
                continue
            trial = self.account(plan.keep | {n}, plan.regions)
            if trial.total_bytes <= budget and trial.extra_s < plan.extra_s:
                trial.notes, trial.crossing_bytes = plan.notes, plan.crossing_bytes
                plan = trial
        return plan

    def fixed_part(self, offset: float, base: float) -> str:
        """What no plan recomputes away (``offset``: the outputs and the largest backward working
        set), with the node of that working set and the largest parameter gradient it makes."""
        am = self.am
        n, work, params = am.largest_working()
        outputs = format_bytes(am.all_output_bytes())
        text = (f"{format_bytes(offset)} ({offset / base:.3f}) of it fixed: the outputs ({outputs})"
                f" and the backward's largest working set ({format_bytes(work)}")
        if n is not None:
            text += f", at {n.name}"
            if params:
                text += f", {format_bytes(params[0][1])} of it the fresh gradient of {params[0][0]}"
        return text + ")"

    def select(self, budget: float, caps: list, offset: float = 0.0, headroom: float = 0.0) -> Plan:
        """The plan that fits ``budget`` with the least predicted recomputation time, over
        region sizes ``caps`` (bigger regions: fewer boundary tensors held, a bigger transient
        while one region is recomputed). ``budget`` covers the step's activation memory:
        ``offset`` (the graph's outputs and the backward's working set) plus what the plan saves
        and its recomputation transient; plans fill at most ``1 - headroom`` of it (room for the
        prediction's error)."""
        asked = budget
        budget = budget * (1.0 - headroom) - offset
        order = self.order()
        all_keep = set(n for n in self.am.body if n not in self.forced_recompute)
        best_fit, minimum = None, None
        smallest: list = []  # each region size's sampled plans (smallest first): where two-level recomputation starts
        n = len(order)
        grid = sorted({round(n * i / 16) for i in range(17)})
        for cap in caps:
            def plan_for(k: int) -> Plan:
                return self.random_consistent(self.evaluate(all_keep - set(order[:k]), cap), cap)

            sampled = [(k, plan_for(k)) for k in grid]
            low = min((p for _, p in sampled), key=lambda p: p.total_bytes)
            if minimum is None or low.total_bytes < minimum.total_bytes:
                minimum = low
            # every sampled plan may start a two-level plan: the cheapest may recompute little itself
            # and leave the memory to the outer checkpoints
            smallest.extend(sorted((p for _, p in sampled), key=lambda p: p.total_bytes))
            fits = [k for k, p in sampled if p.total_bytes <= budget]
            if not fits:
                continue
            hi = fits[0]
            lo = max([k for k in grid if k < hi], default=hi)
            while lo < hi:  # the smallest k in (lo, hi] whose plan fits
                mid = (lo + hi) // 2
                if plan_for(mid).total_bytes <= budget:
                    hi = mid
                else:
                    lo = mid + 1
            plan = plan_for(hi)
            if plan.total_bytes <= budget and (best_fit is None or (plan.extra_s, plan.total_bytes) <
                                               (best_fit.extra_s, best_fit.total_bytes)):
                best_fit = plan
        if best_fit is not None:
            best_fit = self.refine(best_fit, budget)
        # the largest budget each sampled plan could not be nested under (by id: the plans live in
        # `smallest`); a plan that cannot meet a budget is not tried again under a smaller one
        failed_at: dict = {}

        def nested_under(p: Plan, b: float) -> Plan | None:
            if failed_at.get(id(p), -1.0) >= b:
                return None
            out = self.nest(p, b)
            if out is None:
                failed_at[id(p)] = max(failed_at.get(id(p), -1.0), b)
            return out

        if best_fit is None and self.aot:
            # no plan of one level fits: run consecutive regions under an outer checkpoint
            for p in smallest:
                nested = nested_under(p, budget)
                if nested is not None and (best_fit is None or nested.extra_s < best_fit.extra_s):
                    best_fit = nested
        if best_fit is None:
            base = self.am.step_activation_bytes()
            low = minimum.total_bytes + offset
            if self.aot and smallest:  # the smallest two-level plan: bisect the budget nest() can meet
                lo_b, hi_b = 0.0, min(p.total_bytes for p in smallest)
                for _ in range(10):
                    mid = (lo_b + hi_b) / 2
                    if any(nested_under(p, mid) is not None for p in smallest):
                        hi_b = mid
                    else:
                        lo_b = mid
                low = min(low, hi_b + offset)
            low = low / (1.0 - headroom)
            # the plans' accounting is an upper bound (the working set with everything saved still held),
            # the baseline's is walked: recomputing nothing meets the baseline, whatever the plans say
            low = float(math.ceil(min(low, base)))  # whole bytes: the minimum can be passed back as a budget
            raise BudgetError(
                f"memory budget {format_bytes(asked)} is below the achievable minimum "
                f"{format_bytes(low)} ({low / base:.3f} of the baseline activation memory {format_bytes(base)}: "
                f"saved tensors, outputs and the backward's working set"
                + (f", plus {headroom:.0%} left free for the prediction's error" if headroom else "")
                + f"; {self.fixed_part(offset, base)}) over the recompute/keep trade-offs searched"
                + (" by the AOT backend" if self.aot else " by the selective checkpoint")
                + "; raise memory_budget to at least that", minimum=low)
        return best_fit



def recomputed_by_op(am: ActivationModel, keep: set, recomputed: set | None = None) -> dict:
    """The plan's recomputation by op: {op: {"count", "ms"}} (predicted), costliest first; views
    and other free nodes are left out. ``recomputed``: the nodes that rerun, where the plan knows
    (else every node not kept)."""
    rows: dict = {}
    for n in am.body:
        reruns = n in recomputed if recomputed is not None else n not in keep
        if not reruns or am.seconds.get(n, 0.0) <= 0:
            continue
        r = rows.setdefault(ir.op_name(n), {"count": 0, "ms": 0.0})
        r["count"] += 1
        r["ms"] += am.seconds[n] * 1e3
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]["ms"]))


def saved_by_op(am: ActivationModel, keep: set, saved_roots: set | None = None,
                recomputed: set | None = None) -> dict:
    """What the plan holds for backward by op of the producing node: {op: {"count", "gb"}},
    largest first (kept outputs that autograd saves, and what kept ops save internally; where the
    plan knows them, ``saved_roots`` are the storages saved and ``recomputed`` the nodes rerun)."""
    rows: dict = {}
    held = am.saved_roots() if saved_roots is None else saved_roots
    for n in am.body:
        if n not in keep and n not in am.outputs or (recomputed is not None and n in recomputed):
            continue
        b = (am.bytes.get(n, 0.0) if am.root.get(n) is n and n in held else 0.0)
        b += am.extra.get(n, 0.0)
        if b <= 0:
            continue
        r = rows.setdefault(ir.op_name(n), {"count": 0, "gb": 0.0})
        r["count"] += 1
        r["gb"] += b / 1e9
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]["gb"]))


def _by_layer(am: ActivationModel, keep: set) -> list:
    """Saved vs recomputed tensors (count, bytes) per layer."""
    rows: dict = {}
    held = am.saved_roots()
    for n in am.body:
        if am.root.get(n) is not n or n not in held and am.extra.get(n, 0.0) <= 0:
            continue
        layer = layer_of(n)
        r = rows.setdefault(layer, {"layer": layer, "saved": 0, "saved_bytes": 0.0, "recomputed": 0,
                                    "recomputed_bytes": 0.0, "recomputed_nodes": []})
        b = am.bytes.get(n, 0.0) + am.extra.get(n, 0.0)
        if n in keep or n in am.outputs:
            r["saved"] += 1
            r["saved_bytes"] += b
        else:
            r["recomputed"] += 1
            r["recomputed_bytes"] += b
            if len(r["recomputed_nodes"]) < 12:
                r["recomputed_nodes"].append(n.name)
    return list(rows.values())



def plan_details(am: ActivationModel, plan: Plan) -> dict:
    """The plan's numbers for the report: predicted memory and recomputation, by layer and op."""
    return dict(
        predicted_saved_bytes=plan.saved_bytes,
        recompute_transient_bytes=max(plan.transient_bytes, 0.0),
        region_input_bytes=plan.crossing_bytes,
        predicted_held_bytes=am.held_bytes(plan.saved_bytes),
        predicted_activation_bytes=am.step_activation_bytes(plan.saved_bytes, plan.transient_bytes),
        predicted_peak_bytes=am.step_peak_bytes(plan.saved_bytes, plan.transient_bytes),
        extra_ms=plan.extra_s * 1e3,
        regions=len(plan.regions),
        kept_nodes=len(plan.keep),
        recomputed_nodes=len(plan.recomputed) if plan.recomputed is not None else len(am.body) - len(plan.keep),
        by_layer=_by_layer(am, plan.keep),
        recomputed_by_op=recomputed_by_op(am, plan.keep, plan.recomputed),
        saved_by_op=saved_by_op(am, plan.keep, plan.saved_roots, plan.recomputed),
    )
