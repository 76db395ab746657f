"""Fully balanced expert parallelism (`model.moe_overflow=balanced`): redundant experts so that every EP rank computes
exactly the same number of (token, expert) pairs, nothing dropped, every buffer of a fixed size, no value read on
the host. MODEL.md section 5 (MoonEP); docs/experts.md has the algorithm with a worked example.

Legend: R expert-parallel ranks, E experts, El = E/R owned by each rank, S replica slots per rank
(`moe.redundant_experts`), N tokens per rank, k experts per token, M = N*k pairs per rank, L latent width,
P = parameters of one expert (w1, w3, w2).

One MoE layer's forward under balanced dispatch:

1. Counts. Every rank's per-expert counts are all-gathered in the EP group ([R, E] on every rank, on device).
2. Plan (`alias_plan`, identical on every rank). Rank o's *stream* is every pair routed to its experts, ordered by
   (its expert, from the most to the least loaded (`streams`), source rank, the pair's order at the source); its
   length is the owner load L_o, and the loads sum to R*M. Walker's alias construction over ranks: while some rank
   holds less than M and another more, the lowest-numbered such receiver takes exactly what it lacks from the front
   of the lowest-numbered donor's stream, and is done; a donor that falls below M becomes a receiver. Every rank then
   computes a suffix of its own stream plus at most one range of one donor's stream, and exactly M pairs. A donated
   range lies inside one rank's El experts, so S = El (= E/R, the default) slots guarantee exact balance for every
   routing. With S < El a range is cut at the end of its S-th expert: the receiver stays short, its donor computes
   the rest, nothing is dropped and the step's imbalance is reported (`stats`). Streams start with the most loaded
   experts so that a donor gives its largest first and a short receiver takes as much as S experts can hold.
3. Weights to replicas, in two static all-to-alls through relays: every owner sends slice x (1/R of the P values) of
   each of its El experts to rank x (every rank then holds one slice of every expert of the layer), and every rank x
   sends each host its slice of the S experts that host's plan names. Each rank sends and receives El + S experts'
   worth (times (R-1)/R), whatever the routing. The owner's first exchange does not depend on the plan and runs while
   the shared experts compute. The backward of the two exchanges returns every replica's gradient to its owner,
   where autograd sums it into the owner's own. With `moe.replica_exchange=step` the first exchange runs once per
   step instead (`cache_weights`, `flush`): each relay keeps its fp32 store and the store's gradient for the step.
4. Tokens in two static all-to-alls through relays (no split sizes): each source sorts its M pairs by (destination,
   position there), pads to a multiple of R, and deals the sorted rows round-robin to the R ranks (M/R each); each
   relay forwards what it holds to the destinations in blocks of B = floor(Cap/R) + R - 1 rows. Dealing a run of F
   rows round-robin gives each relay at most ceil(F/R) of them, so a destination receives at most
   sum_s ceil(F_s/R) <= Cap/R + R - 1 rows from one relay: B never overflows.
5. Each rank runs its Cap rows (own experts then replicas, grouped GEMM with device-side offsets), the outputs go back
   the way they came, and the source combines its k outputs per token with the late routing weights in fp32.

Cap is M when S >= El (exact balance). Below that it is the most pairs one rank's experts can be routed:
R * N * min(El, k), the dropless worst case, since the plan cannot promise better.
"""

from __future__ import annotations

import contextlib

import torch

from ..model.dispatcher import counts, positions
from ..model.layers import recomputing
from ..ops.grouped_gemm import weighted_combine
from .mappings import all_gather_single, all_to_all, all_to_all_overlapped

__all__ = ["alias_plan", "streams", "pair_destinations", "slot_layout", "compute_capacity", "relay_block",
           "BalancedDispatch", "balanced_layers", "flush_replica_gradients", "exchanged"]


def compute_capacity(N: int, k: int, R: int, El: int, S: int) -> int:
    """Rows each rank computes: M = N*k when the slots guarantee exact balance, else the most pairs one rank's
    experts can be sent (every token of every rank routed to min(El, k) of them)."""
    M = N * k
    return M if S >= El else min(R * M, R * N * min(El, k))


def relay_block(cap: int, R: int) -> int:
    """Rows per (relay, destination) block of the second token exchange: never overflows (module docstring)."""
    return cap // R + R - 1


def _first(mask: torch.Tensor) -> torch.Tensor:
    """[1]: index of the first True in a 1-D mask (0 when none), without a host read."""
    return torch.argmax(mask.to(torch.int8)).view(1)


