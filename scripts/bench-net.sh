#!/usr/bin/env bash
# V1 (Raft) versus V2 (streaming chain) write throughput on an emulated
# multi-host network (seed 000's benchmark, scaled down), then the same on
# plain loopback.
#
#   sudo scripts/bench-net.sh                 # or: make bench-net
#   RATE=500mbit KEYS=4 scripts/bench-net.sh # knobs below
#
# Hosts are Linux network namespaces on private addresses (10.77.x.y; nothing
# leaves the machine): meta, dn1+dn2 on rack1, dn3 on rack2, clients c1
# (rack1), c2 (rack2), c3 (rack1). Each rack is a bridge; a router namespace
# joins the racks and the core (meta). Every host link (veth) is capped with
# tbf at RATE in both directions, so links, not this machine's CPU, are the
# limit. Every process is the real binary: `basalt meta`, `basalt datanode`,
# `basalt bench write --validate --json`.
#
# Why V2 should win on capped links: in V1 every byte goes client → leader
# and leader → each of 2 followers, so the leader's uplink carries 2x the
# data: V1 <= RATE/2. In V2 the chain client → dn → dn → dn puts 1x on
# every link: V2 <= RATE. The script prints per-host bytes up/down for each
# write phase to show where the bytes went.
#
# Teardown is a trap on EXIT: it kills only the PIDs this script started and
# deletes only the namespaces and bridges it created (all named bnet-*).
set -euo pipefail
cd "$(dirname "$0")/.."

# 250 Mbit/s keeps this 2-vCPU machine's CPU out of the way: measured
# 2026-11-21, V1 reaches 91% of its link bound at <= 81% CPU busy, V2 94%
# at 25%; at 500 Mbit/s V1 was CPU-limited (88% busy, 74% of its bound),
# which flatters V2. The report prints CPU busy per run to check this.
RATE=${RATE:-250mbit}           # per host link, each direction
BURST=${BURST:-512kb}           # tbf bucket; >= RATE/HZ and > a 64 KiB GSO packet
KEYS=${KEYS:-2}                 # keys per client per run (~3.5 min in all at 250mbit)
SIZE=${SIZE:-128MiB}            # bytes per key (seed 000: 128 MB)
THREADS=${THREADS:-2}           # concurrent PutKeys per client
MAX_SECONDS=${MAX_SECONDS:-600} # whole script; runs that would start later are skipped
RUN_TIMEOUT=${RUN_TIMEOUT:-240} # one bench invocation
BIN=${BIN:-bin/basalt}
OUT=${OUT:-}                    # also write the report (markdown) here
KEEP=${KEEP:-0}                 # 1: keep the work directory (logs, JSON)

T0=$(date +%s)
log() { printf '[%4ds] %s\n' $(($(date +%s) - T0)) "$*" >&2; }
die() { log "error: $*"; exit 1; }

[ "$(uname -s)" = Linux ] || die "network namespaces need Linux"
[ "$(id -u)" = 0 ] || die "must run as root (ip netns, tc); try: sudo $0"
if ! command -v ip >/dev/null || ! command -v tc >/dev/null; then
  log "installing iproute2 (ip, tc)"
  apt-get update -qq && apt-get install -y -qq iproute2 >/dev/null
fi
command -v jq >/dev/null || { log "installing jq"; apt-get update -qq && apt-get install -y -qq jq >/dev/null; }
for ns in $(ip netns list | awk '{print $1}'); do
  case $ns in bnet-*) die "namespace $ns exists (an earlier run died?); remove it with: ip netns del $ns";; esac
done
if ip -o link show | awk -F': ' '{print $2}' | grep -q '^bnet-'; then
  die "links named bnet-* exist (an earlier run died?); list them with: ip -o link show | grep bnet-"
fi

log "building $BIN"
"${GO:-go}" build -o "$BIN" ./cmd/basalt
BIN=$(realpath "$BIN")
WORK=$(mktemp -d "${TMPDIR:-/tmp}/basalt-bench-net.XXXXXX")

