"""Stand-in for `grouped_gemm.ops`: the three ops upstream's MoE uses (`nn/moe.py`), in plain torch.

- `permute(x, indices)`: indices (tokens, top_k) int32 expert ids; returns the tokens copied once per chosen
  expert, grouped by expert in increasing id (stable), and a map for `unpermute`.
- `gmm(a, b, batch_sizes, trans_b=False)`: row block e of `a` (batch_sizes[e] rows) times b[e] (or b[e].T).
- `unpermute(y, row_id_map, probs)`: out[t] = sum_k probs[t, k] * y[row of (t, k)], in y's dtype.

Here `row_id_map` is the stable sort order of the flattened (token, k) choices; the CUDA library's map has
another layout but is only ever passed back to its own `unpermute`. No parameters are created here (the
expert weights are upstream's `GroupedMLP` parameters), so block split, build, freezing, DDP/optimizer
construction and the engine schedule are unchanged; the ops only make a CPU MoE forward/backward correct.
"""

import torch


def permute(input_act, indices, num_out_tokens=None, max_token_num=0):
    if num_out_tokens not in (None, 0, indices.numel()):
        raise NotImplementedError("grouped_gemm stand-in: dropping tokens (num_out_tokens) is not supported")
    order = torch.argsort(indices.reshape(-1).long(), stable=True)
    return input_act[order // indices.shape[1]], order


def unpermute(input_act, row_id_map, probs=None):
    tokens, top_k = probs.shape if probs is not None else (row_id_map.numel(), 1)
    rows = input_act[torch.argsort(row_id_map)].view(tokens, top_k, -1).float()
    if probs is not None:
        rows = rows * probs.float().unsqueeze(-1)
    return rows.sum(1).to(input_act.dtype)


def gmm(a, b, batch_sizes, trans_b=False):
    outs = [x @ (w.t() if trans_b else w) for x, w in zip(a.split(batch_sizes.tolist()), b)]
    return torch.cat(outs) if outs else a.new_zeros(0, b.shape[1] if trans_b else b.shape[2])
