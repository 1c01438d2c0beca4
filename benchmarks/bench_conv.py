#!/usr/bin/env python
"""Convolution GFLOPS, forward and backward: fastconv vs torch vs numpy vs ONNX Runtime.

Layers: ResNet-18/50 (conv1 7x7/2; 3x3 at 56/28/14/7 and the strided 3x3/2;
the 1x1 bottlenecks incl. the 1x1/2 downsample), VGG16 conv1_1/conv1_2 at
224, MobileNetV2 depthwise 3x3 and a dilated 3x3, at batch 1 and 8, float32.

Systems, side by side in one run:

* fastconv   fastconv.conv2d on NHWC arrays (algorithm="auto"); per
             algorithm ("implicit", "im2col", "gemm1x1", "direct", "winograd") and
             fastconv.PackedConv2d (prepacked weights) in a table of their own
* torch NCHW torch.nn.functional.conv2d on contiguous NCHW tensors
* torch CL   the same on channels_last tensors (torch's fastest on CPU)
* numpy      im2col by sliding_window_view + reshape, then np.matmul (NHWC)
* ORT        ONNX Runtime running a one-node Conv model (onnx.helper,
             opset 17), in a subprocess of its own (its thread pool spins
             and would tax the others): intra_op threads = --threads,
             inter_op 1

Backward (grad input + grad weight): fastconv.conv2d_backward(output_mask=
(True, True, False)) vs torch.ops.aten.convolution_backward (the op torch's
autograd runs for a conv) in both torch layouts.  Every system's result is
checked against torch NCHW.  Peak memory: each system's extra peak RSS for
one forward call, in a fresh process per system (/proc/self/status VmHWM,
reset through /proc/self/clear_refs).

    python benchmarks/bench_conv.py [--quick] [--batch 1,8] [--threads 2]
        [--budget S] [--rounds R] [--layers SUBSTR[,SUBSTR]] [--no-torch] [--no-ort]
        [--no-backward] [--memory | --no-memory] [--memory-layers SUBSTR|all]
        [--retry-busy N] [--markdown PATH]
"""
import argparse
import contextlib
import ctypes
import gc
import json
import os
import subprocess
import sys
import tempfile
import time

import _harness as h

# Workers (started by this script) run with the parent's cleaned environment.
REEXEC_NOTE = h.reexec_without_openblas_overrides()

import numpy as np  # noqa: E402

import fastconv  # noqa: E402
from fastconv._bench_conv import (ConvSpec, numpy_conv2d, torch_conv_call,  # noqa: E402
                                  torch_inference)

LAYERS = (
    ConvSpec("resnet conv1 7x7/2 3->64 @224", 224, 3, 64, 7, 2, 3),
    ConvSpec("resnet 3x3 64->64 @56", 56, 64, 64, 3, 1, 1),
    ConvSpec("resnet18 3x3/2 64->128 @56", 56, 64, 128, 3, 2, 1),
    ConvSpec("resnet 3x3 128->128 @28", 28, 128, 128, 3, 1, 1),
    ConvSpec("resnet 3x3 256->256 @14", 14, 256, 256, 3, 1, 1),
    ConvSpec("resnet 3x3 512->512 @7", 7, 512, 512, 3, 1, 1),
    ConvSpec("resnet50 1x1 64->256 @56", 56, 64, 256, 1),
    ConvSpec("resnet50 1x1 256->64 @56", 56, 256, 64, 1),
    ConvSpec("resnet50 down 1x1/2 256->512 @56", 56, 256, 512, 1, 2),
    ConvSpec("resnet50 1x1 2048->512 @7", 7, 2048, 512, 1),
    ConvSpec("vgg16 conv1_1 3x3 3->64 @224", 224, 3, 64, 3, 1, 1),
    ConvSpec("vgg16 conv1_2 3x3 64->64 @224", 224, 64, 64, 3, 1, 1),
    ConvSpec("mobilenetv2 dw 3x3 32 @112", 112, 32, 32, 3, 1, 1, groups=32),
    ConvSpec("mobilenetv2 dw 3x3 576 @14", 14, 576, 576, 3, 1, 1, groups=576),
    ConvSpec("dilated 3x3 d2 128->128 @28", 28, 128, 128, 3, 1, 2, dilation=2),
    ConvSpec("resnext 3x3 g32 128->128 @28", 28, 128, 128, 3, 1, 1, groups=32),
)
#: --quick: one of each kind (3x3, strided, 1x1, 1x1/2, depthwise, dilated).
QUICK_LAYERS = ("resnet 3x3 64->64 @56", "resnet18 3x3/2", "resnet50 1x1 256->64",
                "resnet50 down 1x1/2", "dw 3x3 576", "dilated")
