"""Train a small character-level GPT with flash_attn_ext, side by side with PyTorch's attention.

What it does
    Builds a small GPT-style decoder-only transformer (token + learned position embeddings,
    pre-LayerNorm blocks of causal self-attention and an MLP, output head tied to the token
    embedding) and trains two copies of it in lock-step:

    * "ours": attention computed by ``flash_attn_ext.scaled_dot_product_attention``;
    * "ref":  ``torch.nn.functional.scaled_dot_product_attention`` forced to the math backend
      (``torch.nn.attention.sdpa_kernel(SDPBackend.MATH)``), the plain softmax(q k^T) v.

    Both copies start from the same weights (one model is built and deep-copied, and the copy is
    checked to be equal), see the same batches, and use the same AdamW settings, so any gap
    between the two loss curves comes from the attention kernels alone.

The corpus
    Real text that every Debian machine has, with no download: all regular files in
    ``/usr/share/common-licenses/`` (GPL, LGPL, Apache-2.0, Artistic, MPL, GFDL, ...), read in
    sorted order with symlinks resolved and identical contents kept once.  Without that
    directory it falls back to CPython's own ``LICENSE.txt``.  ``--data`` takes another text
    file or directory.  The last 10% of the characters are held out for validation.

How to run it
    python examples/train_gpt.py                      # 100 steps, CPU fp32 (~30 s on 2 idle cores)
    python examples/train_gpt.py --steps 5 --compile  # both models under torch.compile
    python examples/train_gpt.py --dtype bf16         # bfloat16 weights and activations
    python examples/train_gpt.py --dtype fp16         # mixed precision: fp32 weights, fp16
                                                      # compute (autocast), a GradScaler
    python examples/train_gpt.py --sample 300         # then generate 300 characters

    (From a source checkout without installing: ``PYTHONPATH=. python examples/train_gpt.py``.)

What it checks
    Every logged step prints both losses, the largest |loss difference| so far, the throughput
    of our model (its forward, backward and optimizer step only) and the kernel that served the
    attention (``flash_attn_ext.last_plan()``; with ``--compile``, where calls are not recorded,
    what ``explain()`` says).  At the end it prints train/validation losses of
    both models.  On CPU in fp32/fp64 the run fails (exit status 1) when the two training loss
    curves ever differ by more than ``--tolerance`` (default 1e-4).  On CUDA or in bf16/fp16
    the difference is reported but not enforced: the kernels and the rounding differ there.
    In every dtype the run fails when a training loss is NaN or infinite.

    fp16 runs as fp16 training is done: fp32 weights and optimizer state, the forward under
    ``torch.autocast`` in fp16, the loss scaled by a ``torch.amp.GradScaler`` (AdamW's eps of
    1e-8 is 0 in fp16, so all-fp16 AdamW divides 0 by 0 wherever a gradient vanishes).

    Exact attention kernels still round differently from the math backend (about 1e-6 in fp32),
    so the curves match only while training is stable: with a learning rate high enough to make
    the loss spike (``--lr 3e-3`` here) those differences grow chaotically, to about 1e-2, and
    they do just as much between PyTorch's own CPU flash and math backends.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import math
import os
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

import flash_attn_ext

LICENSES_DIR = Path("/usr/share/common-licenses")
DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp64": torch.float64,
                                  "bf16": torch.bfloat16, "fp16": torch.float16}
STRICT_DTYPES = ("fp32", "fp64")  # where the two loss curves must agree to --tolerance

# (query, key, value, is_causal=...) -> output, in the (B, H, L, E) layout of PyTorch's SDPA.
Attention = Callable[..., torch.Tensor]


# ----------------------------------------------------------------------------------------------
# Corpus


@dataclass
class Corpus:
    """The training text and where it came from."""

    text: str
    source: str  # the directory or file, for the log
    files: list[str]  # the files read, in order
    duplicates: int = 0  # files skipped because an identical one was read already


def _read_files(paths: list[Path]) -> tuple[str, list[str], int]:
    """Reads regular files (symlinks resolved) in the given order, each distinct content once.

    Returns the texts joined by newlines, the names of the files read, and how many files were
    skipped as duplicates.
    """
    seen: set[str] = set()
    parts: list[str] = []
    names: list[str] = []
    duplicates = 0
    for path in paths:
        real = path.resolve()
        if not real.is_file():
            continue
        data = real.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        if digest in seen:
            duplicates += 1
            continue
        seen.add(digest)
        parts.append(data.decode("utf-8", errors="replace"))
        names.append(f"{path.name} -> {real.name}" if path.is_symlink() else path.name)
    return "\n".join(parts), names, duplicates


def _python_license_candidates() -> list[Path]:
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt",
                  Path(os.__file__).parent / "LICENSE.txt"]
    for prefix in dict.fromkeys((sys.base_prefix, sys.prefix, sys.exec_prefix)):
        candidates += [Path(prefix) / "lib" / version / "LICENSE.txt",
                       Path(prefix) / "lib64" / version / "LICENSE.txt",
                       Path(prefix) / "Lib" / "LICENSE.txt",
                       Path(prefix) / "LICENSE.txt"]
    return candidates


def load_corpus(data: str | None = None) -> Corpus:
    """Loads the training text: ``data``, else Debian's license texts, else CPython's LICENSE.

    Raises:
        SystemExit: nothing readable was found (the script never makes up text to train on).
    """
    if data is not None:
        path = Path(data)
        paths = sorted(path.iterdir()) if path.is_dir() else [path]
        text, names, duplicates = _read_files(paths)
        if not text:
            raise SystemExit(f"error: --data {data}: no readable text file there")
        return Corpus(text, str(path), names, duplicates)
    if LICENSES_DIR.is_dir():
        text, names, duplicates = _read_files(sorted(LICENSES_DIR.iterdir()))
        if text:
            return Corpus(text, str(LICENSES_DIR), names, duplicates)
    for candidate in _python_license_candidates():
        if candidate.is_file():
            text, names, _ = _read_files([candidate])
            return Corpus(text, str(candidate), names)
    raise SystemExit(f"error: found no corpus: {LICENSES_DIR} is missing and so is CPython's "
                     "LICENSE.txt; pass --data FILE_OR_DIR")


class CharTokenizer:
    """Maps each distinct character of the corpus to an integer id."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        unknown = sorted(set(text) - self.index.keys())
        if unknown:
            raise ValueError(f"characters not in the corpus vocabulary: {unknown!r}")
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)


