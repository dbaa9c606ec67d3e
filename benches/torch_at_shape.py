"""poslab's bench encoder in PyTorch, at any shape, on the CPU or a CUDA GPU, in f32 or half precision.

`poslab bench --torch` runs this script beside poslab (it is built into the binary, so a fresh
clone or an installed poslab needs only a Python with torch). The model is the one
`poslab bench` builds (src/bench/mod.rs, `Shape::model_config`), written out in plain PyTorch:

  * token embedding (vocab x width) and the variant's positions (below);
  * `layers` pre-LayerNorm blocks: x + proj(attention(LN(x))), then x + fc2(GELU(fc1(LN(x))))
    with the exact (erf) GELU, biases on every linear layer, LayerNorm eps 1e-5, no dropout;
    attention is softmax(q k^T / sqrt(d_head) + bias) v over all positions (no mask);
  * a final LayerNorm, the mean over positions, and a linear head to 2 classes.

Variants, under `poslab bench`'s names:
  sin_add          token embedding + the fixed sinusoid table (sin on even, cos on odd columns)
  sin_concat       token embedding of width - 64, then 64 sinusoid columns
  sin_concat_proj  token embedding of width ++ 64 sinusoid columns, then Linear(width + 64 -> width)
  learned          token embedding + a learned table of `seq` rows
  rope             rotary positions on q and k in every layer, halves rotated (GPT-NeoX / LLaMA),
                   theta 10000, the whole head
  alibi            -slope_h |i - j| added to every head's scaled scores (Press et al.'s slopes)
  none             token embedding only

It is timed as `poslab bench` times poslab: a forward under inference_mode; a training step of
forward, cross-entropy, backward and AdamW (lr 1e-4, weight decay 0.01), the loss read every
step. On CUDA every timed segment ends with torch.cuda.synchronize() and the peak GPU memory is
torch.cuda.max_memory_allocated() per phase; bf16 / f16 run under torch.autocast (weights and
AdamW in f32; f16 with a GradScaler), f32 matrix multiplies stay full f32 (no TF32).

It prints one JSON line (fwd_tokens_per_s_median, train_tokens_per_s_median,
train_part_medians_ms, peak_rss_train_phase_mib, peak_gpu_train_phase_mib, the cores other
processes used while it ran, ...).

Cross-check against another PyTorch encoder of the same architecture (the lab's shared
`torch_reference.py`): `--cross-check PATH` builds that file's model at this shape, copies this
model's weights into it, and compares logits and every gradient (f32 on the CPU), then exits.

`--products` times instead the matrix products of one encoder layer's training step, one by
one, as PyTorch's autograd runs them (f32, CPU): each linear layer's output `F.linear(x, W, b)`,
input gradient `g.mm(W)` and weight gradient `g.t().mm(x)`, over batch x seq rows; the
attention's six products per (batch, head) (q k^T, P v, dout v^T, P^T dout, dS k, dS^T q) on the
model's strided views of its heads; and a square 1024^3 product. It prints {"torch": ..., "products": {"qkv.output": GFLOP/s, ...}}, the best of
--train-iters runs after --warm (`poslab bench --products --torch`).

Usage: python benches/torch_at_shape.py VARIANT [--device cuda] [--dtype bf16] [--d-model 768
       --heads 12 --layers 12 --ffn 3072 --batch 32 --seq 512] [--attn manual|sdpa]
       python benches/torch_at_shape.py --probe          (torch's version and the variants)
       python benches/torch_at_shape.py --products [--d-model ... --batch ... --seq ...]
       python benches/torch_at_shape.py rope --cross-check ../shared/bench/torch_reference.py
"""
import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import time

VARIANTS = ["sin_add", "sin_concat", "sin_concat_proj", "learned", "rope", "alibi", "none"]
POS_DIM = 64  # the concatenated sinusoid's width
CLASSES = 2
CLK = os.sysconf("SC_CLK_TCK")


# --- the model -----------------------------------------------------------------------------

