"""A training run's memory per rank, estimated before launch from the model's config (no weights
are built), the precision, the world size and the longest micro-batch; and whether it fits.

Pure arithmetic, no torch: `sftflow show` and planning run it in the CLI process.

What one rank holds during a step (P parameters, Pt of them trained: all, or LoRA's adapters;
`act` the bytes of the compute dtype, 4 fp32 / 2 bf16; `W` the world size):

* parameters: fp32 masters, sharded by FSDP2 (4P / W); with FSDP2 also the gathered compute copy,
  the whole model when gathered weights are kept (`reshard_after_forward` off, the CPU default),
  else the root (embeddings, head) and two blocks (the one running and the one prefetched);
* gradients: fp32, sharded (4Pt / W); with FSDP2 also the unsharded ones being reduced (all of them
  when gathered weights are kept: accumulation without sync holds them), else two blocks' worth;
* optimizer: AdamW's two fp32 moments (8Pt / W), plus one temporary the size of a moment that the foreach
  step makes (after backward, so it counts only when larger than the activations);
* activations for T tokens: per layer and token, what autograd saves (derivation at
  `layer_bytes_per_token`), SDPA's dense mask per layer (rows x row length^2; eager attention also
  keeps every head's scores; flash kernels neither), and the loss (`loss_bytes`): the output head
  and the loss run on the trained positions only, LOSS_CHUNK at a time, each chunk recomputed in
  backward (runtime/loss.py), so one chunk's fp32 log-probabilities and the two gradients of that
  size are its transient, not T x vocab of them. With activation checkpointing a layer keeps only
  its input (h per token); backward recomputes one at a time.

QLoRA (`actor.lora.quantize: nf4`): the block linears whose size allows it (core/nf4.py's rule)
hold torchao's NF4 layout instead of fp32, `core.nf4.nf4_bytes` each (codes, int8 block scales,
second-level factors: ~0.516 bytes a weight at block 64 / scaler block 256), sharded and gathered in
that layout (the gather moves 4-bit codes). Each forward and backward dequantizes one weight at a
time: a transient of `DEQUANT_BYTES` per weight of the largest quantized linear. With `quantize:
q4_1` the linears whose input width is a multiple of 32 hold GGUF's Q4_1 bytes (0.625 a weight,
core/q4_1.py), plain uint8 rows that FSDP2 shards evenly (padded) on any world size; its
dequantization (codes unpacked to a byte, then fp32 q, d x q and + m: ~13 bytes a weight) stays
within the same transient.
"""

from __future__ import annotations

from dataclasses import dataclass

from stages.core.machine.precision import cpu_speed, native_bf16
from stages.core import q4_1 as q4_1_format
from stages.core.nf4 import nf4_bytes, quantizable, scaler_block
from stages.core.machine.precision import resolve as resolve_precision
from stages.core.machine.precision import why as precision_why

__all__ = ["MARGIN", "Arch", "Batch", "Budget", "Device", "MemoryPlan", "UnknownArchitecture", "Verdict", "estimate",
           "fits", "human", "longest_batch_bound",
           "longest_batch_of", "for_config", "budget_for", "check_fits", "visible_device", "prepared_lengths",
           "loss_bytes", "LOSS_CHUNK"]

GIB = 1024 ** 3
# A plan refuses only above budget x MARGIN: the estimate measured up to 16% over the CPU peak
# (docs/operations.md, "Memory plan"), and its GPU terms (allocator caching, NCCL buffers, kernel
# workspaces) are unmeasured; inside the band it warns and runs.
MARGIN = 1.2
# The layouts `Arch` describes (dense decoder, Llama-style MLP): the builtin model (qwen2), SmolLM2
# (llama) and their kin. Others (MoE, hybrid) would be undercounted: no estimate, never a refusal.
DENSE_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


class UnknownArchitecture(ValueError):
    """A config.json whose layout the plan does not know; str() is "model_type X"."""
