#!/usr/bin/env python
"""ResNet-18 inference end to end: fastconv.nn vs torch vs ONNX Runtime.

One network, one set of weights: examples/export_torch_resnet18.py's
hand-built torch ResNet-18 (seeded random weights, batchnorm statistics
calibrated on random images), loaded into fastconv.models.resnet18 with
nn.load_torch_state_dict, then eval(), nn.fold_batchnorms and nn.prepack, as
examples/resnet18_infer.py runs it.  224x224 float32 images, batch 1 and 8.

* fastconv       the fastconv.nn model on NHWC images, under nn.no_grad()
* torch NCHW     eager torch, contiguous NCHW, under torch.inference_mode()
* torch CL       the same with the model and input in channels_last
* torch CL jit   torch.jit.trace + torch.jit.optimize_for_inference of the
                 channels_last model (frozen, batchnorms folded; --no-jit
                 leaves it out)
* ORT            the torch model exported by torch.onnx.export(dynamo=False,
                 opset 17) run by ONNX Runtime in a process of its own (its
                 thread pool spins): intra_op threads = --threads, inter_op 1

Latency (ms per batch, best and median), images/s, and the ratios
fastconv / ORT (the project's target: <= 0.90) and fastconv / torch CL
(< 1: fastconv faster).  Every system's logits are checked against torch
NCHW.  --digits adds seconds per training epoch of examples/train_digits.py's
CNN, fastconv vs torch.

    python benchmarks/bench_resnet18.py [--quick] [--batch 1,8] [--threads 2]
        [--budget S] [--rounds R] [--no-torch] [--no-ort] [--no-jit] [--digits]
        [--epochs E] [--retry-busy N] [--markdown PATH]
"""
import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import _harness as h

REEXEC_NOTE = h.reexec_without_openblas_overrides()

import numpy as np  # noqa: E402

from fastconv import models, nn  # noqa: E402

EXAMPLES = os.path.join(h.REPO_ROOT, "examples")
IMAGE_SIZE = 224
SEED = 0
#: ORT target: fastconv's latency at most this times ORT's.
ORT_TARGET = 0.90
#: Largest max |logits - torch NCHW| / max |torch NCHW| accepted.
TOLERANCE = 1e-3


def load_example(name):
    """examples/<name>.py as a module (the examples are not a package)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def images(batch):
    """Seeded NHWC float32 batch, the same in every process."""
    rng = np.random.default_rng([SEED, batch])
    return rng.standard_normal((batch, IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.float32)


# --------------------------------------------------------------- ONNX Runtime worker

def ort_worker(request):
    """--ort-worker JSON: time the exported model on one batch with ONNX
    Runtime; write the logits to request["out"]; print one JSON line."""
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = request["threads"]
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(request["model"], options, providers=["CPUExecutionProvider"])
    feed = {"x": np.ascontiguousarray(images(request["batch"]).transpose(0, 3, 1, 2))}

    def call():
        return session.run(None, feed)[0]

    np.save(request["out"], call())
    timings, share = h.run_cell([h.Block("ORT", contextlib.nullcontext, call)],
                                h.Settings(**request["settings"]))
    t = timings["ORT"]
    print(json.dumps({"best": t.best, "median": t.median, "samples": t.samples, "share": share,
                      "version": ort.__version__}))
    return 0


def time_ort(model_path, batch, threads, settings):
    """(Timing, share, logits, version) from a fresh worker process, or Nones."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "logits.npy")
        request = json.dumps(dict(model=model_path, batch=batch, threads=threads,
                                  settings=settings._asdict(), out=out))
        run = subprocess.run([sys.executable, os.path.abspath(__file__), "--ort-worker", request],
                             stdout=subprocess.PIPE, text=True)
        if run.returncode != 0:
            print(f"  ORT worker failed (exit {run.returncode})", file=sys.stderr)
            return None, None, None, None
        reply = json.loads(run.stdout.strip().splitlines()[-1])
        logits = np.load(out)
    return (h.Timing(reply["best"], reply["median"], reply["samples"]), reply["share"], logits,
            reply["version"])


