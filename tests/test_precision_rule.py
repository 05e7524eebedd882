"""The one precision rule (stages/core/machine/precision.py) held to torch's own answer, never to the plan's:
on a patched CUDA device of each compute capability, `torch.cuda.is_bf16_supported(including_emulation=
False)` (torch's real function, which reads the device's properties) says whether bf16 is native; the
worker's `choose_precision`, the model `generation.load` returns (replay, chat, the registered chat
model) and `sftflow show --json` on the simulated machine must all say bf16 exactly there. A T4 or V100
makes bf16 tensors (torch's default `including_emulation=True` answers True there), so the rule must
not ask torch's default. On CPU `auto` follows bf16's measured speed (core/machine/bf16_speed.py): the tests
patch the calibration's clock (faster, slower, within the margin), the flags (no native bf16: never
measured) and the cache (a stale entry of another torch), and check that the plan, a rank, replay's and
chat's loader and evaluate read the same answer."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from conftest import ROOT, sftflow
from fake_gpu import FakeGPU, simulated_machine

CAPABILITIES = [(7, 0), (7, 5), (8, 0), (8, 6), (9, 0)]
NAMES = {(7, 0): "Tesla V100-SXM2-16GB", (7, 5): "Tesla T4", (8, 0): "NVIDIA A100-SXM4-80GB",
         (8, 6): "NVIDIA RTX A6000", (9, 0): "NVIDIA H100 80GB HBM3"}


@pytest.fixture
def gpu(monkeypatch):
    """A rank's view of one CUDA GPU of compute capability `cap`, on which a bf16 tensor can be made
    (emulated on 7.x): what torch.cuda's real functions read is patched, nothing above them."""
    def machine(cap: tuple[int, int], hip: str | None = None):
        props = SimpleNamespace(major=cap[0], minor=cap[1], name=NAMES.get(cap, "GPU"), total_memory=16 << 30)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
        monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: True)
        monkeypatch.setattr(torch.version, "hip", hip)
    return machine


def torch_says_native(cap, gpu) -> bool:
    gpu(cap)
    return torch.cuda.is_bf16_supported(including_emulation=False)


@pytest.mark.parametrize("cap", CAPABILITIES, ids=lambda c: f"{c[0]}.{c[1]}")
def test_the_worker_uses_bf16_exactly_where_torch_says_it_is_native(gpu, cap):
    from stages.runtime.distributed import choose_precision, precision_why
    native = torch_says_native(cap, gpu)
    assert native == (cap >= (8, 0))  # torch's own reading of the patched device
    assert torch.cuda.is_bf16_supported() is True  # the default counts emulation: a T4 "supports" bf16
    device = torch.device("cuda", 0)
    assert choose_precision("auto", device) == ("bf16" if native else "fp32")
    assert choose_precision("fp32", device) == "fp32" and choose_precision("bf16", device) == "bf16"
    assert precision_why("auto", device).startswith(("bf16" if native else "fp32") + ": auto, compute capability "
                                                   f"{cap[0]}.{cap[1]}")


def test_a_rocm_gpu_computes_bf16(gpu):
    from stages.runtime.distributed import choose_precision
    gpu((9, 4), hip="6.4")
    assert torch.cuda.is_bf16_supported(including_emulation=False)
    assert choose_precision("auto", torch.device("cuda", 0)) == "bf16"


TEST_CPU = "Test CPU @ 2.0GHz"


@pytest.fixture
def cpu(monkeypatch, tmp_path):
    """This process's CPU as the calibration sees it: `cpu(flags, speedup)` makes its flags `flags` and
    every bf16 matmul `speedup` times as fast as fp32's (the clock patched, the weighting real); the
    cache in a file of the test's own. Returns the list of measurements taken."""
    from stages.core.machine import bf16_speed
    monkeypatch.delenv(bf16_speed.ENV_PIN, raising=False)  # the suite's pin (conftest.py): this is the rule
    monkeypatch.setenv(bf16_speed.ENV_CACHE, str(tmp_path / "bf16-speed.json"))
    monkeypatch.setattr(bf16_speed, "_remembered", {})
    taken: list = []
    real = bf16_speed.measure

    def machine(flags: str = "avx512f avx512_bf16", speedup: float = 2.0):
        monkeypatch.setattr(bf16_speed, "cpu_identity", lambda cpuinfo="/proc/cpuinfo": (TEST_CPU,
                                                                                         frozenset(flags.split())))

        def patched(fp32, bf16):
            taken.append(speedup)
            return 1e-3 * speedup, 1e-3
        monkeypatch.setattr(bf16_speed, "measure", lambda dims, threads=None, cpuinfo="/proc/cpuinfo", clock=None:
                            real(dims, threads, cpuinfo, clock=patched))
        bf16_speed._remembered.clear()
        return taken
    return machine


