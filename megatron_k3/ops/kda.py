"""Kimi Delta Attention (KDA): a chunked torch form (`chunk_kda`) and its step-by-step reference (`recurrent_kda`).

Layout and meaning follow flash-linear-attention's KDA ops (see MODEL.md section 2).

Shape legend: B batch, T tokens, H query/key heads, HV value heads (a multiple of H), K key dim, V value dim,
N chunks (or, for states with `cu_seqlens`, documents), C chunk length.

Packed documents (several documents in one row, each starting from a zero or its own initial state) come in one
of two forms: `cu_seqlens`, the 1-D tensor of N+1 document offsets of a single row (B = 1), read on the host
(per-document layout, per-document initial and final states; prefill with a decode cache); or `seq_idx` [B, T]
int, the index of the document each token belongs to (non-decreasing along T, as fla/mamba's seq_idx), which
`chunk_kda` handles with static shapes and no host read (fixed chunks with document masks; what torch.compile
traces without graph breaks); its states are each row's own (a row continuing a document: `state_doc`).

Per head, with state S in R^{K x V}, the recurrence is
    S <- diag(exp(g_t)) S;   S <- S + beta_t k_t (v_t - S^T k_t)^T;   o_t = S^T (scale q_t).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .numerics import compute_dtype, without_autocast

__all__ = ["chunk_kda", "recurrent_kda", "runs_fused"]

_BACKENDS = ("auto", "torch", "fla")
_DIAG_BLOCK = 1  # diagonal blocks done pairwise (see _intra_chunk_scores); 1: sibling-block matmuls cover all
_FLA_CHUNK_KDA = None  # cached result of the fla capability probe: a callable, or False once the import failed


# --------------------------------------------------------------------------------------------------------------
# input checks


def _validate(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size=None):
    """Checks shapes and returns (B, T, H, K, HV, V, N, cu_list); cu_list is None without cu_seqlens."""
    for name, x, rank in (("q", q, 4), ("k", k, 4), ("v", v, 4), ("g", g, 4), ("beta", beta, 3)):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"`{name}` must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != rank:
            raise ValueError(f"`{name}` must have rank {rank}, got shape {tuple(x.shape)}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"`k` must have the shape of `q` [B, T, H, K] = {tuple(q.shape)}, got {tuple(k.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if v.shape[:2] != (B, T) or HV == 0 or HV % max(H, 1) != 0:
        raise ValueError(
            f"`v` must be [B, T, HV, V] with B={B}, T={T} and HV a multiple of H={H}, got {tuple(v.shape)}"
        )
    if g.shape != (B, T, HV, K):
        raise ValueError(f"`g` must be [B, T, HV, K] = {(B, T, HV, K)}, got {tuple(g.shape)}")
    if beta.shape != (B, T, HV):
        raise ValueError(f"`beta` must be [B, T, HV] = {(B, T, HV)}, got {tuple(beta.shape)}")
    if chunk_size is not None and (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"`chunk_size` must be a positive int, got {chunk_size!r}")

    cu_list = None
    N = B
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError("`cu_seqlens` must be a 1-D tensor of N+1 offsets (N >= 1 documents)")
        if cu_seqlens.dtype.is_floating_point or cu_seqlens.dtype.is_complex or cu_seqlens.dtype == torch.bool:
            raise ValueError(f"`cu_seqlens` must hold integers, got dtype {cu_seqlens.dtype}")
        if B != 1:
            raise ValueError(f"`cu_seqlens` needs the documents packed into batch size 1, got B={B}")
        cu_list = [int(x) for x in cu_seqlens.tolist()]
        if cu_list[0] != 0:
            raise ValueError(f"`cu_seqlens` must start at 0, got {cu_list[0]}")
        if any(b < a for a, b in zip(cu_list[:-1], cu_list[1:])):
            raise ValueError(f"`cu_seqlens` must be non-decreasing, got {cu_list}")
        if cu_list[-1] != T:
            raise ValueError(f"`cu_seqlens[-1]` must equal T={T}, got {cu_list[-1]}")
        N = len(cu_list) - 1
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor) or initial_state.shape != (N, HV, K, V):
            shape = tuple(initial_state.shape) if isinstance(initial_state, torch.Tensor) else type(initial_state)
            what = "N documents" if cu_seqlens is not None else "B"
            raise ValueError(f"`initial_state` must be [{what}, HV, K, V] = {(N, HV, K, V)}, got {shape}")
    return B, T, H, K, HV, V, N, cu_list


def _validate_seq_idx(seq_idx, B, T, cu_seqlens, initial_state, state_doc):
    """Checks `seq_idx` [B, T] (and `state_doc` [B]) by shape and dtype only (values are never read on the host)."""
    for name, x, shape in (("seq_idx", seq_idx, (B, T)), ("state_doc", state_doc, (B,))):
        if x is None and name == "state_doc":
            continue
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != shape:
            got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x)
            raise ValueError(f"`{name}` must be a {list(shape)} = {shape} tensor of document indices, got {got}")
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise ValueError(f"`{name}` must hold integers, got dtype {x.dtype}")
    if cu_seqlens is not None:
        raise ValueError("`seq_idx` and `cu_seqlens` describe the same documents: pass one of them, not both")
    if (initial_state is None) != (state_doc is None):
        raise ValueError("with `seq_idx`, `initial_state` [B, HV, K, V] and `state_doc` [B] (the document it belongs "
                         "to) come together: the state enters the row's leading tokens of that document")


def seq_idx_from_cu_seqlens(cu_seqlens: torch.Tensor, T: int, device=None) -> torch.Tensor:
    """[1, T] int64: the document index of every token of a packed row with offsets `cu_seqlens` (N+1 of them),
    with static-shape ops only (no host read): token t belongs to document #{n >= 1 : cu_seqlens[n] <= t}
    (an empty document gets no token; its index is skipped)."""
    cu = cu_seqlens.to(device if device is not None else cu_seqlens.device)
    return torch.searchsorted(cu[1:], torch.arange(T, dtype=cu.dtype, device=cu.device), right=True)[None]


def _seq_idx_to_cu_seqlens(seq_idx: torch.Tensor) -> torch.Tensor:
    """The offsets of the documents of seq_idx's B rows laid end to end as one packed row [1, B*T] (a row start
    always starts a document). Reads the host (nonzero): only for fla's kernel, which reads cu_seqlens anyway."""
    flat = seq_idx.reshape(-1)
    t = torch.arange(flat.numel(), device=flat.device)
    start = t % max(seq_idx.shape[1], 1) == 0
    start[1:] |= flat[1:] != flat[:-1]
    return torch.cat([start.nonzero().squeeze(1), t.new_full((1,), flat.numel())])


