#!/usr/bin/env bash
# Basalt's S3 gateway and MinIO side by side, driven by MinIO's warp, in one
# run (issue 15). The peers are NOT built here and never committed: build
# them yourself from their public sources (docs/BENCHMARKS.md has the
# commands used) and pass the binaries.
#
#   BASALT=./bin/basalt MINIO=/path/minio WARP=/path/warp scripts/bench-peers.sh
#   knobs: ROUNDS=3 DUR=20s PORT=28100 SYSTEMS="basalt minio" WORKLOADS="put1 put3 get3 small stat"
#          OUT=dir (data and results; removed data dirs after each run)
#
# Every round starts each system fresh (its own data dir) and runs every
# workload against it; systems alternate within a round, so drift on a
# shared machine hits both. MinIO runs as one node with 4 drives (erasure
# coding 2+2, each byte stored twice); Basalt as `basalt dev` (1 meta node,
# 3 datanodes, 3 replicas, the S3 gateway in the same process). Server CPU
# is sampled from /proc/PID/stat every 0.5 s and taken over the window warp
# measured (its start_time..end_time), so upload phases of GET runs do not
# count.
set -euo pipefail
ROUNDS=${ROUNDS:-3}; DUR=${DUR:-20s}; PORT=${PORT:-28100}
SYSTEMS=${SYSTEMS:-"basalt minio"}
WORKLOADS=${WORKLOADS:-"put1 put3 get3 small stat"}
: "${WARP:=}"; [ -n "${SUMMARY_ONLY:-}" ] || : "${WARP:?WARP=path to a warp binary}"
OUT=${OUT:-$(mktemp -d /tmp/bench-peers.XXXXXX)}; mkdir -p "$OUT"
echo "results in $OUT" >&2

sampler() { # pid file: "unix_seconds cpu_seconds" every 0.5 s while pid lives
	local pid=$1 f=$2 tck
	tck=$(getconf CLK_TCK)
	while [ -r /proc/$pid/stat ]; do
		awk -v t="$(date +%s.%N)" -v k="$tck" '{print t, ($14+$15)/k}' /proc/$pid/stat >>"$f" 2>/dev/null || break
		sleep 0.5
	done
}

start_basalt() { # dir -> sets PID HOST KEY SECRET
	local dir=$1
	"$BASALT" dev --data-dir "$dir" --base-port "$PORT" --s3 127.0.0.1:$((PORT+16)) --webhdfs "" \
		--metrics 127.0.0.1:$((PORT-2)) >"$dir.log" 2>&1 &
	PID=$!
	for _ in $(seq 600); do grep -q '^ready' "$dir.log" 2>/dev/null && break; sleep 0.2; done
	grep -q '^ready' "$dir.log" || { echo "basalt not ready, see $dir.log" >&2; kill "$PID"; return 1; }
	KEY=$(sed -n 's/.*access key \([^ ]*\) *secret \([^ ]*\).*/\1/p' "$dir.log" | head -1)
	SECRET=$(sed -n 's/.*access key \([^ ]*\) *secret \([^ ]*\).*/\2/p' "$dir.log" | head -1)
	HOST=127.0.0.1:$((PORT+16))
}

start_minio() { # dir
	local dir=$1
	mkdir -p "$dir"/d1 "$dir"/d2 "$dir"/d3 "$dir"/d4
	KEY=benchadmin; SECRET=benchadmin-secret-key
	MINIO_ROOT_USER=$KEY MINIO_ROOT_PASSWORD=$SECRET MINIO_STORAGE_CLASS_STANDARD=EC:2 \
		MINIO_BROWSER=off MINIO_UPDATE=off MINIO_ROOTDISK_THRESHOLD_SIZE=1B \
		"$MINIO" server "$dir/d{1...4}" --address 127.0.0.1:$((PORT+20)) \
		--console-address 127.0.0.1:$((PORT+21)) >"$dir.log" 2>&1 &
	PID=$!
	HOST=127.0.0.1:$((PORT+20))
	# MINIO_ROOTDISK_THRESHOLD_SIZE=1B: MinIO refuses drives on the root
	# file system (this machine has only that one) unless told its size.
	for _ in $(seq 300); do
		curl -sf "http://$HOST/minio/health/cluster" >/dev/null 2>&1 && return 0; sleep 0.2
	done
	echo "minio not ready, see $dir.log" >&2; kill "$PID"; return 1
}

run_warp() { # system round workload
	local sys=$1 r=$2 w=$3 args=()
	case $w in
	put1) args=(put --obj.size 128MiB --concurrent 1) ;;
	put3) args=(put --obj.size 128MiB --concurrent 3) ;;
	get3) args=(get --obj.size 128MiB --concurrent 3 --objects 6) ;;
	small) args=(put --obj.size 4KiB --concurrent 32) ;;
	stat) args=(stat --obj.size 4KiB --concurrent 64 --objects 2000) ;;
	esac
	"$WARP" "${args[@]}" --host "$HOST" --access-key "$KEY" --secret-key "$SECRET" \
		--bucket "warp-$w" --duration "$DUR" --no-color --json --benchdata "$OUT/$sys-$w-$r" \
		>"$OUT/$sys-$w-$r.json" 2>"$OUT/$sys-$w-$r.err" || echo "$sys $w round $r: warp failed" >&2
	cp "$OUT/cpu-$sys-$r" "$OUT/cpu-$sys-$w-$r" 2>/dev/null || true
}

