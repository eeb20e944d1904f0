#!/bin/bash
# minipar with torchrun on several nodes, without Slurm: run this script once on every node.
#
#   head node:   NODE_RANK=0 HEAD_ADDR=node001 bash scripts/torchrun_multinode.sh
#   other nodes: NODE_RANK=1 HEAD_ADDR=node001 bash scripts/torchrun_multinode.sh
#
# torchrun starts NPROC_PER_NODE ranks here, meets the other nodes at HEAD_ADDR:HEAD_PORT
# (c10d rendezvous) and numbers the ranks node by node, so a TP group of adjacent ranks
# stays inside one node. minipar reads RANK, WORLD_SIZE and LOCAL_RANK from torchrun.
set -euo pipefail

NNODES=${NNODES:-2}                 # nodes taking part
NODE_RANK=${NODE_RANK:-0}           # this node: 0 on the head node, 1..NNODES-1 elsewhere
NPROC_PER_NODE=${NPROC_PER_NODE:-8} # ranks per node: one per GPU
HEAD_ADDR=${HEAD_ADDR:-node001}     # host name or IP of the node with NODE_RANK=0
HEAD_PORT=${HEAD_PORT:-29500}       # a free TCP port on the head node
RUN_ID=${RUN_ID:-minipar-demo}      # the same on every node of one run
# export NCCL_SOCKET_IFNAME=ib0     # site-specific: the interface to bootstrap over
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
WORLD=$((NNODES * NPROC_PER_NODE))
OUT=${OUT:-minipar-out}
mkdir -p "$OUT"

# 1. Training run over every node: TP inside a node, PP across nodes
torchrun --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$HEAD_ADDR:$HEAD_PORT" --rdzv-id "$RUN_ID" \
    -m minipar.train --model gpt2-medium --dtype bf16 --tp "$NPROC_PER_NODE" --pp "$NNODES" \
        --microbatches $((4 * NNODES)) --batch-size $((8 * NNODES)) --steps 50 --log-every 5 \
        --metrics "$OUT/train.jsonl"

# 2. A scaling sweep inside the head node only: minipar.scaling starts each point itself
#    (python -m minipar.train --nproc N); across nodes it needs Slurm (one srun step per point).
if [ "$NODE_RANK" -eq 0 ]; then
    python -m minipar.scaling weak --nproc-list 1,2,4,"$NPROC_PER_NODE" --launcher local \
        --model gpt2-medium --dtype bf16 --zero 1 --microbatches 4 --batch-size 8 \
        --steps 10 --discard 3 --out "$OUT/weak.jsonl" --plot "$OUT/weak.png"
fi