# --------------------------------------------------------------------------------------------------------------
# reference: one step at a time


def recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Step-by-step KDA: the reference for `chunk_kda`, and the decode path (T=1 with a state).

    q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV, K] per-step log decay (<= 0); beta: [B, T, HV] in (0, 1).
    States are [B, HV, K, V] fp32 ([N, HV, K, V] with `cu_seqlens`, B = 1). Returns (o [B, T, HV, V], final state or
    None). Math in fp32 (fp64 for fp64 inputs); o has v's dtype.
    """
    with without_autocast(q.device.type):  # fp32 math under a bf16 autocast too
        B, T, H, K, HV, V, N, cu_list = _validate(q, k, v, g, beta, initial_state, cu_seqlens)
        scale = K**-0.5 if scale is None else scale
        dt = compute_dtype(q, k, v, g, beta, initial_state)
        q_BTHK, k_BTHK = (x.to(dt).repeat_interleave(HV // H, dim=2) for x in (q, k))
        v_BTHV, g_BTHK, beta_BTH = v.to(dt), g.to(dt), beta.to(dt)
        segments = [(0, T, slice(None))] if cu_list is None else [(a, b, slice(n, n + 1)) for n, (a, b) in
                                                                      enumerate(zip(cu_list[:-1], cu_list[1:]))]
        outs, finals = [], []
        for start, end, rows in segments:
            if initial_state is None:
                S_BHKV = q_BTHK.new_zeros(B if cu_list is None else 1, HV, K, V)
            else:
                S_BHKV = initial_state[rows].to(dt)
            for t in range(start, end):
                k_t = k_BTHK[:, t]
                S_BHKV = S_BHKV * g_BTHK[:, t].exp()[..., None]
                err_BHV = v_BTHV[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, S_BHKV)
                S_BHKV = S_BHKV + (beta_BTH[:, t, :, None] * k_t)[..., None] * err_BHV[..., None, :]
                outs.append(torch.einsum("bhk,bhkv->bhv", q_BTHK[:, t] * scale, S_BHKV))
            finals.append(S_BHKV)
        o_BTHV = torch.stack(outs, dim=1) if outs else v_BTHV.new_zeros(B, 0, HV, V)
        final = None
        if output_final_state:
            final = torch.cat(finals, dim=0)
        return o_BTHV.to(v.dtype), final


# --------------------------------------------------------------------------------------------------------------
# chunked form


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
    *,
    seq_idx: torch.Tensor | None = None,
    state_doc: torch.Tensor | None = None,
    backend: str = "auto",
    lower_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise-parallel KDA; same arguments and results as `recurrent_kda`, plus `chunk_size`.

    seq_idx: [B, T] int, the document index of each token (non-decreasing along each row, any B): every document
    starts from a zero state, as with the equivalent `cu_seqlens`, but with static shapes and no host read of the
    layout (see `_chunk_kda_torch`). Exclusive with `cu_seqlens`. A row can continue a document from before it
    (a range of a longer row: sequence tiling): `initial_state` [B, HV, K, V] with `state_doc` [B], the document
    that state belongs to, reaches the row's leading tokens of that document; the final state ([B, HV, K, V],
    `output_final_state`) is the state after each row's last token, in that token's document.

    lower_bound: when the caller guarantees lower_bound <= g < 0 (K3's gate, -5), fla's kernel may use its
    bounded-gate ("safe_gate") path; the torch path is safe for any g and ignores it.

    backend: "torch" runs the pure-torch chunked algorithm below (the CPU path); "fla" calls
    `fla.ops.kda.chunk_kda` (CUDA tensors, chunk_size 32 or 64); "auto" uses fla when it can, else torch.
    """
    if backend not in _BACKENDS:
        raise ValueError(f"`backend` must be one of {_BACKENDS}, got {backend!r}")
    B, T, _, _, _, _, _, cu_list = _validate(q, k, v, g, beta, initial_state, cu_seqlens, chunk_size)
    if seq_idx is not None:
        _validate_seq_idx(seq_idx, B, T, cu_seqlens, initial_state, state_doc)
    elif state_doc is not None:
        raise ValueError("`state_doc` names the document of an initial state under `seq_idx`; no `seq_idx` given")
    if backend != "torch":
        fla_fn = _fla_chunk_kda() if runs_fused(q, chunk_size, backend) else None
        if fla_fn is not None and seq_idx is not None and (initial_state is not None or output_final_state):
            if backend == "fla":
                raise RuntimeError("backend='fla' takes no initial or final state with `seq_idx`; pass cu_seqlens")
            fla_fn = None
        if fla_fn is not None:
            return _fla_chunk(fla_fn, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                              seq_idx, chunk_size, lower_bound)
        if backend == "fla":
            raise RuntimeError(
                "backend='fla' needs CUDA tensors, chunk_size 32 or 64 and an importable flash-linear-attention"
            )
    with without_autocast(q.device.type):  # fp32 math under a bf16 autocast too
        return _chunk_kda_torch(q, k, v, g, beta, scale, initial_state, output_final_state, chunk_size, cu_list,
                                seq_idx, state_doc)


