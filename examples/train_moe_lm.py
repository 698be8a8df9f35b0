#!/usr/bin/env python3
"""examples/train_moe_lm.py — train a small decoder-only MoE language model with gmoe, and the same
model written in plain PyTorch, on the same data; compare their loss curves, speed and memory.

    python examples/train_moe_lm.py                  # tiny model on the CPU, or a bigger one on an sm_90 GPU
    python examples/train_moe_lm.py --steps 100 --save-dir build/ckpt --save-every 50 --stop-at 50
    python examples/train_moe_lm.py --steps 100 --resume build/ckpt   # continues the same loss curves

(scripts/run.sh builds the package and runs this.) PYTHONPATH must reach the gmoe package: an
installed one, or python/ after an in-place build.

The model: byte-level tokens (vocabulary 256), token embedding, `layers` decoder layers (RMSNorm,
causal multi-head attention with rotary positions, RMSNorm, MoE block), final RMSNorm, LM head. The
MoE block is a softmax top-k router over `experts` experts, each a gated MLP (SwiGLU by default),
with the load-balancing aux loss and the router z-loss added to the loss.

Two implementations of that one architecture, trained one after the other on the same batches
from the same initial weights (the PyTorch model's initialisation, copied bit for bit):

* gmoe: the MoE block is `gmoe.MoELayer` (router → permute → gmoe.GroupedMLP → combine; FP8 recipes,
  delayed weight gradients, stacked or per-expert expert weights).
* torch: the MoE block written the way Megatron writes it: softmax top-k router, stable argsort
  permute, counts and offsets computed on the device, the experts as `torch._grouped_mm`
  (a per-expert loop on the CPU, where `_grouped_mm`'s backward is not usable), SwiGLU, and a
  probability-weighted index_add combine; `torch.compile`d on the GPU.
Everything else (attention, norms, head, optimizer) is the same code; on the GPU it is
`torch.compile`d for both.

The corpus is the text of the Python documentation's topic pages that ship with every CPython
(`pydoc_data/topics.py`, about 466 kB of English), read as UTF-8 bytes: nothing is downloaded.
Batches are random windows whose start positions depend only on (seed, step), so the data position
of a run is its step.

On a CUDA GPU the training step — forward, backward, (delayed weight gradients,) gradient clipping,
AdamW on float32 master weights (the fused kernel) — is captured once in a CUDA graph per model and replayed for every
step: the batch is copied into a static input buffer, the routing changes every step, nothing in
the step reads a device value on the host. On the CPU the same step runs eagerly.

--offload-activations (gmoe model): the forward runs inside `gmoe.offload_activations(model)`,
which moves what autograd saves inside the MoE layers (routed input, FP8 copies and scales, FC1
output, probabilities, routing map) to pinned host memory and back when backward needs it; the last
MoE layer's activations stay on the device (its backward comes first), weights never move. The
losses are those of the run without it, bit for bit on the CPU (an offload only moves tensors).
On CUDA the gmoe step then runs eagerly, not in a CUDA graph (OFFLOAD_EAGER_REASON says why);
summary.md states that offloading was on, the bytes it moved per step and the peak memory with it.

Checkpoints (--save-dir): per model, a directory with `model.safetensors` (Hugging Face names:
`model.layers.{L}.mlp.gate.weight` for the router, the experts either per expert
`model.layers.{L}.mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight` (Qwen3-MoE, OLMoE) or
stacked, the same keys without the expert index, `model.layers.{L}.mlp.experts.gate_proj.weight`
[E, F, H], per --ckpt-layout; float32 master weights), `optimizer.safetensors` (AdamW's moments
under the same names, prefixed `exp_avg.` / `exp_avg_sq.`, and its step) and `trainer_state.json`
(step = data position, the loss curve so far, the configuration). --resume reads either expert
layout into either weight layout. `gmoe-ckpt` converts a checkpoint between the two layouts (both
.safetensors files; trainer_state.json is copied as it is), and the converted one resumes the
same curve:

    mkdir -p build/ckpt2/gmoe && cp build/ckpt/gmoe/trainer_state.json build/ckpt2/gmoe/
    for f in model optimizer; do
      gmoe-ckpt convert build/ckpt/gmoe/$f.safetensors build/ckpt2/gmoe/$f.safetensors --layout stacked
    done
    python examples/train_moe_lm.py --steps 100 --impl gmoe --resume build/ckpt2

Outputs (--out): losses.json, loss.png (both curves), summary.md, and a progress line per
--log-every steps.
"""
import argparse
import dataclasses
import gc
import json
import math
import os
import re
import sys
import time
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import nn

import gmoe

from gmoe import MoELayer

VOCAB = 256
IMPLS = ("gmoe", "torch")
ACTIVATIONS = ("swiglu", "geglu", "clamped_swiglu", "squared_relu")

# ---------------------------------------------------------------------------------------------
# configuration
# ---------------------------------------------------------------------------------------------

#: Fields that define the model and its training; a checkpoint must agree on these to be resumed.
ARCH_FIELDS = ("layers", "hidden", "heads", "experts", "top_k", "ffn", "activation", "seq_len", "batch", "seed",
               "lr", "weight_decay", "aux_loss_coeff", "z_loss_coeff", "clip")

PRESETS = {
    # About a minute per model on two CPU cores; the loss falls from ln(256) = 5.5 to about 2.5.
    "tiny": dict(layers=2, hidden=64, heads=4, experts=8, top_k=2, ffn=128, seq_len=64, batch=16, steps=300,
                 lr=3e-3),
    # One H100/H200: the MoE blocks are about 70% of the matmul FLOPs (summary.md states the share).
    "gpu": dict(layers=4, hidden=1024, heads=16, experts=32, top_k=4, ffn=1024, seq_len=1024, batch=16,
                steps=300, lr=1e-3),
    # One H100/H200, the MoE blocks most of the step's time: Qwen3-30B-A3B's fine-grained experts
    # (hidden 2048, expert FFN 768, top-8; 64 of its 128 experts), where routing and permutation
    # weigh most against the expert GEMMs, and many tokens per parameter: the optimizer's time
    # grows with the parameters, the MoE blocks' with the tokens (65,536 a step, 8,192 per expert).
    # Two layers keep both models' memory in an 80 GB card: about 12 GiB of weights, float32
    # masters, gradients and AdamW moments, and about 24 GiB of activations. Batches above 96 x 1024
    # put more than 2^31 elements in the permuted rows [tokens x top_k, hidden].
    "gpu-moe": dict(layers=2, hidden=2048, heads=16, experts=64, top_k=8, ffn=768, seq_len=1024, batch=64,
                    steps=300, lr=5e-4),
}