#: Layers whose peak memory is measured by default (at the largest batch).
MEMORY_LAYERS = ("vgg16 conv1_2", "resnet conv1", "resnet 3x3 64->64 @56",
                 "resnet50 1x1 64->256", "mobilenetv2 dw 3x3 32")
QUICK_MEMORY_LAYERS = ("resnet 3x3 64->64 @56",)
#: fastconv's forward algorithms, and the subset "auto" chooses from.
ALGORITHMS = ("implicit", "im2col", "gemm1x1", "direct", "winograd")
FORWARD = ("fastconv", "torch NCHW", "torch CL", "numpy", "ORT")
BACKWARD = ("fastconv", "torch NCHW", "torch CL")
MEMORY_SYSTEMS = ("fastconv", "fastconv packed", "fastconv im2col", "torch NCHW", "torch CL",
                  "numpy", "ORT")
#: Largest max |result - torch NCHW| / max |torch NCHW| accepted (float32).
FORWARD_TOLERANCE, BACKWARD_TOLERANCE = 1e-4, 1e-3
#: A cell whose fastconv call takes longer than this takes one sample per
#: round (instead of min_reps over all rounds): the big batch-8 layers.
SLOW_CALL = 0.08
MIB = 1 << 20
#: Timed seconds per system and cell (bench_gemm's 0.6 would take a full run
#: past 10 minutes: ~30 cells x ~10 systems x 3 rounds).
DEFAULT_BUDGET = 0.4

LEGEND = ("GFLOPS: best (fastest call) / median; 2·N·OH·OW·OC·KH·KW·C/groups flops per "
          "forward (each of the two gradients costs as much again).  Ratios: fastconv / "
          "other GFLOPS, of best / of median; > 1 means fastconv is faster.  "
          "best(CL,ORT) is the faster of torch channels_last and ORT; packed/best(CL,ORT) "
          "puts fastconv.PackedConv2d (weights packed once, as nn.prepack does for inference "
          "and as ORT does at session creation) in fastconv's place.  Every system "
          "allocates its output in each call.  fc ms: fastconv's median ms per call.  "
          "others: share of the CPUs other processes used while the row was timed (above a "
          "few %, distrust it); ORT is timed in its own process right after the others.")


def auto_algorithm(spec, batch, packed=False):
    """What conv2d(algorithm="auto") runs for this layer at this batch (or,
    packed=True, what PackedConv2d's auto runs): fastconv.conv's own choice."""
    x, w, _ = spec.arrays(1)
    x = np.broadcast_to(x, (batch, *x.shape[1:]))
    c = fastconv.conv._conv_setup(x, w, spec.stride, spec.padding, spec.dilation, spec.groups,
                                  "zeros", "NHWC")
    return fastconv.conv._choose_algorithm("auto", spec.groups, x.shape[3], w.shape[0], batch,
                                           c.geo, x.shape[1:3], packed)


def select_layers(text, layers=LAYERS):
    """Layers whose name contains any of the comma-separated substrings."""
    if text is None or text.strip().lower() == "all":
        return list(layers)
    wanted = [s.strip().lower() for s in text.split(",") if s.strip()]
    return [spec for spec in layers if any(w in spec.name.lower() for w in wanted)]


def layer_by_name(name):
    return next(spec for spec in LAYERS if spec.name == name)


def nchw(a):
    """NHWC numpy array of a torch NCHW tensor (any memory format)."""
    return a.permute(0, 2, 3, 1).numpy()


def rate(spec, batch, timing, factor=1.0):
    """(best, median) GFLOPS."""
    flops = factor * spec.flops(batch)
    return flops / timing.best / 1e9, flops / timing.median / 1e9


def fmt_rate(r):
    return "" if r is None else f"{r[0]:.1f} / {r[1]:.1f}"


def fmt_ratio(a, b):
    if a is None or b is None:
        return ""
    return f"{a[0] / b[0]:.2f} / {a[1] / b[1]:.2f}"


