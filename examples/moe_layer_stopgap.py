"""examples/moe_layer_stopgap.py — TEMPORARY stand-in for ``gmoe.MoELayer``; delete at merge.

gmoe.MoELayer is being added to the PyTorch package on another branch. Until it is on this one,
examples/train_moe_lm.py imports this class instead (one ``except ImportError`` branch there). It
has gmoe.MoELayer's constructor, submodules (``router``, ``experts``, ``shared_experts``) and
``forward`` contract, but routes in torch ops around ``gmoe.GroupedMLP``: softmax top-k, a stable
argsort permute, device counts, router probabilities applied inside the experts' activation, an
index_add combine. Only what the training example uses is implemented; the rest raises.

When gmoe.MoELayer lands: delete this file and the ``except ImportError`` branch in
train_moe_lm.py.
"""
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

import gmoe


class MoELayer(nn.Module):
    """The interface of gmoe.MoELayer (see the module docstring for what is not implemented)."""

    def __init__(self, num_experts, hidden_size, ffn_hidden_size, top_k, *, activation="swiglu", bias=False,
                 glu_layout="concatenated", score_func="softmax", normalize_topk=False, n_group=1, topk_group=1,
                 scaling_factor=1.0, score_correction_bias=False, pad_multiple=1, capacity_factor=0.0,
                 aux_loss_coeff=0.0, z_loss_coeff=0.0, shared_expert_ffn_hidden_size=0, recipe=None,
                 weight_layout="stacked", device=None, dtype=None):
        super().__init__()
        unsupported = dict(score_func=(score_func, "softmax"), n_group=(n_group, 1), topk_group=(topk_group, 1),
                           score_correction_bias=(score_correction_bias, False), pad_multiple=(pad_multiple, 1),
                           capacity_factor=(capacity_factor, 0.0),
                           shared_expert_ffn_hidden_size=(shared_expert_ffn_hidden_size, 0))
        for name, (got, only) in unsupported.items():
            if got != only:
                raise NotImplementedError(f"moe_layer_stopgap.MoELayer: {name}={got!r} (only {only!r})")
        self.num_experts, self.top_k = num_experts, top_k
        self.normalize_topk, self.scaling_factor = normalize_topk, float(scaling_factor)
        self.aux_loss_coeff, self.z_loss_coeff = float(aux_loss_coeff), float(z_loss_coeff)
        self.router = nn.Linear(hidden_size, num_experts, bias=False, device=device, dtype=dtype)
        self.experts = gmoe.GroupedMLP(num_experts, hidden_size, ffn_hidden_size, activation=activation,
                                       glu_layout=glu_layout, bias=bias, weight_layout=weight_layout, recipe=recipe,
                                       device=device, dtype=dtype)
        self.shared_experts = None
        self.aux_loss: Optional[torch.Tensor] = None
        self.last_counts: Optional[torch.Tensor] = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        T, E, k = x.shape[0], self.num_experts, self.top_k
        logits = F.linear(x.float(), self.router.weight.float())
        scores = torch.softmax(logits, dim=-1)
        probs, ids = torch.topk(scores, k, dim=-1)
        if self.normalize_topk:
            probs = probs / (probs.sum(-1, keepdim=True) + 1e-20)
        probs = probs * self.scaling_factor
        flat_ids = ids.reshape(-1)
        counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
        order = torch.argsort(flat_ids, stable=True)  # (token, slot) order inside each expert
        token_of_row = order // k
        y = self.experts(x[token_of_row], counts, probs.reshape(-1)[order])
        out = torch.zeros(T, shape[-1], dtype=torch.float32, device=x.device)
        out = out.index_add(0, token_of_row, y.float()).to(x.dtype)
        self.last_counts = counts
        self.aux_loss = self._losses(logits, scores, counts, T)
        return out.reshape(shape)

    def _losses(self, logits, scores, counts, T):
        loss = None
        if self.aux_loss_coeff > 0:
            loss = self.aux_loss_coeff * self.num_experts / (T * T * self.top_k) * \
                (counts.float() * scores.sum(0)).sum()
        if self.z_loss_coeff > 0:
            z = self.z_loss_coeff * torch.logsumexp(logits, dim=-1).square().mean()
            loss = z if loss is None else loss + z
        return loss