@dataclasses.dataclass
class Config:
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    experts: int = 8
    top_k: int = 2
    ffn: int = 128
    activation: str = "swiglu"
    seq_len: int = 64
    batch: int = 16
    steps: int = 300
    seed: int = 0
    lr: float = 3e-3
    weight_decay: float = 0.1
    clip: float = 1.0
    aux_loss_coeff: float = 1e-2
    z_loss_coeff: float = 1e-3
    recipe: Optional[str] = None          # FP8 recipe of the gmoe experts (the torch model stays bf16)
    delay_wgrad: bool = False
    offload_activations: bool = False
    ep_size: int = 1
    weight_layout: str = "stacked"        # gmoe's expert parameters
    ckpt_layout: str = "per_expert"       # the checkpoint's expert tensors
    device: str = "cpu"
    dtype: str = "float32"
    impls: tuple = IMPLS
    cuda_graph: bool = True
    compile: bool = True
    save_dir: Optional[str] = None
    save_every: int = 0
    stop_at: Optional[int] = None
    resume: Optional[str] = None
    out: Optional[str] = "build/train_moe_lm"
    log_every: int = 25
    graph_warmup: int = 3

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[self.dtype]

    def arch(self) -> dict:
        return {k: getattr(self, k) for k in ARCH_FIELDS}


def parse_args(argv=None) -> Config:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=("auto",) + tuple(PRESETS), default="auto",
                    help="sizes: tiny (CPU), gpu, or gpu-moe (the MoE blocks most of the step: fine-grained "
                         "experts, 64k tokens a step); auto picks tiny or gpu by device. Flags below override it")
    ap.add_argument("--layers", type=int)
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--experts", type=int)
    ap.add_argument("--top-k", type=int)
    ap.add_argument("--ffn", type=int, help="expert FFN width (FC1 has 2x that for gated activations)")
    ap.add_argument("--activation", choices=ACTIVATIONS)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--batch", type=int, help="sequences per step")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--lr", type=float)
    ap.add_argument("--aux-loss-coeff", type=float)
    ap.add_argument("--z-loss-coeff", type=float)
    ap.add_argument("--recipe", choices=tuple(gmoe.FP8_RECIPES),
                    help="FP8 recipe of gmoe's expert GEMMs (the torch model stays in --dtype)")
    ap.add_argument("--delay-wgrad", action="store_true",
                    help="gmoe: expert weight gradients in backward_dw() after backward")
    ap.add_argument("--offload-activations", action="store_true",
                    help="gmoe: the MoE layers' saved activations go to host memory in forward and come back in "
                         "backward (gmoe.offload_activations; the last layer's stay on the device); on CUDA the "
                         "gmoe step then runs eagerly, not in a CUDA graph")
    ap.add_argument("--ep-size", type=int, help="expert-parallel size (only 1: not available yet)")
    ap.add_argument("--weight-layout", choices=("stacked", "per_expert"), help="gmoe's expert parameters")
    ap.add_argument("--ckpt-layout", choices=("stacked", "per_expert"), help="expert tensors in checkpoints")
    ap.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: bfloat16 on CUDA, float32 on the CPU")
    ap.add_argument("--impl", choices=("both",) + IMPLS, default="both", help="which models to train")
    ap.add_argument("--no-cuda-graph", action="store_true", help="CUDA: run the step eagerly")
    ap.add_argument("--no-compile", action="store_true", help="CUDA: no torch.compile")
    ap.add_argument("--save-dir", help="write checkpoints here (one directory per model)")
    ap.add_argument("--save-every", type=int, help="checkpoint every N steps (and at the end / --stop-at)")
    ap.add_argument("--stop-at", type=int, help="stop after this step (a checkpoint is written with --save-dir)")
    ap.add_argument("--resume", help="checkpoint directory to continue from")
    ap.add_argument("--out", help="directory for losses.json, loss.png, summary.md ('' for none)")
    ap.add_argument("--log-every", type=int)
    a = ap.parse_args(argv)

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    preset = a.preset if a.preset != "auto" else ("gpu" if device.startswith("cuda") else "tiny")
    cfg = Config(**PRESETS[preset])
    cfg.device = device
    cfg.dtype = a.dtype or ("bfloat16" if device.startswith("cuda") else "float32")
    for name in ("layers", "hidden", "heads", "experts", "top_k", "ffn", "activation", "seq_len", "batch", "steps",
                 "seed", "lr", "aux_loss_coeff", "z_loss_coeff", "recipe", "ep_size", "weight_layout", "ckpt_layout",
                 "save_dir", "save_every", "stop_at", "resume", "out", "log_every"):
        value = getattr(a, name)
        if value is not None:
            setattr(cfg, name, value)
    cfg.delay_wgrad, cfg.offload_activations = a.delay_wgrad, a.offload_activations
    cfg.impls = IMPLS if a.impl == "both" else (a.impl,)
    cfg.cuda_graph, cfg.compile = not a.no_cuda_graph, not a.no_compile
    return cfg


def check_config(cfg: Config) -> None:
    """Refuses what gmoe cannot do yet, by name, rather than silently doing something else."""
    if cfg.ep_size != 1:
        raise SystemExit(f"--ep-size {cfg.ep_size}: expert parallelism is not available yet in gmoe (the example "
                         f"trains on one device); only --ep-size 1 runs")
    if cfg.hidden % cfg.heads or (cfg.hidden // cfg.heads) % 2:
        raise SystemExit(f"--hidden {cfg.hidden} must split into --heads {cfg.heads} heads of even width")
    if not 1 <= cfg.top_k <= cfg.experts:
        raise SystemExit(f"--top-k {cfg.top_k}: expected 1..{cfg.experts}")
    if cfg.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {cfg.device}: no CUDA device")
    if cfg.device.startswith("cuda") and cfg.dtype == "float32":
        raise SystemExit("--dtype float32 on CUDA: gmoe's CUDA GEMMs take bfloat16/float16 weights")
    if cfg.stop_at is not None and not 0 < cfg.stop_at <= cfg.steps:
        raise SystemExit(f"--stop-at {cfg.stop_at}: expected 1..{cfg.steps}")


# ---------------------------------------------------------------------------------------------
# corpus and batches
# ---------------------------------------------------------------------------------------------

CORPUS_NAME = "CPython's pydoc_data/topics.py (the Python documentation's topic pages), UTF-8 bytes"


def load_corpus() -> torch.Tensor:
    """The corpus as uint8 tokens: every topic page of pydoc_data, in sorted order of its name."""
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[name] for name in sorted(topics))
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8)


