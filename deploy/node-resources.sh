#!/bin/sh
# Usage: node-resources.sh [--head] ROLES_FILE
# Prints this machine's custom Ray resources, for `ray start --resources="$(node-resources.sh FILE)"`:
# the JSON of the ROLES_FILE line whose IP is one of this machine's (`hostname -I`), else one
# expert worker's worth ({"expert_node":1}). See deploy/node-roles.
#
# --head (the head's `ray start --head` in deploy/ray-up-onprem.yaml): adds the control-plane
# resource, {"head_node": $MOE_HEAD_NODE_UNITS} (default 4), to what the roles give. The app asks for
# one unit per router replica and one for the balancer (`control_resources: {head_node: 1}` in
# deploy/cluster.yaml), so the front door stays on the head and no worker machine's loss takes it:
# 4 = 2 router replicas + the balancer + 1 for the replica a rolling update starts beside the old.
set -eu
head=0
if [ "${1:-}" = --head ]; then
    head=1
    shift
fi
roles=$1

resources='{"expert_node":1}'
for ip in ${MOE_NODE_IPS:-$(hostname -I)}; do
    line=$(awk -v ip="$ip" '$1 == ip { print $2; exit }' "$roles")
    if [ -n "$line" ]; then
        resources=$line
        break
    fi
done
if [ "$head" = 1 ]; then
    case $resources in
        *'"head_node"'*) ;;  # the roles file gives the head its units itself
        '{}') resources="{\"head_node\":${MOE_HEAD_NODE_UNITS:-4}}" ;;
        *) resources="{\"head_node\":${MOE_HEAD_NODE_UNITS:-4},${resources#\{}" ;;
    esac
fi
echo "$resources"
