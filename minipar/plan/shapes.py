"""Model shapes: parameter counts and training FLOPs.

Notation (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", SC'21): l layers, h hidden size, a attention heads, V vocabulary,
s sequence length, B global batch in sequences, F the MLP's hidden size; and g key/value
heads (grouped-query attention, Ainslie et al. 2023: g = a is multi-head attention, g = 1
multi-query), so K and V are h_kv = g h / a wide.

Parameters
----------
GPT (Megatron's closed form, section 5.1 of the paper), learned positions, tied head, biases:

    P = 12 l h^2 (1 + 13/(12 h) + (V + s)/(12 l h))  =  12 l h^2 + 13 l h + (V + s) h

One layer is 12 h^2 + 13 h: attention 4h^2 + 4h (QKV and output projection with biases),
MLP 8h^2 + 5h (F = 4h with biases), two LayerNorms 4h. ``gpt_params`` counts the same
pieces for any F, an untied head and the final LayerNorm (2h, which the closed form leaves
out), so it also reproduces ``minipar.model`` exactly.

LLaMA (Touvron et al. 2023): SwiGLU MLP with three F x h matrices, RMSNorm (h weights, no
bias), no biases anywhere, rotary positions (no position table), untied head:

    P = l (4 h^2 + 3 h F + 2 h) + 2 V h + h,     F default: 2/3 * 4h rounded up to 256

With grouped-query attention the K and V projections are h x h_kv, so the attention's
4 h^2 becomes 2 h^2 + 2 h h_kv (and its biases 2h + 2 h_kv) in every count below, FLOPs
included. Any shape can be given as a JSON file (``load_model``: the fields of
``ModelShape``; name, arch, layers, hidden, heads, vocab and seq_len required).

The planner's presets (``PRESETS``) live in ``presets.json`` beside this module: one such
object per model, keyed by its name, with a ``source``. Their ``global_batch_tokens`` is the
batch the family trained with: 3,145,728 for the GPT shapes, GPT-3 175B's 1,536 sequences of
2,048 tokens (Brown et al. 2020, Table 2.1); 4,194,304 for LLaMA, 2,048 x 2,048 (Touvron et
al. 2023, Table 2), and for Llama 3, 512 x 8,192 (Dubey et al. 2024).

Training FLOPs per iteration
----------------------------
Megatron-LM (Narayanan et al. 2021, section 5.1), counting matmuls only, with full activation
recomputation (one extra forward pass):

    F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h))

and 72 B s l h^2 (...) without recomputation (forward 1x, backward 2x). Megatron-DeepSpeed's
throughput log uses the same bracket for both (24 * factor * ... with factor 4 or 3); that is
``megatron_flops``. Counted exactly, the logits (2BshV forward) are never recomputed, so the
no-recomputation bracket is V/(12 l h); ``training_flops`` sums the pieces exactly:

    forward per layer   2 B s (2h^2 + 2h h_kv + 2hF)   [GPT]   (3hF: LLaMA's SwiGLU)
                      + 4 B s^2 h            (Q K^T and attention x V, no causal saving)
    logits              2 B s h V
    training            3 x forward  (+ 1 x the layers' forward with full recomputation,
                                      + 1 x the attention core with selective recomputation,
                                        Korthikanti et al. 2022)
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace
from pathlib import Path

from .errors import PlanError

RECOMPUTE_MODES = ("none", "selective", "full")


def llama_ffn(hidden: int, multiple_of: int = 256) -> int:
    """LLaMA's MLP width: int(2/3 * 4h) rounded up to a multiple of 256 (4096 -> 11008)."""
    return multiple_of * math.ceil(int(2 * 4 * hidden / 3) / multiple_of)


