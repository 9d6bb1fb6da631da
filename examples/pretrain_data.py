"""Data of examples/pretrain_gdn.py: the shipped corpus (a token is a byte) and batches.

No download: the corpus is ``examples/data/stdlib_docstrings.txt`` (see its README for origin and
licence) and a token is a byte (vocabulary 256). Batches are random windows of the corpus drawn
from a generator seeded with the run's seed, so the flag-on and flag-off runs of ``--compare``
see exactly the same tokens in the same order, on every rank.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator

import torch

CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "stdlib_docstrings.txt")
VOCAB_SIZE = 256  # bytes
HELD_OUT_FRACTION = 0.05


def load_corpus(path: str = CORPUS) -> tuple[torch.Tensor, torch.Tensor]:
    """The corpus as int64 token ids, split into (train, held-out): the last 5 % is held out."""
    with open(path, "rb") as f:
        data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).to(torch.int64)
    split = int(len(data) * (1.0 - HELD_OUT_FRACTION))
    return data[:split], data[split:]


@dataclass
class Batch:
    tokens: torch.Tensor  # [b, s] input ids
    labels: torch.Tensor  # [b, s] next-token ids
    loss_mask: torch.Tensor  # [b, s] float, ones (windows never cross the corpus end)
    position_ids: torch.Tensor  # [b, s]


def _windows(data: torch.Tensor, starts: torch.Tensor, seq_length: int) -> Batch:
    idx = starts[:, None] + torch.arange(seq_length + 1)[None, :]
    chunk = data[idx]
    tokens, labels = chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()
    position_ids = torch.arange(seq_length).expand_as(tokens).contiguous()
    return Batch(tokens, labels, torch.ones(tokens.shape, dtype=torch.float32), position_ids)


def train_batches(data: torch.Tensor, *, seq_length: int, micro_batch_size: int,
                  num_micro_batches: int, dp_rank: int, dp_size: int, seed: int,
                  device: torch.device) -> Iterator[list[Batch]]:
    """Yields, for every step, this data-parallel rank's micro-batches.

    Every step draws ``dp_size * num_micro_batches * micro_batch_size`` window starts from one
    CPU generator seeded with ``seed`` (the same sequence on every rank and in every run); this
    rank keeps its slice. Tensor-parallel ranks of one data-parallel rank get identical batches,
    as Megatron requires."""
    gen = torch.Generator().manual_seed(seed)
    per_step = dp_size * num_micro_batches * micro_batch_size
    high = len(data) - seq_length - 1
    while True:
        starts = torch.randint(0, high, (per_step,), generator=gen)
        starts = starts.view(dp_size, num_micro_batches, micro_batch_size)[dp_rank]
        yield [_to(_windows(data, s, seq_length), device) for s in starts]


def held_out_batches(data: torch.Tensor, *, seq_length: int, micro_batch_size: int,
                     num_batches: int, device: torch.device) -> list[Batch]:
    """Fixed, evenly spaced windows of the held-out split (same on every rank and run)."""
    high = len(data) - seq_length - 1
    n = num_batches * micro_batch_size
    starts = torch.linspace(0, high, n).to(torch.int64).view(num_batches, micro_batch_size)
    return [_to(_windows(data, s, seq_length), device) for s in starts]


def _to(batch: Batch, device: torch.device) -> Batch:
    return Batch(*(t.to(device, non_blocking=True) for t in
                   (batch.tokens, batch.labels, batch.loss_mask, batch.position_ids)))
