#!/usr/bin/env bash
# One call on a 2-GPU host (device tool kind nvidia-h200-x2): GPU checks and the CPU test suite
# under the host's torch, results under $OUT (default out/gpu).
#   bash benchmarks/gpu_suite.sh
# What runs now: AFD 1 attention : 1 FFN over NCCL (eager FX programs, fp32) for HF Llama and
# HF Qwen3-MoE through examples/afd_torchrun.py, and `pytest tests` (CPU, gloo) under the host's
# torch (2.11 there) to check the >=2.11 claim. Compiled/CUDA-graph benchmarks come with the
# torch.compile backend (issue 4).
set -uo pipefail
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
{
  python3 -c "import torch, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
  nvidia-smi -L
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
for fam in llama qwen3_moe; do
  echo "== AFD 1A1F over NCCL: $fam"
  torchrun --nproc-per-node 2 examples/afd_torchrun.py --attention-ranks 1 --ffn-ranks 1 --family "$fam" \
    > "$OUT/afd_nccl_$fam.txt" 2>&1 || status=1
  grep -v "^W1" "$OUT/afd_nccl_$fam.txt" | tail -3
done
echo "== CPU test suite under this torch"
python3 -m pytest -q -p no:cacheprovider tests > "$OUT/pytest_cpu.txt" 2>&1 || status=1
tail -15 "$OUT/pytest_cpu.txt"
exit $status