def alias_plan(ends_RE: torch.Tensor, M: int, S: int):
    """The balanced plan from every owner's stream ends (`ends_RE[o, j]`: the inclusive cumulative load of the
    first j + 1 experts of rank o's stream (`streams`), so ends_RE[:, -1] are the owner loads, summing to R*M).

    Returns (given_R, donor_R, dstart_R, damt_R): rank o keeps the suffix [given_R[o], L_o) of its stream; rank r
    computes also the range [dstart_R[r], dstart_R[r] + damt_R[r]) of donor_R[r]'s stream (donor -1, amount 0:
    none). R - 1 fixed iterations of device operations, no host read."""
    R, El = ends_RE.shape
    dev = ends_RE.device
    L_R = ends_RE[:, -1]
    mass = L_R.clone()  # own pairs a rank still keeps
    given = torch.zeros_like(L_R)
    donor = torch.full_like(L_R, -1)
    dstart = torch.zeros_like(L_R)
    damt = torch.zeros_like(L_R)
    done = torch.zeros(R, dtype=torch.bool, device=dev)
    for _ in range(R - 1):
        recv_mask = (~done) & (mass < M)
        don_mask = mass > M
        live = (recv_mask.any() & don_mask.any()).view(1)
        r, g = _first(recv_mask), _first(don_mask)
        need = M - mass.index_select(0, r)
        off = given.index_select(0, g)
        # the donor's expert holding position `off`, and the end of its S-th expert from there
        j_a = (ends_RE.index_select(0, g).view(El) <= off).sum().view(1)
        j_last = torch.clamp(j_a + (S - 1), max=El - 1)
        limit = ends_RE.index_select(0, g).view(El).index_select(0, j_last)
        amt = torch.where(live, torch.minimum(need, limit - off), torch.zeros_like(need))
        donor = donor.index_copy(0, r, torch.where(live, g, donor.index_select(0, r)))
        dstart = dstart.index_copy(0, r, torch.where(live, off, dstart.index_select(0, r)))
        damt = damt.index_copy(0, r, torch.where(live, amt, damt.index_select(0, r)))
        given = given.index_add(0, g, amt)
        mass = mass.index_add(0, g, -amt).index_add(0, r, amt)
        done = done.index_copy(0, r, done.index_select(0, r) | live)
    return given, donor, dstart, damt


def exchanged(experts) -> list:
    """[(tensors, trained)] that define a layer's local experts, one set per dtype, in the order replicas take them:
    the experts' own `exchanged()` (peft.FrozenExperts: its MXFP4 codes and scales, then its adapters), else their
    (w1, w3, w2)."""
    f = getattr(experts, "exchanged", None)
    return f() if f is not None else [((experts.w1, experts.w3, experts.w2), True)]


def _unflatten(flat: torch.Tensor, ws) -> tuple:
    """[n, >= P] rows of experts flattened as (w1, w3, w2) -> views shaped [n, ...] like each of `ws`. One split:
    its backward concatenates the parts' gradients into one [n, P] tensor (a slice per part would make a zero-filled
    [n, >= P] gradient for each and add them: three times the replicas' size at the layer's backward)."""
    sizes = [w[0].numel() for w in ws]
    body = flat if flat.shape[1] == sum(sizes) else flat[:, :sum(sizes)]
    return tuple(part.reshape((flat.shape[0],) + tuple(w.shape[1:]))
                 for part, w in zip(torch.split(body, sizes, dim=1), ws))


class _TakeRows(torch.autograd.Function):
    """store.index_select(0, rows), whose backward adds the rows' gradients into one zero tensor in place (torch's
    makes the zero tensor and an out-of-place index_add of it: twice the relay store's size at the exchange's
    backward, the balanced layer's peak)."""

    @staticmethod
    def forward(ctx, store, rows):
        ctx.save_for_backward(rows)
        ctx.store_rows = store.shape[0]
        return store.index_select(0, rows)

    @staticmethod
    def backward(ctx, grad):
        rows, = ctx.saved_tensors
        return grad.new_zeros((ctx.store_rows,) + tuple(grad.shape[1:])).index_add_(0, rows, grad), None


def _overlap(a0, a1, b0, b1):
    return torch.clamp(torch.minimum(a1, b1) - torch.maximum(a0, b0), min=0)


