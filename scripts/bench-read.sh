#!/usr/bin/env bash
# Read throughput and server CPU of several basalt builds (or TLS against
# --insecure-no-tls) side by side in one run: each round starts a fresh
# `basalt dev` per configuration (its own data dir, kept across rounds),
# and runs `bench read` with 1 and 3 readers and `bench s3 get` with 3
# clients. Configurations alternate within every round, so drift on a
# shared machine hits all of them. Prints the medians and each run.
#
#   scripts/bench-read.sh old=/tmp/old/basalt new=/tmp/new/basalt plain=/tmp/new/basalt,plain
#   (knobs: ROUNDS=3 KEYS=6 SIZE=128MiB S3DUR=15s PORT=27100)
set -euo pipefail
ROUNDS=${ROUNDS:-3}; KEYS=${KEYS:-6}; SIZE=${SIZE:-128MiB}; S3DUR=${S3DUR:-15s}
PORT=${PORT:-27100}
OUT=${OUT:-$(mktemp -d /tmp/bench-read.XXXXXX)}; mkdir -p "$OUT"
echo "results in $OUT" >&2
[ $# -gt 0 ] || { echo "usage: $0 label=BIN[,plain] ..." >&2; exit 2; }

run_one() { # label bin plain round
	local label=$1 bin=$2 plain=$3 round=$4
	local dir=$OUT/data-$label flag=() cli=()
	[ "$plain" = plain ] && flag=(--insecure-no-tls)
	"$bin" dev --data-dir "$dir" --base-port "$PORT" --s3 127.0.0.1:$((PORT+16)) --webhdfs "" \
		--metrics 127.0.0.1:$((PORT-2)) "${flag[@]}" >"$OUT/dev-$label-$round.log" 2>&1 &
	local pid=$!
	for _ in $(seq 600); do grep -q '^ready' "$OUT/dev-$label-$round.log" 2>/dev/null && break; sleep 0.2; done
	if ! grep -q '^ready' "$OUT/dev-$label-$round.log"; then
		echo "$label round $round: cluster not ready" >&2; kill "$pid"; wait "$pid" || true; return
	fi
	cli=(--meta 127.0.0.1:$PORT --tls-dir "$dir/tls/client-cli" --server-pid $pid --json)
	[ "$plain" = plain ] && cli=(--meta 127.0.0.1:$PORT --insecure-no-tls --server-pid $pid --json)
	if [ "$round" = 1 ]; then
		"$bin" bench write "${cli[@]}" -n "$KEYS" -t 3 --size "$SIZE" --prefix r- >"$OUT/$label-write.json" 2>>"$OUT/err.log" || true
	fi
	"$bin" bench read "${cli[@]}" -n "$KEYS" -t 1 --size "$SIZE" --prefix r- >"$OUT/$label-t1-$round.json" 2>>"$OUT/err.log" || true
	"$bin" bench read "${cli[@]}" -n "$KEYS" -t 3 --size "$SIZE" --prefix r- >"$OUT/$label-t3-$round.json" 2>>"$OUT/err.log" || true
	local key secret
	key=$(sed -n 's/.*access key \([^ ]*\) *secret \([^ ]*\).*/\1/p' "$OUT/dev-$label-$round.log")
	secret=$(sed -n 's/.*access key \([^ ]*\) *secret \([^ ]*\).*/\2/p' "$OUT/dev-$label-$round.log")
	"$bin" bench s3 get --endpoint http://127.0.0.1:$((PORT+16)) --access-key "$key" --secret-key "$secret" \
		--size "$SIZE" -t 3 -n 3 --duration "$S3DUR" --server-pid $pid --json >"$OUT/$label-s3-$round.json" 2>>"$OUT/err.log" || true
	kill "$pid"; wait "$pid" || true
}

for r in $(seq "$ROUNDS"); do
	for c in "$@"; do
		label=${c%%=*}; spec=${c#*=}; bin=${spec%%,*}; plain=""
		[ "$spec" != "$bin" ] && plain=${spec#*,}
		run_one "$label" "$bin" "$plain" "$r"
	done
done

python3 - "$OUT" "$ROUNDS" "$@" <<'PY'
import json, statistics, sys, os
out, rounds, cfgs = sys.argv[1], int(sys.argv[2]), [c.split("=")[0] for c in sys.argv[3:]]
def rows(label, w):
    r = []
    for i in range(1, rounds + 1):
        try:
            d = json.load(open(os.path.join(out, f"{label}-{w}-{i}.json")))
        except Exception:
            continue
        for row in (d if isinstance(d, list) else [d]):
            if row.get("phase", "read") in ("read", "get") or row.get("op") == "get":
                r.append(row)
    return r
print("| workload | config | MiB/s (median) | server CPU-s/GiB (median) | runs MiB/s | errors |")
print("|---|---|---|---|---|---|")
for w, name in (("t1", "native read, 1 reader"), ("t3", "native read, 3 readers"), ("s3", "S3 GET, 3 clients")):
    for c in cfgs:
        r = rows(c, w)
        if not r:
            print(f"| {name} | {c} | - | - | - | - |"); continue
        mib = [x.get("mib_per_sec", 0) for x in r]
        cpu = [x.get("server_cpu_seconds", 0) / (x["bytes"] / 2**30) if x.get("bytes") else 0 for x in r]
        err = sum(x.get("errors", 0) for x in r)
        print(f"| {name} | {c} | {statistics.median(mib):.1f} | {statistics.median(cpu):.2f} | {'/'.join(f'{m:.1f}' for m in mib)} | {err} |")
PY
