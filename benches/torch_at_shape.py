"""The PyTorch reference encoder at any shape, on the CPU or a CUDA GPU, in f32 or half precision.

`shared/bench/torch_reference.py` measures its encoder on the CPU at one fixed shape (width 256,
4 heads, 4 layers, FFN 1024, batch 32 x 128, f32). This script imports that file's model
unchanged (`Encoder`, `Block`, the sinusoid and RoPE tables), sets the shape, and times it the
same way (forward under inference_mode; a training step of forward, cross-entropy, backward and
AdamW(lr 1e-4, weight decay 0.01)) wherever it is asked to run, so `poslab bench --torch
benches/torch_at_shape.py` compares like with like at any shape and on any device:

  * on CUDA every timed segment ends with torch.cuda.synchronize(), and the peak GPU memory is
    torch.cuda.max_memory_allocated() per phase (weights included);
  * bf16 / f16 run under torch.autocast (weights and AdamW stay f32; matrix multiplies in the half
    type, softmax and LayerNorm in f32), which is poslab's mixed precision; f16 trains with a
    GradScaler, as poslab trains f16 with a dynamic loss scale;
  * f32 matrix multiplies stay full f32 (no TF32), as candle's cuBLAS calls are.

It prints one JSON line with the reference's field names (fwd_tokens_per_s_median,
train_tokens_per_s_median, train_part_medians_ms, peak_rss_train_phase_mib) plus
peak_gpu_fwd_phase_mib, peak_gpu_train_phase_mib, the GPU's name and the shape.

The reference is found at --reference, else $POSLAB_TORCH_REFERENCE, else
../shared/bench/torch_reference.py from the repository root.

Usage: python benches/torch_at_shape.py VARIANT [--device cuda] [--dtype bf16] [--d-model 768
       --heads 12 --layers 12 --ffn 3072 --batch 32 --seq 512] [--attn manual|sdpa]
"""
import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def load_reference(path):
    path = os.path.abspath(path)
    if not os.path.isfile(path):
        sys.exit(f"torch_at_shape.py: no reference at {path}: pass --reference "
                 "PATH/torch_reference.py or set POSLAB_TORCH_REFERENCE")
    sys.path.insert(0, os.path.dirname(path))  # its cpumon.py
    spec = importlib.util.spec_from_file_location("torch_reference", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def proc_mib(field):
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def reset_peak_rss():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("variant")
    ap.add_argument("--attn", default="manual", choices=["manual", "sdpa"])
    ap.add_argument("--fwd-iters", type=int, default=20)
    ap.add_argument("--train-iters", type=int, default=12)
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="f32", choices=["f32", "bf16", "f16"])
    ap.add_argument("--reference", default=os.environ.get(
        "POSLAB_TORCH_REFERENCE",
        os.path.join(HERE, "..", "..", "shared", "bench", "torch_reference.py")))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.d_model % args.heads or (args.d_model // args.heads) % 2:
        sys.exit(f"torch_at_shape.py: width {args.d_model} must split into {args.heads} heads "
                 "of an even width")

    ref = load_reference(args.reference)
    torch, F = ref.torch, ref.F
    # The reference's model reads these module globals when it is built and run.
    ref.VOCAB, ref.D, ref.H, ref.L, ref.FFN = (args.vocab, args.d_model, args.heads, args.layers,
                                               args.ffn)
    ref.B, ref.T, ref.DH = args.batch, args.seq, args.d_model // args.heads
    if args.variant == "sin_concat" and args.d_model <= ref.DPOS:
        sys.exit(f"torch_at_shape.py: sin_concat needs a width above {ref.DPOS}")

    device = torch.device("cuda" if args.device.startswith("gpu") else args.device)
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        sys.exit("torch_at_shape.py: --device cuda, but torch sees no CUDA GPU")
    torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    half = {"f32": None, "bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]

    def sync():
        if cuda:
            torch.cuda.synchronize(device)

    def autocast():
        return torch.autocast(device_type=device.type, dtype=half, enabled=half is not None)

    torch.manual_seed(0)
    model = ref.Encoder(args.variant, args.attn).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    labels = torch.randint(0, ref.NCLS, (args.batch,), device=device)
    tokens = args.batch * args.seq

    def timed(fn, warm, iters):
        for _ in range(warm):
            fn()
        sync()
        times = []
        a = ref.cpumon.snap()
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t)
        return times, ref.cpumon.foreign_cores(a, ref.cpumon.snap())

    # (a) inference forward
    model.eval()
    reset_peak_rss()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)

    def fwd():
        with torch.inference_mode(), autocast():
            return model(ids)

    ft, f_foreign = timed(fwd, args.warm, args.fwd_iters)
    peak_gpu_fwd = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None
    peak_rss_fwd = proc_mib("VmHWM")

    # (b) training step: forward + loss, backward, AdamW
    model.train()
    reset_peak_rss()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    scaler = torch.amp.GradScaler(device.type, enabled=args.dtype == "f16")
    losses, parts = [], []

    def step():
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = F.cross_entropy(model(ids).float(), labels)
        losses.append(loss.item())  # reads the loss, as poslab does every step
        t1 = time.perf_counter()
        scaler.scale(loss).backward()
        sync()
        t2 = time.perf_counter()
        scaler.step(opt)
        scaler.update()
        sync()
        t3 = time.perf_counter()
        parts.append((t1 - t0, t2 - t1, t3 - t2))

    tt, t_foreign = timed(step, args.warm, args.train_iters)
    peak_gpu_train = torch.cuda.max_memory_allocated(device) / 2**20 if cuda else None
    timed_parts = parts[args.warm:]

    d, f, t, layers = args.d_model, args.ffn, args.seq, args.layers
    proj = (d + ref.DPOS) * d if args.variant == "sin_concat_proj" else 0
    flops_fwd = (2 * (layers * (4 * d * d + 2 * d * f) + proj) * tokens
                 + 4 * layers * t * t * d * args.batch)
    res = dict(
        framework="pytorch", torch=torch.__version__, variant=args.variant, attn=args.attn,
        device=str(device), gpu=torch.cuda.get_device_name(device) if cuda else None,
        dtype=args.dtype, tf32=False, threads=torch.get_num_threads(),
        shape=dict(vocab=args.vocab, d_model=d, heads=args.heads, layers=layers, ffn=f,
                   batch=args.batch, seq=t),
        n_params=n_params, flops_fwd=flops_fwd, flops_train_approx=3 * flops_fwd,
        fwd_s=dict(min=min(ft), median=statistics.median(ft), max=max(ft), n=len(ft)),
        fwd_tokens_per_s_median=tokens / statistics.median(ft),
        fwd_tokens_per_s_best=tokens / min(ft),
        train_ms=dict(min=min(tt) * 1e3, median=statistics.median(tt) * 1e3, max=max(tt) * 1e3,
                      n=len(tt)),
        train_tokens_per_s_median=tokens / statistics.median(tt),
        train_tokens_per_s_best=tokens / min(tt),
        train_part_medians_ms=dict(fwd=statistics.median(p[0] for p in timed_parts) * 1e3,
                                   bwd=statistics.median(p[1] for p in timed_parts) * 1e3,
                                   opt=statistics.median(p[2] for p in timed_parts) * 1e3),
        loss_first=losses[0], loss_last=losses[-1],
        fwd_foreign_cores=f_foreign, train_foreign_cores=t_foreign,
        peak_rss_fwd_phase_mib=peak_rss_fwd, peak_rss_train_phase_mib=proc_mib("VmHWM"),
        peak_gpu_fwd_phase_mib=peak_gpu_fwd, peak_gpu_train_phase_mib=peak_gpu_train,
    )
    if not all(math.isfinite(x) for x in losses):
        sys.exit(f"torch_at_shape.py: the loss was not finite: {losses}")
    line = json.dumps(res)
    print(line)
    if args.out:
        with open(args.out, "a") as out:
            out.write(line + "\n")


if __name__ == "__main__":
    main()
