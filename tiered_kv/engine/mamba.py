"""A small Mamba2-style mixer: a selective state-space layer with a fixed-size state per sequence.

Per token ``in_proj`` gives ``z`` (the gate), ``xBC`` and ``dt``. ``xBC`` runs through a causal
depthwise conv of width ``K`` (its **conv state** is the last ``K-1`` inputs, ``[conv_dim, K-1]``),
then SiLU, and splits into ``x`` (``[heads, head_dim]``), ``B`` and ``C`` (``[n_groups, d_state]``,
each group shared by ``heads / n_groups`` heads). The SSM recurrence per head keeps the **SSM
state** ``h`` (``[heads, head_dim, d_state]``)::

    dt_t = softplus(dt_t + dt_bias)          A = -exp(A_log)
    h_t  = exp(dt_t * A) * h_{t-1} + dt_t * x_t (outer) B_t
    y_t  = h_t . C_t + D * x_t

then ``y * silu(z)`` is RMS-normed per group (gated RMSNorm) and ``out_proj`` maps it back.
``conv_dim = head_dim*num_heads + 2*n_groups*d_state``.

:meth:`Mamba2Mixer.forward` with step metadata continues every request of the step from the
states in its slot and writes the new states back (the chunk scan, :func:`ssd_scan`); without
metadata it is the dense reference from zero states (:func:`ssd_reference`, token by token).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tiered_kv.engine.cache_resources import CausalConvHandler, ResourceHandler, SSMStateHandler

SCAN_CHUNK = 64  # tokens per block of the chunked scan


def ssd_reference(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                  h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence token by token (fp32). ``x`` [n, H, P], ``dt`` [n, H], ``A`` [H], ``B``/``C``
    [n, H, N] (already repeated per head), ``h`` [H, P, N]; returns ``y`` [n, H, P] and the last ``h``."""
    ys = []
    for t in range(x.shape[0]):
        decay = torch.exp(dt[t] * A)[:, None, None]
        h = decay * h + (dt[t][:, None] * x[t])[:, :, None] * B[t][:, None, :]
        ys.append(torch.einsum("hpn,hn->hp", h, C[t]))
    return torch.stack(ys), h