def _fla_chunk(fla_fn, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, seq_idx, chunk_size,
               lower_bound):
    """fla's fused chunk_kda, with the chunk length (fla takes it as a keyword: 64 when not given) and, given K3's
    gate bound, its bounded-gate path."""
    fla_kw = {"chunk_size": chunk_size}
    if lower_bound is not None:
        fla_kw.update(safe_gate=True, lower_bound=lower_bound)
    if seq_idx is not None:
        return _fla_seq_idx(fla_fn, q, k, v, g, beta, scale, seq_idx, fla_kw)
    o, final = fla_fn(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                      output_final_state=output_final_state, cu_seqlens=cu_seqlens, **fla_kw)
    return o.to(v.dtype), (final.float() if final is not None else None)


def _fla_seq_idx(fla_fn, q, k, v, g, beta, scale, seq_idx, fla_kw):
    """fla's kernel on seq_idx's documents: the B rows laid end to end as one packed row with the equivalent
    cu_seqlens (fla's varlen path reads the offsets on the host in any case). Returns (o [B, T, HV, V], None)."""
    B, T = seq_idx.shape

    def flat(x):
        return x.reshape(1, B * T, *x.shape[2:])

    o, _ = fla_fn(flat(q), flat(k), flat(v), flat(g), flat(beta), scale=scale, initial_state=None,
                  output_final_state=False, cu_seqlens=_seq_idx_to_cu_seqlens(seq_idx), **fla_kw)
    return o.reshape(B, T, *o.shape[2:]).to(v.dtype), None


