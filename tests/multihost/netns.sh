#!/usr/bin/env bash
# Fake "multi-host" network on a single Linux box using network namespaces.
#
#   netns.sh up N         create/refresh mj-h1..mj-hN (removes mj-hK for K>N)
#   netns.sh down         kill processes left in mj-h* namespaces, remove all of it
#   netns.sh status       show what exists
#   netns.sh addr K       print the address of host K (0 = controller / root ns)
#   netns.sh exec K CMD.. run CMD in mj-hK with its own UTS namespace, hostname mj-hK
#                         (and /etc/hosts, /etc/resolv.conf of that fake host)
#   netns.sh check        connectivity self-test (root<->h1, h1<->h2), needs up >= 2
#
# Topology (all addresses are in a private test subnet created here):
#
#   root namespace  (controller)  bridge mj-br0   10.213.0.1/24
#   mj-hK namespace               eth0            10.213.0.(10+K)/24   (veth peer mj-hK-br on mj-br0)
#
# Every namespace has lo up, so each "host" also has its own 127.0.0.1.
# /etc/netns/mj-hK/hosts is written so that inside the namespaces the names
# mj-ctl and mj-h1..mj-hN resolve to the addresses above (and the machine's
# real hostname, which plain `ip netns exec` keeps, to the namespace's own
# address, as on a real host), and
# /etc/netns/mj-hK/resolv.conf points at a closed 127.0.0.1:53 so failed
# lookups fail fast instead of timing out (ip netns exec bind-mounts
# /etc/netns/NAME/* over /etc/*).
#
# Overridable via env: MJ_NETNS_PREFIX (mj-h), MJ_NETNS_BRIDGE (mj-br0),
# MJ_NETNS_SUBNET (10.213.0; a /24 given as its first three octets).
set -euo pipefail

PREFIX=${MJ_NETNS_PREFIX:-mj-h}
BRIDGE=${MJ_NETNS_BRIDGE:-mj-br0}
SUBNET=${MJ_NETNS_SUBNET:-10.213.0}
CTL_ADDR="${SUBNET}.1"
MAX_HOSTS=200

die() { echo "netns.sh: $*" >&2; exit 1; }

need_ip() {
    if ! command -v ip >/dev/null 2>&1; then
        echo "netns.sh: installing iproute2" >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -q iproute2 >/dev/null
    fi
    [ "$(id -u)" = 0 ] || die "must run as root"
}

host_addr() { # K -> address (K=0 -> controller)
    if [ "$1" = 0 ]; then echo "$CTL_ADDR"; else echo "${SUBNET}.$((10 + $1))"; fi
}

existing_hosts() { # prints K for every existing ${PREFIX}K namespace
    ip netns list 2>/dev/null | awk '{print $1}' | sed -n "s/^${PREFIX}\([0-9][0-9]*\)\$/\1/p" | sort -n
}