@pytest.mark.parametrize("speedup,want", [(2.0, "bf16"), (0.6, "fp32"), (1.1, "fp32"), (1.15, "bf16")],
                         ids=["faster", "slower", "within-margin", "at-margin"])
def test_a_cpu_rank_uses_bf16_exactly_where_it_measured_faster(cpu, speedup, want):
    """The rule on a CPU with native bf16: bf16 from MARGIN (1.15x) on, fp32 below, said with the ratio;
    explicit choices are obeyed without measuring."""
    from stages.core.machine.bf16_speed import MARGIN
    from stages.runtime.distributed import choose_precision, precision_why
    assert MARGIN == 1.15
    taken = cpu("fpu avx512f avx512_bf16", speedup)
    dev = torch.device("cpu")
    assert choose_precision("bf16", dev) == "bf16" and choose_precision("fp32", dev) == "fp32"
    assert taken == []  # nothing asked `auto`: nothing measured
    assert choose_precision("auto", dev) == want
    assert choose_precision("auto", dev, key="eval.precision") == want
    n = len(taken)
    assert n > 0
    line = precision_why("auto", dev)
    ratio = f"{speedup:.2f}x fp32's speed at this model's training shapes on {TEST_CPU} (avx512_bf16)"
    ratio += f", 1 thread, torch {torch_version()} (bf16 from 1.15x)"  # a per-core ratio: bf16_speed.py says why
    assert line == (f"bf16: auto, measured {ratio}" if want == "bf16" else f"fp32: auto, bf16 measured {ratio}")
    assert "decode shapes" in precision_why("auto", dev, "eval.precision")
    assert precision_why("fp32", dev, "eval.precision") == "fp32: eval.precision=fp32 (set in the config)"
    assert len(taken) == n  # measured once: later questions read the answer


def torch_version():
    from stages.core.machine.bf16_speed import torch_version as v
    return v()


def test_a_cpu_without_native_bf16_is_fp32_unmeasured(cpu):
    from stages.runtime.distributed import choose_precision, precision_why
    taken = cpu("fpu sse2 avx2 avx512f", 3.0)  # no avx512_bf16, amx_bf16 or bf16: emulated at best
    assert choose_precision("auto", torch.device("cpu")) == "fp32"
    assert precision_why("auto", torch.device("cpu")).startswith("fp32: auto on a CPU without native bf16")
    assert taken == []


def test_the_measurement_is_cached_per_cpu_torch_and_shape_class(cpu, tmp_path, monkeypatch):
    """Measured once per (CPU, flags, torch, shape class) and written to the cache; a new process reads it
    without measuring; an entry of another torch is never read (measured again) and leaves the file."""
    from stages.core.machine import bf16_speed
    from stages.core.machine.bf16_speed import Dims
    taken = cpu("avx512_bf16 amx_bf16 amx_tile", 2.0)
    small, big = Dims(64, 128, 256, 32, 2, 16), Dims(128, 256, 512, 64, 2, 16)
    assert bf16_speed.speed(small).train == 2.0
    calls = len(taken)
    bf16_speed._remembered.clear()  # a new process
    assert bf16_speed.speed(small).train == 2.0 and len(taken) == calls
    assert bf16_speed.speed(big).train == 2.0 and len(taken) == 2 * calls  # another shape class: measured
    cache = json.loads((tmp_path / "bf16-speed.json").read_text())
    assert sorted(cache) == sorted(bf16_speed.cache_key(d) for d in (small, big))
    assert all(TEST_CPU in k and f"torch {torch_version()}" in k for k in cache)
    assert cache[bf16_speed.cache_key(small)]["shape_class"] == small.shape_class
    # the same CPU after an upgrade of torch: its entries are stale
    monkeypatch.setattr(bf16_speed, "torch_version", lambda: "9.9.9+cpu")
    bf16_speed._remembered.clear()
    cpu("avx512_bf16 amx_bf16 amx_tile", 0.5)
    assert bf16_speed.speed(small).train == 0.5
    assert list(json.loads((tmp_path / "bf16-speed.json").read_text())) == [bf16_speed.cache_key(small)]
    assert "torch 9.9.9+cpu" in bf16_speed.cache_key(small)
    # a damaged cache is measured again, never trusted
    (tmp_path / "bf16-speed.json").write_text("{not json")
    bf16_speed._remembered.clear()
    before = len(taken)
    assert bf16_speed.speed(small).train == 0.5 and len(taken) > before