def batches(data: torch.Tensor, batch_size: int, seq_len: int, seed: int,
            device: torch.device) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless random (input, next-character target) windows, reproducible from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq_len + 1)
    while True:
        starts = torch.randint(len(data) - seq_len, (batch_size,), generator=generator)
        window = data[starts[:, None] + offsets]
        yield window[:, :-1].to(device), window[:, 1:].to(device)


# ----------------------------------------------------------------------------------------------
# Model


def math_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
              is_causal: bool = False) -> torch.Tensor:
    """The reference: PyTorch's scaled_dot_product_attention on its math backend."""
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(query, key, value, is_causal=is_causal)


@dataclass
class GPTConfig:
    vocab_size: int
    seq_len: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, attention: Attention) -> None:
        super().__init__()
        if config.d_model % config.n_head:
            raise ValueError(f"d_model={config.d_model} is not a multiple of "
                             f"n_head={config.n_head}")
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.attention = attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        # (B, L, 3 * D) -> three (B, H, L, D / H) views, the layout SDPA takes.
        q, k, v = (self.qkv(x).view(batch, length, 3, self.n_head, width // self.n_head)
                   .permute(2, 0, 3, 1, 4).unbind(0))
        y = self.attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, attention: Attention) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config, attention)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = nn.Sequential(nn.Linear(config.d_model, 4 * config.d_model), nn.GELU(),
                                 nn.Linear(4 * config.d_model, config.d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Decoder-only transformer; ``attention`` computes the causal self-attention of every block.

    No dropout anywhere, so a forward pass is a deterministic function of weights and input.
    """

    def __init__(self, config: GPTConfig, attention: Attention) -> None:
        super().__init__()
        self.config = config
        self.autocast_dtype: torch.dtype | None = None  # fp16 mixed precision: float16
        self.tok_emb = nn.Embedding(config.vocab_size, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config, attention) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # weight tying
        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1 / sqrt(number of residual additions).
        for block in self.blocks:
            for proj in (block.attn.proj, block.mlp[2]):
                nn.init.normal_(proj.weight, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def set_attention(self, attention: Attention) -> None:
        for block in self.blocks:
            block.attn.attention = attention

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """(B, L) token ids -> (B, L, vocab_size) logits."""
        with torch.autocast(idx.device.type, dtype=self.autocast_dtype or torch.float16,
                            enabled=self.autocast_dtype is not None):
            positions = torch.arange(idx.shape[1], device=idx.device)
            x = self.tok_emb(idx) + self.pos_emb(positions)
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-character cross-entropy, in fp32 for bf16/fp16 models (fp64 stays fp64)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices and embeddings only (not on biases and LayerNorms)."""
    params = list(model.parameters())  # tied weights appear once
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def check_identical(a: nn.Module, b: nn.Module) -> None:
    """Raises unless ``a`` and ``b`` have equal, but separate, parameters."""
    params_a, params_b = dict(a.named_parameters()), dict(b.named_parameters())
    if params_a.keys() != params_b.keys():
        raise RuntimeError("the two models have different parameters")
    for name, p in params_a.items():
        q = params_b[name]
        if p.data_ptr() == q.data_ptr():
            raise RuntimeError(f"parameter {name} is shared between the two models")
        if not torch.equal(p, q):
            raise RuntimeError(f"parameter {name} differs between the two models")


@torch.no_grad()
def evaluate(model: nn.Module, eval_batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    return sum(lm_loss(model(x), y).item() for x, y in eval_batches) / len(eval_batches)


@torch.no_grad()
def sample(model: GPT, tokenizer: CharTokenizer, prompt: str, n: int, temperature: float,
           device: torch.device, seed: int) -> str:
    """Continues ``prompt`` by ``n`` characters; temperature 0 picks the likeliest one."""
    generator = torch.Generator(device=device).manual_seed(seed)
    idx = tokenizer.encode(prompt).to(device)[None]
    for _ in range(n):
        logits = model(idx[:, -model.config.seq_len:])[0, -1].float()
        if temperature <= 0:
            nxt = logits.argmax()[None]
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)
        idx = torch.cat([idx, nxt[None]], dim=1)
    return tokenizer.decode(idx[0].tolist())


# ----------------------------------------------------------------------------------------------
# Training


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help, except where the help says it in words (--dtype,
    --data: their default of None stands for a choice made later)."""

    def _get_help_string(self, action):
        if "(default: " in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a small character-level GPT with flash_attn_ext attention, in "
                    "lock-step with a copy that uses PyTorch's math SDPA, and compare the losses.",
        formatter_class=_DefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=100, help="training steps")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="torch device")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="model dtype (default: fp32 on CPU, bf16 on CUDA)")
    parser.add_argument("--batch-size", type=int, default=16, help="sequences per step")
    parser.add_argument("--seq-len", type=int, default=128, help="context length")
    parser.add_argument("--n-layer", type=int, default=4, help="transformer blocks")
    parser.add_argument("--n-head", type=int, default=4, help="attention heads per block")
    parser.add_argument("--d-model", type=int, default=128, help="model width")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    parser.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay")
    parser.add_argument("--log-every", type=int, default=10, help="log every N steps")
    parser.add_argument("--eval-batches", type=int, default=8,
                        help="batches for the final train/val losses")
    parser.add_argument("--seed", type=int, default=0, help="random seed")
    parser.add_argument("--compile", action="store_true",
                        help="wrap both models in torch.compile(fullgraph=True)")
    parser.add_argument("--tolerance", type=float, default=1e-4,
                        help="largest |loss difference| allowed on CPU in fp32/fp64")
    parser.add_argument("--sample", type=int, default=0, metavar="N",
                        help="after training, generate N characters with our model")
    parser.add_argument("--temperature", type=float, default=0.8,
                        help="sampling temperature for --sample (0: greedy)")
    parser.add_argument("--prompt", default="The ", help="start of the --sample text")
    parser.add_argument("--data", default=None, metavar="PATH",
                        help=f"text file or directory to train on (default: {LICENSES_DIR}, "
                             "else CPython's LICENSE.txt)")
    args = parser.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "n_layer", "n_head", "d_model", "log_every",
                 "eval_batches"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(model: Callable[[torch.Tensor], torch.Tensor], optimizer: torch.optim.Optimizer,
               x: torch.Tensor, y: torch.Tensor, device: torch.device,
               scaler: torch.amp.GradScaler | None = None) -> tuple[float, float]:
    """One forward, backward and AdamW step (through ``scaler`` for fp16); returns (loss,
    seconds it took)."""
    synchronize(device)
    start = time.perf_counter()
    loss = lm_loss(model(x), y)
    optimizer.zero_grad(set_to_none=True)
    if scaler is None:
        loss.backward()
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    synchronize(device)
    return loss.item(), time.perf_counter() - start


@dataclass
class RunStats:
    """What the lock-step training loop measured."""

    max_diff: float = 0.0  # largest |loss ours - loss ref| over the run
    max_diff_step: int = 0
    nonfinite_step: int = 0  # the first step whose loss (either model's) was NaN or infinite
    seconds_ours: float = 0.0  # fwd+bwd+step time after step 1 (warm-up, compilation)
    seconds_ref: float = 0.0
    plan: flash_attn_ext.Plan | None = None  # the kernels that served our attention


def prepare_data(args: argparse.Namespace) -> tuple[CharTokenizer, torch.Tensor, torch.Tensor]:
    """Loads and encodes the corpus; returns (tokenizer, train ids, validation ids)."""
    corpus = load_corpus(args.data)
    tokenizer = CharTokenizer(corpus.text)
    data = tokenizer.encode(corpus.text)
    n_train = int(0.9 * len(data))
    train_data, val_data = data[:n_train], data[n_train:]
    skipped = f" ({corpus.duplicates} duplicate(s) skipped)" if corpus.duplicates else ""
    print(f"corpus: {corpus.source}: {len(corpus.files)} file(s){skipped}, "
          f"{len(corpus.text):,} characters, vocabulary of {tokenizer.vocab_size}")
    print(f"        {', '.join(corpus.files)}")
    print(f"split:  train {len(train_data):,} characters, validation (last 10%) "
          f"{len(val_data):,}")
    if len(val_data) <= args.seq_len:
        raise SystemExit(f"error: the validation split ({len(val_data)} characters) is not "
                         f"longer than --seq-len {args.seq_len}")
    return tokenizer, train_data, val_data


def build_models(args: argparse.Namespace, vocab_size: int, device: torch.device,
                 dtype: torch.dtype) -> tuple[GPT, GPT]:
    """Builds our model and the reference: one set of initial weights, two attentions (fp16:
    fp32 weights, the forward under autocast)."""
    torch.manual_seed(args.seed)
    config = GPTConfig(vocab_size, args.seq_len, args.n_layer, args.n_head, args.d_model)
    ours = GPT(config, flash_attn_ext.scaled_dot_product_attention)
    ref = copy.deepcopy(ours)
    ref.set_attention(math_sdpa)
    for model in (ours, ref):
        if dtype == torch.float16:
            model.to(device=device)
            model.autocast_dtype = torch.float16
        else:
            model.to(device=device, dtype=dtype)
    check_identical(ours, ref)
    n_params = sum(p.numel() for p in ours.parameters())
    print(f"model:  {args.n_layer} layers, {args.n_head} heads, d_model {args.d_model}, "
          f"context {args.seq_len}, {n_params:,} parameters (token embedding tied to the "
          "output head); both copies start from identical weights")
    return ours, ref


def train_lockstep(args: argparse.Namespace, ours: GPT, ref: GPT, train_data: torch.Tensor,
                   device: torch.device,
                   plan: flash_attn_ext.Plan | None = None) -> RunStats:
    """Trains both models on the same batches, one step each in turn, and logs the losses
    (``plan``: explain()'s plan for our attention, shown where calls are not recorded)."""
    opt_ours = make_optimizer(ours, args.lr, args.weight_decay)
    opt_ref = make_optimizer(ref, args.lr, args.weight_decay)
    amp = ours.autocast_dtype is not None
    scaler_ours = torch.amp.GradScaler(device.type) if amp else None
    scaler_ref = torch.amp.GradScaler(device.type) if amp else None
    fwd_ours: Callable[[torch.Tensor], torch.Tensor] = ours
    fwd_ref: Callable[[torch.Tensor], torch.Tensor] = ref
    if args.compile:
        fwd_ours = torch.compile(ours, fullgraph=True)
        fwd_ref = torch.compile(ref, fullgraph=True)

    tokens_per_step = args.batch_size * args.seq_len
    train_batches = batches(train_data, args.batch_size, args.seq_len, args.seed, device)
    stats = RunStats(plan=plan)
    window_seconds, window_steps = 0.0, 0  # our time since the last log line
    print(f"{'step':>6} {'loss ours':>11} {'loss ref':>11} {'max|diff|':>10} "
          f"{'ours tok/s':>11}  attention kernel (ours)")
    # A bar on a terminal only: in a log (CI, a pipe) tqdm.write would redraw it before every
    # line; the log lines already say where training is.
    progress = tqdm(range(1, args.steps + 1), desc="training", unit="step", dynamic_ncols=True,
                    mininterval=0.1, disable=not sys.stderr.isatty())
    for step in progress:
        x, y = next(train_batches)  # the same batch for both models
        loss_ours, seconds_ours = train_step(fwd_ours, opt_ours, x, y, device, scaler_ours)
        # Eager calls are recorded; compiled ones are not (the plan explain() gave stays).
        stats.plan = flash_attn_ext.last_plan() or stats.plan
        loss_ref, seconds_ref = train_step(fwd_ref, opt_ref, x, y, device, scaler_ref)
        if not stats.nonfinite_step and not math.isfinite(loss_ours + loss_ref):
            stats.nonfinite_step = step

        if step > 1:
            stats.seconds_ours += seconds_ours
            stats.seconds_ref += seconds_ref
        window_seconds += seconds_ours
        window_steps += 1
        diff = abs(loss_ours - loss_ref)
        if not diff <= stats.max_diff:  # also catches NaN
            stats.max_diff, stats.max_diff_step = diff, step
        progress.set_postfix(loss=f"{loss_ours:.4f}", max_diff=f"{stats.max_diff:.1e}",
                             refresh=False)  # redrawn at the bar's own pace
        if step == 1 or step % args.log_every == 0 or step == args.steps:
            kernel = stats.plan.kernel if stats.plan is not None else "?"
            tqdm.write(f"{step:>6} {loss_ours:>11.7f} {loss_ref:>11.7f} {stats.max_diff:>10.2e} "
                       f"{window_steps * tokens_per_step / window_seconds:>11,.0f}  {kernel}")
            window_seconds, window_steps = 0.0, 0
    progress.close()
    return stats


def summarize(args: argparse.Namespace, ours: GPT, ref: GPT, train_data: torch.Tensor,
              val_data: torch.Tensor, stats: RunStats, device: torch.device) -> None:
    """Prints both models' train/validation losses, the loss gap and the throughputs."""
    eval_train = batches(train_data, args.batch_size, args.seq_len, args.seed + 1, device)
    eval_val = batches(val_data, args.batch_size, args.seq_len, args.seed + 2, device)
    train_eval = [next(eval_train) for _ in range(args.eval_batches)]
    val_eval = [next(eval_val) for _ in range(args.eval_batches)]
    results = {name: (evaluate(model, train_eval), evaluate(model, val_eval))
               for name, model in (("ours", ours), ("ref", ref))}
    tokens_per_step = args.batch_size * args.seq_len
    print(f"\nsummary after {args.steps} steps (losses over {args.eval_batches} fixed batches "
          f"of {tokens_per_step:,} tokens per split):")
    for name, (train_loss, val_loss) in results.items():
        print(f"  {name:<4}  train loss {train_loss:.6f}   val loss {val_loss:.6f}")
    print(f"  |diff| train {abs(results['ours'][0] - results['ref'][0]):.2e}   "
          f"val {abs(results['ours'][1] - results['ref'][1]):.2e}")
    where = f"step {stats.max_diff_step}" if stats.max_diff_step else "identical curves"
    print(f"  max |training loss difference| over the run: {stats.max_diff:.2e} ({where})")
    if args.steps > 1:
        timed = (args.steps - 1) * tokens_per_step
        print(f"  throughput after step 1 (fwd+bwd+step): ours {timed / stats.seconds_ours:,.0f} "
              f"tok/s, ref {timed / stats.seconds_ref:,.0f} tok/s")
    print(f"  attention served by: {stats.plan}")
    fallbacks = flash_attn_ext.fallback_counts()
    if fallbacks:
        print(f"  fallback calls: {fallbacks}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype_name = args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    dtype = DTYPES[dtype_name]
    enforced = device.type == "cpu" and dtype_name in STRICT_DTYPES

    tokenizer, train_data, val_data = prepare_data(args)
    ours, ref = build_models(args, tokenizer.vocab_size, device, dtype)
    note = ""
    if dtype_name == "fp16":
        note = " (mixed precision: fp32 weights and optimizer state, fp16 autocast, GradScaler)"
    elif device.type == "cuda" and dtype_name == "bf16":
        note = (" (both models are cast to this dtype: weights, activations and optimizer "
                "state)")
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    compiled = ", torch.compile(fullgraph=True)" if args.compile else ""
    print(f"run:    {args.steps} steps on {device}{threads}, {dtype_name}{note}, batch "
          f"{args.batch_size}, AdamW lr {args.lr}, seed {args.seed}{compiled}")
    head_dim = args.d_model // args.n_head
    probe = torch.empty(args.batch_size, args.n_head, args.seq_len, head_dim, device=device,
                        dtype=dtype)
    plan = flash_attn_ext.explain(probe, probe, probe, is_causal=True)
    print(f"attention: ours = flash_attn_ext, {plan}; ref = torch SDPA, math backend")

    stats = train_lockstep(args, ours, ref, train_data, device, plan)
    summarize(args, ours, ref, train_data, val_data, stats, device)

    if args.sample > 0:
        text = sample(ours, tokenizer, args.prompt, args.sample, args.temperature, device,
                      args.seed)
        print(f"\nsample from our model (temperature {args.temperature}):\n{text}")

    if stats.nonfinite_step:
        print(f"\nFAIL: a training loss was NaN or infinite at step {stats.nonfinite_step}")
        return 1
    if not enforced:
        print(f"\nnot enforced on {device.type}/{dtype_name} (the tolerance applies on CPU in "
              f"fp32/fp64): max |loss difference| {stats.max_diff:.2e}")
        return 0
    if stats.max_diff <= args.tolerance:
        print(f"\nOK: the loss curves agree to {args.tolerance:g} "
              f"(max |difference| {stats.max_diff:.2e})")
        return 0
    print(f"\nFAIL: the loss curves differ by {stats.max_diff:.2e} at step "
          f"{stats.max_diff_step}, more than --tolerance {args.tolerance:g}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
