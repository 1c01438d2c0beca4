"""pytest plugin loaded by tools/run_installed_tests.py.

Some test modules find the checkout's data files (examples/) through
``REPO = pathlib.Path(fastconv.__file__).resolve().parents[1]``.  Against an
installed wheel that is site-packages, which holds no examples/.  The runner
lays out tests/ and examples/ side by side in a temporary directory
(FASTCONV_TEST_ROOT); after collection this plugin re-roots every
module-level pathlib.Path of a test module that points at fastconv's parent
directory (or below it, outside the package itself) onto that directory.
Paths that already point elsewhere, e.g. derived from the test file's own
location, are left alone.
"""
import os
import pathlib

import fastconv

ROOT = pathlib.Path(os.environ["FASTCONV_TEST_ROOT"]).resolve()
PKG = pathlib.Path(fastconv.__file__).resolve().parent
PKG_PARENT = PKG.parent


def _reroot(path):
    try:
        resolved = path.resolve()
    except OSError:
        return None
    if resolved == PKG or PKG in resolved.parents:
        return None                              # inside the package: keep
    if resolved == PKG_PARENT:
        return ROOT
    if PKG_PARENT in resolved.parents:
        return ROOT / resolved.relative_to(PKG_PARENT)
    return None


def pytest_collection_modifyitems(session, config, items):
    done = set()
    for item in items:
        module = getattr(item, "module", None)
        if module is None or module.__name__ in done:
            continue
        done.add(module.__name__)
        for name, value in list(vars(module).items()):
            if isinstance(value, pathlib.PurePath):
                new = _reroot(pathlib.Path(value))
                if new is not None:
                    setattr(module, name, new)
