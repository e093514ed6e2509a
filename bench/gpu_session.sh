#!/usr/bin/env bash
# One batched GPU session: GPU tests and/or benchmarks by purpose, run in the order given, logs to $OUT/log.txt and the
# jsonl rows to $OUT/results.tar (bench/results). Regenerate bench/RESULTS.md from the rows: python bench/report.py.
#   bash bench/gpu_session.sh STAGE ...
# Stages (one H200 unless stated; each fits a 10-minute call):
#   gpu-tests         pytest -m gpu tests/kernels tests/models (ARENO_AUTOTUNE=off)
#   gpu-tests-engine  the engine's GPU tests with the decode kernels (gemm, qkv_prologue, rms_norm) and model parity
#   gpu-tests-train   the trainer's GPU tests: AdamW, log-prob kernels, norms, RoPE, batch packing, CUDA-graphed step
#   gpu-tests-hybrid  Ling 3 (bailing_hybrid) engine and model, MLA decode (transformers from $WHEELS_TF if present)
#   attention-tests   tests/kernels/test_attention.py -m gpu (every candidate config)
#   gpu-tests-all     every other GPU test of tests/ (the newest families and kernels first; transformers from
#                     $WHEELS_TF), one line per test in the log (a run cut at the limit still names each result);
#                     about 9 minutes on a fresh H200: set ALL_LIMIT, or pass test paths in $ALL_TESTS to run fewer
#   parity            rollout-vs-trainer log-prob parity (bench/logprob_parity.py)
#   kernels           K1 attention, K2 log-probs, sampler, speculative verify, small ops, K3 MoE
#   fp8-gemm          the FP8 block GEMM's GPU tests; fp8-gemm-bench: bench/fp8_gemm.py (8B, 30B-A3B expert, 0.6B,
#                     sweep; $FP8_LIMIT s; $FP8_ARGS, e.g. "--shapes 0.6b_qkv,0.6b_o,0.6b_gate_up,0.6b_down --ms 64,256")
#   nf4               QLoRA's NF4 GEMM: its GPU tests, then bench/nf4_gemm.py (fused vs dequantising pass vs bf16;
#                     $NF4_LIMIT s, $NF4_ARGS e.g. "--shapes 32b_gate_up,32b_down --ms 1,8,32")
#   kernel-variants   K1 attention variants at 4k (and the TMA sweep), K2 without Liger
#   rollout           R1-R3 ($ROLLOUT_ARGS, $ROLLOUT_LIMIT s); rollout-fallback: a smoke run first, eager decode if graphs fail
#   rollout-profile   where a decode step's time goes, and its kernel table ($PROFILE_ARGS for decode_profile.py,
#                     $PROF_ARGS for profile_step.py decode: e.g. "--family 8b --rollout-dtype fp8", FP8 rollout's step;
#                     PROF_ONLY=1: profile_step.py alone)
#   spec-bisect       why a fitted MTP draft was not accepted at the 9B shape (greedy accept 1.0; 3.0 at the smoke shape):
#                     the GPU test of fitted drafts under real graphs (passed on the H100), then R3 at the 9B shape
#                     with the refit rounds and where speculation's greedy path leaves the plain one ($SPEC_ARGS)
#   spec-r2           MTP speculation at R2 (issue 41's >= 1.3x), the draft fitted first (one 10-minute call; a fit
#                     with refit rounds that outlasts it is kept, and the same command again on the warm machine times it)
#   spec-ling         R3 with MTP at the Ling-3-Flash shape (issue 41's second R3 bar), its draft fitted first: an H200
#                     (~100 GB: 7 layers of 256 experts, and the MTP layer's 3.2B expert weights under fp32 Adam)
#   spec-profile      MTP speculation gated at R1 (0.894x of plain on the H100, 12-06): kernel tables of the MTP model's
#                     decode step plain and gated, and the gated step's host gaps
#   spec-verify-profile  kernel tables of the never-gated verify step (the sweep's: 2.6x a plain step's time at 16
#                     rows, 6x at 64 on the H100, 12-07) at $SPEC_SEQS rows and of a plain step; $PROF_LIMIT s each
#                     (a fresh machine writes the 9B checkpoint first: 100 s was not enough); SPEC_PROF_ARGS=--gaps:
#                     the host gaps between its kernels instead (a verify step at 1 row costs ~2x a plain one, 12-07)
#   batch-invariance  whether a 9B decode GEMM's row depends on the rows sharing the call (bench/batch_invariance.py)
#   spec-host         the host time of a steady speculative step by batch on this machine, graphs replayed (a tiny
#                     Qwen3.5: the device work is small, so the step is its host time and waits; bench/spec_host.py)
#   gdn-tiles         Qwen3.5's gated-DeltaNet decode step and speculative verify per tile (bench/gdn_decode.py, 9B
#                     shape, $GDN_ARGS): the verify ran at 1.9 TB/s on the step's tile, 2.7 the step (H100, 12-07)
#   kernel-resources  those kernels' registers and spills per tile from the machine's own Triton and ptxas
#                     (bench/kernel_resources.py: on the CPU, Triton 3.7.1's, the step's tile spills)
#   spec-gate         MTP speculation's gate (issue 41): R1 with --spec-gate $SPEC_GATES (default auto,off) vs plain
#                     ($SPEC_ARGS="--spec-plain-after": plain before and after, the speed-up against both);
#                     spec-sweep: the crossover table, speculation vs plain at batch 1..256 ($SPEC_ARGS, e.g.
#                     "--mtp-train-steps 300 --spec-batches 1,16,64,128,256"), with the accept length each batch needs
#   train             T1/T2 model step and train step (default, then graphs on without checkpointing), optimizer step
#   train-profile     kernel tables of T1 and T2 steps, graph gaps, graphed-step memory
#   families-profile  kernel tables of issue 38's T1 step (35B-A3B shape; $PROF_TRAIN_ARGS) with 8-bit and fp32 states
#   grpo              G1 vs TRL (TRL from $WHEELS_TRL if present), graphs off and on ($G1_ARGS instead, e.g.
#                     "--rollout-dtypes bf16,fp8": FP8 rollout's G1); grpo-default: the default command
#   lora              G1-lora / G8B-lora LoRA GRPO steps vs TRL + PEFT (bench/lora_step.py); lora-qlora: G32B-qlora
#   grpo-split        G1 colocated vs split sync/async vs TRL (nvidia-h200-x2)
#   sync              S1 policy sync and the split-mode tests (nvidia-h200-x2)
#   tp                serve/train TP vs TP=1 on every GPU of the machine (nvidia-h200-x2 or -x4)
#   serve             V1: the engine alone, then the server under 500 streams and 16 req/s; serve-lora: 4 rank-16
#                     adapters under 500 streams vs the base model (bench/serve_lora.py, $SERVE_LIMIT s)
#   eval              `areno eval` throughput (bench/eval.py, $EVAL_ARGS); optimizer-8bit: bench/optimizer_8bit.py
#                     ($OPT_ARGS, e.g. "--parts kernel": the 8-bit kernel's tiles)
#   learn             proof of learning (SFT then GRPO/GSPO from scratch, $LEARN_ARGS; "--algos grpo
#                     --rollout-dtypes bf16,fp8": FP8 rollout's curve beside bf16's)
#   families          issue 38's speed bench: Qwen3.5-9B / 35B-A3B shapes, R1 rollout and T1 train step vs
#                     transformers (>= 5.24 from $WHEELS_TF; older: areno's rows only), $FAMILIES_ARGS
# Wheels for Python 3.12 that the GPU machine lacks, carried with the tree (bench/README.md says how to fetch them):
#   $WHEELS (default .whl: serving/CLI dependencies, liger-kernel), $WHEELS_TF (.whl_tf: transformers >= 5.2x),
#   $WHEELS_TRL (.whl_trl: trl 1.16.0, datasets 5.2.0, dill 0.4.1, multiprocess 0.70.19).
# The correctness stages run with ARENO_AUTOTUNE=off: one config per kernel compiles (the every-candidate tests pin
# each config themselves), so a fresh machine spends its minutes testing rather than tuning.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LOG="$OUT/log.txt"
WHEELS=${WHEELS:-.whl} WHEELS_TF=${WHEELS_TF:-.whl_tf} WHEELS_TRL=${WHEELS_TRL:-.whl_trl}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
wheels() {  # wheels DIR TARGET: install DIR's wheels into TARGET (no index, no dependencies); false if DIR is absent
  [ -d "$1" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$2" \
    "$1"/*.whl >>"$LOG" 2>&1
}
if wheels "$WHEELS" /tmp/site; then export PYTHONPATH=/tmp/site:$PWD; fi
export PYTHONPATH=${PYTHONPATH:-$PWD}
{ [ -n "${ARENO_GIT_SHA:-}" ] || echo "ARENO_GIT_SHA is unset: the rows name this copy's commit, stale where its .git" \
    "was copied earlier (the device tool's): start the command with ARENO_GIT_SHA=<the commit> to name it"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
} >>"$LOG" 2>&1
step() {  # step NAME TIMEOUT CMD...
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T))" >>"$LOG"
  timeout "$limit" "$@" >>"$LOG" 2>&1; echo "=== $name rc=$? ($(date +%T))" >>"$LOG"
  tar -cf "$OUT/results.tar" bench/results 2>/dev/null
}
gpu_pytest() {  # gpu_pytest NAME TIMEOUT PYTEST-ARGS...
  local name=$1 limit=$2; shift 2
  step "$name" "$limit" env ARENO_AUTOTUNE=off python3 -m pytest -m gpu -q --timeout 150 --tb=short -p no:cacheprovider "$@"
}
for stage in "$@"; do
  case $stage in
    gpu-tests) gpu_pytest gpu-tests 330 tests/kernels tests/models ;;
    gpu-tests-engine) gpu_pytest gpu-tests-engine 200 tests/engine/test_engine.py tests/kernels/test_gemm.py \
        tests/kernels/test_qkv_prologue.py tests/kernels/test_rms_norm.py tests/models/test_gpu.py ;;
    gpu-tests-train) gpu_pytest gpu-tests-train 330 tests/kernels/test_adamw.py tests/kernels/test_linear_logprobs.py \
        tests/kernels/test_linear_logprobs_loss.py tests/kernels/test_rms_norm.py tests/kernels/test_qk_norm_rope.py \
        tests/training/test_pack.py tests/training/test_train_graphs_gpu.py tests/models/test_gpu.py ;;
    gpu-tests-hybrid)  # the Flash-shaped parity test loads a 1.1B checkpoint three ways and autotunes every kernel
      wheels "$WHEELS_TF" /tmp/tf
      step gpu-tests-hybrid 560 env PYTHONPATH=/tmp/tf:$PYTHONPATH python3 -m pytest -m gpu -q --timeout 520 \
        --tb=short -p no:cacheprovider tests/engine/test_engine_hybrid.py tests/models/test_bailing_hybrid.py \
        tests/kernels/test_mla_decode.py ;;
    gpu-tests-all)
      wheels "$WHEELS_TF" /tmp/tf
      step gpu-tests-all ${ALL_LIMIT:-560} env ARENO_AUTOTUNE=off PYTHONPATH=/tmp/tf:$PYTHONPATH python3 -m pytest -m gpu \
        -v -rfE --timeout 150 --tb=short -p no:cacheprovider --durations=40 --junitxml="$OUT/junit.xml" \
        --ignore=tests/kernels/test_attention.py --ignore=tests/kernels/test_attention_gluon.py \
        --continue-on-collection-errors ${ALL_TESTS:-tests/kernels/test_nf4.py tests/kernels/test_lora_kernel.py \
        tests/kernels/test_adamw8bit.py tests/kernels/test_fp8.py tests/kernels/test_attention_sinks.py tests/models \
        tests/engine tests/training tests/rl tests/kernels tests} ;;
    attention-tests) step attention-tests 300 python3 -m pytest -m gpu -q --timeout 180 --tb=short -p no:cacheprovider \
        tests/kernels/test_attention.py ;;
    parity) step parity 200 python3 bench/logprob_parity.py ;;
    kernels)
      step attention 150 python3 bench/attention.py
      step logprob 100 python3 bench/logprob.py
      step sampler 90 python3 bench/sampler.py
      step spec_verify 90 python3 bench/spec_verify.py
      step small_ops 90 python3 bench/small_ops.py
      step moe 150 python3 bench/moe.py ;;
    fp8-gemm) gpu_pytest fp8-gemm-tests 300 tests/kernels/test_fp8.py ;;
    fp8-gemm-bench) step fp8_gemm ${FP8_LIMIT:-560} python3 bench/fp8_gemm.py ${FP8_ARGS:-} ;;
    nf4)
      gpu_pytest nf4-tests 200 tests/kernels/test_nf4.py
      step nf4_gemm ${NF4_LIMIT:-240} python3 bench/nf4_gemm.py ${NF4_ARGS:-} ;;
    kernel-variants)
      step k1-variants 200 python3 bench/attention.py --variants --seqs 4096
      step k1-sweep 300 python3 bench/attention.py --variants --seqs 4096 --sweep ${SWEEP:-near}
      step k2-no-liger 120 python3 bench/logprob.py --impls torch areno areno_loss --no-liger ;;
    rollout) step rollout ${ROLLOUT_LIMIT:-190} python3 bench/rollout.py ${ROLLOUT_ARGS:-} ;;
    rollout-fallback)  # a tiny run first: if CUDA-graph decode fails there, measure eager decode rather than nothing
      if timeout 120 python3 bench/rollout.py --smoke >"$OUT/smoke.txt" 2>&1 && ! grep -q "Traceback" "$OUT/smoke.txt"
      then step rollout 330 python3 bench/rollout.py ${ROLLOUT_ARGS:-}
      else cat "$OUT/smoke.txt" >>"$LOG"; step rollout-eager 330 python3 bench/rollout.py --eager ${ROLLOUT_ARGS:-}; fi ;;
    spec-bisect)
      [ -n "${SPEC_SKIP_TEST:-}" ] ||
      gpu_pytest spec-trained 240 tests/engine/test_spec_graphs.py -k "trained"
      step spec-9b ${SPEC_LIMIT:-420} python3 bench/rollout.py --speculative-tokens 2 --workloads R3 \
        --spec-greedy --mtp-train-steps 300 --mtp-fit-rounds ${SPEC_ROUNDS:-3} ${SPEC_ARGS:-} ;;
    spec-r2)  # R2 (moderate batch) with an MTP draft fitted to the model: the fit alone takes ~2 min at the 9B shape
      step spec-r2 ${SPEC_LIMIT:-580} python3 bench/rollout.py --speculative-tokens 2 --workloads R2 --spec-greedy \
        --mtp-train-steps 300 ${SPEC_ARGS:-} ;;
    spec-ling) step spec-ling ${SPEC_LIMIT:-560} python3 bench/rollout.py --speculative-tokens 2 --workloads R3 \
        --mtp-family bailing_hybrid --spec-greedy --mtp-train-steps 300 ${SPEC_ARGS:-} ;;
    spec-profile)  # what gating costs at R1's 256 sequences: the MTP model's decode plain (8 steps chained) and gated
      step prof_plain 150 python3 bench/profile_step.py decode --mtp --decode-steps 8
      step prof_gated 150 python3 bench/profile_step.py decode --speculative-tokens 2
      step gaps_plain 120 python3 bench/profile_step.py decode --mtp --decode-steps 8 --gaps
      step gaps_gated 120 python3 bench/profile_step.py decode --speculative-tokens 2 --gaps ;;
    spec-verify-profile)  # the sweep's never-gated verify step at $SPEC_SEQS (64) rows against a plain step
      step prof_verify ${PROF_LIMIT:-300} python3 bench/profile_step.py decode --speculative-tokens 2 --spec-gate off \
        --seqs ${SPEC_SEQS:-64} --top 45 ${SPEC_PROF_ARGS:-}
      step prof_plain1 ${PROF_LIMIT:-300} python3 bench/profile_step.py decode --mtp --seqs ${SPEC_SEQS:-64} --top 25 ;;
    batch-invariance) step batch_invariance 120 python3 bench/batch_invariance.py ;;
    kernel-resources) step kernel_resources 120 python3 bench/kernel_resources.py ;;
    spec-host) step spec_host ${SPEC_HOST_LIMIT:-240} python3 bench/spec_host.py ${SPEC_HOST_ARGS:-} ;;
    gdn-tiles) step gdn_tiles ${GDN_LIMIT:-300} python3 bench/gdn_decode.py ${GDN_ARGS:---rows 64 --verify-tokens 3 \
        --bv 32,64,128 --warps 2,4,8} ;;
    spec-gate) step spec-gate ${SPEC_LIMIT:-560} python3 bench/rollout.py --speculative-tokens 2 --workloads R1 \
        --spec-gate ${SPEC_GATES:-auto,off} ${SPEC_ARGS:-} ;;
    spec-sweep) step spec-sweep ${SPEC_LIMIT:-560} python3 bench/rollout.py --speculative-tokens 2 --spec-batch-sweep \
        ${SPEC_ARGS:-} ;;
    rollout-profile)
      [ -n "${PROF_ONLY:-}" ] || step decode_profile 120 python3 bench/decode_profile.py ${PROFILE_ARGS:-}
      step prof_decode ${PROF_LIMIT:-90} python3 bench/profile_step.py decode ${PROF_ARGS:-} ;;
    train)
      step model_step 100 python3 bench/model_step.py
      step train_step 150 python3 bench/train_step.py
      step train_step_graphs 240 python3 bench/train_step.py --workloads T1,T2 --checkpointing off --graphs on
      step optimizer 60 python3 bench/optimizer_step.py
      step optimizer_8bit 120 python3 bench/optimizer_8bit.py ;;
    train-profile)
      step prof_train 90 python3 bench/profile_step.py train
      step prof-t2 120 python3 bench/profile_step.py train --shape 4x4096 --top 45
      step gaps-t2 70 python3 bench/profile_step.py train --shape 4x4096 --train-cuda-graphs on --gaps --top 8
      step graph-memory 200 bash -c "python3 bench/graph_memory.py && python3 bench/graph_memory.py --shape t1" ;;
    families-profile)  # where issue 38's T1 step goes with 8-bit AdamW, fp32 states beside it
      step prof_t1_8bit 150 python3 bench/profile_step.py train ${PROF_TRAIN_ARGS:---family qwen3_5-35b-a3b} \
        --optimizer-states 8bit --top 40
      step prof_t1_fp32 150 python3 bench/profile_step.py train ${PROF_TRAIN_ARGS:---family qwen3_5-35b-a3b} --top 40 ;;
    grpo)
      wheels "$WHEELS_TRL" /tmp/trl
      step grpo_step ${G1_LIMIT:-420} env PYTHONPATH=$PYTHONPATH:/tmp/trl python3 bench/grpo_step.py \
        ${G1_ARGS:---train-cuda-graphs off,on} ;;
    lora)
      wheels "$WHEELS_TRL" /tmp/trl
      step lora_step ${LORA_LIMIT:-560} env PYTHONPATH=$PYTHONPATH:/tmp/trl python3 bench/lora_step.py ${LORA_ARGS:-} ;;
    lora-qlora) step lora_qlora ${LORA_LIMIT:-560} python3 bench/lora_step.py --shapes none --qlora ;;
    grpo-default) step grpo_step ${G1_LIMIT:-300} python3 bench/grpo_step.py ;;
    grpo-split)
      wheels "$WHEELS_TRL" /tmp/trl
      step grpo_split ${G1_LIMIT:-560} env PYTHONPATH=$PYTHONPATH:/tmp/trl python3 bench/grpo_step.py --split ;;
    sync)
      step policy_sync 300 python3 bench/policy_sync.py
      step gpu2-tests 280 python3 -m pytest -q --timeout 240 --tb=short -p no:cacheprovider tests/rl/test_split.py \
        tests/training/test_train_graphs_gpu.py -k "not quickstart and not memory" ;;
    tp) step tp ${TP_LIMIT:-500} python3 bench/tp.py --gpus "$(nvidia-smi -L | wc -l)" ;;
    serve) step serve 480 python3 bench/serve.py ;;  # the engine alone on the same batch first, then the server
    serve-lora) step serve_lora ${SERVE_LIMIT:-480} python3 bench/serve_lora.py ;;
    eval) step eval ${EVAL_LIMIT:-240} python3 bench/eval.py ${EVAL_ARGS:-} ;;
    optimizer-8bit) step optimizer_8bit ${OPT_LIMIT:-200} python3 bench/optimizer_8bit.py ${OPT_ARGS:-} ;;
    learn) step learn ${LEARN_LIMIT:-280} python3 bench/learn.py ${LEARN_ARGS:-} ;;
    families)
      wheels "$WHEELS_TF" /tmp/tf
      step families ${FAMILIES_LIMIT:-560} env PYTHONPATH=/tmp/tf:$PYTHONPATH python3 bench/families.py \
        ${FAMILIES_ARGS:-} ;;
    *) echo "unknown stage $stage" >>"$LOG" ;;
  esac
done
tar -cf "$OUT/results.tar" bench/results 2>/dev/null
exit 0
