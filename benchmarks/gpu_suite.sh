#!/usr/bin/env bash
# The GPU tests and benchmarks in one command, on a 2-GPU host (device tool kind nvidia-h200-x2).
# Results (logs, JSON, tables) go under $OUT (default out/gpu), and all of them in $OUT/00_gpu_suite_logs.tgz.
# ONLY=<grep -E pattern> runs the matching jobs only; PYTEST_ARGS narrows the CPU suite.
#   bash benchmarks/gpu_suite.sh            # everything
#   bash benchmarks/gpu_suite.sh tests step # or some sections: tests | exchange | step | cpu | four
# tests:    torch.compile(backend="afd") on NCCL, Inductor + CUDA graphs, through
#           examples/compile_backend.py: TP=2 and AFD 1A1F for HF Llama and HF Qwen3-MoE (bf16, and
#           fp32 for the MoE), TP=2 with DP attention; 4 steps over 2 token layouts (graph replays
#           with new inputs); each prints OK only within rel err 1e-2 (bf16) / 1e-5 (fp32) of the
#           uncompiled model and with zero cudagraph skips. Plus the eager-FX AFD runner
#           (examples/afd_torchrun.py, fp32); TP=2 with --moe-a2a (fp32) and --dense-dp (bf16).
#           The jobs run side by side, each under `timeout`.
#           With "all", the CPU section runs alongside them.
# exchange: benchmarks/gpu_exchange.py (AFD layer exchange in CUDA graphs vs the bare NCCL floor)
# junction: benchmarks/junction.py (all-reduce + add + RMSNorm alone, by message size: NCCL vs the
#           one-shot all-reduce over symmetric memory, in CUDA graphs); also run by "step"
# step:     benchmarks/compile_step.py for tp and afd (compiled+graphed vs eager, vs one GPU; TP also
#           with every junction over NCCL), and
#           benchmarks/pingpong_step.py (AFD 1A1F with 1, 2, 3 micro-batch stages vs each role alone
#           and one GPU; a profiler trace of S=2 steps)
# cpu:      the CPU test suite under this host's torch (checks the torch>=2.11 claim), GPUs hidden
# decode:   KV-cache decoding (issue 12): examples/generate.py (HF generate() with a static cache,
#           the forward compiled with the afd backend, Inductor + CUDA graphs, bf16) for TP=2 and AFD
#           1A1F, Llama and Qwen3-MoE, tokens against one-GPU generate(); then
#           benchmarks/decode_step.py (decode step time vs one GPU and the HBM floor) and
#           benchmarks/decode_attention_kernel.py (one layer: masked SDPA vs FlexAttention vs the KV-read floor)
# moe:      (only when named; a 1-GPU host; also in "one") benchmarks/moe_ffn.py: the FFN side of a
#           Qwen3-30B-A3B-shaped MoE per expert form (transformers' grouped_mm / batched_mm, the
#           afd::moe_experts op, and each form exported and recognised by passes/moe) against its HBM
#           floor; benchmarks/moe_kernels.py: the op's pieces alone; tests/test_gpu_moe_kernel.py (the
#           op's fused Triton path against its reference, and under CUDA graph capture)
# one:      (only when named; a 1-GPU host) decode attention on one GPU: examples/generate.py with no
#           layout and --decode-attention flex (Llama, Qwen3-MoE; bf16 tokens against generate()),
#           tests/test_gpu_partition.py (ops run between the captured pieces of a program),
#           benchmarks/ffn_program_step.py (an FFN rank's real program: its exchange in one graph
#           captured per tuple of peer sizes, between pieces, between pieces with each send and
#           the next receive fused),
#           decode_step.py's one-GPU columns (reduce-overhead vs the afd backend with the pass),
#           decode_attention_kernel.py; the deployment estimate against measurements
#           (estimate_check.py, Llama and Qwen3-MoE: interpolation, parts vs whole, --layers K vs all,
#           two-GPU steps recomputed) and AFD vs TP/EP for real shapes (estimate_table.py); the MoE
#           FFN side (moe_ffn.py, moe_kernels.py, tests/test_gpu_moe_kernel.py)
# families: the backend (TP=2 and AFD 1A1F, bf16, Inductor + CUDA graphs, --control) on HF families
#           other than Llama (FAMILIES="gemma2 gpt2 ..." picks them)
# four:     (only when named; a 4-GPU host) compiled AFD 2A1F / 3A1F and TP=4 (with DP attention)
#           on NCCL, bf16, Llama and Qwen3-MoE (MoE with --control), and generate() for AFD 3A1F
#           (ranks finishing apart) and TP=4 with 2 DP groups; the jobs run side by side
set -uo pipefail
OUT=${OUT:-out/gpu}
SECTIONS=" ${*:-all} "
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
status=0
run() {  # name, then the command; keeps the log, shows its last lines (skipped unless it matches $ONLY)
  local name=$1; shift
  echo "$name" | grep -Eq "${ONLY:-.}" || return 0
  echo "== $name: $*"
  "$@" > "$OUT/$name.txt" 2>&1 || { status=1; echo "   FAILED (exit $?)"; }
  grep -v "^W1\|Warning\|warnings.warn\|return cls" "$OUT/$name.txt" | tail -${TAIL:-4}
}
want() { [[ $SECTIONS == *" all "* || $SECTIONS == *" $1 "* ]]; }
# installed as a user would (the torch.compile backend is found through its entry point); no
# dependency resolution: the host has torch and transformers, and no internet
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.txt" 2>&1 || {
  echo "pip install -e . failed (see $OUT/install.txt)"; status=1; }
{
  python3 -c "import torch, transformers, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
  nvidia-smi -L
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
TR="torchrun --standalone --nproc-per-node 2"
# background jobs (each with its own rendezvous port and a time limit: a hang shows as rc 124)
declare -a JOBS=()
par() {  # name, then the command (skipped unless the name matches $ONLY, a grep -E pattern)
  local name=$1; shift
  echo "$name" | grep -Eq "${ONLY:-.}" || return 0
  echo "== $name (background): $*"
  ( timeout -s INT -k 20 "${LIMIT:-500}" "$@" > "$OUT/$name.txt" 2>&1; echo $? > "$OUT/$name.rc" ) &
  JOBS+=("$name")
}
collect() {  # wait for the background jobs; show each one's exit status and last lines
  wait
  for name in "${JOBS[@]}"; do
    local rc; rc=$(cat "$OUT/$name.rc" 2>/dev/null || echo "?")
    echo "== $name: exit $rc$([ "$rc" = 124 ] || [ "$rc" = 130 ] && echo ' (TIMEOUT: hung or too slow; interrupted)')"
    [ "$rc" = 0 ] || status=1
    grep -v "^W1\|Warning\|warnings.warn\|return cls" "$OUT/$name.txt" | tail -"${TAIL:-4}"
  done
  JOBS=()
}
if want tests; then
  # Inductor compiles in parallel jobs: few compile workers each
  export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-4}
  E="examples/compile_backend.py --steps 4"
  par compiled_tp2_llama $TR $E --tp 2 --dtype bfloat16 --check-cache
  par compiled_tp2_llama_decode $TR $E --tp 2 --dtype bfloat16 --seq 1
  par compiled_tp2_dp2_llama $TR $E --tp 2 --attn-dp 2 --dtype bfloat16
  par compiled_afd1a1f_llama $TR $E --attention 1 --ffn 1 --dtype bfloat16
  par compiled_afd1a1f_llama_decode $TR $E --attention 1 --ffn 1 --dtype bfloat16 --seq 1
  par compiled_tp2_qwen3moe $TR $E --tp 2 --family qwen3_moe --dtype bfloat16 --control
  par compiled_tp2_qwen3moe_fp32 $TR $E --tp 2 --family qwen3_moe
  par compiled_afd1a1f_qwen3moe $TR $E --attention 1 --ffn 1 --family qwen3_moe --dtype bfloat16 --control
  par compiled_afd1a1f_qwen3moe_fp32 $TR $E --attention 1 --ffn 1 --family qwen3_moe
  par eager_afd1a1f_llama $TR examples/afd_torchrun.py --attention-ranks 1 --ffn-ranks 1
  # micro-batch stages (issue 13): asynchronous transfers inside CUDA graphs on NCCL
  par compiled_afd1a1f_llama_stages2 $TR $E --attention 1 --ffn 1 --dtype bfloat16 --stages 2
  par compiled_afd1a1f_qwen3moe_stages3_fp32 $TR $E --attention 1 --ffn 1 --family qwen3_moe --stages 3
  # SCATTERED MLPs (issue 3): MoE experts over 2 GPUs with all-to-all (fp32; the EP ops sync with
  # the host, so that program runs compiled without CUDA graphs), and a data-parallel dense MLP
  # inside a 2-rank attention-TP group (reduce-scatter / all-gather of token shares, graphed)
  par compiled_tp2_qwen3moe_a2a $TR $E --tp 2 --family qwen3_moe --moe-a2a
  par compiled_tp2_llama_densedp $TR $E --tp 2 --dense-dp --dtype bfloat16
  if want cpu; then  # the CPU suite alongside (it does not touch the GPUs)
    par pytest_cpu env CUDA_VISIBLE_DEVICES= AFD_BACKEND=gloo python3 -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-tests}
  fi
  TAIL=3 collect
