#!/usr/bin/env bash
# Two "nodes" on one machine: two network namespaces joined by a veth pair, each running
# `npu-run --nnodes 2 --nproc-per-node N` (torchrun's c10d rendezvous), as two hosts would.
#
#   sudo examples/multinode/two_nodes.sh [-n RANKS_PER_NODE] [-- NPU-RUN OPTIONS --] SCRIPT [ARGS...]
#
# Needs root (ip netns). The nodes' addresses are in the loopback range, 127.0.100.1 and
# 127.0.100.2, on the veth pair only (each namespace keeps 127.0.0.1 alone on its lo, so
# 127.0.100.x is routed over the veth; route_localnet lets the kernel send it there): the run's
# traffic never leaves the machine. Namespaces and links are removed on exit. Each node's output
# goes to $LOGS/node{0,1}.log (LOGS defaults to a new temporary folder), then is printed.
# NPU_RUN (default npu-run) is the command each node runs, e.g. "python -m npukit.run"; PORT the
# rendezvous port (default 29400).
set -euo pipefail

per_node=4
options=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        -n) per_node="$2"; shift 2 ;;
        --) shift; while [[ $# -gt 0 && "$1" != "--" ]]; do options+=("$1"); shift; done; shift ;;
        *) break ;;
    esac
done
[[ $# -ge 1 ]] || { echo "usage: $0 [-n RANKS_PER_NODE] [-- NPU-RUN OPTIONS --] SCRIPT [ARGS...]" >&2; exit 2; }
[[ $(id -u) -eq 0 ]] || { echo "$0: needs root (ip netns)" >&2; exit 2; }

NPU_RUN=${NPU_RUN:-npu-run}
tag="npk$$"
logs=${LOGS:-$(mktemp -d)}
port=${PORT:-29400}

cleanup() {
    for node in 0 1; do ip netns pids "${tag}n$node" 2>/dev/null | xargs -r kill 2>/dev/null || true; done
    for node in 0 1; do ip netns del "${tag}n$node" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 143' TERM INT

ip link add "${tag}v0" type veth peer name "${tag}v1"
for node in 0 1; do
    ns="${tag}n$node"
    ip netns add "$ns"
    ip link set "${tag}v$node" netns "$ns"
    ip netns exec "$ns" ip link set lo up
    # only 127.0.0.1 is local: 127.0.100.0/24 must go over the veth, not back into lo
    ip netns exec "$ns" ip addr del 127.0.0.1/8 dev lo
    ip netns exec "$ns" ip addr add 127.0.0.1/32 dev lo
    ip netns exec "$ns" sysctl -q -w net.ipv4.conf.all.route_localnet=1 "net.ipv4.conf.${tag}v$node.route_localnet=1"
    ip netns exec "$ns" ip addr add "127.0.100.$((node + 1))/24" dev "${tag}v$node"
    ip netns exec "$ns" ip link set "${tag}v$node" up
done

pids=()
for node in 0 1; do
    ns="${tag}n$node"
    # gloo binds to the node's own interface; node 0 hosts the rendezvous (said outright: torch
    # takes any loopback-range endpoint for its own machine, so both would host one); each node is
    # known by its address (both namespaces share one host name)
    ip netns exec "$ns" env GLOO_SOCKET_IFNAME="${tag}v$node" NPUKIT_RDZV_ID="$tag" \
        $NPU_RUN --nnodes 2 --nproc-per-node "$per_node" --rdzv-endpoint "127.0.100.1:$port" \
        --rdzv-conf "is_host=$((node == 0))" --local-addr "127.0.100.$((node + 1))" \
        "${options[@]}" "$@" > "$logs/node$node.log" 2>&1 &
    pids+=($!)
    [[ $node -eq 0 ]] && sleep 1  # node 0 first: it hosts the rendezvous store
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
for node in 0 1; do echo "== node $node ($logs/node$node.log)"; cat "$logs/node$node.log"; done
exit "$status"