def fmt_error(error, tolerance):
    if error is None:
        return ""
    return f"{error:.1e}" + ("" if error <= tolerance else " FAIL")


def percent(share):
    return "" if share is None else f"{share:.0%}"


def cell_settings(settings, seconds_per_call):
    if seconds_per_call > SLOW_CALL:
        return settings._replace(min_reps=settings.rounds)
    return settings


# --------------------------------------------------------------- ONNX Runtime

def ort_conv_model(spec, w, batch):
    """Serialized one-node ONNX model: y = Conv(x, w) on NCHW, opset 17."""
    from onnx import TensorProto, helper, numpy_helper
    k, s, p, d = spec.kernel, spec.stride, spec.padding, spec.dilation
    node = helper.make_node("Conv", ["x", "w"], ["y"], kernel_shape=[k, k], strides=[s, s],
                            pads=[p, p, p, p], dilations=[d, d], group=spec.groups)
    graph = helper.make_graph(
        [node], "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, spec.in_c, spec.hw, spec.hw])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT,
                                       [batch, spec.out_c, spec.out_hw, spec.out_hw])],
        initializer=[numpy_helper.from_array(np.ascontiguousarray(w.transpose(0, 3, 1, 2)), "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8   # what opset 17 came with; any ONNX Runtime since 1.13 reads it
    return model.SerializeToString()


def ort_session(model_bytes, threads):
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    return ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])


def ort_worker():
    """--ort-worker: answer one JSON request per stdin line (time one layer
    with ONNX Runtime, write its output to request["out"]) with one JSON
    line on stdout.  Imports neither torch nor anything that spins."""
    try:
        import onnx  # noqa: F401
        import onnxruntime
        unavailable = None
        version = onnxruntime.__version__
    except ImportError as e:
        unavailable, version = f"not importable: {e}", None
    print(json.dumps({"version": version, "unavailable": unavailable}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = _ort_time(request)
        except Exception as e:  # report, keep serving
            reply = {"failed": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), flush=True)
    return 0


def _ort_time(request):
    spec, batch = layer_by_name(request["layer"]), request["batch"]
    threads = request["threads"]
    settings = h.Settings(**request["settings"])
    x, w, _ = spec.arrays(batch)
    x = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    session = ort_session(ort_conv_model(spec, w, batch), threads)
    feed = {"x": x}

    def call():
        return session.run(None, feed)[0]

    np.save(request["out"], call())
    start = time.perf_counter()
    call()
    settings = cell_settings(settings, time.perf_counter() - start)
    timings, share = h.run_cell([h.Block("ORT", contextlib.nullcontext, call)], settings)
    t = timings["ORT"]
    return {"best": t.best, "median": t.median, "samples": t.samples, "share": share}


class OrtClient:
    """The ORT worker process, started at the first request."""

    def __init__(self):
        self.process = None
        self.version = self.unavailable = None

    def _start(self):
        self.process = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--ort-worker"],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = json.loads(self.process.stdout.readline() or '{"unavailable": "worker died"}')
        self.version, self.unavailable = hello.get("version"), hello.get("unavailable")

    def forward(self, spec, batch, threads, settings):
        """(Timing, share, NHWC output) or (None, None, None) with a note."""
        if self.process is None:
            self._start()
        if self.unavailable:
            return None, None, None
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "y.npy")
            request = dict(layer=spec.name, batch=batch, threads=threads,
                           settings=settings._asdict(), out=out)
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
            if not line:
                self.unavailable = "worker died"
                return None, None, None
            reply = json.loads(line)
            if "failed" in reply:
                print(f"  ORT failed on {spec.name}: {reply['failed']}", file=sys.stderr)
                return None, None, None
            y = np.load(out).transpose(0, 2, 3, 1)
        timing = h.Timing(reply["best"], reply["median"], reply["samples"])
        return timing, reply["share"], y

    def close(self):
        if self.process is not None:
            self.process.stdin.close()
            self.process.wait(timeout=60)
            self.process = None


# --------------------------------------------------------------- peak memory