elif want cpu; then
  par pytest_cpu env CUDA_VISIBLE_DEVICES= AFD_BACKEND=gloo python3 -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-tests}
  TAIL=15 collect
fi
if want families; then  # issue 14: the backend on families other than Llama, bf16, Inductor + CUDA graphs
  export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-2}
  E="examples/compile_backend.py --steps 4 --dtype bfloat16 --control"
  for fam in ${FAMILIES:-gemma2 gpt2 phi3 olmo2 granite deepseek_v3}; do
    par "family_tp2_$fam" $TR $E --tp 2 --family "$fam"
    par "family_afd1a1f_$fam" $TR $E --attention 1 --ffn 1 --family "$fam"
  done
  TAIL=3 collect
fi
if [[ $SECTIONS == *" four "* ]]; then  # issue 5: needs a 4-GPU host (device tool kind nvidia-h200-x4); not in "all"
  export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-4}
  E="examples/compile_backend.py --steps 4 --dtype bfloat16"
  T3="torchrun --standalone --nproc-per-node 3" T4="torchrun --standalone --nproc-per-node 4"
  par four_afd2a1f_llama $T3 $E --attention 2 --ffn 1
  par four_afd3a1f_llama $T4 $E --attention 3 --ffn 1
  par four_afd2a1f_qwen3moe $T3 $E --attention 2 --ffn 1 --family qwen3_moe --control
  par four_afd3a1f_qwen3moe $T4 $E --attention 3 --ffn 1 --family qwen3_moe --control
  par four_tp4_llama $T4 $E --tp 4
  par four_tp4_dp2_llama $T4 $E --tp 4 --attn-dp 2
  par four_tp4_dp2_qwen3moe $T4 $E --tp 4 --attn-dp 2 --family qwen3_moe --control
  par four_generate_afd3a1f_llama $T4 examples/generate.py --dtype bfloat16 --attention 3 --ffn 1 --stagger 2
  par four_generate_tp4_dp2_llama $T4 examples/generate.py --dtype bfloat16 --tp 4 --attn-dp 2
  TAIL=3 collect
