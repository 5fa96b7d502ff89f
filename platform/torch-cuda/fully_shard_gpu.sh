#!/usr/bin/env bash
# benchmarks/fully_shard.py on one GPU: hyper_parallel's fully_shard beside torch's FSDP2
# at world 1 (NCCL), a model of LAYERS (default 32) blocks, so that the per-unit cost of the
# hooks and of the copy-in / copy-out shows against kernels that launch fast. Needs one GPU
# and a CUDA build of torch; takes under 3 minutes (each of the 2 x REPEATS configurations
# starts its own rank process). Run from anywhere; OUT (default build/torch-cuda) receives
# the log and fully_shard_cuda.json / .md, to be copied to benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-build/torch-cuda}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HYPER_PARALLEL_PLATFORM=torch-cuda
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())' \
    2>&1 | tee "$OUT/fully_shard_env.txt"
# BENCH_ARGS: more options for the benchmark (e.g. --batch 8 --seq 512)
# shellcheck disable=SC2086
timeout "${BENCH_TIMEOUT:-170}" python3 benchmarks/fully_shard.py --device cuda --worlds 1 \
    --layers "${LAYERS:-32}" --dim "${DIM:-512}" --batch "${BATCH:-8}" --seq "${SEQ:-256}" \
    --iters "${ITERS:-20}" --warmup "${WARMUP:-5}" --repeats "${REPEATS:-3}" \
    --out "$OUT/fully_shard_cuda" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/fully_shard_bench.txt"
exit "${PIPESTATUS[0]}"
