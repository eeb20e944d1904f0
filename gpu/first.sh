#!/usr/bin/env bash
# first look at the GPU path, on the landed main (before any change of this session)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch;print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0), 'nccl', torch.cuda.nccl.version())"
echo "=== bench gpu (gpt2, bf16, eager)"
timeout 100 python3 -m minipar.bench gpu --steps 20 --warmup 5 2>&1 | tee $OUT/bench_gpu.log
echo "=== torchrun bf16 gpt2 save / resume"
timeout 60 python3 -m torch.distributed.run --nproc-per-node 1 -m minipar.train --model gpt2 --dtype bf16 --batch-size 8 --steps 20 --log-every 5 --save /tmp/r --save-every 10 --metrics $OUT/full.jsonl 2>&1 | tail -15
timeout 60 python3 -m torch.distributed.run --nproc-per-node 1 -m minipar.train --model gpt2 --dtype bf16 --batch-size 8 --steps 20 --log-every 5 --resume /tmp/r/step-000010 --metrics $OUT/resumed.jsonl 2>&1 | tail -15
python3 - <<'PY'
import json, os
o = os.environ["OUT"]
a = [json.loads(l) for l in open(f"{o}/full.jsonl")] if os.path.exists(f"{o}/full.jsonl") else []
b = [json.loads(l) for l in open(f"{o}/resumed.jsonl")] if os.path.exists(f"{o}/resumed.jsonl") else []
A = {r["step"]: r["loss"] for r in a}; B = {r["step"]: r["loss"] for r in b}
print("resume vs full, steps", sorted(B), [(s, A.get(s), B[s]) for s in sorted(B)][:12])
PY
echo "=== the suite with the GPU visible (notebooks left out: no nbval there)"
timeout 170 python3 -m pytest tests -o addopts="" -p no:cacheprovider -n 12 --dist loadfile -q -rfEs --timeout 120 2>&1 | tee $OUT/suite.log | tail -60
