"""Model import: a ModelGraph (config + ops + weights by HF state-dict key) from a preset, a checkpoint dir or a model.

Sources:
  * a named shape preset with seeded random weights (no downloads): ``toy``, ``llama-3.2-1b``, ``llama-3.2-3b``,
    ``llama-3.1-8b``, ``qwen3-0.6b``, ``qwen3-1.7b`` (exact public shapes);
  * a Hugging Face checkpoint directory (config.json + model.safetensors, or a sharded model.safetensors.index.json);
  * a ``transformers`` model object (its config + state dict).
Families: Llama (incl. Llama-3 rope scaling), Qwen2 (QKV bias), Qwen3 (QK-norm), Mistral (sliding window); tied or
untied LM head; GQA. Anything else is a ``GraphError`` naming the architecture and listing the supported ones.
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import Any, Callable

import torch

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "mistral")
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


class GraphError(ValueError):
    """Bad model input: unknown preset/architecture, missing files or weights, wrong shapes, bad dtype."""


@dataclasses.dataclass
class ModelConfig:
    arch: str
    vocab: int
    hidden: int
    intermediate: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None      # {"rope_type": "llama3"|"linear", ...}
    tie_embeddings: bool = False
    attn_bias: bool = False               # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False                 # RMSNorm on q and k per head (Qwen3)
    sliding_window: int | None = None     # Mistral
    max_position: int = 4096

    @property
    def group(self) -> int:
        return self.n_heads // self.n_kv_heads

    def to_hf(self):
        """The equivalent transformers config object."""
        import transformers
        cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig}[self.arch]
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope = {**self.rope_scaling, "rope_theta": self.rope_theta}
        kw: dict[str, Any] = dict(vocab_size=self.vocab, hidden_size=self.hidden, intermediate_size=self.intermediate,
                                  num_hidden_layers=self.n_layers, num_attention_heads=self.n_heads,
                                  num_key_value_heads=self.n_kv_heads, head_dim=self.head_dim,
                                  rms_norm_eps=self.rms_eps, tie_word_embeddings=self.tie_embeddings,
                                  max_position_embeddings=self.max_position, rope_parameters=rope)
        if self.arch == "llama":
            kw["attention_bias"] = self.attn_bias
        if self.arch == "mistral":
            kw["sliding_window"] = self.sliding_window
        cfg = cls(**kw)
        cfg._attn_implementation = "eager"
        return cfg


def config_from_hf(d: dict) -> ModelConfig:
    """ModelConfig from a config.json dict (transformers 4.x 'rope_scaling' or 5.x 'rope_parameters' style)."""
    arch = str(d.get("model_type", "")).lower()
    if arch not in SUPPORTED_ARCHS:
        names = d.get("architectures") or [arch or "<missing model_type>"]
        raise GraphError(f"unsupported architecture {names[0]!r} (model_type {arch!r}); "
                         f"supported model types: {', '.join(SUPPORTED_ARCHS)}")
    try:
        n_heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        rp = d.get("rope_parameters") or {}
        theta = float(rp.get("rope_theta", d.get("rope_theta", 10000.0)))
        scaling = d.get("rope_scaling") or ({k: v for k, v in rp.items() if k != "rope_theta"} if rp else None)
        if scaling:
            scaling = dict(scaling)
            rtype = scaling.get("rope_type", scaling.get("type", "default"))
            scaling["rope_type"] = rtype
            scaling.pop("type", None)
            if rtype == "default":
                scaling = None
            elif rtype not in ("llama3", "linear"):
                raise GraphError(f"unsupported rope_type {rtype!r} (supported: default, linear, llama3)")
        window = None
        if arch == "mistral" or (arch in ("qwen2", "qwen3") and d.get("use_sliding_window")):
            window = d.get("sliding_window")
            window = int(window) if window else None
        return ModelConfig(
            arch=arch, vocab=int(d["vocab_size"]), hidden=hidden, intermediate=int(d["intermediate_size"]),
            n_layers=int(d["num_hidden_layers"]), n_heads=n_heads,
            n_kv_heads=int(d.get("num_key_value_heads") or n_heads),
            head_dim=int(d.get("head_dim") or hidden // n_heads), rms_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=theta, rope_scaling=scaling, tie_embeddings=bool(d.get("tie_word_embeddings", False)),
            attn_bias=(arch == "qwen2") or bool(d.get("attention_bias", False)), qk_norm=(arch == "qwen3"),
            sliding_window=window, max_position=int(d.get("max_position_embeddings", 4096)))
    except KeyError as e:
        raise GraphError(f"config.json is missing required field {e.args[0]!r}") from None


_LLAMA3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
PRESETS: dict[str, ModelConfig] = {
    "toy": ModelConfig("llama", 313, 96, 176, 2, 6, 2, 16, 1e-5, 10000.0, None, False, max_position=512),
    "llama-3.2-1b": ModelConfig("llama", 128256, 2048, 8192, 16, 32, 8, 64, 1e-5, 500000.0, _LLAMA3, True,
                                max_position=131072),
    "llama-3.2-3b": ModelConfig("llama", 128256, 3072, 8192, 28, 24, 8, 128, 1e-5, 500000.0, _LLAMA3, True,
                                max_position=131072),
    "llama-3.1-8b": ModelConfig("llama", 128256, 4096, 14336, 32, 32, 8, 128, 1e-5, 500000.0,
                                {**_LLAMA3, "factor": 8.0}, False, max_position=131072),
    "qwen3-0.6b": ModelConfig("qwen3", 151936, 1024, 3072, 28, 16, 8, 128, 1e-6, 1000000.0, None, True,
                              qk_norm=True, max_position=40960),
    "qwen3-1.7b": ModelConfig("qwen3", 151936, 2048, 6144, 28, 16, 8, 128, 1e-6, 1000000.0, None, True,
                              qk_norm=True, max_position=40960),
}


def weight_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF state-dict key the model needs, with its shape."""
    H, I, hd = c.hidden, c.intermediate, c.head_dim
    s: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab, H), "model.norm.weight": (H,)}
    if not c.tie_embeddings:
        s["lm_head.weight"] = (c.vocab, H)
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        s[p + "input_layernorm.weight"] = (H,)
        s[p + "post_attention_layernorm.weight"] = (H,)
        s[p + "self_attn.q_proj.weight"] = (c.n_heads * hd, H)
        s[p + "self_attn.k_proj.weight"] = (c.n_kv_heads * hd, H)
        s[p + "self_attn.v_proj.weight"] = (c.n_kv_heads * hd, H)
        s[p + "self_attn.o_proj.weight"] = (H, c.n_heads * hd)
        if c.attn_bias:
            s[p + "self_attn.q_proj.bias"] = (c.n_heads * hd,)
            s[p + "self_attn.k_proj.bias"] = (c.n_kv_heads * hd,)
            s[p + "self_attn.v_proj.bias"] = (c.n_kv_heads * hd,)
        if c.qk_norm:
            s[p + "self_attn.q_norm.weight"] = (hd,)
            s[p + "self_attn.k_norm.weight"] = (hd,)
        s[p + "mlp.gate_proj.weight"] = (I, H)
        s[p + "mlp.up_proj.weight"] = (I, H)
        s[p + "mlp.down_proj.weight"] = (H, I)
    return s


