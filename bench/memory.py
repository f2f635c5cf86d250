"""Peak memory of one PPO update, for every memory option and the smollm2 / gpt2 / qwen architectures.

Each (architecture, option) runs in a fresh process: the model is built randomly initialised from
its known configuration (memory does not depend on the weight values; the real weights need a hub
this machine cannot reach), then one PPO update at the blog post's batch shape (2 sequences per forward)
runs through textrl's own policy, loss and optimizer code: forward, backward, grad-norm clip,
optimizer step. On a CPU the figure is the process's peak RSS (so it includes Python, torch and
transformers, ~0.6 GB, but not the transient peak of building the model: freed memory is returned
to the OS first and the RSS is sampled every millisecond during the update); with a GPU, peak
allocated CUDA memory. All blocks are trained (model.trainable_layers=null), as in the blog post.

``qlora`` quantises a pretrained model as it loads (textrl refuses ``memory=qlora`` with
``model.source=random``: a model built from its config takes no 4-bit quantisation), so for it the
randomly initialised model is first saved to a temporary directory and loaded from there
(``model.source=hub model.path=DIR``): real NF4 weights, on a GPU or, with bitsandbytes >= 0.50,
on a CPU.

    python bench/memory.py                       # all architectures and options
    python bench/memory.py --archs smollm2 --options none lora
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import tempfile

from result import write_result  # bench/result.py (the script directory is on sys.path)

ARCHS = ["smollm2", "gpt2", "qwen"]
OPTIONS = ["none", "adam8bit", "bf16", "grad_ckpt", "lora", "lowmem", "fp16", "qlora"]


class RSSPeak:
    """Highest resident set size seen while the block runs (sampled from /proc every 1 ms)."""

    def __enter__(self):
        import threading

        self.peak, self._stop = self.current(), threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    @staticmethod
    def current() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    def _poll(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self.current())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.current())


def measure(arch: str, option: str, seq_len: int, batch: int) -> dict:
    import ctypes
    import gc

    import torch

    from textrl.config import TrainConfig, load_memory_config, load_model_config, resolve, validate
    from textrl.policy.memory import make_optimizer
    from textrl.policy.model import build_policy

    cuda = torch.cuda.is_available()
    cfg = TrainConfig(output_dir="unused")
    # randomly initialised: a model whose own weights hold its tokenizer (smollm2's GGUF) names itself
    cfg.model = load_model_config(arch, source="random", trainable_layers=None,
                                  tokenizer_from=load_model_config(arch).tokenizer_from or arch)
    cfg.memory = load_memory_config(option)
    if not cuda and cfg.memory.precision == "16-mixed" and option == "lowmem":
        cfg.memory.precision = "bf16-mixed"  # the blog post's combination without fp16, as on any CPU
    folder = tempfile.TemporaryDirectory(prefix=f"memory-{arch}-")  # removed when this function returns
    if cfg.memory.quantize_4bit:  # a pretrained model from disk (module docstring), never a fake qlora
        cfg.model = saved_model(cfg.model, folder.name)
    try:
        cfg = resolve(validate(cfg))
    except ValueError as exc:
        return {"skipped": str(exc)}
    device = torch.device("cuda" if cuda else "cpu")
    policy, _ = build_policy(cfg.model, memory=cfg.memory, device=device)
    policy.to(device).train()
    optimizer = make_optimizer([p for p in policy.lm.parameters() if p.requires_grad],
                               list(policy.value_head.parameters()), cfg.memory, 1e-5, 1e-4, 0.0)
    dtype = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(cfg.memory.precision)
    scaler = torch.amp.GradScaler("cuda") if dtype == torch.float16 else None
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # give the model-building temporaries back to the OS
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    before = RSSPeak.current()
    with RSSPeak() as rss:
        update(policy, optimizer, dtype, scaler, device, seq_len, batch)
    if cuda:
        peak = torch.cuda.max_memory_allocated() / 2**30
    else:
        peak = rss.peak / 2**30
    params = sum(p.numel() for p in policy.parameters())
    trainable = sum(p.numel() for p in policy.parameters() if p.requires_grad)
    return {"peak_gb": round(peak, 3), "rss_before_update_gb": round(before / 2**30, 3),
            "params_m": round(params / 1e6, 1), "trainable_m": round(trainable / 1e6, 2),
            "precision": cfg.memory.precision}


def saved_model(model_cfg, folder: str):
    """The randomly initialised model of ``model_cfg`` (and its tokenizer) saved to ``folder``, as a
    model config that loads it from there like a pretrained model (``source=hub``, ``path``)."""
    from dataclasses import replace

    from textrl.policy.model import build_policy

    policy, tokenizer = build_policy(model_cfg)
    policy.lm.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return replace(model_cfg, source="hub", path=folder, hub_id=None, gguf_package=None, gguf_file=None,
                   architecture={})


def update(policy, optimizer, dtype, scaler, device, seq_len, batch):
    """One PPO update: forward of ``batch`` sequences, PPO loss at 8 decisions each, backward, clip, step."""
    import torch

    from textrl.ppo.losses import DecisionBatch, LossCoefs, ppo_loss

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 49152, (batch, seq_len), generator=g).to(device)
    decisions = 8
    rows = torch.arange(batch).repeat_interleave(decisions).to(device)
    cols = torch.arange(seq_len - decisions, seq_len).repeat(batch).to(device)
    with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        hidden, _ = policy.hidden(ids, torch.ones_like(ids), torch.arange(seq_len, device=device)[None].expand_as(ids))
        h = hidden[rows, cols]
        n = len(rows)
        logits = policy.logits_of(h, torch.arange(6, device=device).expand(n, -1))  # a 6-way fork, as the update
        valid = torch.ones_like(logits, dtype=torch.bool)
        batch = DecisionBatch(logits, valid, torch.zeros(n, dtype=torch.long, device=device), torch.ones(n, device=device),
                              torch.full((n,), -1.8, device=device), torch.randn(n, generator=g).to(device),
                              policy.value(h), torch.zeros(n, device=device))
        terms = ppo_loss(batch, LossCoefs(clip=0.2, vf_coef=0.05, ent_coef=0.01, kl_coef=0.0, explore=0.0), normalizer=n)
    loss = terms.loss
    (scaler.scale(loss) if scaler else loss).backward()
    if scaler:
        scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], 1.0)
    if scaler:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--archs", nargs="*", default=ARCHS)
    ap.add_argument("--options", nargs="*", default=OPTIONS)
    ap.add_argument("--seq-len", type=int, default=384, help="tokens per sequence (prompt + command)")
    ap.add_argument("--batch", type=int, default=2, help="sequences per forward (the blog post: 2, x32 accumulation)")
    ap.add_argument("--out", default="bench/results/memory.json")
    ap.add_argument("--worker", nargs=2, metavar=("ARCH", "OPTION"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(measure(*args.worker, args.seq_len, args.batch)))
        return

    import torch

    results = {}
    for arch in args.archs:
        for option in args.options:
            cmd = [sys.executable, __file__, "--worker", arch, option, "--seq-len", str(args.seq_len),
                   "--batch", str(args.batch)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            line = [l for l in out.stdout.splitlines() if l.startswith("RESULT ")]
            results.setdefault(arch, {})[option] = json.loads(line[0][7:]) if line else \
                {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
            print(arch, option, results[arch][option], flush=True)
    report = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({platform.machine()})",
        "measure": "peak allocated CUDA memory" if torch.cuda.is_available() else "peak process RSS",
        "seq_len": args.seq_len, "batch": args.batch, "results": results,
    }
    write_result(args.out, report, argv)


if __name__ == "__main__":
    main()
