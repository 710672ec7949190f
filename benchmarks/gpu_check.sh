#!/usr/bin/env bash
# The GPU path of issue 56 in one run of under 8 minutes, from the repository root after `pip install -e ".[test]"`:
#   (a) the tests marked gpu; (b) round_overhead on ResNet10 at width 1.0 and 0.25 on cuda, eager and compiled
#   (CUDA graphs), against the plain loop eager and compiled; (c) four Ray client actors sharing the GPU
#   (resources.gpus_per_worker=0.25); (d) the default job on cuda, its rounds cut to GPU_CHECK_DEFAULT_ROUNDS (10 of
#   25) so the whole fits the 8 minutes.
# Writes ONE JSON file of figures: $1, else $OUT/gpu_check.json, else ./gpu_check.json. Each step has its own time
# cap, cut further to what is left of GPU_CHECK_BUDGET_S (440 s), so one hung step cannot eat the others' time.
# Without CUDA it says so and exits 0. GPU_CHECK_DEVICE=cpu is for checking this script on a machine without a GPU
# only: every command runs on the CPU at toy sizes (no GPU fractions), so each is known to parse and start.
set -u
out=${1:-${OUT:+$OUT/gpu_check.json}}
out=${out:-./gpu_check.json}
py=${PYTHON:-python}
device=${GPU_CHECK_DEVICE:-cuda}
budget=${GPU_CHECK_BUDGET_S:-440}  # + a step's 15 s to die + the JSON: under 8 minutes
default_rounds=${GPU_CHECK_DEFAULT_ROUNDS:-10}

if [ "$device" = cuda ] && [ "$("$py" -c 'import torch; print(torch.cuda.is_available())' 2>/dev/null)" != True ]; then
    echo "gpu_check: no CUDA device here (torch.cuda.is_available() is not True): nothing measured, no JSON written"
    exit 0
fi
if [ "$device" = cuda ]; then  # the measurement's sizes
    clients=20 samples=64 rounds=5 frac=0.25 cpus=1 short_rounds=3
else  # the dry run's: the same commands, toy sizes, no GPU to share
    clients=2 samples=16 rounds=2 frac=0 cpus=0.5 short_rounds=2 default_rounds=2  # cpus: 4 actors on 2 cores
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$work/inductor}  # cold: the compile seconds are a cold cache's
export PYTHONUNBUFFERED=1
start=$(date +%s)
: >"$work/steps.tsv"

# step NAME CAP_S COMMAND...: runs COMMAND under `timeout` (SIGINT first, so Ray shuts down; KILL 15 s later),
# its output in $work/NAME.log, and records name, exit status and seconds.
step() {
    local name=$1 cap=$2 left t0 rc
    shift 2
    left=$((budget - ($(date +%s) - start)))
    [ "$left" -lt "$cap" ] && cap=$left
    if [ "$cap" -lt 5 ]; then
        echo "gpu_check: $name skipped: the ${budget} s budget is spent"
        printf '%s\t%s\t%s\t%s\n' "$name" skipped 0 0 >>"$work/steps.tsv"
        return
    fi
    echo "gpu_check: $name (at most ${cap} s): $*"
    t0=$(date +%s)
    timeout -s INT -k 15 "$cap" "$@" >"$work/$name.log" 2>&1
    rc=$?
    printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(($(date +%s) - t0))" "$cap" >>"$work/steps.tsv"
    echo "gpu_check: $name exit $rc after $(($(date +%s) - t0)) s"
}

step tests 60 "$py" -m pytest -q -n 0 -p no:cacheprovider -m gpu --junitxml "$work/tests.xml" tests
for width in 1.0 0.25; do
    step "round_overhead_w$width" 130 "$py" benchmarks/round_overhead.py --device "$device" --model resnet10 \
        --width "$width" --clients "$clients" --samples-per-client "$samples" --rounds "$rounds" --workers 1 \
        --reference-threads 1 --backends reference,local --compile off train --out "$work/round_overhead_w$width.jsonl"
done
step ray_fractions 60 "$py" -m fedsap_ray.cli run --preset smoke --backend ray --out "$work/ray_fractions" \
    --run-id gpu_fractions --quiet --set resources.device="$device" --set resources.gpus_per_worker="$frac" \
    --set resources.num_workers=4 --set resources.cpus_per_worker="$cpus" --set training.rounds="$short_rounds"
step default_job 100 "$py" -m fedsap_ray.cli run --out "$work/default_job" --run-id default_job --quiet \
    --set resources.device="$device" --set training.rounds="$default_rounds"

"$py" - "$work" "$out" "$device" "$default_rounds" <<'EOF'
"""Gathers the steps' figures into one JSON file (a step that failed or ran out of time keeps its exit status)."""
import json
import platform
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import torch

work, out, device, default_rounds = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])


def tail(name, n=15):
    log = work / f"{name}.log"
    return log.read_text(errors="replace").splitlines()[-n:] if log.exists() else []


def run_figures(folder):
    """Per-round wall seconds, final accuracy and the workers that trained, from a run's results."""
    from fedsap_ray import results

    res = results.load(folder)
    per_round = res.rounds.groupby("round")  # a row per round and domain: the round's wall time is on each
    wall = per_round["round_wall_s"].first().sort_index().tolist() if "round_wall_s" in res.rounds else []
    return {"rounds": int(res.rounds["round"].max()), "round_wall_s": [round(float(s), 3) for s in wall],
            "mean_round_wall_s_after_1": round(sum(wall[1:]) / len(wall[1:]), 3) if len(wall) > 1 else None,
            "workers_seen": int(res.clients["worker"].nunique()),
            "final_global_accuracy": float(res.runs["final_global_accuracy"].iloc[-1])
            if len(res.runs) and "final_global_accuracy" in res.runs else None}  # a run cut short has no row


steps = {}
for line in (work / "steps.tsv").read_text().splitlines():
    name, rc, secs, cap = line.split("\t")
    entry = {"exit": rc if rc == "skipped" else int(rc), "secs": int(secs), "cap_s": int(cap),
             "timed_out": rc in ("124", "137")}
    try:
        if name == "tests" and (work / "tests.xml").exists():
            suite = ET.parse(work / "tests.xml").getroot().iter("testsuite").__next__()
            entry.update({k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")})
        elif name.startswith("round_overhead") and (work / f"{name}.jsonl").exists():
            entry["lines"] = [json.loads(x) for x in (work / f"{name}.jsonl").read_text().splitlines() if x.strip()]
        elif name in ("ray_fractions", "default_job") and (work / name / "rounds").exists():  # rounds done, maybe cut
            entry.update(run_figures(work / name))
    except Exception as e:  # a figure that cannot be read is reported, the other steps' figures still written
        entry["read_error"] = repr(e)
    if entry["exit"] != 0:
        entry["log_tail"] = tail(name)
    steps[name] = entry

report = {"device": device, "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
          "torch": torch.__version__, "cuda": torch.version.cuda, "python": platform.python_version(),
          "default_job_rounds": default_rounds, "steps": steps}
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(json.dumps(report, indent=1) + "\n")
print(f"gpu_check: figures in {out}: " + ", ".join(f"{k} exit {v['exit']}" for k, v in steps.items()))
EOF
