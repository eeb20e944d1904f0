"""Text, a byte-level tokenizer, and deterministic global batches.

The default corpus needs no network: it is the source of a few modules of Python's own
standard library, which is on every machine that runs minipar. ``--data FILE`` trains on any
text file; ``download_tiny_shakespeare()`` is an optional helper that the tests never use.

Determinism is what lets every layout be compared with the serial run: step k's global batch
(B sequences of L tokens) depends only on (seed, k), and a data-parallel rank takes a
contiguous slice of it, so the union over ranks is always the same global batch. Training
batches come from the first 90% of the corpus; the last 10% is held out for evaluation
(``split``), and each evaluation reads the same held-out batches.
"""
from __future__ import annotations

import importlib.util
import os
import urllib.request

import torch
from einops import rearrange

# Modules of the standard library, as plain text; chosen for size and prose-rich docstrings.
DEFAULT_MODULES = ("argparse", "textwrap", "difflib", "pprint", "dataclasses", "calendar",
                   "fractions", "statistics", "heapq", "bisect")

TINY_SHAKESPEARE_URL = ("https://raw.githubusercontent.com/karpathy/char-rnn/master/"
                        "data/tinyshakespeare/input.txt")


class ByteTokenizer:
    """UTF-8 bytes as tokens: vocabulary 256, no training, lossless."""

    vocab_size = 256

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)

    def decode(self, ids) -> str:
        """The text of the complete UTF-8 characters only: a sampled byte sequence can stop
        inside a multi-byte character, or the model can emit a byte that starts none; those
        bytes are left out rather than shown as U+FFFD."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="ignore")


def default_corpus() -> str:
    parts = []
    for name in DEFAULT_MODULES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.origin and os.path.exists(spec.origin):
            with open(spec.origin, encoding="utf-8") as f:
                parts.append(f.read())
    return "\n".join(parts)


def load_text(path: str | None = None) -> str:
    """The corpus: ``path`` if given, else the built-in one."""
    if path is None:
        return default_corpus()
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def download_tiny_shakespeare(dest: str = "data/tinyshakespeare.txt") -> str:
    """Optional: fetch tiny-shakespeare (1.1 MB) for ``--data``. Needs network access."""
    if not os.path.exists(dest):
        os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
        urllib.request.urlretrieve(TINY_SHAKESPEARE_URL, dest)
    return dest


class Batches:
    """Step k's global batch: B random windows of L+1 tokens, chosen by (seed, k) alone."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, global_batch: int, seed: int = 0):
        if tokens.numel() < seq_len + 2:
            raise ValueError(f"corpus has {tokens.numel()} tokens; need more than seq_len + 1")
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, seed

    def global_batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y), each (B, L): inputs and next-token targets of step ``step``."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1, (self.global_batch,),
                               generator=g)
        windows = torch.stack([self.tokens[s:s + self.seq_len + 1] for s in starts.tolist()])
        return windows[:, :-1], windows[:, 1:]

    def local_batch(self, step: int, dp_rank: int = 0, dp: int = 1):
        """This data-parallel rank's contiguous slice of step ``step``'s global batch."""
        x, y = self.global_batch_at(step)
        per_rank = self.global_batch // dp
        sl = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        return x[sl], y[sl]


HELD_OUT = 0.1   # the last tenth of the corpus: the validation split


def split(tokens: torch.Tensor, held_out: float = HELD_OUT) -> tuple[torch.Tensor, torch.Tensor]:
    """(training, validation): the last ``held_out`` of the tokens is never trained on."""
    n_val = int(tokens.numel() * held_out)
    return tokens[:tokens.numel() - n_val], tokens[tokens.numel() - n_val:]


def microbatches(x: torch.Tensor, y: torch.Tensor, m: int):
    """Split a (B, L) batch into m micro-batches of B/m sequences: [(x_i, y_i), ...]."""
    xs = rearrange(x, "(m b) s -> m b s", m=m)
    ys = rearrange(y, "(m b) s -> m b s", m=m)
    return list(zip(xs, ys))
