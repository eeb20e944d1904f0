"""Checkpoints in PyTorch's distributed format (DCP), under the serial model's names.

    python -m minipar.checkpoint info DIR           # the manifest: step, layout, model, versions
    python -m minipar.checkpoint export DIR OUT.pt [--force]  # one plain state_dict (serial names)

What a checkpoint is. ``torch.distributed.checkpoint`` (DCP) writes one file per rank, each
holding that rank's part, and a ``.metadata`` file saying which box of which tensor lies
where. Our keys are what PyTorch's own ``get_state_dict(model, optimizer)`` gives for the
*serial* GPT and AdamW, flattened as DCP flattens them::

    model.<name>                         parameters, full serial shapes (under bf16/fp16: the
                                         fp32 masters, so any dtype resumes from any other)
    optim.state.<name>.exp_avg / .exp_avg_sq / .step
    optim.param_groups.0.*               lr, betas, eps, ... and the parameter names
    trainer.rng                          rank 0's CPU random state

so a checkpoint saved by any layout loads into any other, and into a plain serial model with
``dcp.load`` + ``set_state_dict`` (the tests do that). Each rank contributes the boxes it owns
(``minipar.train.pieces``): a TP slice is one box per split group, a ZeRO rank's OS shard is a few
row-boxes of each parameter it touches, replicas write nothing twice. Loading is resharding:
DCP reads, for every box a rank asks for, the overlapping parts of the saved boxes.

Beside the DCP files, ``manifest.json`` (readable: step, layout, model config, schedule, data
position, versions) and ``COMPLETE``. A save goes to ``DIR/.step-000010.tmp``; once every
rank has written, rank 0 writes the manifest, then the ``COMPLETE`` marker, then renames the
folder to ``DIR/step-000010`` (atomic). A save killed at any point leaves no folder that
``--resume`` takes as complete. ``--keep N`` then removes all but the newest N.

The data position is the step: step k's batch is a function of (seed, k) (``minipar.data``),
and so is the learning rate (``minipar.train.optim``), so a resumed run continues both exactly.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import warnings

import torch

from .. import __version__, comm
from ..runtime import cli, dist
from ..runtime.errors import UsageError
from ..model import GPT, GPTConfig
from .pieces import pieces

FORMAT = "minipar-dcp-1"
MANIFEST, COMPLETE = "manifest.json", "COMPLETE"
ADAM = ("exp_avg", "exp_avg_sq")
_STEP_DIR = re.compile(r"^step-(\d+)$")


# --------------------------------------------------------------------------------------
# A rank's boxes of one serial tensor, as DCP sees a DTensor's local shard
# --------------------------------------------------------------------------------------
class SerialPart(torch.Tensor):
    """This rank's boxes of one serial tensor, as DCP sees it: a tensor of the full serial
    shape that holds no data itself, only ``boxes``, a list of (offsets, view of our state).

    DCP saves a DTensor through three methods it calls on any tensor (the protocol DTensor
    implements: write items, chunk list, shard lookup). A DTensor can only describe even
    splits along whole dimensions; a rank's part here is irregular (qkv's three head groups,
    a ZeRO range that starts mid-row), so it answers the same three questions itself.
    """

    @staticmethod
    def __new__(cls, shape, boxes: list[tuple[tuple[int, ...], torch.Tensor]]):
        like = boxes[0][1]
        part = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=like.dtype,
                                                   device=like.device)
        part.boxes = boxes
        return part

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"a SerialPart only describes a checkpoint's boxes; {func} is not defined")

    def __repr__(self):
        return f"SerialPart({tuple(self.shape)}, {len(self.boxes)} boxes)"

    # DCP calls these three, so it is imported by then (``_dcp_call`` says why not before)
    def __create_write_items__(self, fqn: str, obj) -> list:
        from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                           TensorProperties)
        from torch.distributed.checkpoint.planner import (TensorWriteData, WriteItem,
                                                          WriteItemType)
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(o)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(torch.Size(o), t.size()),
                              properties=TensorProperties.create_from_tensor(t),
                              size=self.shape))
                for o, t in self.boxes]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        return [ChunkStorageMetadata(torch.Size(o), t.size()) for o, t in self.boxes]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        for o, t in self.boxes:
            if torch.Size(o) == index.offset:
                return t
        raise ValueError(f"{index.fqn}: no box at {index.offset} on this rank")


# --------------------------------------------------------------------------------------
# The state dict of one rank
# --------------------------------------------------------------------------------------
def serial_shapes(model_cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """The serial model's parameter names and shapes, without allocating it."""
    with torch.device("meta"):
        return {n: tuple(p.shape) for n, p in GPT(model_cfg).named_parameters()}


