#!/bin/bash
# S3 GET server CPU of several basalt builds on ONE data directory (bench
# s3 get writes its objects itself), alternating: each run starts a fresh `basalt dev` of one build and runs `bench s3 get -t 3
# -n 3`; prints label, round, MiB/s, server CPU-s/GiB, load average.
#   scripts/bench-s3-ab.sh DATADIR PORT ROUNDS label=BIN ...   (DUR=12s)
D=$1; P=$2; R=$3; shift 3
OUT=${OUT:-$(mktemp -d /tmp/bench-s3-ab.XXXXXX)}
for r in $(seq $R); do for c in "$@"; do
 l=${c%%=*}; b=${c#*=}
 $b dev --data-dir $D --base-port $P --s3 127.0.0.1:$((P+16)) --webhdfs "" --metrics 127.0.0.1:$((P-2)) > $OUT/dev.log 2>&1 & pid=$!
 for i in $(seq 300); do grep -q '^ready' $OUT/dev.log && break; sleep 0.2; done
 K=$(sed -n 's/.*access key \([^ ]*\) *secret \([^ ]*\).*/\1/p' $OUT/dev.log); S=$(sed -n 's/.*access key \([^ ]*\) *secret \([^ ]*\).*/\2/p' $OUT/dev.log)
 $b bench s3 get --endpoint http://127.0.0.1:$((P+16)) --access-key $K --secret-key $S --size 128MiB -t 3 -n 3 --duration ${DUR:-12s} --server-pid $pid --json > $OUT/$l-$r.json 2>/dev/null
 python3 -c "
import json,sys
d=json.load(open('$OUT/$l-$r.json')); d=d if isinstance(d,list) else [d]
for x in d:
  if x.get('op')=='get' or x.get('phase')=='get':
    print('$l', $r, round(x['mib_per_sec']), round(x['server_cpu_seconds']/(x['bytes']/2**30),3), open('/proc/loadavg').read().split()[0])
"
 kill $pid; wait $pid
done; done
