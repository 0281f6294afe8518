"""The corpus's own GPU workloads (issue 17): thirty-one real training and inference shapes,
the last seventeen held out (six added after the paging policy's constants were set, four more
in session 31, two in session 32, five in session 35).

Each workload is a function ``f(c: Ctx) -> loop``: it builds its model (random init, from a
config: nothing is downloaded) and returns ``loop``, a callable that runs the steady-state part
once. The runner (run.py) calls ``loop()`` once to warm up (cuDNN/cuBLAS start-up, the
allocator's first growth, graph capture where there is one) and then times further calls, so
model construction is never on the clock. ``loop`` reseeds its own random streams on every
call: every repetition asks the allocator for the same sequence of sizes, and so does every
allocator.

Sizes are for an H100 (80 GB): one ``loop()`` should take about 0.3-1 s and the model build a
few seconds (it is created on the GPU, where random init is fast). ``CORPUS_DEVICE=cpu`` (or
``Ctx(tiny=True)``) shrinks every size so that the code paths run on a CPU in seconds: a smoke
test of the code, not a measurement.

The registry ``WORKLOADS`` maps a name to (function, family, expected peak requested bytes on
the H100, expected seconds of one process: interpreter and imports (~3-5 s), build, warm-up and two timed loops). The
expected figures are estimates written before the first GPU run; run.py reports the measured
ones.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import threading
from dataclasses import dataclass
from typing import Callable, Dict

import torch
import torch.nn as nn
import torch.nn.functional as F


class Ctx:
    """Where and how big: ``dev`` the device, ``tiny`` the CPU smoke sizes."""

    def __init__(self, device: str = "cuda", tiny: bool = False):
        self.dev = torch.device(device)
        self.cuda = self.dev.type == "cuda"
        self.tiny = tiny
        # Half precision where the GPU runs; float32 on the CPU (its half kernels are slow or missing).
        self.half = torch.float16 if self.cuda else torch.float32
        self.bf16 = torch.bfloat16 if self.cuda else torch.float32
        self.info: Dict[str, str] = {}  # what a workload chose at build time (reported by run.py)

    def pick(self, full, tiny):
        """``full`` on the GPU, ``tiny`` in the CPU smoke mode."""
        return tiny if self.tiny else full

    def autocast(self):
        """bf16 autocast on the GPU (as the training recipes run); nothing on the CPU."""
        if self.cuda:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def seed(self, s: int) -> random.Random:
        """Reseeds torch (CPU and GPU) and returns a Python RNG: a loop's sizes and data repeat."""
        torch.manual_seed(s)
        return random.Random(s)

    # Streams: real ones on the GPU; on the CPU they degrade to the current (only) stream.
    def new_stream(self):
        return torch.cuda.Stream(self.dev) if self.cuda else None

    def on(self, stream):
        return torch.cuda.stream(stream) if (self.cuda and stream is not None) else contextlib.nullcontext()

    def current_stream(self):
        return torch.cuda.current_stream(self.dev) if self.cuda else None

    def adamw(self, params):
        return torch.optim.AdamW(params, lr=1e-4, fused=self.cuda)


@dataclass
class Workload:
    fn: Callable[[Ctx], Callable[[], None]]
    family: str
    footprint: str  # expected peak requested bytes on an H100, in words
    est_s: float  # expected seconds of one run.py process (REPS=2) on an H100


WORKLOADS: Dict[str, Workload] = {}


def workload(family: str, footprint: str, est_s: float):
    def register(fn):
        WORKLOADS[fn.__name__] = Workload(fn, family, footprint, est_s)
        return fn

    return register


def optimize(loss, opt) -> None:
    """One optimizer step on ``loss``: gradients made, applied, then freed (``set_to_none``), as
    training loops do, so every step allocates its gradients anew."""
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def sync(c: Ctx) -> None:
    if c.cuda:
        torch.cuda.synchronize(c.dev)


# ---------------------------------------------------------------------------------------------
# Inference with a batch that varies from call to call


@workload("inference, variable batch, < 1 GiB", "~0.3 GiB", 5)
def resnet18_infer_varbatch(c: Ctx):
    """A small image classifier served one request at a time: the batch is whatever arrived
    (1-64 images), each answer (top-5) goes back to the host. The whole footprint stays far
    under 1 GiB, so every small size class the allocator keeps shows in the ratio."""
    import torchvision

    m = torchvision.models.resnet18(weights=None).to(c.dev, c.half).eval()
    if c.cuda:
        m = m.to(memory_format=torch.channels_last)
    side = c.pick(224, 32)

    def loop():
        rng = c.seed(10)
        with torch.no_grad():
            for _ in range(c.pick(200, 4)):
                b = rng.choice([1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64])
                x = torch.randn(b, 3, side, side, device=c.dev, dtype=c.half)
                if c.cuda:
                    x = x.to(memory_format=torch.channels_last)
                top = m(x).float().softmax(-1).topk(5, dim=-1)
                top.indices.cpu()  # the reply: one host sync per request, as a server has

    return loop


class EagerAttentionBlock(nn.Module):
    """A pre-norm transformer block whose attention materialises its scores (B, H, L, L), as
    "eager" attention does: activations far larger than the weights, at little compute."""

    def __init__(self, d: int, heads: int, ff: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)
        self.ff1 = nn.Linear(d, ff)
        self.ff2 = nn.Linear(ff, d)
        self.n1 = nn.LayerNorm(d)
        self.n2 = nn.LayerNorm(d)

    def forward(self, x):
        b, l, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, l, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.matmul(q, k.transpose(-1, -2))
        a.mul_(q.shape[-1] ** -0.5)
        a = a.softmax(-1)  # scores and probabilities are both live here: the peak, 2 x B*H*L*L
        x = x + self.o((a @ v).transpose(1, 2).reshape(b, l, d))
        del a, q, k, v
        return x + self.ff2(F.gelu(self.ff1(self.n2(x))))


@workload("inference, variable batch, > 40 GiB", "~43 GiB (2 x 20 GiB of attention scores at B=40, L=4096)", 6)
def eager_attn_infer_40g(c: Ctx):
    """Encoder inference (d=2048, 16 heads, 4 layers, fp16) with eager attention, over batches
    of 4-40 sequences of 1-4K tokens. The largest request (B=40, L=4096) comes first in every
    loop: its scores are 40 x 16 x 4096^2 x 2 B = 20 GiB, twice live during the softmax, so
    the peak requested is ~43 GiB; the rest of the loop reuses (or not) that memory for
    smaller shapes."""
    d, heads, ff, layers = c.pick((2048, 16, 8192, 4), (64, 4, 128, 2))
    with torch.device(c.dev):
        m = nn.Sequential(*[EagerAttentionBlock(d, heads, ff) for _ in range(layers)])
    m = m.to(c.half).eval()
    batches = c.pick([4, 8, 16, 24, 32, 40], [1, 2])
    lengths = c.pick([1024, 2048, 3072, 4096], [8, 16])

    def loop():
        rng = c.seed(11)
        shapes = [(max(batches), max(lengths))]
        shapes += [(rng.choice(batches), rng.choice(lengths)) for _ in range(c.pick(15, 2))]
        with torch.no_grad():
            for b, l in shapes:
                x = torch.randn(b, l, d, device=c.dev, dtype=c.half)
                m(x)[:, 0].float().cpu()  # the first token's embedding goes back to the host

    return loop


# ---------------------------------------------------------------------------------------------
# Generation


