"""The one-time timing behind conv2d(algorithm="tune").

"auto" picks an algorithm by a rule measured on one machine (Zen 4/5,
AVX-512; see conv._choose_algorithm); on another CPU, ISA build or thread
count the crossovers move.  "tune" times, once per problem and process,
every algorithm that applies and keeps the fastest, as
torch.backends.cudnn.benchmark does.  The choice is cached by everything
that changes which one wins: the kernel build, dtype, the shapes, the
convolution's geometry, the thread count, and whether the weights are
prepacked, a residual is added or a bias and activation are applied.
The choices can be saved to a file and loaded in another process (FFTW's
"wisdom"), which then skips the timing and makes the same choices.
"""
import json
import threading
import time
from typing import NamedTuple

#: Rounds over the candidates; each candidate's best time counts.  The
#: candidates take turns, so a stretch where the machine runs slow (these
#: 2-vCPU VMs have them, seconds long) hits all of them; and the rounds
#: span enough time (ROUNDS x SAMPLE_SECONDS per candidate, at least) that
#: another library's thread pool, spinning for a while after its last call
#: (torch's, OpenBLAS's), leaves some samples alone: measured right after
#: torch convolutions, single calls took 4-30x their time.
ROUNDS = 5
#: Another algorithm replaces auto's choice only when it is at least this
#: much faster: a near tie stays with the rule, so a noisy timing cannot
#: flip a layer between runs for nothing.
MARGIN = 0.05
#: Each timed sample repeats a small problem until it takes about this long
#: (the clock and the call's Python overhead would otherwise dominate).
SAMPLE_SECONDS = 5e-3
MAX_REPEATS = 64
#: After the warm-up, candidates this many times slower than the quickest
#: are not timed further (a single disturbed call can take 4x its time, so
#: this is wide; the depthwise layers it is for run the other algorithms
#: 70-200x slower).
HOPELESS = 8.0


class Problem(NamedTuple):
    """What a tuned choice is cached by."""
    isa: str
    dtype: str
    x_shape: tuple          # NHWC, after explicit padding (non-zero padding modes)
    weight_shape: tuple     # (OC, KH * KW * C / groups)
    groups: int
    kernel: tuple
    stride: tuple
    dilation: tuple
    pad_before: tuple
    out_hw: tuple
    threads: int
    prepacked: bool
    bias: bool
    residual: bool
    activation: object


_choices = {}               # Problem -> algorithm
_lock = threading.Lock()    # one tuning at a time: concurrent ones would time each other


def tuned_algorithms():
    """{Problem: algorithm} for every problem tuned so far in this process."""
    with _lock:
        return dict(_choices)


def clear_tuned_algorithms():
    """Forget every tuned choice; the next "tune" call of each problem times again."""
    with _lock:
        _choices.clear()


_FILE_FORMAT = "fastconv tuned algorithms"
_FILE_VERSION = 1


def save_tuned_algorithms(path):
    """Write every tuned choice of this process to a JSON file at path, for
    load_tuned_algorithms in another process."""
    with _lock:
        entries = [{"problem": p._asdict(), "algorithm": a} for p, a in _choices.items()]
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"format": _FILE_FORMAT, "version": _FILE_VERSION, "choices": entries}, f,
                  indent=1)


