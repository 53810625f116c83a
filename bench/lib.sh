# Shared by the benchmark scripts: source it after `cd` to the repository root.

# Processes a script started, by PID; `stop_pids` kills and reaps them (call it from an EXIT
# trap, so nothing outlives the script).
pids=()
stop_pids() {
    for pid in "${pids[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${pids[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
}

# A free port of 127.0.0.1 for TCP (the default, or $1 = tcp) or UDP ($1 = udp), chosen by
# the OS. (Free when asked: a script binds it soon after.)
free_port() {
    python3 -c 'import socket, sys
kind = socket.SOCK_DGRAM if sys.argv[1] == "udp" else socket.SOCK_STREAM
s = socket.socket(socket.AF_INET, kind); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' "${1:-tcp}"
}

# Waits up to 10 s for something to listen on 127.0.0.1:$1, and fails if process $2 died.
wait_listening() {
    local i
    for i in $(seq 100); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; then
            return 0
        fi
        kill -0 "$2" 2>/dev/null || { echo "process $2 exited before listening on $1" >&2; return 1; }
        sleep 0.1
    done
    echo "nothing listens on 127.0.0.1:$1 after 10 s" >&2
    return 1
}