def test_the_ratio_weights_each_part_by_how_often_a_step_runs_it():
    """A step's ratio: a layer's time times the layers plus the head's, a head timed on a slice of its
    columns counted at its full width; a big model's layer is timed on fewer rows. Checked with a clock
    whose times the test chooses, per part: (fp32 seconds, bf16 seconds)."""
    from stages.core.machine import bf16_speed
    from stages.core.machine.bf16_speed import Dims
    d = Dims(hidden=64, intermediate=256, vocab=100_000, kv=32, layers=3, head_dim=16)
    times = iter([(2.0, 1.0), (1.0, 1.0),   # training: a layer 2x faster in bf16, the head no faster
                  (1.0, 2.0), (3.0, 1.0)])  # decoding: a layer 2x slower in bf16, the head 3x faster
    train, generate = bf16_speed._timings(d, clock=lambda fp32, bf16: next(times))
    rows = bf16_speed.layer_rows(d, bf16_speed.TRAIN_ROWS)
    assert rows == bf16_speed.TRAIN_ROWS  # a small layer is timed at a whole micro-batch
    head = 100_000 / int(bf16_speed.FLOP_BUDGET // (6 * rows * 64))  # the head's columns it stands for
    assert train == pytest.approx((3 * 2.0 + head * 1.0) / (3 * 1.0 + head * 1.0))
    decode_head = 100_000 / min(100_000, bf16_speed.BYTE_BUDGET // (4 * 64))  # 1: the whole head fits its budget
    assert generate == pytest.approx((3 * 1.0 + decode_head * 3.0) / (3 * 2.0 + decode_head * 1.0))
    big = Dims(hidden=4096, intermediate=11008, vocab=32000, kv=1024, layers=32, head_dim=128)
    assert bf16_speed.layer_rows(big, bf16_speed.TRAIN_ROWS) == bf16_speed.MIN_ROWS


def test_the_timed_layer_is_a_decoder_layer():
    """What the calibration times computes what a Llama layer computes (transformers' own, same weights):
    the clock measures the work the worker does, not a stand-in."""
    import torch
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from stages.core.machine import bf16_speed
    from stages.core.machine.bf16_speed import Dims
    c = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, rms_norm_eps=1e-6, attn_implementation="sdpa")
    ref = LlamaDecoderLayer(c, 0).eval()
    d = Dims.from_hf_config(c.to_dict())
    w = bf16_speed._weights(d, torch.Generator().manual_seed(0), grad=False)
    names = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
             "g": "mlp.gate_proj", "u": "mlp.up_proj", "dn": "mlp.down_proj", "n1": "input_layernorm",
             "n2": "post_attention_layernorm"}
    with torch.no_grad():
        for k, n in names.items():
            ref.get_submodule(n).weight.copy_(w[k])
        x = torch.randn(1, 10, 64)
        pos = torch.arange(10)[None]
        cos, sin = LlamaRotaryEmbedding(c)(x, pos)
        # without rotary embeddings on both sides: the calibration leaves them out (elementwise, a sliver)
        want = ref(x, position_embeddings=(torch.ones_like(cos), torch.zeros_like(sin)), attention_mask=None,
                   position_ids=pos)
        want = want[0] if isinstance(want, tuple) else want
        got = bf16_speed._layer(x, w, d)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_calibration_runs_in_a_process_without_torch(tmp_path):
    """Planning never imports torch: it measures in `python -m stages.core.machine.bf16_speed`, which prints one
    Speed; the real clock on this machine gives positive ratios."""
    import subprocess
    import sys
    from stages.core.machine.bf16_speed import Dims, Speed
    out = subprocess.run([sys.executable, "-m", "stages.core.machine.bf16_speed",
                          json.dumps({"hidden": 64, "intermediate": 128, "vocab": 256, "kv": 32, "layers": 2,
                                      "head_dim": 16}),
                          "--threads", "1"], cwd=ROOT, capture_output=True, text=True, check=True)
    speed = Speed(**json.loads(out.stdout.strip().splitlines()[-1]))
    assert speed.train > 0 and speed.generate > 0 and speed.threads == 1
    assert speed.shape_class == Dims(64, 128, 256, 32, 2, 16).shape_class


