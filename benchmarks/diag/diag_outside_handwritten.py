"""Hand-written models of kinds no zoo, sweep or library list holds, on the CPU: recurrent layers (LSTM,
GRU), transposed convolutions (a DCGAN generator), 1-D convolutions (an audio front end), a diffusion-style
U-Net (GroupNorm, SiLU, a time embedding, nearest upsampling, skip concatenation, a self-attention block),
PixelShuffle super-resolution, nn.TransformerDecoder with a causal mask and cross-attention,
nn.TransformerEncoder with a causal and a key padding mask, an EmbeddingBag recommender (DLRM-like), weight
and spectral norm parametrizations, module hooks, tied weights, and buffers a forward updates itself. Answered: do capture, the passes a GPU plan applies, the defaults and
training (with a memory budget) hold the accuracy rule on such models? The cells are
diag_outside_seq2seq.cells'.

    PYTHONPATH=$PWD python benchmarks/diag/diag_outside_handwritten.py [--only lstm,unet] [--out DIR]
"""
from __future__ import annotations

import math
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diag_outside_seq2seq import table  # noqa: E402  (it puts the repository on the path)


class LSTMClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        self.rnn = nn.LSTM(32, 48, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(96, 5)

    def forward(self, ids):
        out, _ = self.rnn(self.emb(ids))
        return self.head(out.mean(1))


class GRUTagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(16, 32, batch_first=True)
        self.head = nn.Linear(32, 7)

    def forward(self, x):
        out, h = self.rnn(x)
        return self.head(out), h


class DCGANGenerator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.ConvTranspose2d(16, 64, 4, 1, 0, bias=False), nn.BatchNorm2d(64), nn.ReLU(True),
            nn.ConvTranspose2d(64, 32, 4, 2, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU(True),
            nn.ConvTranspose2d(32, 3, 4, 2, 1, bias=False), nn.Tanh())

    def forward(self, z):
        return self.net(z)


class AudioFrontEnd(nn.Module):
    """wav2vec-style: strided 1-D convolutions with GroupNorm and GELU, then a projection."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv1d(1, 32, 10, 5, bias=False)
        self.n1 = nn.GroupNorm(32, 32)
        self.c2 = nn.Conv1d(32, 32, 3, 2, bias=False)
        self.c3 = nn.Conv1d(32, 32, 2, 2, bias=False)
        self.proj = nn.Linear(32, 24)
        self.ln = nn.LayerNorm(32)

    def forward(self, wav):
        x = F.gelu(self.n1(self.c1(wav.unsqueeze(1))))
        x = F.gelu(self.c3(F.gelu(self.c2(x))))
        return self.proj(self.ln(x.transpose(1, 2)))


class ResBlock(nn.Module):
    def __init__(self, cin, cout, tdim):
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(8, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.t = nn.Linear(tdim, cout)
        self.n2, self.c2 = nn.GroupNorm(8, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, temb):
        h = self.c1(F.silu(self.n1(x))) + self.t(F.silu(temb))[:, :, None, None]
        return self.skip(x) + self.c2(F.silu(self.n2(h)))


class AttnBlock(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.norm, self.qkv, self.out = nn.GroupNorm(8, c), nn.Conv2d(c, 3 * c, 1), nn.Conv2d(c, c, 1)

    def forward(self, x):
        b, c, h, w = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, 3, c, h * w).unbind(1)
        a = torch.softmax(q.transpose(1, 2) @ k / math.sqrt(c), dim=-1)
        return x + self.out((v @ a.transpose(1, 2)).reshape(b, c, h, w))


class TinyUNet(nn.Module):
    """A diffusion U-Net's structure at toy width: a sinusoidal time embedding, two levels, a middle
    attention block, nearest upsampling and skip concatenation."""

    def __init__(self):
        super().__init__()
        self.tmlp = nn.Sequential(nn.Linear(32, 64), nn.SiLU(), nn.Linear(64, 64))
        self.inc = nn.Conv2d(3, 32, 3, padding=1)
        self.d1, self.down = ResBlock(32, 32, 64), nn.Conv2d(32, 32, 3, 2, 1)
        self.d2 = ResBlock(32, 64, 64)
        self.mid, self.attn = ResBlock(64, 64, 64), AttnBlock(64)
        self.u2 = ResBlock(128, 32, 64)
        self.u1 = ResBlock(64, 32, 64)
        self.outc = nn.Sequential(nn.GroupNorm(8, 32), nn.SiLU(), nn.Conv2d(32, 3, 3, padding=1))

    def forward(self, x, t):
        half = 16
        freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=x.device, dtype=torch.float32) / half)
        ang = t.float()[:, None] * freqs[None]
        temb = self.tmlp(torch.cat([ang.sin(), ang.cos()], dim=1))
        h0 = self.d1(self.inc(x), temb)
        h1 = self.d2(self.down(h0), temb)
        m = self.attn(self.mid(h1, temb))
        u = self.u2(torch.cat([m, h1], 1), temb)
        u = F.interpolate(u, scale_factor=2, mode="nearest")
        u = self.u1(torch.cat([u, h0], 1), temb)
        return self.outc(u)


class SuperResolution(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(3, 32, 5, padding=2), nn.PReLU(32), nn.Conv2d(32, 32, 3, padding=1),
                                  nn.LeakyReLU(0.1), nn.Conv2d(32, 3 * 4, 3, padding=1))
        self.shuffle = nn.PixelShuffle(2)

    def forward(self, x):
        return self.shuffle(self.body(x)) + F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)


class CausalDecoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        layer = nn.TransformerDecoderLayer(32, 4, 64, dropout=0.0, batch_first=True, norm_first=True)
        self.dec = nn.TransformerDecoder(layer, 2)
        self.head = nn.Linear(32, 100)

    def forward(self, ids, memory):
        s = ids.shape[1]
        mask = torch.triu(torch.full((s, s), float("-inf"), device=ids.device), diagonal=1)
        return self.head(self.dec(self.emb(ids), memory, tgt_mask=mask))


class PaddedEncoder(nn.Module):
    """nn.TransformerEncoder (post-norm, nested tensors allowed: eval's fast path) with a causal mask and a
    key padding mask, as a sequence model with padded batches uses it."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(32, 2)

    def forward(self, ids, pad):
        s = ids.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(s, device=ids.device)
        return self.head(self.enc(self.emb(ids), mask=causal, src_key_padding_mask=pad)[:, 0])


class DLRMish(nn.Module):
    def __init__(self):
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(50, 16, mode="sum") for _ in range(3))
        self.bottom = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.top = nn.Sequential(nn.Linear(16 + 6, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, dense, idx, offsets):
        feats = [self.bottom(dense)] + [bag(idx[i], offsets) for i, bag in enumerate(self.bags)]
        x = torch.stack(feats, 1)
        inter = torch.bmm(x, x.transpose(1, 2))
        iu = torch.triu_indices(4, 4, 1, device=x.device)
        return torch.sigmoid(self.top(torch.cat([feats[0], inter[:, iu[0], iu[1]]], 1)))


class HiFiGANish(nn.Module):
    """A HiFi-GAN generator stage: weight-normalized (torch.nn.utils.parametrizations.weight_norm) transposed
    and dilated 1-D convolutions with leaky ReLU and a residual sum."""

    def __init__(self):
        super().__init__()
        wn = torch.nn.utils.parametrizations.weight_norm
        self.pre = wn(nn.Conv1d(8, 16, 7, padding=3))
        self.up = wn(nn.ConvTranspose1d(16, 8, 4, stride=2, padding=1))
        self.res = nn.ModuleList(wn(nn.Conv1d(8, 8, 3, dilation=d, padding=d)) for d in (1, 3))
        self.post = wn(nn.Conv1d(8, 1, 7, padding=3))

    def forward(self, mel):
        x = self.up(F.leaky_relu(self.pre(mel), 0.1))
        for conv in self.res:
            x = x + conv(F.leaky_relu(x, 0.1))
        return torch.tanh(self.post(F.leaky_relu(x, 0.1)))


class SpectralNormed(nn.Module):
    """parametrizations.spectral_norm (a GAN discriminator): a power iteration updating buffers in training."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.utils.parametrizations.spectral_norm(nn.Conv2d(3, 8, 3, padding=1))
        self.lin = nn.Linear(8, 1)

    def forward(self, x):
        return self.lin(torch.relu(self.conv(x)).mean((2, 3)))


class Hooked(nn.Module):
    """A forward hook that rescales an output and a pre-hook that shifts an input."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)
        self.a.register_forward_hook(lambda m, i, o: o * 0.5)
        self.b.register_forward_pre_hook(lambda m, i: (i[0] + 1.0,))

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class TiedLM(nn.Module):
    """An output projection sharing the embedding's weight."""

    def __init__(self):
        super().__init__()
        self.emb, self.norm = nn.Embedding(50, 16), nn.LayerNorm(16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.norm(self.emb(ids)))


class RunningStat(nn.Module):
    """Buffers a training forward updates itself, as a custom normalization does: a running variance
    reassigned (``self.var = ...``), a step counter advanced in place; eval reads the running value."""

    def __init__(self):
        super().__init__()
        self.proj, self.out = nn.Linear(8, 12), nn.Linear(12, 3)
        self.register_buffer("var", torch.ones(12))
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        h = self.proj(x)
        if self.training:
            v = h.var(0, unbiased=False)
            with torch.no_grad():
                self.var = 0.95 * self.var + 0.05 * v
                self.seen.add_(x.shape[0])
        else:
            v = self.var
        return self.out(h * torch.rsqrt(v + 1e-5))


def _inputs(name):
    g = torch.Generator().manual_seed(1)
    if name == "lstm":
        return (torch.randint(0, 100, (4, 12), generator=g),)
    if name == "gru":
        return (torch.randn(4, 10, 16, generator=g),)
    if name == "dcgan":
        return (torch.randn(4, 16, 1, 1, generator=g),)
    if name == "audio":
        return (torch.randn(2, 800, generator=g),)
    if name == "unet":
        return torch.randn(2, 3, 16, 16, generator=g), torch.tensor([3, 250])
    if name == "superres":
        return (torch.randn(2, 3, 16, 16, generator=g),)
    if name == "decoder":
        return torch.randint(0, 100, (2, 9), generator=g), torch.randn(2, 5, 32, generator=g)
    if name == "encoder":
        pad = torch.zeros(2, 9, dtype=torch.bool)
        pad[1, 6:] = True
        return torch.randint(0, 100, (2, 9), generator=g), pad
    if name == "weight_norm":
        return (torch.randn(2, 8, 12, generator=g),)
    if name == "spectral_norm":
        return (torch.randn(2, 3, 8, 8, generator=g),)
    if name in ("hooks", "running_stat"):
        return (torch.randn(4, 8, generator=g),)
    if name == "tied":
        return (torch.randint(0, 50, (2, 5), generator=g),)
    if name == "dlrm":
        return (torch.randn(4, 8, generator=g), torch.randint(0, 50, (3, 10), generator=g), torch.tensor([0, 2, 5, 7]))
    raise KeyError(name)


MODELS = {"lstm": LSTMClassifier, "gru": GRUTagger, "dcgan": DCGANGenerator, "audio": AudioFrontEnd,
          "unet": TinyUNet, "superres": SuperResolution, "decoder": CausalDecoder, "encoder": PaddedEncoder,
          "dlrm": DLRMish, "weight_norm": HiFiGANish, "spectral_norm": SpectralNormed, "hooks": Hooked,
          "tied": TiedLM, "running_stat": RunningStat}


def build(name):
    torch.manual_seed(0)
    model = MODELS[name]()
    if name == "dcgan":  # BatchNorm statistics from one training-mode forward
        with torch.no_grad():
            model.train()(torch.randn(16, 16, 1, 1))
    return model.eval(), _inputs(name)


def main(argv=None):
    table(argv, "Hand-written models of kinds outside every list, on the CPU",
          f"torch {torch.__version__}; fp32, random weights; `benchmarks/diag/diag_outside_handwritten.py` (the "
          "models are defined there). plan: the H200 plan's passes in strict mode + the accuracy rule; optimize: "
          "defaults; train: training=True, then memory_budget=0.6 (or the model's minimum where 0.6 is below it), "
          "the loss and every parameter gradient (and buffer) by the rule against float64.", MODELS, build,
          "outside_handwritten")


if __name__ == "__main__":
    main()
