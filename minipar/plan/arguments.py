"""The planner's shared flags: any model from the command line, and sets of allowed values.

* A model is ``--model NAME`` (a preset), ``--model FILE.json`` (``shapes.load_model``), or
  the shape itself: ``--layers --hidden --heads --vocab --seq-len`` with ``--kv-heads``,
  ``--ffn-hidden``, ``--arch gpt|llama``, ``--tied/--untied``, ``--no-bias``,
  ``--no-dropout``. Given with ``--model``, a shape flag overrides the preset's field
  (``--model llama-7b --kv-heads 8``). ``params``, ``flops``, ``memory``, ``estimate`` and
  ``search`` all take them (``shape_from_args``).
* A search axis takes one value (``--tp 4``), a set (``--tp 1,2,4``) or a range
  (``--tp 1-8``: every value from 1 to 8 that the model allows); ``--zero 0,1`` and
  ``--recompute none,full`` likewise. An empty set is bad input (exit 2, one line).
"""
from __future__ import annotations

import argparse
from dataclasses import replace

from ..runtime.cli import positive_int as positive
from .errors import PlanError
from .shapes import ModelShape, model_preset

SHAPE_FLAGS = ("layers", "hidden", "heads", "kv_heads", "vocab", "seq_len", "ffn_hidden")
REQUIRED = ("layers", "hidden", "heads", "vocab", "seq_len")
# A bound, not a rule (an assumption): no search axis has more than a few thousand useful
# values (tp up to a node or the heads, pp up to the layers, micro-batches up to the batch
# per replica); a longer range is a typo, and listing it would only exhaust memory.
MAX_RANGE = 4096


def add_shape(p, model_help: str = "a preset (gpt-22b, gpt-175b, gpt-1t, llama-7b, "
              "llama3-8b, ...) or a model JSON file (the fields of ModelShape)") -> None:
    """The model flags (module docstring)."""
    p.add_argument("--model", help=model_help)
    p.add_argument("--layers", type=positive, help="transformer layers l")
    p.add_argument("--hidden", type=positive, help="hidden size h")
    p.add_argument("--heads", type=positive, help="attention heads a")
    p.add_argument("--kv-heads", type=positive,
                   help="key/value heads g of grouped-query attention (default: as many as "
                        "--heads); must divide --heads")
    p.add_argument("--vocab", type=positive, help="vocabulary size V")
    p.add_argument("--seq-len", type=positive, help="sequence length s")
    p.add_argument("--ffn-hidden", type=positive,
                   help="MLP width (default 4h; LLaMA: 2/3 of 4h rounded up to 256)")
    p.add_argument("--arch", choices=["gpt", "llama"], default=None,
                   help="layer design: gpt (GELU, LayerNorm, learned positions, biases) or "
                        "llama (SwiGLU, RMSNorm, rotary, no biases) (default: gpt, or the "
                        "preset's)")
    tie = p.add_mutually_exclusive_group()
    tie.add_argument("--tied", dest="tied", action="store_true", default=None,
                     help="the head shares the embedding's matrix (default for gpt)")
    tie.add_argument("--untied", "--untied-head", dest="tied", action="store_false",
                     help="the head has its own matrix (default for llama)")
    p.add_argument("--no-bias", action="store_true", help="GPT without biases")
    p.add_argument("--no-dropout", action="store_true",
                   help="GPT trained without dropout (no masks kept, as MPT)")


def shape_from_args(args, need_heads: bool = True) -> ModelShape:
    """A preset or model file (``--model``) with any shape flag overriding its field, or a
    shape from the flags alone (all of --layers --hidden --heads --vocab --seq-len;
    ``need_heads=False``: --heads may be left out, as ``params`` and ``flops`` need none)."""
    given = {k: getattr(args, k) for k in SHAPE_FLAGS if getattr(args, k, None) is not None}
    if args.model:
        shape = model_preset(args.model, given.pop("seq_len", None))   # same sequence count
    else:
        missing = [f"--{k.replace('_', '-')}" for k in REQUIRED
                   if k not in given and (need_heads or k != "heads")]
        if missing:
            raise PlanError(f"give --model NAME|FILE.json or all of --layers --hidden --heads "
                            f"--vocab --seq-len (missing {' '.join(missing)})")
        shape = ModelShape("custom", "gpt", given.pop("layers"), given.pop("hidden"),
                           given.pop("heads", 1), given.pop("vocab"), given.pop("seq_len"))
    arch = args.arch or shape.arch
    if arch != shape.arch:              # and that design's defaults (LLaMA: untied, no biases)
        given.update(arch=arch, tied_head=arch != "llama", bias=arch != "llama")
    if args.tied is not None:
        given["tied_head"] = args.tied
    if args.no_bias:
        given["bias"] = False
    if args.no_dropout:
        given["dropout"] = False
    return replace(shape, **given) if given else shape


def _values(text: str, flag: str, parse, ranges: bool = False) -> tuple:
    out = []                            # an empty set is search()'s to refuse (``allowed``)
    for item in (x.strip() for x in text.split(",") if x.strip()):
        if ranges and "-" in item:
            lo, hi = map(parse, item.split("-", 1))
            if lo > hi:
                raise argparse.ArgumentTypeError(f"{flag} range {item} is empty (low > high)")
            if len(out) + hi - lo + 1 > MAX_RANGE:
                raise argparse.ArgumentTypeError(
                    f"{flag} {text} has more than the {MAX_RANGE:,} values a search axis "
                    f"takes (range {item}: {hi - lo + 1:,}); give a shorter range or a set")
            out += range(lo, hi + 1)
        else:
            out.append(parse(item))
    values = tuple(sorted(set(out)))
    single = values and "," not in text and "-" not in text        # "4": 4, not (4,)
    return values[0] if single else values


def int_set(flag: str, low: int = 1, high: int | None = None):
    """A ``type=`` for a search axis: one int (kept an int), or a set/range as a tuple."""
    def parse(text: str):
        def one(x):
            try:
                v = int(x)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"{flag} takes whole numbers, sets (1,2,4) or ranges (1-8), got {text!r}"
                ) from None
            if v < low or (high is not None and v > high):
                bound = f">= {low}" if high is None else f"from {low} to {high}"
                raise argparse.ArgumentTypeError(f"{flag} values must be {bound}, got {v}")
            return v
        return _values(text, flag, one, ranges=True)
    return parse


def mode_set(text: str):
    """``--recompute`` for the search: one mode or a set of them (``search`` checks each)."""
    return _values(text, "--recompute", str)
