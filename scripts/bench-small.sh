#!/usr/bin/env bash
# Small-object PUTs (issue 15), binaries side by side in one run: for each
# round and binary, a fresh `basalt dev`, 1,500 warm-up keys, then
# `basalt bench write` (native, 8,000 × 4 KiB, 32 threads) and
# `basalt bench s3 put` (4 KiB, 32 clients, 15 s), one line each. Rounds
# alternate the binaries so drift on a shared machine hits all of them.
# SYSCALLS=1 instead counts, under strace -c, the server's fdatasync, fsync,
# openat and pwrite64 calls per object for 2,000 native 4 KiB PUTs.
#
#   scripts/bench-small.sh BIN...        (knobs: ROUNDS=3, PORT=19962, SYSCALLS=0)
set -uo pipefail
ROUNDS=${ROUNDS:-3}; PORT=${PORT:-19962}; SYSCALLS=${SYSCALLS:-0}
S3PORT=$((PORT + 16)); MPORT=$((PORT - 2))
OUT=$(mktemp -d /tmp/bench-small.XXXXXX)
echo "results in $OUT" >&2

start() { # bin dir → sets P
	"$1" dev --data-dir "$2" --base-port "$PORT" --s3 127.0.0.1:$S3PORT --metrics 127.0.0.1:$MPORT --webhdfs "" >"$2.log" 2>&1 &
	P=$!
	for _ in $(seq 1 120); do grep -q '^ready' "$2.log" && return 0; sleep 0.5; done
	echo "basalt dev did not start: $2.log" >&2; kill $P; return 1
}

for r in $(seq 1 "$ROUNDS"); do
	for bin in "$@"; do
		d=$OUT/data-$r-$(basename "$bin")
		start "$bin" "$d" || continue
		cli=(--meta 127.0.0.1:$PORT --tls-dir "$d/tls/client-cli" --size 4KiB -t 32)
		"$bin" bench write "${cli[@]}" --prefix warm- -n 1500 >/dev/null 2>&1
		if [ "$SYSCALLS" = 1 ]; then
			strace -f -c -e trace=fdatasync,fsync,openat,pwrite64 -p $P -o "$d.strace" 2>/dev/null &
			S=$!; sleep 1
			"$bin" bench write "${cli[@]}" --prefix s- -n 2000 >/dev/null 2>&1
			kill -INT $S; wait $S
			echo "round $r $(basename "$bin") per object: $(awk 'NR>2 && $NF!="total" && NF>=5 {printf "%s %.2f  ", $NF, $4/2000}' "$d.strace")"
		else
			secret=$(grep -o 'secret [^ ]*' "$d.log" | awk '{print $2}')
			n=$("$bin" bench write "${cli[@]}" --prefix n- -n 8000 --server-pid $P 2>&1 | tail -1)
			s=$(AWS_ACCESS_KEY_ID=basalt-dev AWS_SECRET_ACCESS_KEY=$secret "$bin" bench s3 put --endpoint http://127.0.0.1:$S3PORT \
				--size 4KiB -t 32 --duration 15s --server-pid $P 2>&1 | tail -1)
			echo "round $r $(basename "$bin") native: $n"
			echo "round $r $(basename "$bin") s3:     $s"
		fi
		kill $P; wait $P 2>/dev/null
		rm -rf "$d"
	done
done
