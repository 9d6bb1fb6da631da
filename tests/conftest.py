"""Without a GPU, every Triton kernel runs through the interpreter: set it before triton loads."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
