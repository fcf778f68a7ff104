"""Tiny chat models on real tokenizers (tests/tokenizers/, see its README), for tests of what real
checkpoints bring: several stop ids, a turn that ends with a token other than EOS, no pad token or a
pad equal to EOS, tied embeddings, a reward model with a tokenizer of its own.

Each policy is a random-init model (hidden 64, 2 layers, heads of 32 dims: vLLM's CPU attention needs
32) fine-tuned for a few steps on "What is a plus b?" -> "c." so that it answers briefly and ends its
turn as its chat template does. Built on first use, cached under runs/real/<name>/ as ordinary HF
checkpoints with the tokenizer's generation_config.json.

    python tests/real_models.py        # builds them all (about a minute on 2 CPU cores)
"""
import json
import lzma
import os
import random
import shutil

import torch
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer, GenerationConfig,
                          GPT2Config, LlamaConfig, MistralConfig, Qwen2Config)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(os.path.dirname(HERE), "runs", "real")
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, max_position_embeddings=256)
# name: (tokenizer folder, config, what the case is)
POLICIES = {
    "qwen2": ("qwen2", lambda v: Qwen2Config(vocab_size=v, tie_word_embeddings=True, **SMALL),
              "ChatML, eos <|im_end|>, generation_config eos [<|im_end|>, <|endoftext|>], tied embeddings"),
    "qwen2-base": ("qwen2", None, "the same weights with a base model's tokenizer: eos <|endoftext|>, turns end with "
                   "<|im_end|> (the chat template's)"),
    "llama": ("llama", lambda v: LlamaConfig(vocab_size=v, **SMALL), "Llama 2 SentencePiece, pad = eos"),
    "mistral": ("mistral", lambda v: MistralConfig(vocab_size=v, **SMALL), "Mistral v3 SentencePiece, no pad"),
    "gpt2": ("gpt2", lambda v: GPT2Config(vocab_size=v, n_embd=64, n_layer=2, n_head=2, n_positions=256,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
             "GPT-2 byte-level BPE, no pad, eos = bos = unk, learned absolute positions"),
}


def tokenizer_dir(name):
    """tests/tokenizers/<name> with tokenizer.json decompressed, under runs/real/tokenizers/<name>."""
    out = os.path.join(ROOT, "tokenizers", name)
    if not os.path.exists(os.path.join(out, "tokenizer.json")):
        os.makedirs(out, exist_ok=True)
        src = os.path.join(HERE, "tokenizers", name)
        for f in os.listdir(src):
            if f.endswith(".xz"):
                open(os.path.join(out, f[:-3]), "wb").write(lzma.open(os.path.join(src, f)).read())
            else:
                shutil.copy(os.path.join(src, f), out)
    return out


def question(rng):
    a, b = rng.randrange(10), rng.randrange(10)
    return f"What is {a} plus {b}?", f"{a + b}."


def rows(n, seed):
    """Prompt rows as ppo.py reads them: chat messages and the answer for the reward function."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        q, a = question(rng)
        out.append({"prompt": [{"role": "user", "content": q}], "answer": a})
    return out


def reward(prompts, responses, answer):
    """1 for a response that starts with the right sum, else 0 (a --reward-fn)."""
    return [float(r.strip().startswith(a)) for r, a in zip(responses, answer)]


def write_prompts(path, n=256, seed=0):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows(n, seed))
    return path


def finetune(model, tok, steps=80, batch=8, lr=5e-3, seed=0):
    """A few steps of SFT on the rendered chats, so that the policy answers and ends its turn."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    model.train()
    for _ in range(steps):
        texts = []
        for _ in range(batch):
            q, a = question(rng)
            texts.append(tok.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                                                 tokenize=False))
        ids = [tok(t, add_special_tokens=False).input_ids for t in texts]
        L = max(map(len, ids))
        x = torch.tensor([i + [pad] * (L - len(i)) for i in ids])
        am = torch.tensor([[1] * len(i) + [0] * (L - len(i)) for i in ids])
        loss = model(input_ids=x, attention_mask=am, labels=x.masked_fill(am == 0, -100)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval(), loss.item()


def build(name):
    """The policy checkpoint folder of a case (built once)."""
    path = os.path.join(ROOT, name)
    if os.path.exists(os.path.join(path, "done.json")):
        return path
    tok_name, make_config, _ = POLICIES[name]
    if name == "qwen2-base":  # the qwen2 policy, with a base model's tokenizer and generation config
        src = build("qwen2")
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(src, path)
        os.remove(os.path.join(path, "done.json"))
        tok = AutoTokenizer.from_pretrained(path)
        tok.eos_token = "<|endoftext|>"
        tok.save_pretrained(path)
        eos = tok.convert_tokens_to_ids("<|endoftext|>")
        GenerationConfig(bos_token_id=eos, eos_token_id=eos).save_pretrained(path)
        json.dump({"sft_loss": None}, open(os.path.join(path, "done.json"), "w"))
        return path
    tdir = tokenizer_dir(tok_name)
    tok = AutoTokenizer.from_pretrained(tdir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config(len(tok)))
    model, loss = finetune(model, tok)
    shutil.rmtree(path, ignore_errors=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    GenerationConfig.from_pretrained(tdir).save_pretrained(path)  # the checkpoint's stop ids
    json.dump({"sft_loss": loss}, open(os.path.join(path, "done.json"), "w"))
    return path


def reward_model(tok_name="gpt2"):
    """A random-init scalar reward model on another real tokenizer (GPT-2's has no pad token)."""
    path = os.path.join(ROOT, f"rm-{tok_name}")
    if not os.path.exists(os.path.join(path, "config.json")):
        tok = AutoTokenizer.from_pretrained(tokenizer_dir(tok_name))
        torch.manual_seed(1)
        cfg = GPT2Config(vocab_size=len(tok), n_embd=64, n_layer=2, n_head=2, n_positions=256, num_labels=1,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0)
        AutoModelForSequenceClassification.from_config(cfg).save_pretrained(path)
        tok.save_pretrained(path)
    return path


if __name__ == "__main__":
    for name in POLICIES:
        print(name, build(name), json.load(open(os.path.join(build(name), "done.json"))))