def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _settle():
    """Give freed memory back to the OS, so that RSS is what is live."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _extra_peak(call):
    """(extra peak RSS of one call in bytes, output bytes) over the RSS
    before it; the result is dropped and freed memory trimmed afterwards."""
    _settle()
    base = _status_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")   # reset VmHWM to the current RSS
    y = call()
    peak = _status_kib("VmHWM")
    out_bytes = int(np.prod(y.shape)) * 4
    del y
    _settle()
    return (peak - base) * 1024, out_bytes


def memory_worker(request):
    """--memory-worker JSON: set one system up for one layer, then measure
    its first forward call and a repeat; print one JSON line."""
    spec, batch = layer_by_name(request["layer"]), request["batch"]
    system, threads = request["system"], request["threads"]
    x, w, _ = spec.arrays(batch)
    kwargs = spec.conv_kwargs()
    limits = contextlib.ExitStack()
    if system.startswith("fastconv"):
        fastconv.set_num_threads(threads)
        if system == "fastconv packed":
            layer = fastconv.PackedConv2d(w, None, **kwargs)   # packs at its first call
            call = lambda: layer(x)  # noqa: E731
        elif system == "fastconv im2col":
            call = lambda: fastconv.conv2d(x, w, None, **kwargs, algorithm="im2col")  # noqa: E731
        else:
            call = lambda: fastconv.conv2d(x, w, None, **kwargs)  # noqa: E731
    elif system.startswith("torch"):
        torch = h.import_torch()
        call, _, _ = torch_conv_call(torch, spec, x, w, channels_last=system == "torch CL")
        limits.enter_context(torch_inference(threads))
    elif system == "numpy":
        limits.enter_context(h.numpy_threads(threads))
        call = lambda: numpy_conv2d(x, w, **kwargs)  # noqa: E731
    elif system == "ORT":
        session = ort_session(ort_conv_model(spec, w, batch), threads)
        feed = {"x": np.ascontiguousarray(x.transpose(0, 3, 1, 2))}
        call = lambda: session.run(None, feed)[0]  # noqa: E731
    else:
        raise ValueError(system)
    with limits:
        first, out_bytes = _extra_peak(call)
        repeat, _ = _extra_peak(call)
    print(json.dumps({"first": first, "repeat": repeat, "out": out_bytes,
                      "base": _status_kib("VmRSS") * 1024}))
    return 0


def clear_refs_supported():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def measure_memory(spec, batch, threads, systems):
    """{system: reply dict or None}: one fresh process per system."""
    results = {}
    for system in systems:
        request = json.dumps(dict(layer=spec.name, batch=batch, system=system, threads=threads))
        try:
            run = subprocess.run([sys.executable, os.path.abspath(__file__), "--memory-worker",
                                  request], capture_output=True, text=True, timeout=600)
            results[system] = json.loads(run.stdout.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, ValueError, IndexError):
            tail = (run.stderr.strip().splitlines() or ["?"])[-1] if "run" in locals() else "timeout"
            print(f"  memory: {system} on {spec.name} failed: {tail}", file=sys.stderr)
            results[system] = None
    return results


def memory_section(specs, batch, threads, systems):
    headers = ["layer", "N", "output MiB"] + list(systems) + ["fastconv x out"]
    rows = []
    for spec in specs:
        print(f"  memory {spec.name} N={batch}: {', '.join(systems)}", file=sys.stderr,
              flush=True)
        results = measure_memory(spec, batch, threads, systems)
        out = spec.output_bytes(batch)
        row = [spec.name, batch, f"{out / MIB:.1f}"]
        for system in systems:
            r = results[system]
            row.append("failed" if r is None else
                       f"{r['first'] / MIB:.1f} / {r['repeat'] / MIB:.1f}")
        fc = results.get("fastconv")
        row.append("" if fc is None else f"{fc['first'] / out:.2f} / {fc['repeat'] / out:.2f}")
        rows.append(row)
    notes = [f"Extra peak RSS (MiB) of one forward call over the RSS just before it, each "
             f"system in a fresh process ({threads} threads): first call / a repeat call.  The "
             f"first call includes one-off costs (thread pools, PackedConv2d's packing, ORT's "
             f"arena growth); before the repeat the previous output is freed and malloc_trim "
             f"run (memory an allocator keeps for reuse, like ORT's arena, then counts in the "
             f"base and not in the repeat's extra).  The output itself "
             f"is part of the extra; 'fastconv x out' = fastconv's extra / output size "
             f"(first / repeat): at most ~1.1 means no workspace beyond the output worth "
             f"mentioning."]
    return ("Peak memory of one forward call, float32", headers, rows, notes)


# --------------------------------------------------------------- timing cells

class Cell:
    """One layer x batch x thread count: every system's timings and errors."""

    def __init__(self, spec, batch, threads):
        self.spec, self.batch, self.threads = spec, batch, threads
        self.forward = {}      # system or "fastconv <algorithm>" / "fastconv packed" -> Timing
        self.errors = {}       # same keys -> max rel err vs torch NCHW (or numpy)
        self.backward = {}     # system -> Timing
        self.backward_errors = {}  # system -> (grad input err, grad weight err)
        self.forward_share = self.ort_share = self.backward_share = None
        self.applicable = {}   # algorithm -> bool
        self.tuned = None      # what conv2d(algorithm="tune") chose
        self.reference = None  # what the errors are measured against

    def rate(self, key):
        t = self.forward.get(key)
        return None if t is None else rate(self.spec, self.batch, t)

    def backward_rate(self, key):
        t = self.backward.get(key)
        return None if t is None else rate(self.spec, self.batch, t, 2.0)


