#!/usr/bin/env bash
# The asynchronous loop against the synchronous one on the lent TPU v5e, in one device call
# (benchmarks/README.md, "TPU v5e, measured"):
#
#     device run, carry [".whl-tpu"]:  . .whl-tpu/install.sh && bash benchmarks/chip.sh [shipped] [latency] [bench]
#
# The shipped FrozenLake example async then sync (the chip holds the learner, actors sample on the
# host's cores), then the 0.5 s-per-environment-step protocol (utilisation.py's settings) both
# ways; every run under a timeout, so a hang costs its slot and not the call. The table of all
# runs goes to $OUT/chip.md and $OUT/chip.json (benchmarks/run_figures.py), each run's log to $OUT.
# host_cpu.py always first (~15 s); shipped (seeds CHIP_SEEDS, default 0 1) and latency by default (~9 minutes); `latency` alone gives its synchronous run the ~5
# minutes it needs to reach 0.9; `bench` alone (~8 minutes) runs `stoker bench` on benchmarks/chip/; `flags` (~1 minute a variant) the grad step under grad_flags.py's variants; `step` (~4 minutes a manifest under remat auto) the learner's whole step at real size; `actors` (~1 minute a flag set) eight actor loops at once for each of CHIP_ACTOR_FLAGS' flag sets (default: XLA's pools against one thread each); `variants` the example with CHIP_VARIANTS' spec overrides (below); `duty` the learner alone, fed by a full buffer; `decode` (~8 minutes) the write-and-attend kernel against the two, whole sampler calls on the kernels with where their device time went, and top-p / top-k draws; `colocated` (~6 minutes) a 0.5B-shaped policy sampling and training on the chip; `head` (~4 minutes) the LM head fused with the draw or apart. CHIP_SECONDS scales every limit (e.g. 0.2 for a quick check on a CPU machine).
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
OUT=${OUT:-$ROOT/runs/chip}
WORK=${CHIP_WORK:-/tmp/stoker-chip}
SCALE=${CHIP_SECONDS:-1}
rm -rf "$WORK" && mkdir -p "$OUT" "$WORK"
cd "$WORK"  # not the project root: its folder stoker/ (the core alone) would shadow the installed package

limit() { "$PYTHON" -c "print(max(10, int($1 * $SCALE)))"; }

# run NAME SECONDS MANIFEST MODE: `stoker run` to 0.9, stopped cleanly a little before SECONDS.
run() {
    local name=$1 seconds profile=(); seconds=$(limit "$2")
    # CHIP_PROFILE=1: where the first async run's processes wait ($OUT/shipped-async-profiles.txt).
    # Off by default: on the host's Python 3.11 an actor once died while profiled (reading other
    # threads' frames), and that cost the run its measurement.
    [ "$name" = shipped-async-s0 ] && [ "${CHIP_PROFILE:-0}" = 1 ] && profile=(--profile)
    # -k 40: `stoker run` gives its children 30 s to stop (a learner's last checkpoint).
    timeout -k 40 "$seconds" "$PYTHON" -m stoker.cli run "$3" --mode "$4" --run-dir "$WORK/$name" --no-progress ${profile[@]+"${profile[@]}"} \
        --target-success 0.9 --max-minutes "$("$PYTHON" -c "print(round(($seconds - 15) / 60, 2))")" \
        > "$WORK/$name.log" 2>&1
    echo "$name: exit $? after ${SECONDS}s of the script" | tee -a "$OUT/chip.log"
    reap "$WORK/$name"
}

# reap RUN_DIR: wait (60 s at most) until no process of that run is left, then kill what is. A
# child that outlives a killed `stoker run` (a learner still checkpointing, the TPU runtime
# shutting down) would hold the chip, and every later run would fail to open it.
reap() {
    local i
    for i in $(seq 60); do
        pgrep -f -- "$1(/| |\$)" > /dev/null || return 0
        sleep 1  # polling for the processes to be gone
    done
    echo "$1: processes left after 60 s, killed: $(pgrep -f -- "$1(/| |\$)" | tr '\n' ' ')" | tee -a "$OUT/chip.log"
    pkill -9 -f -- "$1(/| |\$)"
}

# The 0.5 s-per-step protocol's manifests, as utilisation.py writes them.
"$PYTHON" - "$ROOT" "$WORK" <<'EOF'
import sys
from pathlib import Path
root, work = Path(sys.argv[1]), Path(sys.argv[2])
sys.path.insert(0, str(root / "benchmarks"))
import argparse
from utilisation import with_latency
args = argparse.Namespace(
    latency=0.5, concurrency=256, staleness=24, batch_groups=None, sandbox="inline", learning_rate=0.0015,
    sync_learning_rate=0.003, clip_high=0.5, weight_sync=None, weight_poll=1.5, sample_order="newest-first", out=work,
)
for mode in ("async", "sync"):
    print(with_latency(root / "examples" / "frozenlake.yaml", args, mode))