def ensure_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Adam creates its state at the first step; a checkpoint needs it before (to load into).

    The step counter lives where Adam itself would put it: on the parameter's device for the
    fused and capturable kernels (they read it there: a CPU counter beside CUDA parameters
    fails the first fused step after ``--resume``), a CPU scalar otherwise.
    """
    for group in optimizer.param_groups:
        on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            if not optimizer.state.get(p):
                optimizer.state[p] = {
                    "step": torch.zeros((), dtype=torch.float32,
                                        device=p.device if on_device else "cpu"),
                    "exp_avg": torch.zeros_like(p.detach()),
                    "exp_avg_sq": torch.zeros_like(p.detach())}


def _adam_step(optimizer) -> torch.Tensor:
    return next(iter(optimizer.state.values()))["step"]


def rank_state_dict(mesh, runner, engine, owned_only: bool) -> dict:
    """{DCP key: SerialPart | tensor} for what this rank holds (saving: only what it owns)."""
    ensure_adam_state(engine.optimizer)
    boxes: dict[str, tuple[tuple, list]] = {}
    step = _adam_step(engine.optimizer)
    out = {}
    for pc in pieces(mesh, runner, engine):
        if owned_only and not pc.owner:
            continue
        for kind, key in [("param", f"model.{pc.name}")] + [
                (k, f"optim.state.{pc.name}.{k}") for k in ADAM]:
            boxes.setdefault(key, (pc.shape, []))[1].append((pc.offsets, pc.views[kind]))
        # one scalar per parameter: written by the owner of its first element
        if not owned_only or not any(pc.offsets):
            out[f"optim.state.{pc.name}.step"] = step if owned_only else step.clone()
    out.update({k: SerialPart(shape, b) for k, (shape, b) in boxes.items()})
    return out


# --------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------
def step_of(folder: str) -> int:
    """The step of a ``step-NNNNNN`` folder."""
    return int(_STEP_DIR.match(os.path.basename(folder)).group(1))


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:06d}")


def manifest_for(cfg, step: int, tokens: int, loss_scaler=None) -> dict:
    """What ``manifest.json`` says; with fp16's loss scaler, its state (the same on every rank)."""
    return {
        "format": FORMAT, "step": step,
        "layout": {"world": cfg.world, "dp": cfg.dp, "tp": cfg.tp, "pp": cfg.pp, "cp": cfg.cp,
                   "sp": cfg.sp,
                   "zero": cfg.zero, "shard": cfg.shard, "spec": cfg.spec,
                   "schedule": cfg.schedule, "microbatches": cfg.microbatches},
        "model": {"preset": cfg.model, "config": cfg.model_cfg.to_dict()},
        "training": {"steps": cfg.steps, "batch_size": cfg.batch_size, "seed": cfg.seed,
                     "lr": cfg.lr, "lr_schedule": cfg.lr_schedule, "warmup": cfg.warmup,
                     "min_lr": cfg.min_lr, "weight_decay": cfg.weight_decay,
                     "clip_grad": cfg.clip_grad, "dtype": cfg.dtype},
        "data": {"source": cfg.data or "built-in corpus", "tokens": tokens,
                 "held_out": "the last 10% of the tokens", "next_step": step + 1},
        "versions": {"minipar": __version__, "torch": torch.__version__},
        **({"loss_scaler": loss_scaler.state_dict()} if loss_scaler is not None else {}),
    }


