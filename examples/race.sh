#!/usr/bin/env bash
# A race: which algorithm reaches 90 % accuracy on the digits first, on 2 workers behind a wide-area link
# (100 Mbit/s, 50 ms one way), each contestant given 4 s of training time; the report ranks them and
# draws accuracy against time. About 30 s.
#
#     bash examples/race.sh [OUT]          (default OUT: results/race; then read OUT/report.md)
set -euo pipefail
out=${1:-results/race}
thinwire compare --workload digits-mlp --target 0.9 --workers 2 --network wan --budget 4 \
    --algorithms "bsp,localsgd:period=8,diloco:period=8+fp4" --out "$out"
