"""Universal pre-training on synthetic data (Bloem, arXiv 2506.20057; x-transformers' ``up_wrapper``).

A small randomly initialised recurrent network (the "Turing machine" of the paper, an LSTM by default) turns
random sequences into structured ones; a buffer of such sequences is enriched step by step (each step some
sequences are fed through the generator and written back, a few are reset to fresh random ones), and the
language model trains autoregressively on sequences drawn from the buffer.

Shape legend: B buffer size, b batch, n sequence length, s seed length, v vocabulary, c width.
There is no padding here: every sequence is ``seq_len`` real token ids in ``[0, num_tokens)``.
"""

from __future__ import annotations

import math
import random
from functools import partial

import torch
from torch import Tensor, nn

from ..decoding.generation import AutoregressiveWrapper
from ..interop.convert import register_converter
from ..stack.wrappers import TransformerWrapper

__all__ = ["UniversalPretrainWrapper", "SyntheticDataGenerator", "random_sequences", "universal_pretrain_from_x_transformers"]


def _positive_int(v, name: str, minimum: int = 1) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {v!r}")
    return v


def random_sequences(num_tokens: int, seq_len: int, num_samples_random: int, num_samples_constant: int,
                     shuffle: bool = True, device=None) -> Tensor:
    """``(num_samples_random + num_samples_constant, seq_len)`` token ids: uniformly random sequences and
    constant ones (one random token repeated; x-transformers' mix), shuffled."""
    _positive_int(num_tokens, "num_tokens")
    _positive_int(seq_len, "seq_len")
    for name, v in (("num_samples_random", num_samples_random), ("num_samples_constant", num_samples_constant)):
        _positive_int(v, name, 0)
    if num_samples_random + num_samples_constant == 0:
        raise ValueError("random_sequences needs at least one sample (num_samples_random + num_samples_constant > 0)")
    rand_seq = torch.randint(0, num_tokens, (num_samples_random, seq_len), device=device)
    const_seq = torch.full((num_samples_constant, seq_len), random.randrange(num_tokens), device=device)
    seqs = torch.cat((rand_seq, const_seq))
    return seqs[torch.randperm(seqs.shape[0], device=seqs.device)] if shuffle else seqs