@workload("generation, growing KV cache (HF generate)", "~1-2 GiB", 8)
def gpt2_generate_dynamic(c: Ctx):
    """GPT-2 (124M, fp16) through Hugging Face ``generate``: greedy decoding with the default
    dynamic cache, which grows by one token per step (a new, slightly larger key/value tensor
    per layer and step). Batches of 1-32 prompts of 16-256 tokens, 32-64 new tokens each."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(**c.pick({}, dict(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=128,
                                             bos_token_id=1, eos_token_id=2)))
    with torch.device(c.dev):
        m = GPT2LMHeadModel(cfg)
    m = m.to(c.half).eval()

    def loop():
        rng = c.seed(12)
        for _ in range(2):
            b = rng.choice(c.pick([1, 4, 8, 16, 32], [1, 2]))
            prompt = rng.randint(*c.pick((16, 256), (4, 16)))
            new = rng.choice(c.pick([32, 48, 64], [4]))
            x = torch.randint(0, cfg.vocab_size, (b, prompt), device=c.dev)
            with torch.no_grad():
                m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0)

    return loop


def small_llama_config(c: Ctx, **full):
    """A Llama config: ``full`` on the GPU, a two-layer toy in the CPU smoke mode."""
    from transformers import LlamaConfig

    if c.tiny:
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)
    return LlamaConfig(**full)


@workload("generation, static KV cache (HF generate)", "~2 GiB", 8)
def llama_generate_static(c: Ctx):
    """A small Llama (8 layers, d=1024, GQA 16/4, bf16) through ``generate`` with
    ``cache_implementation="static"``: the cache is allocated once per (batch, length) bucket
    at its full size and updated in place. Batches of 1-16 prompts, 32-64 new tokens.
    ``disable_compile``: on CUDA, transformers would otherwise compile the decode step with
    inductor and CUDA graphs, tens of seconds for each new batch shape, far beyond a run's
    budget; the eager decode keeps the static cache's allocations."""
    from transformers import LlamaForCausalLM

    cfg = small_llama_config(c, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                             num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                             max_position_embeddings=2048)
    with torch.device(c.dev):
        m = LlamaForCausalLM(cfg)
    m = m.to(c.bf16).eval()

    def loop():
        rng = c.seed(13)
        for _ in range(2):
            b = rng.choice(c.pick([1, 4, 8, 16], [1, 2]))
            prompt = rng.randint(*c.pick((16, 256), (4, 16)))
            new = rng.choice(c.pick([32, 48, 64], [4]))
            x = torch.randint(0, cfg.vocab_size, (b, prompt), device=c.dev)
            with torch.no_grad():
                m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0, cache_implementation="static",
                           disable_compile=True)

    return loop


# ---------------------------------------------------------------------------------------------
# Mixture of experts


class TopKMoE(nn.Module):
    """Top-k routed experts (GELU MLPs). Tokens are sorted by expert and each expert runs on
    its slice, so the sizes of its activations change with the router's choices every step."""

    def __init__(self, d: int, ff: int, experts: int, k: int):
        super().__init__()
        self.k = k
        self.router = nn.Linear(d, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, d, ff) * d ** -0.5)
        self.w2 = nn.Parameter(torch.randn(experts, ff, d) * ff ** -0.5)

    def forward(self, x):  # x: (tokens, d)
        weight, idx = self.router(x).float().softmax(-1).topk(self.k, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        flat = idx.flatten()
        order = flat.argsort()
        counts = torch.bincount(flat, minlength=self.w1.shape[0]).tolist()  # host sync, as real MoE code has
        token = order // self.k
        parts = x[token].split(counts)
        y = torch.cat([F.gelu(p @ self.w1[e]) @ self.w2[e] for e, p in enumerate(parts)])
        y = y * weight.flatten()[order, None].to(y.dtype)
        return torch.zeros(x.shape, dtype=y.dtype, device=x.device).index_add_(0, token, y).to(x.dtype)


class MoEBlock(nn.Module):
    def __init__(self, d: int, heads: int, ff: int, experts: int, k: int):
        super().__init__()
        self.heads = heads
        self.n1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)
        self.n2 = nn.LayerNorm(d)
        self.moe = TopKMoE(d, ff, experts, k)

    def forward(self, x):
        b, l, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, l, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, l, d))
        return x + self.moe(self.n2(x).reshape(b * l, d)).view(b, l, d)


@workload("MoE training (top-2 of 8 experts)", "~8 GiB", 6)
def moe_train(c: Ctx):
    """A 4-layer MoE language model (d=1024, 8 experts of 2816, top-2; ~220M parameters) trained
    with AdamW under bf16 autocast on 4-12 sequences of 1024 tokens per step."""
    d, heads, ff, experts, layers, vocab, seq = c.pick((1024, 16, 2816, 8, 4, 8192, 1024), (64, 4, 128, 4, 2, 256, 16))
    with torch.device(c.dev):
        emb = nn.Embedding(vocab, d)
        blocks = nn.Sequential(*[MoEBlock(d, heads, ff, experts, 2) for _ in range(layers)])
        head = nn.Linear(d, vocab, bias=False)
    model = nn.ModuleList([emb, blocks, head])
    opt = c.adamw(model.parameters())

    def loop():
        rng = c.seed(14)
        for _ in range(c.pick(20, 2)):
            b = rng.randint(*c.pick((4, 12), (1, 3)))
            x = torch.randint(0, vocab, (b, seq + 1), device=c.dev)
            with c.autocast():
                logits = head(blocks(emb(x[:, :-1])))
                loss = F.cross_entropy(logits.float().view(-1, vocab), x[:, 1:].reshape(-1))
            optimize(loss, opt)

    return loop


# ---------------------------------------------------------------------------------------------
# Diffusion


def timestep_embedding(t, dim: int):
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]
    return torch.cat([args.cos(), args.sin()], dim=-1)


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, tdim: int, groups: int):
        super().__init__()
        self.n1 = nn.GroupNorm(groups, cin)
        self.c1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.t = nn.Linear(tdim, cout)
        self.n2 = nn.GroupNorm(groups, cout)
        self.c2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, t):
        h = self.c1(F.silu(self.n1(x))) + self.t(t)[:, :, None, None]
        return self.c2(F.silu(self.n2(h))) + self.skip(x)


