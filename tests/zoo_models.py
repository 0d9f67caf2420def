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


def _rel_distance(q: int, k: int) -> torch.Tensor:
    """torchvision's MViT distance table between a q grid and a k grid of one axis (scaled where they differ)."""
    return torch.arange(q)[:, None] * max(k / q, 1.0) - (torch.arange(k)[None, :] + 1.0 - k) * max(q / k, 1.0)


class PoolAttention(nn.Module):
    """MViTv2's pooling attention: q, k, v pooled by depthwise 3-D convs (each followed by LayerNorm, the
    class token kept apart), decomposed relative positions (einsum of q with per-axis tables), softmax, and
    the residual pooling connection ``x[:, :, 1:] += q[:, :, 1:]`` (in place, as torchvision writes it)."""

    def __init__(self, dim: int, out: int, heads: int, stride_q: int, grid: int) -> None:
        super().__init__()
        self.heads, self.hd, self.out_dim = heads, out // heads, out
        self.scale = self.hd**-0.5
        self.qkv = nn.Linear(dim, 3 * out)
        self.proj = nn.Linear(out, out)
        self.stride_q = stride_q
        self.pool = nn.ModuleList(
            nn.Conv3d(self.hd, self.hd, 3, (1, s, s), 1, groups=self.hd, bias=False) for s in (stride_q, 2, 2)
        )
        self.norms = nn.ModuleList(nn.LayerNorm(self.hd) for _ in range(3))
        size = 2 * grid - 1  # covers every distance between the q and k grids (both at most ``grid``)
        self.rel_h = nn.Parameter(torch.randn(size, self.hd) * 0.02)
        self.rel_w = nn.Parameter(torch.randn(size, self.hd) * 0.02)

    def _pool(self, x: torch.Tensor, i: int, thw: tuple[int, int, int]) -> tuple[torch.Tensor, tuple[int, ...]]:
        b, h, _, c = x.shape
        cls, x = x[:, :, :1], x[:, :, 1:]
        x = x.transpose(2, 3).reshape(b * h, c, *thw).contiguous()
        x = self.pool[i](x)
        new = tuple(x.shape[2:])
        x = x.reshape(b, h, c, -1).transpose(2, 3)
        return self.norms[i](torch.cat((cls, x), dim=2)), new

    def forward(self, x: torch.Tensor, thw: tuple[int, int, int]) -> tuple[torch.Tensor, tuple[int, ...]]:
        b, n, _ = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, self.hd).transpose(1, 3).unbind(dim=2)
        k, k_thw = self._pool(k, 1, thw)
        v, _ = self._pool(v, 2, thw)
        q, q_thw = self._pool(q, 0, thw)
        attn = torch.matmul(self.scale * q, k.transpose(2, 3))
        t, qh, qw = q_thw
        kh, kw = k_thw[1:]
        # torchvision's distances, scaled where q and k are pooled differently
        dist_h = _rel_distance(qh, kh)
        dist_w = _rel_distance(qw, kw)
        rh, rw = self.rel_h[dist_h.long()], self.rel_w[dist_w.long()]
        r_q = q[:, :, 1:].reshape(b, self.heads, t, qh, qw, self.hd)
        rel = (torch.einsum("bythwc,hkc->bythwk", r_q, rh)[..., :, None]
               + torch.einsum("bythwc,wkc->bythwk", r_q, rw)[..., None, :])  # fmt: skip
        kt = k_thw[0]
        rel = rel[:, :, :, :, :, None].expand(-1, -1, -1, -1, -1, kt, -1, -1)
        attn[:, :, 1:, 1:] += rel.reshape(b, self.heads, t * qh * qw, kt * kh * kw)
        x = torch.matmul(attn.softmax(dim=-1), v)
        x[:, :, 1:, :] += q[:, :, 1:, :]  # residual pooling
        return self.proj(x.transpose(1, 2).reshape(b, -1, self.out_dim)), q_thw


