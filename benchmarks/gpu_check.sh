#!/usr/bin/env bash
# One-GPU check of the CUDA paths, as one short script (device machine: one H200, no internet).
#   1. tests/test_device.py tests/test_runtime_cuda.py  (the device seam dynmb/runtime/device.py on CUDA:
#      events, allocator peaks, binding a GPU, the meter on the allocator; NCCL/CUDA runtime: gradients =
#      reference, CUDA peak <= limit)
#   2. dynmb memory --device "$DEV"  (dynmb/measure/memory.py: memory model fitted on the allocator's peaks,
#      held-out error)
#   3. dynmb profile/fit --device "$DEV" (dynmb/measure/profiler.py: cost model on CUDA events, held-out error)
#   4. dynmb compare on one GPU: 2 stages interleaved on one rank (--virtual 2), with the fitted models
#   5. planning ahead on a GPU host (dynmb/runtime/planahead.py): the same run in line and with
#      --plan-ahead 1 (steps.plan_wait_s; on a GPU the host cores idle while the planner works)
#   6. studies/zerobubble/recompute_peak.py: the allocator's peak during a recomputed forward against the
#      memory model's two transients (which one the forward really holds)
#   7. the LM head split by vocabulary (ModelConfig.head_split, dynmb/models/head.py): its two shards
#      on one GPU as 2 chunks (interleaved), --verify (gradients = the single-process reference on CUDA)
#   8. stage boundaries inside half-blocks (the 1/16-layer grid, dynmb/models/pieces.py): 4 chunks on one
#      GPU (interleaved), ending inside layer 1's attention (K/V heads) and twice inside an MLP (columns:
#      one chunk holds 2/8 of it, sending and receiving [y | h]), --verify
#   9. activation offload (dynmb/runtime/offload.py, benchmarks/offload_check.py): a stage's gradients with and
#      without its blocks offloaded (bitwise), the allocator's peak lower by about the bytes offloaded, and the
#      pinned D2H / H2D bandwidth of the copy stream, written to $R/offload.json
#  10. per-stage recomputation of leading blocks (ModelConfig.recompute_blocks, dynmb/models/stage.py): 2 chunks
#      on one GPU (interleaved), the first chunk recomputing
#      its first block, --verify, and the allocator's peak against the prediction (the GPU's: pred_rank_peak_bytes)
# Usage: bash benchmarks/gpu_check.sh [results-dir]   (runs from the repo root; no install needed)
# Without a GPU, DEV=cpu MODEL=tiny QUICK=--quick SKIP_TESTS=1 GB=8 STEPS=1 LIMIT=64MiB runs steps 2-10 on the CPU (a check
# of the script and the commands, not of CUDA); ONLY=9 runs step 9 alone (either device).
set -uo pipefail
R=${1:-results/gpu_check}
mkdir -p "$R"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
D="python3 -m dynmb.cli"
MODEL=${MODEL:-gpt2}
LIMIT=${LIMIT:-6GiB}
DEV=${DEV:-cuda}
step() { echo; echo "=== $* ($(date +%T))"; }
offload_check() {     # step 9 (also alone: ONLY=9)
step activation offload
timeout 240 python3 benchmarks/offload_check.py --device "$DEV" --model "$MODEL" --out "$R/offload.json" 2>&1 | tail -3
return "${PIPESTATUS[0]}"
}
step env
nvidia-smi -L || true
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available() and torch.cuda.get_device_name())"
# SKIP_TESTS=1 skips step 1; COST=<json> uses that cost model and skips steps 3-4
if [ "${ONLY:-}" = 9 ]; then offload_check; exit $?; fi
step pytest cuda
[ -n "${SKIP_TESTS:-}" ] || timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_device.py tests/test_runtime_cuda.py
step memory model on CUDA
timeout 240 $D memory --model "$MODEL" --stages 2 ${QUICK:-} --device "$DEV" -o "$R/mem-$MODEL-p2-cuda.json" --samples "$R/mem-samples.csv"
if [ -z "${COST:-}" ]; then
step profile on CUDA
timeout 300 $D profile --model "$MODEL" --stages 2 --device "$DEV" ${QUICK:-} --repeats 3 --warmup 2 --no-memory -o "$R/prof-$MODEL-p2-cuda.csv" 2>&1 | tail -5
step fit
timeout 120 $D fit "$R/prof-$MODEL-p2-cuda.csv" --model "$MODEL" --stages 2 -o "$R/cost-$MODEL-p2-cuda.json" --plot "$R/fit.png"
else cp "$COST" "$R/cost-$MODEL-p2-cuda.json"; fi
step compare on one GPU
MM=(); [ -f "$R/mem-$MODEL-p2-cuda.json" ] && MM=(--memory-model "$R/mem-$MODEL-p2-cuda.json")
CM=(); [ -f "$R/cost-$MODEL-p2-cuda.json" ] && CM=(--cost-model "$R/cost-$MODEL-p2-cuda.json")
timeout 300 $D compare --model "$MODEL" --stages 2 --virtual 2 --device "$DEV" --memory-limit "$LIMIT" \
    --global-batch "${GB:-128}" --steps "${STEPS:-3}" --allow-over-limit "${MM[@]}" "${CM[@]}" --out "$R/compare"
