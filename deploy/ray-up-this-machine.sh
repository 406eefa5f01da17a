#!/bin/sh
# Usage: sh deploy/ray-up-this-machine.sh [WORKDIR]
#
# Runs deploy/ray-up-onprem.yaml for real on this one machine, the way docs/deploy.md tells a
# newcomer to (section 2), over SSH to 127.0.0.1: `ray up`, the API answering a completion,
# `ray exec ... moe-cluster scale-experts` and `status`, `ray down`, and then nothing of the
# cluster left running (Ray, the app, Redis). Needs root on a Debian-like machine with no Ray
# running (`ray up` runs `ray stop` here). What it changes, and puts back on exit: sshd on
# 127.0.0.1:22 (openssh-server and rsync installed with apt-get if missing), a throwaway key in
# ~/.ssh/authorized_keys, a PATH line in ~/.bashrc, ~/moe-cluster (the synced repository),
# ~/.moe-cluster (start-head.sh's secrets), ~/.ray/moe-cluster-token (the cluster's Ray token) and
# the yaml's RAY_AUTH_MODE line in ~/.bashrc, unless they were there before.
#
# The yaml it runs is deploy/ray-up-onprem.yaml with what differs on one machine: head_ip
# 127.0.0.1 and no workers, this user and key, a node-roles line giving the head both roles, a tiny
# generated checkpoint, and the torch line without the download.pytorch.org index (this machine's
# pip finds torch). MOE_RAY_UP_VENV=DIR uses a virtualenv that already holds the project instead of
# installing one (the test does; the install itself is what a fresh `ray up` spends minutes on).
# Everything goes to WORKDIR/log.txt; the exit status is the first failed step's.
set -eu
repo=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$(mktemp -d)}
mkdir -p "$work"
work=$(cd "$work" && pwd)
log=$work/log.txt
venv=${MOE_RAY_UP_VENV:-$work/venv}
python=${PYTHON:-python3}
user=$(id -un)
: >"$log"

say() { echo "== $(date +%T) $*" | tee -a "$log"; }
run() { "$@" >>"$log" 2>&1; }