def streams(loads_RE: torch.Tensor):
    """(ends_RS, perm_RS) of every owner's stream: its local experts from the most to the least loaded (ties by
    index), perm_RS[o, j] the local expert at stream place j and ends_RS[o, j] the inclusive cumulative load there."""
    perm = torch.argsort(loads_RE, dim=1, descending=True, stable=True)
    return torch.cumsum(loads_RE.gather(1, perm), 1), perm


def _starts(ends_RS):
    return ends_RS - torch.diff(ends_RS, dim=1, prepend=torch.zeros_like(ends_RS[:, :1]))


def slot_layout(ends_RS: torch.Tensor, perm_RS: torch.Tensor, plan, S: int):
    """For every rank d: its slots' row counts [R, El + S] (own local experts 0..El-1, then the replicas) and the
    global expert of every replica slot [R, S] (a slot without rows names some expert and gets 0 rows)."""
    given, donor, dstart, damt = plan
    R, El = ends_RS.shape
    starts_RS = _starts(ends_RS)
    own_stream = _overlap(given[:, None], ends_RS[:, -1:], starts_RS, ends_RS)  # [R, El] by stream place
    own = torch.empty_like(own_stream).scatter_(1, perm_RS, own_stream)  # by local expert
    g = donor.clamp(min=0)
    g_ends, g_starts = ends_RS.index_select(0, g), starts_RS.index_select(0, g)  # [R, El]: each rank's donor's
    j_a = (g_ends <= dstart[:, None]).sum(1)  # the donor's stream place where the range starts
    at = j_a[:, None] + torch.arange(S, device=ends_RS.device)
    j = torch.clamp(at, max=El - 1)  # [R, S]
    rep = _overlap(dstart[:, None], (dstart + damt)[:, None], g_starts.gather(1, j), g_ends.gather(1, j))
    rep = torch.where((at < El) & (donor[:, None] >= 0), rep, torch.zeros_like(rep))
    return torch.cat([own, rep], 1), g[:, None] * El + perm_RS.index_select(0, g).gather(1, j)


def pair_destinations(expert_M: torch.Tensor, cnt_RE: torch.Tensor, rank: int, ends_RS: torch.Tensor,
                      perm_RS: torch.Tensor, own_RE: torch.Tensor, plan):
    """(dest_M, bufpos_M): the rank that computes each of this rank's pairs and its row there. A rank's rows are its
    kept own pairs by local expert (own_RE[d, j] of them for expert j), then the donated range in its donor's stream
    order, which is the order of its replica slots."""
    given, donor, dstart, damt = plan
    R, El = ends_RS.shape
    E = R * El
    starts_E = torch.empty_like(ends_RS).scatter_(1, perm_RS, _starts(ends_RS)).reshape(E)  # by global expert
    before_E = (torch.cumsum(cnt_RE, 0) - cnt_RE)[rank]  # pairs of lower source ranks to each expert
    start = starts_E[expert_M]
    pos = start + before_E[expert_M] + positions(expert_M, E)  # in the owner's stream
    owner = expert_M // El
    hit = (donor[None, :] == owner[:, None]) & (dstart[None, :] <= pos[:, None]) & \
        (pos[:, None] < (dstart + damt)[None, :])  # [M, R]
    received = hit.any(1)
    recv_by = torch.argmax(hit.to(torch.int8), 1)
    dest = torch.where(received, recv_by, owner)
    own_before_E = (torch.cumsum(own_RE, 1) - own_RE).reshape(E)  # kept rows of the lower local experts
    kept = own_before_E[expert_M] + pos - torch.maximum(given[owner], start)
    bufpos = torch.where(received, own_RE.sum(1)[recv_by] + pos - dstart[recv_by], kept)
    return dest, bufpos


