#!/bin/bash
# The extender's speed in two checkouts side by side (BENCHMARKS.md, "Scheduler extender speed"): three interleaved
# runs each, in-process (the extender's own CPU per pod) and over loopback HTTP, on the openb cluster.
#   bench/extender_ab.sh BEFORE_CHECKOUT AFTER_CHECKOUT [OUT_DIR]
# Each checkout needs its environment (`uv sync --locked` there); JSON and text results go to OUT_DIR.
set -euo pipefail
before=${1:?usage: bench/extender_ab.sh BEFORE_CHECKOUT AFTER_CHECKOUT [OUT_DIR]}
after=${2:?usage: bench/extender_ab.sh BEFORE_CHECKOUT AFTER_CHECKOUT [OUT_DIR]}
out=${3:-/tmp/extender-ab}
O=${OPENB:-$(cd "$(dirname "$0")/../.." && pwd)/shared/data/openb}
mkdir -p "$out"
for i in 1 2 3; do
  for mode in in-process http; do
    for side in before after; do
      dir=$before; [ "$side" = after ] && dir=$after
      flag=""; [ "$mode" = in-process ] && flag="--in-process"
      (cd "$dir" && uv run python bench/extender_bench.py $flag --cycles 2000 \
        --nodes "$O/openb_node_list_gpu_node.csv" --pods "$O/openb_pod_list_default.csv" \
        --json "$out/$mode-$side-$i.json" > "$out/$mode-$side-$i.txt" 2>&1)
    done
  done
done
python3 - "$out" <<'PY'
import json, statistics, sys
out = sys.argv[1]
for mode in ("in-process", "http"):
    for side in ("before", "after"):
        runs = [json.load(open(f"{out}/{mode}-{side}-{i}.json")) for i in (1, 2, 3)]
        def med(k):
            v = [r[k] for r in runs]
            return f"{statistics.median(v):.4g} ({min(v):.4g}-{max(v):.4g})"
        print(f"{mode:10} {side:6} cycles/s {med('cycles_per_s')}  p50 {med('cycle_p50_ms')} ms  "
              f"p99 {med('cycle_p99_ms')} ms  relist {med('relist_s')} s")
PY
