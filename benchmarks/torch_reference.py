"""The default model in PyTorch, for a side-by-side speed comparison (``benchmarks/throughput.py``).

The same shape and training step as ``models/text/dense.py`` + ``training/step.py``: token embedding,
pre-norm blocks (RMSNorm, fused QKV projection, RoPE in the "rotate half" form, causal
``scaled_dot_product_attention``, output projection; RMSNorm, SwiGLU), final RMSNorm, output
projection (its own weight, or the embedding's with ``tie_embeddings``);
mean next-token cross entropy; AdamW (decoupled weight decay on every parameter, as ``optax.adamw``)
after global-norm clipping, linear warmup then cosine decay; gradients of G microbatches averaged
before the one update. Eager PyTorch, float32, ``torch.set_num_threads`` = the cores this process
may use. An optional dependency (``benchmarks/requirements-torch.txt``): nothing in ``make run`` or
``make test`` imports this file.

Shape legend: B batch, L sequence length, D d_model, N heads, C channels per head, F d_ff, V vocab.
"""

from __future__ import annotations

import math
import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def cores() -> int:
    """CPU cores this process may run on (its affinity mask, as JAX sizes its pool)."""
    return len(os.sched_getaffinity(0))


def rope_tables(length: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles_LC = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cos(angles_LC), torch.sin(angles_LC)


def apply_rope(x_BNLC: torch.Tensor, cos_LC: torch.Tensor, sin_LC: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_BNLC.chunk(2, dim=-1)
    return torch.cat([x1 * cos_LC - x2 * sin_LC, x2 * cos_LC + x1 * sin_LC], dim=-1)


class Attention(nn.Module):
    def __init__(self, d: int, n_heads: int, n_layers: int, seq_len: int, theta: float):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, d // n_heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        nn.init.normal_(self.qkv.weight, std=0.02)
        nn.init.normal_(self.out.weight, std=0.02 / math.sqrt(2 * n_layers))
        cos, sin = rope_tables(seq_len, self.head_dim, theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        B, L, D = x_BLD.shape
        qkv = self.qkv(x_BLD).view(B, L, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q_BNLC, k_BNLC, v_BNLC = qkv[0], qkv[1], qkv[2]
        cos, sin = self.cos[:L], self.sin[:L]
        q_BNLC, k_BNLC = apply_rope(q_BNLC, cos, sin), apply_rope(k_BNLC, cos, sin)
        y_BNLC = F.scaled_dot_product_attention(q_BNLC, k_BNLC, v_BNLC, is_causal=True)
        return self.out(y_BNLC.transpose(1, 2).reshape(B, L, D))


class SwiGLU(nn.Module):
    def __init__(self, d: int, d_ff: int, n_layers: int):
        super().__init__()
        self.gate = nn.Linear(d, d_ff, bias=False)
        self.up = nn.Linear(d, d_ff, bias=False)
        self.down = nn.Linear(d_ff, d, bias=False)
        nn.init.normal_(self.gate.weight, std=0.02)
        nn.init.normal_(self.up.weight, std=0.02)
        nn.init.normal_(self.down.weight, std=0.02 / math.sqrt(2 * n_layers))

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x_BLD)) * self.up(x_BLD))


class Block(nn.Module):
    def __init__(self, d: int, n_heads: int, d_ff: int, n_layers: int, seq_len: int, theta: float):
        super().__init__()
        self.attn_norm = nn.RMSNorm(d, eps=1e-6)  # flax nnx.RMSNorm's epsilon
        self.attn = Attention(d, n_heads, n_layers, seq_len, theta)
        self.mlp_norm = nn.RMSNorm(d, eps=1e-6)
        self.mlp = SwiGLU(d, d_ff, n_layers)

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        x_BLD = x_BLD + self.attn(self.attn_norm(x_BLD))
        return x_BLD + self.mlp(self.mlp_norm(x_BLD))


class DecoderLM(nn.Module):
    """``forward(ids: int64[B, L]) -> logits: float32[B, L, V]``; ``cfg`` as ``DenseLMConfig``."""

    def __init__(self, cfg, vocab_size: int, seq_len: int):
        super().__init__()
        d = cfg.d_model
        self.embed = nn.Embedding(vocab_size, d)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(
            [Block(d, cfg.n_heads, cfg.d_ff, cfg.n_layers, seq_len, cfg.rope_theta) for _ in range(cfg.n_layers)]
        )
        self.final_norm = nn.RMSNorm(d, eps=1e-6)
        self.head = None if cfg.tie_embeddings else nn.Linear(d, vocab_size, bias=False)
        if self.head is not None:
            nn.init.normal_(self.head.weight, std=0.02)

    def forward(self, ids_BL: torch.Tensor) -> torch.Tensor:
        x_BLD = self.embed(ids_BL)
        for block in self.blocks:
            x_BLD = block(x_BLD)
        x_BLD = self.final_norm(x_BLD)
        return F.linear(x_BLD, self.embed.weight) if self.head is None else self.head(x_BLD)


def load_flax_params(model: DecoderLM, params: dict) -> None:
    """Copy a :class:`models.text.dense.DecoderLM`'s parameters (``nnx.to_pure_dict(nnx.state(m))``,
    numpy arrays) into ``model``: kernels ``[in, out]`` become ``nn.Linear`` weights ``[out, in]``;
    the fused QKV keeps its (3, N, C) output layout. Raises ``KeyError`` on a missing parameter."""

    def put(param: torch.Tensor, value) -> None:
        value = torch.from_numpy(np.array(value, np.float32))  # a writable copy
        if param.shape != value.shape:
            raise ValueError(f"shape {tuple(value.shape)} for a parameter of shape {tuple(param.shape)}")
        param.data.copy_(value)

    put(model.embed.weight, params["embed"]["embedding"])
    for i, block in enumerate(model.blocks):
        ours = params["blocks"][i]
        put(block.attn_norm.weight, ours["attn_norm"]["scale"])
        put(block.attn.qkv.weight, np.asarray(ours["attn"]["qkv"]["kernel"]).T)
        put(block.attn.out.weight, np.asarray(ours["attn"]["out"]["kernel"]).T)
        put(block.mlp_norm.weight, ours["mlp_norm"]["scale"])
        for name in ("gate", "up", "down"):
            put(getattr(block.mlp, name).weight, np.asarray(ours["mlp"][name]["kernel"]).T)
    put(model.final_norm.weight, params["final_norm"]["scale"])
    if model.head is not None:
        put(model.head.weight, np.asarray(params["head"]["kernel"]).T)


@torch.no_grad()
def greedy_generate(model: DecoderLM, ids_BP: torch.Tensor, new: int) -> torch.Tensor:
    """``new`` greedy tokens after each prompt (``int64[B, P]``, all of length P) with a KV cache:
    one prompt pass, then ``new - 1`` single-token steps whose keys and values are written into
    preallocated ``[B, N, P + new - 1, C]`` buffers per block (the decode loop of a KV-cached
    PyTorch LM in eager mode). No EOT or stop string ends a row. Returns ``int64[B, new]``."""
    B, P = ids_BP.shape
    S = P + new - 1
    caches = []
    x_BLD = model.embed(ids_BP)
    for block in model.blocks:
        a = block.attn
        N, C = a.n_heads, a.head_dim
        h_BLD = block.attn_norm(x_BLD)
        qkv = a.qkv(h_BLD).view(B, P, 3, N, C).permute(2, 0, 3, 1, 4)
        cos, sin = a.cos[:P], a.sin[:P]
        q_BNLC, k_BNLC = apply_rope(qkv[0], cos, sin), apply_rope(qkv[1], cos, sin)
        k_cache, v_cache = torch.empty(B, N, S, C), torch.empty(B, N, S, C)
        k_cache[:, :, :P], v_cache[:, :, :P] = k_BNLC, qkv[2]
        caches.append((k_cache, v_cache))
        y_BNLC = F.scaled_dot_product_attention(q_BNLC, k_BNLC, qkv[2], is_causal=True)
        x_BLD = x_BLD + a.out(y_BNLC.transpose(1, 2).reshape(B, P, -1))
        x_BLD = x_BLD + block.mlp(block.mlp_norm(x_BLD))
    out = torch.empty(B, new, dtype=torch.int64)
    out[:, 0] = _head(model, x_BLD[:, -1]).argmax(-1)
    for t in range(1, new):
        pos = P + t - 1
        x_B1D = model.embed(out[:, t - 1 : t])
        for block, (k_cache, v_cache) in zip(model.blocks, caches):
            a = block.attn
            N, C = a.n_heads, a.head_dim
            qkv = a.qkv(block.attn_norm(x_B1D)).view(B, 1, 3, N, C).permute(2, 0, 3, 1, 4)
            cos, sin = a.cos[pos : pos + 1], a.sin[pos : pos + 1]
            q_BN1C = apply_rope(qkv[0], cos, sin)
            k_cache[:, :, pos : pos + 1], v_cache[:, :, pos : pos + 1] = apply_rope(qkv[1], cos, sin), qkv[2]
            y_BN1C = F.scaled_dot_product_attention(q_BN1C, k_cache[:, :, : pos + 1], v_cache[:, :, : pos + 1])
            x_B1D = x_B1D + a.out(y_BN1C.transpose(1, 2).reshape(B, 1, -1))
            x_B1D = x_B1D + block.mlp(block.mlp_norm(x_B1D))
        out[:, t] = _head(model, x_B1D[:, 0]).argmax(-1)
    return out


def _head(model: DecoderLM, x_BD: torch.Tensor) -> torch.Tensor:
    x_BD = model.final_norm(x_BD)
    return F.linear(x_BD, model.embed.weight) if model.head is None else model.head(x_BD)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def warmup_cosine(step: int, peak: float, warmup: int, total: int, final_frac: float) -> float:
    """``optax.warmup_cosine_decay_schedule`` as ``training.optimizers.lr_schedule`` builds it."""
    if step < warmup:
        return peak * step / warmup
    t = min(step - warmup, total - warmup) / max(total - warmup, 1)
    end = peak * final_frac
    return end + (peak - end) * 0.5 * (1 + math.cos(math.pi * t))


class TorchTrainer:
    """Model + AdamW + clip; ``step(batch: int64[B, L+1]) -> loss`` (a 0-d tensor, already computed).

    ``microbatches`` (G): forward and backward on B / G rows at a time, gradients averaged, one
    update — as ``training.step.make_train_step``. ``inner``: an ``InnerOptConfig``.
    """

    def __init__(
        self,
        model_cfg,
        inner,
        vocab_size: int,
        seq_len: int,
        microbatches: int = 1,
        total_steps: int = 1000,
        seed: int = 0,
    ):
        torch.set_num_threads(cores())
        torch.manual_seed(seed)
        self.model = DecoderLM(model_cfg, vocab_size, seq_len)
        self.microbatches, self.clip = microbatches, inner.grad_clip
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=inner.lr, betas=(inner.b1, inner.b2), eps=1e-8, weight_decay=inner.weight_decay
        )
        warmup = min(inner.warmup_steps, max(total_steps - 1, 0))
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: warmup_cosine(s, 1.0, warmup, max(total_steps, warmup + 1), inner.final_lr_frac)
        )

    def step(self, batch_BT: torch.Tensor) -> torch.Tensor:
        self.opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for mb in batch_BT.chunk(self.microbatches):
            logits_BLV = self.model(mb[:, :-1])
            loss = F.cross_entropy(logits_BLV.reshape(-1, logits_BLV.shape[-1]), mb[:, 1:].reshape(-1))
            (loss / self.microbatches).backward()
            total += loss.detach()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.opt.step()
        self.sched.step()
        return total / self.microbatches