def batch_starts(num_tokens: int, cfg: Config, first: int, last: int) -> torch.Tensor:
    """Start positions [last - first, batch] of the windows of steps first … last-1; a step's
    batch depends only on (seed, step), which makes the step the data position."""
    out = torch.empty(last - first, cfg.batch, dtype=torch.int64)
    g = torch.Generator()
    for i, step in enumerate(range(first, last)):
        g.manual_seed(cfg.seed * 1_000_003 + step)
        out[i] = torch.randint(0, num_tokens - cfg.seq_len - 1, (cfg.batch,), generator=g)
    return out


# ---------------------------------------------------------------------------------------------
# the model (shared by both implementations; only the MoE block differs)
# ---------------------------------------------------------------------------------------------


def rotary_tables(seq_len: int, head_dim: int):
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return torch.cos(angles).float(), torch.sin(angles).float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, S, D]: rotate the (first half, second half) pairs (the rotate-half convention)."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: Config, **factory):
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.hidden // cfg.heads
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self, name, nn.Linear(cfg.hidden, cfg.hidden, bias=False, **factory))

    def forward(self, x, cos, sin):
        B, S, H = x.shape
        q, k, v = (p(x).view(B, S, self.heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(B, S, H))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Config, mlp: nn.Module, **factory):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden, eps=1e-6, **factory)
        self.self_attn = Attention(cfg, **factory)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden, eps=1e-6, **factory)
        self.mlp = mlp
        self.attention_part = self._attention_part  # replaced by its torch.compile'd self on the GPU

    def _attention_part(self, x, cos, sin):
        """The residual stream after attention, and its normalised copy for the MoE block."""
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h, self.post_attention_layernorm(h)

    def forward(self, x, cos, sin):
        h, normed = self.attention_part(x, cos, sin)
        return h + self.mlp(normed)


class Backbone(nn.Module):
    def __init__(self, cfg: Config, make_mlp, **factory):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, cfg.hidden, **factory)
        self.layers = nn.ModuleList(DecoderLayer(cfg, make_mlp(i), **factory) for i in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden, eps=1e-6, **factory)


class MoELM(nn.Module):
    """Decoder-only MoE LM; parameter names follow Hugging Face's (model.layers.{L}.self_attn.q_proj…)."""

    def __init__(self, cfg: Config, make_mlp, device=None, dtype=None):
        super().__init__()
        factory = dict(device=device, dtype=dtype)
        self.model = Backbone(cfg, make_mlp, **factory)
        self.lm_head = nn.Linear(cfg.hidden, VOCAB, bias=False, **factory)
        cos, sin = rotary_tables(cfg.seq_len, cfg.hidden // cfg.heads)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)
        self.head_loss = self._head_loss  # replaced by its torch.compile'd self on the GPU

    def _head_loss(self, x, targets):
        logits = self.lm_head(self.model.norm(x))
        return F.cross_entropy(logits.float().view(-1, VOCAB), targets.reshape(-1))

    def loss(self, tokens: torch.Tensor):
        """(cross-entropy of next-byte prediction, the MoE blocks' summed aux losses or None) for
        tokens [B, S + 1]."""
        x = self.model.embed_tokens(tokens[:, :-1])
        for layer in self.model.layers:
            x = layer(x, self.rope_cos, self.rope_sin)
        ce = self.head_loss(x, tokens[:, 1:])
        aux = [layer.mlp.aux_loss for layer in self.model.layers if layer.mlp.aux_loss is not None]
        return ce, (torch.stack(aux).sum() if aux else None)

    def compile_parts(self, moe_too: bool) -> None:
        """torch.compile the attention parts and the head (and the MoE blocks when moe_too)."""
        # One compiled code object serves every layer, recompiled per layer (the guards see another
        # module): allow that many, or the later layers would silently run eagerly.
        dynamo = torch._dynamo.config
        limit = "recompile_limit" if hasattr(dynamo, "recompile_limit") else "cache_size_limit"
        setattr(dynamo, limit, max(getattr(dynamo, limit), 2 * len(self.model.layers)))
        for layer in self.model.layers:
            layer.attention_part = torch.compile(layer._attention_part, dynamic=False)
            if moe_too:
                layer.mlp.compile_forward()
        self.head_loss = torch.compile(self._head_loss, dynamic=False)


def glu_activation(kind: str, h: torch.Tensor) -> torch.Tensor:
    """gmoe's activations on FC1's output h ([gate | up] for the gated kinds), in h's dtype."""
    if kind == "squared_relu":
        return torch.relu(h).square()
    gate, up = h.chunk(2, dim=-1)
    if kind == "swiglu":
        return F.silu(gate) * up
    if kind == "geglu":
        return F.gelu(gate) * up
    gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)  # gpt-oss's clamped SwiGLU (alpha 1.702, limit 7)
    return gate * torch.sigmoid(1.702 * gate) * (up + 1)


class TorchExperts(nn.Module):
    """E expert MLPs as two stacked parameters, named as transformers v5's fused experts."""

    def __init__(self, cfg: Config, **factory):
        super().__init__()
        fc1_rows = cfg.ffn if cfg.activation == "squared_relu" else 2 * cfg.ffn
        self.fc1_name = "up_proj" if cfg.activation == "squared_relu" else "gate_up_proj"
        self.register_parameter(self.fc1_name, nn.Parameter(torch.empty(cfg.experts, fc1_rows, cfg.hidden, **factory)))
        self.down_proj = nn.Parameter(torch.empty(cfg.experts, cfg.hidden, cfg.ffn, **factory))

    @property
    def fc1(self) -> torch.Tensor:
        return getattr(self, self.fc1_name)