class SyntheticDataGenerator(nn.Module):
    """The synthetic data source: an embedding, a recurrent network and a linear read-out, randomly initialised
    (the read-out's weights scaled by a random factor in ``[0, 1.1]``, as in the paper) and never trained.

    Args:
        dim: embedding width c.
        num_tokens: vocabulary v.
        max_seq_len: length of the sequences ``generate`` returns (its last ``max_seq_len`` tokens).
        hidden_size: the recurrent network's state width (default ``dim``); with the default network the
            read-out takes ``hidden_size`` features.
        use_gru: a GRU instead of an LSTM.
        network_klass: a custom recurrent network ``klass(dim, hidden_size)`` with ``batch_first`` semantics,
            called as ``net(x (b, n, c), state) -> (out (b, n, hidden_size), state)``.
    """

    def __init__(self, dim: int, num_tokens: int, max_seq_len: int = 512, hidden_size: int | None = None,
                 use_gru: bool = False, network_klass=None):
        super().__init__()
        _positive_int(dim, "dim")
        _positive_int(num_tokens, "num_tokens")
        _positive_int(max_seq_len, "max_seq_len")
        hidden_size = dim if hidden_size is None else _positive_int(hidden_size, "hidden_size")
        self.max_seq_len = max_seq_len
        self.num_tokens = num_tokens
        self.embed = nn.Embedding(num_tokens, dim)
        klass = partial(nn.GRU if use_gru else nn.LSTM, batch_first=True) if network_klass is None else network_klass
        self.net = klass(dim, hidden_size)
        self.to_logits = nn.Linear(hidden_size, num_tokens, bias=False)
        self.apply(self.init_)

    def reset_(self) -> None:
        """Draw fresh random weights (a new "machine")."""
        for m in self.modules():
            if m is not self and hasattr(m, "reset_parameters"):
                m.reset_parameters()
        self.apply(self.init_)

    @torch.no_grad()
    def init_(self, m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            m.weight *= random.uniform(0.0, 1.1)  # the paper scales the weights by a random factor in [0, 1.1]

    def forward(self, input: Tensor, hiddens=None):  # noqa: A002 (x-transformers' name)
        """``(logits (b, n, v), state)`` of token ids ``input (b, n)`` continuing from ``hiddens``."""
        out, hidden = self.net(self.embed(input), hiddens)
        return self.to_logits(out), hidden

    @torch.no_grad()
    def generate(self, length: int, seed: Tensor | None = None, condition: Tensor | None = None,
                 temperature: float = 1e-4) -> Tensor:
        """Sample ``length`` tokens after the prefix ``cat(seed, condition)`` (either may be left out) and return
        the last ``max_seq_len`` tokens of the whole sequence, ``(b, max_seq_len)`` (the prefix included when it is
        shorter). ``temperature`` near 0 is near-greedy, as in the paper; 0 is greedy (argmax). The softmax runs
        in float32 at least, so the division by a small temperature stays finite."""
        _positive_int(length, "length", 0)
        if not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
                and math.isfinite(temperature) and temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
        prefix = [t for t in (seed, condition) if t is not None]
        if not prefix:
            raise ValueError("generate needs a seed or a condition (the prefix the generator continues)")
        for t in prefix:
            if not isinstance(t, Tensor) or t.dim() != 2 or t.dtype.is_floating_point or t.dtype == torch.bool:
                raise ValueError(f"seed and condition must be integer token ids (b, n), got {getattr(t, 'shape', type(t))}")
        seq = torch.cat(prefix, dim=-1)
        if seq.numel() and bool(((seq < 0) | (seq >= self.num_tokens)).any()):
            raise ValueError(f"seed / condition hold ids outside the vocabulary [0, num_tokens={self.num_tokens})")
        inp, state, out = seq, None, [seq]
        for _ in range(length):
            logits, state = self(inp, state)
            last = logits[:, -1].to(torch.promote_types(logits.dtype, torch.float32))  # (b, v)
            if temperature == 0:
                sampled = last.argmax(dim=-1, keepdim=True)
            else:
                sampled = torch.multinomial((last / temperature).softmax(dim=-1), 1)  # (b, 1)
            out.append(sampled)
            inp = sampled
        return torch.cat(out, dim=-1)[:, -self.max_seq_len:]


class UniversalPretrainWrapper(nn.Module):
    """Universal pre-training of a causal ``TransformerWrapper`` on synthetic data (x-transformers'
    ``UniversalPretrainWrapper``, Bloem 2025, algorithm 1).

    Args:
        model: a ``TransformerWrapper`` around a causal stack (``Decoder``); it is trained with
            ``AutoregressiveWrapper(model)``.
        data_generator: the synthetic source (default: a ``SyntheticDataGenerator`` of the model's width and
            vocabulary). A custom one needs ``generate(length, seed=, condition=) -> (b, seq_len)`` token ids in
            ``[0, num_tokens)`` (checked every step), and ``reset_()`` with ``reset_turing_machine_every``.
        buffer_size: sequences in the buffer (default ``20 * batch_size``); more than ``batch_size``.
        num_reset: sequences reset to fresh random ones each step (even: half random, half constant).
        batch_size: sequences per step.
        seq_len: length of every sequence (the autoregressive loss reads ``seq_len - 1`` positions).
        seed_length: length of the random crop of a buffer sequence used as the generator's seed.
        reset_turing_machine_every: every that many steps the generator gets fresh weights (0: never).
        keep_buffer_on_cpu: keep the buffer a plain CPU tensor (not a module buffer: ``.to(device)`` leaves it,
            and it is not in the ``state_dict``); by default it is a buffer that moves with the module.

    ``forward()`` takes no input: it enriches the buffer (the generator continues ``batch_size`` sequences,
    seeded by random crops of others; the results replace them in the buffer, and ``num_reset`` random entries
    are reset) and returns the autoregressive loss of ``batch_size`` sequences drawn from the buffer. Unlike
    x-transformers 2.31.10, whose in-place copies land on copies of the buffer rows (so its buffer never
    changes), the generated and reset sequences are written into the buffer, as the paper's algorithm says.
    """

    def __init__(self, model: TransformerWrapper, data_generator: nn.Module | None = None, buffer_size: int | None = None,
                 num_reset: int = 20, batch_size: int = 32, seq_len: int = 512, seed_length: int = 8,
                 reset_turing_machine_every: int = 0, keep_buffer_on_cpu: bool = False):
        super().__init__()
        if not isinstance(model, TransformerWrapper):
            raise TypeError(f"model must be a TransformerWrapper, got {type(model).__name__}")
        if not model.attn_layers.causal:
            raise ValueError("model must be causal (attn_layers=Decoder(...)): it is trained autoregressively")
        _positive_int(batch_size, "batch_size")
        _positive_int(seq_len, "seq_len", 2)
        _positive_int(seed_length, "seed_length")
        _positive_int(num_reset, "num_reset", 0)
        _positive_int(reset_turing_machine_every, "reset_turing_machine_every", 0)
        if not isinstance(keep_buffer_on_cpu, bool):
            raise TypeError(f"keep_buffer_on_cpu must be a bool, got {keep_buffer_on_cpu!r}")
        buffer_size = 20 * batch_size if buffer_size is None else _positive_int(buffer_size, "buffer_size")
        if buffer_size <= batch_size:
            raise ValueError(f"buffer_size={buffer_size} must be greater than batch_size={batch_size}")
        if num_reset % 2:
            raise ValueError(f"num_reset must be even (half random, half constant sequences), got {num_reset}")
        if num_reset > buffer_size:
            raise ValueError(f"num_reset={num_reset} is more than buffer_size={buffer_size}")
        if seed_length >= seq_len:
            raise ValueError(f"seed_length={seed_length} must be less than seq_len={seq_len} (a crop of a sequence)")
        if model.pos_emb is not None and seq_len - 1 > model.max_seq_len:
            raise ValueError(f"seq_len={seq_len} is too long for the model's max_seq_len={model.max_seq_len} (the "
                             f"autoregressive loss reads seq_len - 1 positions)")
        num_tokens, dim = model.num_tokens, model.attn_layers.dim
        if data_generator is None:
            data_generator = SyntheticDataGenerator(dim=dim, num_tokens=num_tokens, max_seq_len=seq_len)
        elif not callable(getattr(data_generator, "generate", None)):
            raise TypeError("data_generator must have a generate(length, seed=, condition=) method")
        if reset_turing_machine_every and not callable(getattr(data_generator, "reset_", None)):
            raise TypeError("reset_turing_machine_every needs a data_generator with a reset_() method")
        self.model = model
        self.ar_wrapped = AutoregressiveWrapper(model)
        self.data_generator = data_generator
        self.num_tokens = num_tokens
        self.seq_len, self.seed_length, self.batch_size = seq_len, seed_length, batch_size
        self.buffer_size, self.num_reset = buffer_size, num_reset
        self.reset_turing_machine_every = reset_turing_machine_every
        self.random_sequences_fn = partial(random_sequences, num_tokens, seq_len)
        init = self.random_sequences_fn(buffer_size // 2, buffer_size - buffer_size // 2)  # (B, n)
        self.keep_buffer_on_cpu = keep_buffer_on_cpu
        if keep_buffer_on_cpu:
            self.synth_data_buffer = init
        else:
            self.register_buffer("synth_data_buffer", init)
        self.register_buffer("step", torch.tensor(0))

    @property
    def device(self) -> torch.device:
        return self.step.device

    def _indices(self, size: int) -> Tensor:
        """``size`` distinct random rows of the buffer (on the buffer's device)."""
        return torch.randperm(self.buffer_size, device=self.synth_data_buffer.device)[:size]

    def get_rand_sequences_from_buffer(self, size: int | None = None) -> Tensor:
        """``(size, seq_len)`` distinct random sequences of the buffer (a copy; default ``batch_size``)."""
        return self.synth_data_buffer[self._indices(self.batch_size if size is None else size)]

    @torch.no_grad()
    def _enrich(self) -> None:
        """One step of the buffer: generated continuations replace ``batch_size`` sequences, ``num_reset``
        random entries become fresh random sequences."""
        buf = self.synth_data_buffer
        cond_idx = self._indices(self.batch_size)
        conditions = buf[cond_idx]  # (b, n)
        seeds = self.get_rand_sequences_from_buffer()  # (b, n)
        offset = torch.randint(0, self.seq_len - self.seed_length, (self.batch_size,), device=buf.device)
        crop = offset[:, None] + torch.arange(self.seed_length, device=buf.device)  # (b, s)
        seeds = seeds.gather(1, crop)  # (b, s): a random crop of each
        generated = self.data_generator.generate(self.seq_len, condition=conditions.to(self.device),
                                                 seed=seeds.to(self.device))
        if not isinstance(generated, Tensor) or tuple(generated.shape) != (self.batch_size, self.seq_len) \
                or generated.dtype.is_floating_point or generated.dtype == torch.bool:
            raise ValueError(f"data_generator.generate must return integer token ids of shape (batch_size, seq_len) = "
                             f"({self.batch_size}, {self.seq_len}), got {getattr(generated, 'shape', type(generated))}")
        if bool(((generated < 0) | (generated >= self.num_tokens)).any()):
            raise ValueError(f"data_generator.generate returned ids outside the vocabulary [0, num_tokens={self.num_tokens})")
        self.step.add_(1)
        if self.reset_turing_machine_every and int(self.step) % self.reset_turing_machine_every == 0:
            self.data_generator.reset_()
        if self.num_reset > 0:
            half = self.num_reset // 2
            buf[self._indices(self.num_reset)] = self.random_sequences_fn(half, half, device=buf.device)
        buf[cond_idx] = generated.to(buf.device, buf.dtype)  # the enriched sequences go back

    def forward(self) -> Tensor:
        """Enrich the buffer one step, then the autoregressive loss of ``batch_size`` sequences drawn from it."""
        self._enrich()
        data = self.get_rand_sequences_from_buffer().to(self.device)
        return self.ar_wrapped(data)


# ----------------------------------------------------------------------------------------------------
# conversion from x-transformers
# ----------------------------------------------------------------------------------------------------


def _generator_from_xt(gen) -> nn.Module:
    """x-transformers' ``SyntheticDataGenerator`` as safeformer's, with its weights; any other generator (a user's
    module with ``generate``) is kept as it is (the same object)."""
    import copy

    if type(gen).__name__ != "SyntheticDataGenerator" or not type(gen).__module__.startswith("x_transformers"):
        return gen
    embed, net, to_logits = gen.embed, gen.net, gen.to_logits
    hidden = getattr(net, "hidden_size", to_logits.in_features)
    if to_logits.in_features != hidden:
        raise ValueError(f"UniversalPretrainWrapper.data_generator: its read-out takes {to_logits.in_features} features "
                         f"but its network gives {hidden} (x-transformers sizes it by dim, not hidden_size: it cannot run)")
    # the network itself is copied (an LSTM, a GRU or a user's): the same module, the same weights
    klass = lambda dim, hidden_size: copy.deepcopy(net)  # noqa: E731
    out = SyntheticDataGenerator(dim=embed.embedding_dim, num_tokens=embed.num_embeddings, max_seq_len=gen.max_seq_len,
                                 hidden_size=hidden, network_klass=klass)
    p = next(gen.parameters())
    out = out.to(device=p.device, dtype=p.dtype)  # before the weights: exact copies
    try:
        out.load_state_dict(gen.state_dict(), strict=True)
    except RuntimeError as err:
        raise ValueError(f"UniversalPretrainWrapper.data_generator: the weights do not map onto safeformer's ({err})") from err
    return out.train(gen.training)


def universal_pretrain_from_x_transformers(model, *, drop_training_only: bool = False) -> UniversalPretrainWrapper:
    """Convert an x-transformers ``UniversalPretrainWrapper`` with its weights and its state.

    The language model goes through ``from_x_transformers`` (with its ``AutoregressiveWrapper``: what it cannot
    represent is that ``ValueError``; ``drop_training_only`` is passed on); x-transformers' default
    ``SyntheticDataGenerator`` becomes safeformer's with the same weights (a user's generator is kept, the same
    object); the buffer (its contents, and whether it is kept on the CPU), the step count and every setting are
    kept. The same random draws give the same training batches and losses, except that safeformer writes the
    generated and reset sequences back into the buffer (x-transformers 2.31.10 writes them into copies, so its
    buffer never changes). Refused: an odd ``buffer_size`` (x-transformers' buffer then holds ``buffer_size - 1``
    rows while it draws indices up to ``buffer_size - 1``), and settings safeformer rejects (``seed_length`` not
    below ``seq_len``, ``num_reset`` above ``buffer_size``, a ``seq_len`` past the model's absolute positions).
    """
    from ..interop.convert import from_x_transformers

    for attr in ("model", "ar_wrapped", "data_generator", "synth_data_buffer", "step", "buffer_size", "num_reset",
                 "batch_size", "seq_len", "seed_length", "reset_turing_machine_every"):
        if not hasattr(model, attr):
            raise TypeError(f"expected an x_transformers UniversalPretrainWrapper, got {type(model).__name__} (no {attr!r})")
    if model.ar_wrapped.net is not model.model:
        raise ValueError("UniversalPretrainWrapper: ar_wrapped does not wrap model")
    buf = model.synth_data_buffer
    if tuple(buf.shape) != (model.buffer_size, model.seq_len):
        raise ValueError(f"UniversalPretrainWrapper: its buffer holds {tuple(buf.shape)} sequences, not (buffer_size, "
                         f"seq_len) = ({model.buffer_size}, {model.seq_len}) (x-transformers keeps buffer_size // 2 * 2 "
                         f"rows: an odd buffer_size has no exact counterpart)")
    ar = from_x_transformers(model.ar_wrapped, drop_training_only=drop_training_only)
    keep_on_cpu = "synth_data_buffer" not in model._buffers
    out = UniversalPretrainWrapper(
        ar.net, data_generator=_generator_from_xt(model.data_generator), buffer_size=int(model.buffer_size),
        num_reset=int(model.num_reset), batch_size=int(model.batch_size), seq_len=int(model.seq_len),
        seed_length=int(model.seed_length), reset_turing_machine_every=int(model.reset_turing_machine_every),
        keep_buffer_on_cpu=keep_on_cpu)
    want = {k: v for k, v in ar.get_config().items() if k != "net"}
    got = {k: v for k, v in out.ar_wrapped.get_config().items() if k != "net"}
    if want != got:
        diff = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
        raise ValueError(f"UniversalPretrainWrapper: its AutoregressiveWrapper differs from the default one in {diff}")
    device = model.step.device
    out = out.to(device)
    with torch.no_grad():
        out.step.copy_(model.step)
        if keep_on_cpu:
            out.synth_data_buffer = buf.clone()
        else:
            out.synth_data_buffer.copy_(buf)
    return out.train(model.training)


# ``from_x_transformers`` converts x-transformers' class through this module's converter
register_converter("x_transformers.up_wrapper", "UniversalPretrainWrapper", universal_pretrain_from_x_transformers, takes_drop=True)
