"""An independent NumPy (float64) restatement of the transformer, for tests only."""

import math

import numpy as np


def _rms(x, w, eps, style="w"):
    scale = 1.0 + w if style == "1+w" else w
    return scale * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _inv_freq(cfg, local=False):
    d = cfg.head_dim
    theta = cfg.rope_local_theta if local else cfg.rope_theta
    inv = 1.0 / (theta ** (np.arange(0, d, 2) / d))
    s = None if local else cfg.rope_scaling
    if s is None:
        return inv
    if s.kind == "linear":
        return inv / s.factor
    if s.kind == "longrope":  # short factors; cos/sin times attention_factor (_rope's scale)
        return inv / np.asarray(s.short_factor)
    out = []
    for f in inv:
        wl = 2 * math.pi / f
        if wl < s.original_max_position / s.high_freq_factor:
            out.append(f)
        elif wl > s.original_max_position / s.low_freq_factor:
            out.append(f / s.factor)
        else:
            sm = (s.original_max_position / wl - s.low_freq_factor) / (
                s.high_freq_factor - s.low_freq_factor
            )
            out.append((1 - sm) * f / s.factor + sm * f)
    return np.array(out)


def _rope(x, pos, inv, scale=1.0):  # x [t, h, d]
    ang = pos[:, None] * inv[None, :]
    cos, sin = scale * np.cos(ang), scale * np.sin(ang)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _act(cfg, x):
    if cfg.activation == "silu":
        return x / (1 + np.exp(-x))
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _layer_types(cfg):
    """Per layer: is it a sliding layer (window and, if any, local RoPE)."""
    if cfg.layer_types is None:
        return [cfg.sliding_window is not None] * cfg.num_layers
    return [t == "sliding" for t in cfg.layer_types]


def forward(model, ids, mask=None, *, embeds=None, rope_positions=None, blocks=None):
    """Logits [B, T, V] in float64, one row at a time, loops over heads and layers.

    ``embeds`` [B, T, D]: the layers' inputs instead of the embedding table's rows;
    ``rope_positions`` [B, T]: each token's RoPE position instead of its index among the valid
    tokens; ``blocks`` [B, T]: tokens with the same id > 0 attend to each other both ways (inside
    a sliding layer's window: ``q - k < W``, one-sided)."""
    cfg = model.config
    P = lambda a: None if a is None else np.asarray(a, np.float64)
    L = model.layers
    ids = np.asarray(ids)
    mask = np.ones(ids.shape, int) if mask is None else np.asarray(mask)
    sliding = _layer_types(cfg)
    inv = {False: _inv_freq(cfg), True: _inv_freq(cfg, local=cfg.rope_local_theta is not None)}
    head = P(model.embed if model.lm_head is None else model.lm_head)
    scale = 1 / math.sqrt(
        cfg.head_dim if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar
    )
    norm = lambda x, w: _rms(x, w, cfg.rms_norm_eps, cfg.norm_weight)
    out = np.zeros(ids.shape + (cfg.vocab_size,))
    for b in range(ids.shape[0]):
        valid = np.nonzero(mask[b])[0]
        x = P(model.embed)[ids[b, valid]]
        if cfg.scale_embeddings:
            x = x * math.sqrt(cfg.hidden_size)
        if embeds is not None:
            x = np.asarray(embeds, np.float64)[b, valid]
        t = len(valid)
        idx = np.arange(t, dtype=np.float64)
        pos = idx if rope_positions is None else np.asarray(rope_positions, np.float64)[b, valid]
        blk = np.zeros(t, int) if blocks is None else np.asarray(blocks)[b, valid]
        for l in range(cfg.num_layers):
            g = lambda name: None if getattr(L, name) is None else P(getattr(L, name)[l])
            h = norm(x, g("attn_norm"))
            q = h @ g("wq") + (0 if g("bq") is None else g("bq"))
            k = h @ g("wk") + (0 if g("bk") is None else g("bk"))
            v = h @ g("wv") + (0 if g("bv") is None else g("bv"))
            q = q.reshape(t, cfg.num_heads, cfg.head_dim)
            k = k.reshape(t, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(t, cfg.num_kv_heads, cfg.head_dim)
            if cfg.qk_norm:
                q, k = norm(q, g("q_norm")), norm(k, g("k_norm"))
            local = sliding[l] and cfg.rope_local_theta is not None  # a local RoPE is unscaled
            factor = 1.0 if local or cfg.rope_scaling is None else cfg.rope_scaling.attention_factor
            q, k = _rope(q, pos, inv[sliding[l]], factor), _rope(k, pos, inv[sliding[l]], factor)
            o = np.zeros_like(q)
            for hq in range(cfg.num_heads):
                hk = hq // (cfg.num_heads // cfg.num_kv_heads)
                s = q[:, hq] @ k[:, hk].T * scale
                allowed = np.tril(np.ones((t, t), bool))
                allowed |= (blk[:, None] == blk[None, :]) & (blk[:, None] > 0)
                if sliding[l] and cfg.sliding_window is not None:
                    allowed &= (idx[:, None] - idx[None, :]) < cfg.sliding_window
                s = np.where(allowed, s, -np.inf)
                p = np.exp(s - s.max(-1, keepdims=True))
                o[:, hq] = (p / p.sum(-1, keepdims=True)) @ v[:, hk]
            a = o.reshape(t, -1) @ g("wo") + (0 if g("bo") is None else g("bo"))
            x = x + (norm(a, g("attn_out_norm")) if cfg.sandwich_norms else a)
            h = norm(x, g("mlp_norm"))
            gate = h @ g("w_gate") + (0 if g("b_gate") is None else g("b_gate"))
            up = h @ g("w_up") + (0 if g("b_up") is None else g("b_up"))
            y = (_act(cfg, gate) * up) @ g("w_down") + (0 if g("b_down") is None else g("b_down"))
            x = x + (norm(y, g("mlp_out_norm")) if cfg.sandwich_norms else y)
        x = norm(x, P(model.norm))
        out[b, valid] = x @ head.T
    return out
