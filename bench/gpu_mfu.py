"""MFU of a bf16 transformer training step on one GPU, two ways, against the peak table.

    python3 bench/gpu_mfu.py [--layers 8 --d-model 2048 --heads 16 --seq 2048 --batch 8]

1. formula (TorchTitan): flops/token = 6·N + 6·layers·heads·head_dim·seq,
   N = parameters without the token embedding;
2. FLOP counter: ``torch.utils.flop_counter.FlopCounterMode`` over one real step, and the same
   count through trainguard's worker path (``tg.step(flops="auto")``).
MFU = flops per step / median step time / peak; the peak comes from trainguard's table for the
device name (H200 → 989e12). Needs torch with CUDA; does not need opentelemetry.
Prints one JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from trainguard.telemetry.mfu import (  # noqa: E402
    count_flops,
    mfu,
    peak_flops,
    transformer_flops_per_token,
)


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class Model(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny run on CPU (checks the script)")
    args = p.parse_args()
    cuda = torch.cuda.is_available() and not args.cpu_smoke
    if not cuda and not args.cpu_smoke:
        print(json.dumps({"error": "no CUDA device (use --cpu-smoke to check the script)"}))
        sys.exit(1)
    torch.manual_seed(0)
    dev = torch.device("cuda" if cuda else "cpu")

    def sync() -> None:
        if cuda:
            sync()

    name = torch.cuda.get_device_name() if cuda else "cpu"
    model = Model(args.vocab, args.d_model, args.layers, args.heads).to(dev, torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev)
    tgt = torch.randint(0, args.vocab, (args.batch, args.seq), device=dev)

    def step() -> torch.Tensor:
        logits = model(idx)
        loss = F.cross_entropy(logits.view(-1, args.vocab).float(), tgt.view(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(3):
        step()
    sync()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)

    _, counted = count_flops(step)
    sync()

    # the same count through trainguard's worker path (plain python: no agent, no port)
    for k in list(os.environ):
        if k.startswith(("TRAINGUARD_", "TORCHELASTIC_")):
            del os.environ[k]
    from trainguard.worker.api import TrainGuard

    with tempfile.TemporaryDirectory() as d:
        tg = TrainGuard(run_dir=d)
        for _ in range(2):
            with tg.step(tokens=args.batch * args.seq, flops="auto"):
                step()
                sync()
        tg.close()
        recs = [json.loads(x) for x in open(os.path.join(d, "metrics", "rank_0.jsonl"))]
    steps = [r for r in recs if r["kind"] == "step"]
    tg_flops = steps[-1]["flops"]

    tokens = args.batch * args.seq
    n_params = sum(p.numel() for p in model.parameters()) - model.emb.weight.numel()
    head_dim = args.d_model // args.heads
    per_token = transformer_flops_per_token(
        num_params=n_params,
        num_layers=args.layers,
        num_heads=args.heads,
        head_dim=head_dim,
        seq_len=args.seq,
    )
    formula = per_token * tokens
    peak = peak_flops(name)
    out = {
        "device": name,
        "peak_flops": peak,
        "peak_source": "trainguard table (dense BF16)" if peak else "unknown device",
        "params_non_embedding": n_params,
        "tokens_per_step": tokens,
        "step_s_median": round(step_s, 5),
        "tokens_per_s": round(tokens / step_s, 1),
        "flops_per_step_formula": formula,
        "flops_per_step_counter": counted,
        "flops_per_step_trainguard_auto": tg_flops,
        "achieved_tflops_formula": round(formula / step_s / 1e12, 2),
        "achieved_tflops_counter": round(counted / step_s / 1e12, 2),
        "mfu_formula": round(mfu(formula, step_s, peak), 4) if peak else None,
        "mfu_counter": round(mfu(counted, step_s, peak), 4) if peak else None,
        "mfu_vs_989e12_formula": round(mfu(formula, step_s, 989e12), 4),
        "mfu_vs_989e12_counter": round(mfu(counted, step_s, 989e12), 4),
        "gpu_memory_peak_bytes": steps[-1].get("gpu_memory_peak_bytes"),
        "config": vars(args),
        "torch": torch.__version__,
        "opentelemetry_imported": "opentelemetry" in sys.modules,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
