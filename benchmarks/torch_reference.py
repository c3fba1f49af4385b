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
