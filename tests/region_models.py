"""The small reference models and engine settings the region tests share."""

from __future__ import annotations

import torch
import torch.nn as nn

from qaic_dynamo import LLM
from qaic_dynamo.models import QaicLlamaConfig, QaicLlamaForCausalLM

PROMPTS = [[3, 14, 15, 92, 65], [35, 89], [79, 32, 38, 46, 26, 43, 38]]


def llama(layers, **kw):
    torch.manual_seed(0)
    cfg = dict(
        num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2
    )
    cfg.update(kw)
    return QaicLlamaForCausalLM(QaicLlamaConfig(**cfg)).eval()


def engine(model, **kw):
    return LLM(model, max_num_seqs=3, max_model_len=64, **kw)


class Scaled(nn.Module):
    """A block whose forward branches on a plain attribute: Dynamo guards on its value."""

    def __init__(self, width):
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.act = True

    def forward(self, x):
        y = self.proj(x)
        return torch.relu(y) if self.act else torch.tanh(y)


class Stack(nn.Module):
    def __init__(self, layers=3, width=8):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(width, width)
        self.layers = nn.ModuleList(Scaled(width) for _ in range(layers))

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return x