fi
if [[ $SECTIONS == *" one "* ]]; then
  export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-8}
  T1="torchrun --standalone --nproc-per-node 1"
  TAIL=2 run one_generate_flex_llama $T1 examples/generate.py --dtype bfloat16 --decode-attention flex
  TAIL=2 run one_generate_flex_qwen3moe $T1 examples/generate.py --dtype bfloat16 --decode-attention flex --family qwen3_moe
  TAIL=8 run one_decode_step $T1 benchmarks/decode_step.py --shapes 1x1024,8x1024,64x1024,64x4096 --iters 15 --out "$OUT/one_decode_step.json"
  TAIL=8 run one_decode_attention_kernel python3 benchmarks/decode_attention_kernel.py --out "$OUT/one_decode_attention_kernel.json"
  # issue 35: an FFN program's exchange between its captured pieces (Inductor's graph partition)
  TAIL=3 run one_partition_tests python3 -m pytest -q -m gpu tests/test_gpu_partition.py tests/test_gpu_control.py
  # issue 35: the serve loop's control read as a device tensor (on the NCCL group) against a host one
  TAIL=6 run one_control_read python3 benchmarks/control_read.py --tokens 8,64,256 --json "$OUT/one_control_read.json"
  # issue 35: ffn_capture="compute" (the exchange between captured pieces) against "all" (one graph), a stand-in exchange
  TAIL=6 run one_ffn_partition python3 benchmarks/ffn_partition.py --tokens 8,64,256 --json "$OUT/one_ffn_partition.json"
  # issue 35: the real FFN program (AFD 2A1F split, a stand-in transport): all / compute / compute fused
  TAIL=6 run one_ffn_program_step python3 benchmarks/ffn_program_step.py --json "$OUT/one_ffn_program_step.json"
  TAIL=6 run one_ffn_program_step_8b python3 benchmarks/ffn_program_step.py --hidden 4096 --inter 14336 --json "$OUT/one_ffn_program_step_8b.json"
  # one rank: symmetric-memory setup, capture and dispatch of the junction (the sum of one partial)
  TAIL=14 run one_junction $T1 benchmarks/junction.py --tokens 8,64 --out "$OUT/one_junction.json"
