#!/usr/bin/env bash
# A pretend cluster on one Linux machine: N "nodes", each a network namespace with its own address,
# joined by a bridge, so torchrun agents and gloo talk over real (virtual) Ethernet between
# addresses, as on N machines. The host's own network is never touched: the bridge lives in a
# namespace of its own. Needs root (or CAP_NET_ADMIN) and iproute2.
#
#   tools/netns_cluster.sh up N [NAME]     create NAME-hub and nodes NAME-n0 .. NAME-n<N-1>
#   tools/netns_cluster.sh down [NAME]     remove them (killing anything still running inside)
#   tools/netns_cluster.sh addr I          node I's address (10.77.0.<I+1>)
#   tools/netns_cluster.sh exec I [NAME] -- CMD...   run CMD on node I
#
# Inside every node the interface is called eth0, so GLOO_SOCKET_IFNAME=eth0 works on each.
# Files are shared (namespaces separate the network only): a directory is a shared file system.
# NAME defaults to "mt"; keep it to 8 characters or fewer (Linux caps interface names at 15).
set -euo pipefail

SUBNET=10.77.0

node_addr() { echo "$SUBNET.$(($1 + 1))"; }

up() {
    local n=$1 name=${2:-mt}
    [[ $n =~ ^[0-9]+$ && $n -ge 1 && $n -le 200 ]] || { echo "up: N must be 1..200, got '$n'" >&2; exit 2; }
    down "$name" 2>/dev/null || true
    ip netns add "$name-hub"
    # No spanning tree and no forwarding delay: a port forwards the moment it is up.
    ip -n "$name-hub" link add br0 type bridge stp_state 0 forward_delay 0
    ip -n "$name-hub" link set br0 up
    ip -n "$name-hub" link set lo up
    for ((i = 0; i < n; i++)); do
        local ns="$name-n$i"
        ip netns add "$ns"
        # One veth pair per node: one end is the node's eth0, the other a port on the hub's bridge.
        ip link add "${name}n$i" type veth peer name "${name}h$i"
        ip link set "${name}n$i" netns "$ns" name eth0
        ip link set "${name}h$i" netns "$name-hub"
        ip -n "$name-hub" link set "${name}h$i" master br0 up
        ip -n "$ns" addr add "$(node_addr "$i")/24" dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up  # workers reach their own agent's store over loopback
    done
}

down() {
    local name=${1:-mt} ns
    for ns in $(ip netns list | awk '{print $1}' | grep -E "^$name-(hub|n[0-9]+)$" || true); do
        # Whatever still runs in a node would keep its namespace alive: end it first.
        ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
        ip netns del "$ns"
    done
}

case "${1:-}" in
    up) shift; up "$@" ;;
    down) shift; down "$@" ;;
    addr) node_addr "$2" ;;
    exec)
        i=$2 name=mt
        shift 2
        if [[ ${1:-} != -- ]]; then name=$1; shift; fi
        [[ ${1:-} == -- ]] && shift
        exec ip netns exec "$name-n$i" "$@" ;;
    *) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
