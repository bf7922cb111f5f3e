"""FSDP2's other clients, their own code, on zero: accelerate, the HF Trainer, Lightning Fabric
and torchtune, each against the same run on torch's ``fully_shard``, bitwise.

Each library calls ``fully_shard`` from its own code; the only change in zero's runs is where
that name comes from (notes/11, "FSDP2's other clients"):

- accelerate (and the HF Trainer, which prepares through it) imports it inside
  ``fsdp2_prepare_model`` on every call: ``torch.distributed.fsdp.fully_shard`` is replaced;
- torchtune imports it at module level in ``torchtune.training._distributed``;
- Lightning leaves it to the user's ``parallelize_fn``, which calls whichever it is given.

accelerate enables FSDP only in its GPU branch; on CPU processes it stays ``MULTI_CPU`` and
drops the plugin (the Trainer then runs DDP, silently). ``_fsdp_on_cpu`` does on CPU what that
branch does, for torch's runs and zero's alike. The libraries are the ``clients`` extra; each
test skips where its library is absent.
"""

import os

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

import zero
from conftest import sample
from harness import run_ranks


def _full(model: nn.Module) -> dict:
    return {k: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for k, p in model.named_parameters()}


def _substitute(which: str, module, name: str = "fully_shard") -> None:
    if which == "zero":
        setattr(module, name, zero.fully_shard)


def _env(rank: int, n: int) -> None:
    # The libraries read the launcher's variables; the process group already exists (gloo).
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(n), NODE_RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="1")


def _by(model: nn.Module) -> str:
    """Whose fully_shard sharded ``model``: zero's leaves its units on the modules."""
    from zero.core import registry

    return "zero" if any(registry.units_on(m) for m in model.modules()) else "torch"


def _same(ours, theirs) -> None:
    for o, t in zip(ours, theirs):
        assert o.keys() == t.keys()
        different = [k for k in o if not torch.equal(o[k], t[k])]
        assert not different, f"{len(different)} of {len(o)} differ, first {different[0]}"


# ---- accelerate: Accelerator with its FSDP2 plugin ---------------------------------------------


def _fsdp_on_cpu() -> None:
    """What ``AcceleratorState``'s GPU branch does with an FSDP plugin, on a CPU process."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__

    def patched(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = PartialState().distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin

    AcceleratorState.__init__ = patched


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _accelerate(rank, n, which, ckpt, phase, precision, accumulate):
    import torch.distributed.fsdp

    _env(rank, n)
    _substitute(which, torch.distributed.fsdp)
    _fsdp_on_cpu()
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"], state_dict_type="SHARDED_STATE_DICT")
    acc = Accelerator(cpu=True, fsdp_plugin=plugin, mixed_precision=precision,
                      gradient_accumulation_steps=accumulate)
    torch.manual_seed(0)
    model = Net()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    loaded = None
    if phase == "resume":
        acc.load_state(ckpt)
        loaded = _full(model)
    steps = range(2 * accumulate) if phase == "train" else range(2 * accumulate, 3 * accumulate)
    for s in steps:
        with acc.accumulate(model):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * s + rank))
            acc.backward(model(x).float().square().mean())
            if acc.sync_gradients:
                acc.clip_grad_norm_(model.parameters(), 0.1)
            opt.step()
            opt.zero_grad()
    if phase == "train":
        acc.save_state(ckpt)
    return {"class": type(model).__name__, "by": _by(model), "loaded": loaded,
            "params": _full(model)}


ACCELERATE = [("no", 1), ("bf16", 1), ("no", 2)]


@pytest.mark.parametrize("precision,accumulate", sample(ACCELERATE[:1], ACCELERATE))
def test_accelerate_fsdp2_plugin_trains_and_resumes_as_on_fsdp2(precision, accumulate, tmp_path):
    """Prepare (auto-wrap by block class), clip, step, save_state; then in fresh ranks
    load_state and step again: each bitwise FSDP2's; the load restores what was saved."""
    pytest.importorskip("accelerate")
    import accelerate.utils  # noqa: F401  (here, once: the ranks fork with it imported)

    runs = {}
    for which in ("zero", "torch"):
        for phase in ("train", "resume"):
            runs[which, phase] = run_ranks(_accelerate, 2, which, str(tmp_path / which), phase,
                                           precision, accumulate, timeout=120)
    for which in ("zero", "torch"):
        assert runs[which, "train"][0]["class"] == "FSDPNet"
        assert runs[which, "train"][0]["by"] == which
        _same([r["loaded"] for r in runs[which, "resume"]],
              [r["params"] for r in runs[which, "train"]])
    for phase in ("train", "resume"):
        _same([r["params"] for r in runs["zero", phase]], [r["params"] for r in runs["torch", phase]])


# ---- the Hugging Face Trainer (through accelerate) ---------------------------------------------


