"""Small models with the structure of the timm/torchvision architectures where issue 47's sweep found amplite
short of torch.autocast (random init, seconds to convert on one CPU core)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """timm's interleaved rotation: (x0, x1) -> (-x1, x0) on each pair."""
    return torch.stack([-x[..., 1::2], x[..., ::2]], -1).reshape(x.shape)


class RopeAttention(nn.Module):
    """EVA-02 attention: fused qkv, rotary embeddings on q and k (patch tokens only), scaled dot product."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        sin, cos = rope.chunk(2, -1)
        q = torch.cat([q[:, :, :1], q[:, :, 1:] * cos + _rotate_half(q[:, :, 1:]) * sin], 2)
        k = torch.cat([k[:, :, :1], k[:, :, 1:] * cos + _rotate_half(k[:, :, 1:]) * sin], 2)
        attn = (q * self.scale) @ k.transpose(-2, -1)
        x = (attn.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c)
        return self.proj(x)


class SwiGLU(nn.Module):
    """EVA-02's MLP: SiLU-gated, with a LayerNorm on the hidden features (sub-LN) before the output layer."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Linear(dim, hidden), nn.Linear(dim, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.w3 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w3(self.norm(F.silu(self.w1(x)) * self.w2(x)))


class EvaBlock(nn.Module):
    def __init__(self, dim: int, heads: int, init: float) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn, self.mlp = RopeAttention(dim, heads), SwiGLU(dim, dim * 8 // 3)
        self.gamma1 = nn.Parameter(init * torch.ones(dim))  # layer scale
        self.gamma2 = nn.Parameter(init * torch.ones(dim))

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        x = x + self.gamma1 * self.attn(self.norm1(x), rope)
        return x + self.gamma2 * self.mlp(self.norm2(x))


class EvaLike(nn.Module):
    """Patch embedding, class token, absolute position embedding, EVA blocks, mean-pooled head."""

    def __init__(self, dim: int = 96, heads: int = 3, depth: int = 8, grid: int = 8, init: float = 0.1) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 4, 4)
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, grid * grid + 1, dim) * 0.02)
        self.blocks = nn.ModuleList(EvaBlock(dim, heads, init) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 10)
        half = dim // heads // 4  # rotary frequencies on each of the two axes
        freqs = 1.0 / (10000 ** (torch.arange(half) / half))
        t = torch.arange(grid).float()
        ang = torch.cat([torch.outer(t, freqs)[:, None].expand(grid, grid, half),
                         torch.outer(t, freqs)[None].expand(grid, grid, half)], -1).reshape(grid * grid, -1)
        ang = ang.repeat_interleave(2, -1)
        self.register_buffer("rope", torch.cat([ang.sin(), ang.cos()], -1), persistent=False)
        for layer in self.modules():  # timm's ViT init: small weights, so each block adds a small update
            if isinstance(layer, nn.Linear):
                nn.init.trunc_normal_(layer.weight, std=0.02)
                nn.init.zeros_(layer.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], 1) + self.pos
        for block in self.blocks:
            x = block(x, self.rope)
        return self.head(self.norm(x[:, 1:].mean(1)))