def lm_head_key(c: ModelConfig) -> str:
    return "model.embed_tokens.weight" if c.tie_embeddings else "lm_head.weight"


def rope_inv_freq(c: ModelConfig) -> torch.Tensor:
    """fp32 [head_dim/2] inverse frequencies, including Llama-3 / linear scaling (as HF computes them)."""
    hd = c.head_dim
    inv = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    sc = c.rope_scaling
    if not sc:
        return inv
    if sc["rope_type"] == "linear":
        return inv / float(sc["factor"])
    factor, lo, hi = float(sc["factor"]), float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
    old = float(sc["original_max_position_embeddings"])
    lo_wl, hi_wl = old / lo, old / hi
    wl = 2 * math.pi / inv
    inv_l = torch.where(wl > lo_wl, inv / factor, inv)
    smooth = (old / wl - lo) / (hi - lo)
    smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
    medium = ~(wl < hi_wl) & ~(wl > lo_wl)
    return torch.where(medium, smoothed, inv_l)


@dataclasses.dataclass
class GraphOp:
    """One logical op of the model graph (what the lowering tiles)."""
    kind: str                 # embed | rmsnorm | qkv_rope | attention | o_proj_residual | gate_up_silu | down_residual | lm_head | argmax
    layer: int                # -1 outside the layer stack
    weights: tuple[str, ...]  # state-dict keys read