def _trainer(rank, n, which, out, phase, extra):
    import torch.distributed.fsdp

    _env(rank, n)
    _substitute(which, torch.distributed.fsdp)
    _fsdp_on_cpu()
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                         max_position_embeddings=32)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": (ids := torch.randint(0, 64, (16,), generator=g)), "labels": ids.clone()}
            for _ in range(32)]
    args = TrainingArguments(
        output_dir=out, per_device_train_batch_size=2, per_device_eval_batch_size=2,
        max_steps=3 if phase == "resume" else 2, learning_rate=1e-2, lr_scheduler_type="constant",
        save_strategy="steps", save_steps=2, report_to=[], logging_steps=1, use_cpu=True,
        fsdp=True, max_grad_norm=0.5, seed=0, disable_tqdm=True,
        gradient_accumulation_steps=2 if "accumulate" in extra else 1,
        gradient_checkpointing="checkpointing" in extra, bf16="bf16" in extra,
        fsdp_config={"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                     "reshard_after_forward": True})
    trainer = Trainer(model=model, args=args, train_dataset=data, eval_dataset=data[:4])
    trainer.train(resume_from_checkpoint=phase == "resume")
    out = {"class": type(trainer.model).__name__, "by": _by(trainer.model),
           "params": _full(trainer.model),
           "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h]}
    if "evaluate" in extra:
        out["eval"] = trainer.evaluate()["eval_loss"]
        with torch.no_grad():
            out["generated"] = trainer.model.generate(data[0]["input_ids"][None, :4],
                                                      max_new_tokens=3, do_sample=False)
    return out


TRAINER = ["accumulate", "bf16,checkpointing", "evaluate"]


@pytest.mark.full  # 16 s a case: four Trainer runs (the suite keeps to 5 minutes)
@pytest.mark.parametrize("extra", TRAINER)
def test_hf_trainer_with_fsdp2_trains_and_resumes_as_on_fsdp2(extra, tmp_path):
    """A tiny Llama from its config, the Trainer's FSDP2 path (version 2, wrapped by decoder
    layer), clipping, a checkpoint at step 2 and a resume to step 3 in fresh ranks."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import accelerate.utils  # noqa: F401  (here, once: the ranks fork with it imported)

    runs = {}
    for which in ("zero", "torch"):
        for phase in ("train", "resume"):
            runs[which, phase] = run_ranks(_trainer, 2, which, str(tmp_path / which), phase,
                                           extra, timeout=180)
    for phase in ("train", "resume"):
        ours, theirs = runs["zero", phase], runs["torch", phase]
        assert ours[0]["class"] == theirs[0]["class"] == "FSDPLlamaForCausalLM"
        assert (ours[0]["by"], theirs[0]["by"]) == ("zero", "torch")
        assert ours[0]["losses"] == theirs[0]["losses"]
        _same([r["params"] for r in ours], [r["params"] for r in theirs])
        if "evaluate" in extra:
            assert ours[0]["eval"] == theirs[0]["eval"]
            assert torch.equal(ours[0]["generated"], theirs[0]["generated"])
    assert len(runs["zero", "resume"][0]["losses"]) == 3  # two from the checkpoint, one more


# ---- Lightning Fabric: ModelParallelStrategy, the model built on meta --------------------------


def _fabric(rank, n, which, ckpt, phase, layout="rows"):
    import functools

    from lightning.fabric import Fabric
    from lightning.fabric.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    _env(rank, n)
    shard = functools.partial(zero.fully_shard, layout=layout) if which == "zero" else \
        torch_fully_shard

    def parallelize(model, mesh):  # the user's code: Lightning never calls fully_shard itself
        for block in model.blocks:
            shard(block, mesh=mesh["data_parallel"])
        shard(model, mesh=mesh["data_parallel"])
        return model

    fabric = Fabric(accelerator="cpu", devices=n, strategy=ModelParallelStrategy(
        parallelize, data_parallel_size=n, tensor_parallel_size=1))
    fabric.launch()
    torch.manual_seed(0)
    with fabric.init_module(empty_init=True):  # on meta; setup runs to_empty, reset_parameters
        model = Net()
    model = fabric.setup(model)
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2))
    loaded = None
    if phase == "resume":
        fabric.load(ckpt, {"model": model, "opt": opt})
        loaded = _full(model)
    for s in range(2) if phase == "train" else range(2, 3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * s + rank))
        fabric.backward(model(x).square().mean())
        fabric.clip_gradients(model, opt, max_norm=0.1)
        opt.step()
        opt.zero_grad()
    if phase == "train":
        fabric.save(ckpt, {"model": model, "opt": opt})
    return {"by": _by(model), "loaded": loaded, "params": _full(model)}


def test_lightning_fabric_model_parallel_strategy_trains_and_resumes_as_on_fsdp2(tmp_path):
    """Built under meta (empty_init), materialised by Fabric's setup (to_empty, then each
    module's reset_parameters), clipped by Fabric, saved and loaded through its distributed
    checkpoint."""
    pytest.importorskip("lightning")
    import lightning.fabric  # noqa: F401  (here, once: the ranks fork with it imported)

    runs = {(w, p): run_ranks(_fabric, 2, w, str(tmp_path / w), p, timeout=120)
            for w in ("zero", "torch") for p in ("train", "resume")}
    for which in ("zero", "torch"):
        assert runs[which, "train"][0]["by"] == which
        _same([r["loaded"] for r in runs[which, "resume"]],
              [r["params"] for r in runs[which, "train"]])
    for phase in ("train", "resume"):
        _same([r["params"] for r in runs["zero", phase]], [r["params"] for r in runs["torch", phase]])


def _fabric_flat(rank, n):
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            _fabric(rank, n, "zero", None, "train", layout="flat")
            error = "trained"
        except ValueError as e:
            error = str(e)
    return [str(w.message) for w in seen], error


def test_lightning_fabric_meta_init_with_the_flat_layout_is_refused_naming_rows():
    """With ``layout="flat"`` the parameters are 1-D pieces: Fabric's materialisation
    (``to_empty``, then each module's ``reset_parameters``, whose fan-in needs the full shape)
    cannot initialise them, and Fabric's checkpointing looks for DTensor parameters. Sharding
    warns, naming ``layout="rows"``; ``to_empty`` refuses, naming it too."""
    pytest.importorskip("lightning")
    import lightning.fabric  # noqa: F401  (here, once: the ranks fork with it imported)

    for warned, error in run_ranks(_fabric_flat, 2, timeout=120):
        assert any("layout='rows'" in w and "Lightning" in w for w in warned)
        assert "reset_parameters" in error and "layout='rows'" in error


# ---- torchtune: a recipe's setup and step ------------------------------------------------------


def _torchtune(rank, n, which, ckpt, phase, in_backward):
    import torchtune.training._distributed as distributed
    from torchtune import training
    from torchtune.models.llama3 import llama3
    from torchtune.modules import TransformerSelfAttentionLayer

    _substitute(which, distributed)

    def build():
        return llama3(vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32,
                      max_seq_len=32)

    with torch.device("meta"):  # full_finetune_distributed's setup
        model = build()
    training.shard_model(model, [lambda name, m: isinstance(m, TransformerSelfAttentionLayer)],
                         cpu_offload=False, reshard_after_forward=True)
    torch.manual_seed(0)
    full = build().state_dict() if phase == "train" else torch.load(f"{ckpt}/model.pt")
    training.load_from_full_model_state_dict(model, full, torch.device("cpu"), strict=True)
    for m in model.modules():  # RoPE's buffers are not in the checkpoint
        if hasattr(m, "rope_init"):
            m.rope_init()
    training.validate_no_params_on_meta_device(model)
    if in_backward:
        optims = {p: torch.optim.AdamW([p], lr=1e-2) for p in model.parameters()}
        training.register_optim_in_bwd_hooks(model=model, optim_dict=optims)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if phase == "resume":
            training.load_from_full_optimizer_state_dict(model, opt, torch.load(f"{ckpt}/opt.pt"),
                                                         torch.device("cpu"))
    loss_fn = nn.CrossEntropyLoss()
    for s in range(2) if phase == "train" else range(2, 3):
        tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(10 * s + rank))
        loss_fn(model(tokens).reshape(-1, 64).float(), tokens.reshape(-1)).backward()
        if not in_backward:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            opt.zero_grad()
    state = training.gather_cpu_state_dict(model, rank == 0)
    if phase == "train" and not in_backward:
        optim_state = training.get_full_optimizer_state_dict(model, opt, rank == 0)
        if rank == 0:
            os.makedirs(ckpt, exist_ok=True)
            torch.save(state, f"{ckpt}/model.pt")
            torch.save(optim_state, f"{ckpt}/opt.pt")
    torch.distributed.barrier()
    return {"by": _by(model), "state": state,
            "initial": {k: v.clone() for k, v in full.items()} if rank == 0 else None}


@pytest.mark.parametrize("in_backward", sample([False], [False, True]))
def test_torchtune_recipe_setup_and_step_as_on_fsdp2(in_backward, tmp_path):
    """Shard on meta, load full weights (assign=True, adopted), clip, step, save full model
    and optimizer state; resume from them in fresh ranks. Or step in backward (the recipe's
    optimizer_in_bwd), which trains."""
    pytest.importorskip("torchtune")
    import torchtune.training  # noqa: F401  (here, once: the ranks fork with it imported)

    phases = ("train",) if in_backward else ("train", "resume")
    runs = {(w, p): run_ranks(_torchtune, 2, w, str(tmp_path / w), p, in_backward, timeout=120)
            for w in ("zero", "torch") for p in phases}
    for phase in phases:
        assert (runs["zero", phase][0]["by"], runs["torch", phase][0]["by"]) == ("zero", "torch")
        ours, theirs = runs["zero", phase][0]["state"], runs["torch", phase][0]["state"]
        _same([ours], [theirs])
    start, end = runs["zero", "train"][0]["initial"], runs["zero", "train"][0]["state"]
    assert not any(torch.equal(start[k], end[k]) for k in end if k.endswith("weight"))


# ---- the Lightning Trainer: the user's configure_model shards ----------------------------------


def _lightning_trainer(rank, n, which, ckpt, phase):
    import lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    _env(rank, n)
    shard = zero.fully_shard if which == "zero" else torch_fully_shard

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = None

        def configure_model(self):  # Lightning calls it; the sharding is the user's code
            if self.net is None:
                self.net = Net()
                for block in self.net.blocks:
                    shard(block, mesh=self.device_mesh["data_parallel"])
                shard(self.net, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch, index):
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(
        torch.randn(16, 8, generator=torch.Generator().manual_seed(rank))), batch_size=4)
    torch.manual_seed(0)
    trainer = L.Trainer(
        accelerator="cpu", devices=n, max_steps=2 if phase == "train" else 3,
        strategy=ModelParallelStrategy(data_parallel_size=n, tensor_parallel_size=1),
        gradient_clip_val=0.5, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    module = Module()
    trainer.fit(module, data, ckpt_path=ckpt if phase == "resume" else None)
    if phase == "train":
        trainer.save_checkpoint(ckpt)
    return {"by": _by(module.net), "params": _full(module.net)}


@pytest.mark.full
def test_lightning_trainer_model_parallel_strategy_trains_and_resumes_as_on_fsdp2(tmp_path):
    """setup's model.to(device) (a no-op), clipping by the Trainer, save_checkpoint and a
    resume through fit(ckpt_path=...) in fresh ranks."""
    pytest.importorskip("lightning")
    import lightning.pytorch  # noqa: F401  (here, once: the ranks fork with it imported)

    runs = {(w, p): run_ranks(_lightning_trainer, 2, w, str(tmp_path / w), p, timeout=120)
            for w in ("zero", "torch") for p in ("train", "resume")}
    for phase in ("train", "resume"):
        assert (runs["zero", phase][0]["by"], runs["torch", phase][0]["by"]) == ("zero", "torch")
        _same([r["params"] for r in runs["zero", phase]], [r["params"] for r in runs["torch", phase]])


# ---- transformers: from_pretrained(distributed_config=...) shards while it loads ---------------


def _from_pretrained(rank, n, which, path):
    import transformers.distributed.fsdp as hf_fsdp

    _env(rank, n)
    _substitute(which, hf_fsdp)  # transformers imports fully_shard at module level there
    from transformers import LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    # On meta, fully_shard by the model's FSDP plan, then each weight set with setattr as a
    # DTensor of this rank's rows (transformers' core_model_loading).
    config = DistributedConfig(fsdp_size=n)
    model = LlamaForCausalLM.from_pretrained(path, distributed_config=config)
    loaded = _full(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for s in range(2):
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(10 * s + rank))
        loss = model(ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return {"by": _by(model), "class": type(model).__name__, "loaded": loaded,
            "losses": losses, "params": _full(model)}


def test_transformers_from_pretrained_with_distributed_config_as_on_fsdp2(tmp_path):
    """``from_pretrained(path, distributed_config=DistributedConfig(fsdp_size=2))``: the model
    is sharded on the meta device by its FSDP plan, then loaded weight by weight (``setattr``
    of DTensors, which zero adopts); the loaded values and two training steps bitwise FSDP2's."""
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")  # (transformers refuses a device_map without it)
    from transformers import LlamaConfig, LlamaForCausalLM
    import transformers.distributed.fsdp  # noqa: F401  (here, once: the ranks fork with it)

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                         max_position_embeddings=32)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    runs = {w: run_ranks(_from_pretrained, 2, w, str(tmp_path / "llama"), timeout=120)
            for w in ("zero", "torch")}
    assert [r["by"] for r in runs["zero"]] == ["zero", "zero"]
    assert runs["zero"][0]["class"] == runs["torch"][0]["class"] == "FSDPLlamaForCausalLM"
    for key in ("loaded", "params"):
        _same([r[key] for r in runs["zero"]], [r[key] for r in runs["torch"]])
    for ours, theirs in zip(runs["zero"], runs["torch"]):
        assert all(torch.equal(a, b) for a, b in zip(ours["losses"], theirs["losses"]))