# ------------------------------------------------------------ teardown
PIDS=()       # processes we started
NETNS=()      # namespaces we created
LINKS=()      # root-namespace links we created (bridges; veths go with their namespace)
cleanup() {
  local rc=$?
  set +e
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null; done
  for _ in $(seq 50); do
    local alive=0
    for p in "${PIDS[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.2
  done
  for p in "${PIDS[@]}"; do kill -KILL "$p" 2>/dev/null; done
  for n in "${NETNS[@]}"; do ip netns del "$n" 2>/dev/null; done
  for l in "${LINKS[@]}"; do ip link del "$l" 2>/dev/null; done
  if [ "$KEEP" = 1 ] || [ $rc != 0 ]; then
    echo "work directory kept: $WORK" >&2
  else
    rm -rf "$WORK"
  fi
  exit $rc
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# ------------------------------------------------------------ topology
# host → "namespace subnet-index host-octet location"
declare -A HOST=(
  [meta]="0 10 -"
  [dn1]="1 11 /dc1/rack1" [dn2]="1 12 /dc1/rack1" [dn3]="2 13 /dc1/rack2"
  [c1]="1 21 /dc1/rack1" [c2]="2 22 /dc1/rack2" [c3]="1 23 /dc1/rack1"
)
HOSTS="meta dn1 dn2 dn3 c1 c2 c3"
ip_of() { set -- ${HOST[$1]}; echo "10.77.$1.$2"; }
loc_of() { set -- ${HOST[$1]}; echo "$3"; }

addns() { ip netns add "$1"; NETNS+=("$1"); ip -n "$1" link set lo up; }

setup_net() {
  log "creating namespaces, bridges and veths (cap $RATE per link and direction)"
  addns bnet-rt
  ip netns exec bnet-rt sysctl -qw net.ipv4.ip_forward=1
  for s in 0 1 2; do
    ip link add "bnet-br$s" type bridge && LINKS+=("bnet-br$s")
    ip link set "bnet-br$s" up
    # router leg: bnet-rt$s in the root namespace, r$s in the router.
    ip link add "bnet-rt$s" type veth peer name "bnet-rtp$s"
    ip link set "bnet-rtp$s" netns bnet-rt
    ip -n bnet-rt link set "bnet-rtp$s" name "r$s"
    ip -n bnet-rt addr add "10.77.$s.254/24" dev "r$s"
    ip -n bnet-rt link set "r$s" up
    ip link set "bnet-rt$s" master "bnet-br$s" up
  done
  for h in $HOSTS; do
    set -- ${HOST[$h]}
    local ns="bnet-$h" s=$1
    addns "$ns"
    ip link add "bnet-$h" type veth peer name "bnet-$h-p"
    ip link set "bnet-$h-p" netns "$ns"
    ip -n "$ns" link set "bnet-$h-p" name eth0
    ip -n "$ns" addr add "$(ip_of "$h")/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" route add default via "10.77.$s.254"
    ip link set "bnet-$h" master "bnet-br$s" up
    # Upload (host → bridge) and download (bridge → host) caps.
    ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$RATE" burst "$BURST" latency 20ms
    tc qdisc add dev "bnet-$h" root tbf rate "$RATE" burst "$BURST" latency 20ms
  done
}

# ------------------------------------------------------------ cluster
# start_cluster MODE: MODE=net runs each role in its namespace on 10.77.x.y;
# MODE=lo runs the same processes in this namespace on 127.0.0.1.
META=""
SERVER_PIDS=""
start_cluster() {
  local mode=$1 dir="$WORK/$1"
  mkdir -p "$dir"
  local maddr mexec
  # Loopback ports are off basalt dev's defaults (9862...) so a running dev
  # cluster does not collide.
  if [ "$mode" = net ]; then maddr=$(ip_of meta); mexec="ip netns exec bnet-meta"; else maddr=127.0.0.1; mexec=""; fi
  META="$maddr:29862"
  # Every process gets its own certificate from a fresh cluster CA.
  "$BIN" admin ca init --dir "$dir/ca" >/dev/null
  "$BIN" admin ca issue --dir "$dir/ca" --role meta --id 1 --out "$dir/tls-meta" >/dev/null
  "$BIN" admin ca issue --dir "$dir/ca" --role client --id bench --out "$dir/tls-client" >/dev/null
  export BASALT_TLS_DIR=$dir/tls-client
  $mexec "$BIN" meta --id 1 --data-dir "$dir/meta" --tls-dir "$dir/tls-meta" --grpc "$maddr:29862" --raft "$maddr:29863" \
    >"$dir/meta.log" 2>&1 &
  PIDS+=($!)
  SERVER_PIDS=$!
  local i=0
  for h in dn1 dn2 dn3; do
    local a x port=$((29870 + 10 * i))
    if [ "$mode" = net ]; then a=$(ip_of $h); x="ip netns exec bnet-$h"; port=9870; else a=127.0.0.1; x=""; fi
    "$BIN" admin ca issue --dir "$dir/ca" --role datanode --out "$dir/tls-$h" >/dev/null
    $x "$BIN" datanode --data-dir "$dir/$h" --tls-dir "$dir/tls-$h" --hostname "$h" --location "$(loc_of $h)" --meta "$META" \
      --listen "$a:$port" --raft "$a:$((port + 1))" --stream "$a:$((port + 2))" >"$dir/$h.log" 2>&1 &
    PIDS+=($!)
    SERVER_PIDS="$SERVER_PIDS,$!"
    i=$((i + 1))
  done
  # Writable when a V1 and a V2 write both go through (pipeline created,
  # leader elected, streams served).
  log "waiting for the $mode cluster to take writes"
  local deadline=$(($(date +%s) + 120))
  until client_exec "$mode" c1 "$BIN" bench write --meta "$META" --location "$(loc_of c1)" -n 1 --size 5MiB -t 1 \
      --prefix warm-v1- --pipeline v1 >/dev/null 2>&1 &&
    client_exec "$mode" c1 "$BIN" bench write --meta "$META" --location "$(loc_of c1)" -n 1 --size 5MiB -t 1 \
      --prefix warm-v2- --pipeline v2 >/dev/null 2>&1; do
    [ "$(date +%s)" -lt $deadline ] || die "the $mode cluster did not take writes within 120s (logs in $dir)"
    sleep 1
  done
}

stop_cluster() {
  local keep=()
  for p in "${PIDS[@]}"; do
    if [[ ",$SERVER_PIDS," == *",$p,"* ]]; then kill -TERM "$p" 2>/dev/null || true; else keep+=("$p"); fi
  done
  for p in ${SERVER_PIDS//,/ }; do
    for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$p" 2>/dev/null || true
  done
  PIDS=("${keep[@]}")
}

client_exec() {
  local mode=$1 h=$2
  shift 2
  if [ "$mode" = net ]; then ip netns exec "bnet-$h" "$@"; else "$@"; fi
}

# ------------------------------------------------------------ measuring
# Per-host link bytes: on the root side of each host's veth, rx is what the
# host sent (up) and tx what it received (down).
link_snapshot() {
  for h in $HOSTS; do
    echo "$h $(cat /sys/class/net/bnet-$h/statistics/rx_bytes) $(cat /sys/class/net/bnet-$h/statistics/tx_bytes)"
  done
}
cpu_snapshot() { awk '/^cpu /{idle=$5+$6; t=0; for(i=2;i<=NF;i++) t+=$i; print t, idle}' /proc/stat; }

RESULTS="$WORK/results.tsv" # mode workload path client MiB/s seconds bytes write_phase_cpu_busy%
: >"$RESULTS"
LINKS_REPORT="$WORK/links.txt"
: >"$LINKS_REPORT"

# run MODE WORKLOAD PATH CLIENT...: the clients write KEYS keys each at once,
# then each validates its keys.
run() {
  local mode=$1 wl=$2 path=$3
  shift 3
  local clients=("$@")
  local left=$((MAX_SECONDS - ($(date +%s) - T0)))
  if [ $left -lt 30 ]; then
    log "skipping $mode $wl $path: time bound MAX_SECONDS=$MAX_SECONDS reached"
    for c in "${clients[@]}"; do printf '%s\t%s\t%s\t%s\tskipped\t0\t0\t-\n' "$mode" "$wl" "$path" "$c" >>"$RESULTS"; done
    return
  fi
  log "$mode: $wl, $path: ${#clients[@]} client(s) x $KEYS x $SIZE, validated"
  local d="$WORK/runs/$mode-$wl-$path"
  mkdir -p "$d"
  [ "$mode" = net ] && link_snapshot >"$d/links0"
  cpu_snapshot >"$d/cpu0"
  local pids=()
  for c in "${clients[@]}"; do
    # --progress: the write phase's progress line ends with a newline,
    # which tells the watcher below that this client's writes are done.
    client_exec "$mode" "$c" timeout "$RUN_TIMEOUT" "$BIN" bench write --meta "$META" --location "$(loc_of "$c")" \
      -n "$KEYS" --size "$SIZE" -t "$THREADS" --pipeline "$path" --validate --json --progress \
      --prefix "$wl-$c-" --server-pid "$SERVER_PIDS" >"$d/$c.json" 2>"$d/$c.err" &
    pids+=($!)
    PIDS+=($!)
  done
  # Snapshot links and CPU when the first client ends its write phase
  # (clients run the same load at once, so they end close together); the
  # validate reads that follow must not count as write traffic.
  while :; do
    local done_writing=0
    for c in "${clients[@]}"; do
      [ -f "$d/$c.err" ] && [ "$(wc -l <"$d/$c.err")" -ge 1 ] && done_writing=1
    done
    local running=0
    for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && running=1; done
    if [ $done_writing = 1 ] || [ $running = 0 ]; then break; fi
    sleep 0.1
  done
  [ "$mode" = net ] && link_snapshot >"$d/links1"
  cpu_snapshot >"$d/cpu1"
  local failed=0
  for p in "${pids[@]}"; do wait "$p" || failed=1; done
  local busy
  busy=$(paste "$d/cpu0" "$d/cpu1" | awk '{dt=$3-$1; di=$4-$2; printf "%.0f", (dt > 0) ? 100*(dt-di)/dt : 0}')
  for c in "${clients[@]}"; do
    if ! jq -e '.[0].phase == "write"' "$d/$c.json" >/dev/null 2>&1; then
      log "client $c: no result; stderr: $(tail -c 400 "$d/$c.err" | tr '\r\n' '  ')"
      printf '%s\t%s\t%s\t%s\tfailed\t0\t0\t%s\n' "$mode" "$wl" "$path" "$c" "$busy" >>"$RESULTS"
      continue
    fi
    local v
    v=$(jq -r '[.[0].mib_per_sec, .[0].seconds, .[0].bytes, .[0].errors, (.[1].mismatching // 0), (.[1].validated // 0), (.[0].server_cpu_seconds // 0)] | @tsv' "$d/$c.json")
    read -r mibs secs bytes errs mism valid scpu <<<"$v"
    if [ "$errs" != 0 ] || [ "$mism" != 0 ] || [ "$valid" != "$KEYS" ]; then
      log "client $c: $errs write errors, $mism mismatching, $valid/$KEYS validated"
      failed=1
    fi
    printf '%s\t%s\t%s\t%s\t%.1f\t%.2f\t%s\t%s\t%.1f\n' "$mode" "$wl" "$path" "$c" "$mibs" "$secs" "$bytes" "$busy" "$scpu" >>"$RESULTS"
  done
  [ $failed = 0 ] || log "$mode $wl $path: FAILED or not validated (see $d)"
  if [ "$mode" = net ]; then
    {
      echo "$wl $path (write phase, MiB; up = sent by the host, down = received):"
      paste "$d/links0" "$d/links1" | awk '{printf "  %-4s up %7.1f  down %7.1f\n", $1, ($5-$2)/1048576, ($6-$3)/1048576}'
    } >>"$LINKS_REPORT"
  fi
}

workloads() {
  local mode=$1
  run "$mode" 1client v1 c1
  run "$mode" 1client v2 c1
  run "$mode" 3clients v1 c1 c2 c3
  run "$mode" 3clients v2 c1 c2 c3
}

# ------------------------------------------------------------ main
setup_net
start_cluster net
workloads net
stop_cluster
rm -rf "$WORK/net/meta" "$WORK/net/dn"*   # free the disk for the loopback run
start_cluster lo
workloads lo
stop_cluster

# ------------------------------------------------------------ report
# Aggregate of a run = all clients' bytes / the slowest client's write time.
agg() { # mode workload path → MiB/s or "-"
  awk -F'\t' -v m="$1" -v w="$2" -v p="$3" '$1==m && $2==w && $3==p {
      if ($5 !~ /^[0-9.]+$/) bad=1; b+=$7; if ($6>s) s=$6 }
    END { if (bad || s==0) print "-"; else printf "%.1f", b/1048576/s }' "$RESULTS"
}
busy() { awk -F'\t' -v m="$1" -v w="$2" -v p="$3" '$1==m && $2==w && $3==p {print $8; exit}' "$RESULTS"; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { if (a=="-" || b=="-" || a==0) print "-"; else printf "%.2fx", b/a }'; }
verdict() { awk -v r="${1%x}" -v g="$2" 'BEGIN { if (r=="-") print "n/a"; else if (r+0 >= g) print "met"; else print "missed" }'; }

report() {
  local mach
  mach="$(nproc) vCPU $(awk -F': ' '/model name/{print $2; exit}' /proc/cpuinfo), $(awk '/MemTotal/{printf "%.0f GiB", $2/1048576}' /proc/meminfo), kernel $(uname -r)"
  echo "## basalt bench-net: V1 vs V2, $KEYS x $SIZE per client, -t $THREADS, every key validated"
  echo
  echo "date $(date -u '+%F %T UTC'), machine: $mach, commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet 2>/dev/null || echo ' (+ uncommitted changes)')"
  echo "command: RATE=$RATE KEYS=$KEYS SIZE=$SIZE THREADS=$THREADS scripts/bench-net.sh"
  for mode in net lo; do
    echo
    if [ $mode = net ]; then
      echo "### network namespaces, every host link capped at $RATE each way (tbf)"
    else
      echo "### plain loopback (same processes on 127.0.0.1, no caps)"
    fi
    echo
    echo "| workload | V1 MiB/s | V2 MiB/s | V2/V1 | goal | CPU busy V1 / V2 (write phase, all $(nproc) cores) |"
    echo "|---|---:|---:|---:|---|---|"
    for wl in 1client 3clients; do
      local a b r g
      a=$(agg $mode $wl v1) b=$(agg $mode $wl v2) r=$(ratio "$a" "$b")
      g=2; [ $wl = 3clients ] && g=3
      echo "| $wl | $a | $b | $r | >= ${g}x: $(verdict "$r" $g) | $(busy $mode $wl v1)% / $(busy $mode $wl v2)% |"
    done
    echo
    echo "per client (MiB/s, write phase):"
    awk -F'\t' -v m=$mode '$1==m {printf "  %-8s %s %s %8s MiB/s  %6.1f s  server CPU %5.1f s\n", $2, $3, $4, $5, $6, $9}' "$RESULTS"
  done
  echo
  echo "### bytes per host link during the write phases (network run)"
  echo
  echo '```'
  cat "$LINKS_REPORT"
  echo '```'
}
report | tee "$WORK/report.md"
[ -z "$OUT" ] || cp "$WORK/report.md" "$OUT"
log "done in $(($(date +%s) - T0)) s"
