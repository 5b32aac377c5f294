"""TinyGPT: the small GPT-style decoder that the demo, the benchmarks and the tests train."""

from __future__ import annotations

import torch


class TinyGPT(torch.nn.Module):
    """Token and position embeddings, pre-norm causal attention blocks, and a head tied to the embedding."""

    def __init__(self, vocab: int = 96, dim: int = 64, heads: int = 4, layers: int = 2, seq: int = 32):
        super().__init__()
        self.seq = seq
        self.tok = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers)
        )
        self.norm = torch.nn.LayerNorm(dim)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(seq), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos[:t]
        for block in self.blocks:
            x = block(x, src_mask=self.mask[:t, :t], is_causal=True)
        return self.norm(x) @ self.tok.weight.t()

    def loss(self, idx: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy on a batch of sequences of ``seq + 1`` tokens."""
        logits = self(idx[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
