"""Autograd in Python where it must run Python: the expert-parallel dispatch whose backward runs the
experts' delayed weight gradients (a Python callback) beside its exchange (MoELayer's
experts_wgrad_during_combine). Every op's own formula is in C++ (python/csrc/autograd.cpp), the
exchanges' included."""
from typing import Callable, Optional

import torch

_ops = torch.ops.gmoe


# The plain exchanges' formulas are C++ (python/csrc/autograd.cpp: each one's backward is the other
# with the same plan). Here, the one variant whose backward runs Python beside its exchange.
def _ep_setup(ctx, inputs, output):
    group, counts_all, local_counts, rows, scalars = inputs
    ctx.group = group
    ctx.save_for_backward(counts_all, local_counts)
    ctx.out_shape = output[0].shape  # for a missing gradient's zeros
    ctx.rows_dtype = rows.dtype
    ctx.has_scalars = scalars is not None
    ctx.needs_scalars_grad = scalars is not None and scalars.requires_grad


def _reverse_grads(ctx, drows, dscalars):
    """The reverse exchange's inputs from the output gradients, and the plan."""
    counts_all, local_counts = ctx.saved_tensors
    # The reverse exchange is collective: every rank runs it with the same arguments, so a missing
    # gradient (an output this rank did not use) is zeros, never a skipped exchange.
    drows = counts_all.new_zeros(ctx.out_shape, dtype=ctx.rows_dtype) if drows is None else \
        drows.to(ctx.rows_dtype).contiguous()
    ds = None
    if ctx.has_scalars:
        ds = dscalars.float().contiguous() if dscalars is not None else \
            drows.new_zeros((drows.shape[0],), dtype=torch.float32)
    return counts_all, local_counts, drows, ds


def _run_beside(exchange: Callable, work: Callable[[], None], comm: Optional["torch.cuda.Stream"], inputs):
    """exchange() on the stream `comm` while work() runs on the current stream (both ordered after
    what the current stream has enqueued; the current stream waits for the exchange before going
    on); without a stream (the CPU), the exchange and then the work. Returns what exchange()
    returns. `inputs` are the tensors the exchange reads."""
    if comm is None:
        out = exchange()
        work()
        return out
    current = torch.cuda.current_stream(comm.device)
    comm.wait_stream(current)
    with torch.cuda.stream(comm):
        out = exchange()
    # Memory made on one stream and used on the other: its reuse waits for both (record_stream).
    for t in inputs:
        if t is not None:
            t.record_stream(comm)
    work()
    current.wait_stream(comm)
    for t in out:
        if t is not None:
            t.record_stream(current)
    return out


class EpDispatchWorkDuringCombine(torch.autograd.Function):
    """gmoe::ep_dispatch whose backward, ep_combine of the gradients (collective), runs on the
    stream ``comm`` while ``work()`` (the experts' delayed weight gradients: local, no op of the
    group) runs on the current stream; on the CPU backend (``comm`` None) the combine, then the work.
    The gradients are those of the plain dispatch, bitwise: only the streams differ."""

    @staticmethod
    def forward(ctx, group, counts_all, local_counts, rows, scalars, work, comm):
        out, out_scalars = _ops.ep_dispatch(group, counts_all, local_counts, rows, scalars)
        _ep_setup(ctx, (group, counts_all, local_counts, rows, scalars), (out, out_scalars))
        ctx.work, ctx.comm = work, comm
        if scalars is None:
            ctx.mark_non_differentiable(out_scalars)
        return out, out_scalars

    @staticmethod
    def backward(ctx, drows, dscalars):
        counts_all, local_counts, drows, ds = _reverse_grads(ctx, drows, dscalars)
        drows_in, dscalars_in = _run_beside(
            lambda: _ops.ep_combine(ctx.group, counts_all, local_counts, drows, ds), ctx.work, ctx.comm,
            (counts_all, local_counts, drows, ds))
        return None, None, None, drows_in, (dscalars_in if ctx.needs_scalars_grad else None), None, None


class WorkAfterBackward(torch.autograd.Function):
    """The identity on ``x``, whose backward calls ``work()`` before passing the gradient on: work
    that must follow the backward of what consumed ``x`` (the experts' delayed weight gradients
    right after the experts' backward, where no exchange runs)."""

    @staticmethod
    def forward(ctx, x, work):
        ctx.work = work
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dx):
        ctx.work()
        return dx, None
