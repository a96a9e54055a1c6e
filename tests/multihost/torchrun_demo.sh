#!/usr/bin/env bash
# Run torchrun on two fake hosts (mj-h1, mj-h2; see netns.sh) with a gloo
# all_reduce payload (allreduce.py) and time launch -> all ranks done.
#
#   torchrun_demo.sh c10d      --rdzv-backend c10d, endpoint on mj-h1 (10.213.0.11)
#   torchrun_demo.sh static    --node-rank/--master-addr 10.213.0.11 (static rdzv)
#   torchrun_demo.sh ctlstore  --rdzv-backend c10d, endpoint = a TCPStore that a
#                              process in the ROOT namespace (the "controller",
#                              10.213.0.1) hosts; agents only connect to it
#
# Env: NPROC (2 per node), PORT (29500; for ctlstore default 29613),
#      MJ_IFNAME (set to e.g. eth0 to export GLOO_SOCKET_IFNAME), TIMEOUT (120).
# Creates the namespaces (netns.sh up 2) if they are missing; does not remove them.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
MODE=${1:-c10d}
NPROC=${NPROC:-2}
TIMEOUT=${TIMEOUT:-120}
LOGDIR=${LOGDIR:-$(mktemp -d /tmp/mj-torchrun.XXXXXX)}
H1=$("$HERE/netns.sh" addr 1)
CTL=$("$HERE/netns.sh" addr 0)

ip netns list | grep -q '^mj-h2\b' || "$HERE/netns.sh" up 2 >/dev/null

envs=()
[ -n "${MJ_IFNAME:-}" ] && envs+=(env "GLOO_SOCKET_IFNAME=$MJ_IFNAME")

store_pid=
cleanup() { [ -n "$store_pid" ] && kill "$store_pid" 2>/dev/null; wait 2>/dev/null || true; }
trap cleanup EXIT

case "$MODE" in
    c10d)
        PORT=${PORT:-29500}
        common=(--nnodes 2 --nproc-per-node "$NPROC" --rdzv-backend c10d
            --rdzv-endpoint "$H1:$PORT" --rdzv-id "mj-$$")
        args1=("${common[@]}")
        args2=("${common[@]}")
        ;;
    static)
        PORT=${PORT:-29500}
        common=(--nnodes 2 --nproc-per-node "$NPROC" --master-addr "$H1" --master-port "$PORT")
        args1=("${common[@]}" --node-rank 0)
        args2=("${common[@]}" --node-rank 1)
        ;;
    ctlstore)
        PORT=${PORT:-29613}
        # The controller (root namespace) owns the rendezvous store; torchrun
        # agents on the hosts are pure clients (endpoint is not a local address).
        python3 -c "
import sys, time, torch.distributed as d
s = d.TCPStore('$CTL', $PORT, is_master=True, wait_for_workers=False, timeout=__import__('datetime').timedelta(seconds=$TIMEOUT))
print('controller store up on $CTL:$PORT', flush=True)
time.sleep($TIMEOUT)
" >"$LOGDIR/store.log" 2>&1 &
        store_pid=$!
        for _ in $(seq 50); do grep -q 'store up' "$LOGDIR/store.log" 2>/dev/null && break; sleep 0.1; done
        common=(--nnodes 2 --nproc-per-node "$NPROC" --rdzv-backend c10d
            --rdzv-endpoint "$CTL:$PORT" --rdzv-id "mj-$$")
        args1=("${common[@]}")
        args2=("${common[@]}")
        ;;
    *) sed -n '2,16p' "$0" >&2; exit 2 ;;
esac

echo "mode=$MODE logs=$LOGDIR"
echo "h1: ip netns exec mj-h1 ${envs[*]} torchrun ${args1[*]} $HERE/allreduce.py"
echo "h2: ip netns exec mj-h2 ${envs[*]} torchrun ${args2[*]} $HERE/allreduce.py"
start=$(date +%s.%N)
"$HERE/netns.sh" exec 1 timeout "$TIMEOUT" "${envs[@]}" torchrun "${args1[@]}" "$HERE/allreduce.py" >"$LOGDIR/h1.log" 2>&1 &
p1=$!
"$HERE/netns.sh" exec 2 timeout "$TIMEOUT" "${envs[@]}" torchrun "${args2[@]}" "$HERE/allreduce.py" >"$LOGDIR/h2.log" 2>&1 &
p2=$!
rc=0
wait $p1 || rc=$?
wait $p2 || rc=$?
end=$(date +%s.%N)
grep -h '^rank=' "$LOGDIR/h1.log" "$LOGDIR/h2.log" | sort -t= -k2 -n || true
grep -hE 'Error|error|Traceback|hostname of the client' "$LOGDIR/h1.log" "$LOGDIR/h2.log" | head -20 || true
printf 'mode=%s rc=%s launch->all-done=%.2fs ranks_ok=%s\n' "$MODE" "$rc" \
    "$(echo "$end - $start" | bc)" "$(cat "$LOGDIR/h1.log" "$LOGDIR/h2.log" | grep -o " OK " | wc -l)"
exit $rc