def measure_cell(spec, batch, threads, settings, torch, ort, with_backward):
    cell = Cell(spec, batch, threads)
    x, w, dy = spec.arrays(batch)
    kwargs = spec.conv_kwargs()
    fc_threads = lambda: h.fastconv_threads(threads)  # noqa: E731
    torch_ctx = lambda: torch_inference(threads)  # noqa: E731
    auto = auto_algorithm(spec, batch)

    # ---- forward calls
    calls = {"fastconv": (fc_threads, lambda: fastconv.conv2d(x, w, None, **kwargs))}
    for algorithm in ALGORITHMS:
        if algorithm == auto:
            cell.applicable[algorithm] = True
            continue
        call = (lambda a=algorithm: fastconv.conv2d(x, w, None, **kwargs, algorithm=a))
        try:
            with h.fastconv_threads(threads):
                call()
            cell.applicable[algorithm] = True
        except ValueError:
            cell.applicable[algorithm] = False
            continue
        calls[f"fastconv {algorithm}"] = (fc_threads, call)
    if auto_algorithm(spec, batch, packed=True) in ("implicit", "winograd", "direct"):
        # elsewhere (gemm1x1) PackedConv2d runs what auto runs, with nothing packed
        packed = fastconv.PackedConv2d(w, None, **kwargs)
        calls["fastconv packed"] = (fc_threads, lambda: packed(x))
    torch_tensors = {}
    if torch is not None:
        for name, channels_last in (("torch NCHW", False), ("torch CL", True)):
            call, xt, wt = torch_conv_call(torch, spec, x, w, channels_last)
            torch_tensors[name] = (xt, wt)
            calls[name] = (torch_ctx, call)
    calls["numpy"] = (lambda: h.numpy_threads(threads), lambda: numpy_conv2d(x, w, **kwargs))

    # ---- forward check (also estimates the call time)
    outputs = {}
    for key, (enter, call) in calls.items():
        with enter():
            start = time.perf_counter()
            y = call()
            seconds = time.perf_counter() - start
        outputs[key] = nchw(y) if torch is not None and key.startswith("torch") else y
        if key == "fastconv":
            fastconv_seconds = seconds
    # algorithm="tune": its own timing, once (not timed itself: it runs what
    # it chose), after the pause every system's block gets (the thread pools
    # of the calls above spin for a while and would slow its samples)
    fastconv.clear_tuned_algorithms()
    time.sleep(settings.pause)
    with fc_threads():
        fastconv.conv2d(x, w, None, **kwargs, algorithm="tune")
    (cell.tuned,) = fastconv.tuned_algorithms().values()
    cell.reference = "torch NCHW" if torch is not None else "numpy"
    reference = outputs[cell.reference]
    cell.errors = {key: h.max_relative_error(y, reference) for key, y in outputs.items()
                   if key != cell.reference}
    del outputs, y
    settings = cell_settings(settings, fastconv_seconds)

    blocks = [h.Block(key, enter, call) for key, (enter, call) in calls.items()]
    cell.forward, cell.forward_share = h.run_cell(blocks, settings)
    del blocks, calls

    if ort is not None:
        timing, share, y = ort.forward(spec, batch, threads, settings)
        if timing is not None:
            cell.forward["ORT"], cell.ort_share = timing, share
            cell.errors["ORT"] = h.max_relative_error(y, reference)

    # ---- backward
    if with_backward:
        mask = (True, True, False)
        calls = {"fastconv": (fc_threads, lambda: fastconv.conv2d_backward(
            dy, x, w, **kwargs, output_mask=mask)[:2])}
        if torch is not None:
            op = torch.ops.aten.convolution_backward
            s, p, d = spec.stride, spec.padding, spec.dilation
            for name, (xt, wt) in torch_tensors.items():
                dyt = torch.from_numpy(dy).permute(0, 3, 1, 2).contiguous(
                    memory_format=torch.channels_last if name == "torch CL"
                    else torch.contiguous_format)
                calls[name] = (torch_ctx, lambda xt=xt, wt=wt, dyt=dyt: op(
                    dyt, xt, wt, None, [s, s], [p, p], [d, d], False, [0, 0], spec.groups,
                    list(mask))[:2])
        grads = {}
        for key, (enter, call) in calls.items():
            with enter():
                start = time.perf_counter()
                gx, gw = call()
                seconds = time.perf_counter() - start
            if key.startswith("torch"):
                gx, gw = nchw(gx), nchw(gw)
            grads[key] = (gx, gw)
            if key == "fastconv":
                fastconv_seconds = seconds
        if "torch NCHW" in grads:
            ref_x, ref_w = grads["torch NCHW"]
            cell.backward_errors = {key: (h.max_relative_error(gx, ref_x),
                                          h.max_relative_error(gw, ref_w))
                                    for key, (gx, gw) in grads.items() if key != "torch NCHW"}
        del grads
        blocks = [h.Block(key, enter, call) for key, (enter, call) in calls.items()]
        cell.backward, cell.backward_share = h.run_cell(
            blocks, cell_settings(settings, fastconv_seconds))
    return cell