@pytest.mark.parametrize("speedup", [2.0, 0.6], ids=["bf16-faster", "bf16-slower"])
def test_show_the_fingerprints_and_the_ranks_read_one_measurement(tmp_path, monkeypatch, cpu, speedup):
    """`sftflow show` (the plan, torch-free) on a CPU where bf16 measured faster and slower: training and
    scoring in the rule's precision, said with the ratio; the scoring stages' fingerprints carry it (a
    folder scored in fp32 is never reused as bf16), training's does not; and the ranks' rule (worker,
    replay, evaluate, generation.load) reads the same cached entry, at the base model's shapes."""
    from typer.testing import CliRunner

    import flows.cli
    from conftest import base_model, tiny_config_dict, write_config
    from stages.core.config import load_config
    from stages.evaluate.runner import load_model
    from stages.inference.generation import load
    from stages.pipeline import plan
    from stages.runtime.distributed import choose_precision
    from stages.core.machine import bf16_speed
    raw = tiny_config_dict(tmp_path)
    raw["actor"]["precision"] = raw["eval"]["precision"] = "auto"
    path = write_config(tmp_path, raw)
    cpu("avx512f avx512_bf16", 0.6)
    before = plan(load_config(path)).fingerprints
    assert plan(load_config(path)).facts["actor_precision"] == "fp32"
    monkeypatch.setenv(bf16_speed.ENV_CACHE, str(tmp_path / "another-machine.json"))  # the same CPU elsewhere
    taken = cpu("avx512f avx512_bf16", speedup)
    taken.clear()
    p = plan(load_config(path))
    want = "bf16" if speedup > 1.15 else "fp32"
    assert p.facts["actor_precision"] == p.facts["eval_precision"] == want
    for stage in ("baseline", "evaluate"):
        assert (p.fingerprints[stage] != before[stage]) == (want == "bf16")
    assert p.fingerprints["train"] == before["train"]
    measured = len(taken)
    assert measured > 0
    result = CliRunner().invoke(flows.cli.app, ["show", "-c", str(path), "--json"])
    assert result.exit_code == 0, result.output
    launch = json.loads(result.output)["launch"]
    assert launch["precision"] == launch["eval_precision"] == want
    assert launch["device"]["bf16"]["measured"] == {"train": speedup, "generate": speedup}
    assert launch["device"]["bf16"]["cpu"] == f"{TEST_CPU} (avx512_bf16)"
    verb = "measured" if want == "bf16" else "bf16 measured"
    assert launch["precision_why"].startswith(f"{want}: auto, {verb} {speedup:.2f}x fp32's speed at this model's "
                                              "training shapes")
    assert launch["eval_precision_why"].startswith(f"{want}: auto, {verb} {speedup:.2f}x fp32's speed at this "
                                                   "model's decode shapes")
    shown = CliRunner().invoke(flows.cli.app, ["show", "-c", str(path)])
    assert f"training in {want}: auto, {verb} {speedup:.2f}x" in " ".join(shown.output.split())
    # the ranks: the built base model's config.json names the shapes the plan measured at
    cfg = load_config(path)
    folder = base_model(cfg)
    dev = torch.device("cpu")
    assert choose_precision("auto", dev, folder) == want
    model, _ = load_model(cfg, {"kind": "hf", "path": folder}, folder, dev)
    assert next(model.parameters()).dtype == (torch.bfloat16 if want == "bf16" else torch.float32)
    model, _ = load(folder, device="cpu")
    assert model.sftflow_precision == want
    assert len(taken) == measured  # one measurement served the plan, show and every rank


