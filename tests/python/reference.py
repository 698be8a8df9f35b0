"""Plain-torch references for the gmoe package tests, and the named routings (tests/common's
named shape cases, scaled down for the CPU backend)."""
import math

import torch
import torch.nn.functional as F

# name -> counts builder for E experts and `total` rows
ROUTINGS = {
    "uniform": lambda E, total: [total // E + (1 if e < total % E else 0) for e in range(E)],
    "skewed_empty": lambda E, total: _skewed(E, total),
    "one_expert": lambda E, total: [total if e == E - 1 else 0 for e in range(E)],
    "all_empty": lambda E, total: [0] * E,
}


def _skewed(E, total):
    w = [1.0 / (e + 1) ** 1.1 if e % 3 != 1 else 0.0 for e in range(E)]
    s = sum(w)
    counts = [int(math.floor(total * x / s)) for x in w]
    counts[0] += total - sum(counts)
    return counts


def counts_tensor(counts, device="cpu", dtype=torch.int32):
    return torch.tensor(counts, dtype=dtype, device=device)


def offsets(counts):
    o = [0]
    for c in counts:
        o.append(o[-1] + int(c))
    return o


def grouped_linear(x, w, counts, bias=None):
    """y[rows of e] = F.linear(x[rows of e], w[e], bias[e]); rows past the total are 0."""
    o = offsets(counts)
    parts = [F.linear(x[o[e]:o[e + 1]], w[e], None if bias is None else bias[e]) for e in range(len(counts))]
    # the rows past the total: zeros that still depend on x (so that autograd sees them)
    parts.append(0 * F.linear(x[o[-1]:], w[0]))
    return torch.cat(parts)


def gate_up(h, glu_block):
    F_ = h.shape[1] // 2
    if glu_block == 0:
        return h[:, :F_], h[:, F_:]
    v = h.reshape(h.shape[0], F_ // glu_block, 2, glu_block)
    return v[:, :, 0, :].reshape(h.shape[0], F_), v[:, :, 1, :].reshape(h.shape[0], F_)


def activation(h, kind, alpha=1.702, limit=7.0, gelu_tanh=False, glu_block=0):
    if kind == "squared_relu":
        return torch.relu(h) ** 2
    g, u = gate_up(h, glu_block)
    if kind == "swiglu":
        return F.silu(g) * u
    if kind == "geglu":
        return F.gelu(g, approximate="tanh" if gelu_tanh else "none") * u
    if kind == "clamped_swiglu":
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
        return g * torch.sigmoid(alpha * g) * (u + 1)
    raise ValueError(kind)


def grouped_activation(h, counts, kind, probs=None, **kw):
    """act(h)·probs on the rows within the total, 0 past it."""
    total = sum(int(c) for c in counts)
    z = activation(h, kind, **kw)
    if probs is not None:
        z = z * probs[:, None].to(z.dtype)
    mask = (torch.arange(h.shape[0]) < total).to(z.dtype)[:, None]
    return z * mask


def tolerance_ok(got, ref64, ref_same_precision, atol=1e-5):
    """The project's rule: gmoe's error against the fp64 reference is at most twice that of a
    reference computed in gmoe's own precision, plus a small atol."""
    err = (got.double() - ref64).abs().max().item()
    base = (ref_same_precision.double() - ref64).abs().max().item()
    return err <= 2 * base + atol, (err, base)


# ---- routing: the MoE block as Megatron writes it in plain torch -----------------------------------

def _stable_topk(values, k):
    """The k largest along the last dimension, ties to the lower index (gmoe's order)."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def router_topk(logits, top_k, score_func="softmax", normalize=False, n_group=1, topk_group=1, scaling_factor=1.0,
                score_bias=None):
    """(ids int32 [T, k], probs f32 [T, k] differentiable in logits, counts int32 [E])."""
    x = logits.float()
    T, E = x.shape
    scores = torch.softmax(x, dim=-1) if score_func == "softmax" else torch.sigmoid(x)
    with torch.no_grad():
        if score_bias is None and n_group == 1:
            choice = x.clone()  # ranks as the scores do, without exp's rounding
        else:
            choice = scores + (0 if score_bias is None else score_bias.float())
        if n_group > 1:
            gsize = E // n_group
            m = max(1, min(top_k // topk_group, gsize))
            grouped = choice.view(T, n_group, gsize)
            gscore = torch.gather(grouped, 2, _stable_topk(grouped, m)).sum(-1)
            keep = torch.zeros(T, n_group, dtype=torch.bool)
            keep.scatter_(1, _stable_topk(gscore, topk_group), True)
            choice = choice.masked_fill(~keep.repeat_interleave(gsize, dim=1), -math.inf)
        ids = _stable_topk(choice, top_k)
    probs = torch.gather(scores, 1, ids)
    if normalize:
        probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
    probs = probs * scaling_factor
    counts = torch.bincount(ids.flatten(), minlength=E)
    return ids.int(), probs, counts.int()


def router_aux_loss(logits, counts, top_k, coeff, score_func="softmax"):
    x = logits.float()
    T, E = x.shape
    if T == 0:
        return x.sum() * 0
    q = torch.softmax(x, -1) if score_func == "softmax" else torch.sigmoid(x)
    if score_func == "sigmoid":
        q = q / (q.sum(-1, keepdim=True) + 1e-20)
    return coeff * E / (T * T * top_k) * (counts.float() * q.sum(0)).sum()


def router_z_loss(logits, coeff):
    x = logits.float()
    if x.shape[0] == 0:
        return x.sum() * 0
    return coeff * torch.logsumexp(x, -1).square().mean()


def permute(x, ids, E, pad_multiple=1, capacity_factor=0.0, probs=None):
    """The argsort permute: (permuted [rows, H], padded counts, row_of, src_token, permuted_probs,
    dropped), differentiable in x and probs. rows = gmoe.permuted_rows(...)."""
    T, k = ids.shape
    n = T * k
    flat = ids.flatten().long()
    order = torch.argsort(flat, stable=True)  # (token, slot) order inside an expert
    seen = torch.bincount(flat, minlength=E)
    start = torch.cumsum(seen, 0) - seen
    pos = torch.empty(n, dtype=torch.long)
    pos[order] = torch.arange(n) - start[flat[order]]
    cap = math.ceil(capacity_factor * T * k / E) if capacity_factor > 0 else n
    kept_per_expert = seen.clamp(max=cap)
    padded = (kept_per_expert + pad_multiple - 1) // pad_multiple * pad_multiple
    offset = torch.cumsum(padded, 0) - padded
    kept = pos < cap
    row_of = torch.where(kept, offset[flat] + pos, torch.full_like(pos, -1))
    kept_min = min(n, E * cap) if capacity_factor > 0 else n
    rows = kept_min + E * (pad_multiple - 1)
    src_token = torch.full((rows,), -1, dtype=torch.long)
    dest = row_of[kept]
    token = torch.arange(n)[kept] // k
    src_token[dest] = token
    permuted = torch.zeros(rows, x.shape[1], dtype=x.dtype).index_copy(0, dest, x[token])
    permuted_probs = None
    if probs is not None:
        permuted_probs = torch.zeros(rows, dtype=torch.float32).index_copy(0, dest, probs.flatten()[kept].float())
    dropped = int((~kept).sum())
    return permuted, padded.int(), row_of.view(T, k).int(), src_token.int(), permuted_probs, dropped


def combine(expert_out, row_of, probs=None):
    """out[t] = Σ_j probs[t, j]·expert_out[row_of[t, j]] over the kept slots (index_add), in f32."""
    T, k = row_of.shape
    flat = row_of.flatten().long()
    kept = flat >= 0
    rows = expert_out.float()[flat[kept]]
    if probs is not None:
        rows = rows * probs.flatten()[kept][:, None].float()
    token = torch.arange(T * k)[kept] // k
    out = torch.zeros(T, expert_out.shape[1], dtype=torch.float32).index_add(0, token, rows)
    return out.to(expert_out.dtype)


def mlp(x, counts, w1, b1, w2, b2, kind, glu_block=0, **kw):
    """GroupedMLP in plain torch: grouped FC1 → activation → grouped FC2 (counts: a list)."""
    h = grouped_linear(x, w1, counts, b1)
    z = grouped_activation(h, counts, kind, glu_block=glu_block, **kw)
    return grouped_linear(z, w2, counts, b2)


def saved_bytes(m, *args):
    """m(*args), and the bytes autograd saves for its backward (deduplicated by storage, parameters
    excluded)."""
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = m(*args)
    return y, sum(saved.values())