FLASH_KERNELS = ("flash_attention_2", "flash_attention_3", "flex_attention")
# Trained positions per output-head + loss chunk: stages/runtime/loss.py's LOSS_CHUNK (this module
# imports no torch; tests/test_memory_plan.py holds the two equal).
LOSS_CHUNK = 1024
# torchao's NF4 dequantization (NF4Tensor.get_original_weight, an fp32 base): the codes unpacked to
# two int64 halves (8 bytes a weight), looked up, scaled and stacked (3 x 4), all alive at its end
DEQUANT_BYTES = 20


@dataclass(frozen=True)
class Arch:
    """The dimensions of a decoder-only transformer (Llama / Qwen2 / Mistral layout)."""

    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    qkv_bias: bool = False

    @classmethod
    def from_hf_config(cls, c: dict) -> "Arch":
        """From a Hugging Face `config.json`; a KeyError names a missing dimension, an
        UnknownArchitecture a model type outside DENSE_MODEL_TYPES."""
        if c.get("model_type") not in DENSE_MODEL_TYPES:
            raise UnknownArchitecture(f"model_type {c.get('model_type') or 'missing'}")
        heads = c["num_attention_heads"]
        return cls(vocab=c["vocab_size"], hidden=c["hidden_size"], intermediate=c["intermediate_size"],
                   layers=c["num_hidden_layers"], heads=heads, kv_heads=c.get("num_key_value_heads") or heads,
                   head_dim=c.get("head_dim") or c["hidden_size"] // heads,
                   tied=bool(c.get("tie_word_embeddings", True)),
                   # Qwen2 always biases q, k and v; Llama-likes say so in `attention_bias`
                   qkv_bias=bool(c.get("attention_bias", c.get("model_type") in ("qwen2", "qwen2_moe"))))

    def linears(self) -> dict[str, tuple[int, int]]:
        """A block's linear layers: name -> (in features, out features)."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, self.intermediate), "up_proj": (h, self.intermediate),
                "down_proj": (self.intermediate, h)}

    def block_params(self) -> int:
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        bias = q + 2 * kv if self.qkv_bias else 0
        return sum(i * o for i, o in self.linears().values()) + bias + 2 * self.hidden  # + two RMSNorms

    def root_params(self) -> int:
        """Embeddings, the final norm and an untied head: what FSDP2's root unit holds."""
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def n_params(self) -> int:
        return self.layers * self.block_params() + self.root_params()

    def lora_params(self, r: int, targets: str | list[str]) -> int:
        """Adapter parameters: r x (in + out) per adapted linear; 'all-linear' is every block linear
        (peft leaves the output head out)."""
        names = self.linears() if targets == "all-linear" else {n: d for n, d in self.linears().items() if n in targets}
        return self.layers * sum(r * (i + o) for i, o in names.values())

    def quantized_linears(self, block_size: int, scaler_block_size: int) -> list[tuple[int, int]]:
        """A block's linears that a quantized run stores 4-bit (core/nf4.py's rule): (rows, size) each."""
        return [(o, i * o) for i, o in self.linears().values() if quantizable(i * o, block_size, scaler_block_size)]

    def q4_1_linears(self) -> list[tuple[int, int]]:
        """A block's linears that a q4_1 run stores 4-bit (input width a multiple of 32): (rows, size) each."""
        return [(o, i * o) for i, o in self.linears().values() if q4_1_format.quantizable(i)]

    def layer_bytes_per_token(self, act: int) -> int:
        """Bytes autograd keeps per token for one block, `act` the bytes of the compute dtype:

        * each RMSNorm upcasts its input to fp32 and keeps it (4h), its normalized value for the
          weight's product (act x h) and its output, the next linears' input (act x h);
        * attention with a mask (padding or packed rows) keeps q, k and v after RoPE, k and v
          repeated to every head (q's width, heads x head_dim, here `q`), its output, and that
          output made contiguous for o_proj: 5 x act x q;
        * the MLP keeps gate's and up's outputs, SiLU(gate) and their product (down_proj's
          input): 4 x act x intermediate.

        Measured (saved-tensor hooks, the builtin model, fp32): within 3% of what autograd keeps
        (tests/test_memory_plan.py).
        """
        h, q = self.hidden, self.heads * self.head_dim
        return 2 * (4 + 2 * act) * h + 5 * act * q + 4 * act * self.intermediate