def _fsync_write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def save(root: str, step: int, manifest: dict, mesh, runner, engine, keep: int = 0) -> str:
    """Every rank writes its part of step ``step`` under ``root``; returns the folder."""
    final, tmp = step_dir(root, step), os.path.join(root, f".step-{step:06d}.tmp")
    if mesh.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()
    state = rank_state_dict(mesh, runner, engine, owned_only=True)
    if mesh.rank == 0:
        group = dict(engine.optimizer.param_groups[0])
        group["params"] = list(serial_shapes(model_config_of(manifest)))
        state["optim.param_groups"] = [group]
        state["trainer.rng"] = torch.get_rng_state()
    with _dcp_call() as dcp:
        dcp.save(state, checkpoint_id=tmp, planner=dcp.DefaultSavePlanner())
    if mesh.rank == 0:
        _fsync_write(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=2) + "\n")
        _fsync_write(os.path.join(tmp, COMPLETE), f"step {step}\n")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        if keep:
            for old in complete_checkpoints(root)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


@contextlib.contextmanager
def _dcp_call():
    """DCP itself, for one call. It is imported here, not at the top: it pulls in DTensor, about
    a second of start-up that a rank which never saves or loads need not pay. Its calls are
    bookkeeping (untracked); without a process group DCP warns that it runs in one process,
    which is what we mean."""
    import torch.distributed.checkpoint as dcp
    with comm.untracked(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield dcp


def _barrier():
    if torch.distributed.is_initialized():
        with comm.untracked():
            comm.barrier(comm.WORLD)


# --------------------------------------------------------------------------------------
# Finding, checking and loading
# --------------------------------------------------------------------------------------
def is_complete(path: str) -> bool:
    return (os.path.isfile(os.path.join(path, COMPLETE))
            and os.path.isfile(os.path.join(path, MANIFEST))
            and os.path.isfile(os.path.join(path, ".metadata")))


def complete_checkpoints(root: str) -> list[str]:
    """The complete checkpoints under ``root``, oldest first."""
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m and is_complete(os.path.join(root, name)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return [p for _, p in sorted(found)]


def find(path: str, what: str = "--resume") -> str:
    """``path`` itself if it is a complete checkpoint, else the newest complete one in it."""
    if not os.path.isdir(path):
        raise UsageError(f"{what} {path}: no such folder")
    if is_complete(path):
        return path
    if os.path.isfile(os.path.join(path, MANIFEST)):
        raise UsageError(f"{what} {path}: an incomplete checkpoint (no {COMPLETE} marker: its "
                         f"save was interrupted); resume from an older one")
    found = complete_checkpoints(path)
    if not found:
        raise UsageError(f"{what} {path}: no complete checkpoint in it (a save that was "
                         f"interrupted leaves none); give a folder written by --save")
    return found[-1]


def read_manifest(path: str) -> dict:
    def damaged(e):
        return UsageError(f"checkpoint {path}: {MANIFEST} is damaged ({type(e).__name__}: {e}); "
                          f"resume from another checkpoint")
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise damaged(e) from None
    written = manifest.get("format") if isinstance(manifest, dict) else None
    if written != FORMAT:
        raise UsageError(f"checkpoint {path}: format {written!r} is not {FORMAT!r}; it was not "
                         f"written by this minipar")
    try:   # everything a reader takes from it, checked once here
        model_config_of(manifest)
        if type(manifest["step"]) is not int:          # not 10.7, True or "12"
            raise ValueError(f"step {manifest['step']!r} is not a whole number")
        manifest["layout"], manifest["training"]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise damaged(e) from None
    return manifest


def model_config_of(manifest: dict) -> GPTConfig:
    return GPTConfig(**manifest["model"]["config"])


def check(path: str, model_cfg: GPTConfig | None = None) -> dict:
    """Everything that can be checked before training: the manifest, the DCP metadata, every
    data file present and long enough, and (given ``model_cfg``) the same model shapes.
    Returns the manifest; raises UsageError with one line."""
    manifest = read_manifest(path)
    with _dcp_call() as dcp:               # imported outside the try: only the file is judged
        try:
            meta = dcp.FileSystemReader(path).read_metadata()
        except Exception as e:  # noqa: BLE001  a torn or foreign file can fail in many ways
            raise UsageError(f"checkpoint {path}: its DCP metadata is damaged "
                             f"({type(e).__name__}); resume from another checkpoint") from None
    ends: dict[str, int] = {}
    for info in (meta.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for rel, end in ends.items():
        file = os.path.join(path, rel)
        if not os.path.isfile(file) or os.path.getsize(file) < end:
            raise UsageError(f"checkpoint {path}: data file {rel} is missing or truncated; "
                             f"resume from another checkpoint")
    saved = model_config_of(manifest)
    if model_cfg is not None:
        want = serial_shapes(model_cfg)
        if saved != model_cfg:
            diff = ", ".join(f"{k} {getattr(saved, k)} here {getattr(model_cfg, k)}"
                             for k in model_cfg.to_dict() if getattr(saved, k) != getattr(model_cfg, k))
            raise UsageError(f"checkpoint {path} holds another model ({diff}); use the "
                             f"checkpoint's --model {manifest['model']['preset']} and --seq-len "
                             f"{saved.seq_len}")
        for name, shape in want.items():
            md = meta.state_dict_metadata.get(f"model.{name}")
            if md is None or tuple(getattr(md, "size", ())) != shape:
                raise UsageError(f"checkpoint {path}: model.{name} is missing or has another "
                                 f"shape than {shape}; it does not fit this model")
    return manifest


def load(path: str, mesh, runner, engine) -> dict:
    """Fill this rank's parameters and Adam state from the checkpoint at ``path`` (any layout
    wrote it); returns its manifest. Collective."""
    state = rank_state_dict(mesh, runner, engine, owned_only=False)
    state["trainer.rng"] = torch.get_rng_state()
    with _dcp_call() as dcp:
        dcp.load(state, checkpoint_id=path, planner=dcp.DefaultLoadPlanner())
    with comm.untracked():
        engine.sync_params()
    torch.set_rng_state(state["trainer.rng"])
    steps = [v for k, v in state.items() if k.endswith(".step")]
    for s in engine.optimizer.state.values():
        if steps:
            s["step"].copy_(steps[0])
    return read_manifest(path)


def load_serial(path: str, device="cpu") -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """The model's parameters as full tensors in serial names, in this one process."""
    manifest = check(path)
    cfg = model_config_of(manifest)
    state = {f"model.{n}": torch.empty(s) for n, s in serial_shapes(cfg).items()}
    with _dcp_call() as dcp:
        dcp.load(state, checkpoint_id=path, planner=dcp.DefaultLoadPlanner())
    return cfg, {k[len("model."):]: v.to(device) for k, v in state.items()}


# --------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------
def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    cli.main_guard(_run, argv)


def _run(argv):
    p = cli.ArgumentParser(prog="python -m minipar.checkpoint",
                            description="Inspect or export a minipar checkpoint.")
    sub = p.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="print the manifest of a checkpoint")
    info.add_argument("dir", help="a checkpoint, or a --save folder (its newest checkpoint)")
    exp = sub.add_parser("export", help="write the model as one plain state_dict file")
    exp.add_argument("dir", help="a checkpoint, or a --save folder (its newest checkpoint)")
    exp.add_argument("out", help="the .pt file to write (torch.save of {name: tensor})")
    exp.add_argument("--force", action="store_true", help="replace OUT if it exists")
    a = p.parse_args(argv)
    path = find(a.dir, what="checkpoint")
    if a.command == "info":
        manifest = check(path)
        print(f"checkpoint {path}")
        print(json.dumps(manifest, indent=2))
        return
    cli.check_output_file(a.out, "export OUT")           # before the model is loaded
    if os.path.exists(a.out) and not a.force:
        raise UsageError(f"export OUT {a.out} exists; give --force to replace it")
    _, state = load_serial(path)
    torch.save(state, a.out)
    print(f"wrote {a.out}: {len(state)} tensors, "
          f"{sum(t.numel() for t in state.values()):,} parameters (serial names)")


if __name__ == "__main__":
    main()