def load_tuned_algorithms(path):
    """Add the choices in a file written by save_tuned_algorithms (replacing
    this process's choices for the same problems); "tune" calls of those
    problems then time nothing.  Choices for another ISA build or thread
    count are kept but match no call here.  Returns how many were loaded;
    ValueError if the file is not such a file or names an algorithm that
    cannot run its problem (nothing is loaded then)."""
    from .conv import _TUNE_CANDIDATES, _Geometry, _inapplicable
    with open(path, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not a fastconv tuned-algorithms file ({e})") from None
    if (not isinstance(data, dict) or data.get("format") != _FILE_FORMAT
            or not isinstance(data.get("choices"), list)):
        raise ValueError(f"{path}: not a fastconv tuned-algorithms file")
    if data.get("version") != _FILE_VERSION:
        raise ValueError(f"{path}: version {data.get('version')!r}; this fastconv reads "
                         f"version {_FILE_VERSION}")
    loaded = {}
    for i, entry in enumerate(data["choices"]):
        problem = _problem_from_json(entry)
        if problem is None:
            raise ValueError(f"{path}: choice {i} is malformed: {entry!r}")
        algorithm = entry.get("algorithm")
        geo = _Geometry(problem.kernel, problem.stride, problem.dilation, problem.pad_before,
                        problem.out_hw)
        reason = ("" if algorithm in _TUNE_CANDIDATES else f"unknown algorithm {algorithm!r}")
        reason = reason or _inapplicable(algorithm, problem.groups, problem.x_shape[3],
                                         problem.weight_shape[0], geo, problem.x_shape[1:3])
        if reason:
            raise ValueError(f"{path}: choice {i}: {reason}")
        loaded[problem] = algorithm
    with _lock:
        _choices.update(loaded)
    return len(loaded)


#: Problem's fields as JSON gives them back: the type, and a tuple's length.
_FIELD_KINDS = {"isa": str, "dtype": str, "x_shape": 4, "weight_shape": 2, "groups": int,
                "kernel": 2, "stride": 2, "dilation": 2, "pad_before": 2, "out_hw": 2,
                "threads": int, "prepacked": bool, "bias": bool, "residual": bool,
                "activation": (type(None), str)}


def _problem_from_json(entry):
    """The Problem of a saved choice, or None if it is not one."""
    fields = entry.get("problem") if isinstance(entry, dict) else None
    if not isinstance(fields, dict) or set(fields) != set(Problem._fields):
        return None
    values = {}
    for name, kind in _FIELD_KINDS.items():
        v = fields[name]
        if isinstance(kind, int):
            if not (isinstance(v, list) and len(v) == kind
                    and all(type(n) is int and n >= 0 for n in v)):
                return None
            v = tuple(v)
        elif not isinstance(v, kind) or (kind is int and (type(v) is not int or v < 1)):
            return None
        values[name] = v
    return Problem(**values)


def _sample(run, repeats):
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    return (time.perf_counter() - start) / repeats


def choose(problem, candidates, preferred, run):
    """The cached choice for problem, else the fastest of candidates (a
    tuple of algorithm names that apply, preferred among them) timed by
    run(algorithm), which must compute the whole convolution."""
    choice = _choices.get(problem)
    if choice is not None:
        return choice
    with _lock:
        choice = _choices.get(problem)
        if choice is not None:       # another thread tuned it meanwhile
            return choice
        if len(candidates) > 1:
            # A first call packs weights (prepacked layers) and faults in
            # the result's pages; a second one sizes each sample and drops
            # the hopeless (implicit GEMM and Winograd run a depthwise layer
            # group by group, 70-200x slower than the direct kernel: timing
            # them ROUNDS more times would only make tuning slow).
            for a in candidates:
                run(a)
            second = {a: _sample(lambda a=a: run(a), 1) for a in candidates}
            quickest = min(second.values())
            candidates = tuple(a for a in candidates
                               if a == preferred or second[a] < HOPELESS * quickest)
            repeats = {a: min(MAX_REPEATS, max(1, int(SAMPLE_SECONDS / max(second[a], 1e-9))))
                       for a in candidates}
        if len(candidates) == 1:
            choice = preferred
        else:
            best = dict.fromkeys(candidates, float("inf"))
            for _ in range(ROUNDS):
                for a in candidates:
                    best[a] = min(best[a], _sample(lambda a=a: run(a), repeats[a]))
            fastest = min(candidates, key=best.__getitem__)
            choice = (fastest if best[fastest] < (1 - MARGIN) * best[preferred]
                      else preferred)
        _choices[problem] = choice
        return choice