def onnx_available():
    return all(importlib.util.find_spec(m) is not None for m in ("onnx", "onnxruntime"))


# --------------------------------------------------------------- models

def build_models(torch, seed=SEED):
    """(torch ResNet-18 in eval mode, its state_dict as numpy arrays)."""
    example = load_example("export_torch_resnet18")
    torch.manual_seed(seed)
    model = example.ResNet18()
    example.randomize_batchnorms(model, 64, seed)
    model.eval()
    return model, {k: v.numpy() for k, v in model.state_dict().items()}


def fastconv_model(state, algorithm="auto"):
    model = models.resnet18(num_classes=state["fc.weight"].shape[0])
    nn.load_torch_state_dict(model, state)
    model.eval()
    nn.fold_batchnorms(model)
    return nn.prepack(model, algorithm)


@contextlib.contextmanager
def fastconv_inference(threads):
    with h.fastconv_threads(threads), nn.no_grad():
        yield


@contextlib.contextmanager
def torch_inference(threads):
    import torch
    with h.torch_threads(threads), torch.inference_mode():
        yield


def random_state(seed=SEED):
    """Without torch: fastconv's own seeded weights (no ORT or torch to
    compare with, so only fastconv is timed)."""
    return nn.to_torch_state_dict(models.resnet18(rng=seed))


# --------------------------------------------------------------- digits

def digits_section(args, torch):
    """Seconds per epoch of train_digits.py's CNN, fastconv vs torch."""
    if importlib.util.find_spec("sklearn") is None:
        print("\n--digits: scikit-learn is not installed; skipped")
        return None
    example = load_example("train_digits")
    frameworks = ["fastconv"] + (["torch"] if torch is not None else [])
    threads = args.threads[-1]
    epochs = args.epochs or (2 if args.quick else 4)
    rows, per_epoch = [], {}
    for framework in frameworks:
        print(f"  digits: {framework}, {epochs} epochs, {threads} threads", file=sys.stderr,
              flush=True)
        threads_ctx = h.fastconv_threads(threads) if framework == "fastconv" else \
            h.torch_threads(threads)
        with threads_ctx, h.ForeignLoad() as load:
            history = example.train(framework, epochs=epochs, show_progress=False,
                                    log=lambda line: None)
        steady = history["seconds"][1:] or history["seconds"]
        per_epoch[framework] = statistics.median(steady)
        rows.append([framework, f"{per_epoch[framework]:.3f}", f"{min(steady):.3f}",
                     f"{history['seconds'][0]:.3f}", f"{history['test_accuracy'][-1]:.2%}",
                     "" if load.share is None else f"{load.share:.0%}"])
    notes = [f"examples/train_digits.py's CNN (8x8x1 -> conv 32 -> conv 64 -> max pool -> "
             f"linear 10, batch 32, SGD with momentum) on scikit-learn's digits, the same "
             f"initial weights and batches in both, {threads} threads, {epochs} epochs.  "
             f"Seconds per epoch: median and best after the first, and the first (one-off "
             f"costs).  The frameworks train one after the other, not interleaved."]
    if "torch" in per_epoch:
        notes.append(f"epoch time fastconv / torch: {per_epoch['fastconv'] / per_epoch['torch']:.2f}"
                     f" (< 1: fastconv faster)")
    headers = ["framework", "s/epoch (median)", "s/epoch (best)", "first epoch s",
               "final test acc", "others"]
    return ("Training: digits CNN, seconds per epoch", headers, rows, notes)


# --------------------------------------------------------------- main

_batch_list = h.positive_int_list("batch sizes")


#: In-process systems and ORT are timed in this many alternating pairs.
PAIRED_REPEATS = 3


