#!/usr/bin/env bash
# Two-GPU DDP launch of the tiny GPT (as a CUDA user would have it).
set -euo pipefail
export CUDA_VISIBLE_DEVICES=0,1
export NCCL_DEBUG=WARN
torchrun --nproc-per-node 2 "$(dirname "$0")/train_gpt.py" --steps 20 --device cuda "$@"