class TorchMoE(nn.Module):
    """The MoE block in plain PyTorch, as Megatron writes it (see the module docstring)."""

    def __init__(self, cfg: Config, **factory):
        super().__init__()
        self.num_experts, self.top_k, self.activation = cfg.experts, cfg.top_k, cfg.activation
        self.aux_loss_coeff, self.z_loss_coeff = cfg.aux_loss_coeff, cfg.z_loss_coeff
        self.gate = nn.Linear(cfg.hidden, cfg.experts, bias=False, **factory)
        self.experts = TorchExperts(cfg, **factory)
        self.aux_loss: Optional[torch.Tensor] = None
        self.block = self._block  # replaced by its torch.compile'd self on the GPU

    def compile_forward(self) -> None:
        self.block = torch.compile(self._block, dynamic=False)

    def forward(self, x):
        y, self.aux_loss = self.block(x)
        return y

    def _block(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        T, E, k = x.shape[0], self.num_experts, self.top_k
        logits = F.linear(x.float(), self.gate.weight.float())  # the router in float32
        scores = torch.softmax(logits, dim=-1)
        probs, ids = torch.topk(scores, k, dim=-1)
        flat_ids = ids.reshape(-1)
        # torch.bincount would read the largest id on the host (a sync): count with scatter_add.
        counts = torch.zeros(E, dtype=torch.int32, device=x.device).scatter_add_(
            0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
        order = torch.argsort(flat_ids, stable=True)
        token_of_row = order // k
        rows = x[token_of_row]
        y = self._experts(rows, counts)
        weighted = y.float() * probs.reshape(-1)[order, None]
        out = torch.zeros(T, shape[-1], dtype=torch.float32, device=x.device).index_add(0, token_of_row, weighted)
        return out.to(x.dtype).reshape(shape), self._losses(logits, scores, counts, T)

    def _experts(self, rows, counts):
        w1, w2 = self.experts.fc1, self.experts.down_proj
        if rows.is_cuda:
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            h = torch._grouped_mm(rows, w1.transpose(-2, -1), offs=offs)
            return torch._grouped_mm(glu_activation(self.activation, h), w2.transpose(-2, -1), offs=offs)
        # CPU: torch._grouped_mm's backward fails there (strides), so one GEMM pair per expert;
        # the host reads the counts, which costs nothing on the CPU.
        outs, start = [], 0
        for e, c in enumerate(counts.tolist()):
            h = F.linear(rows[start:start + c], w1[e])
            outs.append(F.linear(glu_activation(self.activation, h), w2[e]))
            start += c
        return torch.cat(outs)

    def _losses(self, logits, scores, counts, T):
        """Switch / Megatron load-balancing loss and the router z-loss, as gmoe defines them."""
        loss = None
        if self.aux_loss_coeff > 0:
            loss = self.aux_loss_coeff * self.num_experts / (T * T * self.top_k) * \
                (counts.float() * scores.sum(0)).sum()
        if self.z_loss_coeff > 0:
            z = self.z_loss_coeff * torch.logsumexp(logits, dim=-1).square().mean()
            loss = z if loss is None else loss + z
        return loss


def build_model(impl: str, cfg: Config, device, dtype) -> MoELM:
    if impl == "torch":
        return MoELM(cfg, lambda i: TorchMoE(cfg, device=device, dtype=dtype), device=device, dtype=dtype)

    def make_gmoe(i):
        layer = MoELayer(cfg.experts, cfg.hidden, cfg.ffn, cfg.top_k, activation=cfg.activation,
                         aux_loss_coeff=cfg.aux_loss_coeff, z_loss_coeff=cfg.z_loss_coeff, recipe=cfg.recipe,
                         weight_layout=cfg.weight_layout, device=device, dtype=dtype)
        # The expert layers read the flag in every forward; backward_dw() runs after backward.
        layer.delay_wgrad_compute = cfg.delay_wgrad
        return layer

    return MoELM(cfg, make_gmoe, device=device, dtype=dtype)


def initial_state(cfg: Config) -> Dict[str, torch.Tensor]:
    """The initial weights (float32, CPU, Hugging Face names with stacked experts), from the seed:
    normal(0, 0.02), output projections scaled by 1/sqrt(2·layers), norms 1; drawn in the PyTorch
    model's parameter order."""
    g = torch.Generator().manual_seed(cfg.seed)
    model = build_model("torch", cfg, "cpu", torch.float32)
    out_std = 0.02 / math.sqrt(2 * cfg.layers)
    state = {}
    for name, p in model.state_dict().items():
        if "norm" in name:
            state[name] = torch.ones_like(p)
        else:
            std = out_std if name.endswith(("o_proj.weight", "down_proj")) else 0.02
            state[name] = torch.randn(p.shape, generator=g) * std
    return to_hf(state, "torch", cfg, "stacked")


# ---------------------------------------------------------------------------------------------
# Hugging Face names for the expert tensors
# ---------------------------------------------------------------------------------------------

_MLP = re.compile(r"^(model\.layers\.\d+\.mlp\.)(.*)$")


def _fc_names(cfg: Config):
    """The per-expert names of FC1's row blocks (gate rows first)."""
    return ("up_proj",) if cfg.activation == "squared_relu" else ("gate_proj", "up_proj")


def _torch_fc1(cfg: Config) -> str:
    """The PyTorch model's stacked FC1 parameter under its block (transformers v5's fused experts)."""
    return "experts.up_proj" if cfg.activation == "squared_relu" else "experts.gate_up_proj"


def _split_mlps(state: Dict[str, torch.Tensor]):
    """({key: tensor} outside the MoE blocks, {"model.layers.L.mlp.": {rest of key: tensor}})."""
    rest, mlps = {}, {}
    for key, t in state.items():
        m = _MLP.match(key)
        if m:
            mlps.setdefault(m.group(1), {})[m.group(2)] = t
        else:
            rest[key] = t
    return rest, mlps


def to_hf(state: Dict[str, torch.Tensor], impl: str, cfg: Config, layout: str) -> Dict[str, torch.Tensor]:
    """A model's state (its own names; weights or any per-parameter tensor such as an Adam moment)
    under Hugging Face names, the experts in `layout`: "per_expert" (`experts.{e}.gate_proj.weight`
    [F, H], …) or "stacked" (the same keys without the expert index, [E, F, H]: the form
    `gmoe-ckpt convert --layout stacked` writes and reads back, which no other family's keys share)."""
    out, mlps = _split_mlps(state)
    for prefix, sub in mlps.items():
        if impl == "torch":
            router, fc1, fc2 = sub["gate.weight"], sub[_torch_fc1(cfg)], sub["experts.down_proj"]
        else:
            router = sub["router.weight"]
            fc1, fc2 = (_stacked(sub, f"experts.{fc}.weight", cfg.experts) for fc in ("fc1", "fc2"))
        out[prefix + "gate.weight"] = router
        # FC1's rows are [gate; up] (the concatenated GLU layout): gate_proj and up_proj are its halves.
        fc1_parts = fc1.chunk(len(_fc_names(cfg)), dim=1)
        if layout == "stacked":
            for name, part in zip(_fc_names(cfg), fc1_parts):
                out[f"{prefix}experts.{name}.weight"] = part.contiguous()
            out[prefix + "experts.down_proj.weight"] = fc2
        else:
            for e in range(cfg.experts):
                for name, part in zip(_fc_names(cfg), fc1_parts):
                    out[f"{prefix}experts.{e}.{name}.weight"] = part[e].clone()
                out[f"{prefix}experts.{e}.down_proj.weight"] = fc2[e].clone()
    return out


def _stacked(sub: Dict[str, torch.Tensor], key: str, E: int) -> torch.Tensor:
    return sub[key] if key in sub else torch.stack([sub[f"{key}{e}"] for e in range(E)])


def from_hf(hf: Dict[str, torch.Tensor], impl: str, cfg: Config) -> Dict[str, torch.Tensor]:
    """The inverse of to_hf, from either expert layout, into the model's own names (gmoe: in
    cfg.weight_layout)."""
    out, mlps = _split_mlps(hf)
    for prefix, sub in mlps.items():
        try:
            if "experts.down_proj.weight" in sub:
                fc1 = torch.cat([sub[f"experts.{n}.weight"] for n in _fc_names(cfg)], dim=1)
                fc2 = sub["experts.down_proj.weight"]
            else:
                fc1 = torch.stack([torch.cat([sub[f"experts.{e}.{n}.weight"] for n in _fc_names(cfg)])
                                   for e in range(cfg.experts)])
                fc2 = torch.stack([sub[f"experts.{e}.down_proj.weight"] for e in range(cfg.experts)])
        except KeyError as missing:
            raise SystemExit(f"checkpoint: {prefix}experts lacks {missing} (Hugging Face expert names, "
                             f"stacked or per expert, for {cfg.experts} experts)")
        if impl == "torch":
            out[prefix + "gate.weight"] = sub["gate.weight"]
            out[prefix + _torch_fc1(cfg)] = fc1
            out[prefix + "experts.down_proj"] = fc2
            continue
        out[prefix + "router.weight"] = sub["gate.weight"]
        for fc, w in (("fc1", fc1), ("fc2", fc2)):
            if cfg.weight_layout == "stacked":
                out[f"{prefix}experts.{fc}.weight"] = w
            else:
                for e in range(cfg.experts):
                    out[f"{prefix}experts.{fc}.weight{e}"] = w[e]
    return out


# ---------------------------------------------------------------------------------------------
# training step: eager, or captured once in a CUDA graph
# ---------------------------------------------------------------------------------------------

#: Why --offload-activations runs the gmoe step eagerly on CUDA (printed, and written to summary.md).
OFFLOAD_EAGER_REASON = (
    "the example does not capture gmoe.offload_activations in a CUDA graph: during a capture PyTorch's caching "
    "allocator reuses a block freed after record_stream on another stream (every offloaded activation: the copy "
    "stream reads it) only once the capture has ended, so inside the graph offloading would free no GPU memory "
    "while the reloads take more; run eagerly, each block is reused as soon as its copy to the host is done")


class Trainer:
    """AdamW on float32 master weights (the model's own parameters when they are float32), gradient
    clipping, one step = forward + backward (+ delayed weight gradients) + update."""

    def __init__(self, model: MoELM, cfg: Config, weights: Dict[str, torch.Tensor], moments=None, step: int = 0,
                 offload: Optional[gmoe.offload_activations] = None):
        self.model, self.cfg = model, cfg
        self.offload = offload  # the forward runs inside it: the MoE layers' saved activations go to the host
        self.steps_run = 0
        self.device = torch.device(cfg.device)
        self.names = [n for n, _ in model.named_parameters()]
        self.params = [p for _, p in model.named_parameters()]
        self.mixed = any(p.dtype != torch.float32 for p in self.params)
        if self.mixed:
            self.masters = [nn.Parameter(weights[n].to(self.device, torch.float32).clone()) for n in self.names]
            for m in self.masters:
                m.grad = torch.zeros_like(m)  # static: the step copies the parameters' gradients in
        else:
            self.masters = self.params
        with torch.no_grad():
            for n, p in zip(self.names, self.params):
                p.copy_(weights[n])
        decay = [m for m, p in zip(self.masters, self.params) if p.dim() >= 2]
        no_decay = [m for m, p in zip(self.masters, self.params) if p.dim() < 2]
        # CUDA: the fused AdamW kernel, what large trainers run (Megatron's and Transformer Engine's
        # fused Adam): one pass over the masters, gradients and moments per launch, where foreach
        # makes a pass per elementwise op. capturable lets the CUDA graph capture it; the fused
        # kernel keeps the step counter on the device (float32) and reads it there, so the captured
        # step advances it on every replay with no host value baked in. The CPU keeps foreach,
        # whose curves the CPU tests compare bit for bit.
        self.fused = self.device.type == "cuda"
        impl = dict(fused=True, capturable=True) if self.fused else dict(foreach=True)
        self.opt = torch.optim.AdamW([dict(params=decay, weight_decay=cfg.weight_decay),
                                      dict(params=no_decay, weight_decay=0.0)],
                                     lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, **impl)
        # AdamW's state made here (it would be made lazily in the first step), so that a checkpoint
        # and the graph's warm-up can write it in place: the step where AdamW makes it (on the
        # parameter's device, float32, for the fused kernel; on the CPU otherwise).
        for n, m in zip(self.names, self.masters):
            st = self.opt.state[m]
            step_dev = m.device if self.fused else torch.device("cpu")
            st["step"] = torch.tensor(float(step), dtype=torch.float32, device=step_dev)
            st["exp_avg"] = torch.zeros_like(m)
            st["exp_avg_sq"] = torch.zeros_like(m)
            if moments is not None:
                st["exp_avg"].copy_(moments["exp_avg"][n])
                st["exp_avg_sq"].copy_(moments["exp_avg_sq"][n])
        self.moe_layers = [layer.mlp for layer in model.model.layers]
        self.graph = None

    def _step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.steps_run += 1
        if self.offload is None:
            ce, aux = self.model.loss(tokens)
        else:
            with self.offload:  # backward runs outside: it brings the offloaded tensors back
                ce, aux = self.model.loss(tokens)
        (ce if aux is None else ce + aux).backward()
        if self.cfg.delay_wgrad:
            for moe in self.moe_layers:
                moe.backward_dw()
        self.update()
        return ce.detach()

    def update(self) -> None:
        """The update after backward: the gradients into the float32 masters, clipping, AdamW, the
        masters back into the parameters."""
        if self.mixed:
            torch._foreach_copy_([m.grad for m in self.masters], [p.grad for p in self.params])
        torch.nn.utils.clip_grad_norm_(self.masters, self.cfg.clip, foreach=True)
        self.opt.step()
        if self.mixed:
            with torch.no_grad():
                torch._foreach_copy_(self.params, self.masters)

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One training step on tokens [B, S + 1]; returns the cross-entropy (a 0-dim tensor on the
        device, not read here)."""
        if self.graph is None:
            self.model.zero_grad(set_to_none=True)
            return self._step(tokens)
        self.static_tokens.copy_(tokens)
        self.graph.replay()
        return self.static_loss

    def capture(self, sample_tokens: torch.Tensor) -> None:
        """torch.cuda.graph's recipe: warm-up steps on a side stream (torch.compile compiles here,
        AdamW's capturable kernels are chosen), then one captured step. The warm-up steps change the
        weights and AdamW's state; both are restored in place afterwards, so the first replayed step
        is step `start` of the curve."""
        if self.offload is not None:
            raise RuntimeError(OFFLOAD_EAGER_REASON)
        self.static_tokens = sample_tokens.clone()
        saved_masters = [m.detach().clone() for m in self.masters]
        saved_state = [{k: v.clone() for k, v in self.opt.state[m].items()} for m in self.masters]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.cfg.graph_warmup):
                self.model.zero_grad(set_to_none=True)
                self._step(self.static_tokens)
        torch.cuda.current_stream().wait_stream(side)
        with torch.no_grad():
            torch._foreach_copy_([m.data for m in self.masters], saved_masters)
            if self.mixed:
                torch._foreach_copy_(self.params, self.masters)
            for m, st in zip(self.masters, saved_state):
                for k, v in st.items():
                    self.opt.state[m][k].copy_(v)
        del saved_masters, saved_state
        # Gradients are made inside the graph (from its pool) and written, not accumulated, by
        # every replay.
        self.model.zero_grad(set_to_none=True)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.static_loss = self._step(self.static_tokens)

    def state(self):
        """(weights, moments, AdamW step) in the model's names, float32, on the CPU."""
        weights = {n: m.detach().float().cpu() for n, m in zip(self.names, self.masters)}
        moments = {k: {n: self.opt.state[m][k].detach().cpu() for n, m in zip(self.names, self.masters)}
                   for k in ("exp_avg", "exp_avg_sq")}
        step = float(self.opt.state[self.masters[0]]["step"])
        return weights, moments, step


# ---------------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------------


def save_checkpoint(directory: str, impl: str, cfg: Config, trainer: Trainer, step: int, losses: List[float]) -> None:
    """directory/<impl>/{model,optimizer}.safetensors and trainer_state.json, each written to a
    temporary name first, so an interrupted save leaves the previous checkpoint whole."""
    from safetensors.torch import save_file
    path = os.path.join(directory, impl)
    os.makedirs(path, exist_ok=True)
    weights, moments, adam_step = trainer.state()
    meta = {"format": "pt", "step": str(step), "impl": impl}  # the keys tell the expert layout
    files = {"model.safetensors": to_hf(weights, impl, cfg, cfg.ckpt_layout)}
    opt = {"step": torch.tensor([adam_step], dtype=torch.float32)}
    for k, per_name in moments.items():
        opt.update({f"{k}.{name}": t for name, t in to_hf(per_name, impl, cfg, cfg.ckpt_layout).items()})
    files["optimizer.safetensors"] = opt
    for name, tensors in files.items():
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, name + ".tmp"), metadata=meta)
    trainer_state = {"step": step, "data_position": step, "losses": losses, "config": cfg.arch(),
                     "sampler": "batch of step s: torch.randint with a generator seeded seed*1000003+s",
                     "corpus": CORPUS_NAME}
    with open(os.path.join(path, "trainer_state.json.tmp"), "w") as f:
        json.dump(trainer_state, f)
    for name in list(files) + ["trainer_state.json"]:
        os.replace(os.path.join(path, name + ".tmp"), os.path.join(path, name))


