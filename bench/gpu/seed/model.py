"""The benchmark's pipeline stage: pre-LayerNorm transformer layers, bf16."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class StageConfig:
    layers: int = 9
    hidden: int = 1024
    ffn: int = 4096
    heads: int = 16
    seq: int = 4096
    micro_batch: int = 1
    dtype: torch.dtype = torch.bfloat16


class Layer(nn.Module):
    """x + attn(ln1(x)); then x + fc2(gelu(fc1(ln2(x)))). Causal attention through SDPA."""

    def __init__(self, cfg: StageConfig) -> None:
        super().__init__()
        h = cfg.hidden
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(h)
        self.qkv = nn.Linear(h, 3 * h)
        self.proj = nn.Linear(h, h)
        self.ln2 = nn.LayerNorm(h)
        self.fc1 = nn.Linear(h, cfg.ffn)
        self.fc2 = nn.Linear(cfg.ffn, h)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        nh = self.heads
        qkv = self.qkv(self.ln1(x)).view(b, s, 3, nh, h // nh).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


def build_stage(cfg: StageConfig, chunk_sizes: list[int], seed: int = 1234) -> list[list[Layer]]:
    """The stage's layers split into chunks (same weights for the same seed in every process)."""
    torch.manual_seed(seed)
    layers = [Layer(cfg).to(device="cuda", dtype=cfg.dtype) for _ in range(cfg.layers)]
    out, i = [], 0
    for n in chunk_sizes:
        out.append(layers[i : i + n])
        i += n
    assert i == cfg.layers
    return out