def build_model(torch, variant, vocab, d_model, heads, layers, ffn, seq, attn="manual"):
    """The bench encoder (see the module's doc) as a torch.nn.Module mapping ids [B, T] to
    logits [B, 2]."""
    nn, F = torch.nn, torch.nn.functional
    d_head = d_model // heads

    def sinusoid(n, dim):
        """[n, dim]: sin(p w_i) in column 2i, cos(p w_i) in 2i + 1, w_i = 10000^(-2i / dim)."""
        pos = torch.arange(n, dtype=torch.float32).unsqueeze(1)
        w = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
        table = torch.empty(n, dim)
        table[:, 0::2] = torch.sin(pos * w)
        table[:, 1::2] = torch.cos(pos * w)
        return table

    def alibi_slopes(h):
        """Press et al.'s geometric slopes; for h not a power of two, the closest power's
        slopes then every other slope of twice it (as poslab's alibi_slopes)."""
        def power_of_two(n):
            return [2.0 ** (-8.0 * i / n) for i in range(1, n + 1)]
        if h & (h - 1) == 0:
            return power_of_two(h)
        closest = 1 << (h.bit_length() - 1)
        return power_of_two(closest) + alibi_slopes(2 * closest)[0::2][:h - closest]

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(d_model, 3 * d_model)
            self.proj = nn.Linear(d_model, d_model)

        def forward(self, x, rotary, bias):
            b, t, _ = x.shape
            q, k, v = (z.view(b, t, heads, d_head).transpose(1, 2)
                       for z in self.qkv(x).split(d_model, dim=-1))
            if rotary is not None:
                cos, sin = rotary
                q, k = (z * cos + torch.cat([-z[..., d_head // 2:], z[..., :d_head // 2]], -1) * sin
                        for z in (q, k))
            if attn == "sdpa":
                y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            else:
                scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d_head))
                if bias is not None:
                    scores = scores + bias
                y = scores.softmax(dim=-1) @ v
            return self.proj(y.transpose(1, 2).reshape(b, t, d_model))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
            self.attn = Attention()
            self.fc1, self.fc2 = nn.Linear(d_model, ffn), nn.Linear(ffn, d_model)

        def forward(self, x, rotary, bias):
            x = x + self.attn(self.ln1(x), rotary, bias)
            return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.tok = nn.Embedding(vocab, d_model - POS_DIM if variant == "sin_concat" else d_model)
            if variant == "sin_add":
                self.register_buffer("table", sinusoid(seq, d_model), persistent=False)
            elif variant in ("sin_concat", "sin_concat_proj"):
                self.register_buffer("table", sinusoid(seq, POS_DIM), persistent=False)
                if variant == "sin_concat_proj":
                    self.in_proj = nn.Linear(d_model + POS_DIM, d_model)
            elif variant == "learned":
                self.pos = nn.Embedding(seq, d_model)
            elif variant == "rope":
                w = 10000.0 ** (-torch.arange(0, d_head, 2, dtype=torch.float32) / d_head)
                angles = torch.arange(seq, dtype=torch.float32).unsqueeze(1) * w
                angles = torch.cat([angles, angles], dim=-1)  # [seq, d_head]: halves rotate
                self.register_buffer("cos", angles.cos(), persistent=False)
                self.register_buffer("sin", angles.sin(), persistent=False)
            elif variant == "alibi":
                p = torch.arange(seq, dtype=torch.float32)
                distance = (p.unsqueeze(0) - p.unsqueeze(1)).abs()
                slopes = torch.tensor(alibi_slopes(heads), dtype=torch.float32)
                self.register_buffer("bias", -slopes.view(heads, 1, 1) * distance,
                                     persistent=False)
            elif variant != "none":
                raise ValueError(f"unknown variant {variant!r}: use {', '.join(VARIANTS)}")
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(d_model)
            self.head = nn.Linear(d_model, CLASSES)

        def forward(self, ids):
            b, t = ids.shape
            x = self.tok(ids)
            if variant == "sin_add":
                x = x + self.table[:t]
            elif variant in ("sin_concat", "sin_concat_proj"):
                x = torch.cat([x, self.table[:t].expand(b, t, POS_DIM)], dim=-1)
                if variant == "sin_concat_proj":
                    x = self.in_proj(x)
            elif variant == "learned":
                x = x + self.pos.weight[:t]
            rotary = (self.cos[:t], self.sin[:t]) if variant == "rope" else None
            bias = self.bias[:, :t, :t].to(x.dtype) if variant == "alibi" else None
            for block in self.blocks:
                x = block(x, rotary, bias)
            return self.head(self.ln_f(x).mean(dim=1))

    return Encoder()


def forward_flops(variant, batch, seq, d_model, layers, ffn):
    """poslab bench's count: 2 per multiply-add of every matrix multiply (projections, FFN,
    the concat projection, the head) plus 4 L T^2 d B for the two attention products."""
    proj = (d_model + POS_DIM) * d_model if variant == "sin_concat_proj" else 0
    tokens = batch * seq
    return (2 * (layers * (4 * d_model * d_model + 2 * d_model * ffn) + proj) * tokens
            + 2 * d_model * CLASSES * batch + 4 * layers * seq * seq * d_model * batch)


# --- measuring -----------------------------------------------------------------------------

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
    """Linux 4.0 and later: writing 5 to clear_refs resets VmHWM to the current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def cpu_snapshot():
    """(time, every core's busy ticks, this process's ticks), from /proc; None where absent."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        own = int(fields[11]) + int(fields[12])  # utime + stime, every thread
        return time.perf_counter(), sum(ticks) - ticks[3] - ticks[4], own
    except (OSError, ValueError, IndexError):
        return None


def foreign_cores(a, b):
    """Cores' worth of CPU that other processes used between two snapshots."""
    if a is None or b is None or b[0] <= a[0]:
        return None
    return max((b[1] - a[1]) - (b[2] - a[2]), 0) / CLK / (b[0] - a[0])


def cross_check(torch, args, variant):
    """This model against the encoder of `args.cross_check` (a file whose module globals
    VOCAB, D, H, L, FFN, B, T, DH set its shape and whose Encoder(variant, attn) builds it),
    with the same weights: logits and every gradient, f32 on the CPU."""
    path = os.path.abspath(args.cross_check)
    if not os.path.isfile(path):
        sys.exit(f"torch_at_shape.py: --cross-check {path}: no such file")
    sys.path.insert(0, os.path.dirname(path))
    spec = importlib.util.spec_from_file_location("other_encoder", path)
    other = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(other)
    other.VOCAB, other.D, other.H, other.L, other.FFN = (args.vocab, args.d_model, args.heads,
                                                         args.layers, args.ffn)
    other.B, other.T, other.DH = args.batch, args.seq, args.d_model // args.heads
    torch.manual_seed(0)
    mine = build_model(torch, variant, args.vocab, args.d_model, args.heads, args.layers,
                       args.ffn, args.seq, args.attn)
    theirs = other.Encoder(variant, args.attn)
    # Their names differ only in the attention's two linear layers.
    rename = {".attn.qkv.": ".qkv.", ".attn.proj.": ".proj."}
    state = {}
    for name, value in mine.state_dict().items():
        for a, b in rename.items():
            name = name.replace(a, b)
        state[name] = value
    theirs.load_state_dict(state, strict=True)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    labels = torch.randint(0, CLASSES, (args.batch,))
    worst = {}
    outs = []
    for model in (mine, theirs):
        logits = model(ids)
        torch.nn.functional.cross_entropy(logits, labels).backward()
        outs.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (l1, g1), (l2, g2) = outs
    worst["logits"] = ((l1 - l2).abs().max() / l2.abs().max().clamp_min(1e-30)).item()
    for name, grad in g1.items():
        for a, b in rename.items():
            name = name.replace(a, b)
        ref = g2[name]
        worst[name] = ((grad - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    name, err = max(worst.items(), key=lambda kv: kv[1])
    ok = err <= 1e-4
    print(json.dumps(dict(cross_check=path, variant=variant, params=len(g1), ok=ok,
                          largest_relative_difference=err, at=name)))
    if not ok:
        sys.exit(f"torch_at_shape.py: {variant} differs from {path} at {name}: {err:.3e} of "
                 "the largest value (allowed 1e-4)")


def time_products(torch, args):
    """Each matrix product of an encoder layer's training step, timed alone: GFLOP/s by name."""
    F = torch.nn.functional
    rows, d, f = args.batch * args.seq, args.d_model, args.ffn

    def rate(flop, fn):
        for _ in range(args.warm):
            fn()
        best = math.inf
        for _ in range(max(args.train_iters, 1)):
            t = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t)
        return flop / best / 1e9

    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    rates = {}
    with torch.no_grad():
        a, b = randn(1024, 1024), randn(1024, 1024)
        rates["square"] = rate(2 * 1024 ** 3, lambda: a.mm(b))
        for layer, inp, out in [("qkv", d, 3 * d), ("attn_out", d, d), ("ffn_up", d, f),
                                ("ffn_down", f, d)]:
            x, w, bias, g = randn(rows, inp), randn(out, inp), randn(out), randn(rows, out)
            flop = 2 * rows * inp * out
            rates[f"{layer}.output"] = rate(flop, lambda: F.linear(x, w, bias))
            rates[f"{layer}.input_gradient"] = rate(flop, lambda: g.mm(w))
            rates[f"{layer}.weight_gradient"] = rate(flop, lambda: g.t().mm(x))
        # The attention's products per (batch, head), on the views the model takes of the
        # packed projections and of the heads' joined output, as autograd multiplies them.
        b, t, h = args.batch, args.seq, args.heads
        dh = d // h
        qkv, dout = randn(b, t, 3 * d), randn(b, t, d).view(b, t, h, dh).transpose(1, 2)
        q, k, v = (z.view(b, t, h, dh).transpose(1, 2) for z in qkv.split(d, dim=-1))
        p = randn(b, h, t, t)
        flop = 2 * b * h * t * t * dh
        for name, fn in [("scores", lambda: q @ k.transpose(-2, -1)),
                         ("outputs", lambda: p @ v),
                         ("probs_gradient", lambda: dout @ v.transpose(-2, -1)),
                         ("values_gradient", lambda: p.transpose(-2, -1) @ dout),
                         ("queries_gradient", lambda: p @ k),
                         ("keys_gradient", lambda: p.transpose(-2, -1) @ q)]:
            rates[f"attention.{name}"] = rate(flop, fn)
    return rates


def main():
    ap = argparse.ArgumentParser(description="poslab's bench encoder in PyTorch, timed.")
    ap.add_argument("variant", nargs="?", help=", ".join(VARIANTS))
    ap.add_argument("--probe", action="store_true",
                    help="print torch's version and the variants as JSON, then exit")
    ap.add_argument("--products", action="store_true",
                    help="time the step's matrix products one by one (f32, CPU), then exit")
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
    ap.add_argument("--cross-check", metavar="PATH",
                    help="compare this model with another file's encoder, then exit")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    try:
        import torch
    except ImportError as e:
        sys.exit(f"torch_at_shape.py: {sys.executable} cannot import torch ({e}): install it "
                 "(pip install torch) or run a Python that has it")
    if args.probe:
        print(json.dumps(dict(torch=torch.__version__, variants=VARIANTS)))
        return
    if args.products:
        for name in ("batch", "seq", "d_model", "ffn", "heads"):
            if getattr(args, name) < 1:
                sys.exit(f"torch_at_shape.py: --{name.replace('_', '-')} must be at least 1")
        if args.d_model % args.heads:
            sys.exit(f"torch_at_shape.py: width {args.d_model} must split into {args.heads} heads")
        torch.set_num_threads(args.threads)
        print(json.dumps(dict(torch=torch.__version__, products=time_products(torch, args))))
        return
    if args.variant not in VARIANTS:
        sys.exit(f"torch_at_shape.py: unknown variant {args.variant!r}: use {', '.join(VARIANTS)}")
    sizes = dict(vocab=args.vocab, d_model=args.d_model, heads=args.heads, layers=args.layers,
                 ffn=args.ffn, batch=args.batch, seq=args.seq)
    for name, value in sizes.items():
        if value < 1:
            sys.exit(f"torch_at_shape.py: --{name.replace('_', '-')} must be at least 1")
    if args.d_model % args.heads or (args.d_model // args.heads) % 2:
        sys.exit(f"torch_at_shape.py: width {args.d_model} must split into {args.heads} heads "
                 "of an even width")
    if args.variant == "sin_concat" and args.d_model <= POS_DIM:
        sys.exit(f"torch_at_shape.py: sin_concat needs a width above {POS_DIM}")
    if args.cross_check:
        cross_check(torch, args, args.variant)
        return

    F = torch.nn.functional
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
    model = build_model(torch, args.variant, args.vocab, args.d_model, args.heads, args.layers,
                        args.ffn, args.seq, args.attn).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
    labels = torch.randint(0, CLASSES, (args.batch,), device=device)
    tokens = args.batch * args.seq

    def timed(fn, warm, iters):
        for _ in range(warm):
            fn()
        sync()
        times = []
        a = cpu_snapshot()
        for _ in range(iters):
            t = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t)
        return times, foreign_cores(a, cpu_snapshot())

    # (a) inference forward
    model.eval()
    reset_peak_rss()
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)

    def fwd():
        with torch.inference_mode(), autocast():
            return model(ids)

    # --fwd-iters 0 skips the forward phase (a profiler then sees one training step alone).
    ft, f_foreign = timed(fwd, args.warm, args.fwd_iters) if args.fwd_iters > 0 else ([], None)
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
    if not all(math.isfinite(x) for x in losses):
        sys.exit(f"torch_at_shape.py: the loss was not finite: {losses}")

    flops_fwd = forward_flops(args.variant, args.batch, args.seq, args.d_model, args.layers,
                              args.ffn)
    median = statistics.median
    res = dict(
        framework="pytorch", torch=torch.__version__, model="poslab bench encoder",
        variant=args.variant, attn=args.attn, device=str(device),
        gpu=torch.cuda.get_device_name(device) if cuda else None, dtype=args.dtype, tf32=False,
        threads=torch.get_num_threads(), shape=sizes, n_params=n_params, flops_fwd=flops_fwd,
        flops_train_approx=3 * flops_fwd,
        fwd_s=dict(min=min(ft), median=median(ft), max=max(ft), n=len(ft)) if ft else None,
        fwd_tokens_per_s_median=tokens / median(ft) if ft else None,
        fwd_tokens_per_s_best=tokens / min(ft) if ft else None,
        train_ms=dict(min=min(tt) * 1e3, median=median(tt) * 1e3, max=max(tt) * 1e3, n=len(tt)),
        train_tokens_per_s_median=tokens / median(tt), train_tokens_per_s_best=tokens / min(tt),
        train_part_medians_ms=dict(fwd=median(p[0] for p in timed_parts) * 1e3,
                                   bwd=median(p[1] for p in timed_parts) * 1e3,
                                   opt=median(p[2] for p in timed_parts) * 1e3),
        loss_first=losses[0], loss_last=losses[-1],
        fwd_foreign_cores=f_foreign, train_foreign_cores=t_foreign,
        peak_rss_fwd_phase_mib=peak_rss_fwd, peak_rss_train_phase_mib=proc_mib("VmHWM"),
        peak_gpu_fwd_phase_mib=peak_gpu_fwd, peak_gpu_train_phase_mib=peak_gpu_train,
    )
    line = json.dumps(res)
    print(line)
    if args.out:
        with open(args.out, "a") as out:
            out.write(line + "\n")


if __name__ == "__main__":
    main()