class SelfAttention2d(nn.Module):
    def __init__(self, ch: int, groups: int, heads: int = 8):
        super().__init__()
        self.heads = heads
        self.norm = nn.GroupNorm(groups, ch)
        self.qkv = nn.Conv2d(ch, 3 * ch, 1)
        self.out = nn.Conv2d(ch, ch, 1)

    def forward(self, x):
        b, ch, hh, ww = x.shape
        q, k, v = self.qkv(self.norm(x)).reshape(b, 3, self.heads, ch // self.heads, hh * ww).unbind(1)
        o = F.scaled_dot_product_attention(q.transpose(-1, -2), k.transpose(-1, -2), v.transpose(-1, -2))
        return x + self.out(o.transpose(-1, -2).reshape(b, ch, hh, ww))


class UNet(nn.Module):
    """A DDPM-style UNet: one residual block per level, downsampling by 2 between levels,
    self-attention at the lowest resolution, skip connections concatenated on the way up."""

    def __init__(self, ch=(128, 256, 512), tdim: int = 512, groups: int = 32):
        super().__init__()
        self.tin = tdim // 4
        self.temb = nn.Sequential(nn.Linear(self.tin, tdim), nn.SiLU(), nn.Linear(tdim, tdim))
        self.inp = nn.Conv2d(3, ch[0], 3, padding=1)
        self.down = nn.ModuleList()
        c = ch[0]
        for co in ch:
            self.down.append(ResBlock(c, co, tdim, groups))
            c = co
        self.mid = ResBlock(c, c, tdim, groups)
        self.attn = SelfAttention2d(c, groups)
        self.up = nn.ModuleList()
        for co in reversed(ch):
            self.up.append(ResBlock(c + co, co, tdim, groups))
            c = co
        self.out = nn.Sequential(nn.GroupNorm(groups, c), nn.SiLU(), nn.Conv2d(c, 3, 3, padding=1))

    def forward(self, x, t):
        t = self.temb(timestep_embedding(t, self.tin))
        h = self.inp(x)
        skips = []
        for i, block in enumerate(self.down):
            h = block(h, t)
            skips.append(h)
            if i < len(self.down) - 1:
                h = F.avg_pool2d(h, 2)
        h = self.attn(self.mid(h, t))
        for block in self.up:
            skip = skips.pop()
            if h.shape[-1] != skip.shape[-1]:
                h = F.interpolate(h, scale_factor=2, mode="nearest")
            h = block(torch.cat([h, skip], 1), t)
        return self.out(h)


@workload("diffusion (UNet): training + periodic sampling", "~10 GiB", 6)
def unet_diffusion_train(c: Ctx):
    """DDPM training of a UNet (128/256/512 channels, ~40M parameters) on batches of 48 random
    64x64 "images" (bf16 autocast, channels-last), and every 8th step a short sampling pass
    (8 denoising steps on 16 images, no grad), as a training job that previews samples does."""
    ch, groups, side, batch = c.pick(((128, 256, 512), 32, 64, 48), ((16, 32, 64), 8, 16, 2))
    with torch.device(c.dev):
        m = UNet(ch, tdim=c.pick(512, 64), groups=groups)
    if c.cuda:
        m = m.to(memory_format=torch.channels_last)
    opt = c.adamw(m.parameters())
    steps = 1000
    abar = torch.cumprod(1 - torch.linspace(1e-4, 0.02, steps, device=c.dev), 0)

    def images(n):
        x = torch.randn(n, 3, side, side, device=c.dev)
        return x.to(memory_format=torch.channels_last) if c.cuda else x

    def loop():
        c.seed(15)
        sample_every = c.pick(8, 2)
        for step in range(c.pick(16, 2)):
            x0 = images(batch)
            t = torch.randint(0, steps, (batch,), device=c.dev)
            noise = torch.randn_like(x0)
            a = abar[t][:, None, None, None]
            with c.autocast():
                loss = F.mse_loss(m(a.sqrt() * x0 + (1 - a).sqrt() * noise, t).float(), noise)
            optimize(loss, opt)
            if step % sample_every == sample_every - 1:
                with torch.no_grad(), c.autocast():
                    x = images(c.pick(16, 1))
                    for s in torch.linspace(steps - 1, 0, 8).long().tolist():  # DDIM, eta=0
                        ts = torch.full((x.shape[0],), s, device=c.dev)
                        eps = m(x, ts).float()
                        a_t = abar[s]
                        a_prev = abar[max(s - steps // 8, 0)]
                        x0_hat = (x - (1 - a_t).sqrt() * eps) / a_t.sqrt()
                        x = a_prev.sqrt() * x0_hat + (1 - a_prev).sqrt() * eps

    return loop


# ---------------------------------------------------------------------------------------------
# Speech


@workload("speech: wav2vec2 CTC training, variable audio lengths", "~15 GiB", 8)
def wav2vec2_ctc_train_varlen(c: Ctx):
    """Wav2Vec2-base (95M) CTC training on raw 16 kHz audio: 2-8 clips per batch of 2-12 s each,
    padded to the longest; the convolutional front end's activations scale with the audio
    length, so every step asks for different sizes."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    small = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                 conv_dim=(32, 32), conv_kernel=(10, 3), conv_stride=(5, 2), num_conv_pos_embeddings=16,
                 num_conv_pos_embedding_groups=2)
    # Deterministic steps: no SpecAugment masking (numpy's RNG) and no layer drop.
    cfg = Wav2Vec2Config(vocab_size=32, mask_time_prob=0.0, layerdrop=0.0, ctc_zero_infinity=True,
                         ctc_loss_reduction="mean", **c.pick({}, small))
    with torch.device(c.dev):
        m = Wav2Vec2ForCTC(cfg)
    m.train()
    opt = c.adamw(m.parameters())
    rate = c.pick(16000, 400)

    def loop():
        rng = c.seed(16)
        for _ in range(c.pick(8, 2)):
            lengths = [int(rng.uniform(2, 12) * rate) for _ in range(rng.choice(c.pick([2, 4, 6, 8], [1, 2])))]
            audio = torch.zeros(len(lengths), max(lengths), device=c.dev)
            for i, n in enumerate(lengths):
                audio[i, :n] = torch.randn(n, device=c.dev)
            label_len = max(lengths) // c.pick(1600, 40)  # ~10 characters a second
            labels = torch.randint(1, 32, (len(lengths), label_len), device=c.dev)
            for i, n in enumerate(lengths):
                labels[i, n // c.pick(1600, 40):] = -100
            with c.autocast():
                loss = m(audio, labels=labels).loss
            optimize(loss, opt)

    return loop


@workload("speech: Whisper encoder-decoder training, variable transcripts", "~10 GiB", 8)
def whisper_train_varlen(c: Ctx):
    """Whisper-base-sized (d=512, 6+6 layers) training on 30 s log-mel inputs (80 x 3000) with
    4-16 clips per batch and transcripts of 16-224 tokens: the encoder's sizes move with the
    batch, the decoder's with batch and transcript length."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    small = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                 decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=256,
                 max_source_positions=16, max_target_positions=64, num_mel_bins=8, pad_token_id=0,
                 bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    full = dict(d_model=512, encoder_layers=6, decoder_layers=6, encoder_attention_heads=8,
                decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048)
    cfg = WhisperConfig(**c.pick(full, small))
    with torch.device(c.dev):
        m = WhisperForConditionalGeneration(cfg)
    m.train()
    opt = c.adamw(m.parameters())
    frames = 2 * cfg.max_source_positions  # Whisper's encoder takes exactly this many frames

    def loop():
        rng = c.seed(17)
        for _ in range(c.pick(10, 2)):
            b = rng.choice(c.pick([4, 8, 12, 16], [1, 2]))
            t = rng.randint(*c.pick((16, 224), (4, 16)))
            feats = torch.randn(b, cfg.num_mel_bins, frames, device=c.dev)
            labels = torch.randint(0, cfg.vocab_size, (b, t), device=c.dev)
            with c.autocast():
                loss = m(input_features=feats, labels=labels).loss
            optimize(loss, opt)

    return loop


# ---------------------------------------------------------------------------------------------
# Detection and segmentation with variable input sizes


@workload("detection: Mask R-CNN training, variable image sizes", "~8 GiB", 8)
def maskrcnn_train_varsize(c: Ctx):
    """torchvision's Mask R-CNN (ResNet-50 FPN, random init) trained on batches of 4 images of
    random sizes (480-1024 a side) with multi-scale resizing (shorter side 480-800) and 1-12
    boxes with masks per image: every batch pads to a different size, and the number of
    proposals and masks per image changes too."""
    import torchvision

    m = torchvision.models.detection.maskrcnn_resnet50_fpn(
        weights=None, weights_backbone=None, num_classes=91,
        min_size=c.pick((480, 544, 608, 672, 736, 800), (64,)), max_size=c.pick(1333, 96)).to(c.dev)
    m.train()
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    sizes = c.pick((480, 1024), (48, 96))

    def target(h, w, rng):
        n = rng.randint(1, c.pick(12, 3))
        boxes, masks = [], torch.zeros(n, h, w, dtype=torch.uint8, device=c.dev)
        for i in range(n):
            x0, y0 = rng.randint(0, w // 2), rng.randint(0, h // 2)
            x1, y1 = rng.randint(x0 + 8, w), rng.randint(y0 + 8, h)
            boxes.append([x0, y0, x1, y1])
            masks[i, y0:y1, x0:x1] = 1
        return {"boxes": torch.tensor(boxes, dtype=torch.float32, device=c.dev),
                "labels": torch.tensor([rng.randint(1, 90) for _ in range(n)], device=c.dev),
                "masks": masks}

    def loop():
        rng = c.seed(18)
        for _ in range(c.pick(6, 1)):
            shapes = [(rng.randint(*sizes), rng.randint(*sizes)) for _ in range(c.pick(4, 2))]
            images = [torch.rand(3, h, w, device=c.dev) for h, w in shapes]
            targets = [target(h, w, rng) for h, w in shapes]
            loss = sum(m(images, targets).values())
            optimize(loss, opt)

    return loop


@workload("segmentation: FCN inference, variable image sizes", "~3 GiB", 6)
def fcn_segment_infer_varsize(c: Ctx):
    """torchvision's FCN-ResNet50 (random init, fp16) segmenting batches of 1-8 images whose
    sides are random multiples of 32 in 256-768, each mask's argmax going back to the host."""
    import torchvision

    m = torchvision.models.segmentation.fcn_resnet50(weights=None, weights_backbone=None, num_classes=21,
                                                     aux_loss=False).to(c.dev, c.half).eval()
    if c.cuda:
        m = m.to(memory_format=torch.channels_last)
    lo, hi = c.pick((8, 24), (1, 2))

    def loop():
        rng = c.seed(19)
        with torch.no_grad():
            for _ in range(c.pick(24, 2)):
                b = rng.choice(c.pick([1, 2, 4, 8], [1, 2]))
                h, w = 32 * rng.randint(lo, hi), 32 * rng.randint(lo, hi)
                x = torch.randn(b, 3, h, w, device=c.dev, dtype=c.half)
                if c.cuda:
                    x = x.to(memory_format=torch.channels_last)
                m(x)["out"].argmax(1).to(torch.uint8).cpu()

    return loop


# ---------------------------------------------------------------------------------------------
# Long context, LoRA


@workload("long-context training with activation checkpointing", "~12 GiB", 8)
def llama_longctx_ckpt_train(c: Ctx):
    """A Llama (12 layers, d=1024, GQA 16/4, ~200M parameters) trained on single sequences of
    4-16K tokens with Hugging Face gradient checkpointing (non-reentrant) and SDPA attention:
    each layer's input is kept, its inside recomputed in the backward pass."""
    from transformers import LlamaForCausalLM

    cfg = small_llama_config(c, hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                             num_attention_heads=16, num_key_value_heads=4, vocab_size=32000,
                             max_position_embeddings=16384)
    with torch.device(c.dev):
        m = LlamaForCausalLM(cfg)
    m.config.use_cache = False
    m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    m.train()
    opt = c.adamw(m.parameters())

    def loop():
        rng = c.seed(20)
        for _ in range(c.pick(8, 2)):
            n = rng.choice(c.pick([4096, 8192, 12288, 16384], [32, 64]))
            x = torch.randint(0, cfg.vocab_size, (1, n), device=c.dev)
            with c.autocast():
                loss = m(input_ids=x, labels=x).loss
            optimize(loss, opt)

    return loop


class LoRALinear(nn.Module):
    """``base(x) + scale * B(A(dropout(x)))`` with the base frozen: the hand-written adapter
    used where peft is not installed (or CORPUS_LORA=manual)."""

    def __init__(self, base: nn.Linear, r: int, alpha: int):
        super().__init__()
        self.base = base
        self.a = nn.Linear(base.in_features, r, bias=False, device=base.weight.device)
        self.b = nn.Linear(r, base.out_features, bias=False, device=base.weight.device)
        nn.init.kaiming_uniform_(self.a.weight, a=math.sqrt(5))
        nn.init.zeros_(self.b.weight)
        self.scale = alpha / r
        self.dropout = nn.Dropout(0.05)

    def forward(self, x):
        return self.base(x) + self.b(self.a(self.dropout(x))) * self.scale


@workload("LoRA fine-tuning of a frozen 1.1B model", "~20 GiB", 9)
def llama_lora_finetune(c: Ctx):
    """LoRA (r=16 on q/k/v/o) fine-tuning of a frozen bf16 Llama of ~1.1B parameters (16 layers,
    d=2048) on batches of 2-8 sequences of 256-1024 tokens. peft's adapters when peft is
    importable (and CORPUS_LORA is not "manual"), else the hand-written LoRALinear; run.py
    reports which ("lora": "peft" or "manual")."""
    from transformers import LlamaForCausalLM

    cfg = small_llama_config(c, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                             num_attention_heads=16, num_key_value_heads=16, vocab_size=32000,
                             max_position_embeddings=2048)
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]

    def frozen_base():
        torch.manual_seed(0)
        with torch.device(c.dev):
            base = LlamaForCausalLM(cfg)
        return base.to(c.bf16).requires_grad_(False)

    m = None
    if os.environ.get("CORPUS_LORA", "") != "manual":
        try:
            import peft

            m = peft.get_peft_model(frozen_base(), peft.LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05,
                                                                   target_modules=targets))
            c.info["lora"] = "peft"
        except ImportError:
            pass
        except Exception as e:  # a peft that does not fit this transformers: say so, go on by hand
            c.info["lora"] = f"manual (peft failed: {type(e).__name__}: {str(e)[:120]})"
            m = None
    if m is None:
        m = frozen_base()
        for layer in m.model.layers:
            for name in targets:
                setattr(layer.self_attn, name, LoRALinear(getattr(layer.self_attn, name), 16, 32))
        c.info.setdefault("lora", "manual")
    m.train()
    trainable = [p for p in m.parameters() if p.requires_grad]
    for p in trainable:  # adapters train in float32 (their optimizer state too), under autocast
        p.data = p.data.float()
    opt = c.adamw(trainable)

    def loop():
        rng = c.seed(21)
        for _ in range(c.pick(10, 2)):
            b = rng.choice(c.pick([2, 4, 8], [1, 2]))
            n = rng.randint(*c.pick((256, 1024), (8, 32)))
            x = torch.randint(0, cfg.vocab_size, (b, n), device=c.dev)
            with c.autocast():
                loss = m(input_ids=x, labels=x).loss
            optimize(loss, opt)

    return loop


# ---------------------------------------------------------------------------------------------
# CUDA graphs, streams


def mlp_stack(d: int, ff: int, layers: int):
    blocks = []
    for _ in range(layers):
        blocks += [nn.LayerNorm(d), nn.Linear(d, ff), nn.GELU(), nn.Linear(ff, d)]
    return nn.Sequential(*blocks)


@workload("CUDA-graph inference (bucketed decode + eager prefill)", "~1 GiB", 6)
def cuda_graph_infer(c: Ctx):
    """Serving with CUDA graphs, as vLLM does: one graph per batch bucket (1-128 rows), captured
    largest first into one shared private pool; each request copies its rows into the static
    input, replays its bucket's graph and post-processes the output eagerly (fresh tensors
    every call); every 16th request is a large "prefill" run eagerly, outside the graphs. On
    the CPU the graphs are replaced by eager calls on the static buffers."""
    d, ff, layers = c.pick((2048, 8192, 6), (32, 64, 2))
    with torch.device(c.dev):
        m = mlp_stack(d, ff, layers)
    m = m.to(c.half).eval()
    buckets = c.pick([1, 2, 4, 8, 16, 32, 64, 128], [1, 2, 4])
    static_in = torch.zeros(max(buckets), d, device=c.dev, dtype=c.half)
    graphs = {}

    def capture():
        # Graphs are captured on first use (the warm-up), under whichever allocator runs.
        side = torch.cuda.Stream(c.dev)
        side.wait_stream(torch.cuda.current_stream(c.dev))
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(3):
                m(static_in)
        torch.cuda.current_stream(c.dev).wait_stream(side)
        pool = None
        for b in sorted(buckets, reverse=True):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool), torch.no_grad():
                out = m(static_in[:b])
            pool = g.pool()
            graphs[b] = (g, out)

    def run_bucket(b):
        if c.cuda:
            g, out = graphs[b]
            g.replay()
            return out
        with torch.no_grad():
            return m(static_in[:b])

    def loop():
        if c.cuda and not graphs:
            capture()
        rng = c.seed(22)
        prefill_every = c.pick(16, 4)
        with torch.no_grad():
            for i in range(c.pick(1000, 8)):
                if i % prefill_every == prefill_every - 1:
                    x = torch.randn(c.pick(rng.choice([512, 1024, 2048]), 8), d, device=c.dev, dtype=c.half)
                    m(x).float().argmax(-1).cpu()
                    continue
                n = rng.randint(1, max(buckets))
                b = min(x for x in buckets if x >= n)
                static_in[:n].copy_(torch.randn(n, d, device=c.dev, dtype=c.half))
                y = run_bucket(b)[:n].float().softmax(-1)
                if i % 4 == 3:
                    y.argmax(-1).cpu()

    return loop


@workload("multi-stream pipeline (two stages on two streams)", "~2 GiB", 6)
def multistream_pipeline(c: Ctx):
    """A two-stage inference pipeline: pinned host batches are copied and run through stage 1
    on stream A, stage 2 runs on stream B after waiting for A, and results come back to the
    default stream. Tensors made on one stream and used on another are marked with
    record_stream, so their blocks return to the pool only when the other stream is done.
    Microbatches of 256-2048 rows (d=4096, fp16), stage 1 of one batch overlapping stage 2 of
    the one before."""
    d, ff, layers = c.pick((4096, 4096, 2), (32, 64, 1))
    with torch.device(c.dev):
        stage1, stage2 = mlp_stack(d, ff, layers), mlp_stack(d, ff, layers)
    stage1, stage2 = stage1.to(c.half).eval(), stage2.to(c.half).eval()
    rows = c.pick([256, 512, 1024, 2048], [2, 4])
    rng0 = random.Random(23)
    host = [torch.randn(rng0.choice(rows), d, dtype=c.half) for _ in range(8)]
    if c.cuda:
        host = [h.pin_memory() for h in host]
    a, b = c.new_stream(), c.new_stream()
    main = c.current_stream()

    def loop():
        c.seed(23)
        results = []
        with torch.no_grad():
            for i in range(c.pick(800, 8)):
                with c.on(a):
                    x = host[i % len(host)].to(c.dev, non_blocking=True)
                    h = stage1(x)
                if c.cuda:
                    b.wait_stream(a)
                    h.record_stream(b)
                with c.on(b):
                    y = stage2(h).float().sum(-1)
                del x, h
                if c.cuda:
                    main.wait_stream(b)
                    y.record_stream(main)
                results.append(y.mean())
                if len(results) == c.pick(32, 4):
                    torch.stack(results).cpu()
                    results.clear()
        sync(c)

    return loop


# ---------------------------------------------------------------------------------------------
# Held out: workloads added after the policy's constants were set (session 27), to check that
# its figures carry over to shapes it was never looked at on.


@workload("vision transformer training, bf16 autocast, gradient accumulation", "~12 GiB", 8)
def vit_train_amp(c: Ctx):
    """ViT-B/16 (torchvision, random init, 86M) trained on fixed 224x224 batches of 48 under
    bf16 autocast, two micro-batches accumulated per optimizer step: fixed shapes, the
    common case that every allocator should hold near 1.0."""
    from torchvision.models import VisionTransformer

    side, patch, layers, heads, hidden, mlp, batch = c.pick((224, 16, 12, 12, 768, 3072, 48), (32, 16, 2, 2, 32, 64, 2))
    with torch.device(c.dev):
        m = VisionTransformer(image_size=side, patch_size=patch, num_layers=layers, num_heads=heads,
                              hidden_dim=hidden, mlp_dim=mlp, num_classes=1000)
    opt = c.adamw(m.parameters())

    def loop():
        c.seed(31)
        for step in range(c.pick(8, 2)):
            x = torch.randn(batch, 3, side, side, device=c.dev)
            y = torch.randint(0, 1000, (batch,), device=c.dev)
            with c.autocast():
                loss = F.cross_entropy(m(x).float(), y, label_smoothing=0.1) / 2
            loss.backward()
            if step % 2 == 1:
                opt.step()
                opt.zero_grad(set_to_none=True)

    return loop


@workload("text encoder-decoder training (T5), variable source and target lengths", "~10 GiB", 8)
def t5_train_varlen(c: Ctx):
    """T5-small-sized (d=512, 6+6 layers, 60M) seq2seq training with dynamic padding: batches
    of 8-32 pairs, sources of 64-512 tokens and targets of 16-128, each batch padded to its
    longest, as a summarisation or translation fine-tune runs."""
    from transformers import T5Config, T5ForConditionalGeneration

    full = dict(d_model=512, d_ff=2048, d_kv=64, num_layers=6, num_decoder_layers=6, num_heads=8, vocab_size=32128)
    tiny = dict(d_model=32, d_ff=64, d_kv=16, num_layers=2, num_decoder_layers=2, num_heads=2, vocab_size=256)
    cfg = T5Config(decoder_start_token_id=0, pad_token_id=0, **c.pick(full, tiny))
    with torch.device(c.dev):
        m = T5ForConditionalGeneration(cfg)
    m.train()
    opt = c.adamw(m.parameters())

    def loop():
        rng = c.seed(32)
        for _ in range(c.pick(10, 2)):
            b = rng.choice(c.pick([8, 16, 24, 32], [1, 2]))
            src_lens = [rng.randint(*c.pick((64, 512), (4, 16))) for _ in range(b)]
            tgt_lens = [rng.randint(*c.pick((16, 128), (2, 8))) for _ in range(b)]
            src = torch.randint(1, cfg.vocab_size, (b, max(src_lens)), device=c.dev)
            mask = torch.zeros_like(src)
            labels = torch.randint(1, cfg.vocab_size, (b, max(tgt_lens)), device=c.dev)
            for i, (n, t) in enumerate(zip(src_lens, tgt_lens)):
                mask[i, :n] = 1
                labels[i, t:] = -100
            with c.autocast():
                loss = m(input_ids=src, attention_mask=mask, labels=labels).loss
            optimize(loss, opt)

    return loop


class DiTBlock(nn.Module):
    """A DiT block with adaLN-Zero: the conditioning sets each sublayer's shift, scale and gate."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.n1 = nn.LayerNorm(d, elementwise_affine=False)
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)
        self.n2 = nn.LayerNorm(d, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(approximate="tanh"), nn.Linear(4 * d, d))
        self.ada = nn.Sequential(nn.SiLU(), nn.Linear(d, 6 * d))

    def forward(self, x, cond):
        b, l, d = x.shape
        s1, c1, g1, s2, c2, g2 = self.ada(cond)[:, None].chunk(6, dim=-1)
        h = self.n1(x) * (1 + c1) + s1
        q, k, v = self.qkv(h).view(b, l, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + g1 * self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, l, d))
        return x + g2 * self.mlp(self.n2(x) * (1 + c2) + s2)


class DiT(nn.Module):
    """A latent diffusion transformer over 4-channel latents, patch 2, class-conditioned."""

    def __init__(self, d: int, heads: int, layers: int, classes: int = 1000, patch: int = 2):
        super().__init__()
        self.d, self.patch = d, patch
        self.inp = nn.Conv2d(4, d, patch, patch)
        self.temb = nn.Sequential(nn.Linear(256, d), nn.SiLU(), nn.Linear(d, d))
        self.cemb = nn.Embedding(classes + 1, d)  # the last class: unconditional
        self.blocks = nn.ModuleList([DiTBlock(d, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(d, elementwise_affine=False)
        self.out = nn.Linear(d, patch * patch * 4)

    def forward(self, x, t, y):
        b, _, hh, ww = x.shape
        p = self.patch
        h = self.inp(x).flatten(2).transpose(1, 2)
        pos = timestep_embedding(torch.arange(h.shape[1], device=x.device), self.d).to(h.dtype)
        h = h + pos[None]
        cond = self.temb(timestep_embedding(t, 256).to(h.dtype)) + self.cemb(y)
        for block in self.blocks:
            h = block(h, cond)
        h = self.out(self.norm(h))
        return h.view(b, hh // p, ww // p, p, p, 4).permute(0, 5, 1, 3, 2, 4).reshape(b, 4, hh, ww)


@workload("diffusion (DiT) inference, variable resolution and batch", "~6 GiB", 8)
def dit_infer_varres(c: Ctx):
    """Class-conditional sampling with a DiT-L-sized transformer (d=1024, 24 layers, fp16) with
    classifier-free guidance (the batch doubled): each request asks for 1-8 images at 256,
    384 or 512 pixels (latents of 32-64 a side: 256-1,024 tokens), 8 Euler steps each, as an
    image-generation service runs."""
    d, heads, layers = c.pick((1024, 16, 24), (32, 2, 2))
    with torch.device(c.dev):
        m = DiT(d, heads, layers)
    m = m.to(c.half).eval()

    def loop():
        rng = c.seed(33)
        with torch.no_grad():
            for _ in range(c.pick(4, 2)):
                b = rng.choice(c.pick([1, 2, 4, 8], [1, 2]))
                side = rng.choice(c.pick([32, 48, 64], [4, 8]))
                x = torch.randn(b, 4, side, side, device=c.dev, dtype=c.half)
                y = torch.randint(0, 1000, (b,), device=c.dev)
                y2 = torch.cat([y, torch.full_like(y, 1000)])
                for s in torch.linspace(999, 0, 9).tolist()[:-1]:
                    t = torch.full((2 * b,), s, device=c.dev)
                    eps_c, eps_u = m(torch.cat([x, x]), t, y2).float().chunk(2)
                    eps = eps_u + 4.0 * (eps_c - eps_u)
                    x = (x.float() - eps / 8).to(c.half)
                x.float().clamp(-1, 1).cpu()  # the images go back to the caller

    return loop


@workload("graph network training, variable graph sizes", "~8 GiB", 8)
def gnn_train_varsize(c: Ctx):
    """A 3-layer GCN-style network (hidden 256) trained on random graphs of 20-150K nodes and
    8-16 edges a node, one graph a step: messages gathered per edge and summed per node with
    index_add_, so every activation's size follows the graph's node or edge count."""
    feat, hidden, classes = c.pick((128, 256, 40), (8, 16, 4))
    with torch.device(c.dev):
        layers = nn.ModuleList([nn.Linear(feat, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)])
        head = nn.Linear(hidden, classes)
    params = list(layers.parameters()) + list(head.parameters())
    opt = c.adamw(params)

    def loop():
        rng = c.seed(34)
        for _ in range(c.pick(12, 2)):
            n = rng.randint(*c.pick((20000, 150000), (20, 50)))
            e = n * rng.randint(8, 16)
            src = torch.randint(0, n, (e,), device=c.dev)
            dst = torch.randint(0, n, (e,), device=c.dev)
            deg = torch.zeros(n, device=c.dev).index_add_(0, dst, torch.ones(e, device=c.dev)).clamp(min=1)
            norm = deg.rsqrt()
            h = torch.randn(n, feat, device=c.dev)
            labels = torch.randint(0, classes, (n,), device=c.dev)
            for lin in layers:
                msg = (h * norm[:, None])[src]
                agg = torch.zeros(n, h.shape[1], device=c.dev, dtype=msg.dtype).index_add_(0, dst, msg)
                h = F.relu(lin(agg * norm[:, None]))
            loss = F.cross_entropy(head(h), labels)
            optimize(loss, opt)

    return loop


@workload("recommendation (DLRM-style) training, variable batch", "~10 GiB", 8)
def dlrm_train_varbatch(c: Ctx):
    """Eight embedding-bag tables (500K x 128 each) with dense gradients, bottom and top MLPs,
    pairwise dot interactions; batches of 1-16K samples with 1-20 lookups per bag: each
    backward makes full-size gradients of every table (256 MB each) and activations that
    scale with the batch."""
    tables, rows, dim, dense = c.pick((8, 500000, 128, 13), (2, 100, 8, 4))
    with torch.device(c.dev):
        bags = nn.ModuleList([nn.EmbeddingBag(rows, dim, mode="sum") for _ in range(tables)])
        bottom = nn.Sequential(nn.Linear(dense, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, dim))
        pairs = (tables + 1) * tables // 2
        top = nn.Sequential(nn.Linear(dim + pairs, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 1))
    params = list(bags.parameters()) + list(bottom.parameters()) + list(top.parameters())
    opt = c.adamw(params)
    iu = torch.triu_indices(tables + 1, tables + 1, offset=1, device=c.dev)

    def loop():
        rng = c.seed(35)
        for _ in range(c.pick(10, 2)):
            b = rng.choice(c.pick([1024, 2048, 4096, 8192, 16384], [2, 4]))
            x = torch.randn(b, dense, device=c.dev)
            feats = [bottom(x)]
            for bag in bags:
                counts = torch.randint(1, 21, (b,), device=c.dev)
                offsets = torch.cumsum(counts, 0) - counts
                idx = torch.randint(0, rows, (int(counts.sum()),), device=c.dev)
                feats.append(bag(idx, offsets))
            z = torch.stack(feats, 1)
            inter = torch.bmm(z, z.transpose(1, 2))[:, iu[0], iu[1]]
            logit = top(torch.cat([feats[0], inter], 1)).squeeze(1)
            loss = F.binary_cross_entropy_with_logits(logit, torch.rand(b, device=c.dev).round())
            optimize(loss, opt)

    return loop


@workload("serving: continuous batching, per-request KV caches grown by concatenation", "~4 GiB", 8)
def llm_serve_contbatch(c: Ctx):
    """A decoder (8 layers, d=1024, 8 heads, fp16) served with continuous batching: up to 16
    requests in flight; a new one is admitted with a prompt of 32-512 tokens (its prefill makes
    its caches), every step decodes one token for each, appending to each request's own K and
    V with torch.cat (a new, slightly larger block per layer per token), and a request leaves
    after 16-256 tokens, freeing its caches: the allocation pattern of simple serving code."""
    d, heads, layers, vocab = c.pick((1024, 8, 8, 32000), (32, 2, 2, 256))
    hd = d // heads
    with torch.device(c.dev):
        emb = nn.Embedding(vocab, d)
        qkv = nn.ModuleList([nn.Linear(d, 3 * d, bias=False) for _ in range(layers)])
        out = nn.ModuleList([nn.Linear(d, d, bias=False) for _ in range(layers)])
        mlp = nn.ModuleList([nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d)) for _ in range(layers)])
        head = nn.Linear(d, vocab, bias=False)
    for mod in (emb, qkv, out, mlp, head):
        mod.to(c.half)

    def step(x, caches):
        """x: (B, L, d) for B requests of L new tokens each; caches[i][layer] = (K, V) or None."""
        b, l, _ = x.shape
        for j in range(layers):
            q, k, v = qkv[j](F.layer_norm(x, (d,))).view(b, l, 3, heads, hd).permute(2, 0, 3, 1, 4)
            outs = []
            for i in range(b):
                kv = caches[i][j]
                ki = k[i] if kv is None else torch.cat([kv[0], k[i]], 1)
                vi = v[i] if kv is None else torch.cat([kv[1], v[i]], 1)
                caches[i][j] = (ki, vi)
                outs.append(F.scaled_dot_product_attention(q[i : i + 1], ki[None], vi[None], is_causal=kv is None and l > 1))
            x = x + out[j](torch.cat(outs).transpose(1, 2).reshape(b, l, d))
            x = x + mlp[j](F.layer_norm(x, (d,)))
        return head(x[:, -1]).argmax(-1)

    def loop():
        rng = c.seed(36)
        active = []  # [tokens left, caches, last token]
        with torch.no_grad():
            for _ in range(c.pick(160, 6)):
                while len(active) < c.pick(16, 2) and rng.random() < 0.5:
                    prompt = torch.randint(0, vocab, (1, rng.randint(*c.pick((32, 512), (2, 8)))), device=c.dev)
                    caches = [[None] * layers]
                    tok = step(emb(prompt), caches)
                    active.append([rng.randint(*c.pick((16, 256), (2, 4))), caches[0], tok])
                if not active:
                    continue
                x = emb(torch.cat([a[2] for a in active])[:, None])
                caches = [a[1] for a in active]
                toks = step(x, caches)
                for a, t in zip(active, toks.split(1)):
                    a[0] -= 1
                    a[2] = t
                done = [a for a in active if a[0] <= 0]
                if done:
                    torch.cat([a[2] for a in done]).cpu()  # the finished answers go back
                active = [a for a in active if a[0] > 0]

    return loop


# ---------------------------------------------------------------------------------------------
# Held out in session 31: written and first run after every constant of the paging policy was
# set, and not tuned on since. Families the corpus had not covered: a recurrent network, a
# latent-diffusion VAE decoder, 3D convolutions over video.


@workload("RNN training, packed variable-length sequences (held out)", "~4 GiB", 9)
def lstm_lm_train_varlen(c: Ctx):
    """A 2-layer LSTM language model (vocabulary 32K, width 1024, cuDNN in float32, the
    output layer and loss under bf16 autocast) trained on batches of 8-32 sequences of
    32-384 tokens, packed (``pack_padded_sequence``) so that every step's activations, cuDNN
    workspace and logits follow its token count."""
    vocab, d = c.pick(32000, 101), c.pick(1024, 16)
    emb = nn.Embedding(vocab, d).to(c.dev)
    lstm = nn.LSTM(d, d, num_layers=2, batch_first=True).to(c.dev)
    head = nn.Linear(d, vocab).to(c.dev)
    params = [*emb.parameters(), *lstm.parameters(), *head.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-4)
    lo, hi = c.pick((32, 384), (2, 8))

    def loop():
        rng = c.seed(31)
        for _ in range(c.pick(16, 2)):
            b = rng.choice(c.pick([8, 12, 16, 24, 32], [2, 3]))
            lengths = sorted((rng.randint(lo, hi) for _ in range(b)), reverse=True)
            x = torch.randint(0, vocab, (b, lengths[0]), device=c.dev)
            lens = torch.tensor(lengths)
            packed = nn.utils.rnn.pack_padded_sequence(emb(x), lens, batch_first=True)
            out, _ = lstm(packed)
            target = nn.utils.rnn.pack_padded_sequence(x, lens, batch_first=True).data
            with c.autocast():
                loss = F.cross_entropy(head(out.data).float(), target)
            optimize(loss, opt)

    return loop


class VaeResBlock(nn.Module):
    """GroupNorm, SiLU, 3x3 conv, twice, with a 1x1 conv on the skip where channels change."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(32, cin), nn.Conv2d(cin, cout, 3, padding=1)
        self.n2, self.c2 = nn.GroupNorm(32, cout), nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x):
        h = self.c1(F.silu(self.n1(x)))
        h = self.c2(F.silu(self.n2(h)))
        return self.skip(x) + h


