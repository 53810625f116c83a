#!/usr/bin/env bash
# libnbd's nbdsh with strict mode off: out-of-range, oversize, zero-length and flag errors
# (and a usable connection after each), unaligned I/O against a model, multi-conn
# coherence, many requests in flight, reads racing writes, block status, and option
# haggling; with READ_ONLY=1, refusals and pattern reads instead. The checks are in
# nbdsh_checks.py.
source "$(dirname "$0")/lib.sh"
need nbdsh
python3 -c 'import nbd' 2>/dev/null || skip "python3 has no nbd module (python3-libnbd)"

# compile() with the path, so that a traceback names the file and line.
CHECKS=$HERE/nbdsh_checks.py
NBD_URI=$URI t nbdsh -n -c "exec(compile(open('$CHECKS').read(), '$CHECKS', 'exec'))"
echo "PASS: $NAME"