fi
if [[ $SECTIONS == *" one "* || $SECTIONS == *" moe "* ]]; then  # issue 34: the MoE FFN side on one GPU
  TAIL=3 run one_moe_kernel_tests python3 -m pytest -q -m gpu tests/test_gpu_moe_kernel.py
  # a fixed wire slot's padded rows on the FFN side: MoE (masked or not) and dense, against exact rows
  TAIL=12 run one_slot_padding python3 benchmarks/slot_padding.py --json "$OUT/one_slot_padding.json"
  TAIL=8 run one_slot_program_step python3 benchmarks/slot_program_step.py --json "$OUT/one_slot_program_step.json"
  # an attention rank's CUDA graphs over a changing batch, its batch as it came or padded to buckets
  TAIL=6 run one_attention_graphs python3 benchmarks/attention_graphs.py --json "$OUT/one_attention_graphs.json"
  # plan --estimate against measurements: a profile's interpolation, the no-layout step from its parts, the
  # multi-GPU step times BENCHMARKS.md records (Llama-8B-shaped x 4) recomputed from this one-GPU profile
  TAIL=45 run one_estimate_check_llama python3 benchmarks/estimate_check.py --family llama --kernels 8 --json "$OUT/one_estimate_check_llama.json"
  TAIL=30 run one_estimate_check_qwen3moe python3 benchmarks/estimate_check.py --family qwen3_moe --kernels 1,4,8 --json "$OUT/one_estimate_check_qwen3moe.json"
  # AFD against TP/EP for real model shapes (a few layers of each profiled here, scaled), 8 to 64 GPUs
  # (each model in its own run: 1.5-4 minutes each, DeepSeek-V3 more than 5: 4 layers of 2 kinds; the profiles land in
  # $OUT/table, and `estimate_table.py --profiles $OUT/table --models ...` tables them together)
  mkdir -p "$OUT/table"
  for m in llama3_70b qwen3_30b_a3b qwen3_235b_a22b deepseek_v3; do
    TAIL=12 run "one_estimate_table_$m" python3 benchmarks/estimate_table.py --models "$m" --json "$OUT/table/one_estimate_table_$m.json"
  done
  TAIL=8 run one_moe_ffn python3 benchmarks/moe_ffn.py --json "$OUT/one_moe_ffn.json"
  TAIL=9 run one_moe_kernels python3 benchmarks/moe_kernels.py --json "$OUT/one_moe_kernels.json"
  TAIL=12 run one_moe_kernels_split python3 benchmarks/moe_kernels.py --split --tokens 64,256,1024 --json "$OUT/one_moe_kernels_split.json"
fi
if want decode; then
  export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-4}
  G="examples/generate.py --dtype bfloat16"
  par generate_tp2_llama $TR $G --tp 2
  par generate_afd1a1f_llama $TR $G --attention 1 --ffn 1
  # (Qwen3-MoE TP=2 under transformers 5.17 bf16: its experts run as bmm, which TP cannot shard yet)
  par generate_afd1a1f_qwen3moe $TR $G --attention 1 --ffn 1 --family qwen3_moe
  TAIL=4 collect
  TAIL=8 run decode_step $TR benchmarks/decode_step.py --shapes 8x1024,64x1024,64x4096 --iters 15 --out "$OUT/decode_step.json"
  TAIL=8 run decode_attention_kernel python3 benchmarks/decode_attention_kernel.py --out "$OUT/decode_attention_kernel.json"
fi
if want exchange; then
  TAIL=9 run exchange $TR benchmarks/gpu_exchange.py --out "$OUT/exchange.json"
fi
if want step || want junction; then  # issue 15: the TP junction alone, NCCL vs one-shot over symmetric memory
  TAIL=14 run junction $TR benchmarks/junction.py --out "$OUT/junction.json"
fi
if want step; then
  TAIL=6 run step_tp $TR benchmarks/compile_step.py --mode tp --out "$OUT/step_tp.json"
  TAIL=6 run step_afd $TR benchmarks/compile_step.py --mode afd --out "$OUT/step_afd.json"
  TAIL=8 run pingpong $TR benchmarks/pingpong_step.py --out "$OUT/pingpong.json" --trace "$OUT/pingpong_trace.json"
fi
# everything in one archive as well (the device tool brings back a limited number of files)
tar czf "/tmp/gpu_suite_logs.$$.tgz" -C "$OUT" --exclude 00_gpu_suite_logs.tgz . && mv "/tmp/gpu_suite_logs.$$.tgz" "$OUT/00_gpu_suite_logs.tgz"
exit $status