class VaeDecoder(nn.Module):
    """Stable Diffusion's VAE decoder in shape: 4 latent channels to 512, a mid block of two
    residual blocks, four up blocks of three (512, 512, 256, 128 channels; nearest x2 and a
    conv after each of the first three), then GroupNorm, SiLU and a conv to RGB: x8 per side."""

    def __init__(self, widths=(512, 512, 256, 128)):
        super().__init__()
        self.conv_in = nn.Conv2d(4, widths[0], 3, padding=1)
        self.mid = nn.Sequential(VaeResBlock(widths[0], widths[0]), VaeResBlock(widths[0], widths[0]))
        ups, cin = [], widths[0]
        for i, w in enumerate(widths):
            blocks = [VaeResBlock(cin, w), VaeResBlock(w, w), VaeResBlock(w, w)]
            if i < len(widths) - 1:
                blocks += [nn.Upsample(scale_factor=2, mode="nearest"), nn.Conv2d(w, w, 3, padding=1)]
            ups.append(nn.Sequential(*blocks))
            cin = w
        self.ups = nn.Sequential(*ups)
        self.out = nn.Sequential(nn.GroupNorm(32, cin), nn.SiLU(), nn.Conv2d(cin, 3, 3, padding=1))

    def forward(self, z):
        return self.out(self.ups(self.mid(self.conv_in(z))))