EOF

# bench: `stoker bench` on each manifest of benchmarks/chip/ (issue 51's and 52's figures), each
# under its own bound; a program stuck past --program-timeout is reported by the bench itself.
bench() {
    local manifest name programs
    for manifest in "${CHIP_MANIFESTS:-$ROOT/benchmarks/chip}"/*.yaml; do
        name=$(basename "$manifest" .yaml)
        case $name in q05-roll-*) programs=decode,prefill ;; *) programs=grad,apply,publish ;; esac
        # The bound covers the compiles too (remat auto compiles up to three grad programs).
        timeout -k 10 "$(limit 240)" "$PYTHON" -m stoker.cli bench "$manifest" --programs "$programs" --repeats 5 \
            --program-timeout "$(limit 60)" --json > "$OUT/bench-$name.json" 2> "$WORK/bench-$name.log"
        echo "bench $name: exit $? after ${SECONDS}s of the script" | tee -a "$OUT/chip.log"
        { echo "== $name"; grep -v -e Warning -e warnings.warn "$WORK/bench-$name.log" | tail -n 30; } >> "$OUT/bench-logs.txt"
    done
    "$PYTHON" "$ROOT/benchmarks/bench_table.py" "$OUT"/bench-*.json > "$OUT/bench.md"
}

PARTS=${*:-shipped latency}
# Always first (~15 s): the cores the host really runs at once, against its mask and CPU quota.
"$PYTHON" "$ROOT/benchmarks/host_cpu.py" --json "$OUT/host.json" | tee -a "$OUT/chip.log"
case " $PARTS " in *" bench "*) bench; esac
# flags: the grad step under remat policies, splash blocks and libtpu flags (grad_flags.py; issue
# 51), on CHIP_FLAG_MANIFESTS (default q05-2k) with Adam's state in bfloat16 so that remat none
# passes the bench's fit check (the grad program's speed does not depend on it); CHIP_FLAG_ARGS
# adds grad_flags.py arguments (--variant ...). The table goes to $OUT/flags.md.
case " $PARTS " in *" flags "*)
    # shellcheck disable=SC2086  # several manifests and arguments
    timeout -k 10 "$(limit 540)" "$PYTHON" "$ROOT/benchmarks/grad_flags.py" ${CHIP_FLAG_MANIFESTS:-$ROOT/benchmarks/chip/q05-2k.yaml} \
        --set learner.optimizerStateDtype=bfloat16 --timeout "$(limit 120)" --json "$OUT/flags.json" ${CHIP_FLAG_ARGS:-} \
        > "$OUT/flags.md" 2> "$WORK/flags.log"
    echo "flags: exit $? after ${SECONDS}s of the script" | tee -a "$OUT/chip.log"
    tail -n 20 "$WORK/flags.log" > "$OUT/flags-log-tail.txt"
esac
# step: the learner's whole step at each of CHIP_STEP_MANIFESTS' real size (real_step.py: the
# optimizer state, a publish copy and the gradient sum beside the grad), a JSON line each into
# chip.log: the remat a run takes, its step time and MFU, the device's peak bytes against the plan.
case " $PARTS " in *" step "*)
    for manifest in ${CHIP_STEP_MANIFESTS:-$ROOT/benchmarks/chip/q05-2k-rnone.yaml $ROOT/benchmarks/chip/q05-2k.yaml}; do
        name=$(basename "$manifest" .yaml)
        timeout -k 10 "$(limit 300)" "$PYTHON" "$ROOT/benchmarks/real_step.py" "$manifest" --json "$OUT/step-$name.json" \
            2> "$WORK/step-$name.log" | tee -a "$OUT/chip.log"
        echo "step $name: exit ${PIPESTATUS[0]} after ${SECONDS}s of the script" | tee -a "$OUT/chip.log"
        grep -v -e Warning -e warnings.warn "$WORK/step-$name.log" | tail -n 8 >> "$OUT/chip.log"
    done
esac
# decode: the write-and-attend kernel against the two kernels (decode_write_fused.py), whole sampler
# calls on the kernels (decode_profile.py: each batch's decode tokens/s, a JSON line into chip.log,
# and where its device time went, $OUT/profile-B.md), then top-p / top-k draws (sampling_truncation.py)
# (issue 52). CHIP_DECODE_STEP=1 adds decode_step.py's per-step variants first.
case " $PARTS " in *" decode "*)
    if [ "${CHIP_DECODE_STEP:-0}" = 1 ]; then
        timeout -k 10 "$(limit 240)" "$PYTHON" "$ROOT/benchmarks/decode_step.py" \
            ${CHIP_DECODE_SHAPES:-8x256x192 128x256x192 256x256x192 128x2048x192 128x2048} 2>&1 | grep '^{' | tee -a "$OUT/chip.log"
        echo "decode_step: exit ${PIPESTATUS[0]} after ${SECONDS}s of the script" | tee -a "$OUT/chip.log"
    fi
    timeout -k 10 "$(limit 120)" "$PYTHON" "$ROOT/benchmarks/decode_write_fused.py" 2>&1 | grep '^{' | tee -a "$OUT/chip.log"
    echo "decode_write_fused: exit ${PIPESTATUS[0]} after ${SECONDS}s of the script" | tee -a "$OUT/chip.log"
    (cd "$ROOT/benchmarks" && timeout -k 10 "$(limit 300)" "$PYTHON" decode_profile.py ${CHIP_DECODE_BATCHES:-128 256 8 32} \
        --out "$OUT") 2>&1 | grep '^{' | tee -a "$OUT/chip.log"
    echo "decode_profile: exit ${PIPESTATUS[0]} after ${SECONDS}s of the script" | tee -a "$OUT/chip.log"
    timeout -k 10 "$(limit 100)" "$PYTHON" "$ROOT/benchmarks/sampling_truncation.py" --rows 128 --repeats 3 2>&1 \
        | grep '^{' | tee -a "$OUT/chip.log"
    echo "sampling_truncation: exit ${PIPESTATUS[0]} after ${SECONDS}s of the script" | tee -a "$OUT/chip.log"
esac
# actors: eight actor loops of the example at once (actor_rate.py), XLA's default CPU pools against
# pools of one thread as `stoker run` now sizes them; the lines go to chip.log.
# CHIP_ACTOR_FLAGS: the flag sets compared, separated by '|' (an empty one: actor_rate.py's defaults).
actors() {
    local flags i
    while IFS= read -r flags; do
        echo "== 8 actor loops at once ${flags:-with the default pools}" | tee -a "$OUT/chip.log"
        for i in 0 1 2 3 4 5 6 7; do
            # shellcheck disable=SC2086  # each set is several flags
            JAX_PLATFORMS=cpu timeout "$(limit 120)" "$PYTHON" "$ROOT/benchmarks/actor_rate.py" \
                "$ROOT/examples/frozenlake.yaml" $flags 2>/dev/null | tee -a "$OUT/chip.log" &
        done
        wait
    done < <(echo "${CHIP_ACTOR_FLAGS:-|--cpu-threads 1}" | tr '|' '\n')
}
case " $PARTS " in *" actors "*) actors; esac
# duty: the learner alone on the chip, fed by a full buffer (learner_duty.py), at the manifest's
# micro-batch and at one micro-batch per step; a line each into chip.log.
case " $PARTS " in *" duty "*)
    for tokens in ${CHIP_DUTY_MICROBATCH:-1024 8192}; do
        timeout "$(limit 90)" "$PYTHON" "$ROOT/benchmarks/learner_duty.py" --steps 60 --microbatch-tokens "$tokens" \
            2> "$WORK/duty-$tokens.log" | tail -n 1 | tee -a "$OUT/chip.log"
    done
esac

# seeded PATH SEED [PATH=VALUE,...]: the shipped example at SEED, with spec overrides, written to PATH.
seeded() {
    PYTHONPATH="$ROOT/benchmarks${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -c "import sys; from pathlib import Path; from local_runs import manifest_variant, set_path
def edit(doc):
    doc['spec']['seed'] = int(sys.argv[3])
    for item in filter(None, sys.argv[4].split(',')):
        set_path(doc, *item.split('=', 1))
manifest_variant(Path(sys.argv[1]), Path(sys.argv[2]), edit)" "$ROOT/examples/frozenlake.yaml" "$1" "$2" "${3:-}"
}

SHIPPED=()
case " $PARTS " in *" shipped "*)
    # Each seed both ways, side by side in time (the machine drifts); ~50 s a run since the example's
    # environments run inline.
    for seed in ${CHIP_SEEDS:-0 1}; do
        seeded "$WORK/shipped-seed$seed.yaml" "$seed"
        run "shipped-async-s$seed" 100 "$WORK/shipped-seed$seed.yaml" async
        run "shipped-sync-s$seed" 100 "$WORK/shipped-seed$seed.yaml" sync
        SHIPPED+=("$WORK/shipped-async-s$seed" "$WORK/shipped-sync-s$seed")
    done
esac
# variants: the example with spec overrides, seeds CHIP_SEEDS: each of CHIP_VARIANTS is
# NAME:PATH=VALUE[,PATH=VALUE][:MODE[+MODE]] (modes: async, the default, and sync).
VARIANTS=()
case " $PARTS " in *" variants "*)
    for variant in ${CHIP_VARIANTS:-}; do
        vname=${variant%%:*}
        for seed in ${CHIP_SEEDS:-0 1}; do
            seeded "$WORK/$vname-seed$seed.yaml" "$seed" "$(echo "$variant" | cut -d: -f2)"
            modes=$(echo "$variant" | cut -s -d: -f3); modes=${modes:-async}
            for mode in ${modes//+/ }; do
                run "$vname-$mode-s$seed" 100 "$WORK/$vname-seed$seed.yaml" "$mode"
                VARIANTS+=("$WORK/$vname-$mode-s$seed")
            done
        done
    done
esac
# colocated: benchmarks/colocated/q05.yaml (issue 52 item 4: a 0.5B-shaped policy sampling and
# training on the one chip), its task file's path made absolute; report.md and phases.jsonl to $OUT.
case " $PARTS " in *" colocated "*)
    sed "s|benchmarks/colocated/|$ROOT/benchmarks/colocated/|" "$ROOT/benchmarks/colocated/q05.yaml" > "$WORK/colocated.yaml"
    timeout -k 40 "$(limit 480)" "$PYTHON" -m stoker.cli run "$WORK/colocated.yaml" --run-dir "$WORK/colocated" --no-progress \
        --max-minutes "$("$PYTHON" -c "print(round(($(limit 480) - 60) / 60, 2))")" > "$WORK/colocated.log" 2>&1
    echo "colocated: exit $? after ${SECONDS}s of the script" | tee -a "$OUT/chip.log"
    reap "$WORK/colocated"
    cp "$WORK/colocated/report.md" "$OUT/colocated-report.md"; cp "$WORK/colocated/phases.jsonl" "$OUT/colocated-phases.jsonl"
    grep -v -e Warning -e warnings.warn "$WORK/colocated/logs/learner.log" | tail -n 40 > "$OUT/colocated-learner-tail.txt"
    tail -n 5 "$WORK/colocated.log" >> "$OUT/chip.log"
esac
# head: the LM head fused with the draw against the two apart, whole sampler calls (head_draw.py).
case " $PARTS " in *" head "*)
    (cd "$ROOT/benchmarks" && timeout -k 10 "$(limit 300)" "$PYTHON" head_draw.py ${CHIP_HEAD_BATCHES:-8 32 64}) 2>&1 \
        | grep '^{' | tee -a "$OUT/chip.log"
    echo "head_draw: exit ${PIPESTATUS[0]} after ${SECONDS}s of the script" | tee -a "$OUT/chip.log"
esac
case " $PARTS " in *" latency "*)
    run latency-async 120 "$WORK/job.yaml" async
    if [ "$PARTS" = latency ]; then run latency-sync 330 "$WORK/job-sync.yaml" sync
    else run latency-sync 150 "$WORK/job-sync.yaml" sync; fi
esac

case " $PARTS " in *" shipped "*|*" variants "*|*" latency "*) ;; *) exit 0 ;; esac  # no loop runs to tabulate
"$PYTHON" "$ROOT/benchmarks/run_figures.py" ${SHIPPED[@]+"${SHIPPED[@]}"} ${VARIANTS[@]+"${VARIANTS[@]}"} "$WORK"/latency-async \
    "$WORK"/latency-sync --json "$OUT/chip.json" --markdown "$OUT/chip.md"
tail -n 5 "$WORK"/*.log > "$OUT/logs.txt" 2>&1
# Every run's records and logs in one file (few files come back from the device).
(cd "$WORK" && tar -czf "$OUT/runs.tgz" --exclude=checkpoints --exclude=weights --exclude=buffer --exclude=tensorboard \
    --exclude=plots --exclude=profiles --exclude=cache -- */ *.yaml 2>/dev/null)
for name in shipped-async-s0 latency-async; do
    [ -f "$WORK/$name/report.md" ] && cp "$WORK/$name/report.md" "$OUT/$name-report.md"
done
# Each process's profile, the top of each thread family (at most 8 files come back from the device).
[ -d "$WORK/shipped-async-s0/profiles" ] && head -n 60 "$WORK"/shipped-async-s0/profiles/*.txt > "$OUT/shipped-async-profiles.txt"
exit 0
