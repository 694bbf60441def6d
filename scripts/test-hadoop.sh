#!/usr/bin/env bash
# Hadoop's own client against Basalt's WebHDFS gateway: builds bin/basalt,
# starts a fresh `basalt dev` on free ports in a temporary directory, and
# runs the Maven module in hadoop/ (FsShell commands, including a
# BIGFILE_MIB file put/get with sha256 compared, and the AbstractContract*
# suites of hadoop-common's test jar). Needs Java 17 and Maven; artifacts
# are pinned in hadoop/pom.xml and cached in the Maven repository outside
# the checkout (MAVEN_REPO, default ~/.m2/repository); the first run
# downloads about 200 MB, with retries, before the cluster starts, and
# fails clearly if Maven Central cannot be reached. Build outputs go to
# hadoop/target (git-ignored); nothing downloaded lands in the repository.
#
# Knobs: BIGFILE_MIB (300), MVN_ARGS (e.g. -Dtest=TestFsShell), KEEP=1
# keeps the cluster's directory, MAVEN_REPO, FETCH_TRIES (4).
set -euo pipefail
cd "$(dirname "$0")/.."
GO=${GO:-go}
BIN=${BIN:-bin/basalt}
BIGFILE_MIB=${BIGFILE_MIB:-300}
MAVEN_REPO=${MAVEN_REPO:-$HOME/.m2/repository}
FETCH_TRIES=${FETCH_TRIES:-4}
start=$(date +%s)

command -v java >/dev/null && command -v mvn >/dev/null ||
  { echo "test-hadoop: FAILED: needs java (17+) and mvn on PATH" >&2; exit 1; }
case "$(cd "$(dirname "$MAVEN_REPO")" 2>/dev/null && pwd -P)/" in
"$(pwd -P)/"*) echo "test-hadoop: FAILED: MAVEN_REPO=$MAVEN_REPO is inside the checkout" >&2; exit 1 ;;
esac
# Wagon (Maven 3.8) retries each download itself too.
MVN=(mvn -B -ntp "-Dmaven.repo.local=$MAVEN_REPO"
  -Dmaven.wagon.http.retryHandler.count=5 -Dmaven.wagon.http.retryHandler.requestSentEnabled=true
  -Dmaven.wagon.httpconnectionManager.ttlSeconds=25 -Dhttp.keepAlive=false)

"$GO" build -o "$BIN" ./cmd/basalt

# Fetch the artifacts (dependencies, plugins, and surefire's JUnit 4
# provider, which surefire resolves only when a test runs) before starting
# the cluster, retried with back-off, so a network failure is reported as
# such rather than as failing tests.
fetch_log=$(mktemp /tmp/basalt-hadoop-fetch.XXXXXX)
ok=0
for try in $(seq "$FETCH_TRIES"); do
  if (cd hadoop && "${MVN[@]}" test-compile dependency:get -Dartifact=org.apache.maven.surefire:surefire-junit4:3.2.5) >"$fetch_log" 2>&1; then
    ok=1
    break
  fi
  echo "test-hadoop: fetching Maven artifacts failed (try $try of $FETCH_TRIES):" >&2
  grep -a -E '^\[ERROR\]' "$fetch_log" | head -5 >&2 || true
  [ "$try" = "$FETCH_TRIES" ] || sleep $((try * 10))
done
if [ "$ok" != 1 ]; then
  cp "$fetch_log" /tmp/basalt-hadoop-fetch.log
  echo "test-hadoop: FAILED: could not fetch the Maven artifacts from Maven Central after $FETCH_TRIES tries (network? log: /tmp/basalt-hadoop-fetch.log)" >&2
  exit 1
fi
rm -f "$fetch_log"
echo "test-hadoop: Maven artifacts ready ($(( $(date +%s) - start ))s)"

# A base port with the 50 after it free (basalt dev uses base..base+42),
# and the WebHDFS port at base+48. Starts basalt dev on a free port range (below the ephemeral ports);
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
dir=$(mktemp -d /tmp/basalt-hadoop.XXXXXX)
log="$dir/dev.log"
pid=
cleanup() {
  [ -n "$pid" ] && { kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; }
  if [ "${KEEP:-0}" = 1 ]; then echo "test-hadoop: cluster data kept in $dir"; else rm -rf "$dir"; fi
}
trap cleanup EXIT
for attempt in 1 2 3; do
  base=$(pick_base)
  wport=$((base + 48))
  rm -rf "$dir/data"
  "$BIN" dev --data-dir "$dir/data" --base-port "$base" --webhdfs "127.0.0.1:$wport" \
    --s3 127.0.0.1:0 --metrics 127.0.0.1:0 >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 240); do
    grep -q '^ready' "$log" && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  grep -q '^ready' "$log" && break
  cat "$log" >&2
  kill "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
  pid=
  echo "test-hadoop: basalt dev did not start (attempt $attempt of 3)" >&2
  [ "$attempt" = 3 ] && exit 1
done
grep webhdfs "$log"

rc=0
(cd hadoop && "${MVN[@]}" test -Dbasalt.webhdfs.uri="webhdfs://127.0.0.1:$wport" \
  -Dbasalt.bigfile.mib="$BIGFILE_MIB" ${MVN_ARGS:-}) >"$dir/mvn.log" 2>&1 || rc=$?
grep -a -E '^\[(INFO|WARNING|ERROR)\] (Tests run|Failures|Errors|  )|BUILD|put [0-9]+ MiB' "$dir/mvn.log" || true
if [ "$rc" != 0 ]; then
  cp "$dir/mvn.log" /tmp/basalt-hadoop-mvn.log
  echo "test-hadoop: FAILED (Maven log: /tmp/basalt-hadoop-mvn.log; reports in hadoop/target/surefire-reports)"
fi
echo "test-hadoop: $(( $(date +%s) - start ))s"
exit "$rc"