def merge_runs(runs):
    """{system: Timing} over repeated cells: the fastest call, the median of
    the cells' medians, all samples."""
    merged = {}
    for name in runs[0]:
        ts = [r[name] for r in runs if name in r]
        merged[name] = h.Timing(min(t.best for t in ts), statistics.median(t.median for t in ts),
                                sum(t.samples for t in ts))
    return merged


def paired_ratios(runs, a, b):
    """(best, median) of a / b over the repeats in which both ran, each a
    ratio of two systems timed minutes apart at most; None without pairs."""
    pairs = [(r[a], r[b]) for r in runs if a in r and b in r]
    if not pairs:
        return None
    return (statistics.median(x.best / y.best for x, y in pairs),
            statistics.median(x.median / y.median for x, y in pairs))


def fmt_ratio(a, b):
    if a is None or b is None:
        return ""
    return f"{a.best / b.best:.2f} / {a.median / b.median:.2f}"


def main():
    parser = h.add_common_arguments(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for action in parser._actions:   # this benchmark's defaults
        if action.dest == "threads":
            action.default, action.help = [cpus], f"comma-separated thread counts (default {cpus})"
        if action.dest == "budget":
            action.help = ("timed seconds per system x batch x threads cell, over all rounds "
                           "(default 3; 0.5 with --quick)")
    parser.add_argument("--batch", type=_batch_list, default=None,
                        help="comma-separated batch sizes (default 1,8; 1 with --quick)")
    parser.add_argument("--no-ort", action="store_true", help="leave ONNX Runtime out")
    parser.add_argument("--no-jit", action="store_true", help="leave torch CL jit out")
    parser.add_argument("--digits", action="store_true",
                        help="also time examples/train_digits.py's CNN training, fastconv vs "
                             "torch (seconds per epoch)")
    parser.add_argument("--epochs", type=int, default=None,
                        help="--digits epochs per framework (default 4; 2 with --quick)")
    args = parser.parse_args()
    if args.budget is None:
        args.budget = 0.5 if args.quick else 3.0
    settings = h.settings_from(args)
    batches = args.batch or ([1] if args.quick else [1, 8])
    torch = None if args.no_torch else h.import_torch()
    use_ort = not args.no_ort and torch is not None and onnx_available()
    started = time.perf_counter()

    preamble = h.environment_report(torch, REEXEC_NOTE)
    preamble.append(f"command: {' '.join([os.path.basename(sys.executable)] + sys.argv)}")
    preamble.append(f"method: per cell {settings.budget:g} s timed per system, >= "
                    f"{settings.min_reps} samples, {settings.rounds} interleaved rounds, "
                    f"{settings.pause:g} s pause before each system's block; ORT in a process "
                    f"of its own, timed the same way right after the in-process systems, "
                    f"in {PAIRED_REPEATS} alternating pairs"
                    + (f"; disturbed cells re-timed up to {settings.retries} times"
                       if settings.retries else ""))
    if use_ort:
        from importlib.metadata import version
        preamble.append(f"onnxruntime {version('onnxruntime')}, onnx {version('onnx')} "
                        f"(export: torch.onnx.export(dynamo=False), opset 17)")
    if not args.no_ort and not use_ort:
        preamble.append("ORT: left out (" + ("needs torch to export the model"
                                             if torch is None else "onnx/onnxruntime missing")
                        + ")")

    print("  building the models", file=sys.stderr, flush=True)
    if torch is not None:
        tmodel, state = build_models(torch)
    else:
        tmodel, state = None, random_state()
    fmodel = fastconv_model(state)
    tuned_model = fastconv_model(state, "tune")
    tmodel_cl = jit_model = None
    tmp = tempfile.TemporaryDirectory()
    onnx_path = os.path.join(tmp.name, "resnet18.onnx")
    if torch is not None:
        import copy
        tmodel_cl = copy.deepcopy(tmodel).to(memory_format=torch.channels_last)
        if use_ort:
            print("  exporting to ONNX", file=sys.stderr, flush=True)
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                torch.onnx.export(tmodel, torch.from_numpy(images(1)).permute(0, 3, 1, 2),
                                  onnx_path, dynamo=False, opset_version=17,
                                  input_names=["x"], output_names=["logits"],
                                  dynamic_axes={"x": {0: "batch"}, "logits": {0: "batch"}})
    print("\n".join(preamble), flush=True)

    latency_rows, ratio_rows, error_rows = [], [], []
    ok, shares = True, []
    for batch in batches:
        x = images(batch)
        for threads in args.threads:
            print(f"  ResNet-18 N={batch} {threads} thread(s)", file=sys.stderr, flush=True)
            calls = {"fastconv": (lambda t=threads: fastconv_inference(t), lambda x=x: fmodel(x)),
                     # its first call (the check below) tunes each conv
                     "fastconv tune": (lambda t=threads: fastconv_inference(t),
                                       lambda x=x: tuned_model(x))}
            if torch is not None:
                xt = torch.from_numpy(x).permute(0, 3, 1, 2).contiguous()
                xt_cl = xt.contiguous(memory_format=torch.channels_last)
                calls["torch NCHW"] = (lambda t=threads: torch_inference(t),
                                       lambda xt=xt: tmodel(xt))
                calls["torch CL"] = (lambda t=threads: torch_inference(t),
                                     lambda xt=xt_cl: tmodel_cl(xt))
                if not args.no_jit:
                    if jit_model is None:
                        print("  torch.jit.trace + optimize_for_inference", file=sys.stderr,
                              flush=True)
                        with torch.no_grad():
                            jit_model = torch.jit.optimize_for_inference(
                                torch.jit.trace(tmodel_cl, xt_cl))
                    # jit models keep torch.no_grad (inference_mode tensors upset tracing)
                    calls["torch CL jit"] = (lambda t=threads: _torch_no_grad(torch, t),
                                             lambda xt=xt_cl: jit_model(xt))
            logits = {}
            for name, (enter, call) in calls.items():
                with enter():
                    y = call()
                logits[name] = y if isinstance(y, np.ndarray) else y.numpy()
            blocks = [h.Block(name, enter, call) for name, (enter, call) in calls.items()]
            # ORT runs in a process of its own, so it cannot take turns with
            # the others inside one cell; instead the cell is split into
            # PAIRED_REPEATS (in-process systems, then ORT) pairs, and the
            # fastconv / ORT ratio is the median of the pairs' ratios.  This
            # VM's speed drifts by 20-50 % over minutes (memory-bound work
            # most), more than the margins being measured.
            repeats = PAIRED_REPEATS if use_ort else 1
            part = settings._replace(budget=settings.budget / repeats)
            runs, share_list, ort_share = [], [], None
            for _ in range(repeats):
                timings, share = h.run_cell(blocks, part)
                share_list.append(share)
                if use_ort:
                    timing, ort_share, y, _ = time_ort(onnx_path, batch, threads, part)
                    if timing is not None:
                        timings["ORT"], logits["ORT"] = timing, y
                        share_list.append(ort_share)
                runs.append(timings)
            timings = merge_runs(runs)
            paired = paired_ratios(runs, "fastconv", "ORT")
            paired_tune = paired_ratios(runs, "fastconv tune", "ORT")
            known = [s for s in share_list if s is not None]
            share = max(known) if known else None
            ort_share = share
            shares += known
            reference = "torch NCHW" if "torch NCHW" in logits else None
            for name, t in timings.items():
                latency_rows.append([batch, threads, name, f"{t.median * 1e3:.1f}",
                                     f"{t.best * 1e3:.1f}", f"{batch / t.median:.1f}",
                                     f"{t.samples}", h_percent(ort_share if name == "ORT"
                                                               else share)])
            fc = timings["fastconv"]
            ort_t, cl = timings.get("ORT"), timings.get("torch CL")
            verdict = ort_ratio = ""
            if ort_t is not None and paired:
                ort_ratio = f"{paired[0]:.2f} / {paired[1]:.2f}"
                verdict = "met" if paired[1] <= ORT_TARGET else "missed"
            tune_ratio = (f"{paired_tune[0]:.2f} / {paired_tune[1]:.2f}"
                          if ort_t is not None and paired_tune else "")
            ratio_rows.append([batch, threads, ort_ratio, verdict, tune_ratio, fmt_ratio(fc, cl),
                               fmt_ratio(fc, timings.get("torch CL jit")),
                               fmt_ratio(fc, timings.get("torch NCHW"))])
            if reference is not None:
                row = [batch, threads]
                for name in ("fastconv", "fastconv tune", "torch CL", "torch CL jit", "ORT"):
                    if name not in logits:
                        row.append("")
                        continue
                    error = h.max_relative_error(logits[name], logits[reference])
                    same_top1 = (logits[name].argmax(1) == logits[reference].argmax(1)).mean()
                    failed = error > TOLERANCE
                    ok &= not (failed and name.startswith("fastconv"))
                    row.append(f"{error:.1e}" + (" FAIL" if failed else "")
                               + ("" if same_top1 == 1 else f" (top-1 {same_top1:.0%})"))
                error_rows.append(row)
    tmp.cleanup()

    sections = [
        ("ResNet-18 inference latency, 224x224, float32",
         ["N", "thr", "system", "ms (median)", "ms (best)", "images/s", "samples", "others"],
         latency_rows,
         ["Latency of one forward pass over a batch; images/s from the median.  With ORT, "
          f"each cell is {PAIRED_REPEATS} alternating pairs (in-process systems, then ORT in "
          "its worker): median = the median of the pairs' medians, best = the fastest call.  "
          "fastconv: fastconv.nn with batchnorms folded and conv weights prepacked; fastconv "
          "tune: the same with nn.prepack(model, algorithm='tune') (each conv's algorithm "
          "timed at its first call, before the timing).  others: "
          "share of the CPUs other processes used while the cell was timed (the worst pair; "
          "above a few %, distrust it)."]),
        ("Latency ratios", ["N", "thr", "fastconv/ORT", f"target <= {ORT_TARGET:.2f}",
                            "fastconv tune/ORT", "fastconv/torch CL", "fastconv/torch CL jit",
                            "fastconv/torch NCHW"],
         ratio_rows,
         ["fastconv's latency over the other's, of best / of median: < 1 means fastconv is "
          "faster.  fastconv/ORT is the median over the pairs of each pair's ratio (the two "
          "timed seconds apart, not minutes: this VM's speed drifts); the target is judged on "
          "its median."]),
    ]
    if error_rows:
        sections.append(("Logits vs torch NCHW", ["N", "thr", "fastconv", "fastconv tune",
                                                  "torch CL", "torch CL jit", "ORT"], error_rows,
                         [f"max |logits - torch NCHW| / max |torch NCHW| (FAIL above "
                          f"{TOLERANCE:g}); top-1 agreement shown when not 100%."]))
    for section in sections:
        h.print_section(*section)
    if args.digits:
        section = digits_section(args, torch)
        if section is not None:
            h.print_section(*section)
            sections.append(section)

    return h.finish_run(started, shares, ok, "FASTCONV LOGITS ARE WRONG (FAIL)", args.markdown,
                        "fastconv ResNet-18 benchmark", preamble, sections)


def h_percent(share):
    return "" if share is None else f"{share:.0%}"


@contextlib.contextmanager
def _torch_no_grad(torch, threads):
    with h.torch_threads(threads), torch.no_grad():
        yield


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--ort-worker":
        sys.exit(ort_worker(json.loads(sys.argv[2])))
    sys.exit(main())