# --------------------------------------------------------------- tables

def forward_section(cells, batch):
    headers = (["layer", "thr", "GFLOP", "fc ms"] + list(FORWARD)
               + ["fc/torch CL", "fc/best(CL,ORT)", "packed/best(CL,ORT)", "fc/numpy", "others"])
    rows = []
    for c in cells:
        fc = c.rate("fastconv")
        packed = c.rate("fastconv packed") or fc   # where not timed it runs auto's code
        rivals = [r for r in (c.rate("torch CL"), c.rate("ORT")) if r is not None]
        best_rival = (max(r[0] for r in rivals), max(r[1] for r in rivals)) if rivals else None
        shares = [s for s in (c.forward_share, c.ort_share) if s is not None]
        rows.append([c.spec.name, c.threads, f"{c.spec.flops(c.batch) / 1e9:.3g}",
                     f"{c.forward['fastconv'].median * 1e3:.3g}"]
                    + [fmt_rate(c.rate(s)) for s in FORWARD]
                    + [fmt_ratio(fc, c.rate("torch CL")), fmt_ratio(fc, best_rival),
                       fmt_ratio(packed, best_rival), fmt_ratio(fc, c.rate("numpy")),
                       percent(max(shares) if shares else None)])
    return (f"Forward, batch {batch}, float32", headers, rows, [LEGEND])


def algorithm_section(cells, batch):
    headers = ["layer", "thr", "auto"] + list(ALGORITHMS) + ["packed", "best/auto", "tune"]
    rows = []
    for c in cells:
        auto = auto_algorithm(c.spec, c.batch)
        row = [c.spec.name, c.threads, auto]
        medians = {}
        for algorithm in ALGORITHMS:
            key = "fastconv" if algorithm == auto else f"fastconv {algorithm}"
            r = c.rate(key)
            if r is None:
                row.append("n/a" if not c.applicable.get(algorithm) else "")
                continue
            medians[algorithm] = r[1]
            row.append(fmt_rate(r))
        packed = c.rate("fastconv packed")
        if packed is not None:
            medians["packed"] = packed[1]
        row.append(fmt_rate(packed) if packed is not None else "= auto")
        best = max(medians, key=medians.get)
        row.append(f"{medians[best] / medians[auto]:.2f} ({best})")
        row.append("= auto" if c.tuned == auto else
                   f"{c.tuned} ({medians[c.tuned] / medians[auto]:.2f})")
        rows.append(row)
    notes = ["fastconv.conv2d(algorithm=...) GFLOPS, best / median; 'auto': what "
             "algorithm='auto' runs (its column repeats the 'fastconv' column of the forward "
             "table); n/a: the "
             "algorithm does not apply.  packed: fastconv.PackedConv2d (weights packed once, "
             "as nn.prepack does; its auto can take winograd where conv2d's does not); '= auto': "
             "nothing to pack (gemm1x1), the same code as auto.  "
             "best/auto: the fastest (median) over auto's.  tune: what "
             "algorithm='tune' chose by its own one-time timing (and its median over auto's "
             "here), '= auto' where it kept auto's choice."]
    return (f"fastconv forward algorithms, batch {batch}", headers, rows, notes)


