#!/usr/bin/env bash
# The GPU machine's side of the H200 runs (docs/ladder.md, "How the H200 figures were made").
#
#   bash bench/device.sh h200 OUT COMMIT     one H200: `quantloop ladder`, then `quantloop run`
#                                            on the ladder's workload shape, then bulk
#                                            inference eager vs fast, then (time left) rung 14
#   bash bench/device.sh ddp OUT COMMIT      two (or more) H200s: bench/ddp.py
#   bash bench/device.sh ddp-ctas OUT COMMIT two (or more) H200s: the no-all-reduce control,
#                                            NCCL's blocks per collective swept (CTAS),
#                                            then bench/ddp.py in full with the best
#   bash bench/device.sh gap OUT COMMIT      one H200, one machine: the loader per batch, the
#                                            ladder's rungs 1 and 10, the research training
#                                            alone (bench/train_alone.py), `quantloop run`
#   bash bench/device.sh research OUT COMMIT one H200: `quantloop run` only, `auto` reading
#                                            the committed ladder result; twice, on two
#                                            fresh homes (the spread of a cold run)
#   bash bench/device.sh turnaround OUT COMMIT one H200: bench/turnaround.py, `quantloop run`
#                                            from process start to exit (cold, no-op, one
#                                            feature changed, training changed), REPEAT (3)
#                                            each, on the ladder's workload shape; CASES
#                                            picks them (bench/turnaround.py --cases),
#                                            COLD_REPEAT the cold runs, TURN_NAME the files;
#                                            CUDA_OPEN=1 (or trace): bench/cuda_open.py first;
#                                            WARM_FORK=1: bench/warm_fork.py before it
#   bash bench/device.sh spy OUT COMMIT      one H200: a cold `quantloop run` served by the
#                                            warm process, a "training changed" re-run, then a
#                                            no-op and another "training changed" under py-spy
#                                            (the warm process and its children, every
#                                            thread, idle samples kept: OUT/spy-*.txt, raw
#                                            stacks); py-spy's wheel in WHEELS or EXTRA_WHEELS
#   bash bench/device.sh research-sweep OUT COMMIT  one H200: `quantloop run` of a sweep with
#                                            walk-forward folds (research-h200-sweep.json)
#   bash bench/device.sh sweep OUT COMMIT    one H200: bench/sweep.py (K models as one stack,
#                                            against one after another and K processes);
#                                            SWEEP_ARGS picks its parts (--parts, --ks, --steps)
#
# The machine has torch, Triton, numpy, pyarrow, pandas, scipy ... but not Prefect, MLflow
# or Dask: their wheels (and quantloop's, built from COMMIT) travel in WHEELS (default
# .whl/lite: `python bench/wheelhouse.py` makes it, and the call carries it) and are
# installed with --no-deps into /tmp/site. Everything the runs write goes to OUT (8 files).
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
stage=$1 out=$2 commit=$3
wheels=${WHEELS:-.whl/lite}
preset=${PRESET:-h200} params=${PARAMS:-bench/params/research-h200.json}  # CPU rehearsal: cpu_tiny
# Lent an H100 for an H200 call (as most asks since 2026-12-04 were): research-h200.json's
# `auto` would train the plain loop there (no ladder result names that card), which is
# not the figure asked for; the same shape with the H200's proven rungs named instead.
if [ -z "${PARAMS:-}" ] && nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null \
    | grep -q H100; then
  params=bench/params/research-h100.json
  echo "an H100, not an H200: $params (the H200's rungs named)"
fi
start=$SECONDS
mkdir -p "$out"
export PYTHONUNBUFFERED=1 QUANTLOOP_GIT_COMMIT=$commit MPLBACKEND=Agg
export PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_HOME=/tmp/prefect-home
# NVLink multicast stays off, also in every process these start (KINDS.md)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used --format=csv
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, "gpus", torch.cuda.device_count())'