class ModelGraph:
    """config + ops + weights by state-dict key. Preset weights are generated lazily on first access of
    ``.weights`` (lowering needs only the config), so ``amk compile --no-verify`` never materializes them."""

    def __init__(self, name: str, config: ModelConfig, weights: dict[str, torch.Tensor] | None, dtype: str = "f32",
                 factory: Callable[[], dict[str, torch.Tensor]] | None = None):
        if weights is None and factory is None:
            raise GraphError("ModelGraph needs weights or a weight factory")
        self.name, self.config, self.dtype = name, config, dtype
        self._weights, self._factory = weights, factory

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        if self._weights is None:
            self._weights = self._factory()
        return self._weights

    def __repr__(self) -> str:
        return f"ModelGraph({self.name!r}, {self.config.arch}, dtype={self.dtype})"

    @property
    def ops(self) -> list[GraphOp]:
        c, ops = self.config, [GraphOp("embed", -1, ("model.embed_tokens.weight",))]
        for i in range(c.n_layers):
            p = f"model.layers.{i}."
            ops += [GraphOp("rmsnorm", i, (p + "input_layernorm.weight",)),
                    GraphOp("qkv_rope", i, tuple(p + f"self_attn.{x}_proj.weight" for x in "qkv")),
                    GraphOp("attention", i, ()),
                    GraphOp("o_proj_residual", i, (p + "self_attn.o_proj.weight",)),
                    GraphOp("rmsnorm", i, (p + "post_attention_layernorm.weight",)),
                    GraphOp("gate_up_silu", i, (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight")),
                    GraphOp("down_residual", i, (p + "mlp.down_proj.weight",))]
        ops += [GraphOp("rmsnorm", -1, ("model.norm.weight",)), GraphOp("lm_head", -1, (lm_head_key(c),)),
                GraphOp("argmax", -1, ())]
        return ops

    @property
    def weight_bytes(self) -> int:
        """Bytes of weight storage (from the shapes; does not materialize lazy weights)."""
        isz = torch.empty((), dtype=DTYPES[self.dtype]).element_size()
        return sum(math.prod(s) for s in weight_shapes(self.config).values()) * isz

    def hf_model(self, dtype: str | None = None, device: str = "cpu", weights: dict | None = None):
        """A transformers eager model holding the same weights (shared storage where dtype/device match).
        ``weights`` overrides the tensors used (e.g. fp32 copies already held by a ReferenceVM)."""
        import transformers
        cfg = self.config.to_hf()
        cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
               "qwen3": transformers.Qwen3ForCausalLM, "mistral": transformers.MistralForCausalLM}[self.config.arch]
        tdt = DTYPES[dtype or self.dtype]
        with torch.device("meta"):
            model = cls(cfg)
        sd = {k: v.to(device=device, dtype=tdt) for k, v in (weights or self.weights).items()}
        if self.config.tie_embeddings:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        model.load_state_dict(sd, strict=False, assign=True)
        if self.config.tie_embeddings:
            model.tie_weights()
        # Buffers that are not in the state dict (rotary inv_freq) are rebuilt on the real device.
        for name, mod in model.named_modules():
            if hasattr(mod, "inv_freq") and getattr(mod, "inv_freq").is_meta:
                fn = getattr(mod, "rope_init_fn", None)
                inv, scale = fn(mod.config, device) if fn else (rope_inv_freq(self.config).to(device), 1.0)
                mod.register_buffer("inv_freq", inv, persistent=False)
                mod.original_inv_freq = inv
                mod.attention_scaling = scale
        bad = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
        if bad:
            raise GraphError(f"hf_model: tensors left uninitialised: {bad[:5]}")
        return model.eval()


def _check_dtype(dtype: str) -> torch.dtype:
    if dtype not in DTYPES:
        raise GraphError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def random_weights(c: ModelConfig, dtype: str = "f32", seed: int = 0, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Seeded random weights: matrices ~ N(0, 0.02), norm weights ~ 1 + N(0, 0.1), biases ~ N(0, 0.02)."""
    tdt = _check_dtype(dtype)
    g = torch.Generator(device=device).manual_seed(seed)
    out = {}
    for k, shape in weight_shapes(c).items():
        if k.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g, device=device)
        else:
            t = 0.02 * torch.randn(shape, generator=g, device=device)
        out[k] = t.to(tdt)
    return out


def from_preset(name: str, dtype: str = "f32", seed: int = 0, device: str = "cpu") -> ModelGraph:
    if name not in PRESETS:
        raise GraphError(f"unknown model or preset {name!r}; presets: {', '.join(PRESETS)} "
                         "(or pass a Hugging Face checkpoint directory)")
    c = dataclasses.replace(PRESETS[name])
    _check_dtype(dtype)
    return ModelGraph(name, c, None, dtype, factory=lambda: random_weights(c, dtype, seed, device))


def _check_weights(c: ModelConfig, weights: dict[str, torch.Tensor], where: str) -> None:
    for k, shape in weight_shapes(c).items():
        if k not in weights:
            raise GraphError(f"{where}: missing weight {k!r}")
        if tuple(weights[k].shape) != shape:
            raise GraphError(f"{where}: weight {k!r} has shape {tuple(weights[k].shape)}, expected {shape}")


def _infer_dtype(weights: dict[str, torch.Tensor]) -> str:
    rev = {v: k for k, v in DTYPES.items()}
    dt = weights["model.embed_tokens.weight"].dtype
    if dt not in rev:
        raise GraphError(f"unsupported weight dtype {dt} (supported: float32, bfloat16, float16)")
    return rev[dt]


def from_checkpoint(path: str | pathlib.Path, dtype: str | None = None, device: str = "cpu") -> ModelGraph:
    """Load a HF checkpoint directory (config.json + *.safetensors, sharded index supported)."""
    from safetensors import safe_open
    root = pathlib.Path(path)
    if not root.is_dir():
        raise GraphError(f"checkpoint directory {str(root)!r} does not exist")
    cfg_path = root / "config.json"
    if not cfg_path.is_file():
        raise GraphError(f"{root}: no config.json")
    try:
        c = config_from_hf(json.loads(cfg_path.read_text()))
    except json.JSONDecodeError as e:
        raise GraphError(f"{cfg_path}: not valid JSON ({e})") from None
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            wmap = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise GraphError(f"{index}: malformed index ({e})") from None
        files = sorted(set(wmap.values()))
    elif (root / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise GraphError(f"{root}: no model.safetensors or model.safetensors.index.json")
    need = set(weight_shapes(c))
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        fp = root / f
        if not fp.is_file():
            raise GraphError(f"{root}: shard {f!r} named in the index is missing")
        try:
            with safe_open(str(fp), framework="pt", device="cpu") as sf:
                for k in sf.keys():
                    if k in need:
                        weights[k] = sf.get_tensor(k)
        except GraphError:
            raise
        except Exception as e:  # safetensors raises its own error types on corrupt files
            raise GraphError(f"{fp}: cannot read safetensors file ({type(e).__name__}: {e})") from None
    if c.tie_embeddings and "lm_head.weight" in weights:
        weights.pop("lm_head.weight")
    _check_weights(c, weights, str(root))
    src = _infer_dtype(weights)
    dt = dtype or src
    tdt = _check_dtype(dt)
    weights = {k: v.to(device=device, dtype=tdt) for k, v in weights.items()}
    return ModelGraph(root.name, c, weights, dt)


def from_hf_model(model, dtype: str | None = None) -> ModelGraph:
    """Import a transformers model object (its config + state dict)."""
    c = config_from_hf(model.config.to_dict())
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    if c.tie_embeddings:
        sd.pop("lm_head.weight", None)
    sd = {k: v for k, v in sd.items() if k in weight_shapes(c)}
    _check_weights(c, sd, type(model).__name__)
    dt = dtype or _infer_dtype(sd)
    tdt = _check_dtype(dt)
    return ModelGraph(type(model).__name__, c, {k: v.to(tdt) for k, v in sd.items()}, dt)


def load_model(name_or_path: Any, dtype: str | None = None, seed: int = 0, device: str = "cpu") -> ModelGraph:
    """A preset name, a checkpoint directory, or a transformers model object -> ModelGraph."""
    if not isinstance(name_or_path, (str, pathlib.Path)):
        return from_hf_model(name_or_path, dtype)
    s = str(name_or_path)
    if s in PRESETS:
        return from_preset(s, dtype or "f32", seed, device)
    if pathlib.Path(s).exists() or "/" in s or s.startswith("."):
        return from_checkpoint(s, dtype, device)
    raise GraphError(f"unknown model or preset {s!r}; presets: {', '.join(PRESETS)} "
                     "(or pass a Hugging Face checkpoint directory)")
