"""show_config(), thread control and ISA dispatch (FASTCONV_ISA, use_isa)."""
import json
import os
import pathlib
import platform
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import threadpoolctl
from threadpoolctl import threadpool_limits

import fastconv
from fastconv import _config, _dispatch

REPO = pathlib.Path(fastconv.__file__).resolve().parents[1]
AVAILABLE = _dispatch.AVAILABLE


@pytest.fixture(autouse=True)
def restore_threads():
    n = fastconv.get_num_threads()
    yield
    fastconv.set_num_threads(n)


def run_python(code, **env_changes):
    """Run ``code`` in a fresh interpreter importing this checkout of
    fastconv; env_changes maps a variable to a value, or to None to unset it."""
    env = dict(os.environ)
    for key in ("FASTCONV_ISA", "OMP_NUM_THREADS"):
        env.pop(key, None)
    for key, value in env_changes.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=str(REPO),
                          capture_output=True, text=True, timeout=120)


PROBE = """
    import io, json, contextlib
    import numpy as np
    import fastconv
    from fastconv import _dispatch, _config
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        fastconv.show_config()
    rng = np.random.default_rng(0)
    a = rng.standard_normal((70, 300)).astype(np.float32)
    b = rng.standard_normal((300, 50)).astype(np.float32)
    err = float(np.abs(fastconv.sgemm(1.0, a, b) - a.astype(float) @ b.astype(float)).max())
    print(json.dumps({"isa": _dispatch.current_isa(), "config": _config.config(),
                      "shown": out.getvalue(), "threads": fastconv.get_num_threads(),
                      "err": err}))
"""


def probe(**env):
    r = run_python(PROBE, **env)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------ show_config

def test_show_config_reports_the_running_state(capsys):
    fastconv.show_config()
    text = capsys.readouterr().out
    k = _dispatch.kernels
    lines = {line.split(":", 1)[0].strip(): line.split(":", 1)[1].strip()
             for line in text.splitlines()[1:]}
    assert text.startswith(f"fastconv {fastconv.__version__} on ")
    assert lines["kernels in use"].split()[0] == _dispatch.current_isa() == k.ISA
    assert lines["runnable here"] == ", ".join(AVAILABLE)
    assert lines["GEMM tile MRxNR"] == (f"float32 {k.TILE_F32[0]}x{k.TILE_F32[1]}, "
                                        f"float64 {k.TILE_F64[0]}x{k.TILE_F64[1]}")
    assert lines["threads"] == str(fastconv.get_num_threads())
    if k.HAVE_OPENMP:
        assert "omp" in lines["OpenMP runtime"]


@pytest.mark.parametrize("isa", AVAILABLE)
def test_show_config_follows_use_isa(isa, capsys):
    with _dispatch.use_isa(isa) as k:
        fastconv.show_config()
        cfg = _config.config()
    text = capsys.readouterr().out
    assert f"kernels in use : {isa}" in text
    assert cfg["isa"] == isa
    assert tuple(cfg["gemm_tile_float32"]) == tuple(k.TILE_F32)
    assert tuple(cfg["gemm_tile_float64"]) == tuple(k.TILE_F64)


def test_show_config_reports_thread_count(capsys):
    fastconv.set_num_threads(1)
    fastconv.show_config()
    assert "threads        : 1" in capsys.readouterr().out
    assert _config.config()["num_threads"] == 1


def test_openmp_runtime_is_the_one_threadpoolctl_controls():
    if not _dispatch.kernels.HAVE_OPENMP:
        pytest.skip("built without OpenMP")       # platform condition, not a failure
    named = _config.config()["openmp"]
    libs = [os.path.basename(i["filepath"]) for i in threadpoolctl.threadpool_info()
            if i["user_api"] == "openmp"]
    assert libs, "threadpoolctl sees no OpenMP runtime although fastconv links one"
    assert any(lib in named for lib in libs), (named, libs)


# --------------------------------------------------------------- dispatch

