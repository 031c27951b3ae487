#!/usr/bin/env bash
# The closed loop on CPU: profile the engine, fit a cost model, learn a drafting policy in the
# simulator on the RL run's own workload, then run RL with the learned policy against SD off
# and static k, and print the simulator's predicted generation-stage gains beside the
# measured ones. About 6-9 minutes on 2 cores.
#
#   bench/closed_loop.sh                  # results: bench/results/closed_loop.{json,txt}
#   STEPS=20 PILOT=6 REPEATS=12 WORK=/tmp/loop NAME=closed_loop_long bench/closed_loop.sh
set -euo pipefail
cd "$(dirname "$0")/.."
RLSCHED=${RLSCHED:-.venv/bin/rlsched}
PY=${PY:-.venv/bin/python}
STEPS=${STEPS:-10}  # RL steps of each measured run
STATIC=${STATIC:-"1 2 3 4"}
REPEATS=${REPEATS:-3}  # timed runs per profile point (their median prices it)
WORK=${WORK:-$(mktemp -d /tmp/rlsched-loop.XXXXXX)}
mkdir -p "$WORK"
t0=$(date +%s)
say() { echo "[$(($(date +%s) - t0)) s] $*" >&2; }

say "1/6 profile the engine (built-in pair) -> $WORK/profile"
$RLSCHED profile --out "$WORK/profile" --batch-sizes 1,2,4,8,16,32,64 --k-max 6 --contexts 24,48 --repeats "$REPEATS" >/dev/null
say "2/6 fit the cost model -> $WORK/cost.json"
$RLSCHED fit "$WORK/profile" --out "$WORK/cost.json" >/dev/null
# The pilot spans a drafter update (every 4 steps by default): acceptance falls as the actor
# moves away from the drafter and rises after each distillation, so a pilot of the first few
# steps alone would tell the simulator a higher acceptance than the measured runs see.
PILOT=${PILOT:-6}
say "3/6 a $PILOT-step pilot run for the workload (lengths, acceptance)"
$RLSCHED run --policy static:2 --set steps=$PILOT --out "$WORK/pilot" --json >/dev/null 2>&1
$PY - "$WORK" <<'PYEOF'
import sys, yaml
from rlsched.analysis.replay import sim_config_from_run
w = sys.argv[1]
yaml.safe_dump(sim_config_from_run(f"{w}/pilot", f"{w}/cost.json"), open(f"{w}/sim.yaml", "w"), sort_keys=False)
PYEOF
say "4/6 learn a table policy in the simulator -> $WORK/policy.json"
$RLSCHED learn --config "$WORK/sim.yaml" --out "$WORK/policy.json" --workers 2 >/dev/null
POLICIES="off"
for k in $STATIC; do POLICIES="$POLICIES,static:$k"; done
POLICIES="$POLICIES,goodput,table:$WORK/policy.json"
say "5/6 predicted: rlsched compare --policies $POLICIES"
$RLSCHED compare --config "$WORK/sim.yaml" --policies "$POLICIES" --seeds 2 --workers 2 --json \
    --out "$WORK/compare" > "$WORK/predicted.json"
say "6/6 measured: rlsched run x $(echo "$POLICIES" | tr ',' '\n' | wc -l), $STEPS RL steps each, in lockstep"
# one process, one RL step of each run in turn: a slow spell of this shared machine hits every
# policy's run instead of the one it fell on
$PY - "$WORK" "$POLICIES" "$STEPS" <<'PYEOF' >/dev/null 2>&1
import re, sys
sys.path.insert(0, "bench")
from _common import lockstep
from rlsched.executor.rl.config import build_run_config
from rlsched.executor.rl.trainer import Trainer
work, policies, steps = sys.argv[1], sys.argv[2].split(","), int(sys.argv[3])
name = lambda p: re.sub(r"table:.*", "table", p).replace(":", "-")
lockstep([Trainer(build_run_config({}, [f"policy={p}", f"steps={steps}"]), f"{work}/run-{name(p)}")
          for p in policies], steps)
PYEOF
$PY bench/closed_loop_report.py "$WORK" "$POLICIES" "$(($(date +%s) - t0))" "${NAME:-closed_loop}"