@dataclass(frozen=True)
class Batch:
    """The longest micro-batch: `rows` rows of `row_len` tokens (a packed one is 1 row)."""

    rows: int
    row_len: int
    source: str  # how it was found: the prepared shards, or the bound from the config

    @property
    def tokens(self) -> int:
        return self.rows * self.row_len


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per rank."""

    world: int
    precision: str
    fsdp: bool
    keep_gathered: bool
    checkpointing: bool
    dense_attention: bool
    batch: Batch
    n_params: int
    n_trainable: int
    n_quantized: int  # base weights stored 4-bit (QLoRA); 0 without
    params: int
    grads: int
    optimizer: int
    optimizer_step: int  # the foreach step's temporary: after backward, so it overlaps no activation
    activations_full: int
    activations_checkpointed: int
    dequant: int = 0  # QLoRA: one quantized weight dequantized for its matmul (forward and backward)

    @property
    def activations(self) -> int:
        return (self.activations_checkpointed if self.checkpointing else self.activations_full) + self.dequant

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + max(self.activations, self.optimizer_step)


def nf4_shardable(rows: int, numel: int, world: int, nf4: tuple[int, int]) -> bool:
    """Whether FSDP2 splits a 4-bit weight of `rows` x (numel / rows) over `world` ranks, as
    runtime/qlora.py's `unshardable` decides: rows, blocks and second-level factors each divide by
    the world size; never on one rank."""
    if world == 1:
        return False
    block_size, scaler = nf4
    blocks = numel // block_size
    factors = blocks // (scaler_block(numel, block_size, scaler) or scaler)
    return rows % world == 0 and blocks % world == 0 and factors % world == 0 and (numel // 2) % world == 0


def longest_batch_bound(max_length: int, micro_batch_size: int, max_tokens: int, packing: bool) -> Batch:
    """The longest micro-batch the config allows before the data is prepared: `micro_batch_size`
    samples of `data.max_length`, or, with `max_tokens_per_micro_batch`, that many tokens (a sample
    longer than it is a micro-batch of its own)."""
    src = "bound: "
    if max_tokens > 0:
        return Batch(1, max(max_tokens, max_length), src + "max(actor.max_tokens_per_micro_batch, data.max_length)")
    if packing:
        return Batch(1, micro_batch_size * max_length, src + "actor.micro_batch_size x data.max_length, packed")
    return Batch(micro_batch_size, max_length, src + "actor.micro_batch_size x data.max_length, padded")


def longest_batch_of(lengths, micro_batch_size: int, max_tokens: int, packing: bool) -> Batch:
    """The longest micro-batch of prepared samples with these lengths: micro-batches are cut from
    longest-first shares (runtime/batches.py), so a padded one is at most `micro_batch_size` rows of
    the longest sample, a packed one at most the longest samples' sum."""
    ordered = sorted((int(n) for n in lengths), reverse=True)
    if not ordered:
        return Batch(1, 1, "prepared shards (empty)")
    longest = ordered[0]
    if max_tokens > 0:
        return Batch(1, max(max_tokens, longest), "prepared shards, max_tokens_per_micro_batch")
    if packing:
        return Batch(1, sum(ordered[:micro_batch_size]), "prepared shards, packed")
    return Batch(min(micro_batch_size, len(ordered)), longest, "prepared shards, padded")