def load_checkpoint(directory: str, impl: str, cfg: Config):
    """(weights in the model's names, moments, step, losses so far) from save_checkpoint's files;
    the expert tensors may be in either layout."""
    from safetensors.torch import load_file
    path = os.path.join(directory, impl)
    state_file = os.path.join(path, "trainer_state.json")
    if not os.path.exists(state_file):
        raise SystemExit(f"--resume {directory}: no checkpoint of the {impl} model ({state_file} is missing)")
    with open(state_file) as f:
        st = json.load(f)
    differ = {k: (v, getattr(cfg, k)) for k, v in st["config"].items() if getattr(cfg, k) != v}
    if differ:
        raise SystemExit(f"--resume {directory}: the checkpoint was trained with other settings "
                         f"(name: (checkpoint, now)): {differ}")
    weights = from_hf(load_file(os.path.join(path, "model.safetensors")), impl, cfg)
    opt = load_file(os.path.join(path, "optimizer.safetensors"))
    moments = {}
    for k in ("exp_avg", "exp_avg_sq"):
        hf = {name[len(k) + 1:]: t for name, t in opt.items() if name.startswith(k + ".")}
        moments[k] = from_hf(hf, impl, cfg)
    return weights, moments, int(opt["step"].item()), st["step"], st["losses"]


