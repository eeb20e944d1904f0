"""Text from a trained model: ``python -m minipar.sample --resume DIR --prompt "def "``.

Loads the parameters of a checkpoint that any layout saved (``minipar.checkpoint``) into the
serial GPT, in this one process (CPU by default, ``--device cuda`` on a GPU), and continues the
prompt one byte at a time: the logits of the last position, divided by the temperature,
cut to the ``top-k`` likeliest, sampled. Temperature 0 takes the likeliest byte every time.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from . import checkpoint
from ..runtime import cli
from ..data import ByteTokenizer
from ..runtime.errors import UsageError
from ..model import GPT


def logits(model: GPT, idx: torch.Tensor) -> torch.Tensor:
    """(b s) -> (b s V): the model's parts without the loss."""
    x = model.embed(idx)
    for block in model.blocks:
        x = block(x)
    return model.head.proj(model.head.ln(x))


@torch.no_grad()
def generate(model: GPT, prompt: torch.Tensor, tokens: int, temperature: float = 0.8,
             top_k: int = 0, generator: torch.Generator | None = None) -> torch.Tensor:
    """``prompt`` (s,) continued by ``tokens`` sampled tokens; the context is the last seq_len."""
    idx = prompt.view(1, -1)
    for _ in range(tokens):
        last = logits(model, idx[:, -model.cfg.seq_len:])[0, -1].float()
        if temperature == 0:
            nxt = last.argmax().view(1)
        else:
            last = last / temperature
            if top_k:
                kth = torch.topk(last, min(top_k, last.numel())).values[-1]
                last = last.masked_fill(last < kth, float("-inf"))
            probs = F.softmax(last, dim=-1)
            nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(idx.device)
        idx = torch.cat([idx, nxt.view(1, 1)], dim=1)
    return idx[0]


def parser():
    p = cli.ArgumentParser(prog="python -m minipar.sample",
                            description="Generate text from a minipar checkpoint (serially).")
    p.add_argument("--resume", required=True, metavar="DIR",
                   help="a checkpoint, or a --save folder (its newest checkpoint)")
    p.add_argument("--prompt", default="\n", help="the text to continue")
    p.add_argument("--tokens", type=int, default=200, help="bytes to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="0: always the likeliest")
    p.add_argument("--top-k", type=int, default=0, help="sample among the K likeliest (0: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu, or cuda (when torch sees a GPU)")
    return p


def run(argv) -> str:
    a = parser().parse_args(argv)
    if a.tokens < 1:
        raise UsageError(f"--tokens must be >= 1, got {a.tokens}")
    if not (a.temperature >= 0 and a.temperature < float("inf")):
        raise UsageError(f"--temperature must be a finite number >= 0, got {a.temperature}")
    if a.top_k < 0:
        raise UsageError(f"--top-k must be >= 0, got {a.top_k}")
    if not a.prompt:
        raise UsageError("--prompt is empty; give at least one character")
    try:
        device = torch.device(a.device)
    except RuntimeError:
        raise UsageError(f"--device {a.device!r} is no device; use cpu or cuda") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {a.device!r}: minipar samples on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but torch sees no GPU; use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UsageError(f"--device {a.device}: torch sees {torch.cuda.device_count()} GPU(s)")
    path = checkpoint.find(a.resume)
    cfg, state = checkpoint.load_serial(path, device)
    with torch.device(device):
        model = GPT(cfg)
    model.load_state_dict(state)
    model.eval()
    tok = ByteTokenizer()
    prompt = tok.encode(a.prompt).to(device)
    gen = torch.Generator().manual_seed(a.seed)
    out = generate(model, prompt, a.tokens, a.temperature, a.top_k, gen)
    text = tok.decode(out.tolist())
    print(text)
    return text


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    cli.main_guard(run, argv)


if __name__ == "__main__":
    main()