def loss_bytes(arch: Arch, tokens: int, act: int, kl_to_base: bool = False) -> tuple[int, int]:
    """(bytes the token loss keeps until backward, bytes of its transient peak) for a micro-batch
    of `tokens` tokens, at most all of them trained (runtime/loss.py):

    * kept: the trained positions' final hidden states, gathered (tokens x h, the compute dtype);
      with `kl_to_base` also the base model's (no grad);
    * transient, one chunk of C = min(tokens, LOSS_CHUNK) positions at a time: its fp32
      log-probabilities and the two gradients of that size backward makes (plus the compute dtype's
      logits under bf16), as the full-logits loss has for all T (C x vocab x 12, +2 under bf16);
      with `kl_to_base` the base's logits and log-probabilities of the chunk (C x vocab x (act + 4));
      and the gathered hidden states' gradient (tokens x h).

    A single chunk is not recomputed: its log-probabilities are kept from forward instead (the same
    peak, counted in `kept`).
    """
    C = min(tokens, LOSS_CHUNK)
    logp = C * arch.vocab * 4 if tokens <= LOSS_CHUNK else 0
    kept = tokens * arch.hidden * act * (2 if kl_to_base else 1) + logp
    transient = C * arch.vocab * (12 + (act if act < 4 else 0)) + tokens * arch.hidden * act - logp
    if kl_to_base:
        transient += C * arch.vocab * (act + 4)
    return kept, transient


def estimate(arch: Arch, *, world: int, precision: str, batch: Batch, checkpointing: bool,
             lora_r: int = 0, lora_targets: str | list[str] = "all-linear", keep_gathered: bool = True,
             attn_implementation: str | None = None, kl_to_base: bool = False,
             nf4: tuple[int, int] | None = None, q4_1: bool = False) -> MemoryPlan:
    """The per-rank plan (see the module's docstring for each term). `nf4`: (block size, scaler block
    size) of a QLoRA run's 4-bit base weights; `q4_1`: they are GGUF's Q4_1 blocks instead (plain
    uint8 rows, which FSDP2 shards like any weight)."""
    P = arch.n_params()
    Pt = arch.lora_params(lora_r, lora_targets) if lora_r > 0 else P
    act = 2 if precision == "bf16" else 4
    fsdp = world > 1 or precision == "bf16"  # the worker wraps one fp32 process in nothing
    if q4_1 and lora_r > 0:
        quantized = arch.q4_1_linears()
        Q_block, whole_block = sum(q4_1_format.q4_1_bytes(n) for _, n in quantized), 0
    else:
        quantized = arch.quantized_linears(*nf4) if nf4 and lora_r > 0 else []
        Q_block = sum(nf4_bytes(n, *nf4) for _, n in quantized) if quantized else 0
        # what FSDP2 can't split evenly stays whole on every rank (runtime/qlora.py's `unshardable`)
        whole_block = sum(nf4_bytes(n, *nf4) for rows, n in quantized if not nf4_shardable(rows, n, world, nf4)) \
            if fsdp else 0
    Pq_block = sum(n for _, n in quantized)  # a block's 4-bit weights
    Pq, Q = arch.layers * Pq_block, arch.layers * Q_block
    Q_whole = arch.layers * whole_block
    block = arch.block_params() - Pq_block  # what a block holds in full precision
    if fsdp:
        gathered = P - Pq if keep_gathered else arch.root_params() + 2 * block
        Q_sharded = Q - Q_whole
        params = ((4 * (P - Pq) + Q_sharded) // world + Q_whole + act * gathered
                  + (Q_sharded if keep_gathered else 2 * (Q_block - whole_block)))
        # LoRA's unsharded gradients are the adapters' (tiny); a full model's are its units'
        grads = 4 * Pt // world + act * (Pt if keep_gathered or lora_r > 0 else min(Pt, arch.root_params() + 2 * block))
    else:
        params, grads = 4 * (P - Pq) + Q, 4 * Pt
    optimizer = 8 * Pt // world
    T = batch.tokens
    # The attention kernel: eager keeps every head's scores and probabilities; SDPA (the default)
    # keeps no scores but a dense mask per layer (rows x row length^2, the compute dtype) whenever
    # there is padding or packing; flash and flex kernels keep neither.
    square = batch.rows * batch.row_len ** 2
    mask = 0 if attn_implementation in FLASH_KERNELS else square * act
    scores = 2 * arch.heads * square * act if attn_implementation == "eager" else 0
    layer = T * arch.layer_bytes_per_token(act) + mask + scores
    # The loss: the output head on the trained positions only, chunk by chunk (loss_bytes)
    logits = sum(loss_bytes(arch, T, act, kl_to_base))
    head = T * (4 + 2 * act) * arch.hidden  # the final norm
    full = arch.layers * layer + logits + head
    # checkpointed: each block keeps its input; backward recomputes one block at a time
    checkpointed = arch.layers * T * arch.hidden * act + layer + logits + head
    return MemoryPlan(world=world, precision=precision, fsdp=fsdp, keep_gathered=fsdp and keep_gathered,
                      checkpointing=checkpointing, dense_attention=mask > 0 or scores > 0, batch=batch,
                      n_params=P, n_trainable=Pt, n_quantized=Pq, params=params, grads=grads, optimizer=optimizer,
                      optimizer_step=4 * Pt // world, activations_full=full, activations_checkpointed=checkpointed,
                      dequant=DEQUANT_BYTES * max((n for _, n in quantized), default=0))


