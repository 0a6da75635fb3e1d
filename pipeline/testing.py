"""Tiny random models and a locally trained tokenizer for tests and `make smoke` (no hub ids, no downloads).

`make_tiny_model_dir(out, family)` writes a folder that `AutoTokenizer.from_pretrained` and
`AutoModelForCausalLM.from_pretrained` load exactly like a real model: a byte-level BPE tokenizer trained here
on tool-calling text, with a Qwen-style chat template that renders `tools=` and assistant `tool_calls`
(`<tool_call>{json}</tool_call>`), and a 2-layer random causal LM of the Llama, Qwen2 or Qwen3 family.

Run as: python -m pipeline.testing OUT_DIR [--family qwen2]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

FAMILIES = ("llama", "qwen2", "qwen3")  # the sidecar wave's tiny families; make_config also builds "gemma3" (targets)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]

# Qwen2.5-style template, reduced to what the pipeline needs: system, tools block, user/assistant/tool turns,
# assistant tool_calls rendered as <tool_call> JSON, and the generation prompt.
CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}{{ \"\\n\\n\" }}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ \"\\n\" }}{{ tool | tojson }}{% endfor %}{{ \"\\n\" }}</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}"
    "{% elif message.role == 'assistant' %}"
    "<|im_start|>assistant\n{% if message.content %}{{ message.content }}{% endif %}"
    "{% if message.tool_calls %}{% for tc in message.tool_calls %}"
    "{% set f = tc.function if tc.function is defined else tc %}"
    "{% if not loop.first or message.content %}{{ \"\\n\" }}{% endif %}"
    "<tool_call>\n{\"name\": \"{{ f.name }}\", \"arguments\": {{ f.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS_WORDS = (
    "the a of to and in is for on with what weather city unit celsius fahrenheit paris london tokyo new york "
    "temperature date time user query function name arguments parameters properties type object string integer "
    "number boolean array items enum required description default true false null get set add search find book "
    "hotel flight alarm meeting reminder calculator expression location query limit id token api request "
    "please can you me my tell how much many when where who which call tool tools response result json "
    "hello thanks sure here is the answer 0 1 2 3 4 5 6 7 8 9 10 100 2023 2024 2026 am pm java javascript python"
)


def _corpus() -> list[str]:
    words = _CORPUS_WORDS.split()
    lines = []
    for i in range(len(words)):
        chunk = words[i:i + 8]
        lines.append(" ".join(chunk))
        call = {"name": f"get_{words[i]}", "arguments": {w: (i * 7 + j) if j % 2 else w.title()
                                                         for j, w in enumerate(chunk[:3])}}
        lines.append("<tool_call>\n" + json.dumps(call) + "\n</tool_call>")
        lines.append(json.dumps(call, indent=2))
        lines.append("```json\n" + json.dumps(call, indent=2) + "\n```")
        lines.append(json.dumps({"type": "function", "function": {"name": words[i], "description": " ".join(chunk),
                                 "parameters": {"type": "object", "properties": {chunk[0]: {"type": "string"}},
                                                "required": [chunk[0]]}}}))
    return lines * 3


def make_tokenizer(vocab_size: int = 600):
    """A byte-level BPE tokenizer trained on a small built-in corpus, wrapped as a PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=["<|im_start|>", "<tool_call>", "</tool_call>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "left"
    return fast


def make_config(family: str, vocab_size: int, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                intermediate: int = 128, max_positions: int = 4096):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv_heads, intermediate_size=intermediate, max_position_embeddings=max_positions,
                  tie_word_embeddings=True)
    if family == "llama":
        return LlamaConfig(**common)
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "qwen3":
        return Qwen3Config(head_dim=hidden // heads, **common)
    if family == "gemma3":  # Gemma 3's text model: a sliding-window layer, then a full one (window 32 tokens, so a
        from transformers import Gemma3TextConfig  # test prompt is longer than it)

        return Gemma3TextConfig(head_dim=hidden // heads, sliding_window=32, query_pre_attn_scalar=hidden // heads,
                                layer_types=["sliding_attention", "full_attention"] * (layers // 2)
                                + ["sliding_attention"] * (layers % 2), **common)
    raise ValueError(f"unknown tiny model family {family!r}; expected one of {(*FAMILIES, 'gemma3')}")


def make_tiny_model(family: str = "qwen2", tokenizer=None, seed: int = 0, dtype=None, **config_kw):
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = tokenizer or make_tokenizer()
    config = make_config(family, vocab_size=len(tokenizer), **config_kw)
    config.eos_token_id = tokenizer.eos_token_id  # <|im_end|> for the tiny tokenizer, a family's own for fixtures
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = None
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if dtype is not None:
        model = model.to(dtype)
    model.generation_config.eos_token_id = config.eos_token_id
    model.generation_config.pad_token_id = config.pad_token_id
    model.eval()
    return model, tokenizer


def make_tiny_model_dir(out: str | Path, family: str = "qwen2", seed: int = 0, **config_kw) -> Path:
    """Write a tiny model + tokenizer folder (idempotent: an existing complete folder is reused)."""
    out = Path(out)
    if (out / "config.json").exists() and (out / "tokenizer_config.json").exists():
        return out
    model, tok = make_tiny_model(family, seed=seed, **config_kw)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def tiny_target(family: str, tokenizer=None, scale: float = 0.3, seed: int = 1, tree: bool | None = None,
                attn: str | None = None):
    """A tiny float64 runtime `Target` whose greedy output depends on its context (weights ~ N(0, scale^2)): a
    small-scale random model just repeats one token."""
    import torch

    from .runtime.target import Target

    model, tok = make_tiny_model(family, tokenizer=tokenizer, dtype=torch.float64)
    if attn:
        model.config._attn_implementation = attn
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)
    return Target(model, tok, tree=tree, name=f"tiny-{family}")


def build_tiny_serving_model(path: str | Path) -> Path:
    """A tiny random Qwen2 folder (float32) whose greedy text varies with the prompt (`tiny_target`'s weights): what
    recipes/serve/tiny.yaml serves for scripts/bench_serve.py and scripts/soak_serve.py."""
    import torch

    target = tiny_target("qwen2")
    target.model.to(torch.float32).save_pretrained(path)
    target.tokenizer.save_pretrained(path)
    return Path(path)


class ScriptDrafter:
    """Proposes the true continuation (ar's tokens) as a tree, corrupted in a cycle of ways."""

    def __init__(self, script):
        self.script, self.rounds = script, 0

    def propose(self, ctx):
        at = len(ctx.output)
        true = self.script[at:at + 6]
        if not true:
            return []
        bad = lambda i: true[:i] + [true[i] + 1] + true[i + 1:] if i < len(true) else true  # noqa: E731
        mode, self.rounds = self.rounds % 4, self.rounds + 1
        if mode == 0:
            return [true]                        # full accept: a chain, cropped
        if mode == 1:
            return [bad(2)]                      # partial accept: the rejected tail is cropped
        if mode == 2:
            return [bad(0), bad(1), bad(3), true]  # the right path is the last branch: KV gathered into place
        return []                                # nothing to verify: a plain decode step


def teach(model, examples: list[tuple[list[int], list[int]]], steps: int = 300, lr: float = 5e-3) -> None:
    """Train a tiny model in place to answer each (prompt ids, answer ids) example (loss on the answer only), so that
    greedy decoding writes real tool calls (the hint tests: a random model writes none)."""
    import torch

    seqs = []
    for prompt, answer in examples:
        ids = torch.tensor([list(prompt) + list(answer)])
        labels = ids.clone()
        labels[0, :len(prompt)] = -100  # learn the answer only
        seqs.append((ids, labels))
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    for step in range(steps):
        ids, labels = seqs[step % len(seqs)]
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()


def write_gguf(model, tokenizer, path: str | Path, *, quant: str | None = None, chat_template: str | None = None) -> Path:
    """A tiny Qwen2 transformers model as a GGUF that llama.cpp and transformers load: its weights under llama.cpp's
    tensor names (the gguf package's own map; no output.weight when the embeddings are tied), in F32 or, with `quant`
    ("q8_0" / "q4_0"), its matrices quantized (what `make models` de-quantizes; Q4_0 is what llama.cpp's
    CPU repack takes on x86), and the byte-level BPE tokenizer (tokens, merges, special tokens as control,
    `chat_template` when given)."""
    import gguf
    import numpy as np

    cfg = model.config
    if cfg.model_type != "qwen2":
        raise ValueError(f"write_gguf writes Qwen2 models; got {cfg.model_type!r}")
    arch = gguf.MODEL_ARCH.QWEN2
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    rope = getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 1e6)
    writer.add_rope_freq_base(float(rope))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    qtype = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0, None: None}[quant]
    writer.add_file_type({"q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
                          None: gguf.LlamaFileType.ALL_F32}[quant])
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    special = set(tokenizer.all_special_ids)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list([by_id[i] for i in range(len(tokenizer))])
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                            for i in range(len(tokenizer))])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    if "<|endoftext|>" in tokenizer.get_vocab():
        writer.add_bos_token_id(tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    writer.add_eos_token_id(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied to the embeddings: a GGUF without output.weight
        array = np.ascontiguousarray(tensor.detach().float().numpy(), dtype=np.float32)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if qtype is not None and array.ndim == 2 and array.shape[1] % 32 == 0:
            q = gguf.quants.quantize(array, qtype)
            writer.add_tensor(gguf_name, q, raw_shape=q.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(path)


def resolve_sidecar_recipe(path: str | Path, recipe: dict | None = None) -> dict:
    """`stages.train.from_recipe` of one sidecar recipe, for the tests that resolve every recipe in the repo. A recipe that
    continues an adapter no longer in the tree (`train.init_adapter`; v4's v3 lives in git history only) must fail
    naming that folder; the rest of it is then resolved as if it started from scratch."""
    import copy

    from .io import InputError
    from .stages import train

    recipe = train.load_recipe(path) if recipe is None else recipe
    init = (recipe.get("train") or {}).get("init_adapter")
    if init and not (Path(init) / "adapter_config.json").is_file():
        try:
            train.from_recipe(copy.deepcopy(recipe), str(path))
        except InputError as e:
            if str(init) not in str(e):
                raise
        else:
            raise AssertionError(f"{path}: init_adapter {init} is missing, yet the recipe resolved")
        recipe = copy.deepcopy(recipe)
        recipe["train"]["init_adapter"] = None
        recipe["train"].pop("init_grow", None)
    return train.from_recipe(recipe, str(path))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--family", default="qwen2", choices=FAMILIES)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(make_tiny_model_dir(args.out, args.family, args.seed))


# --- servers a test starts -------------------------------------------------------------------------------------

def free_port() -> int:
    """A free TCP port on loopback (for a server a test starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(port: int, proc, limit_s: float = 240.0) -> None:
    """Until the server `proc` started answers /health with 200 (AssertionError with its stderr if it exits)."""
    import time
    import urllib.request

    end = time.time() + limit_s
    while time.time() < end:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}: {proc.stderr.read()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"server not healthy after {limit_s} s")


def alive(p) -> bool:
    """Whether a psutil process still runs (a zombie does not)."""
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def still_running(children, within_s: float) -> list[tuple[int, str]]:
    """(pid, command line) of the `children` (psutil processes) still alive `within_s` seconds from now."""
    import time

    end = time.time() + within_s
    while time.time() < end and any(alive(c) for c in children):
        time.sleep(0.1)
    return [(c.pid, " ".join(c.cmdline())[:120]) for c in children if alive(c)]



if __name__ == "__main__":
    main()