@dataclass(frozen=True)
class ModelShape:
    """A transformer's shape, enough to count parameters, FLOPs, memory and traffic."""

    name: str
    arch: str                  # "gpt" (GELU MLP, LayerNorm, learned positions) or "llama"
    layers: int
    hidden: int
    heads: int
    vocab: int
    seq_len: int
    ffn_hidden: int = 0        # 0: the architecture's default (4h for GPT, llama_ffn for LLaMA)
    tied_head: bool = True     # GPT-3/Megatron tie the head to the embedding; LLaMA, minipar do not
    bias: bool = True          # GPT: biases in every Linear and LayerNorm; LLaMA: none
    global_batch_tokens: int = 0   # the preset's usual batch (search's default), 0: unknown
    kv_heads: int = 0          # key/value heads (grouped-query attention); 0: as many as heads
    dropout: bool = True       # GPT: dropout after attention and MLP (masks kept); LLaMA: none

    def __post_init__(self):
        optional = ("ffn_hidden", "kv_heads", "global_batch_tokens")    # 0: the default
        for what in ("layers", "hidden", "heads", "vocab", "seq_len", *optional):
            value, low = getattr(self, what), int(what not in optional)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise PlanError(f"model {self.name}: {what} must be a whole number >= {low}"
                                f"{' (0: the default)' if low == 0 else ''}, got {value!r}")
        if self.hidden % self.heads:
            raise PlanError(f"model {self.name}: {self.heads} heads do not divide the hidden "
                            f"size {self.hidden}; choose heads that divide it")
        if self.heads % self.groups:
            raise PlanError(f"model {self.name}: {self.groups} key/value heads do not divide "
                            f"the {self.heads} attention heads; use a divisor of {self.heads}")
        if self.arch not in ("gpt", "llama"):
            raise PlanError(f"model {self.name}: arch must be gpt or llama, got {self.arch!r}")

    @property
    def has_dropout(self) -> bool:
        """Dropout layers (and their 1-byte masks) in every layer: GPT unless turned off
        (MPT, for one, trains without); never LLaMA."""
        return self.dropout and self.arch == "gpt"

    @property
    def groups(self) -> int:
        """Key/value heads g (query groups): ``kv_heads``, or every head (multi-head)."""
        return self.kv_heads or self.heads

    @property
    def kv_hidden(self) -> int:
        """Width of K (and of V): g heads of h / a."""
        return self.groups * (self.hidden // self.heads)

    @property
    def attention_params(self) -> int:
        """Q, K, V and output projections' weights: 2 h^2 + 2 h h_kv (4 h^2 when g = a)."""
        return 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_hidden

    @property
    def ffn(self) -> int:
        return self.ffn_hidden or (4 * self.hidden if self.arch == "gpt"
                                   else llama_ffn(self.hidden))

    @property
    def mlp_weights(self) -> int:
        """The MLP's weight matrices: 2 h F (GPT's fc1, fc2), 3 h F (LLaMA's gate, up, down)."""
        return (3 if self.arch == "llama" else 2) * self.hidden * self.ffn

    @property
    def mlp_params(self) -> int:
        """The MLP's parameters: its weights, and with GPT's biases F + h more."""
        biases = self.ffn + self.hidden if self.arch == "gpt" and self.bias else 0
        return self.mlp_weights + biases

    @property
    def norm_params(self) -> int:
        """One norm's parameters: GPT's LayerNorm a weight and a bias (2h), LLaMA's RMSNorm (or
        a LayerNorm without biases) a weight (h)."""
        return 2 * self.hidden if self.arch == "gpt" and self.bias else self.hidden

    @property
    def layer_params(self) -> int:
        """Parameters of one transformer layer: the attention (with GPT's biases, 2h + 2 h_kv
        more), the MLP and two norms."""
        biases = 2 * self.hidden + 2 * self.kv_hidden if self.arch == "gpt" and self.bias else 0
        return self.attention_params + biases + self.mlp_params + 2 * self.norm_params

    @property
    def embedding_params(self) -> int:
        """Token table (+ learned positions for GPT): the first pipeline stage holds these."""
        return self.vocab * self.hidden + (self.seq_len * self.hidden if self.arch == "gpt" else 0)

    @property
    def head_params(self) -> int:
        """Final norm (+ the untied output projection): the last pipeline stage holds these."""
        return self.norm_params + (0 if self.tied_head else self.vocab * self.hidden)

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params + self.head_params


def megatron_params(layers: int, hidden: int, vocab: int, seq_len: int) -> int:
    """Megatron's closed form (module docstring), as the integer it expands to."""
    l, h = layers, hidden
    return 12 * l * h * h + 13 * l * h + (vocab + seq_len) * h


def gpt_params(layers: int, hidden: int, vocab: int, seq_len: int, ffn_hidden: int = 0,
               tied_head: bool = True, bias: bool = True) -> int:
    """Exact GPT count: ``megatron_params`` plus the final LayerNorm (2h) for F = 4h, tied."""
    return ModelShape("gpt", "gpt", layers, hidden, 1, vocab, seq_len, ffn_hidden,
                      tied_head, bias).params


def llama_params(layers: int, hidden: int, vocab: int, ffn_hidden: int = 0) -> int:
    """LLaMA: l (4h^2 + 3hF + 2h) + 2Vh + h (SwiGLU, RMSNorm, no biases, untied head)."""
    return ModelShape("llama", "llama", layers, hidden, 1, vocab, 0, ffn_hidden,
                      tied_head=False, bias=False).params


# --------------------------------------------------------------------------------------
# FLOPs
# --------------------------------------------------------------------------------------
def megatron_flops(batch: int, seq_len: int, layers: int, hidden: int, vocab: int,
                   recompute: bool = True) -> float:
    """Megatron-LM's 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) (module docstring); with
    ``recompute=False`` 72 B s l h^2 (same bracket), as Megatron-DeepSpeed reports TFLOP/s (and
    so, we take it, the Frontier study's percent of peak)."""
    b, s, l, h, v = batch, seq_len, layers, hidden, vocab
    return 24 * (4 if recompute else 3) * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))