@workload("latent-diffusion VAE decoding, variable resolution (held out)", "~8 GiB", 9)
def vae_decode_varres(c: Ctx):
    """A Stable-Diffusion-shaped VAE decoder (random init, fp16) decoding requests of 1-4
    latents whose sides are random multiples of 8 in 32-128 (images of 256-1024 pixels a
    side; the larger ones 1-2 at a time), each image going back to the host as bytes."""
    m = VaeDecoder(c.pick((512, 512, 256, 128), (32, 32, 32, 32))).to(c.dev, c.half).eval()
    lo, hi = c.pick((4, 16), (1, 2))

    def loop():
        rng = c.seed(32)
        with torch.no_grad():
            for _ in range(c.pick(10, 2)):
                h, w = 8 * rng.randint(lo, hi), 8 * rng.randint(lo, hi)
                b = rng.choice([1, 2, 4] if h * w <= 64 * 64 else [1, 2])
                z = torch.randn(b, 4, h, w, device=c.dev, dtype=c.half)
                img = m(z).clamp(-1, 1)
                ((img + 1) * 127.5).to(torch.uint8).cpu()

    return loop


@workload("video training, variable clip length, 3D convolutions (held out)", "~10 GiB", 10)
def video_r2plus1d_train_varlen(c: Ctx):
    """torchvision's R(2+1)D-18 (random init, 400 classes) trained under bf16 autocast with SGD
    on batches of 8 clips of 112x112 frames, 8-32 frames long (a new length every step)."""
    import torchvision

    m = torchvision.models.video.r2plus1d_18(weights=None, num_classes=400).to(c.dev)
    opt = torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9)
    side, (lo, hi), b = c.pick(112, 32), c.pick((8, 32), (4, 8)), c.pick(8, 2)

    def loop():
        rng = c.seed(33)
        for _ in range(c.pick(10, 2)):
            t = rng.randint(lo, hi)
            x = torch.randn(b, 3, t, side, side, device=c.dev)
            y = torch.randint(0, 400, (b,), device=c.dev)
            with c.autocast():
                loss = F.cross_entropy(m(x), y)
            optimize(loss, opt)

    return loop


