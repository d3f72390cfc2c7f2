"""The tuning modes without a prompt (``prompt_type: none``): LoRA (``lora: true``) and full fine-tuning
(``train_backbone: true``) train through the same fused loss and packed batches (and the gradient cache), save,
resume bit for bit after a SIGKILL, and reload; a LoRA checkpoint loads in PEFT; what cannot combine is refused.

Tolerance of the PEFT comparison (1e-5, absolute, on the pooled fp32 [CLS] vectors before normalisation): both sides
run the same fp32 weights; fastprompt's packed forward and fused attention sum in another order than transformers'
eager attention, and LoRA's update is added in the same order on both sides (PEFT's own LoRA layers run in both).
Each output is a chain of dot products of length <= 64 (hidden 32, intermediate 64) over 2 layers with LayerNorm:
rounding contributes about sqrt(64) * 2**-24 ~ 5e-7 relative per product on values of order 1, a few such per
layer, so differences of ~1e-6 are expected (measured: 1.2e-7 here); 1e-5 leaves a margin of about 80x while
a missing or wrongly scaled adapter (lora_B trained to ~1e-2 over a few steps) moves the vectors by more than 1e-3.
"""
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fastprompt.model import PromptEncoder
from fastprompt.train import Trainer
from fastprompt.train.config import TrainConfig

SENTS = ["a man plays the guitar .", "the dog runs in the park", "two people sit at a big table with water ."]
MODES = {"lora": dict(lora=True, lora_learning_rate=1e-2, lora_dropout=0.1, lora_rank=4),
         "full": dict(train_backbone=True, backbone_learning_rate=1e-3, backbone_weight_decay=0.01)}
#: what last/ holds that resumes must reproduce bit for bit, per mode
LAST_FILES = {"lora": ("adapter_model.safetensors", "prompt.safetensors", "training_state.safetensors"),
              "full": ("model.safetensors", "prompt.safetensors", "training_state.safetensors")}


def _config(base_config, mode, **extra):
    keys = dict(prompt_type="none", mlp="train", max_steps=6, eval_steps=100, save_steps=2, log_every=1,
                **MODES[mode])
    return base_config(**{**keys, **extra})


@pytest.mark.parametrize("mode", list(MODES))
def test_trains_without_a_prompt_through_packed_batches_and_fused_loss(base_config, mode):
    trainer = Trainer(_config(base_config, mode))
    trainer.setup()
    enc = trainer.encoder
    assert enc.prompt is None and enc.input_prompt is None and enc.packed
    assert trainer.method.sentence.backend != "reference"  # the fused contrastive loss
    backbone = [n for n, p in enc.named_parameters() if p.requires_grad and n.startswith("backbone.")]
    if mode == "lora":
        assert backbone and all(".lora_" in n for n in backbone)
        assert any("layer.1.output.dense.lora_B" in n for n in backbone)  # the feed-forward too (BERT's default)
        assert not any("pooler" in n for n in backbone)  # BERT's unused pooler is never adapted
        assert trainer.optimizer.param_groups[-1]["initial_lr"] == 1e-2
    before = {k: v.clone() for k, v in enc.backbone.state_dict().items()}
    assert trainer.train()["status"] == "completed"
    after = enc.backbone.state_dict()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    if mode == "lora":
        assert changed and all(".lora_" in k for k in changed)
        assert any("lora_B" in k for k in changed)
    else:
        assert "encoder.layer.0.attention.self.query.weight" in changed
    reloaded = PromptEncoder.load(trainer.best_dir).pack_sequences()  # packed like the trainer's: the same sums
    assert reloaded.prompt is None and (reloaded.lora is not None) == (mode == "lora")
    torch.testing.assert_close(reloaded.encode(SENTS), enc.encode(SENTS), atol=0, rtol=0)