# SUMMARY_ONLY=1 OUT=dir: print the table of an earlier run again.
[ -n "${SUMMARY_ONLY:-}" ] && ROUNDS_RUN=0 || ROUNDS_RUN=$ROUNDS
for r in $(seq "$ROUNDS_RUN"); do
	for sys in $SYSTEMS; do
		dir=$OUT/data-$sys-$r
		rm -rf "$dir"; mkdir -p "$dir"
		case $sys in
		basalt) start_basalt "$dir" ;;
		minio) start_minio "$dir" ;;
		esac
		sampler "$PID" "$OUT/cpu-$sys-$r" &
		for w in $WORKLOADS; do
			echo "$(date -u +%H:%M:%S) round $r $sys $w (load $(cut -d' ' -f1 /proc/loadavg))" >&2
			run_warp "$sys" "$r" "$w"
		done
		kill "$PID"; wait "$PID" 2>/dev/null || true
		rm -rf "$dir"
	done
done

python3 - "$OUT" "$ROUNDS" "$SYSTEMS" "$WORKLOADS" <<'PY'
import json, os, statistics, sys
from datetime import datetime
out, rounds, systems, workloads = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(), sys.argv[4].split()
def ts(s):
    s = s.rstrip("Z")
    if "." in s:
        a, b = s.split(".", 1)
        b = "".join(ch for ch in b if ch.isdigit())[:6]
        s = a + "." + b
        return datetime.fromisoformat(s).timestamp()
    return datetime.fromisoformat(s).timestamp()
def cpu_between(f, t0, t1):
    pts = []
    try:
        for line in open(f):
            a, b = line.split(); pts.append((float(a), float(b)))
    except OSError:
        return None
    def at(t):
        prev = None
        for p in pts:
            if p[0] >= t:
                if prev is None: return p[1]
                return prev[1] + (p[1]-prev[1]) * (t-prev[0]) / max(p[0]-prev[0], 1e-9)
            prev = p
        return pts[-1][1] if pts else None
    a, b = at(t0), at(t1)
    return None if a is None or b is None else b - a
def op_stats(d, w):
    # warp v1.4's --json: {"by_op_type": {"GET": {"throughput": {...}, "requests_by_client": ...}}};
    # a GET run may also list its upload phase as PUT.
    want = {"get3": "GET", "stat": "STAT"}.get(w, "PUT")
    return (d.get("by_op_type") or {}).get(want)
names = {"put1": "PUT 128 MiB, 1 client", "put3": "PUT 128 MiB, 3 clients", "get3": "GET 128 MiB, 3 clients",
         "small": "PUT 4 KiB, 32 clients", "stat": "STAT (HEAD) 4 KiB, 64 clients"}
print("| workload | system | median | server CPU (median) | p99 ms (median) | runs | errors |")
print("|---|---|---|---|---|---|---|")
for w in workloads:
    for s in systems:
        vals, cpus, p99s, errs = [], [], [], 0
        for r in range(1, rounds + 1):
            try:
                d = json.load(open(os.path.join(out, f"{s}-{w}-{r}.json")))
            except Exception:
                continue
            op = op_stats(d, w)
            if not op: continue
            t = op["throughput"]
            secs = t["measure_duration_millis"] / 1000.0
            if secs <= 0: continue
            errs += t.get("errors", 0) + op.get("total_errors", 0)
            big = w in ("put1", "put3", "get3")
            v = t["bytes"] / 2**20 / secs if big else t["ops"] / secs
            vals.append(v)
            t0 = ts(t["start_time"])
            c = cpu_between(os.path.join(out, f"cpu-{s}-{r}"), t0, t0 + secs)
            if c is not None:
                cpus.append(c / (t["bytes"] / 2**30) if big else c / max(t["ops"], 1) * 1e6)
            for segs in (op.get("requests_by_client") or {}).values():
                for seg in segs:
                    req = seg.get("single_sized_requests") or {}
                    if req.get("dur_99_millis") is not None: p99s.append(req["dur_99_millis"])
        if not vals:
            print(f"| {names[w]} | {s} | - | - | - | - | - |"); continue
        unit = "MiB/s" if w in ("put1", "put3", "get3") else "obj/s"
        cunit = "CPU-s/GiB" if unit == "MiB/s" else "CPU-µs/op"
        cpu = f"{statistics.median(cpus):.2f} {cunit}" if cpus else "-"
        p99 = f"{statistics.median(p99s):.0f}" if p99s else "-"
        print(f"| {names[w]} | {s} | {statistics.median(vals):,.0f} {unit} | {cpu} | {p99} | {'/'.join(f'{v:,.0f}' for v in vals)} | {errs} |")
PY
