#!/usr/bin/env bash
# The torch-cuda checks that one GPU can run (the multi-rank suite needs one GPU per rank:
# `python ci/run_matrix.py --backends torch-cuda` on 4 GPUs): the attention kernels'
# conformance and the forced-kernel test at world size 1, then benchmarks/attention.py on
# the GPU. Run from the repository root with a CUDA build of torch; OUT (default
# build/torch-cuda) receives the logs and the benchmark's JSON / table.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-build/torch-cuda}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HYPER_PARALLEL_PLATFORM=torch-cuda
python3 - <<'PY' 2>&1 | tee "$OUT/env.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
      torch.cuda.get_device_name())
for op in ("_flash_attention_forward", "_flash_attention_backward", "_scaled_dot_product_cudnn_attention_backward"):
    print(getattr(torch.ops.aten, op).default._schema)
PY
status=0
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -p no:cacheprovider -rs \
    tests/platform_contract/test_attention.py tests/backends/test_torch_cuda_attention.py 2>&1 | tee "$OUT/tests.txt" \
    || status=1
# BENCH_ARGS: more options for the benchmark (e.g. --cuda-seqs 4096 16384 --dtypes bfloat16)
# shellcheck disable=SC2086
timeout "${BENCH_TIMEOUT:-240}" python3 benchmarks/attention.py --device cuda --iters "${ITERS:-5}" \
    --out "$OUT/attention" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.txt" || status=1
exit $status
