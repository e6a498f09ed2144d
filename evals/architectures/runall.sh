#!/bin/bash
# bash evals/architectures/runall.sh OUT [ARCH ...] (none: every one in archs.NAMES): each architecture's checks, printing what is not equal, ok or refused by a window
here=$(cd "$(dirname "$0")" && pwd); out=$1; shift; mkdir -p "$out"
[ $# -gt 0 ] || set -- $(cd "$here" && python -c "import archs; print(' '.join(archs.NAMES))")  # none named: all
for a in "$@"; do
  OMP_NUM_THREADS=1 timeout 900 python "$here/probe.py" "$a" "$out" > "$out/log_$a.txt" 2>&1
  echo "== $a rc=$?"; grep "^\[$a\]" "$out/log_$a.txt" | grep -v ": equal\|: ok\|rows that accept different numbers"
done