@dataclass(frozen=True)
class Budget:
    """The memory a plan must fit: `bytes` shared by `ranks` processes (a GPU: 1; system RAM: the
    node's processes)."""

    bytes: int
    what: str
    ranks: int = 1


@dataclass(frozen=True)
class Device:
    """What training will run on, as seen before launch (no torch): a GPU or the CPU."""

    kind: str  # "cuda" | "cpu"
    name: str
    bytes: int  # a GPU's total memory, or the RAM this machine (or its cgroup) allows
    capability: tuple[int, int] | None = None  # a GPU's compute capability (nvidia-smi's compute_cap); None: unknown
    count: int = 1  # how many such GPUs are visible (0 on CPU)
    rocm: bool = False  # an AMD GPU under a ROCm build of torch
    dims: object = None  # the model's matmul shapes (core/machine/bf16_speed.Dims) a CPU's bf16 is measured at

    @property
    def cpu_bf16(self):
        """A CPU's measured bf16 speed at the model's shapes (core/machine/bf16_speed.py: cached, measured once in a
        subprocess where missing); None on a GPU or a CPU without native bf16."""
        return cpu_speed(self.dims) if self.kind == "cpu" else None

    def bf16(self, key: str = "actor.precision") -> bool:
        """Whether `auto` is bf16 here: the one rule (core/machine/precision.py) the ranks apply with torch's view
        of the same device; T4 and V100 (7.x), and CPUs where bf16 measured slower, run fp32."""
        return native_bf16(self.kind, self.capability, self.rocm, self.cpu_bf16, key)

    def precision(self, requested: str, key: str = "actor.precision") -> str:
        if requested != "auto":
            return requested
        return resolve_precision(requested, self.kind, self.capability, self.rocm, self.cpu_bf16, key)

    def precision_why(self, requested: str, key: str = "actor.precision") -> str:
        cpu = self.cpu_bf16 if requested == "auto" else None
        return precision_why(requested, self.kind, self.capability, self.rocm, cpu, key=key)


def human(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 1024 ** 2:.1f} MiB"


@dataclass(frozen=True)
class Verdict:
    """An over-budget plan: `refuse` above budget x MARGIN (a ConfigError), else a warning; `line` says why."""

    refuse: bool
    line: str


