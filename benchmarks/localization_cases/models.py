"""Small models of six families, built from a case's spec, each with an optional `site`: a layer that
holds a precision hazard (or its harmless twin in clean models) at a known module path.

Every model maps features (B, F) or (B, T, F) to class logits. Families and their blocks
(`layers.K`): mlp (Linear + activation), residual (pre-norm MLP with a residual add), attention
(causal self-attention and MLP, pre-norm), norms (Linear + BatchNorm1d/LayerNorm/GroupNorm +
activation), moe (a router picks the top-2 of 4 experts per token), cnn (conv + norm + activation
on 8x8 maps, then pooling; its site acts on the pooled features, or on the maps for `hf32_conv`).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "silu": F.silu, "tanh": torch.tanh, "sigmoid": torch.sigmoid}
SEQUENCE_FAMILIES = ("residual", "attention", "moe")  # inputs (B, T, F)


class TransposedLinear(nn.Linear):
    """The transposed-weight bug: a square Linear that multiplies by W instead of W^T."""

    def forward(self, x):
        return F.linear(x, self.weight.t(), self.bias)


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(width))

    def forward(self, x):
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def make_norm(kind: str, width: int) -> nn.Module:
    return {"layer": lambda: nn.LayerNorm(width), "rms": lambda: RMSNorm(width),
            "batch": lambda: nn.BatchNorm1d(width), "group": lambda: nn.GroupNorm(4, width)}[kind]()


class Dense(nn.Module):
    def __init__(self, width: int, act: str) -> None:
        super().__init__()
        self.fc, self.act = nn.Linear(width, width), act

    def forward(self, x):
        return ACTIVATIONS[self.act](self.fc(x))


class PreNormMLP(nn.Module):
    def __init__(self, width: int, act: str, norm: str) -> None:
        super().__init__()
        self.norm, self.act = make_norm(norm, width), act
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.fc2(ACTIVATIONS[self.act](self.fc1(self.norm(x))))


class Attention(nn.Module):
    """Causal self-attention: `sdpa`, or by hand with the mask filled with -inf or finfo.min."""

    def __init__(self, width: int, heads: int, kind: str) -> None:
        super().__init__()
        self.heads, self.kind = heads, kind
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.scale, self.softmax_dim = 1.0 / math.sqrt(width // heads), -1

    def forward(self, x):
        b, t, w = x.shape
        q, k, v = (part.reshape(b, t, self.heads, w // self.heads).transpose(1, 2)
                   for part in self.qkv(x).chunk(3, dim=-1))
        if self.kind == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) * self.scale
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
            fill = float("-inf") if self.kind == "manual_inf" else torch.finfo(scores.dtype).min
            out = scores.masked_fill(mask, fill).softmax(dim=self.softmax_dim) @ v
        return self.proj(out.transpose(1, 2).reshape(b, t, w))


class AttentionBlock(nn.Module):
    def __init__(self, width: int, act: str, norm: str, attention: str) -> None:
        super().__init__()
        self.norm1, self.attn = make_norm(norm, width), Attention(width, 2, attention)
        self.norm2, self.mlp = make_norm(norm, width), PreNormMLP(width, act, norm)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return self.mlp(self.norm2(x))


class NormBlock(nn.Module):
    def __init__(self, width: int, act: str, norm: str) -> None:
        super().__init__()
        self.fc, self.norm, self.act = nn.Linear(width, width), make_norm(norm, width), act

    def forward(self, x):
        return ACTIVATIONS[self.act](self.norm(self.fc(x)))


class Expert(nn.Module):
    def __init__(self, width: int, act: str) -> None:
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(width, 2 * width), nn.Linear(2 * width, width), act

    def forward(self, x):
        return self.fc2(ACTIVATIONS[self.act](self.fc1(x)))


class MoEBlock(nn.Module):
    """Top-k routing over 4 experts (computed densely, weighted by the routed gates)."""

    def __init__(self, width: int, act: str, norm: str) -> None:
        super().__init__()
        self.norm, self.router = make_norm(norm, width), nn.Linear(width, 4)
        self.experts, self.top_k = nn.ModuleList(Expert(width, act) for _ in range(4)), 2
        with torch.no_grad():
            self.router.weight.mul_(4.0)  # clear preferences: a routing tie is rare

    def forward(self, x):
        h = self.norm(x)
        gates = self.router(h).float().softmax(-1)
        top, chosen = gates.topk(self.top_k, dim=-1)
        weights = torch.zeros_like(gates).scatter(-1, chosen, top / top.sum(-1, keepdim=True))
        out = sum(weights[..., e:e + 1] * expert(h) for e, expert in enumerate(self.experts))
        return x + out


class ConvBlock(nn.Module):
    def __init__(self, channels: int, act: str, norm: str) -> None:
        super().__init__()
        self.conv, self.act = nn.Conv2d(channels, channels, 3, padding=1), act
        self.norm = nn.BatchNorm2d(channels) if norm == "batch" else nn.GroupNorm(4, channels)

    def forward(self, x):
        return ACTIVATIONS[self.act](self.norm(self.conv(x)))


# ---------------------------------------------------------------------------- sites
class Site(nn.Module):
    """One layer on the hidden features (last dim `width`); `kind` says what it computes.

    Hazards (each harmless in fp32; `scale`/`offset` set by the case):
      overflow_linear  x + norm(fc(x)), fc's weight scaled so its output passes fp16's 65504
      overflow_square  x + norm(h * h), h = fc(x) scaled to ~500 (h*h passes 65504)
      overflow_scores  softmax(q @ k^T) @ v with q, k scaled so the scores pass 65504
      cancel_sub       h = fc(x) on a bias `offset` (3000), x + proj(h - h.mean(-1)): the subtraction
                       reveals what rounding h lost
      cancel_norm      the same, revealed by a LayerNorm
      lost_update      new = base + u with u ~1e-4 |base|, x + proj((new - base) * 1e4)
      hf32_sub         h = fc(x + 1e4), x + proj(h - 1e4 * fc.weight.sum(1)) (fp32 run, HF32 matmuls)
      hf32_bn          x + bn(fc(x + 1e4)), BatchNorm1d removes the offset's share
    Harmless twins for clean models: plain (x + norm(fc(x))), plain_sub, plain_square, plain_scores.
    """

    def __init__(self, width: int, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.fc = nn.Linear(width, width)
        if kind in ("overflow_scores", "plain_scores"):
            self.k, self.v = nn.Linear(width, width), nn.Linear(width, width)
        if kind in ("overflow_linear", "overflow_square", "cancel_norm", "plain", "plain_square"):
            self.norm = nn.LayerNorm(width)
        if kind in ("cancel_sub", "hf32_sub", "plain_sub", "lost_update"):
            self.proj = nn.Linear(width, width)
        if kind == "lost_update":
            self.upd = nn.Linear(width, width)
        if kind == "hf32_bn":
            self.bn = nn.BatchNorm1d(width)

    def forward(self, x):
        kind = self.kind
        if kind in ("overflow_linear", "cancel_norm", "plain"):
            return x + self.norm(self.fc(x))
        if kind in ("overflow_square", "plain_square"):
            h = self.fc(x)
            return x + self.norm(h * h)
        if kind in ("overflow_scores", "plain_scores"):
            q, k = self.fc(x), self.k(x)
            scores = q @ k.transpose(-2, -1)
            if kind == "plain_scores":
                scores = scores / math.sqrt(x.shape[-1])
            return x + scores.softmax(-1) @ self.v(x)
        if kind in ("cancel_sub", "plain_sub"):
            h = self.fc(x)
            return x + self.proj(h - h.mean(-1, keepdim=True))
        if kind == "lost_update":
            base = self.fc(x)
            new = base + self.upd(x) * 1e-4
            return x + self.proj((new - base) * 1e4)
        if kind == "hf32_sub":
            h = self.fc(x + 1e4)
            return x + self.proj(h - 1e4 * self.fc.weight.sum(1))
        if kind == "hf32_bn":
            return x + self.bn(self.fc(x + 1e4))
        raise ValueError(kind)


class ConvSite(nn.Module):
    """hf32_conv: x + bn(conv(x + 1e3)) on feature maps: HF32 rounds the offset inputs, BatchNorm2d
    removes the offset's share (plain_conv: the same without the offset)."""

    def __init__(self, channels: int, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.conv, self.bn = nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels)

    def forward(self, x):
        return x + self.bn(self.conv(x + 1e3 if self.kind == "hf32_conv" else x))