def forward_flops(shape: ModelShape, batch: int, seq_len: int | None = None) -> dict:
    """Forward matmul FLOPs of ``batch`` sequences: per layer (dense + attention core), logits."""
    s, h = seq_len or shape.seq_len, shape.hidden
    return {"dense": 2 * batch * s * (shape.attention_params + shape.mlp_weights),  # QKV, out, MLP
            "attention": 4 * batch * s * s * h,          # Q K^T and scores x V
            "logits": 2 * batch * s * h * shape.vocab}


def training_flops(shape: ModelShape, batch: int, recompute: str = "none",
                   seq_len: int | None = None) -> float:
    """Matmul FLOPs of one training iteration on ``batch`` sequences, counted exactly.

    ``recompute="none"`` is the *model* FLOPs that MFU divides by (Chowdhery et al. 2022);
    the other modes add what the hardware recomputes (hardware FLOPs, HFU)."""
    return stage_flops(shape, batch, 1, recompute, seq_len)


def stage_flops(shape: ModelShape, batch: int, pp: int = 1, recompute: str = "none",
                seq_len: int | None = None) -> float:
    """Hardware FLOPs of the heaviest of ``pp`` pipeline stages on ``batch`` sequences.

    The last stage: its ceil(l/pp) layers and the logits (the first stage's extra work, the
    embedding, is a table lookup, no matmul). A pipeline runs at its slowest stage's pace,
    so this, not training_flops / pp, sets a stage's compute time. ``pp=1``: training_flops."""
    if recompute not in RECOMPUTE_MODES:
        raise PlanError(f"unknown recomputation {recompute!r}; "
                        f"use one of {', '.join(RECOMPUTE_MODES)}")
    layers = -(-shape.layers // pp)
    f = forward_flops(shape, batch, seq_len)
    per_layer = f["dense"] + f["attention"]
    # what recomputation runs again: the layers' forward (full), the attention core (selective)
    again = {"none": 0, "selective": f["attention"], "full": per_layer}[recompute]
    return float(3 * (layers * per_layer + f["logits"]) + layers * again)


# --------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------
PRESETS_DATA = Path(__file__).resolve().parent / "presets.json"


def _presets() -> dict[str, ModelShape]:
    """The shapes of ``presets.json``, in its order (``model_from_dict``; "source" says
    where each comes from)."""
    return {name: model_from_dict({"name": name, **{k: v for k, v in entry.items()
                                                    if k != "source"}}, where=name)
            for name, entry in json.loads(PRESETS_DATA.read_text()).items()}


def trainer_presets() -> dict[str, ModelShape]:
    """``minipar.model``'s presets (tiny, nano, ...) as shapes.

    Imported lazily: ``minipar.model`` imports torch, and the planner should not need it.
    The trainer's GPT has an untied head and no dropout (its masks would cost memory the
    trainer never allocates); its default global batch is 16 sequences."""
    from minipar.model import PRESETS as MODEL_PRESETS
    return {name: ModelShape(name, "gpt", c.n_layer, c.d_model, c.n_head, c.vocab_size,
                             c.seq_len, c.ffn, tied_head=False, bias=c.bias,
                             global_batch_tokens=16 * c.seq_len, dropout=c.dropout > 0)
            for name, c in MODEL_PRESETS.items()}


def model_preset(name: str, seq_len: int | None = None) -> ModelShape:
    """A shape by preset name (planner presets first, then the trainer's), or from a JSON
    file (a name ending in .json: ``load_model``)."""
    shape = load_model(name) if str(name).endswith(".json") else PRESETS.get(name)
    if shape is None:
        try:
            shape = trainer_presets().get(name)
            known = [*PRESETS, *trainer_presets()]
        except ImportError:
            known = list(PRESETS)
        if shape is None:
            raise PlanError(f"unknown model {name!r}; use one of: {', '.join(known)}")
    return with_seq_len(shape, seq_len) if seq_len else shape


REQUIRED_FIELDS = ("arch", "layers", "hidden", "heads", "vocab", "seq_len")


def model_from_dict(data: dict, where: str = "model") -> ModelShape:
    """A ``ModelShape`` from a dict of its fields (a model file's contents): the required
    ones present, no unknown ones, every value of its field's kind; else one PlanError."""
    if not isinstance(data, dict):
        raise PlanError(f"{where} must hold a JSON object with the fields "
                        f"{', '.join(REQUIRED_FIELDS)}")
    known = [f.name for f in fields(ModelShape)]
    missing = [k for k in REQUIRED_FIELDS if k not in data]
    if missing:
        raise PlanError(f"{where} lacks {', '.join(missing)}; a model file needs "
                        f"{', '.join(REQUIRED_FIELDS)} (optional: kv_heads, ffn_hidden, "
                        f"tied_head, bias, dropout, global_batch_tokens, name)")
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise PlanError(f"{where} has unknown field(s) {', '.join(unknown)}; known fields: "
                        f"{', '.join(known)}")
    for key in ("tied_head", "bias", "dropout"):
        if key in data and not isinstance(data[key], bool):
            raise PlanError(f"{where}: {key} must be true or false, got {data[key]!r}")
    defaults = {"name": Path(where).stem if where != "model" else "custom"}
    if data["arch"] == "llama":          # LLaMA's defaults: untied head, no biases
        defaults.update(tied_head=False, bias=False)
    return ModelShape(**{**defaults, **data})


def load_model(path: str | Path) -> ModelShape:
    """A model shape from a JSON file (``model_from_dict``)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise PlanError(f"cannot read model file {path}: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PlanError(f"model file {path} is not valid JSON: {e}") from None
    return model_from_dict(data, where=str(path))


def with_seq_len(shape: ModelShape, seq_len: int) -> ModelShape:
    """The same model on sequences of ``seq_len`` tokens; the default batch keeps its
    number of sequences."""
    sequences = shape.global_batch_tokens // shape.seq_len
    return replace(shape, seq_len=seq_len, global_batch_tokens=sequences * seq_len)


PRESETS: dict[str, ModelShape] = _presets()   # here: model_from_dict builds them