class MViTBlock(nn.Module):
    """torchvision's MultiscaleBlock (v2): pre-norm attention with the skip max-pooled as q is; at a stage
    transition the stream is restarted by a projection of the second norm's output (``x = proj(norm2(x)) +
    mlp(norm2(x))``), a low linear at O1, so from there the stream's adds read only low operands."""

    def __init__(self, dim: int, out: int, heads: int, stride_q: int, grid: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = PoolAttention(dim, dim, heads, stride_q, grid)
        self.pool_skip = nn.MaxPool3d((1, 3, 3), (1, stride_q, stride_q), (0, 1, 1)) if stride_q > 1 else None
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, out))
        self.project = nn.Linear(dim, out) if out != dim else None

    def forward(self, x: torch.Tensor, thw: tuple[int, int, int]) -> tuple[torch.Tensor, tuple[int, ...]]:
        x_attn, new = self.attn(self.norm1(x), thw)
        skip = x
        if self.pool_skip is not None:
            cls, rest = x[:, :1], x[:, 1:]
            b, _, c = rest.shape
            rest = self.pool_skip(rest.transpose(1, 2).reshape(b, c, *thw)).flatten(2).transpose(1, 2)
            skip = torch.cat((cls, rest), dim=1)
        x = skip + x_attn
        x_norm = self.norm2(x)
        x_proj = x if self.project is None else self.project(x_norm)
        return x_proj + self.mlp(x_norm), new


class MViTLike(nn.Module):
    """Patch embedding (Conv3d), class token, position embedding, MViTv2 blocks with one stage transition
    (channels doubled, q pooled 2x), LayerNorm, classifier on the class token."""

    def __init__(self, dim: int = 32, frames: int = 2, grid: int = 8, depth: int = 4, classes: int = 100) -> None:
        super().__init__()
        self.embed = nn.Conv3d(3, dim, (1, 4, 4), (1, 4, 4))
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, 1 + frames * grid * grid, dim) * 0.02)
        blocks, g = [MViTBlock(dim, dim, 1, 1, grid), MViTBlock(dim, 2 * dim, 2, 2, grid)], grid // 2
        blocks += [MViTBlock(2 * dim, 2 * dim, 2, 1, g) for _ in range(depth - 2)]
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(2 * dim)
        self.head = nn.Linear(2 * dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        thw = tuple(x.shape[2:])
        x = torch.cat((self.cls.expand(x.shape[0], -1, -1), x.flatten(2).transpose(1, 2)), dim=1) + self.pos
        for block in self.blocks:
            x, thw = block(x, thw)
        return self.head(self.norm(x)[:, 0])


class RepViTBlock(nn.Module):
    """timm's RepViT block: token mixer (depthwise 3x3 conv + BN, plus a depthwise 1x1 conv and the identity,
    as RepVggDw sums them), squeeze-excitation (ReLU, sigmoid gate), residual channel mixer (1x1 conv + BN,
    activation, 1x1 conv + BN)."""

    def __init__(self, ch: int, act: type[nn.Module] = nn.GELU) -> None:
        super().__init__()
        self.dw = nn.Sequential(nn.Conv2d(ch, ch, 3, padding=1, groups=ch, bias=False), nn.BatchNorm2d(ch))
        self.dw1 = nn.Conv2d(ch, ch, 1, groups=ch)
        self.se = SqueezeExcite(ch, max(8, ch // 4), nn.ReLU)
        self.mix = nn.Sequential(nn.Conv2d(ch, 2 * ch, 1, bias=False), nn.BatchNorm2d(2 * ch), act(),
                                 nn.Conv2d(2 * ch, ch, 1, bias=False), nn.BatchNorm2d(ch))  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.se(self.dw(x) + self.dw1(x) + x)
        return x + self.mix(x)


class RepViTBlockNet(nn.Module):
    """Stem (two strided conv + BN + activation), RepViT blocks, global pool, classifier."""

    def __init__(self, ch: int = 32, depth: int = 4, act: type[nn.Module] = nn.GELU, classes: int = 100) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, ch // 2, 3, 2, 1, bias=False), nn.BatchNorm2d(ch // 2), act(),
                                  nn.Conv2d(ch // 2, ch, 3, 2, 1, bias=False), nn.BatchNorm2d(ch))  # fmt: skip
        self.blocks = nn.Sequential(*(RepViTBlock(ch, act) for _ in range(depth)))
        self.fc = nn.Linear(ch, classes)
        _random_bn_stats(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.blocks(self.stem(x)).mean((2, 3)))