@pytest.mark.parametrize("cap", [(7, 5), (8, 0)], ids=["T4", "A100"])
def test_generation_loads_the_model_in_the_rules_precision(gpu, cap, tmp_path, monkeypatch):
    """generation.load (replay, chat, the registered chat model) on the patched GPU: the weights' dtype
    is torch's native answer; `precision` from the config overrides it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from stages.inference.generation import load
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(tmp_path / "m")
    import transformers
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: "tokenizer")
    real_to = torch.nn.Module.to

    def to(self, *args, **kwargs):  # the CPU build has no CUDA: the move is a no-op, a dtype still applies
        args = tuple(a for a in args if not (isinstance(a, (torch.device, str)) and str(a).startswith("cuda")))
        kwargs.pop("device", None)
        return real_to(self, *args, **kwargs) if args or kwargs else self
    monkeypatch.setattr(torch.nn.Module, "to", to)
    native = torch_says_native(cap, gpu)
    model, _ = load(str(tmp_path / "m"), device="cuda")
    assert next(model.parameters()).dtype == (torch.bfloat16 if native else torch.float32)
    assert model.sftflow_precision == ("bf16" if native else "fp32")
    model, _ = load(str(tmp_path / "m"), device="cuda", precision="fp32")
    assert next(model.parameters()).dtype == torch.float32


def test_show_json_says_what_torch_says_on_each_capability(tmp_path, gpu):
    """The torch-free plan (nvidia-smi's compute_cap) on the simulated machine of each capability:
    `sftflow show --json`'s precision is torch's answer for a device of that capability."""
    expected = {cap: "bf16" if torch_says_native(cap, gpu) else "fp32" for cap in CAPABILITIES}
    seen = {}
    for cap in CAPABILITIES:
        machine = simulated_machine(tmp_path / f"m{cap[0]}{cap[1]}", [FakeGPU(NAMES[cap], 81920,
                                                                             f"{cap[0]}.{cap[1]}")])
        proc = sftflow("show", "-c", str(ROOT / "configs" / "default.yaml"), "--json",
                       f"artifacts_dir={tmp_path / 'artifacts'}", cwd=ROOT,
                       env={**machine, "PREFECT_HOME": str(tmp_path / ".prefect"), "CUDA_VISIBLE_DEVICES": None},
                       fresh=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
        launch = json.loads(proc.stdout)["launch"]
        seen[cap] = launch["precision"]
        assert launch["eval_precision"] == launch["precision"]  # scoring follows the same rule by default
        assert launch["precision_why"].startswith(f"{seen[cap]}: auto, compute capability {cap[0]}.{cap[1]}")
    assert seen == expected
    assert [seen[c] for c in CAPABILITIES] == ["fp32", "fp32", "bf16", "bf16", "bf16"]


@pytest.mark.parametrize("asked,speedup,dtype", [("fp32", 2.0, torch.float32), ("bf16", 0.6, torch.bfloat16),
                                                 ("auto", 0.6, torch.float32), ("auto", 2.0, torch.bfloat16)])
def test_evaluation_scores_in_eval_precision_whatever_training_used(tmp_path, cpu, asked, speedup, dtype):
    """evaluate, baseline and champion load the scored model in `eval.precision` (`auto`: the rule, also
    when training ran in bf16), so every model of a comparison is scored alike."""
    from conftest import base_model, tiny_config_dict
    from stages.core.config import config_from_dict
    from stages.evaluate.runner import load_model
    cpu("avx512_bf16", speedup)
    raw = tiny_config_dict(tmp_path)
    raw["actor"]["precision"] = "bf16"
    raw.setdefault("eval", {})["precision"] = asked
    cfg = config_from_dict(raw)
    folder = base_model(cfg)
    model, _ = load_model(cfg, {"kind": "hf", "path": folder}, folder, torch.device("cpu"))
    assert next(model.parameters()).dtype == dtype


def test_a_comparison_of_a_bf16_and_an_fp32_scoring_is_refused():
    """Paired comparisons (evaluate against the baseline, register against the champion) are made in one
    precision: records that say they were computed apart are a ValueError naming both."""
    from stages.core.stats.paired import compare_sets
    rows = [{"reference": "a", "prompt": [{"role": "user", "content": str(i)}], "correct": i % 2 == 0}
            for i in range(4)]
    mine = {"val": [{**r, "precision": "bf16"} for r in rows]}
    assert compare_sets(mine, {"val": [{**r, "precision": "bf16"} for r in rows]}, "the baseline")["val"]["n"] == 4
    assert compare_sets(mine, {"val": rows}, "the baseline")["val"]["n"] == 4  # before precision was recorded
    with pytest.raises(ValueError, match=r"the baseline was scored in fp32, this model in bf16 \(eval set 'val'\)"):
        compare_sets(mine, {"val": [{**r, "precision": "fp32"} for r in rows]}, "the baseline")
