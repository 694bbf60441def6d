#!/usr/bin/env bash
# WebHDFS throughput on a fresh `basalt dev` (issue 14's benchmark, without
# S3A): hadoop fs -put/-get of one SIZE_MIB file through webhdfs:// next to
# `basalt sh key put/get` of the same file into the same FS bucket, a
# directory of FILES small files (FILE_BYTES each) put through webhdfs://,
# and the rename of that directory: once with FsShell -mv (JVM start
# included) and once as the bare WebHDFS RENAME call (curl).
# FsShell times include a JVM start; the "jvm" line is one such start plus
# one GETFILESTATUS, to subtract.
#
# Knobs: SIZE_MIB (1024), FILES (10000), FILE_BYTES (4096), KEEP=1.
#
# S3A=1 runs instead the comparison with S3A (hadoop-aws, Maven profile
# s3a of hadoop/pom.xml; the AWS SDK bundle is a ~600 MB download, cached
# in ~/.m2) against the S3 gateway of the same cluster: put of CMP_FILES
# (1000) small files, rename of that directory (WebHDFS: one RENAME; S3A:
# a copy and a delete per file), and put of one CMP_MIB (512) MiB file.
set -euo pipefail
cd "$(dirname "$0")/.."
GO=${GO:-go}
BIN=${BIN:-bin/basalt}
SIZE_MIB=${SIZE_MIB:-1024}
FILES=${FILES:-10000}
FILE_BYTES=${FILE_BYTES:-4096}

S3A=${S3A:-0}
CMP_FILES=${CMP_FILES:-1000}
CMP_MIB=${CMP_MIB:-512}
if [ "$S3A" = 1 ]; then FILES=$CMP_FILES SIZE_MIB=$CMP_MIB; fi

"$GO" build -o "$BIN" ./cmd/basalt
profile=()
[ "$S3A" = 1 ] && profile=(-Ps3a)
(cd hadoop && mvn -q -B -ntp "${profile[@]}" dependency:build-classpath -Dmdep.outputFile=target/cp.txt >/dev/null)
CP="hadoop/conf:$(cat hadoop/target/cp.txt)"
fsh() { java -cp "$CP" org.apache.hadoop.fs.FsShell "$@"; }

# Starts basalt dev on a free port range (below the ephemeral ports);
# another process can still take a port between the check and the bind,
# so a start that fails is retried on another range.
pick_base() {
  python3 - <<'PY'
import random, socket
for _ in range(200):
    b = random.randrange(10000, 32000, 50)  # below the ephemeral range (32768+)
    ok = True
    for p in range(b, b + 50):
        s = socket.socket()
        try:
            s.bind(("127.0.0.1", p))
        except OSError:
            ok = False
        finally:
            s.close()
        if not ok:
            break
    if ok:
        print(b)
        break
PY
}
dir=$(mktemp -d /tmp/basalt-bench-webhdfs.XXXXXX)
pid=
cleanup() {
  [ -n "$pid" ] && { kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; }
  if [ "${KEEP:-0}" = 1 ]; then echo "kept $dir"; else rm -rf "$dir"; fi
}
trap cleanup EXIT
for attempt in 1 2 3; do
  base=$(pick_base)
  wport=$((base + 48))
  rm -rf "$dir/data"
  "$BIN" dev --data-dir "$dir/data" --base-port "$base" --webhdfs "127.0.0.1:$wport" \
    --s3 "127.0.0.1:$((base + 47))" --metrics 127.0.0.1:0 >"$dir/dev.log" 2>&1 &
  pid=$!
  for _ in $(seq 240); do
    grep -q '^ready' "$dir/dev.log" && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  grep -q '^ready' "$dir/dev.log" && break
  cat "$dir/dev.log" >&2
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  pid=
  echo "basalt dev did not start (attempt $attempt of 3)" >&2
  [ "$attempt" = 3 ] && exit 1
done
meta="127.0.0.1:$base"
U="webhdfs://127.0.0.1:$wport/bench/fsb"
H="http://127.0.0.1:$wport/webhdfs/v1/bench/fsb"

now() { date +%s.%N; }
report() { # name seconds bytes
  # bytes < 0: a count of files (-N), reported as files/s
  python3 -c "import sys; n,s,b=sys.argv[1],float(sys.argv[2]),int(sys.argv[3]); print(f'{n:<34} {s:8.2f} s' + (f'  {b/s/2**20:8.1f} MiB/s' if b > 0 else f'  {-b/s:8.1f} files/s' if b < 0 else ''))" "$@"
}
timed() { # name bytes cmd...
  local name=$1 bytes=$2; shift 2
  local t0; t0=$(now)
  "$@" >/dev/null 2>"$dir/err" || { cat "$dir/err" >&2; echo "$name failed" >&2; exit 1; }
  report "$name" "$(python3 -c "print($(now)-$t0)")" "$bytes"
}

head -c $((SIZE_MIB << 20)) /dev/urandom >"$dir/big"
mkdir "$dir/small"
python3 - "$dir/small" "$FILES" "$FILE_BYTES" <<'PY'
import os, sys
d, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
for i in range(n):
    with open(os.path.join(d, f"f{i:06d}"), "wb") as f:
        f.write(os.urandom(size))
PY
bytes=$((SIZE_MIB << 20))

