#!/usr/bin/env bash
# The durable write path of internal/storage (BenchmarkDurableWrite:
# WriteChunk + Sync per chunk + PutBlock, for a 128 MiB block in 1 MiB
# chunks and for 4 KiB one-chunk blocks, alone and 8 at once), two builds
# side by side on the same disk in alternating rounds; prints medians.
#   BEFORE=<git ref> scripts/bench-storage-durable.sh   # RUNS=5 BENCH_DIR=/work/benchtmp
# The benchmark file is copied into the BEFORE tree; a store without Sync
# runs WriteChunk + PutBlock (PutBlock synced the data itself).
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${BENCH_DIR:-/work/benchtmp}
RUNS=${RUNS:-5}
BEFORE=${BEFORE:?set BEFORE to the git ref to compare against}
mkdir -p "$DIR"
fstype=$(df -T "$DIR" | awk 'NR==2{print $2}')
if [ "$fstype" = tmpfs ]; then echo "$DIR is on tmpfs; pick a directory on the disk under test" >&2; exit 1; fi
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
git archive "$BEFORE" | tar -x -C "$src"
cp internal/storage/bench_durable_test.go "$src/internal/storage/"
(cd "$src" && go test -c -o "$DIR/before.test" ./internal/storage)
go test -c -o "$DIR/after.test" ./internal/storage
: >"$DIR/durable.txt"
for r in $(seq "$RUNS"); do
  for b in before after; do
    for spec in 'DurableWrite/block 8x' 'DurableWrite/small 300x'; do
      set -- $spec
      BASALT_BENCH_DIR="$DIR" "$DIR/$b.test" -test.run '^$' -test.bench "$1" -test.benchtime "$2" |
        awk -v b="$b" '/^Benchmark/{sub(/-[0-9]+$/, "", $1); print b, $1, $3}' | tee -a "$DIR/durable.txt"
    done
  done
done
echo "medians of $RUNS alternating runs (ms/op) on $DIR ($fstype), $(nproc) cores, kernel $(uname -r), $(date -u +%F), BEFORE=$BEFORE"
awk '{k=$2; v[k, $1, ++n[k, $1]]=$3; names[k]=1}
  function med(k, b,   i, j, t, c, a) { c=n[k, b]; for(i=1;i<=c;i++) a[i]=v[k, b, i];
    for(i=1;i<=c;i++) for(j=i+1;j<=c;j++) if(a[j]<a[i]){t=a[i];a[i]=a[j];a[j]=t}
    return (c%2)?a[(c+1)/2]:(a[c/2]+a[c/2+1])/2 }
  END { for (k in names) { x=med(k, "before")/1e6; y=med(k, "after")/1e6;
    printf "%-45s before %9.2f  after %9.2f  after/before %.2f\n", k, x, y, y/x } }' "$DIR/durable.txt" | sort
