#!/usr/bin/env bash
# Two "hosts" on one machine: network namespaces lmsA (10.77.0.1) and lmsB (10.77.0.2)
# joined by one veth pair. Idempotent; needs root (CAP_NET_ADMIN).
#
#   C_netns.sh up      create both namespaces (tearing down any leftover first)
#   C_netns.sh down    remove them (no error if absent)
#   C_netns.sh check   exit 0 when both exist and A reaches B
#
# Nothing is routed outside: the namespaces only have lo and their veth end, and the
# only addresses are 10.77.0.1/24 and 10.77.0.2/24.
set -euo pipefail

NS_A=${LMS_NS_A:-lmsA}
NS_B=${LMS_NS_B:-lmsB}
IP_A=${LMS_IP_A:-10.77.0.1}
IP_B=${LMS_IP_B:-10.77.0.2}
VETH_A=vlmsA
VETH_B=vlmsB

down() {
    ip netns pids "$NS_A" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns pids "$NS_B" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$NS_A" 2>/dev/null || true
    ip netns del "$NS_B" 2>/dev/null || true
    # Deleting a namespace deletes the veth end inside it and its peer; this covers a
    # pair left in the root namespace by an interrupted "up".
    ip link del "$VETH_A" 2>/dev/null || true
}

up() {
    down
    ip netns add "$NS_A"
    ip netns add "$NS_B"
    ip link add "$VETH_A" type veth peer name "$VETH_B"
    ip link set "$VETH_A" netns "$NS_A"
    ip link set "$VETH_B" netns "$NS_B"
    ip -n "$NS_A" addr add "$IP_A/24" dev "$VETH_A"
    ip -n "$NS_B" addr add "$IP_B/24" dev "$VETH_B"
    for ns in "$NS_A" "$NS_B"; do
        ip -n "$ns" link set lo up
    done
    ip -n "$NS_A" link set "$VETH_A" up
    ip -n "$NS_B" link set "$VETH_B" up
    check
}

check() {
    # A TCP round trip from A to B over the veth (no ping on minimal images).
    local port=47700
    ip netns exec "$NS_B" python3 -c "
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(('$IP_B', $port)); s.listen(1); s.settimeout(5)
c, _ = s.accept(); c.sendall(b'ok'); c.close()" &
    local server=$!
    local ok=1
    for _ in 1 2 3 4 5 6 7 8 9 10; do
        if ip netns exec "$NS_A" python3 -c "
import socket
c = socket.create_connection(('$IP_B', $port), timeout=2)
assert c.recv(2) == b'ok'" 2>/dev/null; then ok=0; break; fi
        sleep 0.2
    done
    wait "$server" 2>/dev/null || true
    return $ok
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    check) check ;;
    *) echo "usage: $0 up|down|check" >&2; exit 2 ;;
esac