def backward_section(cells, batch):
    headers = (["layer", "thr", "GFLOP", "fc ms"] + list(BACKWARD)
               + ["fc/torch CL", "fc/torch NCHW", "others"])
    rows = []
    for c in cells:
        fc = c.backward_rate("fastconv")
        rows.append([c.spec.name, c.threads, f"{2 * c.spec.flops(c.batch) / 1e9:.3g}",
                     f"{c.backward['fastconv'].median * 1e3:.3g}"]
                    + [fmt_rate(c.backward_rate(s)) for s in BACKWARD]
                    + [fmt_ratio(fc, c.backward_rate("torch CL")),
                       fmt_ratio(fc, c.backward_rate("torch NCHW")), percent(c.backward_share)])
    notes = ["grad input + grad weight (no bias): fastconv.conv2d_backward(output_mask=(True, "
             "True, False)) vs torch.ops.aten.convolution_backward, the op torch's autograd "
             "runs for a convolution (so: no autograd-engine overhead), on NCHW or "
             "channels_last tensors.  GFLOPS counts both products (2x the forward flops); "
             "otherwise as in the forward table."]
    return (f"Backward (grad input + grad weight), batch {batch}, float32", headers, rows, notes)


def accuracy_section(cells):
    fc_keys = ["fastconv"] + [f"fastconv {a}" for a in ALGORITHMS] + ["fastconv packed"]
    others = ["torch CL", "numpy", "ORT"]
    headers = (["layer", "N", "thr", "vs", "fastconv"] + list(ALGORITHMS) + ["packed"] + others
               + ["bwd fastconv gx / gw", "bwd torch CL gx / gw"])
    rows = []
    ok = True
    for c in cells:
        row = [c.spec.name, c.batch, c.threads, c.reference]
        for key in fc_keys:
            row.append(fmt_error(c.errors.get(key), FORWARD_TOLERANCE))
            if c.errors.get(key, 0.0) > FORWARD_TOLERANCE:
                ok = False
        row += [fmt_error(c.errors.get(key), FORWARD_TOLERANCE) for key in others]
        for key in ("fastconv", "torch CL"):
            e = c.backward_errors.get(key)
            row.append("" if e is None else " / ".join(fmt_error(v, BACKWARD_TOLERANCE)
                                                        for v in e))
        if max(c.backward_errors.get("fastconv", (0.0, 0.0))) > BACKWARD_TOLERANCE:
            ok = False
        rows.append(row)
    notes = [f"max |result - reference| / max |reference|, reference = torch NCHW (numpy "
             f"without torch).  FAIL above {FORWARD_TOLERANCE:g} (forward) / "
             f"{BACKWARD_TOLERANCE:g} (backward).  Empty: not run (the algorithm's column is "
             f"the 'fastconv' one where auto picks it)."]
    return ("Accuracy vs the reference", headers, rows, notes), ok


# --------------------------------------------------------------- main

_batch_list = h.positive_int_list("batch sizes")