def fits(plan: MemoryPlan, budget: Budget, alternatives: dict[str, int] | None = None) -> Verdict | None:
    """None when the plan fits the budget; else a Verdict whose line says what it needs, what there
    is, and the settings that would fit (`alternatives`: setting -> the bytes the budget would then
    have to hold)."""
    need = plan.total * budget.ranks
    if need <= budget.bytes:
        return None
    refuse = need > budget.bytes * MARGIN
    per = f" per process x {budget.ranks}" if budget.ranks > 1 else ""
    parts = (f"params {human(plan.params)}, grads {human(plan.grads)}, optimizer {human(plan.optimizer)}, "
             f"activations {human(plan.activations)} for {plan.batch.tokens} tokens")
    ok = [k for k, n in (alternatives or {}).items() if n <= budget.bytes]
    hint = ("; would fit: " + " or ".join(ok)) if ok else (
        "; no single change fits: combine actor.micro_batch_size or actor.max_tokens_per_micro_batch, "
        "actor.activation_checkpointing=true, actor.lora.r, actor.lora.quantize=nf4, more processes "
        "(actor.nproc_per_node, actor.nnodes)")
    band = ("" if refuse else f"; within the estimate's {MARGIN:g}x margin, so it runs, but may run out of memory")
    return Verdict(refuse, f"actor: training needs ~{human(plan.total)}{per} ({parts}) but {budget.what} has "
                           f"{human(budget.bytes)}{band}{hint} (actor.memory_budget_gb sets the budget, 0 skips "
                           "this check)")


