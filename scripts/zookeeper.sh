#!/usr/bin/env bash
# Start or stop a ZooKeeper for tests and benches, on loopback only.
#   scripts/zookeeper.sh start [PORT] [DIR]   prints nothing on success; DIR/pid holds its PID
#   scripts/zookeeper.sh stop  [PORT] [DIR]   stops only the PID this script started
# Installs Debian's `zookeeper` package when its jar is missing.
set -euo pipefail
cmd=${1:-start}
ZK_PORT=${2:-${ZK_PORT:-21810}}
ZK_DIR=${3:-${ZK_DIR:-/tmp/scheduler-zookeeper-$ZK_PORT}}
JAR=/usr/share/java/zookeeper.jar

probe() {  # true when a standalone ZooKeeper answers `srvr` on the port
  (exec 3<>/dev/tcp/127.0.0.1/"$ZK_PORT" && printf srvr >&3 && timeout 2 cat <&3) 2>/dev/null | grep -q '^Mode: standalone'
}

holds_port() {  # true when our PID is the one listening on the port
  local pid=$1
  ss -ltnpH "sport = :$ZK_PORT" 2>/dev/null | grep -q "pid=$pid,"
}

stop() {
  [ -f "$ZK_DIR/pid" ] || return 0
  local pid; pid=$(cat "$ZK_DIR/pid")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$ZK_DIR/pid"
}

start() {
  if [ ! -f "$JAR" ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq zookeeper >/dev/null
  fi
  if [ -f "$ZK_DIR/pid" ] && kill -0 "$(cat "$ZK_DIR/pid")" 2>/dev/null && probe; then
    return 0  # ours, already up
  fi
  if probe; then
    echo "zookeeper.sh: port $ZK_PORT answers but is not ours; pick another port" >&2
    exit 1
  fi
  stop
  rm -rf "$ZK_DIR/data"; mkdir -p "$ZK_DIR/data"
  # ZooKeeper expires a session only on a tick boundary, so a dead member's
  # session ends between the timeout and the timeout plus one tick: a short
  # tick keeps scanner handover close to the session timeout. The session
  # bounds must be explicit: by default they are 2 and 20 ticks (0.4 s, 4 s),
  # which would cut a 10 s session down to 4 s.
  printf 'tickTime=200\nminSessionTimeout=400\nmaxSessionTimeout=60000\ndataDir=%s/data\nclientPort=%s\nclientPortAddress=127.0.0.1\nmaxClientCnxns=0\nadmin.enableServer=false\n4lw.commands.whitelist=ruok,srvr,stat,mntr,conf\n' \
    "$ZK_DIR" "$ZK_PORT" >"$ZK_DIR/zoo.cfg"
  local cp=$JAR
  [ -f /usr/share/java/slf4j-simple.jar ] && cp="$cp:/usr/share/java/slf4j-simple.jar"
  nohup java -Xmx256m -cp "$cp" org.apache.zookeeper.server.quorum.QuorumPeerMain "$ZK_DIR/zoo.cfg" \
    >"$ZK_DIR/zookeeper.log" 2>&1 </dev/null &
  local pid=$!
  echo "$pid" >"$ZK_DIR/pid"
  for _ in $(seq 300); do
    if probe; then
      if command -v ss >/dev/null && ! holds_port "$pid"; then
        echo "zookeeper.sh: port $ZK_PORT is held by another process" >&2; stop; exit 1
      fi
      return 0
    fi
    kill -0 "$pid" 2>/dev/null || { cat "$ZK_DIR/zookeeper.log" >&2; exit 1; }
    sleep 0.1
  done
  echo "zookeeper.sh: ZooKeeper did not come up on $ZK_PORT within 30 s" >&2
  cat "$ZK_DIR/zookeeper.log" >&2
  stop; exit 1
}

case "$cmd" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop [PORT] [DIR]" >&2; exit 2 ;;
esac
