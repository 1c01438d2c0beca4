"""Run fastconv's test suite against an *installed* fastconv (a wheel), not
the source tree, once per kernel build (ISA) this CPU runs.

    python tools/run_installed_tests.py [--isa default|all|NAME...] [--tests DIR] [-- PYTEST ARGS]

Used by tools/check_wheel.sh and by cibuildwheel's test-command.  The tests
are copied to a temporary directory and pytest runs there, so the source
checkout's fastconv/ cannot be imported by accident; the script checks that
the fastconv the tests import lives in this interpreter's environment
(sys.prefix), outside the checkout.  Exit status: 0 when every run passed.
"""
import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
CHECKOUT = HERE.parent

def python_in(cwd, code, env):
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, check=True,
                          capture_output=True, text=True).stdout.strip()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--isa", nargs="+", default=["all"],
                        help="'all' (every ISA this CPU runs, the default), 'default' "
                             "(whatever fastconv picks), or ISA names")
    parser.add_argument("--tests", default=str(CHECKOUT / "tests"), help="tests directory")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args()

    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.pop("FASTCONV_ISA", None)
    with tempfile.TemporaryDirectory(prefix="fastconv-installed-") as tmp:
        tests = pathlib.Path(tmp, "tests")
        shutil.copytree(args.tests, tests, ignore=shutil.ignore_patterns("__pycache__"))
        source_examples = pathlib.Path(args.tests).resolve().parent / "examples"
        if source_examples.is_dir():          # for tests that look next to themselves
            shutil.copytree(source_examples, pathlib.Path(tmp, "examples"),
                            ignore=shutil.ignore_patterns("__pycache__"))

        where = python_in(tmp, "import fastconv, sys; print(fastconv.__file__); print(sys.prefix)",
                          env).splitlines()
        installed, prefix = pathlib.Path(where[0]).resolve(), pathlib.Path(where[1]).resolve()
        print(f"run_installed_tests: fastconv imported from {installed}")
        checkout = pathlib.Path(args.tests).resolve().parent
        if checkout in installed.parents:
            sys.exit(f"run_installed_tests: fastconv comes from the source checkout {checkout}, "
                     "not from an installed wheel")
        if prefix not in installed.parents:
            sys.exit(f"run_installed_tests: fastconv is not installed in this environment "
                     f"({prefix})")

        available = python_in(tmp, "from fastconv import _dispatch; print(*_dispatch.AVAILABLE)",
                              env).split()
        if args.isa == ["all"]:
            isas = available
        elif args.isa == ["default"]:
            isas = [None]
        else:
            isas = args.isa
        # Test modules that find examples/ next to the fastconv package are
        # pointed at the copy next to tests/ (see wheel_test_plugin.py).
        shutil.copy(HERE / "wheel_test_plugin.py", pathlib.Path(tmp, "_fastconv_wheel_plugin.py"))
        env["FASTCONV_TEST_ROOT"] = tmp
        failed = []
        for isa in isas:
            run_env = dict(env)
            label = "default ISA" if isa is None else f"FASTCONV_ISA={isa}"
            if isa is not None:
                run_env["FASTCONV_ISA"] = isa
            print(f"\n=== run_installed_tests: {label} (runnable here: {' '.join(available)})",
                  flush=True)
            t0 = time.monotonic()
            rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                  "-p", "_fastconv_wheel_plugin", "--rootdir", tmp, *args.pytest_args,
                                  "tests"],
                                 cwd=tmp, env=run_env)
            print(f"=== run_installed_tests: {label}: exit {rc} in {time.monotonic() - t0:.0f} s",
                  flush=True)
            if rc != 0:
                failed.append(label)
    if failed:
        sys.exit(f"run_installed_tests: failed under {', '.join(failed)}")


if __name__ == "__main__":
    main()
