#!/usr/bin/env bash
# GPU readiness, in one prepared script (under 8 minutes on one NVIDIA GPU):
#   bash benchmarks/gpu_check.sh            (MODEL=DIR to use another model directory; default: SmolLM2-135M-Instruct;
#                                            DTYPE=fp16 for the fp16 learner with dynamic loss scaling; default bf16;
#                                            ENGINE=local to generate with the built-in engine (on the CPU) where
#                                            SGLang cannot be installed; default sglang; TRAIN_TIMEOUT_S=N bounds
#                                            the training run, default 420)
# Trains SmolLM2 arithmetic for 2 steps with a launched SGLang server and the DeepSpeed learner in bf16 (or fp16), then
# prints from the run's ledger: rollout tokens/s, weight-sync seconds, learner seconds, the learner's peak GPU
# memory against `loopline plan`'s estimate, and the logprob gap between the engine and the learner (invariant 3).
# What it needs is checked first; on a machine without it (a CPU machine) it stops with one line saying what.
set -euo pipefail
cd "$(dirname "$0")/.."

die() { echo "gpu_check: $*" >&2; exit 1; }
command -v nvidia-smi >/dev/null 2>&1 || die "no NVIDIA GPU here (nvidia-smi not found): run it on a machine with one"
python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())" \
  || die "torch $(python3 -c 'import torch; print(torch.__version__)') sees no CUDA device: install a CUDA build of torch"
DTYPE="${DTYPE:-bf16}"
[[ "$DTYPE" == bf16 || "$DTYPE" == fp16 ]] || die "DTYPE=$DTYPE: expected bf16 or fp16"
[[ "$DTYPE" != bf16 ]] || python3 -c "import torch, sys; sys.exit(not torch.cuda.is_bf16_supported())" \
  || die "this GPU has no bf16: run DTYPE=fp16 bash benchmarks/gpu_check.sh"
ENGINE="${ENGINE:-sglang}"
[[ "$ENGINE" == sglang || "$ENGINE" == local ]] || die "ENGINE=$ENGINE: expected sglang or local"
[[ "$ENGINE" != sglang ]] || python3 -c "import sglang" 2>/dev/null \
  || die "SGLang is not installed in $(command -v python3): pip install 'sglang==0.5.23' (or ENGINE=local)"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

export LOOPLINE_HOME="${LOOPLINE_HOME:-$(mktemp -d)}"
work="$(mktemp -d)"
if [[ -z "${MODEL:-}" ]]; then
  python3 -m loopline.cli models pull smollm2-135m
  MODEL="$LOOPLINE_HOME/models/smollm2-135m"
fi
cp examples/arithmetic_env.yaml "$work/"
name="gpu-check-$(date +%s)"
cat > "$work/run.yaml" <<EOF
name: $name
env: arithmetic_env.yaml
policy: $MODEL
steps: 2
rollout:
  groups_per_step: 8
  group_size: 8
  concurrency: 64
  sampling: {temperature: 1.0, max_new_tokens: 48}
learner: {lr: 3.0e-6, backend: deepspeed, dtype: $DTYPE}
eval: {every: 2, tasks: 50, temperature: 0.0}
EOF
if [[ "$ENGINE" == sglang ]]; then
  cat >> "$work/run.yaml" <<EOF
engine:
  kind: sglang
  launch: {replicas: 1, args: [--mem-fraction-static, "0.5"], startup_timeout_s: 300}
EOF
else
  echo "engine: {kind: local}" >> "$work/run.yaml"
fi
case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n1)" in
  *H200*) gpu=h200 ;; *A100*) gpu=a100-80g ;; *L4*) gpu=l4 ;; *) gpu=h100 ;;
esac
python3 -m loopline.cli plan "$work/run.yaml" --gpu "$gpu" | tee "$work/plan.txt"
# (the ledger is read whatever train's status: a run that trained and then failed to exit still has its numbers)
train_rc=0
timeout -k 20 "${TRAIN_TIMEOUT_S:-420}" python3 -m loopline.cli train "$work/run.yaml" || train_rc=$?
python3 - "$name" "$work/plan.txt" <<'EOF'
import re, sys
from loopline.store import views
from loopline.store.db import read_only_engine

name, plan = sys.argv[1], open(sys.argv[2]).read()
with read_only_engine().connect() as conn:
    run = views.run_id(conn, name)
    timings = [dict(zip(t.columns, r)) for t in [views.step_timings(conn, run)] for r in t.rows]
    metrics = {}
    for step, metric, value in views.metrics(conn, run).rows:
        metrics.setdefault(int(step), {})[metric] = value
learner_total = re.search(r"learner, per rank.*?total\s+([\d.]+ \w+)", plan, re.S)
for t in timings:
    m = metrics.get(int(t["step"]), {})
    rate = t["tokens"] / t["rollout_s"] if t.get("rollout_s") else float("nan")
    print(f"step {t['step']}: rollout {t['tokens']} tokens in {t['rollout_s']:.1f} s = {rate:.0f} tokens/s, "
          f"weight sync {t.get('sync_s') or 0:.2f} s, learner {t.get('learner_s') or 0:.2f} s, "
          f"peak GPU {m.get('peak_gpu_gb', float('nan')):.2f} GB (plan: {learner_total.group(1) if learner_total else '?'} learner), "
          f"|engine - learner| logprob {m.get('logprob_abs_diff', float('nan')):.2e} mean over {m.get('logprob_gap_tokens', 0):.0f} tokens"
          + (f", fp16 overflow-skipped optimizer steps {m['fp16_skipped_steps']:.0f}" if "fp16_skipped_steps" in m else ""))
EOF
[[ $train_rc == 0 ]] || die "loopline train exited with status $train_rc (124: still running after TRAIN_TIMEOUT_S=${TRAIN_TIMEOUT_S:-420} s)"