def main():
    parser = h.add_common_arguments(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for action in parser._actions:   # this benchmark's defaults
        if action.dest == "threads":
            action.default, action.help = [cpus], f"comma-separated thread counts (default {cpus})"
        if action.dest == "budget":
            action.help = ("timed seconds per system x layer x batch x threads cell, over all "
                           f"rounds (default {DEFAULT_BUDGET:g}; 0.15 with --quick)")
    parser.add_argument("--batch", type=_batch_list, default=None,
                        help="comma-separated batch sizes (default 1,8; 1 with --quick)")
    parser.add_argument("--layers", metavar="SUBSTR[,SUBSTR]",
                        help="only layers whose name contains one of these (case-insensitive); "
                             "'all' for all (default all; a few with --quick)")
    parser.add_argument("--no-ort", action="store_true", help="leave ONNX Runtime out")
    parser.add_argument("--no-backward", action="store_true", help="forward only")
    parser.add_argument("--memory", action=argparse.BooleanOptionalAction, default=True,
                        help="measure each system's peak memory per forward call (default on)")
    parser.add_argument("--memory-layers", metavar="SUBSTR[,SUBSTR]",
                        help="layers to measure memory on, 'all' for every selected layer "
                             f"(default: {', '.join(MEMORY_LAYERS)}), at the largest --batch")
    parser.add_argument("--list", action="store_true", help="list the layers and exit")
    args = parser.parse_args()
    if args.list:
        for spec in LAYERS:
            print(f"{spec.name:<36} {spec.hw}x{spec.hw}x{spec.in_c} -> {spec.out_c}, "
                  f"k{spec.kernel} s{spec.stride} p{spec.padding} d{spec.dilation} "
                  f"g{spec.groups}")
        return 0
    if args.budget is None:
        args.budget = 0.15 if args.quick else DEFAULT_BUDGET
    settings = h.settings_from(args)
    batches = args.batch or ([1] if args.quick else [1, 8])
    layers = select_layers(args.layers if args.layers or not args.quick
                           else ",".join(QUICK_LAYERS))
    if not layers:
        parser.error(f"--layers {args.layers!r} matches none of: "
                     + "; ".join(spec.name for spec in LAYERS))
    torch = None if args.no_torch else h.import_torch()
    ort = None if args.no_ort else OrtClient()
    started = time.perf_counter()

    preamble = h.environment_report(torch, REEXEC_NOTE)
    preamble.append(f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    preamble.append(f"method: per cell {settings.budget:g} s timed per system, >= "
                    f"{settings.min_reps} samples (one per round for calls > {SLOW_CALL:g} s), "
                    f"{settings.rounds} interleaved rounds, {settings.pause:g} s pause before "
                    f"each system's block; ORT in a worker process, timed the same way right "
                    f"after the in-process systems"
                    + (f"; disturbed cells re-timed up to {settings.retries} times"
                       if settings.retries else ""))
    if ort is not None:
        ort._start()
        preamble.append("onnxruntime " + (ort.version or f"unavailable ({ort.unavailable})"))
    print("\n".join(preamble), flush=True)

    sections, all_cells, ok = [], [], True
    try:
        for batch in batches:
            cells = []
            for threads in args.threads:
                for spec in layers:
                    print(f"  {spec.name} N={batch} {threads} thread(s)", file=sys.stderr,
                          flush=True)
                    cells.append(measure_cell(spec, batch, threads, settings, torch, ort,
                                              not args.no_backward))
            for section in [forward_section(cells, batch), algorithm_section(cells, batch)] + (
                    [] if args.no_backward else [backward_section(cells, batch)]):
                h.print_section(*section)
                sections.append(section)
            all_cells += cells
    finally:
        if ort is not None:
            ort.close()
    accuracy, ok = accuracy_section(all_cells)
    h.print_section(*accuracy)
    sections.append(accuracy)

    if args.memory:
        if not clear_refs_supported():
            print("\nmemory: /proc/self/clear_refs cannot reset the peak RSS here; skipped")
        else:
            chosen = args.memory_layers or ",".join(
                QUICK_MEMORY_LAYERS if args.quick else MEMORY_LAYERS)
            memory_layers = [s for s in select_layers(chosen) if s in layers or args.memory_layers]
            systems = [s for s in MEMORY_SYSTEMS
                       if not (s.startswith("torch") and torch is None)
                       and not (s == "ORT" and (ort is None or ort.unavailable))]
            if memory_layers:
                section = memory_section(memory_layers, max(batches), args.threads[-1], systems)
                h.print_section(*section)
                sections.append(section)

    shares = [s for c in all_cells for s in (c.forward_share, c.backward_share, c.ort_share)
              if s is not None]
    return h.finish_run(started, shares, ok, "SOME FASTCONV RESULTS ARE WRONG (FAIL)", args.markdown,
                        "fastconv convolution benchmark", preamble, sections)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--ort-worker":
        sys.exit(ort_worker())
    if len(sys.argv) > 2 and sys.argv[1] == "--memory-worker":
        sys.exit(memory_worker(json.loads(sys.argv[2])))
    sys.exit(main())
