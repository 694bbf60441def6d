#!/usr/bin/env bash
# Compare write throughput of two basalt binaries side by side in one run:
# for each round and each binary, a fresh `basalt dev` (its own data dir and
# ports), then `basalt bench write` with V1 and with V2, JSON out. Rounds
# alternate A, B, A, B... so drift on a shared machine hits both. Prints the
# medians per binary and path and the ratio B/A.
#
#   scripts/bench-compare.sh OLD_BIN NEW_BIN      (knobs: ROUNDS, KEYS, SIZE, THREADS, SMALL)
set -euo pipefail
A=${1:?old binary}; B=${2:?new binary}
ROUNDS=${ROUNDS:-3}; KEYS=${KEYS:-6}; SIZE=${SIZE:-128MiB}; THREADS=${THREADS:-1}
SMALL=${SMALL:-2000}
PORT=${PORT:-19962}
OUT=$(mktemp -d /tmp/bench-compare.XXXXXX)
echo "results in $OUT" >&2

run_one() { # label bin round
	local label=$1 bin=$2 round=$3
	local dir=$OUT/data-$label-$round
	"$bin" dev --data-dir "$dir" --base-port "$PORT" --metrics 127.0.0.1:0 --s3 127.0.0.1:0 >"$OUT/dev-$label-$round.log" 2>&1 &
	local pid=$!
	local meta=127.0.0.1:$PORT ok=0
	# basalt dev's client certificate (binaries before TLS ignore it).
	export BASALT_TLS_DIR=$dir/tls/client-cli
	for _ in $(seq 1 120); do
		if "$bin" bench write --meta "$meta" -n 1 --size 4KiB -t 1 --prefix warm- --json >/dev/null 2>&1; then ok=1; break; fi
		sleep 0.5
	done
	if [ $ok = 1 ]; then
		for p in v1 v2; do
			"$bin" bench write --meta "$meta" -n "$KEYS" -t "$THREADS" --size "$SIZE" --pipeline $p \
				--prefix "$p-" --server-pid $pid --json >"$OUT/$label-$p-$round.json" 2>>"$OUT/err.log" || true
		done
		"$bin" bench write --meta "$meta" -n "$SMALL" -t 32 --size 4KiB --prefix small- \
			--server-pid $pid --json >"$OUT/$label-small-$round.json" 2>>"$OUT/err.log" || true
	else
		echo "$label round $round: cluster not ready" >&2
	fi
	kill "$pid" 2>/dev/null || true
	wait "$pid" 2>/dev/null || true
	rm -rf "$dir"
}

for r in $(seq 1 "$ROUNDS"); do
	run_one A "$A" "$r"
	run_one B "$B" "$r"
done

python3 - "$OUT" "$ROUNDS" <<'PY'
import json, statistics, sys, os
out, rounds = sys.argv[1], int(sys.argv[2])
def vals(label, path, field):
    v = []
    for r in range(1, rounds + 1):
        p = os.path.join(out, f"{label}-{path}-{r}.json")
        try:
            d = json.load(open(p))
            rows = d if isinstance(d, list) else [d]
            for row in rows:
                if row.get("phase", "write") == "write" and field in row:
                    v.append(row[field])
        except (OSError, ValueError):
            pass
    return v
print(f"{'path':6} {'metric':12} {'A runs':30} {'B runs':30} {'A med':>8} {'B med':>8} {'B/A':>6}")
for path, field in (("v1", "mib_per_sec"), ("v2", "mib_per_sec"), ("small", "ops_per_sec"), ("small", "p99_ms")):
    a, b = vals("A", path, field), vals("B", path, field)
    ma = statistics.median(a) if a else float("nan")
    mb = statistics.median(b) if b else float("nan")
    fmt = lambda xs: " / ".join(f"{x:.0f}" if x >= 10 else f"{x:.1f}" for x in xs)
    print(f"{path:6} {field:12} {fmt(a):30} {fmt(b):30} {ma:8.1f} {mb:8.1f} {mb/ma if ma else float('nan'):6.2f}")
PY