def test_gradient_cache_gives_the_full_batch_gradients_with_lora_dropout(tiny_bert_dir):
    """The gradient cache replays each micro-batch's dropout, LoRA's adapter dropout included: its gradients equal
    the full batch's (tolerance as tests/train/test_backbone.py's: summation order only, atol = rtol = 1e-5)."""
    from fastprompt.data import Collator
    from fastprompt.methods.simcse.objective import SimCSE
    from fastprompt.model import PromptConfig
    from fastprompt.objectives import Method
    from fastprompt.train.distributed import DistributedContext
    from fastprompt.train.grad_cache import make_micro_batches, plan_micro_batches
    from fastprompt.train.steps import CachedStep, LossSide

    torch.manual_seed(0)
    enc = PromptEncoder.from_pretrained(tiny_bert_dir, prompt_config=PromptConfig(prompt_type="none"), pooler="cls",
                                        mlp="train").add_lora(rank=4, alpha=8.0, dropout=0.2).train()
    enc.pack_sequences()
    with torch.no_grad():
        for n, p in enc.backbone.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    method = Method(SimCSE(temperature=0.05))
    sents = [*SENTS, "it", "a woman is eating food in the park", "the cat sits"]
    batch = Collator(enc.tokenize, 32)([(s,) for s in sents])
    groups = plan_micro_batches(batch.attention_mask, 4)
    assert len(groups) > 1
    torch.manual_seed(5)
    reps = torch.empty(batch.rows, enc.hidden_size)
    for mb in make_micro_batches(batch.model_inputs(), groups):
        reps = reps.index_put((mb.rows,), enc(**mb.inputs, head=False))
    ref_loss = method.sentence(enc.pooler.head(reps).view(2, len(sents), -1)).loss
    ref_loss.backward()
    ref = {n: p.grad.clone() for n, p in enc.named_parameters() if p.grad is not None}
    assert any("lora_A" in n for n in ref)
    enc.zero_grad(set_to_none=True)
    torch.manual_seed(5)
    out = CachedStep(LossSide(method, enc, DistributedContext()), micro_batch_size=4, max_tokens=None)(batch, 0, 5)
    torch.testing.assert_close(torch.as_tensor(out.loss).detach(), ref_loss.detach(), atol=1e-5, rtol=1e-5)
    got = {n: p.grad.clone() for n, p in enc.named_parameters() if p.grad is not None}
    assert set(got) == set(ref)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


_KILLED_RUN = textwrap.dedent("""
    import json, os, signal, sys
    from fastprompt.train import Trainer
    cfg, kill_at = json.loads(sys.argv[1]), int(sys.argv[2])

    def kill(trainer, out):  # a real SIGKILL: no handler runs, nothing is flushed
        if trainer.state.global_step == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)

    Trainer(cfg, callbacks=[kill]).train()
""")


@pytest.mark.heavy  # a training process killed and resumed: ~15 s each
@pytest.mark.parametrize("mode,cache,prompt", [("lora", False, "none"), ("lora", True, "none"), ("full", True, "none"),
                                               ("lora", False, "prefix")])