ns_exists() { ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$1"; }
link_exists() { ip link show "$1" >/dev/null 2>&1; }

kill_ns_procs() { # kill processes still living in namespace $1 (they were started there by us)
    local ns=$1 pids
    pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ' || true)
    [ -n "${pids// /}" ] || return 0
    echo "netns.sh: killing processes left in $ns: $pids" >&2
    # shellcheck disable=SC2086
    kill -TERM $pids 2>/dev/null || true
    for _ in 1 2 3 4 5 6 7 8 9 10; do
        pids=$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ' || true)
        [ -n "${pids// /}" ] || return 0
        sleep 0.3
    done
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
}

remove_host() {
    local k=$1 ns="${PREFIX}$1"
    if ns_exists "$ns"; then
        kill_ns_procs "$ns"
        ip netns del "$ns"
    fi
    # the veth usually vanishes with the namespace (asynchronously): ignore races
    ip link del "${ns}-br" 2>/dev/null || true
    rm -rf "/etc/netns/${ns}"
    return 0
}

write_hosts_files() { # N
    local n=$1 k f
    local content="127.0.0.1 localhost
::1 localhost ip6-localhost ip6-loopback
${CTL_ADDR} mj-ctl"
    for ((k = 1; k <= n; k++)); do content+=$'\n'"$(host_addr "$k") ${PREFIX}${k}"; done
    local machine
    machine=$(hostname)
    for ((k = 1; k <= n; k++)); do
        f="/etc/netns/${PREFIX}${k}/hosts"
        mkdir -p "$(dirname "$f")"
        # The machine's own hostname (what plain `ip netns exec` processes see
        # as gethostname()) resolves to the namespace's own address, like on
        # a real host; it is the SAME name in every namespace, though.
        printf '%s\n%s %s\n' "$content" "$(host_addr "$k")" "$machine" >"$f"
        # No DNS server is reachable from the namespaces; without this every
        # reverse lookup that misses /etc/hosts (e.g. c10d's TCPStore resolving
        # the IPv4-mapped peer address ::ffff:10.213.0.12) hangs for 10 s
        # (2 x 5 s resolver timeout). 127.0.0.1:53 is closed -> fails at once.
        printf 'nameserver 127.0.0.1\noptions timeout:1 attempts:1\n' \
            >"/etc/netns/${PREFIX}${k}/resolv.conf"
    done
}

cmd_up() {
    local n=${1:-}
    [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le "$MAX_HOSTS" ] || die "usage: netns.sh up N (1..$MAX_HOSTS)"
    need_ip

    # bridge + controller address in the root namespace
    link_exists "$BRIDGE" || ip link add "$BRIDGE" type bridge
    ip addr replace "${CTL_ADDR}/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up

    local k ns veth
    for ((k = 1; k <= n; k++)); do
        ns="${PREFIX}${k}"
        veth="${ns}-br"
        ns_exists "$ns" || ip netns add "$ns"
        ip -n "$ns" link set lo up
        if ! ip -n "$ns" link show eth0 >/dev/null 2>&1; then
            # stale root-side half without the namespace side: recreate the pair
            ip link del "$veth" 2>/dev/null || true
            for _ in $(seq 50); do link_exists "$veth" || break; sleep 0.1; done
            ip link add "$veth" type veth peer name "${ns}-tmp"
            ip link set "${ns}-tmp" netns "$ns"
            ip -n "$ns" link set "${ns}-tmp" name eth0
        fi
        ip link set "$veth" master "$BRIDGE"
        ip link set "$veth" up
        ip -n "$ns" addr replace "$(host_addr "$k")/24" dev eth0
        ip -n "$ns" link set eth0 up
        # default route via the controller so that e.g. binding 0.0.0.0 picks eth0
        ip -n "$ns" route replace default via "$CTL_ADDR" dev eth0
    done
    # drop namespaces beyond N
    for k in $(existing_hosts); do
        [ "$k" -gt "$n" ] && remove_host "$k"
    done
    write_hosts_files "$n"
    cmd_status
}

cmd_down() {
    need_ip
    local k
    for k in $(existing_hosts); do remove_host "$k"; done
    # leftover root-side veths whose namespace vanished
    for veth in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E "^${PREFIX}[0-9]+-br\$" || true); do
        ip link del "$veth" 2>/dev/null || true
    done
    link_exists "$BRIDGE" && ip link del "$BRIDGE"
    rmdir /etc/netns 2>/dev/null || true
    echo "netns.sh: down (namespaces left: $(ip netns list | grep -c "^${PREFIX}" || true))"
}

cmd_status() {
    echo "controller: $BRIDGE $CTL_ADDR/24 ($(link_exists "$BRIDGE" && echo present || echo absent))"
    local k
    for k in $(existing_hosts); do
        printf '%s%s: %s  pids=[%s]\n' "$PREFIX" "$k" \
            "$(ip -n "${PREFIX}$k" -4 -o addr show dev eth0 2>/dev/null | awk '{print $4}')" \
            "$(ip netns pids "${PREFIX}$k" 2>/dev/null | tr '\n' ' ' | sed 's/ $//')"
    done
}