if [ "$stage" = ddp-nograph ]; then  # the same without the whole-step CUDA graph
  sw=compile,bf16,device_metrics,fused_kernel,streams,packing,flex_attention
  for n in 1 2; do
    python3 -m torch.distributed.run --standalone --nproc-per-node $n bench/ddp.py --out "$out" \
      --commit "$commit" --work /tmp/ddp-nograph --switches $sw --name ladder-h200x2-nograph
  done 2>&1 | grep -v Warn | tee "$out/ddp-nograph.log" | tail -4
  exit 0
fi
if [ "$stage" = ddp-ctas ]; then  # the all-reduce under backward: NCCL's blocks capped
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade \
    --target /tmp/site "$wheels"/*.whl || exit 1  # pydantic, for the workload's config
  export PYTHONPATH=/tmp/site
  run() { timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node "$1" \
            bench/ddp.py --out "$out" --commit "$commit" --work /tmp/ddp "${@:2}" 2>&1 \
            | grep -v Warn; }
  n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  run 1 | tail -1
  run "$n" --no-allreduce | tail -1 | cut -c1-300  # the control: the step alone
  for c in ${CTAS:-0 4 8 16}; do
    run "$n" --throughput-only --nccl-ctas "$c" --name "ddp-x$n-ctas$c" | tail -1
  done
  echo "== sweep done at $((SECONDS - start)) s"
  # the full run (equivalence, throughput, trace) with the cap of the shortest step
  best=$(python3 -c 'import json, sys
runs = [json.load(open(f)) for f in sys.argv[1:]]
print(min(runs, key=lambda r: r["step_ms"])["nccl_ctas"])' "$out"/ddp-x$n-ctas*.json)
  echo "== shortest step with --nccl-ctas $best"
  run "$n" --nccl-ctas "$best" | tail -1 | cut -c1-1500
  echo "== at $((SECONDS - start)) s"
  exit 0
fi
if [ "$stage" = ddp ]; then
  if [ -z "${SKIP_ALONE:-}" ]; then
  # first, on GPU 0: the research run's training outside the flow (bench/train_alone.py)
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade \
    --target /tmp/site "$wheels"/*.whl && \
    PYTHONPATH=/tmp/site CUDA_VISIBLE_DEVICES=0 timeout 150 python3 bench/train_alone.py \
      --params bench/params/research-h200.json --out "$out" 2>&1 | grep -v Warning | tail -8
  echo "== train_alone at $((SECONDS - start)) s"
  fi
  n=$(python3 -c 'import torch; print(torch.cuda.device_count())')
  run() { python3 -m torch.distributed.run --standalone --nproc-per-node "$1" bench/ddp.py \
            --out "$out" --commit "$commit" "${@:2}"; }
  { run 1 --work /tmp/ddp && run "$n" --work /tmp/ddp; } 2>&1 | tee "$out/ddp.log"
  if [ "${PIPESTATUS[0]}" != 0 ]; then
    echo "== the graphed run failed: again without the whole-step CUDA graph" | tee -a "$out/ddp.log"
    sw=compile,bf16,device_metrics,fused_kernel,streams,packing,flex_attention
    { run 1 --work /tmp/ddp-nograph --switches $sw \
        && run "$n" --work /tmp/ddp-nograph --switches $sw; } 2>&1 | tee -a "$out/ddp.log"
  fi
  exit 0
fi

if [ "$stage" = gap ]; then  # the research run against the top rung, one machine
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade \
    --target /tmp/site "$wheels"/*.whl || exit 1
  export PYTHONPATH=/tmp/site
  params=$(realpath "$params")
  if [ -z "${SKIP_LOADER:-}" ]; then
    timeout 90 python3 bench/loader.py --params "$params" --out "$out" --commit "$commit" \
      2>&1 | tail -5
    echo "== loader at $((SECONDS - start)) s"
  fi
  timeout 150 python3 bench/ladder.py --out /tmp/gap --work /tmp/gap-work --preset $preset \
    --rungs 1,10 --controls "" --commit "$commit" --name ladder-h200-gap > /tmp/gap.log 2>&1
  echo "== ladder rungs 1,10 rc $? at $((SECONDS - start)) s"; tail -4 /tmp/gap.log
  cp /tmp/gap/ladder-h200-gap.json "$out/"
  if [ -z "${SKIP_ALONE:-}" ]; then
    timeout 120 python3 bench/train_alone.py --params "$params" --out "$out" 2>&1 \
      | grep -v Warn | tail -2
    echo "== train_alone at $((SECONDS - start)) s"
  fi
  home=/tmp/qhome-$commit  # fresh: a warm machine keeps /tmp, and a cached model is not a run
  rm -rf $home && mkdir -p $home/ladder && cp bench/results/ladder-h200.json $home/ladder/ladder.json
  (cd /tmp && timeout 220 python3 -P -m quantloop.cli run --params "$params" --home $home \
    --summary-json "$out/research-h200.json" > /tmp/research.log 2>&1)
  echo "== research rc $? at $((SECONDS - start)) s"; tail -12 /tmp/research.log
  tar czf "$out/mlflow-h200.tar.gz" -C $home --exclude='*/trace/*' mlflow.db mlartifacts
  for f in /tmp/gap.log /tmp/research.log $home/logs/*.log; do
    [ -f "$f" ] && { echo "===== $f"; cat "$f"; }
  done > "$out/run.log"
  exit 0
fi
if [ "$stage" = research-sweep ]; then  # `quantloop run` of a sweep with walk-forward folds
  # (bench/params/research-h200-sweep.json): one run on a fresh home, `auto` reading the
  # committed ladder result; its summary, log and MLflow store come back
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade \
    --target /tmp/site "$wheels"/*.whl || exit 1
  export PYTHONPATH=/tmp/site
  echo "== wheels installed at $((SECONDS - start)) s"
  params=$(realpath "${PARAMS:-bench/params/research-h200-sweep.json}") out=$(realpath "$out")
  home=/tmp/qhome-sweep
  rm -rf $home && mkdir -p $home/ladder
  cp bench/results/ladder-h200.json $home/ladder/ladder.json
  (cd /tmp && timeout "${SWEEP_RUN_TIMEOUT:-240}" python3 -P -m quantloop.cli run \
    --params "$params" --home $home --summary-json "$out/research-h200-sweep.json" \
    > /tmp/research-sweep.log 2>&1)
  echo "== research sweep rc $? at $((SECONDS - start)) s"; tail -40 /tmp/research-sweep.log
  tar czf "$out/mlflow-h200-sweep.tar.gz" -C $home --exclude='*/trace/*' mlflow.db mlartifacts
  for f in /tmp/research-sweep.log $home/logs/*.log; do
    [ -f "$f" ] && { echo "===== $f"; cat "$f"; }
  done > "$out/research-sweep.log"
  exit 0
fi
if [ "$stage" = sweep ]; then  # K models trained as one stack (bench/sweep.py)
  # Prefect, pydantic ... for the imports of the data stages; not quantloop's own wheel:
  # bench/sweep.py imports this checkout (bench/checkout.py), the code under test.
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site \
    $(ls "$wheels"/*.whl | grep -v '/quantloop-') || exit 1
  echo "== wheels installed at $((SECONDS - start)) s"
  export PYTHONPATH=/tmp/site TORCHINDUCTOR_CACHE_DIR=/tmp/sweep-inductor
  rm -rf /tmp/sweep-inductor
  # shellcheck disable=SC2086  # SWEEP_ARGS is a list of flags
  timeout "${SWEEP_TIMEOUT:-540}" python3 bench/sweep.py --params "$params" --out "$out" \
    ${SWEEP_ARGS:-} 2>&1 | grep --line-buffered -v Warn | tee "$out/sweep.log"
  echo "== sweep rc ${PIPESTATUS[0]} at $((SECONDS - start)) s"
  exit 0
fi
if [ "$stage" = turnaround ]; then  # `quantloop run` from process start to exit
  # Byte-compiled at install, as any install is: with --no-compile every process there
  # compiled Prefect's and MLflow's sources again (the image does not keep bytecode).
  # EXTRA_WHEELS: a folder of more wheels (an A/B: the dependencies in WHEELS, each
  # half's quantloop wheel in a folder of its own)
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade \
    --target /tmp/site "$wheels"/*.whl ${EXTRA_WHEELS:+"$EXTRA_WHEELS"/*.whl} || exit 1
  echo "== wheels installed at $((SECONDS - start)) s"
  params=$(realpath "$params") out=$(realpath "$out")
  if [ -n "${WARM_FORK:-}" ]; then  # first: do the warm process's children work (an
    # export, a compiled CUDA step after the warm-up; bench/warm_fork.py)
    (cd /tmp && PYTHONPATH=/tmp/site timeout 180 python3 -P "$repo/bench/warm_fork.py") \
      > "$out/warm-fork.jsonl" 2>/tmp/warm-fork.err
    echo "== warm_fork rc $? at $((SECONDS - start)) s"
    cut -c1-3000 "$out/warm-fork.jsonl"; tail -3 /tmp/warm-fork.err | cut -c1-500
  fi
  if [ -n "${CUDA_OPEN:-}" ]; then  # first: does the warm process open the CUDA driver
    # (it then serves no one and the bench waits 300 s for nothing: stop here instead);
    # CUDA_OPEN=trace: the step that opens it, traced (minutes)
    (cd /tmp && PYTHONPATH=/tmp/site timeout 300 python3 -P "$repo/bench/cuda_open.py" \
      $([ "$CUDA_OPEN" = trace ] && echo --trace)) > "$out/cuda-open.jsonl" 2>/tmp/cuda-open.err
    rc=$?
    cut -c1-3000 "$out/cuda-open.jsonl"
    echo "== cuda_open rc $rc at $((SECONDS - start)) s"
    [ $rc = 0 ] || { tail -5 /tmp/cuda-open.err; exit 1; }
  fi
  # A warm machine keeps /tmp: end the resident Prefect APIs a call that ran out of time
  # left (they run in sessions of their own), then start from empty homes and empty
  # Inductor and Triton caches, as a fresh machine would.
  for h in /tmp/turn/*/; do
    [ -d "$h/prefect" ] && (cd /tmp && PYTHONPATH=/tmp/site python3 -P -m quantloop.cli api \
      stop --home "$h" > /dev/null 2>&1)
  done
  rm -rf /tmp/turn /tmp/turn-inductor /tmp/turn-triton
  export TORCHINDUCTOR_CACHE_DIR=/tmp/turn-inductor TRITON_CACHE_DIR=/tmp/turn-triton
  # From /tmp with -P, PYTHONPATH the wheels alone: the runs (`python3 -m quantloop.cli`,
  # no `quantloop` script beside python3) and their servers and workers import quantloop
  # from /tmp/site, never the checkout's folders; turnaround.py puts the checkout on its
  # own path (bench/report.py). The LOBSTER samples (../shared) do not travel: skipped.
  (cd /tmp && PYTHONPATH=/tmp/site timeout "${TURN_TIMEOUT:-540}" python3 -P \
    "$repo/bench/turnaround.py" --data "${DATA:-synthetic,lobster}" --repeat "${REPEAT:-3}" \
    ${CASES:+--cases "$CASES"} ${COLD_REPEAT:+--cold-repeat "$COLD_REPEAT"} \
    --params "$params" --name "${TURN_NAME:-turnaround-h200}" --results "$out" \
    --work /tmp/turn) 2>&1 \
    | grep --line-buffered -v Warn | tee /tmp/turnaround.log
  echo "== turnaround rc ${PIPESTATUS[0]} at $((SECONDS - start)) s"
  # one log: the bench's output, then every run's log and the resident APIs' logs; each
  # run's phases (<log>.profile.json) apart, which outlive a run out of time
  for f in /tmp/turnaround.log /tmp/turn/*/logs/*.log /tmp/turn/*/prefect/server.log; do
    [ -f "$f" ] && { echo "===== $f"; cat "$f"; }
  done > "$out/run.log"
  (cd /tmp/turn 2>/dev/null && find . -name '*.profile.json' -print0 \
    | tar czf "$out/turnaround-profiles.tar.gz" --null -T -)
  ls -la "$out"
  exit 0