def test_resumes_bit_for_bit_after_sigkill(base_config, tmp_path, mode, cache, prompt):
    """Both modes without a prompt (packed, the fused loss; the gradient cache too), and LoRA with a prefix."""
    extra = dict(micro_batch_size=3) if cache else {}
    extra.update(prompt_type=prompt, prompt_dropout=0.1 if prompt != "none" else 0.0)
    ref = _config(base_config, mode, output_dir=str(tmp_path / "ref"), **extra)
    Trainer(ref).train()
    cfg = dict(ref, output_dir=str(tmp_path / "run"))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run([sys.executable, "-c", _KILLED_RUN, json.dumps(cfg), "5"], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    saved = json.loads((tmp_path / "run" / "last" / "training_state.json").read_text())
    assert saved["trainer"]["state"]["global_step"] == 4
    assert Trainer(cfg).train()["status"] == "completed"
    for name in LAST_FILES[mode]:
        a, b = load_file(str(tmp_path / "run" / "last" / name)), load_file(str(tmp_path / "ref" / "last" / name))
        assert a.keys() == b.keys() and a
        for k in a:
            # numpy's global generator is the process's (pytest's or the killed child's), not drawn by the run
            if k != "rng.numpy.keys":
                assert torch.equal(a[k], b[k]), f"{name}: {k}"


def test_a_lora_checkpoint_loads_in_peft_and_encodes_alike(base_config, tiny_bert_dir):
    from peft import PeftModel
    from transformers import AutoModel

    trainer = Trainer(_config(base_config, "lora", max_steps=4, mlp="none", pooler="cls"))
    trainer.train()
    best = trainer.best_dir
    assert json.loads((best / "adapter_config.json").read_text())["peft_type"] == "LORA"
    peft = PeftModel.from_pretrained(AutoModel.from_pretrained(tiny_bert_dir), str(best)).eval()
    enc = PromptEncoder.load(best).pack_sequences()
    lora_b = [v for k, v in enc.backbone.state_dict().items() if "lora_B" in k]
    assert max(float(v.abs().max()) for v in lora_b) > 1e-3  # trained: the comparison would see a lost adapter
    tokens = enc.tokenize(SENTS)
    with torch.no_grad():
        expected = peft(**tokens).last_hidden_state[:, 0]
        base = AutoModel.from_pretrained(tiny_bert_dir).eval()(**tokens).last_hidden_state[:, 0]
    got = enc.encode(SENTS, normalize=False, convert_to_numpy=False)
    print("largest difference to PEFT:", float((got - expected).abs().max()))
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert float((got - base).abs().max()) > 1e-3


def test_using_weights_swaps_the_adapters_back(base_config):
    trainer = Trainer(_config(base_config, "lora", max_steps=2))
    trainer.train()
    enc = trainer.encoder
    before = enc.encode(SENTS)
    with torch.no_grad():
        for k, v in enc.backbone.state_dict().items():
            if "lora_B" in k:
                v.add_(0.5)
    moved = enc.encode(SENTS)
    with enc.using_weights(trainer.best_dir):
        torch.testing.assert_close(enc.encode(SENTS), before, atol=0, rtol=0)
    torch.testing.assert_close(enc.encode(SENTS), moved, atol=0, rtol=0)


@pytest.mark.parametrize("keys,message", [
    (dict(prompt_type="none"), r"prompt_type: none trains no prompt, and the backbone is frozen"),
    (dict(lora=True, train_backbone=True), r"lora: true and train_backbone: true both train the backbone"),
    (dict(prompt_type="none", lora=True, cls_prompt=True), r"prompt_type: none with cls_prompt: true"),
    (dict(prompt_type="none", lora=True, prefix_mode="cache"), r"prefix_mode: cache hands a prefix to the backbone"),
    (dict(lora=True, lora_target_modules=[]), r"lora_target_modules must list one or more module names"),
    (dict(lora=True, rtd_weight=0.05, rtd_discriminator="plain"), r"rtd_discriminator: plain runs the frozen"),
])
def test_meaningless_combinations_are_refused_before_work(keys, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**keys)


def test_unknown_lora_targets_are_refused(base_config):
    with pytest.raises(ValueError, match=r"lora_target_modules \['q_proj'\] match no linear layer of BertModel"):
        Trainer(_config(base_config, "lora", lora_target_modules=["q_proj"])).setup()


def test_resume_refuses_another_mode(base_config):
    cfg = _config(base_config, "lora", max_steps=2)
    Trainer(cfg).train()
    with pytest.raises(ValueError, match=r"LoRA \(lora=true\) run and cannot be resumed with lora=false"):
        Trainer(dict(cfg, lora=False, train_backbone=True, max_steps=4)).setup()
    prompt = base_config(max_steps=2, output_dir=cfg["output_dir"] + "-prompt")
    Trainer(prompt).train()
    with pytest.raises(ValueError, match=r"no-LoRA \(lora=false\) run and cannot be resumed with lora=true"):
        Trainer(dict(prompt, lora=True, max_steps=4)).setup()