if [ "$S3A" = 1 ]; then
  # The dev cluster's key, as basalt dev prints it.
  read -r s3url key secret < <(awk '$1 == "s3" {print $2, $5, $7}' "$dir/dev.log")
  "$BIN" sh --meta "$meta" volume create /s3v >/dev/null 2>&1 || true # the S3 gateway's volume
  "$BIN" sh --meta "$meta" bucket create /s3v/s3abench >/dev/null
  S3A_OPTS=(-D "fs.s3a.endpoint=$s3url" -D fs.s3a.path.style.access=true -D fs.s3a.connection.ssl.enabled=false
    -D fs.s3a.endpoint.region=us-east-1 -D "fs.s3a.access.key=$key" -D "fs.s3a.secret.key=$secret"
    -D fs.s3a.change.detection.mode=none)
  s3a() { java -cp "$CP" org.apache.hadoop.fs.FsShell "${S3A_OPTS[@]}" "$@"; }
  S="s3a://s3abench"
  echo "basalt dev, 3 datanodes, one host; WebHDFS ($U) vs S3A ($S via $s3url), same cluster"
  echo "$FILES files of $FILE_BYTES bytes; one $SIZE_MIB MiB file; FsShell times include a JVM start (see the jvm lines)"
  fsh -mkdir -p "$U/cmp" 2>/dev/null
  timed "jvm webhdfs (FsShell -test -d)" 0 fsh -test -d "$U/cmp"
  timed "jvm s3a (FsShell -ls /)" 0 s3a -ls "$S/"
  s3a -mkdir -p "$S/cmp" 2>/dev/null
  timed "webhdfs -put dir of $FILES files" "-$FILES" fsh -put "$dir/small" "$U/cmp/small"
  timed "s3a -put dir of $FILES files" "-$FILES" s3a -put "$dir/small" "$S/cmp/small"
  timed "webhdfs -mv of that dir (FsShell)" 0 fsh -mv "$U/cmp/small" "$U/cmp/small2"
  timed "webhdfs RENAME of that dir (curl)" 0 curl -sf -X PUT "$H/cmp/small2?op=RENAME&destination=/bench/fsb/cmp/small3&user.name=bench"
  timed "s3a -mv of that dir (FsShell)" 0 s3a -mv "$S/cmp/small" "$S/cmp/small2"
  for u in "$U/cmp/small3" "$S/cmp/small2"; do
    if [ "${u%%:*}" = s3a ]; then n=$(s3a -count "$u" | awk '{print $2}'); else n=$(fsh -count "$u" | awk '{print $2}'); fi
    [ "$n" = "$FILES" ] || { echo "renamed directory $u holds $n files, want $FILES" >&2; exit 1; }
  done
  timed "webhdfs -put ${SIZE_MIB} MiB" "$bytes" fsh -put "$dir/big" "$U/cmp/big"
  timed "s3a -put ${SIZE_MIB} MiB" "$bytes" s3a -put "$dir/big" "$S/cmp/big"
  timed "basalt sh key put ${SIZE_MIB} MiB" "$bytes" "$BIN" sh --meta "$meta" key put /bench/fsb/sh/big "$dir/big"
  timed "webhdfs -get ${SIZE_MIB} MiB" "$bytes" fsh -get "$U/cmp/big" "$dir/big.wh"
  timed "s3a -get ${SIZE_MIB} MiB" "$bytes" s3a -get "$S/cmp/big" "$dir/big.s3a"
  cmp "$dir/big" "$dir/big.wh" && cmp "$dir/big" "$dir/big.s3a" && rm "$dir/big.wh" "$dir/big.s3a"
  exit 0
fi

echo "basalt dev, 3 datanodes, one host; $SIZE_MIB MiB file; $FILES files of $FILE_BYTES bytes"
fsh -mkdir -p "$U/wh" 2>/dev/null
timed "jvm (FsShell -test -d)" 0 fsh -test -d "$U/wh"
timed "webhdfs -put ${SIZE_MIB} MiB" "$bytes" fsh -put "$dir/big" "$U/wh/big"
timed "webhdfs -get ${SIZE_MIB} MiB" "$bytes" fsh -get "$U/wh/big" "$dir/big.wh"
cmp "$dir/big" "$dir/big.wh" && rm "$dir/big.wh"
timed "basalt sh key put ${SIZE_MIB} MiB" "$bytes" "$BIN" sh --meta "$meta" --tls-dir "$dir/data/tls/client-cli" key put /bench/fsb/sh/big "$dir/big"
timed "basalt sh key get ${SIZE_MIB} MiB" "$bytes" "$BIN" sh --meta "$meta" --tls-dir "$dir/data/tls/client-cli" key get /bench/fsb/sh/big "$dir/big.sh"
cmp "$dir/big" "$dir/big.sh" && rm "$dir/big.sh"
timed "webhdfs -put dir of $FILES files" $((FILES * FILE_BYTES)) fsh -put "$dir/small" "$U/wh/small"
timed "webhdfs -mv of that dir (FsShell)" 0 fsh -mv "$U/wh/small" "$U/wh/small2"
timed "webhdfs RENAME of that dir (curl)" 0 curl -sf -X PUT "$H/wh/small2?op=RENAME&destination=/bench/fsb/wh/small3&user.name=bench"
n=$(curl -sf "$H/wh/small3?op=GETCONTENTSUMMARY" | python3 -c "import json,sys; print(json.load(sys.stdin)['ContentSummary']['fileCount'])")
[ "$n" = "$FILES" ] || { echo "renamed directory holds $n files, want $FILES" >&2; exit 1; }
timed "webhdfs DELETE of that dir (curl)" 0 curl -sf -X DELETE "$H/wh/small3?op=DELETE&recursive=true&user.name=bench"
