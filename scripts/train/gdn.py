"""A fast torch chunked gated delta rule for transformers versions whose own one loops."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.qwen3_next import modeling_qwen3_next as qn


def _chunk_gdr(query, key, value, g, beta, chunk_size=64, initial_state=None,  # noqa: ANN001
               output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
    """transformers 5.24's torch chunked gated delta rule (triangular solve per chunk)."""
    dtype = query.dtype
    b, n, hk, dk = key.shape
    hv, dv = value.shape[-2:]
    if hk != hv:
        query = query.repeat_interleave(hv // hk, dim=2)
        key = key.repeat_interleave(hv // hk, dim=2)
    query, key, value, beta, g = [x.transpose(1, 2).to(torch.float32).contiguous()
                                  for x in (query, key, value, beta, g)]
    if use_qk_l2norm_in_kernel:
        query = query * torch.rsqrt((query * query).sum(-1, keepdim=True) + 1e-6)
        key = key * torch.rsqrt((key * key).sum(-1, keepdim=True) + 1e-6)
    query = query * query.shape[-1] ** -0.5
    pad = (chunk_size - n % chunk_size) % chunk_size
    query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    nc = (n + pad) // chunk_size
    v_beta, k_beta = value * beta[..., None], key * beta[..., None]
    query, key, k_beta, v_beta = [x.reshape(b, hv, nc, chunk_size, x.shape[-1])
                                  for x in (query, key, k_beta, v_beta)]
    cum = g.reshape(b, hv, nc, chunk_size).cumsum(-1)
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    pair = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ key.transpose(-1, -2)) * pair
    intra = (query @ key.transpose(-1, -2)) * pair
    new_v = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(ut, k_beta * cum.exp()[..., None], upper=False,
                                          unitriangular=True)
    state = (torch.zeros(b, hv, dk, dv, dtype=torch.float32, device=query.device)
             if initial_state is None else initial_state.to(torch.float32))
    query = query * cum.exp()[..., None]
    key = key * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]
    outs = []
    for i in range(nc):
        vn = new_v[:, :, i] - k_cum[:, :, i] @ state
        outs.append(query[:, :, i] @ state + intra[:, :, i] @ vn)
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ vn
    out = torch.stack(outs, 2).reshape(b, hv, -1, dv)[:, :, :n]
    return out.transpose(1, 2).contiguous().to(dtype), (state if output_final_state else None)


def fast_chunk_gated_delta_rule_installed() -> str:
    """Make sure the torch chunked GDN uses a triangular solve, not a 63-step Python loop."""
    import inspect

    try:
        src = inspect.getsource(qn.torch_chunk_gated_delta_rule)
    except (OSError, TypeError):
        src = ""
    if "solve_triangular" in src:
        return "transformers (solve_triangular)"
    qn.torch_chunk_gated_delta_rule = _chunk_gdr
    return "patched (_chunk_gdr)"
