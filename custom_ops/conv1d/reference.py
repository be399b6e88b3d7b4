"""Torch references of the causal depthwise conv1d ops on packed (THD) sequences.

``*_reference`` is what the ops run on CPU, with the ops' signatures: no host syncs, float32
compute (float64 for float64 inputs), differentiable by torch autograd. ``causal_conv1d_loop``
spells the definition out per sequence in float64, an independent oracle for the tests.

Per sequence, with zero history before its first row (FLA's convention)::

    y[t, c] = act( bias[c] + sum_{j=0}^{K-1} weight[c, K-1-j] * x[t-j, c] )

which is ``nn.Conv1d(groups=C, padding=K-1)`` cut to the first T outputs, with the Conv1d
weight ``[C, 1, K]`` squeezed to ``[C, K]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from custom_ops.runtime.dtypes import accumulation_dtype
from custom_ops.thd.index import row_positions


# FLA's and Qwen3-Next's epsilon for the q/k l2 normalisation, which causal_conv1d_gather applies
L2NORM_EPS = 1e-6


_ACTIVATIONS = (None, "identity", "silu", "swish")


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation in ("silu", "swish"):
        return F.silu(y)
    return y


def check_activation(activation) -> None:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {_ACTIVATIONS}, got {activation!r}")


def causal_conv1d_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal conv1d per packed sequence (see the module docstring).

    x ``[T, C]``, weight ``[C, K]``, bias ``[C]`` or None, cu_seqlens ``[B+1]``.
    Returns ``[T, C]`` in x's dtype. Tap j (looking j rows back) is masked where
    the row's position in its sequence is below j: the zero history.
    """
    check_activation(activation)
    dtype = accumulation_dtype(x.dtype)
    num_rows, kernel = x.shape[0], weight.shape[1]
    pos = row_positions(cu_seqlens, num_rows)
    xc, wc = x.to(dtype), weight.to(dtype)
    y = torch.zeros_like(xc)
    for j in range(kernel):
        shifted = F.pad(xc, (0, 0, j, 0))[:num_rows]  # shifted[t] = x[t - j]
        visible = (pos >= j).unsqueeze(-1)
        y = y + torch.where(visible, shifted, 0.0) * wc[:, kernel - 1 - j]
    if bias is not None:
        y = y + bias.to(dtype)
    return _activate(y, activation).to(x.dtype)


