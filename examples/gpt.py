"""A byte-level GPT trained end to end with pipeq on the Python standard library's own source.

    python examples/gpt.py                     # 4 stages, 1F1B, one process per stage
    python examples/gpt.py --stages 1          # the plain model in this process: the baseline
    python examples/gpt.py --stages 2 --schedule fill-drain --steps 100
    python examples/gpt.py --quick             # a few steps of a tiny model (the smoke test)
    python examples/gpt.py --fixed-length      # every batch of full-context windows
    pipeq launch examples/gpt.toml             # the same training as a job file

The model is a decoder-only transformer built from torch's own pieces (causal
``scaled_dot_product_attention``, learned positions, a final LayerNorm, an LM head tied to the
token embedding); ``pipeq.split`` traces it with ``torch.export`` and cuts it into stages. The data
are the standard library's ``.py`` files (every machine has them, offline): whole files held out
for evaluation, bytes as tokens (vocabulary 256). Each batch's windows have a length of their own,
drawn between half the context and the whole of it, as a language model's batches do (packing,
bucketing, the end of a document): the split's stages take any length, with no new trace and no
restart (``--fixed-length``: always the whole context). The run prints the unigram baseline (the
held-out cross-entropy of the training bytes' frequencies), trains with a progress bar showing
tokens/s, evaluates the held-out loss in nats and bits per byte, saves the model's state as
``model.pt`` under the model's own names, loads it into a plain ``GPT`` (no pipeq) and samples text.
"""

from __future__ import annotations

import argparse
import collections
import functools
import math
import os
import sysconfig
import time
import zlib
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterator

if __name__ == "__main__":  # said at once: importing torch takes a second or two
    print(f"pipeq example: {__doc__.splitlines()[0]}", flush=True)

import torch
import torch.nn.functional as F
from torch import nn

import pipeq

VOCAB = 256  # bytes


# -- the model ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class GPTConfig:
    """The model's size: ``context`` bytes of attention, ``n_layers`` blocks of ``d_model`` features."""

    context: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    vocab: int = VOCAB


#: ``--quick``: a model small enough for a smoke test's few steps.
QUICK = GPTConfig(context=32, d_model=32, n_layers=2, n_heads=2)


class Attention(nn.Module):
    """Causal multi-head self-attention on ``scaled_dot_product_attention``."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2)
                   for t in self.qkv(x).split(C, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    """A pre-norm transformer block: attention, then a 4x GELU MLP, each added back."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.ln1(h))
        return h + self.mlp(self.ln2(h))


class GPT(nn.Module):
    """Bytes in, next-byte logits out: ``(B, T)`` integers -> ``(B, T, vocab)``.

    ``forward`` traces with ``torch.export`` (no data-dependent control flow) and also runs as a
    stage of a split by module names, which removes the modules other stages hold: a missing
    ``tok_emb`` means ``idx`` is already the hidden state, a missing ``norm`` / ``lm_head`` is
    skipped, and the blocks are whichever ``blocks`` still holds."""

    def __init__(self, config: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab, config.d_model)
        self.pos_emb = nn.Embedding(config.context, config.d_model)
        self.blocks = nn.ModuleList(Block(config.d_model, config.n_heads) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab, bias=False)
        self.apply(self._init)
        self.lm_head.weight = self.tok_emb.weight  # tied: one tensor, two names

    @staticmethod
    def _init(m: nn.Module) -> None:
        """GPT-2's: small normal weights (the tied head starts with logits near zero), zero biases."""
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.tok_emb is not None:
            pos = torch.arange(idx.shape[1], device=idx.device)
            h = self.tok_emb(idx) + self.pos_emb(pos)
        else:
            h = idx
        for block in self.blocks:  # a split by name deletes the other stages' entries
            h = block(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.lm_head(h) if self.lm_head is not None else h


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats) of ``(B, T, V)`` logits against ``(B, T)`` targets."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# -- the data: the standard library's own source, as bytes ---------------------------------------

@dataclass(frozen=True)
class Corpus:
    """Training and held-out bytes (whole files apart), and how many files each holds."""

    train: torch.Tensor  # uint8
    heldout: torch.Tensor  # uint8
    train_files: int
    heldout_files: int


def _is_heldout(relpath: str) -> bool:
    """About 1 file in 20, by a stable hash of its path (the same on every machine and run)."""
    return zlib.crc32(relpath.encode()) % 20 == 0


