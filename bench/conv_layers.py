"""Per-layer CPU time of the runtime's convolutions of MobileNetV2 and ResNet-18 (bench/models.py), one
thread, each distinct conv shape called through the runtime table (`_testing.conv`, weight packed once,
ReLU6 epilogue or --sum a residual, channels-last in and out except the NCHW-input stem, or
--nchw-out NCHW outputs), A/B between two builds.

    # one process, prints a JSON line {layer: best us of ROUNDS}:
    PYTHONPATH=$PWD python bench/conv_layers.py [--match STEM] [--batch 1]
    # alternating processes between two package roots (each holding a blade/ with its _C .so):
    PYTHONPATH=$PWD python bench/conv_layers.py --ab /path/to/base $PWD --processes 6

CPU time (time.process_time) of the process, so other load on the machine costs little; the A/B
reports per layer the median over processes of each side's in-process best, and B/A. With
--threads N (N > 1) each layer's time is the wall time of a call at N threads instead (CPU time
would add the threads' times up): how the runtime splits a layer between threads, which needs a
quiet machine.

    PYTHONPATH=$PWD python bench/conv_layers.py --threads 2 --batch 8
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch


def tf_pads(height, width, conv):
    """HF MobileNetV2's TF "SAME" padding (top, left, bottom, right), which blade folds into the conv."""
    pads = []
    for size, stride, kernel, dilation in zip((height, width), conv.stride, conv.kernel_size, conv.dilation):
        along = max(kernel - (stride if size % stride == 0 else size % stride), 0)
        pads.append((along // 2 * dilation, (along - along // 2) * dilation))
    return [pads[0][0], pads[1][0], pads[0][1], pads[1][1]]


def conv_layers(batch):
    """Distinct (name, x shape, weight shape, stride, pads, dilation, groups, layout) of both models."""
    from bench import models
    import transformers.models.mobilenet_v2.modeling_mobilenet_v2 as hf_mnv2
    layers = {}
    for model_name, (model, inputs) in (("mnv2", models.mobilenet_v2(batch)),
                                        ("r18", (models.resnet18()[0], (torch.randn(batch, 3, 224, 224),)))):
        unpadded = {}
        hooks = []
        for module in model.modules():
            if isinstance(module, hf_mnv2.MobileNetV2ConvLayer) and module.config.tf_padding:
                hooks.append(module.register_forward_pre_hook(
                    lambda m, args: unpadded.__setitem__(id(m.convolution), args[0].shape)))
        first = []

        def record(conv, args, model_name=model_name):
            x_shape = tuple(args[0].shape)
            if id(conv) in unpadded:
                x_shape = tuple(unpadded[id(conv)])
                pads = tf_pads(x_shape[2], x_shape[3], conv)
            else:
                pads = [conv.padding[0], conv.padding[1]] * 2
            layout = 2 if not first else 3  # the model's image arrives NCHW
            first.append(1)
            w = tuple(conv.weight.shape)
            kind = "dw" if conv.groups > 1 else f"{w[2]}x{w[3]}"
            name = (f"{model_name} {kind}/{conv.stride[0]} {x_shape[1]}->{w[0]} @{x_shape[2]}x{x_shape[3]}"
                    + (" p" + "".join(map(str, pads)) if any(pads) else ""))
            layers.setdefault(name, (x_shape, w, list(conv.stride), pads, list(conv.dilation), conv.groups, layout))

        for module in model.modules():
            if isinstance(module, torch.nn.Conv2d):
                hooks.append(module.register_forward_pre_hook(record))
        with torch.no_grad():
            model(*inputs)
        for hook in hooks:
            hook.remove()
    return layers


def measure(match, batch, rounds, budget, with_sum, nchw_out, threads=1):
    from blade import _C
    T = _C._testing
    torch.set_num_threads(threads)
    clock = time.process_time if threads == 1 else time.perf_counter
    torch.manual_seed(0)
    results = {}
    for name, (x_shape, w_shape, stride, pads, dilation, groups, layout) in conv_layers(batch).items():
        if match and match not in name:
            continue
        x = torch.randn(x_shape)
        if layout & 1:
            x = x.contiguous(memory_format=torch.channels_last)
        w = torch.randn(w_shape) / (w_shape[1] * w_shape[2] * w_shape[3]) ** 0.5
        b = torch.randn(w_shape[0])
        expected = torch.conv2d(torch.nn.functional.pad(x, [pads[1], pads[3], pads[0], pads[2]]), w, b, stride,
                                dilation=dilation, groups=groups)
        if nchw_out:
            if groups > 1 or not layout & 1:
                continue  # the runtime's depthwise kernel and an NCHW-to-NCHW conv are channels-last only
            layout &= 1
        out = torch.empty(expected.shape).contiguous(
            memory_format=torch.contiguous_format if nchw_out else torch.channels_last)
        residual = torch.randn(out.shape).contiguous(memory_format=torch.channels_last) if with_sum else None
        if residual is not None and nchw_out:
            residual = residual.contiguous()
        activation = 0 if with_sum else 2  # ReLU6 after the expansions, a residual sum after projections

        def call(repeat):
            T.conv(x, w, b, stride, pads, dilation, groups, out, layout, True, residual, activation, 0.0, 6.0, repeat)

        call(1)
        start = clock()
        call(3)
        repeat = max(1, int(budget / max((clock() - start) / 3, 1e-6)))
        best = min(timed(call, repeat, clock) for _ in range(rounds))
        results[name] = round(best * 1e6, 2)
    return results


def timed(call, repeat, clock):
    start = clock()
    call(repeat)
    return (clock() - start) / repeat


def ab(roots, processes, argv):
    sides = [[] for _ in roots]
    for p in range(processes):
        for i, root in enumerate(roots if p % 2 == 0 else roots[::-1]):
            side = i if p % 2 == 0 else len(roots) - 1 - i
            env = dict(os.environ, PYTHONPATH=f"{root}:{os.getcwd()}")
            out = subprocess.run([sys.executable, __file__, *argv], env=env, check=True, capture_output=True,
                                 text=True).stdout
            sides[side].append(json.loads(out.strip().splitlines()[-1]))
    print(f"{'layer':44s} {'A us':>9s} {'B us':>9s}  B/A")
    for name in sides[0][0]:
        a = statistics.median(r[name] for r in sides[0])
        b = statistics.median(r[name] for r in sides[1])
        print(f"{name:44s} {a:9.1f} {b:9.1f}  {b / a:.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--match", default="", help="only layers whose name contains this")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--budget", type=float, default=0.02, help="CPU seconds a round")
    parser.add_argument("--sum", action="store_true", help="a residual sum instead of ReLU6")
    parser.add_argument("--nchw-out", action="store_true", help="NCHW outputs (a model's last conv)")
    parser.add_argument("--threads", type=int, default=1, help="above 1: wall time of a call at this many threads")
    parser.add_argument("--ab", nargs=2, metavar=("ROOT_A", "ROOT_B"))
    parser.add_argument("--processes", type=int, default=4, help="per side, alternating")
    args = parser.parse_args()
    if args.ab:
        flags = ["--sum"] * args.sum + ["--nchw-out"] * args.nchw_out
        ab(args.ab, args.processes, ["--match", args.match, "--batch", str(args.batch), "--rounds", str(args.rounds),
                                     "--budget", str(args.budget), "--threads", str(args.threads), *flags])
    else:
        print(json.dumps(measure(args.match, args.batch, args.rounds, args.budget, args.sum, args.nchw_out,
                                 args.threads)))


if __name__ == "__main__":
    main()