def largest_fitting(lo: int, hi: int, fits_at) -> int | None:
    """The largest n in [lo, hi] with fits_at(n), fits_at true up to some n; None if none."""
    if hi < lo or not fits_at(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits_at(mid) else (lo, mid - 1)
    return lo


# --------------------------------------------------------------------------- a config's plan


def visible_device(dims=None) -> Device:
    """The GPUs this process may train on, as the least of them (`core.topology.inventory`: nvidia-smi,
    or torch where nvidia-smi can't tell; no torch import here, planning runs in the CLI), with how many
    there are; else the CPU, with the machine's RAM or its cgroup's limit when smaller. `dims`: the
    model's shapes, what a CPU's bf16 is measured at."""
    import os

    from stages.core.machine.topology import inventory, torch_build
    gpus = inventory().gpus
    if gpus:
        # the plan must hold on every device a rank may get (a 1g.10gb MIG slice beside a 3g.40gb one, an
        # L4 beside an H100): the smallest memory, the lowest compute capability
        small = min(gpus, key=lambda g: g.bytes)
        caps = [g.capability for g in gpus]
        cap = None if None in caps else min(caps)
        return Device("cuda", small.name, small.bytes, cap, len(gpus), torch_build() == "rocm")
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        limit = open("/sys/fs/cgroup/memory.max").read().strip()
        ram = min(ram, int(limit)) if limit.isdigit() else ram
    except OSError:
        pass
    return Device("cpu", "CPU", ram, count=0, dims=dims)


def attention_kernel(requested: str, device: Device, packing: bool, precision: str) -> str:
    """What `actor.attn_implementation` resolves to on `device`: the worker's own rule
    (`attention.choose_attn_implementation`) on the packages installed here, without importing
    torch; None (the model's default) reads as sdpa. A ConfigError for an explicit choice that
    can't run there."""
    from .attention import choose_attn_implementation, installed_attn_implementations
    return choose_attn_implementation(requested, device.kind, packing, precision, device.capability,
                                      installed_attn_implementations(device.kind)) or "sdpa"


def prepared_lengths(folder) -> list[int] | None:
    """Tokens per prepared training sample, or None when the shards are not there or can't be read
    (a damaged folder the size check missed: the stage that reads them says what is wrong)."""
    from pathlib import Path
    if not Path(folder).is_dir():
        return None
    import pyarrow as pa  # only when prepare has run
    from stages.chatdata.shards import read_shards
    try:
        return read_shards(folder, ["length"]).column("length").to_pylist()
    except (OSError, pa.ArrowException, KeyError):
        return None


def for_config(cfg, hf_config: dict, device: Device, lengths=None, **changes) -> MemoryPlan:
    """The plan of config `cfg` (an SFTConfig) on `device`; `changes` override actor settings
    (micro_batch_size, max_tokens_per_micro_batch, activation_checkpointing, lora_r, quantize, world)."""
    a = cfg.actor
    mbs = changes.get("micro_batch_size", a.micro_batch_size)
    max_tokens = changes.get("max_tokens_per_micro_batch", a.max_tokens_per_micro_batch)
    batch = (longest_batch_of(lengths, mbs, max_tokens, a.packing) if lengths is not None
             else longest_batch_bound(cfg.data.max_length, mbs, max_tokens, a.packing))
    precision = device.precision(a.precision)
    reshard = a.reshard_after_forward if a.reshard_after_forward is not None else device.kind != "cpu"
    kernel = attention_kernel(a.attn_implementation, device, a.packing, precision)
    return estimate(Arch.from_hf_config(hf_config), world=changes.get("world", a.world_size), precision=precision,
                    batch=batch, checkpointing=changes.get("activation_checkpointing", a.activation_checkpointing),
                    lora_r=changes.get("lora_r", a.lora.r), lora_targets=a.lora.target_modules,
                    keep_gathered=not reshard, attn_implementation=kernel,
                    kl_to_base=a.kl_to_base > 0,
                    nf4=(a.lora.quantize_block_size, a.lora.quantize_scaler_block_size)
                    if changes.get("quantize", a.lora.quantize) == "nf4" else None,
                    q4_1=changes.get("quantize", a.lora.quantize) == "q4_1")


def budget_for(cfg, device: Device) -> Budget | None:
    """What the plan must fit: `actor.memory_budget_gb`, else the GPU's memory, else system RAM,
    which a node's processes share. None: no check (`actor.memory_budget_gb: 0`)."""
    a = cfg.actor
    ranks = a.nproc_per_node if device.kind == "cpu" else 1
    if a.memory_budget_gb is not None:
        return (Budget(int(a.memory_budget_gb * GIB), "actor.memory_budget_gb", ranks) if a.memory_budget_gb > 0
                else None)
    if device.kind == "cuda":
        return Budget(device.bytes, f"the GPU ({device.name})")
    return Budget(device.bytes, "system RAM" + (f" (shared by {ranks} processes)" if ranks > 1 else ""), ranks)


def check_fits(cfg, hf_config: dict, device: Device, lengths=None) -> Verdict | None:
    """None when the config's plan fits its budget; else `fits`' verdict, naming the single changes
    that would fit (within the budget itself, no margin), each at the value closest to the config's."""
    budget = budget_for(cfg, device)
    plan = for_config(cfg, hf_config, device, lengths)
    if budget is None or plan.total * budget.ranks <= budget.bytes:
        return None
    a = cfg.actor

    def need(**changes) -> int:
        world = changes.get("world", a.world_size)
        ranks = budget.ranks * world // a.world_size
        return for_config(cfg, hf_config, device, lengths, **changes).total * ranks

    alternatives: dict[str, int] = {}
    if a.max_tokens_per_micro_batch == 0:
        # the largest that fits and still divides the global batch (accumulation makes up the rest)
        m = next((m for m in range(a.micro_batch_size - 1, 0, -1)
                  if a.global_batch_size % (m * a.world_size) == 0 and need(micro_batch_size=m) <= budget.bytes), None)
        if m is not None:
            alternatives[f"actor.micro_batch_size={m}"] = need(micro_batch_size=m)
    if a.packing or a.max_tokens_per_micro_batch > 0:
        t = largest_fitting(cfg.data.max_length, plan.batch.tokens - 1,
                            lambda t: need(max_tokens_per_micro_batch=t) <= budget.bytes)
        if t is not None:
            alternatives[f"actor.max_tokens_per_micro_batch={t}"] = need(max_tokens_per_micro_batch=t)
    if not a.activation_checkpointing:
        alternatives["actor.activation_checkpointing=true"] = need(activation_checkpointing=True)
    if a.lora.r == 0:
        alternatives["actor.lora.r=16"] = need(lora_r=16)
    elif a.lora.quantize == "none":
        alternatives["actor.lora.quantize=nf4"] = need(quantize="nf4")
    world = a.world_size * 2
    while world <= 1024 and need(world=world) > budget.bytes:
        world *= 2
    if world <= 1024:
        alternatives[f"{world} processes (actor.nproc_per_node x actor.nnodes)"] = need(world=world)
    return fits(plan, budget, alternatives)
