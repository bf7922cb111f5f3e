"""What ``python -m zerolab plan --model MODEL`` accepts, built into one shape the plan can run.

MODEL is one of:

- a path to a Hugging Face ``config.json`` (or the folder holding one): the model is built
  from the config with ``transformers`` (``from_config``: nothing is downloaded), as the
  class its ``architectures`` field names, else a causal LM, a masked LM, or the bare model
  (``pip install transformers``; a Mixture-of-Experts runs its experts with transformers'
  grouped matmul, as on a GPU);
- ``torchtitan:NAME:FLAVOR`` (``torchtitan:llama3:8B``, ``torchtitan:deepseek_v3:16B``): the
  flavor's model config from torchtitan's registry for that model, built as its trainer builds
  it: the RoPE tables cut to the training sequence (``--seq``), attention as SDPA (torchtitan's
  flex attention wants ``torch.compile``; SDPA keeps the same tensors for backward as a fused
  kernel would), no torchtitan parallelism (the plan's systems do the sharding);
- ``package.module:callable``: any function returning an ``nn.Module`` that takes token ids
  ``(batch, seq)`` (``zerolab.planmodel:gpt_7_5b`` is one).

``Planned`` wraps what was built with what the systems of ``zerolab.systems`` ask of a model:
``units()`` (each repeated block, then the root; or, given a wrap policy, the modules FSDP1's
auto-wrap would wrap, then the root), ``batch()`` and ``loss()``. A wrap policy is written
``transformer:Class[,Class]`` (``ModuleWrapPolicy`` of the model's classes so named) or
``size:N`` (``size_based_auto_wrap_policy`` at ``min_num_params=N``).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os

import torch
import torch.nn as nn
import torch.nn.functional as F


class PlanError(ValueError):
    """Bad input to the plan: the message says what to do instead."""


class Planned(nn.Module):
    """A model and the facts the plan needs: its units, a batch of token ids, a loss.

    The loss is the cross-entropy of the logits against the next tokens when the model
    returns a score per vocabulary entry; otherwise (an encoder's hidden states) the mean
    square of the output, which exercises the same backward.
    """

    def __init__(self, inner: nn.Module, vocab: int, checkpoint: bool | str = False,
                 wrap: str | None = None):
        super().__init__()
        self.inner, self.vocab = inner, vocab
        self.block_names = repeated_blocks(inner)
        self.wrap, self.policy = wrap, wrap_policy(inner, wrap) if wrap else None
        config = getattr(inner, "config", None)
        # an encoder-decoder (T5, BART) reads the token ids on both sides: the decoder's
        # input is the same sequence (teacher forcing), the loss its next tokens
        self.encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
        if checkpoint:  # activation checkpointing: each block recomputed in backward
            from zerolab.checkpointing import checkpointed

            mode = "full" if checkpoint is True else checkpoint
            for name in self.block_names:
                parent, _, child = name.rpartition(".")
                holder = inner.get_submodule(parent) if parent else inner
                setattr(holder, child, checkpointed(holder.get_submodule(child), mode))

    def max_positions(self) -> int | None:
        """The longest sequence the model embeds positions for, where it says (else None)."""
        for holder, key in ((getattr(self.inner, "cfg", None), "seq"),
                            (getattr(self.inner, "config", None), "max_position_embeddings")):
            if isinstance(getattr(holder, key, None), int):
                return getattr(holder, key)
        return None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out = self.inner(idx, decoder_input_ids=idx) if self.encoder_decoder else self.inner(idx)
        if torch.is_tensor(out):
            return out
        for key in ("logits", "last_hidden_state"):  # HF ModelOutput
            if getattr(out, key, None) is not None:
                return getattr(out, key)
        return out[0]

    def repeat(self) -> dict:
        """The repeated blocks: the list holding them, their class, and whether they are alike
        (one list, one class, the same parameter names, shapes and dtypes in every block), so
        that a block adds the same to every figure wherever it sits."""
        if not self.block_names:
            return {"list": None, "class": None, "alike": False}
        lists = {n.rpartition(".")[0] for n in self.block_names}
        blocks = [self.inner.get_submodule(n) for n in self.block_names]
        shapes = {(type(b), tuple((k, tuple(p.shape), p.dtype, p.requires_grad)
                                  for k, p in b.named_parameters())) for b in blocks}
        return {"list": ", ".join(sorted(lists)) or "(the model)",
                "class": ", ".join(sorted({type(b).__name__ for b in blocks})),
                "alike": len(lists) == 1 and len(shapes) == 1}

    def keep_blocks(self, k: int) -> None:
        """Cut the (one) list of blocks to its first ``k``: the model ``k`` blocks deep."""
        parent = self.block_names[0].rpartition(".")[0]
        holder = self.inner.get_submodule(parent) if parent else self.inner
        kept = list(holder.children())[:k]
        if isinstance(holder, nn.ModuleDict):
            keys = list(holder.keys())[:k]
            new = nn.ModuleDict(dict(zip(keys, kept)))
        else:
            new = type(holder)(kept) if isinstance(holder, nn.Sequential) else nn.ModuleList(kept)
        grand, _, attr = parent.rpartition(".")
        setattr(self.inner.get_submodule(grand) if grand else self.inner, attr, new)
        config = getattr(self.inner, "config", None)  # HF: some forwards slice by the config
        if config is not None and getattr(config, "num_hidden_layers", None) is not None:
            try:
                config.num_hidden_layers = k
            except (AttributeError, ValueError):
                pass
        self.block_names = repeated_blocks(self.inner)

    def units(self) -> list[nn.Module]:
        if self.policy is not None:
            from zero.features.wrap import shared_outside, units_by_policy

            units = units_by_policy(self.inner, self.policy)
            names = {m: n for n, m in self.inner.named_modules()}
            for u in units:  # a tied parameter must live in one unit (FSDP1's rule too)
                if shared_outside(self.inner, u):
                    raise PlanError(f"--wrap-policy {self.wrap}: it makes a unit of {names[u]} "
                                    f"({type(u).__name__}), whose parameter a module outside "
                                    f"it uses too (tied weights); a tied parameter must live in "
                                    f"one unit: choose a policy that leaves both users to a "
                                    f"common parent (a larger size:N, or transformer: of the "
                                    f"blocks)")
            return [*units, self]
        return [*(self.inner.get_submodule(n) for n in self.block_names), self]

    def batch(self, batch: int, generator: torch.Generator, seq: int | None = None):
        seq = seq or getattr(self, "seq", 128)
        idx = torch.randint(0, self.vocab, (batch, seq + 1), generator=generator)
        return idx[:, :-1], idx[:, 1:]

    def loss(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if out.shape[-1] == self.vocab:
            return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), target.reshape(-1))
        return out.float().square().mean()


def repeated_blocks(model: nn.Module) -> list[str]:
    """The names of the model's repeated blocks: the children of every ``ModuleList``,
    ``ModuleDict`` or ``Sequential`` whose children (two or more) are all of one class and
    hold parameters; outermost first, so an MoE's experts inside a block stay in the block."""
    found: list[str] = []
    for name, m in model.named_modules():
        if not isinstance(m, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            continue
        kids = list(m.named_children())
        if len(kids) < 2 or len({type(k) for _, k in kids}) != 1:
            continue
        if not all(any(True for _ in k.parameters()) for _, k in kids):
            continue
        if any(name.startswith(f + ".") for f in found):
            continue  # inside a block already found
        found += [f"{name}.{k}" if name else k for k, _ in kids]
    return found


@contextlib.contextmanager
def fake_safe():
    """Where transformers would read a fake tensor's values, tell it what they are.

    - Its Mixture-of-Experts layers multiply by torch's grouped matmul, whose fake (meta)
      kernel takes bf16 only, and otherwise by a loop over the experts that reads the
      routing's values (impossible on fake tensors). Here, for other dtypes, they take
      transformers' own fallback operator, which has a fake kernel of the same output shapes.
    - Without a key-value cache (training), it looks for several sequences packed into one
      row by reading the position ids; on a fake tensor it cannot, assumes they may be
      packed, and builds an explicit attention mask, which sends attention down another
      kernel (a mask instead of ``is_causal``, keys and values repeated for grouped-query
      attention). The plan's rows are one sequence each, as the real run would find.
    """
    try:
        from transformers import masking_utils
        from transformers.integrations import moe
    except ImportError:
        yield
        return
    can, packed = moe._can_use_grouped_mm, masking_utils.find_packed_sequence_indices
    moe._can_use_grouped_mm = lambda x, w, offs: w.dtype == torch.bfloat16 and can(x, w, offs)
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        moe._can_use_grouped_mm = can
        masking_utils.find_packed_sequence_indices = packed


def build(spec: str, checkpoint: bool | str = False, seq: int | None = None,
          wrap: str | None = None) -> Planned:
    """Build MODEL (see the module docstring) on the current device, for sequences of ``seq``
    tokens where the model sizes a table by them, its units those of the wrap policy ``wrap``
    if given; raise ``PlanError`` with the fix when it cannot be built."""
    if os.path.isdir(spec) or spec.endswith(".json") or os.path.isfile(spec):
        inner, vocab = _hf(spec)
    elif spec.startswith("torchtitan:"):
        inner, vocab = _titan(spec, seq)
    elif ":" in spec:
        inner, vocab = _callable(spec)
    else:
        raise PlanError(f"--model {spec!r}: no such file, and not package.module:callable; give "
                        f"a Hugging Face config.json path (or its folder), torchtitan:NAME:FLAVOR, "
                        f"or a function returning an nn.Module as package.module:callable")
    return Planned(inner, vocab, checkpoint, wrap)


def wrap_policy(model: nn.Module, wrap: str):
    """``transformer:Class[,Class]`` or ``size:N`` as one of torch's FSDP1 wrap policies."""
    import functools

    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

    kind, _, rest = wrap.partition(":")
    if kind == "size":
        try:
            n = int(float(rest))
        except ValueError:
            n = 0
        if n < 1:
            raise PlanError(f"--wrap-policy {wrap}: size:N takes a whole number of parameters "
                            f">= 1 (size:100000000 wraps each module of 1e8 or more)")
        return functools.partial(size_based_auto_wrap_policy, min_num_params=n)
    if kind == "transformer":
        have = {type(m).__name__: type(m) for m in model.modules()
                if any(True for _ in m.parameters(recurse=False))
                or any(True for _ in m.children())}
        names = [c for c in rest.split(",") if c]
        missing = [c for c in names if c not in have]
        if not names or missing:
            raise PlanError(f"--wrap-policy {wrap}: the model has no module class "
                            f"{', '.join(missing) or '(none given)'}; name one or more of "
                            f"{', '.join(sorted(have))}")
        return ModuleWrapPolicy({have[c] for c in names})
    raise PlanError(f"--wrap-policy {wrap}: write transformer:Class[,Class] (FSDP1's "
                    f"ModuleWrapPolicy) or size:N (its size_based_auto_wrap_policy)")


def _hf(path: str):
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise PlanError(f"--model {path}: no such file; pass a Hugging Face config.json (or the "
                        f"folder holding one), or package.module:callable")
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PlanError(f"--model {path}: not a readable JSON config ({e}); pass a Hugging Face "
                        f"config.json (the file next to a model's weights)") from None
    except RecursionError:  # json's parser recurses once a level of nesting
        raise PlanError(f"--model {path}: not a readable JSON config (nested deeper than Python "
                        f"can parse); pass a Hugging Face config.json (the file next to a "
                        f"model's weights)") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise PlanError(f"--model {path}: a JSON file without \"model_type\" is not a Hugging "
                        f"Face model config; pass the model's config.json")
    _bounded(path, raw)
    try:
        import transformers
    except ImportError:
        raise PlanError(f"--model {path}: building a model from a Hugging Face config needs "
                        f"transformers: pip install transformers") from None
    try:
        config = transformers.AutoConfig.for_model(**raw)
    except Exception as e:  # noqa: BLE001 (transformers' validation raises many kinds)
        raise PlanError(f"--model {path}: transformers {transformers.__version__} cannot read "
                        f"this config ({e}); check model_type, or upgrade transformers") from None
    # Training, not generation: no key-value cache. Left on, a model keeps every layer's keys
    # and values in it through backward (Llama-2-70B: 161 GB planned with it, 57 without)
    for c in {id(c): c for c in (config, config.get_text_config())}.values():
        if hasattr(c, "use_cache"):
            c.use_cache = False
    classes = [getattr(transformers, a, None) for a in raw.get("architectures") or []]
    classes += [transformers.AutoModelForCausalLM, transformers.AutoModelForMaskedLM,
                transformers.AutoModel]
    last = None
    for cls in filter(None, classes):
        try:
            build = cls._from_config if hasattr(cls, "_from_config") else cls.from_config
            return build(config), config.get_text_config().vocab_size
        except Exception as e:  # transformers' code on the user's config: say what it said
            last = e
    raise PlanError(f"--model {path}: transformers {transformers.__version__} could not build a "
                    f"model from it ({type(last).__name__}: {last}); check the config's fields "
                    f"against the model's documentation")


# What a config may ask the plan to build: a layer costs milliseconds to build even on the
# meta device, so a million of them would run for minutes before the simulation's own bound
# (``zerolab.plan.MAX_MODULES``) could refuse them. The deepest published models have ~130.
MAX_LAYERS = 1024
LAYER_KEYS = ("num_hidden_layers", "num_layers", "n_layer", "num_decoder_layers",
              "encoder_layers", "decoder_layers")


def _bounded(path: str, raw: dict) -> None:
    """Refuse a config whose layer count is beyond MAX_LAYERS, before anything is built."""
    configs = [raw, *(v for v in raw.values() if isinstance(v, dict))]  # text_config, ...
    for c in configs:
        for key in LAYER_KEYS:
            v = c.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > MAX_LAYERS:
                raise PlanError(f"--model {path}: {key} = {v:,} is beyond the plan's bound of "
                                f"{MAX_LAYERS:,} layers (building them alone would take "
                                f"minutes); plan the model with fewer layers and scale by hand")


def _titan(spec: str, seq: int | None):
    import dataclasses
    import pkgutil

    _, _, rest = spec.partition(":")
    name, _, flavor = rest.partition(":")
    try:
        import torchtitan.models
    except ImportError:
        raise PlanError(f"--model {spec}: torchtitan is not installed: pip install torchtitan "
                        f"(or this package's [titan] extra)") from None
    names = sorted(m.name for m in pkgutil.iter_modules(torchtitan.models.__path__)
                   if m.ispkg and m.name != "common")
    try:
        module = importlib.import_module(f"torchtitan.models.{name}") if name in names else None
    except Exception as e:  # noqa: BLE001 (an optional dependency of that model, say)
        raise PlanError(f"--model {spec}: torchtitan's {name} cannot be imported here "
                        f"({type(e).__name__}: {e})") from None
    if module is None or not hasattr(module, "model_registry"):
        raise PlanError(f"--model {spec}: torchtitan has no model {name!r}; write "
                        f"torchtitan:NAME:FLAVOR with NAME one of {', '.join(names)}")
    flavors = next((list(v) for k, v in vars(module).items()
                    if k.endswith("_configs") and isinstance(v, dict)), [])
    if flavor not in flavors:
        raise PlanError(f"--model {spec}: torchtitan's {name} has no flavor {flavor!r}; write "
                        f"torchtitan:{name}:FLAVOR with FLAVOR one of {', '.join(flavors)}")
    config = module.model_registry(flavor).model
    layers = getattr(config, "layers", None)
    if not layers or not hasattr(config, "vocab_size"):
        raise PlanError(f"--model {spec}: not a language model of token ids (no layers or "
                        f"vocabulary in its config); the plan feeds token ids")
    from torchtitan.models.common.attention import ScaledDotProductAttention

    for layer in layers:  # as torchtitan's trainer does for its training sequence
        attention = getattr(layer, "attention", None)
        if attention is None:
            continue
        attention.inner_attention = ScaledDotProductAttention.Config()
        rope = getattr(attention, "rope", None)
        if seq is not None and rope is not None:
            if seq > rope.max_seq_len:
                raise PlanError(f"--seq {seq}: torchtitan's {name} {flavor} embeds positions for "
                                f"{rope.max_seq_len} tokens at most; pass --seq "
                                f"{rope.max_seq_len} or less")
            attention.rope = dataclasses.replace(rope, max_seq_len=seq)
    try:
        return config.build(), config.vocab_size
    except Exception as e:  # torchtitan's code on this torch: say what it said
        raise PlanError(f"--model {spec}: torchtitan could not build it ({type(e).__name__}: "
                        f"{e})") from None


def _callable(spec: str):
    modname, _, fname = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(modname), fname)
    except Exception as e:  # ImportError, AttributeError, or whatever the module raised
        raise PlanError(f"--model {spec}: cannot import it ({e}); write package.module:callable "
                        f"with the module on PYTHONPATH, the callable returning an nn.Module "
                        f"that takes token ids (batch, seq)") from None
    except SystemExit as e:  # the user's module ended the process: say so, do not end quietly
        raise PlanError(f"--model {spec}: importing it called sys.exit({e.code!r}); the module "
                        f"must define the callable without exiting") from None
    try:
        model = fn()
    except Exception as e:  # the user's code: whatever it raised, say where
        raise PlanError(f"--model {spec}: calling it raised {type(e).__name__}: {e}; it must "
                        f"build the model with no arguments") from None
    except SystemExit as e:
        raise PlanError(f"--model {spec}: calling it called sys.exit({e.code!r}); it must return "
                        f"the model, not exit") from None
    if not isinstance(model, nn.Module):
        raise PlanError(f"--model {spec}: it returned {type(model).__name__}, not an "
                        f"nn.Module; return the model itself")
    vocab = getattr(getattr(model, "cfg", None), "vocab", None) or getattr(model, "vocab", None)
    if vocab is None:
        emb = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        if emb is None:
            raise PlanError(f"--model {spec}: no nn.Embedding and no .vocab: the plan feeds "
                            f"token ids; give the model a .vocab attribute")
        vocab = emb.num_embeddings
    return model, vocab


def gpt_7_5b() -> nn.Module:
    """The ZeRO paper's Table 1 model size: a GPT of 7.46e9 parameters (36 blocks of 4096)."""
    from zerolab.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab=50304, seq=1024, dim=4096, layers=36, heads=32))


def gpt_small() -> nn.Module:
    """compare_stages.py's default GPT (4 blocks of 128, vocabulary 512)."""
    from zerolab.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab=512, seq=64, dim=128, layers=4, heads=4))


def gpt_deep() -> nn.Module:
    """A narrow GPT of 8 blocks: deeper than the 4 the plan simulates before it extends."""
    from zerolab.models import GPT, GPTConfig

    return GPT(GPTConfig(vocab=512, seq=64, dim=64, layers=8, heads=4))
