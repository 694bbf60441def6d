#!/usr/bin/env bash
# Raw disk (dd) versus Basalt's datanode storage layer, on the same disk, in
# the same run, repeated RUNS times; prints medians and ratios.
#   scripts/bench-storage.sh            # BENCH_DIR=/work/benchtmp RUNS=5
# Our write: WriteChunk x64 (4 MiB) + PutBlock with fsync, per 256 MiB block,
# 4 blocks (1 GiB) per run, like dd's bs=4M count=256. Our read: verified
# 4 MiB ReadAt over a 256 MiB block with its page cache dropped.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${BENCH_DIR:-/work/benchtmp}
RUNS=${RUNS:-5}
mkdir -p "$DIR"
fstype=$(df -T "$DIR" | awk 'NR==2{print $2}')
if [ "$fstype" = tmpfs ]; then echo "$DIR is on tmpfs; pick a directory on the disk under test" >&2; exit 1; fi
go test -c -o "$DIR/storage.test" ./internal/storage
F="$DIR/dd.bin"
ddrate() { awk '/copied/{printf "%.0f\n", $1/$(NF-3)/1e6}'; }
benchrate() { awk -v n="$1" '$1 ~ n {for(i=1;i<=NF;i++) if($(i)=="MB/s") printf "%.0f\n", $(i-1)}'; }
: >"$DIR/res.txt"
for r in $(seq "$RUNS"); do
  w=$(dd if=/dev/zero of="$F" bs=4M count=256 oflag=direct 2>&1 | ddrate)
  rd=$(dd if="$F" of=/dev/null bs=4M iflag=direct 2>&1 | ddrate)
  rm -f "$F"
  wf=$(dd if=/dev/zero of="$F" bs=4M count=256 conv=fsync 2>&1 | ddrate)
  rm -f "$F"
  out=$(BASALT_BENCH_DIR="$DIR" "$DIR/storage.test" -test.run=NONE -test.bench='WriteBlock|ReadAt' -test.benchtime=4x)
  crc=$("$DIR/storage.test" -test.run=NONE -test.bench='CRC32C' -test.benchtime=1s | benchrate CRC32C)
  ow=$(echo "$out" | benchrate 'WriteBlock/direct-[0-9]')
  owv=$(echo "$out" | benchrate 'WriteBlock/direct-verify')
  owb=$(echo "$out" | benchrate 'WriteBlock/buffered')
  ord=$(echo "$out" | benchrate 'ReadAt/direct')
  orb=$(echo "$out" | benchrate 'ReadAt/buffered')
  echo "run $r: dd_w_direct=$w dd_w_fsync=$wf dd_r_direct=$rd ours_w_direct=$ow ours_w_direct_verify=$owv ours_w_buffered=$owb ours_r_direct=$ord ours_r_buffered=$orb crc32c=$crc"
  echo "$w $wf $rd $ow $owv $owb $ord $orb $crc" >>"$DIR/res.txt"
done
median() { sort -n | awk '{a[NR]=$1} END{print (NR%2)?a[(NR+1)/2]:(a[NR/2]+a[NR/2+1])/2}'; }
col() { awk -v c="$1" '{print $c}' "$DIR/res.txt" | median; }
names=(dd_write_direct dd_write_buffered_fsync dd_read_direct ours_write_direct ours_write_direct_verify ours_write_buffered ours_read_direct ours_read_buffered crc32c_1core)
echo "medians of $RUNS runs (MB/s, 1 MB = 10^6 B) on $DIR ($fstype), $(nproc) cores, kernel $(uname -r), $(date -u +%F)"
declare -A m
for i in "${!names[@]}"; do m[${names[$i]}]=$(col $((i + 1))); printf '%-26s %s\n' "${names[$i]}" "${m[${names[$i]}]}"; done
awk -v a="${m[ours_write_direct]}" -v b="${m[dd_write_direct]}" 'BEGIN{printf "write ratio ours/dd-direct: %.2f (goal >= 0.90)\n", a/b}'
awk -v a="${m[ours_read_direct]}" -v b="${m[dd_read_direct]}" 'BEGIN{printf "read ratio ours/dd-direct:  %.2f (goal >= 0.85)\n", a/b}'
rm -f "$DIR/storage.test" "$DIR/res.txt"
