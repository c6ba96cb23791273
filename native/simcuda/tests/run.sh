#!/bin/sh
# Builds simcuda (the libcuda.so.1 TEST DOUBLE) and its tests, and runs them.
#   native/simcuda/tests/run.sh            build into a temporary dir and test
#   SIMCUDA_BUILD_DIR=dir run.sh          build into dir (kept)
set -eu
here=$(cd "$(dirname "$0")" && pwd)
src=$(dirname "$here")
root=$(cd "$src/../.." && pwd)
out=${SIMCUDA_BUILD_DIR:-}
if [ -z "$out" ]; then
    out=$(mktemp -d)
    trap 'rm -rf "$out"' EXIT
fi
mkdir -p "$out"
cd "$root"

echo "== build"
gcc -std=gnu11 -O2 -g -fPIC -shared -pthread -Wall -Wextra -Werror -Wl,-soname,libcuda.so.1 \
    -o "$out/libcuda.so.1" native/simcuda/*.c -ldl
gcc -std=gnu11 -O2 -g -pthread -Wall -Wextra -Werror -o "$out/test_simcuda" native/simcuda/tests/test_simcuda.c \
    -L"$out" -l:libcuda.so.1 -Wl,-rpath,"$out" -ldl
gcc -std=gnu11 -O2 -fPIC -shared -Wall -Wextra -Werror -o "$out/libinterposer.so" native/simcuda/tests/interposer.c

echo "== exports"
# Every exported driver entry point must be reachable through cuGetProcAddress (and the
# library must export nothing but the driver API and simcuda's own extensions).
nm -D --defined-only "$out/libcuda.so.1" | awk '{print $3}' | sort >"$out/exported"
grep -v -E '^(cu[A-Z]|simcuda[A-Z])' "$out/exported" && { echo "unexpected exports above"; exit 1; }
grep -E '^cu' "$out/exported" >"$out/exported.cu"
sed -n 's/^ *\(E\|PT\)("[A-Za-z0-9]*", [0-9]*, \([A-Za-z0-9_]*\)),$/\2/p' native/simcuda/procaddr.c | sort -u >"$out/table"
if ! diff -u "$out/exported.cu" "$out/table"; then
    echo "procaddr.c's table and the exported symbols disagree (- exported only, + table only)"
    exit 1
fi
echo "$(wc -l <"$out/exported") symbols exported, all in the cuGetProcAddress table"

cuda_h=${CUDA_HOME:-/usr/local/cuda}/include/cuda.h
if [ -f "$cuda_h" ]; then
    echo "== ABI against $cuda_h"
    sed -n 's/^ *\(CUDA_[A-Z_]*\|CU_[A-Z0-9_]*\) = .*/V(\1)/p; s/^#define \(CU_EVENT_[A-Z_]*\) .*/V(\1)/p' \
        native/simcuda/simcuda_api.h >"$out/abi_consts.h"
    gcc -std=gnu11 -I"$out" -o "$out/abi_sim" native/simcuda/tests/abi_layout.c
    gcc -std=gnu11 -I"$out" -I"$(dirname "$cuda_h")" -DUSE_CUDA_H -o "$out/abi_cuda" native/simcuda/tests/abi_layout.c
    "$out/abi_sim" >"$out/abi_sim.txt"
    "$out/abi_cuda" >"$out/abi_cuda.txt"
    diff -u "$out/abi_cuda.txt" "$out/abi_sim.txt"
    echo "$(wc -l <"$out/abi_sim.txt") layouts and constants match cuda.h"
else
    echo "== ABI check skipped: no $cuda_h"
fi

echo "== tests"
timeout 60 "$out/test_simcuda"
LD_PRELOAD="$out/libinterposer.so" timeout 20 "$out/test_simcuda" interposed
