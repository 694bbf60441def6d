#!/usr/bin/env bash
# What mutual TLS costs on the data path: basalt bench write (V1, V2,
# 4 KiB keys) on a fresh `basalt dev` with TLS (the default) and with
# --insecure-no-tls, alternating, ROUNDS times. Prints one line per run.
#
#   scripts/bench-tls.sh            # ROUNDS=2 SIZE=128MiB N=4 SMALL=3000
set -euo pipefail
ROUNDS=${ROUNDS:-2}; SIZE=${SIZE:-128MiB}; N=${N:-4}; SMALL=${SMALL:-3000}
BIN=${BIN:-/tmp/basalt-bench-tls/basalt}
DIR=${DIR:-/tmp/basalt-bench-tls/data}
PORT=${PORT:-29862}
mkdir -p "$(dirname "$BIN")"
go build -o "$BIN" ./cmd/basalt

run() { # mode: tls | plain
	local mode=$1 flag=()
	[ "$mode" = plain ] && flag=(--insecure-no-tls)
	rm -rf "$DIR" "$DIR.log"
	"$BIN" dev --data-dir "$DIR" --base-port "$PORT" --s3 127.0.0.1:$((PORT+16)) --webhdfs "" \
		--metrics 127.0.0.1:$((PORT-2)) "${flag[@]}" >"$DIR.log" 2>&1 &
	local pid=$!
	for _ in $(seq 600); do grep -q '^ready' "$DIR.log" 2>/dev/null && break; sleep 0.2; done
	grep -q '^ready' "$DIR.log" || { cat "$DIR.log" >&2; kill "$pid"; exit 1; }
	local cli=(--meta 127.0.0.1:$PORT --tls-dir "$DIR/tls/client-cli" --server-pid $pid --json)
	[ "$mode" = plain ] && cli=(--meta 127.0.0.1:$PORT --insecure-no-tls --server-pid $pid --json)
	for p in v1 v2; do
		echo "$mode $p $("$BIN" bench write "${cli[@]}" -n "$N" -t 1 --size "$SIZE" --pipeline $p --prefix $p- 2>/dev/null | tr -d '\n')"
	done
	"$BIN" bench write "${cli[@]}" -n 500 -t 32 --size 4KiB --prefix warm- >/dev/null 2>&1 || true
	echo "$mode small $("$BIN" bench write "${cli[@]}" -n "$SMALL" -t 32 --size 4KiB --prefix small- 2>/dev/null | tr -d '\n')"
	kill "$pid"; wait "$pid" || true
}

for r in $(seq "$ROUNDS"); do
	if [ $((r % 2)) = 1 ]; then run tls; run plain; else run plain; run tls; fi
done
rm -rf "$DIR"
