"""A small decoder-only transformer over bytes, for the outer-step benchmarks.

The language model of :mod:`benchmarks.outer_quality` (the quality of DiLoCo and
SparseLoCo against DDP) and of the byte benchmark, which captures its
pseudo-gradients: next-byte prediction on the standard library's own ``.py``
files (:func:`benchmarks.train_text.standard_library_text`: nothing is
downloaded). Every 2-D weight has sides that are multiples of 64, so SparseLoCo's
64 x 64 tiles (``chunktopk:k=64,chunk=4096``) cover it whole; the 1-D LayerNorm
parameters go in flat chunks.

::

    train, validation = text_splits()
    model = build_model(seed=0)                      # the same weights on every rank
    for x, y in batches(train, rank=rank, seed=0, batch_size=8):
        loss = next_byte_loss(model, x, y)
        ...
    validation_loss(model, validation)               # nats per byte

The batches of a rank depend only on ``(seed, rank, step)``
(:func:`training_batch`), so that every scheme of a comparison, and a run resumed
at any step, sees the same tokens.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from benchmarks.train_text import standard_library_text

#: Bytes are the tokens.
VOCABULARY = 256

#: The sizes :func:`build_model` takes by default: 3.3M parameters.
DEFAULT_SIZES = {"width": 256, "depth": 4, "heads": 4, "sequence": 64, "mlp_ratio": 4}

#: What SparseLoCo tiles 2-D tensors by: every side of a weight matrix is a multiple.
TILE = 64


class Block(torch.nn.Module):
    """One pre-norm transformer block: causal self-attention, then an MLP (GELU)."""

    def __init__(self, width: int, heads: int, mlp_ratio: int):
        super().__init__()
        self.heads = heads
        self.attention_norm = torch.nn.LayerNorm(width)
        self.qkv = torch.nn.Linear(width, 3 * width, bias=False)
        self.attention_out = torch.nn.Linear(width, width, bias=False)
        self.mlp_norm = torch.nn.LayerNorm(width)
        self.mlp_in = torch.nn.Linear(width, mlp_ratio * width, bias=False)
        self.mlp_out = torch.nn.Linear(mlp_ratio * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.attention_norm(x)).split(width, dim=-1)
        q, k, v = (t.view(batch, length, self.heads, width // self.heads).transpose(1, 2)
                   for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attention_out(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp_out(F.gelu(self.mlp_in(self.mlp_norm(x))))


class ByteTransformer(torch.nn.Module):
    """Next byte from the previous ones (up to ``sequence``): a GPT-style decoder.

    Learned token and position embeddings, ``depth`` pre-norm blocks, a final
    LayerNorm and an untied output layer over the 256 byte values; no biases in
    the linear layers. Every 2-D parameter has sides that are multiples of 64.

    Parameters
    ----------
    width : int, default 256
        Model width, a multiple of 64 and of ``heads``.
    depth : int, default 4
        Transformer blocks.
    heads : int, default 4
        Attention heads.
    sequence : int, default 64
        Longest context (the position table's rows), a multiple of 64.
    mlp_ratio : int, default 4
        The MLP's hidden width over ``width``.

    Examples
    --------
    >>> model = ByteTransformer(width=64, depth=1, heads=2, sequence=64)
    >>> sorted({tuple(p.shape) for p in model.parameters() if p.dim() == 2})
    [(64, 64), (64, 256), (192, 64), (256, 64)]
    >>> x = torch.zeros(3, 10, dtype=torch.long)
    >>> tuple(model(x).shape)
    (3, 10, 256)
    """

    def __init__(self, width=256, depth=4, heads=4, sequence=64, mlp_ratio=4):
        super().__init__()
        if width % TILE or sequence % TILE:
            raise ValueError(f"width and sequence must be multiples of {TILE} (SparseLoCo's "
                             f"tiles), got width={width}, sequence={sequence}")
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.sequence = sequence
        self.token_embedding = torch.nn.Embedding(VOCABULARY, width)
        self.position_embedding = torch.nn.Parameter(torch.zeros(sequence, width))
        self.blocks = torch.nn.ModuleList(Block(width, heads, mlp_ratio) for _ in range(depth))
        self.final_norm = torch.nn.LayerNorm(width)
        self.output = torch.nn.Linear(width, VOCABULARY, bias=False)
        self._initialise(depth)

    def _initialise(self, depth: int) -> None:
        # GPT-2's: N(0, 0.02), and the projections back into the residual stream scaled
        # down with depth, so that the stream's variance does not grow with it
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * depth) if name.endswith(("attention_out.weight",
                                                                     "mlp_out.weight")) else 0.02
                torch.nn.init.normal_(p, std=std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits over the next byte at every position of ``x`` (batch, length)."""
        length = x.shape[1]
        if length > self.sequence:
            raise ValueError(f"inputs of {length} bytes, the model takes up to {self.sequence}")
        h = self.token_embedding(x) + self.position_embedding[:length]
        for block in self.blocks:
            h = block(h)
        return self.output(self.final_norm(h))



def next_byte_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy (nats per byte) of ``model`` (a :class:`ByteTransformer`, or one
    wrapped in DDP) predicting ``y`` from ``x``."""
    return F.cross_entropy(model(x).reshape(-1, VOCABULARY), y.reshape(-1))


def build_model(seed: int = 0, **sizes) -> ByteTransformer:
    """A :class:`ByteTransformer` of :data:`DEFAULT_SIZES` updated by ``sizes``, its weights
    drawn from ``seed``: the same on every rank that passes the same seed.

    >>> a, b = build_model(seed=3, depth=1), build_model(seed=3, depth=1)
    >>> all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    True
    """
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return ByteTransformer(**{**DEFAULT_SIZES, **sizes})


def parameter_count(model: torch.nn.Module) -> int:
    """Elements of every parameter of ``model``.

    >>> parameter_count(build_model())
    3297792
    """
    return sum(p.numel() for p in model.parameters())


def text_splits(text_bytes: int = 2_000_000, validation_share: float = 0.1):
    """``(train, validation)``: the first ``text_bytes`` of the standard library's sources
    as int64 byte tensors, the last ``validation_share`` of them held out.

    >>> train, validation = text_splits(10_000)
    >>> train.numel(), validation.numel(), train.dtype
    (9000, 1000, torch.int64)
    """
    text = standard_library_text(text_bytes)
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    held_out = int(len(data) * validation_share)
    return data[:len(data) - held_out], data[len(data) - held_out:]


def _windows(data: torch.Tensor, starts: torch.Tensor, length: int):
    """Inputs (``length`` bytes from each start) and targets (the same, one byte later)."""
    window = data[starts[:, None] + torch.arange(length + 1)]
    return window[:, :-1], window[:, 1:]


def training_batch(train: torch.Tensor, step: int, rank: int = 0, seed: int = 0,
                   batch_size: int = 8, sequence: int = 64):
    """Rank ``rank``'s batch ``(x, y)`` of inner step ``step``: ``batch_size`` windows of
    ``sequence`` bytes at starts drawn from ``(seed, rank, step)`` alone.

    >>> train, _ = text_splits(10_000)
    >>> x, y = training_batch(train, step=5, rank=1, batch_size=2, sequence=16)
    >>> x.shape, bool(torch.equal(x[:, 1:], y[:, :-1]))
    (torch.Size([2, 16]), True)
    >>> bool(torch.equal(x, training_batch(train, 5, 1, batch_size=2, sequence=16)[0]))
    True
    """
    generator = torch.Generator().manual_seed(((seed * 1_000_003) + rank) * 1_000_003 + step)
    starts = torch.randint(0, train.numel() - sequence - 1, (batch_size,), generator=generator)
    return _windows(train, starts, sequence)


def batches(train: torch.Tensor, rank: int = 0, seed: int = 0, batch_size: int = 8,
            sequence: int = 64, start: int = 0):
    """The batches of :func:`training_batch` for steps ``start``, ``start + 1``, ... (endless)."""
    step = start
    while True:
        yield training_batch(train, step, rank, seed, batch_size, sequence)
        step += 1


def validation_loss(model: torch.nn.Module, validation: torch.Tensor, sequence: int = 64,
                    windows: int = 64, batch_size: int = 16) -> float:
    """Mean cross-entropy (nats per byte) of ``model`` over ``windows`` windows of
    ``sequence`` bytes spread evenly over ``validation``: the same windows every call.

    >>> _, validation = text_splits(20_000)
    >>> model = build_model(depth=1, sequence=64)
    >>> abs(validation_loss(model, validation, sequence=64, windows=4) - math.log(256)) < 0.1
    True
    """
    starts = torch.linspace(0, validation.numel() - sequence - 1, windows).long()
    was_training = model.training
    model.eval()
    total = 0.0
    with torch.no_grad():
        for first in range(0, windows, batch_size):
            x, y = _windows(validation, starts[first:first + batch_size], sequence)
            total += next_byte_loss(model, x, y).item() * x.shape[0]
    model.train(was_training)
    return total / windows