# ---------------------------------------------------------------------------------------------
# one model's run
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class RunResult:
    impl: str
    losses: List[float]                  # one per step, from step 0 (a resumed run includes the saved ones)
    tokens_per_s: Optional[float]        # over this run's steps after the first few
    peak_memory_bytes: Optional[int]     # CUDA: peak allocated memory of this model's run (weights included)
    note: str = ""
    offloaded_bytes_per_step: Optional[float] = None  # --offload-activations: bytes moved to the host per step


def release_previous_model(device: torch.device) -> int:
    """Drops what the previous model left on the GPU (its compiled code may still hold its modules,
    graph pool and all) and resets the peak counter: returns the bytes allocated now, from which
    this model's peak is counted."""
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def train_one(impl: str, cfg: Config, init: Dict[str, torch.Tensor], corpus: torch.Tensor, log=print) -> RunResult:
    device, dtype = torch.device(cfg.device), cfg.torch_dtype
    cuda = device.type == "cuda"
    if cuda:
        base_memory = release_previous_model(device)
    torch.manual_seed(cfg.seed)
    model = build_model(impl, cfg, device, dtype)
    start, losses, moments, adam_step = 0, [], None, 0
    weights = from_hf(init, impl, cfg)
    if cfg.resume:
        weights, moments, adam_step, start, losses = load_checkpoint(cfg.resume, impl, cfg)
        losses = losses[:start]
    offload = gmoe.offload_activations(model) if cfg.offload_activations and impl == "gmoe" else None
    trainer = Trainer(model, cfg, weights, moments, adam_step, offload)
    stop = cfg.stop_at if cfg.stop_at is not None else cfg.steps
    if cuda and cfg.compile:
        model.compile_parts(moe_too=(impl == "torch"))
    data = corpus.to(device)
    window = torch.arange(cfg.seq_len + 1, device=device)
    starts = batch_starts(corpus.numel(), cfg, start, max(stop, start + 1)).to(device)

    def batch(i):
        return data[starts[i - start][:, None] + window].long()

    graph = cuda and cfg.cuda_graph
    if graph and offload is not None:
        log(f"{impl}: --offload-activations: the step runs eagerly, not in a CUDA graph: {OFFLOAD_EAGER_REASON}",
            flush=True)
        graph = False
    if graph:
        trainer.capture(batch(start))
    device_losses = torch.zeros(max(stop - start, 0), dtype=torch.float32, device=device)
    skip = min(3, max(stop - start - 1, 0))  # steps not timed (first replays, allocator warm-up)
    t_first = t_last = None
    t_saving = 0.0  # checkpoint writes are not training time

    def tokens_per_s(done):
        timed = done - (start + skip)
        if t_first is None or timed <= 0:
            return None
        return cfg.batch * cfg.seq_len * timed / (t_last - t_first - t_saving)

    for step in range(start, stop):
        if step == start + skip:
            if cuda:
                torch.cuda.synchronize()
            t_first = time.perf_counter()
        device_losses[step - start].copy_(trainer.step(batch(step)))
        done = step + 1
        if done % cfg.log_every == 0 or done == stop:
            if cuda:
                torch.cuda.synchronize()
            t_last = time.perf_counter()
            tps = tokens_per_s(done)
            loss = float(device_losses[step - start])
            log(f"{impl:5s} step {done:5d}/{cfg.steps}  loss {loss:.4f}  tokens/s "
                f"{'-' if tps is None else f'{tps:,.0f}'}", flush=True)
        if cfg.save_dir and (done == stop or (cfg.save_every and done % cfg.save_every == 0)):
            t0 = time.perf_counter()
            save_checkpoint(cfg.save_dir, impl, cfg, trainer, done,
                            losses + device_losses[:done - start].tolist())
            t_saving += time.perf_counter() - t0 if done < stop else 0.0
    losses = losses + device_losses.tolist()
    tps = tokens_per_s(stop)
    peak = torch.cuda.max_memory_allocated(device) - base_memory if cuda else None
    trainer.graph = None
    note = ""
    if impl == "torch":
        note = "experts: torch._grouped_mm" if cuda else \
            "experts: a per-expert loop (torch._grouped_mm's backward fails on the CPU)"
        if cuda and cfg.compile:
            note += ", torch.compile"
    else:
        note = f"MoE block: gmoe.MoELayer{', experts in ' + cfg.recipe if cfg.recipe else ''}"
        if cfg.delay_wgrad:
            note += ", delayed wgrad"
    if graph:
        note += ", CUDA graph"
    offloaded = None
    if offload is not None:
        offloaded = offload.stats.bytes_offloaded / max(trainer.steps_run, 1)
        note += f", activations offloaded ({offloaded / 2**20:.2f} MiB/step)"
        if cuda and cfg.cuda_graph:
            note += ", eager step (offloading is not captured)"
    return RunResult(impl, losses, tps, peak, note, offloaded)