def runs_fused(q: torch.Tensor, chunk_size: int, backend: str = "auto") -> bool:
    """Whether `chunk_kda` on `q` runs fla's fused kernel (which never materialises the chunk terms at once)."""
    return backend != "torch" and q.is_cuda and chunk_size in (32, 64) and _fla_chunk_kda() is not None


def _fla_chunk_kda():
    """Capability probe: fla's Triton chunk_kda, imported lazily on first CUDA call; None if unavailable."""
    global _FLA_CHUNK_KDA
    if _FLA_CHUNK_KDA is None:
        try:
            from fla.ops.kda import chunk_kda as fla_chunk_kda

            _FLA_CHUNK_KDA = fla_chunk_kda
        except Exception:  # noqa: BLE001 - any import failure means "not available"
            _FLA_CHUNK_KDA = False
    return _FLA_CHUNK_KDA or None


class _Chunks:
    """Where the tokens of [B, T, ...] inputs lie in the chunk layout [N, Bc, HV, C, .] (chunk-major, so the
    sequential hand-off slices contiguously), and the way back.

    Plain (cu_list None): each row padded to whole chunks (zero q, k, v, beta and g = 0 past the end leave the state
    unchanged), Bc = B. Documents (cu_list): every document starts its own chunk, slots past a document's end read a
    zero row (index T), Bc = 1; `starts_at` / `ends_at` map a document's first / last chunk to the document."""

    def __init__(self, B, T, C, cu_list, device):
        self.B, self.T, self.C, self.documents = B, T, C, cu_list is not None
        self.starts_at, self.ends_at = {}, {}
        if cu_list is None:
            self.NC = -(-T // C)
            self.pad = self.NC * C - T
            self.Bc = B
            return
        starts = torch.tensor(cu_list[:-1])
        lens = torch.tensor(cu_list[1:]) - starts
        chunks_per_doc = -(-lens // C)
        self.NC = int(chunks_per_doc.sum())
        self.pad, self.Bc, self.num_docs = None, 1, len(lens)
        doc_of_chunk = torch.repeat_interleave(torch.arange(len(lens)), chunks_per_doc)
        first_chunk = torch.cumsum(chunks_per_doc, 0) - chunks_per_doc
        local = torch.arange(self.NC) - first_chunk[doc_of_chunk]
        tok_NC = starts[doc_of_chunk, None] + local[:, None] * C + torch.arange(C)
        valid_NC = tok_NC < (starts + lens)[doc_of_chunk, None]
        self.gather_idx = torch.where(valid_NC, tok_NC, T).reshape(-1).to(device)
        self.out_idx = valid_NC.reshape(-1).nonzero().squeeze(1).to(device)  # tokens come out in order
        nonempty = [d for d in range(len(lens)) if int(chunks_per_doc[d]) > 0]
        self.starts_at = {int(first_chunk[d]): d for d in nonempty}
        self.ends_at = {int(first_chunk[d] + chunks_per_doc[d]) - 1: d for d in nonempty}

    def to_chunks(self, x_BTH_):
        """[B, T, H, ...] -> [N, Bc, H, C, ...]."""
        B, NC, C = self.B, self.NC, self.C
        if not self.documents:  # pad the tail up to a multiple of C
            x_BTH_ = F.pad(x_BTH_, (0, 0) * (x_BTH_.dim() - 2) + (0, self.pad))
            return x_BTH_.reshape(B, NC, C, *x_BTH_.shape[2:]).movedim(1, 0).movedim(3, 2).contiguous()
        x_BTH_ = torch.cat([x_BTH_, x_BTH_.new_zeros(1, 1, *x_BTH_.shape[2:])], dim=1)[:, self.gather_idx]
        return x_BTH_.reshape(1, NC, C, *x_BTH_.shape[2:]).movedim(1, 0).movedim(3, 2).contiguous()

    def from_chunks(self, o_NBHCV):
        """[N, Bc, HV, C, V] -> [B, T, HV, V]."""
        NC, Bc, HV, C, V = o_NBHCV.shape
        o_BTHV = o_NBHCV.movedim(0, 1).movedim(2, 3).reshape(Bc, NC * C, HV, V)
        return o_BTHV[:, :self.T] if not self.documents else o_BTHV[:, self.out_idx]


def _document_masks(seq_idx, chunks, dt, state_doc=None):
    """seq_idx's per-chunk document masks (same_ij, c_i, e_i of `_chunk_kda_torch`), [N, B, 1, C(, C)] in dt
    (broadcast over heads); tail padding joins the row's last document (inert: zero q, k, v, beta and g), so the
    state after the last chunk is that document's. `state_doc` [B]: the document of the incoming state (default:
    the row's first token's, whose incoming state is zero)."""
    B, NC, C = chunks.B, chunks.NC, chunks.C
    doc = seq_idx.to(dtype=torch.long)
    doc = torch.cat([doc, doc[:, -1:].expand(B, chunks.pad)], dim=1)
    doc = doc.reshape(B, NC, C).movedim(1, 0).unsqueeze(2)  # [N, B, 1, C]
    first = doc[:1, ..., :1] if state_doc is None else state_doc.to(doc).reshape(1, B, 1, 1)
    prev = torch.cat([first, doc[:-1, ..., -1:]], dim=0)  # [N, B, 1, 1]
    return ((doc[..., :, None] == doc[..., None, :]).to(dt),  # same_ij
            (doc == prev).to(dt)[..., None],  # c_i, [N, B, 1, C, 1]
            (doc == doc[..., -1:]).to(dt)[..., None])  # e_i


def _chunk_terms(q, k, v, g, beta, scale, C, masks):
    """P, R, M, N of every chunk at once (inputs in the chunk layout [N, Bc, HV, C, .]; beta [N, Bc, HV, C])."""
    K, V = q.shape[-1], v.shape[-1]
    # Every decay exponent is a sum of the g's it spans (<= 0, so every exp is <= 1 and nothing overflows, while
    # a chunk-wide exp(-G) would pass the fp32 range once G < -88). None is a difference of two chunk-wide
    # cumulative sums either: that difference loses |G| * 6e-8 of absolute accuracy (~1e-5 at G = -160).
    A_qk, A_kk = _intra_chunk_scores(q, k, g, C)
    A_qk = A_qk * scale
    A_kk = A_kk * beta[..., :, None]
    gamma = _cumsum(g).exp()  # decay from the chunk start, inclusive
    gamma_in = gamma  # the incoming state's decay to each token (zero where it does not reach: seq_idx)
    if masks is not None:
        same, carry, reach = masks
        A_qk, A_kk, gamma_in = A_qk * same, A_kk * same, gamma * carry
    rhs = torch.cat([v, k * gamma_in], dim=-1) * beta[..., None]
    # (I + A_kk) [U | W] = beta [V | K Gamma]: a unit-triangular solve reads (and differentiates) only the strict
    # lower triangle of A_kk; the unit diagonal is implied
    UW = torch.linalg.solve_triangular(A_kk, rhs, upper=False, unitriangular=True)
    k_tail = k * _tail_sum(g).exp()  # decay from each position to the chunk end
    if masks is not None:
        k_tail = k_tail * reach
    R, AW = (A_qk @ UW).split([V, K], dim=-1)
    N_, KW = (k_tail.transpose(-1, -2) @ UW).split([V, K], dim=-1)
    P = (scale * q) * gamma_in - AW
    M = torch.diag_embed(gamma_in[..., -1, :]) - KW
    return P, R, M, N_


def _hand_off(M, N_, chunks, initial_state, zeros):
    """S_{n+1} = M_n S_n + N_n chunk by chunk, reset at document starts: (each chunk's incoming state
    [N, Bc * HV, K, V], the last state, {document: its final state}). zeros(*shape): a zero state."""
    NC, K, V = chunks.NC, M.shape[-1], N_.shape[-1]
    M3 = M.reshape(NC, -1, K, K)
    N3 = N_.reshape(NC, -1, K, V)
    S = None
    if not chunks.documents:
        S = (initial_state if initial_state is not None else zeros(chunks.B, M3.shape[1] // chunks.B, K, V))
        S = S.reshape(-1, K, V)
    chunk_start_states, finals = [], {}
    M3, N3 = M3.unbind(0), N3.unbind(0)  # (unbind, not indexing: its backward is one stack, not NC zero-fills)
    for n in range(NC):
        d = chunks.starts_at.get(n)
        if d is not None:
            S = initial_state[d] if initial_state is not None else zeros(M3[n].shape[0], K, V)
        chunk_start_states.append(S)
        S = torch.baddbmm(N3[n], M3[n], S)
        d = chunks.ends_at.get(n)
        if d is not None:
            finals[d] = S
    return torch.stack(chunk_start_states), S, finals


def _chunk_kda_torch(q, k, v, g, beta, scale, initial_state, output_final_state, C, cu_list, seq_idx=None,
                     state_doc=None):
    """Chunked KDA in torch (plain autograd). Per chunk with start state S, G the running sum of g, Gamma = exp(G):
    (I + A_kk) [U | W] = beta [V | K Gamma];  O = P S + R,  P = scale Q Gamma - A_qk W,  R = A_qk U;
    S_next = M S + N,  M = diag(Gamma_C) - K_tail^T W,  N = K_tail^T U,  K_tail = K exp(G_C - G).
    P, R, M, N are batched over all chunks (`_chunk_terms`); only S_next = M S + N runs chunk by chunk
    (`_hand_off`).

    Documents, two layouts (`_Chunks`). cu_list (host offsets): every document starts its own chunk, slots past a
    document's end are zero, and the hand-off resets the state at document starts. seq_idx [B, T] (static): the
    plain fixed chunks of each row, with per-chunk document masks (i, j tokens of a chunk; "prev" the token just
    before the chunk's first one, the first token itself for chunk 0, whose incoming state is zero anyway):
        same_ij = doc_i == doc_j,  c_i = doc_i == doc_prev (token i carries the incoming state S),
        e_i = doc_i == doc_last (token i reaches the chunk-end state);
    A_qk, A_kk <- A * same (the solve becomes block-diagonal by document), Gamma <- c Gamma in P and in the solve's
    right-hand side (so W rows vanish for tokens the incoming state does not reach), K_tail <- e K_tail, and
    diag(Gamma_C) <- c_last diag(Gamma_C) in M (the state passes the whole chunk only if one document spans it).
    A document starting exactly at a chunk start has c = 0 throughout, which drops the previous document's state.
    The masks multiply, so every exp stays <= 1 as in the plain path; tail padding joins the last document (its q,
    k, v, beta are zero and g = 0, so it is inert whatever it joins). With an initial state, `state_doc` [B] is
    doc_prev of chunk 0 (the state reaches the leading tokens of that document); the last state is the document of
    each row's last token's.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K**-0.5 if scale is None else scale
    dt = compute_dtype(q, k, v, g, beta, initial_state)
    chunks = _Chunks(B, T, C, cu_list, q.device)
    init = initial_state.to(dt) if initial_state is not None else None
    if chunks.NC == 0:  # T == 0: nothing to do
        final = None
        if output_final_state:
            N = B if cu_list is None else len(cu_list) - 1
            final = init if init is not None else q.new_zeros(N, HV, K, V, dtype=dt)
        return v.new_zeros(B, T, HV, V), final

    masks = None if seq_idx is None else _document_masks(seq_idx.to(q.device), chunks, dt, state_doc)
    grp = HV // H
    q_NBHCK = chunks.to_chunks(q.to(dt).repeat_interleave(grp, dim=2))
    k_NBHCK = chunks.to_chunks(k.to(dt).repeat_interleave(grp, dim=2))
    v_NBHCV = chunks.to_chunks(v.to(dt))
    g_NBHCK = chunks.to_chunks(g.to(dt))
    beta_NBHC = chunks.to_chunks(beta.to(dt).unsqueeze(-1)).squeeze(-1)
    P, R, M, N_ = _chunk_terms(q_NBHCK, k_NBHCK, v_NBHCV, g_NBHCK, beta_NBHC, scale, C, masks)

    def zeros(*shape):
        return q_NBHCK.new_zeros(*shape)

    S_NBHKV, S, finals = _hand_off(M, N_, chunks, init, zeros)
    o_NBHCV = torch.baddbmm(R.reshape(-1, C, V), P.reshape(-1, C, K), S_NBHKV.reshape(-1, K, V))
    o_BTHV = chunks.from_chunks(o_NBHCV.reshape(chunks.NC, chunks.Bc, HV, C, V))
    final = None
    if output_final_state:
        if cu_list is None:
            final = S.reshape(B, HV, K, V)
        else:  # a zero-length document keeps its initial state
            final = torch.stack([finals[d] if d in finals else (init[d] if init is not None else zeros(HV, K, V))
                                 for d in range(len(cu_list) - 1)])
    return o_BTHV.to(v.dtype), final


def _cumsum(x):
    """Inclusive running sum along dim -2 as a matmul with a 0/1 triangle (faster than cumsum on CPU)."""
    n = x.shape[-2]
    return x if n == 1 else torch.ones(n, n, dtype=x.dtype, device=x.device).tril() @ x


def _tail_sum(x):
    """y_i = sum_{t > i} x_t along dim -2, summed directly (never as a difference of two running sums)."""
    n = x.shape[-2]
    return torch.zeros_like(x) if n == 1 else torch.ones(n, n, dtype=x.dtype, device=x.device).triu(1) @ x


def _intra_chunk_scores(q, k, g, C):
    """A_qk[i, j] = sum_c q_i k_j exp(G_i - G_j) for i >= j, and A_kk the same with k_i; both [..., C, C], zero
    above the diagonal. (A_kk is only used strictly below it: its diagonal k_i.k_i is left for the solve to ignore.)

    G_i - G_j = sum_{j < t <= i} g_t <= 0 is always summed directly from the g's it spans (never as a difference
    of running sums), and every factor that gets exponentiated is such a sum, so every exp is <= 1: nothing
    overflows whatever the gate, and every term keeps full relative accuracy.

    Diagonal blocks of S positions (C = S * 2^m, S <= _DIAG_BLOCK unless C has a larger odd factor; S = 1 for
    power-of-two chunks, i.e. just i = j) use the pairwise decay tensor [..., S, S, K]. Every other pair i > j
    lies in exactly one "sibling" block: at block size b (S, 2S, ..., C/2) the chunk splits into pairs of
    adjacent blocks (L, I), and I x L is one matmul with the reference r = end of L: rows i in I take
    exp(sum_{r < t <= i} g_t) <= 1 and columns j in L take exp(sum_{j < t <= r} g_t) <= 1, so the product is
    safe for any g. (Measured on 2 CPU cores at T=4096, H=4, K=V=128: S = 1 is the fastest, 2.5x faster
    fwd+bwd than pairwise 16 x 16 diagonal blocks, whose [..., 16, 16, K] tensors dominate memory traffic.)
    """
    S = C
    while S > _DIAG_BLOCK and S % 2 == 0:
        S //= 2
    X = torch.stack((q, k), dim=-3)  # [..., 2, C, K]: rows of A_qk and A_kk share every column factor
    value, position = _diagonal_blocks(X, k, g, S)
    values, positions = [value], [position]  # flattened pieces of A and where they go in the C x C matrix
    lead, Kd, dev = g.shape[:-2], g.shape[-1], g.device

    b = S
    while b < C:
        nb = C // (2 * b)
        gb = g.reshape(*lead, nb, 2, b, Kd)
        row_f = _cumsum(gb[..., 1, :, :]).exp()  # exp(sum_{r < t <= i} g_t), i in I
        col_f = _tail_sum(gb[..., 0, :, :]).exp()  # exp(sum_{j < t <= r} g_t), j in L
        rows = X.reshape(*lead, 2, nb, 2, b, Kd)[..., 1, :, :] * row_f.unsqueeze(-4)
        cols = k.reshape(*lead, nb, 2, b, Kd)[..., 0, :, :] * col_f
        values.append((rows @ cols.transpose(-1, -2).unsqueeze(-4)).reshape(*lead, 2, nb * b * b))
        i0 = torch.arange(nb, device=dev).reshape(nb, 1, 1) * 2 * b
        ii, jj = torch.arange(b, device=dev).reshape(1, b, 1), torch.arange(b, device=dev).reshape(1, 1, b)
        positions.append(((i0 + b + ii) * C + i0 + jj).reshape(-1))
        b *= 2

    # scatter the pieces into the C x C matrices with one gather (entries above the diagonal read a zero)
    vals = torch.cat(values + [X.new_zeros(*lead, 2, 1)], dim=-1)
    pos = torch.cat(positions)
    src = torch.full((C * C,), vals.shape[-1] - 1, dtype=torch.long, device=dev)
    src[pos] = torch.arange(pos.numel(), device=dev)
    A = vals[..., src].reshape(*lead, 2, C, C)
    return A[..., 0, :, :], A[..., 1, :, :]


def _diagonal_blocks(X, k, g, S):
    """The diagonal S x S blocks of `_intra_chunk_scores` (X = stack(q, k) [..., 2, C, K]): (their values
    [..., 2, C * S], their flat positions in the C x C matrix). D[i, j] = sum_{j < t <= i} g_t as a matmul of 0/1
    spans, masked to -inf above the diagonal before exp (safe for any g); S = 1 is the diagonal i = j, no decay."""
    C, Kd = g.shape[-2], g.shape[-1]
    lead, dt, dev = g.shape[:-2], g.dtype, g.device
    if S == 1:
        return (X * k.unsqueeze(-3)).sum(-1), torch.arange(C, device=dev) * (C + 1)
    pi, pj = torch.arange(S * S, device=dev) // S, torch.arange(S * S, device=dev) % S
    t = torch.arange(S, device=dev)
    span = ((t[None, :] > pj[:, None]) & (t[None, :] <= pi[:, None])).to(dt)  # [S*S, S]
    upper = torch.where(pi >= pj, 0.0, float("-inf")).to(dt)[:, None]
    decay = (span @ g.reshape(*lead, C // S, S, Kd) + upper).exp()  # [..., C/S, S*S, K]
    kdec = k.reshape(*lead, C // S, 1, S, Kd) * decay.reshape(*lead, C // S, S, S, Kd)  # k_j exp(G_i - G_j)
    Xs = X.reshape(*lead, 2, C // S, S, 1, Kd)
    blk = torch.arange(0, C, S, device=dev).reshape(C // S, 1, 1)
    return ((Xs * kdec.unsqueeze(-5)).sum(-1).reshape(*lead, 2, C * S),
            ((blk + pi.reshape(1, S, S)) * C + blk + pj.reshape(1, S, S)).reshape(-1))