@workload("serving from several threads, a stream each (held out)", "~0.7 GiB", 28)
def bert_serve_threads(c: Ctx):
    """A BERT-base encoder (fp16, ``transformers``, random init) served by 4 Python threads,
    each on a CUDA stream of its own, as a simple multi-threaded server runs: every thread
    takes 24 requests of 1-16 sequences of 16-384 tokens and sends each pooled answer back to
    the host. The allocator sees 4 threads at once (thread shards by default)."""
    from transformers import BertConfig, BertModel

    cfg = BertConfig() if not c.tiny else BertConfig(hidden_size=32, num_hidden_layers=2,
                                                      num_attention_heads=2, intermediate_size=64)
    m = BertModel(cfg).to(c.dev, c.half).eval()
    threads, requests = 4, c.pick(24, 2)
    streams = [c.new_stream() for _ in range(threads)]
    lo, hi = c.pick((16, 384), (4, 16))

    def serve(t: int):
        rng = random.Random(34 + t)
        with torch.no_grad(), c.on(streams[t]):
            for _ in range(requests):
                b, n = rng.choice([1, 2, 4, 8, 16]), rng.randint(lo, hi)
                x = torch.randint(0, cfg.vocab_size, (b, n), device=c.dev)
                m(x, attention_mask=torch.ones_like(x)).pooler_output.float().cpu()

    def loop():
        c.seed(34)
        pool = [threading.Thread(target=serve, args=(t,)) for t in range(threads)]
        for th in pool:
            th.start()
        for th in pool:
            th.join()

    return loop