class Net(nn.Module):
    def __init__(self, family: str, features: int, width: int, depth: int, classes: int, acts: list[str],
                 norm: str, attention: str, site: str | None, site_after: int) -> None:
        super().__init__()
        self.family, self.site_after = family, site_after
        if family == "cnn":
            self.stem = nn.Conv2d(3, width, 3, padding=1)
        else:
            self.stem = nn.Linear(features, width)
        blocks = {
            "mlp": lambda i: Dense(width, acts[i]),
            "residual": lambda i: PreNormMLP(width, acts[i], norm),
            "attention": lambda i: AttentionBlock(width, acts[i], norm, attention),
            "norms": lambda i: NormBlock(width, acts[i], norm),
            "moe": lambda i: MoEBlock(width, acts[i], norm),
            "cnn": lambda i: ConvBlock(width, acts[i], norm),
        }[family]
        self.layers = nn.ModuleList(blocks(i) for i in range(depth))
        if site is not None:
            self.site = ConvSite(width, site) if site.endswith("_conv") else Site(width, site)
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        x = self.stem(x)
        for index, layer in enumerate(self.layers):
            x = layer(x)
            if index == self.site_after and hasattr(self, "site") and isinstance(self.site, ConvSite):
                x = self.site(x)
        if self.family == "cnn":
            x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        if hasattr(self, "site") and isinstance(self.site, Site):
            x = self.site(x)
        return self.head(x)

