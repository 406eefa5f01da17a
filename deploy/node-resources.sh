#!/bin/sh
# Usage: node-resources.sh ROLES_FILE
# Prints this machine's custom Ray resources, for `ray start --resources="$(node-resources.sh FILE)"`:
# the JSON of the ROLES_FILE line whose IP is one of this machine's (`hostname -I`), else one
# expert worker's worth ({"expert_node":1}). See deploy/node-roles.
set -eu
roles=$1
for ip in ${MOE_NODE_IPS:-$(hostname -I)}; do
    resources=$(awk -v ip="$ip" '$1 == ip { print $2; exit }' "$roles")
    if [ -n "$resources" ]; then
        echo "$resources"
        exit 0
    fi
done
echo '{"expert_node":1}'