@workload("inference, models swapped in and out, < 1 GiB", "~0.5 GiB", 20)
def model_swap_serve(c: Ctx):
    """A server that holds one model at a time and swaps: each loop builds BERT-base (fp16,
    ``transformers``; every model is made in fp32 on the GPU, then cast), serves 12 requests of 1-16 x 16-256 tokens, drops it, then does the
    same with ViT-B/16 (torchvision, 1-32 images) and ResNet-50 (channels-last, 1-64 images).
    Every model's weights are allocated anew while the previous model's blocks sit freed in
    the cache, in other sizes: what a caching allocator keeps from one model is what the next
    must reuse or add to."""
    import torchvision
    from transformers import BertConfig, BertModel

    cfg = BertConfig() if not c.tiny else BertConfig(hidden_size=32, num_hidden_layers=2,
                                                      num_attention_heads=2, intermediate_size=64)
    requests = c.pick(12, 2)

    def bert(rng):
        with torch.device(c.dev):
            m = BertModel(cfg)
        m = m.to(c.half).eval()
        lo, hi = c.pick((16, 256), (4, 16))
        for _ in range(requests):
            b = rng.choice([1, 2, 4, 8, 16])
            x = torch.randint(0, cfg.vocab_size, (b, rng.randint(lo, hi)), device=c.dev)
            m(x, attention_mask=torch.ones_like(x)).pooler_output.float().cpu()

    def vit(rng):
        side, patch, layers, heads, hidden, mlp = c.pick((224, 16, 12, 12, 768, 3072), (32, 16, 2, 2, 32, 64))
        with torch.device(c.dev):
            m = torchvision.models.VisionTransformer(image_size=side, patch_size=patch, num_layers=layers,
                                                     num_heads=heads, hidden_dim=hidden, mlp_dim=mlp)
        m = m.to(c.half).eval()
        for _ in range(requests):
            x = torch.randn(rng.choice([1, 2, 4, 8, 16, 32]), 3, side, side, device=c.dev, dtype=c.half)
            m(x).float().softmax(-1).topk(5, dim=-1).indices.cpu()

    def resnet(rng):
        with torch.device(c.dev):
            m = torchvision.models.resnet50(weights=None)
        m = m.to(c.half).eval()
        if c.cuda:
            m = m.to(memory_format=torch.channels_last)
        side = c.pick(224, 32)
        for _ in range(requests):
            x = torch.randn(rng.choice([1, 2, 4, 8, 16, 32, 64]), 3, side, side, device=c.dev, dtype=c.half)
            if c.cuda:
                x = x.to(memory_format=torch.channels_last)
            m(x).float().softmax(-1).topk(5, dim=-1).indices.cpu()

    def loop():
        rng = c.seed(35)
        with torch.no_grad():
            for serve in (bert, vit, resnet):
                serve(rng)

    return loop