@functools.lru_cache(maxsize=1)
def load_corpus(max_bytes: int = 4_000_000) -> Corpus:
    """The stdlib's ``.py`` files in the order of their paths (tests and site-packages left out),
    each file held out or trained on as a whole (:func:`_is_heldout`), until the training set has
    95% of ``max_bytes`` and the held-out set 5% (a file that no longer fits is passed over)."""
    root = sysconfig.get_paths()["stdlib"]
    paths = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("test", "tests", "idle_test", "site-packages", "__pycache__")]
        paths += [os.path.relpath(os.path.join(folder, f), root) for f in files if f.endswith(".py")]
    room = {False: max_bytes - max_bytes // 20, True: max_bytes // 20}
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    for rel in sorted(paths):
        held = _is_heldout(rel)
        path = os.path.join(root, rel)
        if os.path.getsize(path) <= room[held]:
            with open(path, "rb") as f:
                parts[held].append(f.read())
            room[held] -= len(parts[held][-1])
    if not parts[True] or not parts[False]:
        raise RuntimeError(f"too little Python source under {root} for a training and a held-out set")

    def joined(texts: list[bytes]) -> torch.Tensor:
        return torch.frombuffer(bytearray(b"".join(texts)), dtype=torch.uint8)

    return Corpus(joined(parts[False]), joined(parts[True]), len(parts[False]), len(parts[True]))


def windows(data: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs ``data[s : s + context]`` and targets one byte on, for each start: two ``(B, T)`` int64."""
    idx = starts[:, None] + torch.arange(context + 1)
    chunk = data[idx].long()
    return chunk[:, :-1], chunk[:, 1:]


def random_batch(data: torch.Tensor, batch: int, context: int, generator: torch.Generator,
                 varlen: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` windows at random places of ``data``, all of one length: drawn between
    ``context // 2`` and ``context`` when ``varlen``, else ``context``."""
    if varlen:
        context = int(torch.randint(context // 2, context + 1, (), generator=generator))
    return windows(data, torch.randint(0, len(data) - context - 1, (batch,), generator=generator), context)


def heldout_windows(corpus: Corpus, context: int, n: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` windows spread evenly over the held-out bytes: the same ones at every evaluation."""
    starts = torch.linspace(0, len(corpus.heldout) - context - 2, n).long()
    return windows(corpus.heldout, starts, context)


def unigram_nats(train: torch.Tensor, targets: torch.Tensor) -> float:
    """Cross-entropy (nats/byte) of ``targets`` under the training bytes' frequencies (add-one)."""
    counts = torch.bincount(train.long(), minlength=VOCAB).double() + 1
    return float(-(counts / counts.sum()).log()[targets.reshape(-1).long()].mean())


def bits(nats: float) -> float:
    return nats / math.log(2)


# -- what a job file names (examples/gpt.toml) ----------------------------------------------------

def split(model: GPT, n_stages: int) -> pipeq.split.Split:
    """``model`` traced and cut into ``n_stages`` stages balanced by parameters (``pipeq.split``):
    their tensors keep the model's names, the tied embedding is marked (the runner keeps its
    copies equal). The example input's batch size and length are free: any microbatch of up to
    ``context`` bytes runs."""
    example = torch.zeros(2, model.config.context, dtype=torch.long)
    return pipeq.split(model, (example,), n_stages=n_stages)


def stages(n_stages: int = 4, quick: bool = False) -> pipeq.split.Split:
    """The job file's stages: a new GPT, split (a list of stages that knows its split points).
    ``pipeq launch`` calls this once per node under the job's seed and hands each stage process
    its own stage."""
    return split(GPT(QUICK if quick else GPTConfig()), n_stages)


def train_batches(epoch: int, batch: int = 32, steps: int = 100, quick: bool = False,
                  seed: int = 0, varlen: bool = True) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch: ``steps`` batches of random training windows (each batch of its own length
    with ``varlen``), seeded by ``seed`` and the epoch (a resumed run draws the same ones)."""
    context = (QUICK if quick else GPTConfig()).context
    corpus = load_corpus()
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    for _ in range(steps):
        yield random_batch(corpus.train, batch, context, g, varlen)


def heldout(quick: bool = False, n: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed held-out windows the job evaluates on."""
    return heldout_windows(load_corpus(), (QUICK if quick else GPTConfig()).context, n)


def bits_per_byte(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """An evaluation metric: the cross-entropy in bits per byte."""
    return bits(float(lm_loss(logits, targets)))


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    """The lr factor at ``step``: linear warmup over ``warmup`` steps, then cosine decay to 10%."""
    if step < warmup:
        return (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))


def lr_schedule(optimizer: torch.optim.Optimizer, warmup: int = 20, total: int = 300) -> Any:
    """:func:`warmup_cosine` as a LambdaLR (stepped after every optimizer step)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, functools.partial(warmup_cosine, warmup=warmup, total=total))


# -- training -------------------------------------------------------------------------------------

class Speed:
    """Training tokens per second (time spent in steps only, evaluations left out): over the last
    ``window`` steps and over the whole run."""

    def __init__(self, window: int = 20) -> None:
        self.recent: collections.deque[tuple[int, float]] = collections.deque(maxlen=window)
        self.tokens = 0
        self.seconds = 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.recent.append((tokens, seconds))
        self.tokens += tokens
        self.seconds += seconds

    def moving(self) -> float:
        return sum(n for n, _ in self.recent) / max(sum(t for _, t in self.recent), 1e-9)

    def overall(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


@dataclass
class Run:
    """A training run's settings."""

    steps: int = 300
    batch: int = 32
    microbatches: int = 4
    lr: float = 3e-3
    warmup: int = 20
    eval_every: int = 100
    seed: int = 0
    varlen: bool = True  # each batch's windows of a length of their own (random_batch)


def train_loop(step: Callable[[torch.Tensor, torch.Tensor], float], evaluate: Callable[[], float],
               corpus: Corpus, config: GPTConfig, run: Run) -> float:
    """Run ``run.steps`` steps of ``step(x, y) -> loss`` with a progress bar; evaluate every
    ``run.eval_every`` steps and at the end. Returns the final held-out loss (nats)."""
    from tqdm import tqdm

    g = torch.Generator().manual_seed(run.seed)
    speed = Speed()
    with tqdm(total=run.steps, unit="step", dynamic_ncols=True) as bar:
        for i in range(1, run.steps + 1):
            x, y = random_batch(corpus.train, run.batch, config.context, g, run.varlen)
            t0 = time.perf_counter()
            loss = step(x, y)
            speed.add(x.numel(), time.perf_counter() - t0)
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{speed.moving():.0f}", avg_tok_s=f"{speed.overall():.0f}",
                            refresh=False)
            bar.update(1)
            if run.eval_every and i % run.eval_every == 0 and i < run.steps:
                ev = evaluate()
                bar.write(f"step {i}: held-out loss {ev:.4f} nats, {bits(ev):.3f} bits/byte")
    ev = evaluate()
    print(f"tokens/s: {speed.overall():.0f} overall, {speed.moving():.0f} over the last steps "
          f"({speed.tokens} tokens in {speed.seconds:.1f} s of steps)")
    return ev


def train_plain(model: GPT, corpus: Corpus, run: Run, device: str) -> tuple[dict[str, torch.Tensor], float]:
    """The baseline: the whole model in this process, a plain torch loop. Returns (state, nats)."""
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=run.lr)
    sched = lr_schedule(opt, run.warmup, run.steps)
    hx, hy = heldout_windows(corpus, model.config.context)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        loss = lm_loss(model(x.to(device)), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        return loss.item()

    @torch.no_grad()
    def evaluate() -> float:
        model.eval()
        out = float(lm_loss(model(hx.to(device)), hy.to(device)))
        model.train()
        return out

    nats = train_loop(step, evaluate, corpus, model.config, run)
    return {k: v.cpu() for k, v in model.state_dict().items()}, nats


def train_pipelined(model: GPT, corpus: Corpus, run: Run, n_stages: int, schedule: str,
                    device: str) -> tuple[dict[str, torch.Tensor], float]:
    """``model`` split into ``n_stages`` stages, one process each, trained by a PipelineRunner."""
    t0 = time.perf_counter()
    parts = split(model, n_stages)
    print(f"pipeq.split: {n_stages} stages, cut before {parts.split_points} ({time.perf_counter() - t0:.1f} s)")
    devices = None
    if device == "cuda":
        devices = [f"cuda:{k % torch.cuda.device_count()}" for k in range(n_stages)]
    runner = pipeq.PipelineRunner(
        list(parts),
        loss_fn=lm_loss,
        optimizer=functools.partial(torch.optim.AdamW, lr=run.lr),
        lr_scheduler=functools.partial(lr_schedule, warmup=run.warmup, total=run.steps),
        schedule=schedule,
        microbatches=run.microbatches,
        threads_per_stage=1,
        devices=devices,
    )
    hx, hy = heldout_windows(corpus, model.config.context)
    t0 = time.perf_counter()
    with runner:
        print(f"started {n_stages} stage processes ({time.perf_counter() - t0:.1f} s)")
        nats = train_loop(runner.step, lambda: runner.evaluate([(hx, hy)])["loss"], corpus, model.config, run)
        state = runner.model_state_dict()  # the model's own names, the tied lm_head.weight included
    return state, nats


# -- sampling -------------------------------------------------------------------------------------

@torch.no_grad()
def generate(model: GPT, prompt: str, n_bytes: int = 300, temperature: float = 0.8, seed: int = 0) -> str:
    """``prompt`` continued by ``n_bytes`` bytes drawn at ``temperature`` (seeded)."""
    model.eval()
    g = torch.Generator().manual_seed(seed)
    idx = torch.tensor([list(prompt.encode())], dtype=torch.long)
    for _ in range(n_bytes):
        logits = model(idx[:, -model.config.context:])[0, -1] / temperature
        nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)
        idx = torch.cat([idx, nxt[None]], dim=1)
    return bytes(idx[0].tolist()).decode("utf-8", errors="replace")


# -- the command line -----------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=4, help="pipeline stages (1: the plain model, no pipeq)")
    p.add_argument("--schedule", default="1f1b", help="a pipeq schedule: 1f1b, fill-drain, ...")
    p.add_argument("--steps", type=int, help="optimizer steps (default 300; 8 with --quick)")
    p.add_argument("--batch", type=int, help="windows per step (default 32; 8 with --quick)")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-every", type=int, default=100, metavar="K")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--out", help="where model.pt goes (default: runs/gpt-<stages>s under the current directory)")
    p.add_argument("--quick", action="store_true", help="a handful of steps of a tiny model (for tests)")
    p.add_argument("--fixed-length", action="store_true",
                   help="every window the whole context long (default: each batch's length drawn between "
                        "half the context and the whole)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    config = QUICK if args.quick else GPTConfig()
    run = Run(steps=args.steps or (8 if args.quick else 300), batch=args.batch or (8 if args.quick else 32),
              microbatches=args.microbatches, lr=args.lr, warmup=2 if args.quick else 20,
              eval_every=args.eval_every, seed=args.seed, varlen=not args.fixed_length)
    out = args.out or os.path.join("runs", f"gpt-{args.stages}s")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: CUDA is not available here")

    t0 = time.perf_counter()
    corpus = load_corpus()
    hx, hy = heldout_windows(corpus, config.context)
    uni = unigram_nats(corpus.train, hy)
    print(f"corpus: {len(corpus.train):,} training bytes ({corpus.train_files} files), {len(corpus.heldout):,} "
          f"held out ({corpus.heldout_files} files), read in {time.perf_counter() - t0:.1f} s")
    print(f"unigram baseline: held-out loss {uni:.4f} nats, {bits(uni):.3f} bits/byte "
          f"(the training bytes' frequencies, on the {len(hx)} held-out windows the model is evaluated on)")

    torch.manual_seed(args.seed)
    model = GPT(config)
    n_params = sum(p.numel() for p in model.parameters())
    length = f"{config.context // 2}..{config.context}" if run.varlen else f"{config.context}"
    print(f"model: {asdict(config)}, {n_params:,} parameters; {run.steps} steps of {run.batch} x "
          f"{length} tokens, {args.stages} stage(s)")
    if args.stages == 1:
        state, nats = train_plain(model, corpus, run, args.device)
    else:
        state, nats = train_pipelined(model, corpus, run, args.stages, args.schedule, args.device)
    print(f"held-out loss {nats:.4f} nats, {bits(nats):.3f} bits/byte "
          f"(unigram baseline {uni:.4f} nats, {bits(uni):.3f} bits/byte)")

    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "model.pt")
    torch.save(state, path)
    plain = GPT(config)  # a fresh model, no pipeq: the saved state is all it needs
    plain.load_state_dict(torch.load(path, weights_only=True), strict=True)
    print(f"saved {path}; loaded into a plain GPT. A sample (temperature 0.8, seed {args.seed}):")
    print("-" * 60)
    print(generate(plain, "def ", n_bytes=120 if args.quick else 300, seed=args.seed))
    print("-" * 60)


if __name__ == "__main__":  # required: the stage processes re-import this file
    main()
