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