def _cpu_flags():
    """The x86 CPU's flags from /proc/cpuinfo; None elsewhere (qemu-user
    running an aarch64 build shows the x86 host's cpuinfo)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return None


def test_available_isas():
    assert AVAILABLE, "no runnable kernel build"
    assert set(AVAILABLE) <= set(_dispatch.ISA_ORDER)
    assert list(AVAILABLE) == [i for i in _dispatch.ISA_ORDER if i in AVAILABLE]   # best first
    assert "baseline" in AVAILABLE
    flags = _cpu_flags()
    if flags is not None and {"avx2", "fma", "bmi2"} <= flags:
        assert "avx2" in AVAILABLE
    if flags is not None and {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd"} <= flags:
        assert "avx512" in AVAILABLE
    for isa in AVAILABLE:
        with _dispatch.use_isa(isa) as k:
            assert k.ISA == isa
            assert len(k.TILE_F32) == len(k.TILE_F64) == 2
            assert {"KC", "NC"} <= set(k.BLOCKING_F32) and {"KC", "NC"} <= set(k.BLOCKING_F64)


def test_default_isa_is_the_best_runnable():
    info = probe()
    assert info["isa"] == AVAILABLE[0]
    assert info["config"]["isa_forced"] is None
    assert "forced" not in info["shown"]
    assert info["err"] < 1e-3


@pytest.mark.parametrize("isa", [None, *AVAILABLE])
def test_import_loads_only_the_build_it_runs(isa):
    # A build's module init runs that build's instructions: importing the
    # AVX-512 build merely to see whether it exists killed `import fastconv`
    # with SIGILL on a CPU without AVX-512 (Zen 3).  Finding the builds must
    # not import them; only the one chosen is loaded.
    r = run_python("""
        import sys
        import fastconv
        from fastconv import _dispatch
        print(_dispatch.current_isa(), sorted(m.rsplit(".", 1)[1] for m in sys.modules
                                               if m.startswith("fastconv._kernels.gemm_")))
    """, FASTCONV_ISA=isa)
    assert r.returncode == 0, r.stderr
    chosen, loaded = r.stdout.strip().splitlines()[-1].split(" ", 1)
    assert chosen == (isa or AVAILABLE[0])
    assert loaded == repr([f"gemm_{chosen}"])


@pytest.mark.parametrize("isa", AVAILABLE)
def test_env_var_forces_isa(isa):
    info = probe(FASTCONV_ISA=isa)
    assert info["isa"] == isa
    assert info["config"]["isa"] == isa
    assert info["config"]["isa_forced"] == isa
    assert f"kernels in use : {isa} (forced by FASTCONV_ISA={isa})" in info["shown"]
    assert info["config"]["isa_available"] == list(AVAILABLE)
    assert info["err"] < 1e-3                                  # and it computes correctly


def test_empty_env_var_means_default():
    info = probe(FASTCONV_ISA="")
    assert info["isa"] == AVAILABLE[0]
    assert info["config"]["isa_forced"] is None


@pytest.mark.parametrize("value", ["sse9", "avx-512", "native"])
def test_env_var_invalid_value_is_a_clear_error(value):
    r = run_python("import fastconv", FASTCONV_ISA=value)
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError"), r.stderr
    assert "FASTCONV_ISA" in last and repr(value) in last
    for isa in _dispatch.ISA_ORDER:
        assert isa in last


def test_env_omp_num_threads():
    info = probe(OMP_NUM_THREADS="1")
    assert info["threads"] == 1
    assert "threads        : 1" in info["shown"]


@pytest.mark.parametrize("isa", AVAILABLE)
def test_use_isa_switches_and_restores(isa, monkeypatch):
    before = _dispatch.current_isa()
    calls = []
    with _dispatch.use_isa(isa) as k:
        assert _dispatch.current_isa() == isa and _dispatch.kernels is k
        real = k.gemm
        monkeypatch.setattr(k, "gemm",
                            lambda *args, **kw: (calls.append(k.ISA), real(*args, **kw))[1])
        a = np.ones((3, 4), np.float32)
        np.testing.assert_array_equal(fastconv.sgemm(1.0, a, a.T), np.full((3, 3), 4.0))
        np.testing.assert_array_equal(fastconv.matmul(a.astype(np.float64), a.T),
                                      np.full((3, 3), 4.0))
    assert calls == [isa, isa]                  # the calls went to this build
    assert _dispatch.current_isa() == before
    with pytest.raises(ZeroDivisionError):
        with _dispatch.use_isa(isa):
            1 / 0
    assert _dispatch.current_isa() == before


@pytest.mark.parametrize("name", ["avx1024", "", "sse2"])
def test_use_isa_unknown_name(name):
    before = _dispatch.current_isa()
    with pytest.raises(ValueError, match="must be one of"):
        with _dispatch.use_isa(name):
            pass
    assert _dispatch.current_isa() == before


def test_use_isa_not_runnable_or_not_built(monkeypatch):
    before = _dispatch.current_isa()
    # Built (it is not off x86-64, where the build check would answer
    # first; seen on aarch64) but not runnable:
    monkeypatch.setattr(_dispatch, "_built", lambda isa: True)
    monkeypatch.setattr(_dispatch._runtime, "cpu_supports", lambda isa: isa == "baseline")
    with pytest.raises(RuntimeError, match="cannot run.*avx512"):
        with _dispatch.use_isa("avx512"):
            pass
    monkeypatch.undo()
    monkeypatch.setattr(_dispatch, "_built", lambda isa: isa == "baseline")
    with pytest.raises(RuntimeError, match="built without.*avx2"):
        with _dispatch.use_isa("avx2"):
            pass
    assert _dispatch.current_isa() == before


# ---------------------------------------------------------------- threads

@pytest.mark.parametrize("n", [1, 2, 3, np.int64(2)])
def test_set_get_num_threads(n):
    fastconv.set_num_threads(n)
    assert fastconv.get_num_threads() == int(n)
    a = np.arange(12.0).reshape(3, 4)
    np.testing.assert_array_equal(fastconv.dgemm(1.0, a, a.T), a @ a.T)


@pytest.mark.parametrize("bad", [0, -1, -100])
def test_set_num_threads_bad_value(bad):
    before = fastconv.get_num_threads()
    with pytest.raises(ValueError, match=r"\bn\b.*>= 1"):
        fastconv.set_num_threads(bad)
    assert fastconv.get_num_threads() == before


@pytest.mark.parametrize("bad", [1.5, 2.0, "2", None, [2], np.float64(2), True], ids=repr)
def test_set_num_threads_bad_type(bad):
    before = fastconv.get_num_threads()
    with pytest.raises(TypeError, match=r"\bn\b.*int"):
        fastconv.set_num_threads(bad)
    assert fastconv.get_num_threads() == before


def test_threadpoolctl_openmp_limit_applies():
    fastconv.set_num_threads(2)
    with threadpool_limits(1, "openmp"):
        assert fastconv.get_num_threads() == 1
        assert _config.config()["num_threads"] == 1
        rng = np.random.default_rng(5)
        a = rng.standard_normal((300, 400))
        b = rng.standard_normal((400, 200))
        got = fastconv.dgemm(1.0, a, b)
        ref = a @ b
        scale = np.abs(a) @ np.abs(b)
        assert np.all(np.abs(got - ref) <= 100 * np.finfo(float).eps * scale)
    assert fastconv.get_num_threads() == 2


def test_public_api():
    for name in ("sgemm", "dgemm", "matmul", "show_config", "get_num_threads",
                 "set_num_threads", "__version__", "tuned_algorithms", "clear_tuned_algorithms",
                 "save_tuned_algorithms", "load_tuned_algorithms"):
        assert name in fastconv.__all__ and hasattr(fastconv, name)
    assert isinstance(fastconv.__version__, str) and fastconv.__version__
