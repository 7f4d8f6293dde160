#!/usr/bin/env bash
# The GPU tests and benchmarks in one command, on a 2-GPU host (device tool kind nvidia-h200-x2).
# Results (logs, JSON, tables) go under $OUT (default out/gpu).
#   bash benchmarks/gpu_suite.sh            # everything
#   bash benchmarks/gpu_suite.sh tests      # or one section: tests | exchange | step | cpu
# tests:    torch.compile(backend="afd") on NCCL, bf16, Inductor + CUDA graphs, through
#           examples/compile_backend.py: TP=2 and AFD 1A1F for HF Llama and HF Qwen3-MoE, TP=2 with
#           DP attention; 4 steps over 2 token layouts (graph replays with new inputs);
#           each prints OK only within bf16 rel err 1e-2 of the uncompiled model and with
#           zero cudagraph skips. Plus the eager-FX AFD runner (examples/afd_torchrun.py, fp32).
# exchange: benchmarks/gpu_exchange.py (AFD layer exchange in CUDA graphs vs the bare NCCL floor)
# step:     benchmarks/compile_step.py for tp and afd (compiled+graphed vs eager, vs one GPU)
# cpu:      the CPU test suite under this host's torch (checks the torch>=2.11 claim)
set -uo pipefail
OUT=${OUT:-out/gpu}
SECTION=${1:-all}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
run() {  # name, then the command; keeps the log, shows its last lines
  local name=$1; shift
  echo "== $name: $*"
  "$@" > "$OUT/$name.txt" 2>&1 || { status=1; echo "   FAILED (exit $?)"; }
  grep -v "^W1\|Warning\|warnings.warn\|return cls" "$OUT/$name.txt" | tail -${TAIL:-4}
}
want() { [ "$SECTION" = all ] || [ "$SECTION" = "$1" ]; }
# installed as a user would (the torch.compile backend is found through its entry point); no
# dependency resolution: the host has torch and transformers, and no internet
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.txt" 2>&1 || {
  echo "pip install -e . failed (see $OUT/install.txt)"; status=1; }
{
  python3 -c "import torch, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
  nvidia-smi -L
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
TR="torchrun --nproc-per-node 2"
if want tests; then
  TAIL=3
  run compiled_tp2_llama $TR examples/compile_backend.py --tp 2 --dtype bfloat16 --steps 4 --check-cache
  run compiled_tp2_qwen3moe $TR examples/compile_backend.py --tp 2 --dtype bfloat16 --steps 4 --family qwen3_moe
  run compiled_tp2_dp2_llama $TR examples/compile_backend.py --tp 2 --attn-dp 2 --dtype bfloat16 --steps 4
  run compiled_afd1a1f_llama $TR examples/compile_backend.py --attention 1 --ffn 1 --dtype bfloat16 --steps 4
  run compiled_afd1a1f_qwen3moe $TR examples/compile_backend.py --attention 1 --ffn 1 --dtype bfloat16 --steps 4 --family qwen3_moe
  run eager_afd1a1f_llama $TR examples/afd_torchrun.py --attention-ranks 1 --ffn-ranks 1
fi
if want exchange; then
  TAIL=9 run exchange $TR benchmarks/gpu_exchange.py --out "$OUT/exchange.json"
fi
if want step; then
  TAIL=6 run step_tp $TR benchmarks/compile_step.py --mode tp --out "$OUT/step_tp.json"
  TAIL=6 run step_afd $TR benchmarks/compile_step.py --mode afd --out "$OUT/step_afd.json"
fi
if want cpu; then
  TAIL=15 run pytest_cpu python3 -m pytest -q -p no:cacheprovider tests
fi
exit $status