# ---------------------------------------------------------------------------------------------
# comparison, plot, summary
# ---------------------------------------------------------------------------------------------

FIRST_STEPS = 10
WINDOW = 20


def tolerances(cfg: Config):
    """(first-steps tolerance, run tolerance): the largest |Δ loss| over the first FIRST_STEPS steps,
    and the largest |Δ| of the WINDOW-step running means over the whole run. Routing is
    discontinuous (a rounding difference can move a token to another expert), so the curves
    separate slowly even in float32; the run tolerance bounds that drift."""
    if cfg.recipe:
        return 0.05, 0.1
    if cfg.dtype == "float32":
        return 1e-3, 0.05
    return 0.02, 0.05


def running_mean(xs: List[float], w: int) -> List[float]:
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= w:
            acc -= xs[i - w]
        out.append(acc / min(i + 1, w))
    return out


def compare(a: List[float], b: List[float], cfg: Config) -> dict:
    n = min(len(a), len(b))
    first = max((abs(a[i] - b[i]) for i in range(min(n, FIRST_STEPS))), default=0.0)
    ma, mb = running_mean(a[:n], WINDOW), running_mean(b[:n], WINDOW)
    run = max((abs(x - y) for x, y in zip(ma, mb)), default=0.0)
    tol_first, tol_run = tolerances(cfg)
    return dict(first_steps_max_abs=first, run_mean_max_abs=run, tol_first=tol_first, tol_run=tol_run,
                agree=first <= tol_first and run <= tol_run)


def moe_flop_share(cfg: Config) -> float:
    """The MoE blocks' share of a forward's matmul FLOPs (attention projections, attention scores,
    router, experts, LM head)."""
    H, F_, S = cfg.hidden, cfg.ffn, cfg.seq_len
    fc1 = F_ if cfg.activation == "squared_relu" else 2 * F_
    moe = cfg.top_k * (H * fc1 + F_ * H) + H * cfg.experts
    attn = 4 * H * H + S * H  # projections; QK^T and PV over a causal half
    return cfg.layers * moe / (cfg.layers * (moe + attn) + H * VOCAB)


def write_outputs(cfg: Config, results: Dict[str, RunResult], out: str) -> str:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "losses.json"), "w") as f:
        json.dump({"config": dataclasses.asdict(cfg), "corpus": CORPUS_NAME,
                   "runs": {k: dataclasses.asdict(r) for k, r in results.items()}}, f, indent=1)
    summary = summary_markdown(cfg, results)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(summary)
    try:
        import matplotlib
    except ImportError:  # the run's numbers are written already; only the picture is missing
        print("no matplotlib: loss.png not written (pip install matplotlib)", file=sys.stderr)
        return summary
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, dax) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, gridspec_kw=dict(height_ratios=(3, 1)))
    style = {"gmoe": dict(color="tab:blue", ls="-"), "torch": dict(color="tab:red", ls="--")}
    for impl, r in results.items():
        steps = range(1, len(r.losses) + 1)
        ax.plot(steps, r.losses, lw=0.6, alpha=0.35, color=style[impl]["color"])
        ax.plot(steps, running_mean(r.losses, WINDOW), lw=1.6, label=f"{impl} ({WINDOW}-step mean; faint: per step)",
                **style[impl])
    ax.set_ylabel("cross-entropy (nats / byte)")
    ax.set_title(f"MoE LM, {cfg.layers}L h{cfg.hidden} E{cfg.experts} top{cfg.top_k}, {cfg.dtype}"
                 f"{', gmoe ' + cfg.recipe if cfg.recipe else ''}, {cfg.device}")
    ax.legend()
    ax.grid(alpha=0.3)
    if "gmoe" in results and "torch" in results:
        g, t = results["gmoe"].losses, results["torch"].losses
        diff = [a - b for a, b in zip(g, t)]
        dax.plot(range(1, len(diff) + 1), diff, lw=0.8, color="tab:gray")
        dax.axhline(0, color="black", lw=0.5)
        dax.set_ylabel("gmoe - torch")
        dax.grid(alpha=0.3)
    dax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss.png"), dpi=120)
    plt.close(fig)
    return summary