cmd_exec() {
    local k=${1:-}
    [[ "$k" =~ ^[0-9]+$ ]] || die "usage: netns.sh exec K CMD [ARGS...]"
    shift
    [ $# -ge 1 ] || die "usage: netns.sh exec K CMD [ARGS...]"
    ns_exists "${PREFIX}$k" || die "namespace ${PREFIX}$k does not exist (run: netns.sh up N)"
    # Like `ip netns exec` (same net namespace, /etc/netns/NAME/* bind-mounted
    # over /etc/*) plus an own UTS namespace so `hostname` is mj-hK. Unlike
    # `ip netns exec` it does NOT remount /sys, so /sys/fs/cgroup stays visible:
    # slurmd 22.05 refuses to start without it ("No filesystem mounted on
    # /sys/fs/cgroup") even with proctrack/linuxproc + task/none.
    exec nsenter --net="/run/netns/${PREFIX}$k" -- \
        unshare --uts --mount --propagation private -- \
        sh -c 'for f in /etc/netns/"$0"/*; do
                   [ -e "$f" ] && mount --bind "$f" "/etc/${f##*/}"
               done
               hostname "$0" && exec "$@"' "${PREFIX}$k" "$@"
}

cmd_check() {
    local h1 h2 port=29731
    h1=$(host_addr 1)
    h2=$(host_addr 2)
    ns_exists "${PREFIX}2" || die "check needs at least 2 hosts (netns.sh up 2)"
    local srv='
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); s.settimeout(10)
c, a = s.accept(); c.sendall(("hello %s from %s" % (a[0], sys.argv[1])).encode()); c.close()'
    local cli='
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5)
print(c.recv(100).decode())'
    local rc=0
    # 1) server in the root namespace on the controller address, client in h1
    python3 -c "$srv" "$CTL_ADDR" "$port" & local sp=$!
    sleep 0.5
    ip netns exec "${PREFIX}1" python3 -c "$cli" "$CTL_ADDR" "$port" || rc=1
    wait "$sp" || rc=1
    # 2) server in h2, client in h1
    ip netns exec "${PREFIX}2" python3 -c "$srv" "$h2" "$port" & sp=$!
    sleep 0.5
    ip netns exec "${PREFIX}1" python3 -c "$cli" "$h2" "$port" || rc=1
    wait "$sp" || rc=1
    # 3) server in h1, client in the root namespace
    ip netns exec "${PREFIX}1" python3 -c "$srv" "$h1" "$port" & sp=$!
    sleep 0.5
    python3 -c "$cli" "$h1" "$port" || rc=1
    wait "$sp" || rc=1
    # 4) isolation: h1's loopback is not the root loopback
    python3 -c "$srv" 127.0.0.1 "$port" & sp=$!
    sleep 0.5
    if ip netns exec "${PREFIX}1" python3 -c "$cli" 127.0.0.1 "$port" 2>/dev/null; then
        echo "UNEXPECTED: h1 reached root-ns 127.0.0.1"; rc=1
    else
        echo "ok: 127.0.0.1 inside ${PREFIX}1 is isolated from the root namespace"
    fi
    kill "$sp" 2>/dev/null || true
    wait "$sp" 2>/dev/null || true
    [ $rc = 0 ] && echo "netns.sh check: OK" || echo "netns.sh check: FAILED"
    return $rc
}

case "${1:-}" in
    up) shift; cmd_up "$@" ;;
    down) cmd_down ;;
    status) need_ip; cmd_status ;;
    addr) host_addr "${2:?usage: netns.sh addr K}" ;;
    exec) shift; need_ip; cmd_exec "$@" ;;
    check) need_ip; cmd_check ;;
    *) sed -n '2,10p' "$0" >&2; exit 2 ;;
esac
