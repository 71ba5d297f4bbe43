"""Small models for ``halfadam train`` that store weights in one dtype and compute in another.

Every layer casts its weights to the dtype of the activations it receives (``F.linear(x,
self.weight.to(x.dtype))``), and the models cast their input to :attr:`compute_dtype`. So a model whose
parameters are float16 or bfloat16 can still compute in float32 — much faster than half-precision
matmuls on a CPU — while autograd casts the gradient back to the *parameter's* dtype: a float16 model
gets float16 gradients (which underflow without loss scaling) and its optimizer updates float16 weights.
This is exactly the storage situation that ``halfadam.AdamW`` is built for. With ``compute_dtype=None``
the model computes in its parameter dtype (what ``halfadam train`` does on CUDA).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["CharGPT", "DigitsMLP", "LayerNorm", "Linear", "relative_distance", "set_compute_dtype"]


class Linear(nn.Module):
    """``nn.Linear`` that casts its weight and bias to the input's dtype in ``forward``."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, std: float = 0.02):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features) * std)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)


class LayerNorm(nn.Module):
    """``nn.LayerNorm`` (weight 1, bias 0 at init) that casts its parameters to the input's dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.weight.to(x.dtype), self.bias.to(x.dtype), self.eps)


class _CastModel(nn.Module):
    """Base class: ``compute_dtype`` is the activation dtype; ``None`` means the parameter dtype."""

    compute_dtype: torch.dtype | None = None

    def _cdtype(self) -> torch.dtype:
        return self.compute_dtype or next(self.parameters()).dtype


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused QKV projection."""

    def __init__(self, d_model: int, n_head: int, proj_std: float):
        super().__init__()
        if d_model % n_head:
            raise ValueError(f"d_model {d_model} is not divisible by n_head {n_head}")
        self.n_head = n_head
        self.qkv = Linear(d_model, 3 * d_model)
        self.proj = Linear(d_model, d_model, std=proj_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """A pre-LayerNorm transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    def __init__(self, d_model: int, n_head: int, proj_std: float):
        super().__init__()
        self.ln1 = LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, proj_std)
        self.ln2 = LayerNorm(d_model)
        self.fc = Linear(d_model, 4 * d_model)
        self.fc_proj = Linear(4 * d_model, d_model, std=proj_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class CharGPT(_CastModel):
    """A small GPT-style character language model.

    Token and learned position embeddings, ``n_layer`` pre-LN blocks with causal self-attention and a
    4x MLP, a final LayerNorm and an untied output head. Weights are N(0, 0.02), residual output
    projections N(0, 0.02 / sqrt(2 n_layer)), biases 0, LayerNorm weights 1. ``forward(idx)`` maps
    ``(batch, time)`` token ids to ``(batch, time, vocab_size)`` logits in the compute dtype.
    """

    def __init__(self, vocab_size: int, seq_len: int, d_model: int = 128, n_layer: int = 2, n_head: int = 4):
        super().__init__()
        proj_std = 0.02 / math.sqrt(2 * n_layer)
        self.seq_len = seq_len
        self.tok_emb = nn.Parameter(torch.randn(vocab_size, d_model) * 0.02)
        self.pos_emb = nn.Parameter(torch.randn(seq_len, d_model) * 0.02)
        self.blocks = nn.ModuleList(Block(d_model, n_head, proj_std) for _ in range(n_layer))
        self.ln_f = LayerNorm(d_model)
        self.head = Linear(d_model, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        cdtype = self._cdtype()
        t = idx.shape[1]
        x = F.embedding(idx, self.tok_emb.to(cdtype)) + self.pos_emb[:t].to(cdtype)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class DigitsMLP(_CastModel):
    """An MLP classifier: ``depth`` hidden layers of ``Linear -> LayerNorm -> GELU``, then a linear head."""

    def __init__(self, num_features: int = 64, num_classes: int = 10, hidden: int = 128, depth: int = 2):
        super().__init__()
        layers: list[nn.Module] = []
        width = num_features
        for _ in range(depth):
            layers += [Linear(width, hidden, std=1 / math.sqrt(width)), LayerNorm(hidden), nn.GELU()]
            width = hidden
        self.body = nn.Sequential(*layers)
        self.head = Linear(width, num_classes, std=1 / math.sqrt(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x.to(self._cdtype())))


def set_compute_dtype(model: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """Set the activation dtype of a model from this module (``None``: compute in the parameter dtype)."""
    model.compute_dtype = dtype
    return model


@torch.no_grad()
def relative_distance(params: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """``||w - w_ref|| / ||w_ref||`` over all parameters together, computed in float32."""
    diff = sum(float((p.float() - r.float()).pow(2).sum()) for p, r in zip(params, reference, strict=True))
    ref = sum(float(r.float().pow(2).sum()) for r in reference)
    return math.sqrt(diff) / math.sqrt(ref) if ref > 0 else math.sqrt(diff)