def causal_conv1d_gather_reference(
    x: torch.Tensor,
    rows: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    activation: str | None = "silu",
    split: int = 0,
    norm_dim: int = 0,
    parts: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(head_blocks(y[:, :split], norm_dim, parts), y[:, split:], x[rows, C:])`` with ``y =
    causal_conv1d_reference(x[rows, :C], ...)`` and ``C = weight.shape[0]``: the conv of x's rows
    taken in the order ``rows`` (``None``: their own), cut at column ``split``, its first part
    l2-normalised over each group of ``norm_dim`` columns (n; 0: not) and put in ``parts`` column
    blocks, and the rest of those rows, each in new contiguous memory."""
    xs = x if rows is None else x.index_select(0, rows)
    channels = weight.shape[0]
    y = causal_conv1d_reference(xs[:, :channels], weight, bias, cu_seqlens, activation)
    rest = (y[:, split:], xs[:, channels:])
    return (head_blocks(y[:, :split], norm_dim, parts), *(p.clone(memory_format=torch.contiguous_format) for p in rest))


def head_blocks(head: torch.Tensor, norm_dim: int, parts: int) -> torch.Tensor:
    """causal_conv1d_gather's first output from the conv's first columns ``head [T, split]``:
    l2-normalised over each group of ``norm_dim`` columns (0: not), as ``parts`` column blocks."""
    return column_blocks(l2norm_groups(head, norm_dim) if norm_dim else head, parts)


def column_blocks(y: torch.Tensor, parts: int) -> torch.Tensor:
    """``y [T, n]`` as ``parts`` blocks of its columns, ``[parts, T, n/parts]``, in new contiguous memory."""
    return y.unflatten(1, (parts, -1)).transpose(0, 1).clone(memory_format=torch.contiguous_format)


def from_column_blocks(blocks: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`column_blocks`: ``[parts, T, w]`` -> ``[T, parts*w]``."""
    return blocks.transpose(0, 1).flatten(1)


def l2norm_groups(y: torch.Tensor, dim: int, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``y / sqrt(sum(y^2) + eps)`` over each group of ``dim`` columns of ``y [T, n*dim]``, computed
    in at least float32, in y's dtype."""
    yc = y.to(accumulation_dtype(y.dtype)).unflatten(-1, (-1, dim))
    return (yc * torch.rsqrt(yc.square().sum(-1, keepdim=True) + eps)).flatten(-2).to(y.dtype)


def l2norm_groups_backward(y: torch.Tensor, grad: torch.Tensor, dim: int, eps: float = L2NORM_EPS) -> torch.Tensor:
    """The gradient of y from that of ``l2norm_groups(y, dim, eps)``: with ``r = rsqrt(sum(y^2) + eps)``
    per group, ``r * grad - r^3 * y * sum(grad * y)``."""
    dtype = accumulation_dtype(y.dtype)
    yc, gc = (t.to(dtype).unflatten(-1, (-1, dim)) for t in (y, grad))
    r = torch.rsqrt(yc.square().sum(-1, keepdim=True) + eps)
    return (r * gc - r.pow(3) * yc * (gc * yc).sum(-1, keepdim=True)).flatten(-2).to(grad.dtype)


def causal_conv1d_loop(x, weight, bias, cu_seqlens, activation="silu"):
    """The conv definition as loops over sequences, rows and taps, in float64."""
    x64, w64 = x.double(), weight.double()
    kernel = w64.shape[1]
    out = torch.zeros_like(x64)
    cu = cu_seqlens.tolist()
    for start, end in zip(cu[:-1], cu[1:]):
        for t in range(start, end):
            acc = bias.double().clone() if bias is not None else torch.zeros_like(x64[0])
            for j in range(kernel):
                if t - j >= start:
                    acc = acc + w64[:, kernel - 1 - j] * x64[t - j]
            out[t] = F.silu(acc) if activation in ("silu", "swish") else acc
    return out


def causal_conv1d_reference_backward(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx ``[T, C]``, dweight ``[C, K]``, dbias ``[C]``) of :func:`causal_conv1d_reference`.

    With ``pre`` the conv before the activation and ``dpre = dy * act'(pre)``:
    ``dx[s] = sum_j [pos(s+j) >= j] dpre[s+j] w[:, K-1-j]``,
    ``dw[:, K-1-j] = sum_t [pos(t) >= j] dpre[t] x[t-j]``, ``db = sum_t dpre[t]``.
    dbias is returned (as the sum) even when bias is None.
    """
    dtype = accumulation_dtype(x.dtype)
    num_rows, kernel = x.shape[0], weight.shape[1]
    pos = row_positions(cu_seqlens, num_rows)
    xc, wc, dy = x.to(dtype), weight.to(dtype), grad_y.to(dtype)
    taps = []
    pre = torch.zeros_like(xc)
    for j in range(kernel):
        visible = (pos >= j).unsqueeze(-1)
        shifted = torch.where(visible, F.pad(xc, (0, 0, j, 0))[:num_rows], 0.0)
        taps.append((visible, shifted))
        pre = pre + shifted * wc[:, kernel - 1 - j]
    if bias is not None:
        pre = pre + bias.to(dtype)
    if activation in ("silu", "swish"):
        sig = torch.sigmoid(pre)
        dpre = dy * sig * (1 + pre * (1 - sig))
    else:
        dpre = dy
    dx = torch.zeros_like(xc)
    dw = torch.zeros_like(wc)
    for j, (visible, shifted) in enumerate(taps):
        masked = torch.where(visible, dpre, 0.0)
        dx = dx + F.pad(masked, (0, 0, 0, j))[j:] * wc[:, kernel - 1 - j]  # row s gets dpre[s + j]
        dw[:, kernel - 1 - j] = (masked * shifted).sum(0)
    db = dpre.sum(0)
    return dx.to(x.dtype), dw.to(weight.dtype), db.to(bias.dtype if bias is not None else weight.dtype)