def ssd_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
             h: torch.Tensor, chunk: int = SCAN_CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence, ``chunk`` tokens at a time: within a chunk the outputs are a masked
    product with the cumulative decays (state-space duality), between chunks the state is carried."""
    ys = []
    for start in range(0, x.shape[0], chunk):
        xs, dts, Bs, Cs = (t[start:start + chunk] for t in (x, dt, B, C))
        q = xs.shape[0]
        cum = torch.cumsum(dts * A, dim=0)  # [q, H]: log of the decay from the chunk start
        seg = cum[:, None, :] - cum[None, :, :]  # [i, j, H]: log decay from token j to token i
        causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()[:, :, None]
        weights = torch.exp(seg.masked_fill(~causal, float("-inf")))
        weights = weights * torch.einsum("ihn,jhn->ijh", Cs, Bs) * dts[None, :, :]
        y = torch.einsum("ijh,jhp->ihp", weights, xs)
        y = y + torch.einsum("ihn,hpn->ihp", Cs, h) * torch.exp(cum)[:, :, None]
        to_end = torch.exp(cum[-1][None, :] - cum) * dts  # [q, H]
        h = h * torch.exp(cum[-1])[:, None, None] + torch.einsum("jh,jhp,jhn->hpn", to_end, xs, Bs)
        ys.append(y)
    return torch.cat(ys), h


class GatedRMSNorm(nn.Module):
    """RMSNorm of ``y * silu(z)`` over each group of channels, times a learned weight."""

    def __init__(self, size: int, groups: int, eps: float) -> None:
        super().__init__()
        self.groups, self.eps = groups, eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        g = (y.float() * F.silu(z.float())).unflatten(-1, (self.groups, -1))
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * g.flatten(-2).to(y.dtype)


class Mamba2Mixer(nn.Module):
    def __init__(self, layer_idx: int, hidden_size: int, num_heads: int, head_dim: int, d_state: int,
                 n_groups: int, conv_kernel: int, eps: float, dtype: str) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # index among the model's Mamba2 layers (its state buffer row)
        self.num_heads, self.head_dim, self.d_state, self.n_groups = num_heads, head_dim, d_state, n_groups
        self.d_inner = num_heads * head_dim
        self.conv_dim = self.d_inner + 2 * n_groups * d_state
        self.kernel = conv_kernel
        self.dtype_name = dtype
        self.in_proj = nn.Linear(hidden_size, self.d_inner + self.conv_dim + num_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=True)
        self.dt_bias = nn.Parameter(torch.zeros(num_heads))
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.D = nn.Parameter(torch.ones(num_heads))
        self.norm = GatedRMSNorm(self.d_inner, n_groups, eps)
        self.out_proj = nn.Linear(self.d_inner, hidden_size, bias=False)
        self.conv_state: torch.Tensor | None = None  # [slots, conv_dim, K-1]
        self.ssm_state: torch.Tensor | None = None  # [slots, heads, head_dim, d_state]

    # ---- cache resources -----------------------------------------------------------------------
    def cache_resources(self) -> dict[str, ResourceHandler]:
        return {
            "conv_state": CausalConvHandler(self.dtype_name, conv_dim=self.conv_dim, kernel_size=self.kernel),
            "ssm_state": SSMStateHandler(self.dtype_name, num_heads=self.num_heads, head_dim=self.head_dim,
                                         d_state=self.d_state, n_groups=self.n_groups),
        }

    def bind_cache(self, name: str, view: torch.Tensor) -> None:
        setattr(self, name, view)

    # ---- forward -------------------------------------------------------------------------------
    def forward(self, hidden: torch.Tensor, meta=None) -> torch.Tensor:
        """``hidden`` [T, hidden]: one step's tokens (``meta``: request rows and state slots) or one
        whole sequence from zero states (``meta`` None)."""
        z, xbc, dt = self.in_proj(hidden).split([self.d_inner, self.conv_dim, self.num_heads], dim=-1)
        if meta is None:
            conv = torch.zeros(self.conv_dim, self.kernel - 1, dtype=hidden.dtype, device=hidden.device)
            ssm = torch.zeros(self.num_heads, self.head_dim, self.d_state, device=hidden.device)
            y, _, _ = self._sequence(xbc, dt, conv, ssm, ssd_reference)
        else:
            if self.conv_state is None or self.ssm_state is None:
                raise RuntimeError("Mamba2 step before bind_cache()")
            y = torch.empty(hidden.shape[0], self.d_inner, dtype=hidden.dtype, device=hidden.device)
            starts = meta.query_starts
            for i, slot in enumerate(meta.state_slots):
                first, last = starts[i], starts[i + 1]
                y[first:last], conv, ssm = self._sequence(xbc[first:last], dt[first:last], self.conv_state[slot],
                                                          self.ssm_state[slot].float(), ssd_scan)
                self.conv_state[slot] = conv
                self.ssm_state[slot] = ssm.to(self.ssm_state.dtype)
        return self.out_proj(self.norm(y, z))

    def _sequence(self, xbc: torch.Tensor, dt: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                  scan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One request's rows after ``conv_state``/``ssm_state``: (y [n, d_inner], new conv, new ssm)."""
        n = xbc.shape[0]
        window = torch.cat([conv_state.to(xbc.dtype), xbc.transpose(0, 1)], dim=1)  # [conv_dim, K-1+n]
        conv = F.conv1d(window[None], self.conv1d.weight, self.conv1d.bias, groups=self.conv_dim)[0]
        xbc = F.silu(conv.transpose(0, 1))  # [n, conv_dim]
        x, B, C = xbc.float().split([self.d_inner, self.n_groups * self.d_state, self.n_groups * self.d_state], -1)
        x = x.view(n, self.num_heads, self.head_dim)
        per_group = self.num_heads // self.n_groups
        B = B.view(n, self.n_groups, self.d_state).repeat_interleave(per_group, dim=1)
        C = C.view(n, self.n_groups, self.d_state).repeat_interleave(per_group, dim=1)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        A = -torch.exp(self.A_log.float())
        y, ssm = scan(x, dt, A, B, C, ssm_state)
        y = y + self.D.float()[:, None] * x
        return y.reshape(n, self.d_inner).to(xbc.dtype), window[:, window.shape[1] - (self.kernel - 1):], ssm