@workload("training compiled with torch.compile (Inductor), variable length", "~6 GiB", 90)
def compiled_gpt_train(c: Ctx):
    """A GPT-style decoder (12 layers, d=768, hand-written, bf16 autocast) compiled with
    ``torch.compile`` (Inductor's default mode, dynamic shapes) and trained on batches of 16
    sequences of 128-1024 tokens, in multiples of 64. Inductor's generated code frees each
    buffer at its last use and reuses buffers within a graph, so the allocator sees fewer,
    larger, differently ordered requests than eager mode makes. The compile happens in the
    warm-up loop (on the CPU smoke run the model stays eager)."""
    d, layers, heads, batch, vocab = c.pick((768, 12, 12, 16, 32000), (32, 2, 2, 2, 128))
    lo, hi = c.pick((2, 16), (1, 2))  # lengths in units of 64 tokens (8 on the CPU)
    unit = c.pick(64, 8)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
            self.ff1, self.ff2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

        def forward(self, x):
            b, n, _ = x.shape
            q, k, v = self.qkv(self.n1(x)).view(b, n, 3, heads, d // heads).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.o(a.transpose(1, 2).reshape(b, n, d))
            return x + self.ff2(F.gelu(self.ff1(self.n2(x))))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

        def forward(self, x):
            h = self.emb(x)
            for blk in self.blocks:
                h = blk(h)
            return self.head(self.norm(h))

    with torch.device(c.dev):
        m = GPT()
    opt = c.adamw(m.parameters())
    step_fn = torch.compile(m, dynamic=True) if c.cuda else m
    c.info["compiled"] = str(c.cuda)

    def loop():
        rng = c.seed(36)
        for _ in range(c.pick(10, 2)):
            n = unit * rng.randint(lo, hi)
            x = torch.randint(0, vocab, (batch, n + 1), device=c.dev)
            with c.autocast():
                logits = step_fn(x[:, :-1])
                loss = F.cross_entropy(logits.float().view(-1, vocab), x[:, 1:].reshape(-1))
            optimize(loss, opt)

    return loop


# ---------------------------------------------------------------------------------------------
# Held out in session 35: written before any of them ran under any allocator.


@workload("generation, beam search (HF generate, 4 beams)", "~1-3 GiB", 30)
def beam_search_generate(c: Ctx):
    """A GPT-2-shaped decoder (d=1024, 16 layers, fp16, random init) through Hugging Face
    ``generate`` with beam search: 4 beams over batches of 1-8 prompts of 16-192 tokens, 24-48
    new tokens. Every step reorders the beams, so each layer's key/value cache is gathered into
    new tensors at every token, and the cache's rows multiply by the beams."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(**c.pick(dict(n_embd=1024, n_layer=16, n_head=16),
                              dict(n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=128,
                                   bos_token_id=1, eos_token_id=2)))
    with torch.device(c.dev):
        m = GPT2LMHeadModel(cfg)
    m = m.to(c.half).eval()

    def loop():
        rng = c.seed(40)
        for _ in range(c.pick(3, 1)):
            b = rng.choice(c.pick([1, 2, 4, 8], [1, 2]))
            prompt = rng.randint(*c.pick((16, 192), (4, 16)))
            new = rng.choice(c.pick([24, 32, 48], [4]))
            x = torch.randint(3, cfg.vocab_size, (b, prompt), device=c.dev)
            with torch.no_grad():
                m.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                           num_beams=4, do_sample=False, early_stopping=False, pad_token_id=0)

    return loop


@workload("generation, assisted (speculative) decoding with a draft model", "~1 GiB", 30)
def assisted_generate(c: Ctx):
    """Speculative decoding through Hugging Face ``generate(assistant_model=...)``: a draft
    decoder (d=512, 4 layers) proposes 5 tokens, the target (d=1024, 16 layers; both fp16,
    random init, one vocabulary) checks them in one pass and the rejected ones are cropped
    from both key/value caches. One prompt at a time (16-512 tokens), 32-64 new tokens: two
    caches that grow and shrink by different steps."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tiny = dict(vocab_size=256, n_positions=640, bos_token_id=1, eos_token_id=2)
    big = c.pick(dict(n_embd=1024, n_layer=16, n_head=16), dict(n_layer=2, n_embd=64, n_head=2, **tiny))
    small = c.pick(dict(n_embd=512, n_layer=4, n_head=8), dict(n_layer=1, n_embd=32, n_head=2, **tiny))
    with torch.device(c.dev):
        m, draft = GPT2LMHeadModel(GPT2Config(**big)), GPT2LMHeadModel(GPT2Config(**small))
    m, draft = m.to(c.half).eval(), draft.to(c.half).eval()
    draft.generation_config.num_assistant_tokens = 5
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    vocab = m.config.vocab_size

    def loop():
        rng = c.seed(41)
        for _ in range(c.pick(3, 1)):
            x = torch.randint(3, vocab, (1, rng.randint(*c.pick((16, 512), (4, 16)))), device=c.dev)
            new = rng.choice(c.pick([32, 48, 64], [4]))
            with torch.no_grad():
                m.generate(x, attention_mask=torch.ones_like(x), assistant_model=draft, max_new_tokens=new,
                           min_new_tokens=new, do_sample=False, pad_token_id=0)

    return loop


@workload("contrastive image-text training (CLIP), variable text length", "~10 GiB", 25)
def clip_contrastive_train(c: Ctx):
    """CLIP-style training: a ViT-S/16 image tower (torchvision, 224 px) and a 6-layer text
    transformer (d=512, 8 heads) over captions of 8-77 tokens (padded to the batch's longest),
    both projected to 512, trained with the symmetric contrastive loss over the batch's
    256 x 256 similarity matrix under bf16 autocast, AdamW. Two towers whose activations are
    held together for one backward, one of them changing shape every step."""
    from torchvision.models import VisionTransformer

    side, batch, vocab, width = c.pick((224, 256, 49408, 512), (32, 4, 256, 32))
    with torch.device(c.dev):
        image = VisionTransformer(image_size=side, patch_size=16, num_layers=c.pick(12, 1), num_heads=c.pick(6, 2),
                                  hidden_dim=c.pick(384, 32), mlp_dim=c.pick(1536, 64), num_classes=width)
        tok, pos = nn.Embedding(vocab, width), nn.Parameter(torch.zeros(77, width))
        layer = nn.TransformerEncoderLayer(width, c.pick(8, 2), 4 * width, batch_first=True, norm_first=True)
        text = nn.TransformerEncoder(layer, c.pick(6, 1), enable_nested_tensor=False)
        proj, scale = nn.Linear(width, width, bias=False), nn.Parameter(torch.tensor(math.log(1 / 0.07)))
    params = [*image.parameters(), *tok.parameters(), pos, *text.parameters(), *proj.parameters(), scale]
    opt = c.adamw(params)

    def loop():
        rng = c.seed(42)
        for _ in range(c.pick(6, 2)):
            n = rng.randint(8, 77)
            ids = torch.randint(0, vocab, (batch, n), device=c.dev)
            x = torch.randn(batch, 3, side, side, device=c.dev)
            with c.autocast():
                img = F.normalize(image(x).float(), dim=-1)
                t = text(tok(ids) + pos[:n])
                txt = F.normalize(proj(t[:, -1]).float(), dim=-1)
                logits = scale.exp() * img @ txt.t()
                labels = torch.arange(batch, device=c.dev)
                loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
            optimize(loss, opt)

    return loop


@workload("training with periodic evaluation at a larger batch (ResNet-50)", "~8 GiB", 25)
def train_with_eval(c: Ctx):
    """ResNet-50 (torchvision, random init, channels-last, bf16 autocast, SGD with momentum)
    trained on batches of 64 images of 192 px, with an evaluation pass after every third step:
    batch 256 at 224 px under ``no_grad``, top-1 back to the host. Two phases whose tensors
    differ in size and lifetime, alternating within each loop, as a validation run does."""
    import torchvision

    with torch.device(c.dev):
        m = torchvision.models.resnet50(weights=None)
    if c.cuda:
        m = m.to(memory_format=torch.channels_last)
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    train_b, train_side, eval_b, eval_side = c.pick((64, 192, 256, 224), (2, 32, 4, 48))
    fmt = torch.channels_last if c.cuda else torch.contiguous_format

    def loop():
        c.seed(43)
        for step in range(c.pick(6, 3)):
            m.train()
            x = torch.randn(train_b, 3, train_side, train_side, device=c.dev).to(memory_format=fmt)
            y = torch.randint(0, 1000, (train_b,), device=c.dev)
            with c.autocast():
                loss = F.cross_entropy(m(x).float(), y)
            optimize(loss, opt)
            if step % 3 == 2:
                m.eval()
                with torch.no_grad(), c.autocast():
                    x = torch.randn(eval_b, 3, eval_side, eval_side, device=c.dev).to(memory_format=fmt)
                    m(x).float().argmax(-1).cpu()

    return loop


@workload("inference compiled with CUDA graphs (torch.compile reduce-overhead)", "~1 GiB", 90)
def compiled_cudagraph_infer(c: Ctx):
    """A 6-layer transformer encoder (d=1024, 16 heads, fp16) compiled with
    ``torch.compile(mode="reduce-overhead")``: Inductor's code replayed through CUDA graph
    trees, whose private memory pool PyTorch manages through the allocator's graph-pool calls.
    Requests of 1-32 sequences of 128 tokens are padded to buckets of 1, 4, 8 and 32 (one
    static graph each); each output is copied to the host before the next replay reuses its
    memory. Every 8th request runs eagerly at 256 tokens, outside the graphs. The compile and
    the graphs' recording happen in the warm-up loop (on the CPU smoke run the model stays
    eager)."""
    d, heads, layers, n = c.pick((1024, 16, 6, 128), (32, 2, 1, 8))
    with torch.device(c.dev):
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, batch_first=True, norm_first=True)
        m = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
    m = m.to(c.half).eval()
    step = torch.compile(m, mode="reduce-overhead", dynamic=False) if c.cuda else m
    c.info["compiled"] = str(c.cuda)
    buckets = c.pick([1, 4, 8, 32], [1, 2])

    def loop():
        rng = c.seed(44)
        with torch.no_grad():
            for i in range(c.pick(200, 6)):
                if i % 8 == 7:
                    x = torch.randn(rng.randint(1, max(buckets)), 2 * n, d, device=c.dev, dtype=c.half)
                    m(x).float().mean(-1).cpu()
                    continue
                k = rng.randint(1, max(buckets))
                b = min(x for x in buckets if x >= k)
                x = torch.randn(b, n, d, device=c.dev, dtype=c.half)
                step(x)[:k].float().mean(-1).cpu()

    return loop


def names():
    return list(WORKLOADS)