cleanup() {
    set +e
    say "cleanup"
    [ -f "$work/up-started" ] && ! grep -q "^ray down done" "$log" && run "$venv/bin/ray" down -y "$work/ray-up.yaml"
    [ -f "$work/id.pub" ] && sed -i "\#$(cut -d' ' -f2 "$work/id.pub")#d" ~/.ssh/authorized_keys
    sed -i "\#export PATH=$venv/bin#d" ~/.bashrc 2>/dev/null
    [ -e "$work/had-ray-auth-line" ] || sed -i '/export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=/d' ~/.bashrc 2>/dev/null
    [ -f "$work/sshd.pid" ] && kill "$(cat "$work/sshd.pid")"
    for _ in $(seq 40); do  # (the watchdog reads its pid files there until Redis and the app are gone)
        pgrep -f "redis-server .*:6380|moe-cluster up --config $HOME/.moe-cluster" >/dev/null || break
        sleep 1
    done
    # its work done, the watchdog would wait a minute for a Ray to come back: this run is over
    [ -e "$work/had-state" ] || pkill -f "head-watchdog.py $HOME/.moe-cluster"
    [ -e "$work/had-moe-cluster" ] || rm -rf ~/moe-cluster
    [ -e "$work/had-state" ] || rm -rf ~/.moe-cluster
    [ -e "$work/had-ray-token" ] || rm -f ~/.ray/moe-cluster-token
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP  # (dash runs the EXIT trap only on exit: make a signal one)
[ -e ~/moe-cluster ] && touch "$work/had-moe-cluster"
[ -e ~/.moe-cluster ] && touch "$work/had-state"
[ -e ~/.ray/moe-cluster-token ] && touch "$work/had-ray-token"
grep -q RAY_AUTH_MODE ~/.bashrc 2>/dev/null && touch "$work/had-ray-auth-line"

say "sshd on 127.0.0.1:22 with a throwaway key"
need=""
[ -x /usr/sbin/sshd ] || need="openssh-server"
command -v rsync >/dev/null || need="$need rsync"  # (`ray up` syncs file_mounts with it)
[ -z "$need" ] || run apt-get install -y -q $need
ssh-keygen -q -t ed25519 -N '' -C moe-ray-up -f "$work/id"
mkdir -p ~/.ssh /run/sshd && chmod 700 ~/.ssh
cat "$work/id.pub" >>~/.ssh/authorized_keys
if ! ssh -o BatchMode=yes -o StrictHostKeyChecking=no -i "$work/id" "$user@127.0.0.1" true 2>/dev/null; then
    run ssh-keygen -A
    /usr/sbin/sshd -o ListenAddress=127.0.0.1 -o PidFile="$work/sshd.pid" -o PermitRootLogin=prohibit-password
    ssh -o BatchMode=yes -o StrictHostKeyChecking=no -i "$work/id" "$user@127.0.0.1" true
fi

if [ -z "${MOE_RAY_UP_VENV:-}" ]; then
    say "a virtualenv for the ray CLI on this side (the yaml's setup commands install the project)"
    run "$python" -m venv "$venv"
    run "$venv/bin/pip" install -q torch==2.13.0
    run "$venv/bin/pip" install -q "$repo"
fi

say "a tiny checkpoint, the roles and the yaml"
run "$venv/bin/moe-cluster" init-model "$work/model" --preset tiny
ip=$(hostname -I | awk '{print $1}')
echo "$ip {\"attention_node\":1,\"expert_node\":3}" >"$work/node-roles"
"$python" - "$repo" "$work" "$venv" "$user" "${MOE_RAY_UP_VENV:-}" <<'EOF'
import sys
from pathlib import Path

import yaml

repo, work, venv = (Path(a) for a in sys.argv[1:4])
user, reuse = sys.argv[4], sys.argv[5]
app = yaml.safe_load((repo / "deploy/cluster.yaml").read_text())
app.update(model=str(work / "model"), served_model_name="tiny", expert_workers=2, redundant_experts=0,
           dtype="float32", attention_threads=1, expert_threads=1, max_num_seqs=8, balancer_period_s=0)
(work / "cluster.yaml").write_text(yaml.safe_dump(app))

text = (repo / "deploy/ray-up-onprem.yaml").read_text()
text = text.replace("grep -q moe-venv", f"grep -q {venv}/bin")
text = text.replace("~/moe-venv", str(venv)).replace("$HOME/moe-venv", str(venv))
text = text.replace("~/moe-cluster/deploy/node-roles", str(work / "node-roles"))
text = text.replace("~/moe-cluster/deploy/cluster.yaml", str(work / "cluster.yaml"))
cfg = yaml.safe_load(text)
cfg["cluster_name"] = "moe-cluster-this-machine"
cfg["provider"].update(head_ip="127.0.0.1", worker_ips=[])
cfg.update(min_workers=0, max_workers=0, auth={"ssh_user": user, "ssh_private_key": str(work / "id")})
cfg["file_mounts"] = {"~/moe-cluster": str(repo)}
setup = [c for c in cfg["setup_commands"] if "pip install -q torch" not in c]
if reuse:  # the project is installed there already: no venv, no pip
    setup = [c for c in setup if "pip install" not in c and "-m venv" not in c]
else:  # this machine's pip finds torch without the download.pytorch.org index
    setup.insert(1, f"{venv}/bin/pip install -q torch==2.13.0")
cfg["setup_commands"] = setup
(work / "ray-up.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
EOF

say "ray up"
touch "$work/up-started"
start=$(date +%s)
run "$venv/bin/ray" up -y --no-config-cache "$work/ray-up.yaml"
echo "ray up done in $(($(date +%s) - start)) s" | tee -a "$log"

say "the API answers"
key=$(cat ~/.moe-cluster/api-key)
for _ in $(seq 180); do
    curl -sf -m 5 -o /dev/null -H "Authorization: Bearer $key" http://127.0.0.1:8000/v1/models && break
    sleep 2
done
curl -sf -m 120 -o "$work/answer.json" http://127.0.0.1:8000/v1/completions -H "Authorization: Bearer $key" \
    -H 'Content-Type: application/json' -d '{"model": "tiny", "prompt": [0, 5, 6, 7], "max_tokens": 8}'
{ cat "$work/answer.json"; echo; } | tee -a "$log"
echo "API answered $(($(date +%s) - start)) s after ray up started" | tee -a "$log"

say "scale-experts and status through ray exec"
run "$venv/bin/ray" exec "$work/ray-up.yaml" 'moe-cluster scale-experts 3'
"$venv/bin/ray" exec "$work/ray-up.yaml" 'moe-cluster status' >"$work/status.txt" 2>&1
cat "$work/status.txt" >>"$log"
grep -q "expert-2" "$work/status.txt"

say "ray down"
run "$venv/bin/ray" down -y "$work/ray-up.yaml"
echo "ray down done" | tee -a "$log"
left=""
for _ in $(seq 60); do  # the watchdog of start-head.sh stops the app and Redis within seconds
    left=$(pgrep -af "redis-server .*:6380|moe-cluster up --config $HOME/.moe-cluster|raylet|gcs_server" |
        grep -v pgrep || true)  # (start-head.sh's Redis and app, Ray's daemons: not other Redis servers)
    [ -z "$left" ] && break
    sleep 2
done
[ -z "$left" ] || { echo "still running after ray down: $left" | tee -a "$log"; exit 1; }
say "all done: nothing left running"