def summary_markdown(cfg: Config, results: Dict[str, RunResult]) -> str:
    dev = torch.cuda.get_device_name(cfg.device) if cfg.device.startswith("cuda") else f"CPU ({os.cpu_count()} cores)"
    lines = ["# MoE language model: gmoe against plain PyTorch", "",
             f"- device: {dev}; dtype {cfg.dtype}{'; gmoe experts in ' + cfg.recipe if cfg.recipe else ''}",
             f"- model: {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads, {cfg.experts} experts, "
             f"top-{cfg.top_k}, expert FFN {cfg.ffn}, {cfg.activation}; "
             f"MoE blocks {100 * moe_flop_share(cfg):.0f}% of the matmul FLOPs",
             f"- data: {CORPUS_NAME}; batch {cfg.batch} x {cfg.seq_len} bytes, {cfg.steps} steps, seed {cfg.seed}",
             f"- AdamW{' (fused)' if cfg.device.startswith('cuda') else ''} lr {cfg.lr}, betas (0.9, 0.95), weight decay {cfg.weight_decay}, clip {cfg.clip}; "
             f"aux loss {cfg.aux_loss_coeff}, z-loss {cfg.z_loss_coeff}", "",
             "| model | final loss | mean of last 20 | tokens/s | peak memory | how |", "|---|---|---|---|---|---|"]
    for impl, r in results.items():
        tail = r.losses[-WINDOW:]
        mem = "-" if r.peak_memory_bytes is None else f"{r.peak_memory_bytes / 2**30:.2f} GiB"
        tps = "-" if r.tokens_per_s is None else f"{r.tokens_per_s:,.0f}"
        lines.append(f"| {impl} | {r.losses[-1]:.4f} | {sum(tail) / len(tail):.4f} | {tps} | {mem} | {r.note} |")
    if "gmoe" in results and "torch" in results:
        g, t = results["gmoe"], results["torch"]
        c = compare(g.losses, t.losses, cfg)
        lines += ["", f"Agreement ({cfg.dtype}{', FP8 ' + cfg.recipe if cfg.recipe else ''}): "
                      f"largest |Δ loss| over the first {FIRST_STEPS} steps {c['first_steps_max_abs']:.2e} "
                      f"(tolerance {c['tol_first']:g}); largest |Δ| of the {WINDOW}-step means over the run "
                      f"{c['run_mean_max_abs']:.2e} (tolerance {c['tol_run']:g}): "
                      f"**{'the curves agree' if c['agree'] else 'the curves DO NOT agree'}**."]
        if g.tokens_per_s and t.tokens_per_s:
            lines.append(f"Speed: gmoe {g.tokens_per_s / t.tokens_per_s:.2f}x the tokens/s of the PyTorch model.")
        if g.peak_memory_bytes and t.peak_memory_bytes:
            lines.append(f"Peak memory: gmoe {g.peak_memory_bytes / t.peak_memory_bytes:.2f}x the PyTorch model's.")
    if cfg.offload_activations and "gmoe" in results:
        r, cuda = results["gmoe"], cfg.device.startswith("cuda")
        mem = (f"{r.peak_memory_bytes / 2**30:.2f} GiB" if r.peak_memory_bytes is not None else
               "not measured on the CPU (there an offload is a host copy: it runs the logic and saves nothing)")
        lines += ["", f"Activation offloading: **on** for the gmoe model (`gmoe.offload_activations`: the MoE "
                      f"layers' saved activations in {'pinned ' if cuda else ''}host memory from forward to backward, "
                      f"the last layer's kept on the device), {r.offloaded_bytes_per_step / 2**20:.2f} MiB moved per "
                      f"step; peak memory with it: {mem}."]
        if cuda and cfg.cuda_graph:
            lines.append(f"The gmoe step ran eagerly, not in a CUDA graph, so its tokens/s is not comparable with "
                         f"a captured step: {OFFLOAD_EAGER_REASON}.")
    if cfg.save_dir:
        other = "per-expert" if cfg.ckpt_layout == "stacked" else "stacked"
        lines += ["", f"Checkpoints: {cfg.save_dir}/<model>/ (model and optimizer safetensors, Hugging Face "
                      f"expert names, {cfg.ckpt_layout}); `--resume {cfg.save_dir}` continues the curve. In the "
                      f"other layout: `gmoe-ckpt convert {cfg.save_dir}/gmoe/model.safetensors "
                      f"OUT/gmoe/model.safetensors --layout {other}`, the same for optimizer.safetensors, "
                      f"trainer_state.json copied."]
    if not cfg.device.startswith("cuda"):
        lines += ["", "CPU run: gmoe's CPU backend is the reference (plain loops), so tokens/s here says nothing "
                      "about speed."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> Dict[str, RunResult]:
    cfg = parse_args(argv)
    check_config(cfg)
    torch.manual_seed(cfg.seed)
    corpus = load_corpus()
    print(f"corpus: {CORPUS_NAME}, {corpus.numel():,} tokens; device {cfg.device}, {cfg.dtype}; "
          f"{cfg.layers} layers, hidden {cfg.hidden}, {cfg.experts} experts top-{cfg.top_k}", flush=True)
    if not cfg.device.startswith("cuda"):
        print("CPU: eager steps (no CUDA graph); the torch model's experts are a per-expert loop "
              "(torch._grouped_mm's backward fails on the CPU)", flush=True)
    init = initial_state(cfg)
    results = {impl: train_one(impl, cfg, init, corpus) for impl in cfg.impls}
    if cfg.out:
        summary = write_outputs(cfg, results, cfg.out)
        print(summary)
        print(f"wrote {cfg.out}/loss.png, summary.md, losses.json")
    return results


if __name__ == "__main__":
    main()
