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


class SqueezeExcite(nn.Module):
    """Global pool, reduce, act, expand, sigmoid gate multiplied onto the features."""

    def __init__(self, ch: int, hidden: int, act: type[nn.Module] = nn.SiLU) -> None:
        super().__init__()
        self.reduce, self.act, self.expand = nn.Conv2d(ch, hidden, 1), act(), nn.Conv2d(hidden, ch, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.expand(self.act(self.reduce(x.mean((2, 3), keepdim=True)))))


class MBConv(nn.Module):
    """EfficientNet's block: expand 1x1, depthwise 3x3, SE, project 1x1 (each conv + BatchNorm), residual."""

    def __init__(self, ch: int, expand: int = 4, act: type[nn.Module] = nn.SiLU) -> None:
        super().__init__()
        mid = ch * expand
        self.expand = nn.Sequential(nn.Conv2d(ch, mid, 1, bias=False), nn.BatchNorm2d(mid), act())
        self.dw = nn.Sequential(nn.Conv2d(mid, mid, 3, padding=1, groups=mid, bias=False), nn.BatchNorm2d(mid), act())
        self.se = SqueezeExcite(mid, max(8, ch // 4), act)
        self.project = nn.Sequential(nn.Conv2d(mid, ch, 1, bias=False), nn.BatchNorm2d(ch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.project(self.se(self.dw(self.expand(x))))


def _random_bn_stats(model: nn.Module, seed: int = 0) -> nn.Module:
    """BatchNorm statistics and affine parameters as a trained network has them (not 0/1)."""
    g = torch.Generator().manual_seed(seed)
    for bn in model.modules():
        if isinstance(bn, nn.BatchNorm2d):
            n = bn.num_features
            bn.running_mean.copy_(torch.randn(n, generator=g) * 0.2)
            bn.running_var.copy_(torch.rand(n, generator=g) * 2 + 0.2)
            bn.weight.data.copy_(torch.rand(n, generator=g) + 0.5)
            bn.bias.data.copy_(torch.randn(n, generator=g) * 0.2)
    return model


class EfficientNetLike(nn.Module):
    """Stem conv + BN + SiLU, MBConv blocks (SE gates), head conv, pooled classifier."""

    def __init__(self, ch: int = 24, depth: int = 4, act: type[nn.Module] = nn.SiLU) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, ch, 3, 2, 1, bias=False), nn.BatchNorm2d(ch), act())
        self.blocks = nn.Sequential(*(MBConv(ch, act=act) for _ in range(depth)))
        self.head = nn.Sequential(nn.Conv2d(ch, 64, 1, bias=False), nn.BatchNorm2d(64), act())
        self.fc = nn.Linear(64, 10)
        _random_bn_stats(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.head(self.blocks(self.stem(x))).mean((2, 3)))


class RepViTLike(EfficientNetLike):
    """RepViT / MobileNetV3: the same blocks with hard-swish."""

    def __init__(self) -> None:
        super().__init__(act=nn.Hardswish)


class SeparableAttention(nn.Module):
    """MobileViTv2's linear attention: a 1-channel context score, softmax over tokens, a weighted context
    vector broadcast back onto ReLU(values); GroupNorm(1) (LayerNorm over C, H, W) before it."""

    def __init__(self, ch: int) -> None:
        super().__init__()
        self.norm = nn.GroupNorm(1, ch)
        self.qkv = nn.Conv2d(ch, 1 + 2 * ch, 1)
        self.out = nn.Conv2d(ch, ch, 1)
        self.ch = ch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).split([1, self.ch, self.ch], 1)
        scores = q.flatten(2).softmax(-1).view_as(q)
        context = (k * scores).sum((2, 3), keepdim=True)
        return x + self.out(torch.relu(v) * context)


class MobileViTv2Like(nn.Module):
    def __init__(self, ch: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, ch, 3, 2, 1, bias=False), nn.BatchNorm2d(ch), nn.SiLU())
        self.mb = MBConv(ch)
        self.attn = nn.Sequential(*(SeparableAttention(ch) for _ in range(depth)))
        self.fc = nn.Linear(ch, 10)
        _random_bn_stats(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.attn(self.mb(self.stem(x))).mean((2, 3)))