fi
if [ "$stage" = spy ]; then  # where a warm "training changed" run's fixed costs go
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade \
    --target /tmp/site "$wheels"/*.whl ${EXTRA_WHEELS:+"$EXTRA_WHEELS"/*.whl} || exit 1
  export PYTHONPATH=/tmp/site TORCHINDUCTOR_CACHE_DIR=/tmp/spy-inductor \
    TRITON_CACHE_DIR=/tmp/spy-triton
  echo "== wheels installed at $((SECONDS - start)) s"
  params=$(realpath "$params") out=$(realpath "$out") home=/tmp/spy-home
  (cd /tmp && python3 -P -m quantloop.cli api stop --home $home > /dev/null 2>&1)
  rm -rf $home /tmp/spy-inductor /tmp/spy-triton && mkdir -p $home
  seeded() {  # the params with the training seed set to $1 (bench/turnaround.py's case)
    python3 -c 'import json, sys; p = json.load(open(sys.argv[1]))
p.setdefault("train", {})["seed"] = int(sys.argv[2]); print(json.dumps(p))' "$params" "$1" \
      > "/tmp/spy-params-$1.json"
    echo "/tmp/spy-params-$1.json"
  }
  # `-m quantloop` is the executable's way in: served by the warm process, which is started
  # (a command that fails at once starts it) and waited for first; `-m quantloop.cli`
  # would run in the command's own interpreter, and py-spy would find no warm process
  runq() { (cd /tmp && timeout 240 python3 -P -m quantloop run --params "$1" --home $home \
             --summary-json "$out/summary-$2.json" > "/tmp/spy-$2.log" 2>&1)
           echo "== $2 rc $? at $((SECONDS - start)) s"; tail -3 "/tmp/spy-$2.log"; }
  (cd /tmp && python3 -P -m quantloop run --lobster /nonexistent-warm-up > /dev/null 2>&1)
  for _ in $(seq 600); do
    pid=$(cd /tmp && python3 -P -m quantloop.forkserver --ping 2> /dev/null) && break; sleep 0.5
  done
  echo "== warm process ${pid:-none} at $((SECONDS - start)) s"
  [ -n "${pid:-}" ] || exit 1
  runq "$params" cold
  runq "$(seeded 100)" changed-100
  spied() {  # $1 the params, $2 the name: the run under py-spy, attached to the warm process
    /tmp/site/bin/py-spy record --pid "$pid" --subprocesses --idle --threads --nonblocking \
      --rate 250 --format raw --output "$out/spy-$2.txt" > "/tmp/spy-record-$2.log" 2>&1 &
    local spy=$!
    sleep 2
    runq "$1" "$2"
    kill -INT $spy; wait $spy; echo "== py-spy rc $?"; tail -3 "/tmp/spy-record-$2.log"
  }
  spied "$(seeded 100)" noop-100      # every node, the model and the simulation found
  spied "$(seeded 101)" changed-101
  for f in /tmp/spy-*.log $home/logs/*.log; do echo "===== $f"; cat "$f"; done > "$out/run.log"
  (cd $home && find . -name '*.profile.json' -print0 | tar czf "$out/profiles.tar.gz" --null -T -)
  (cd /tmp && python3 -P -m quantloop.cli api stop --home $home > /dev/null 2>&1)
  ls -la "$out"
  exit 0
fi
if [ "$stage" = research ]; then
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade \
    --target /tmp/site "$wheels"/*.whl || exit 1
  export PYTHONPATH=/tmp/site
  echo "== wheels installed at $((SECONDS - start)) s"
  params=$(realpath "$params")
  for i in 1 2; do
    home=/tmp/qhome-$i
    rm -rf $home && mkdir -p $home/ladder  # fresh: a warm machine keeps /tmp
    cp bench/results/ladder-h200.json $home/ladder/ladder.json
    (cd /tmp && timeout 240 python3 -P -m quantloop.cli run --params $params --home $home \
      --summary-json "$out/research-h200-$i.json" > /tmp/research-$i.log 2>&1)
    echo "== research $i rc $? at $((SECONDS - start)) s"; tail -12 /tmp/research-$i.log
    grep -h "process of its own\|trained on" $home/logs/*.log | tail -3
  done
  tar czf "$out/mlflow-h200.tar.gz" -C /tmp/qhome-1 --exclude='*/trace/*' mlflow.db mlartifacts
  for f in /tmp/research-*.log /tmp/qhome-*/logs/*.log; do echo "===== $f"; cat "$f"; done \
    > "$out/run.log"
  exit 0
fi

if [ -z "${SKIP_INSTALL:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade \
    --target /tmp/site "$wheels"/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
echo "== wheels installed at $((SECONDS - start)) s"
home=${QHOME:-/tmp/qhome}
# 1. the ladder flow (Prefect's ephemeral API, MLflow's SQLite store under home); rung 14
#    (autotune) apart, at the end: its compile takes minutes
# from /tmp: the checkout's quantloop/ folder (without its package-dir mapping) must not
# shadow the installed wheel, here or in the subprocesses (Prefect's server, Dask workers)
params=$(realpath "$params")
cd /tmp
timeout 330 python3 -P -m quantloop.cli ladder --preset $preset --home $home --rungs 1,2,3,4,5,6,7,8,9,10,11,12,13 \
  > /tmp/ladder.log 2>&1
echo "== ladder rc $? at $((SECONDS - start)) s"; tail -25 /tmp/ladder.log
cp $home/ladder/ladder.json "$out/ladder-h200.json"
cp $home/ladder/ladder.md "$out/ladder-h200.md"
(cd $home/ladder && tar czf "$out/ladder-h200.traces.tar.gz" trace-*.json)
# 2. the research loop on the ladder's workload shape; `auto` reads home/ladder/ladder.json
timeout 200 python3 -P -m quantloop.cli run --params $params --home $home \
  --summary-json "$out/research-h200.json" > /tmp/research.log 2>&1
echo "== research rc $? at $((SECONDS - start)) s"; tail -30 /tmp/research.log
cd "$repo"
grep -h "training optimizations\|trained on\|predicted" $home/logs/*.log | tail -5
# 3. bulk inference over unseen days, eager against the fast path
model=$(python3 -c "import json; print(json.load(open('$out/research-h200.json'))['model_url'])")
timeout 90 python3 bench/inference.py --model "$model" --out "$out" --commit "$commit" \
  --params $params --days 3 2>&1 | tail -22
echo "== inference at $((SECONDS - start)) s"
# MLflow's store and artifacts, less the rung traces (they are in the traces tarball)
tar czf "$out/mlflow-h200.tar.gz" -C $home --exclude='*/trace/*' mlflow.db mlartifacts
# 4. rung 14 in the time left (bench/ladder.py: rung 1 again as its reference)
left=$((560 - (SECONDS - start)))
if [ $left -gt 120 ] && [ -z "${SKIP_AUTOTUNE:-}" ]; then
  timeout $left python3 bench/ladder.py --out /tmp/autotune --work /tmp/autotune-work \
    --preset $preset --rungs 1,14 --controls fp32 --commit "$commit" --name ladder-h200-autotune \
    > /tmp/autotune.log 2>&1
  echo "== autotune rc $? at $((SECONDS - start)) s"
  tail -6 /tmp/autotune.log
  cp /tmp/autotune/ladder-h200-autotune.json "$out/" 2>/dev/null
else
  echo "== autotune not run: $left s left"
fi
# one log of every step (the 8-file limit): ladder, research run (and its log file), rung 14
for f in /tmp/ladder.log /tmp/research.log $home/logs/*.log /tmp/autotune.log; do
  [ -f "$f" ] && { echo "===== $f"; cat "$f"; }
done > "$out/run.log"
ls -la "$out"
