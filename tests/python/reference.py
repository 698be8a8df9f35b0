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