step plan ahead on one GPU
for N in 0 1; do
timeout 240 $D run --nproc 1 --model "$MODEL" --stages 2 --virtual 2 --device "$DEV" --memory-limit "$LIMIT" \
    --global-batch "${GB:-128}" --steps "${STEPS:-3}" --allow-over-limit --method dynamic --schedule interleaved --plan-ahead $N \
    "${MM[@]}" "${CM[@]}" --out "$R/plan-ahead-$N" 2>&1 | tail -2
python3 -c "import dynmb,sys; t=dynmb.load_results(sys.argv[1])['steps']; print(t[['step','step_s','plan_s','plan_wait_s']].to_string())" "$R/plan-ahead-$N"
done
step recomputed forward peak
timeout 120 python3 -m studies.zerobubble.recompute_peak --device "$DEV" --model "$MODEL" --lengths 1024,4096
step head shards on one GPU
python3 -c "import json,sys; from dynmb.core.config import ModelConfig as M; c=M.preset(sys.argv[1]).to_dict(); v=c['vocab_size']; \
c.update(name=sys.argv[1]+'-heads', layer_split=[c['n_layers'], 0], head_split=[v // 3, v - v // 3]); json.dump(c, open(sys.argv[2], 'w'))" \
    "$MODEL" "$R/head-split.json"
timeout 240 $D run --nproc 1 --model "$R/head-split.json" --stages 2 --virtual 2 --device "$DEV" --memory-limit "$LIMIT" \
    --global-batch 8 --steps 1 --allow-over-limit --oversize truncate --method dynamic --schedule interleaved --verify --out "$R/head-split" 2>&1 | tail -3
step chunk split on one GPU
python3 -c "import json,sys; from dynmb.core.config import ModelConfig as M; c=M.preset(sys.argv[1]); n=c.n_layers; \
a=next(k for k in (2, 4, 8) if c.kv_heads * k % 8 == 0); u=[16 + a, 16 * (n // 2) + 12 - 16 - a, 2]; u.append(16 * n - sum(u)); \
d=c.to_dict(); d.update(name=sys.argv[1] + '-chunks', layer_split=[x / 16 for x in u]); M.from_dict(d); json.dump(d, open(sys.argv[2], 'w'))" \
    "$MODEL" "$R/chunk-split.json"
timeout 240 $D run --nproc 1 --model "$R/chunk-split.json" --stages 4 --virtual 4 --device "$DEV" --memory-limit "$LIMIT" \
    --global-batch 8 --steps 1 --allow-over-limit --oversize truncate --method dynamic --schedule interleaved --verify --out "$R/chunk-split" 2>&1 | tail -3
python3 -c "import dynmb,sys; t=dynmb.load_results(sys.argv[1]); print('verified', bool(t['steps']['verified'].all()), 'layer_split', t['runs']['model.layer_split'].iloc[0])" "$R/chunk-split"
step recomputed leading blocks on one GPU
python3 -c "import json,sys; from dynmb.core.config import ModelConfig as M; c=M.preset(sys.argv[1]); n=c.n_layers; \
d=c.to_dict(); d.update(name=sys.argv[1] + '-rcblocks', layer_split=[n - n // 2, n // 2], recompute_blocks=[1, 0]); \
M.from_dict(d); json.dump(d, open(sys.argv[2], 'w'))" "$MODEL" "$R/rc-blocks.json"
timeout 240 $D run --nproc 1 --model "$R/rc-blocks.json" --stages 2 --virtual 2 --device "$DEV" --memory-limit "$LIMIT" \
    --global-batch 8 --steps 1 --allow-over-limit --oversize truncate --method dynamic --schedule interleaved --verify --out "$R/rc-blocks" 2>&1 | tail -3
python3 -c "import dynmb,sys; t=dynmb.load_results(sys.argv[1]); m=t['memory']; print('verified', bool(t['steps']['verified'].all()), \
'recompute_blocks', t['runs']['model.recompute_blocks'].iloc[0]); print(m.groupby('stage')[['peak_bytes','pred_peak_bytes','pred_rank_peak_bytes']].max().to_string())" "$R/rc-blocks"
offload_check
step done