class BalancedDispatch:
    """One layer's balanced dispatch over an EP group (see the module docstring); `stats` after each call:
    (rank_load_R, replicas) on device: the pairs every rank computed and the replica slots in use."""

    def __init__(self, group, R: int, rank: int, slots: int):
        self.group, self.R, self.rank, self.S = group, R, rank, slots
        self.stats = None
        # moe.replica_exchange=step (the trainer sets it, and calls `flush` at the step's boundary): the first weight
        # exchange (owner -> relays) is reused by every micro-batch of the step, as an fp32 store whose gradient
        # accumulates on the relay and goes back to the owners once, by `flush`.
        self.cache_weights = False
        self._store = None

    def flush(self, experts) -> None:
        """End of a step under `cache_weights`: the replicas' gradients accumulated on this relay go back to their
        owners (one all-to-all, the reverse of the first weight exchange) and are added to the experts' gradients;
        the cached exchange is dropped (the optimizer changes the weights next). Every rank of the EP group calls it
        at the same point (the trainer's gradient-accumulation boundary)."""
        stores, self._store = self._store, None
        if stores is None:
            return
        R, El = self.R, experts.num_local
        for (ws, trained), store in zip(exchanged(experts), stores):
            if not trained:
                continue
            g = store.grad if store.grad is not None else torch.zeros_like(store)
            back = all_to_all(g.contiguous(), self.group)  # [R relays * El, Pp/R]: slice x of each own expert from x
            for w, gw in zip(ws, _unflatten(back.view(R, El, -1).transpose(0, 1).reshape(El, -1), ws)):
                w.grad = gw.to(w.dtype, copy=True) if w.grad is None else w.grad.add_(gw)

    def _counts(self, counts_E: torch.Tensor) -> torch.Tensor:
        out = counts_E.new_empty(self.R * counts_E.numel())
        all_gather_single(out, counts_E.contiguous(), group=self.group)
        return out.view(self.R, -1)

    def _replica_weights(self, experts, side):
        """(replicas, side()): `replicas(rep_RS)` gives the tensors of this rank's replica slots ([S, ...] each, in
        the order of `exchanged(experts)`: (w1, w3, w2), or frozen experts' codes then adapters) once the plan names
        every rank's; the first exchange does not depend on the plan and runs while side() computes. With
        `cache_weights` (training) the first exchange runs once per step (`flush` ends it)."""
        sets = exchanged(experts)
        cached = self.cache_weights and torch.is_grad_enabled()
        if cached and self._store is not None:
            return self._replicas(self._store, sets), (side() if side is not None else None)
        out, stores = None, []
        for i, (ws, trained) in enumerate(sets):
            send = self._send(ws, cached)
            if cached:  # an fp32 leaf: every micro-batch's replica gradients accumulate in its .grad until `flush`
                out = side() if side is not None and i == 0 else out
                with torch.no_grad():
                    got = all_to_all(send, self.group)
                    store = got.float().requires_grad_(True) if trained else got
            elif side is None or i > 0:
                store = all_to_all(send, self.group)
            else:
                store, out = all_to_all_overlapped(send, self.group, side)
            stores.append(store)
        if cached:
            self._store = stores
        return self._replicas(stores, sets), out

    def _send(self, ws, cached: bool) -> torch.Tensor:
        """The first exchange's send buffer of one set of expert tensors: slice x of each own expert to rank x."""
        R, El = self.R, ws[0].shape[0]
        P = sum(w[0].numel() for w in ws)
        Pp = -(-P // R) * R
        with torch.no_grad() if cached else contextlib.nullcontext():
            flat = torch.cat([w.reshape(El, -1) for w in ws], 1)  # [El, P]
            if Pp != P:
                flat = torch.cat([flat, flat.new_zeros(El, Pp - P)], 1)
            return flat.view(El, R, Pp // R).transpose(0, 1).reshape(R * El, Pp // R)

    def _replicas(self, stores, sets):
        """`replicas(rep_RS)` from the stores (per set: slice `rank` of every expert of the layer, in global order
        [E, Pp/R])."""
        R = self.R

        def replicas(rep_RS: torch.Tensor):
            S, out = self.S, ()
            for store, (ws, _) in zip(stores, sets):
                Pp = store.shape[1] * R
                mine = _TakeRows.apply(store, rep_RS.reshape(-1))  # [R hosts * S, Pp/R]
                got = all_to_all(mine, self.group).view(R, S, Pp // R).transpose(0, 1).reshape(S, Pp)
                out += _unflatten(got, ws)
            return out
        return replicas

    def __call__(self, z_NL, idx_Nk, weight_Nk, experts, side=None):
        R, S, rank, group = self.R, self.S, self.rank, self.group
        N, k = idx_Nk.shape
        El, E = experts.num_local, experts.num_experts
        M = N * k
        dev = z_NL.device
        cap = compute_capacity(N, k, R, El, S)
        B = relay_block(cap, R)
        replicas, _ = self._replica_weights(experts, side)  # side's result reaches the caller through its closure
        expert_M = idx_Nk.reshape(-1)
        cnt_RE = self._counts(counts(expert_M, E))
        ends_RS, perm_RS = streams(cnt_RE.sum(0).view(R, El))
        plan = alias_plan(ends_RS, M, S)
        rows_RX, rep_RS = slot_layout(ends_RS, perm_RS, plan, S)
        self.stats = self.stats if recomputing() else (rows_RX.sum(1), (rows_RX[:, El:] > 0).sum())  # first pass
        dest, bufpos = pair_destinations(expert_M, cnt_RE, rank, ends_RS, perm_RS, rows_RX[:, :El], plan)
        # hop 1: sort by (destination, row there), pad to Mp = a multiple of R, deal round-robin to the relays:
        # sorted row i goes to relay i % R as its row i // R. One gather builds the dealt rows straight from z.
        Mp = -(-M // R) * R
        code = dest * (cap + 1) + bufpos
        order = torch.argsort(code)
        dummy = (R * (cap + 1), N)  # the padding rows: no destination, token N (a row the combine discards)

        def deal(x_s):
            return x_s.view(Mp // R, R).t().reshape(Mp)
        tok_d = deal(torch.cat([order // k, order.new_full((Mp - M,), dummy[1])]))
        code_d = deal(torch.cat([code.index_select(0, order), code.new_full((Mp - M,), dummy[0])]))
        w_d = deal(torch.cat([weight_Nk.reshape(-1).index_select(0, order), weight_Nk.new_zeros(Mp - M)]))
        code_r = all_to_all(code_d, group)
        # padding rows gather some real row (clamp): their results are never read, no gradient reaches them
        rows_r = all_to_all(z_NL.index_select(0, tok_d.clamp(max=N - 1)), group)
        # hop 2 at the relay: block d holds the rows for destination d, in (destination row) order
        d_r = code_r // (cap + 1)
        o2 = torch.argsort(code_r)
        d_sorted = d_r.index_select(0, o2)
        cnt_d = counts(d_r, R + 1)
        rank_in = torch.arange(Mp, device=dev) - (torch.cumsum(cnt_d, 0) - cnt_d).index_select(0, d_sorted)
        slot_sorted = torch.where(d_sorted < R, d_sorted * B + rank_in, torch.full_like(rank_in, R * B))
        slot_r = torch.empty_like(slot_sorted).scatter_(0, o2, slot_sorted)  # each received row's hop-2 slot
        src = torch.full((R * B + 1,), Mp, dtype=torch.long, device=dev).scatter_(
            0, slot_r, torch.arange(Mp, device=dev))[:R * B]  # Mp: an empty slot
        bp_send = torch.cat([code_r % (cap + 1), code_r.new_full((1,), cap)]).index_select(0, src)  # cap: empty
        bp_d = all_to_all(bp_send, group)
        x_d = all_to_all(rows_r.index_select(0, src.clamp(max=Mp - 1)), group)  # empty slots: never read
        # at the destination: row bufpos of the compute buffer from wherever it arrived (every row of the first
        # `load` is filled exactly once; rows past the load, only below E/ep slots, are not computed)
        at = torch.full((cap + 1,), R * B - 1, dtype=torch.long, device=dev).scatter_(
            0, bp_d, torch.arange(R * B, device=dev))[:cap]
        offs = torch.cumsum(rows_RX[rank], 0).to(torch.int32)
        X = x_d.index_select(0, at)
        if cap > M:  # rows past the load: zero, and so is their gradient (the grouped GEMM leaves them unwritten)
            live = (torch.arange(cap, device=dev) < offs[-1])[:, None]
            X = torch.where(live, X, torch.zeros((), dtype=X.dtype))
        Y = experts.forward_with(X, offs, replicas(rep_RS))  # [cap, L]
        if cap > M:
            Y = torch.where(live, Y, torch.zeros((), dtype=Y.dtype))
        # back the same way, and the combine straight from the dealt rows (late routing weights, fp32)
        y_r = all_to_all(Y.index_select(0, bp_d.clamp(max=cap - 1)), group)
        y_back = all_to_all(y_r.index_select(0, slot_r.clamp(max=R * B - 1)), group)
        return weighted_combine(y_back, w_d, tok_d, N + 1)[:N]


def balanced_layers(model):
    """(dispatch, experts) of every MoE layer of `model` that runs balanced dispatch."""
    out = []
    for m in model.modules():
        b = getattr(getattr(m, "dispatcher", None), "balanced", None)
        if isinstance(b, BalancedDispatch):
            out.append((b, m.experts))
    return out


def flush_replica_gradients(model) -> None:
    """`BalancedDispatch.flush` of every balanced MoE layer of `model` (the trainer's step boundary)."""
    for b, experts in balanced_layers(model):
        b.flush(experts)
