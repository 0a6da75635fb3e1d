"""Request conversion, the forced tool_choice prefix and the recipe -> engine path (no HTTP)."""

from __future__ import annotations


import pytest

from pipeline.io import InputError
from pipeline.recipes import load_recipe
from pipeline.requests import render_prompt
from pipeline.runtime.target import encode
from pipeline.serve.cli import ServeConfig, build_engine
from pipeline.serve.engine import Engine, forced_prefix
from pipeline.serve.protocol import ApiError, parse_chat

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def chat(**body):
    return parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]} | body, "m")


def test_request_becomes_canonical():
    c = chat(messages=[{"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
                       {"role": "user", "content": "weather?"},
                       {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                       {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}],
             tools=TOOLS, max_tokens=7)
    assert set(c.request) == {"id", "messages", "tools"} and c.request["id"].startswith("chatcmpl-")
    assert c.request["messages"][0] == {"role": "system", "content": "be brief"}
    assert c.request["messages"][2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert c.request["messages"][3]["tool_call_id"] == "call_1"
    assert c.request["tools"] == TOOLS and c.max_tokens == 7 and c.tool_choice == "auto" and c.find_calls
    none = chat(tools=TOOLS, tool_choice="none")
    assert none.request["tools"] == [] and not none.find_calls


@pytest.mark.parametrize("body, status, needle", [
    ({"model": "other"}, 404, "'other'"),
    ({"messages": []}, 400, "messages"),
    ({"temperature": 0.2}, 400, "greedily"),
    ({"response_format": {"type": "json_object"}}, 400, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]}, 400, "'f'"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, 400, "sometimes"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "text"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": "f", "arguments": "{oops"}}]}]}, 400, "arguments is not valid JSON"),
    ({"chat_template_kwargs": {"tokenize": True}}, 400, "'tokenize' is not a template variable"),
    ({"chat_template_kwargs": ["enable_thinking"]}, 400, "chat_template_kwargs: expected an object"),
])
def test_bad_requests_name_the_problem(body, status, needle):
    with pytest.raises(ApiError) as e:
        chat(**body)
    assert e.value.status == status and needle in e.value.message
    assert set(e.value.body()["error"]) == {"message", "type", "param", "code"}


def test_forced_prefix_in_each_call_format(tiny):
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    required = chat(tools=TOOLS, tool_choice="required")
    assert forced_prefix(tiny.tok, named) == '<tool_call>\n{"name": "get_weather"'   # the tiny template's format
    assert forced_prefix(tiny.tok, required) == '<tool_call>\n{"name": "'
    assert forced_prefix(tiny.tok, named, "fenced") == '```json\n{\n  "name": "get_weather"'
    assert forced_prefix(tiny.tok, named, "compact") == '{"name": "get_weather"'
    assert forced_prefix(tiny.tok, chat(tools=TOOLS)) == ""


def test_forced_prefix_ends_the_prompt(tiny):
    target = tiny.target()
    engine = Engine(target, "ar", max_context=4096)
    c = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    job = engine.prepare(c)
    rendered = render_prompt(target.tokenizer, c.request)
    assert job.prefix == '<tool_call>\n{"name": "get_weather"'
    assert job.prompt_tokens == len(encode(target.tokenizer, rendered + job.prefix))
    assert job.max_new_tokens == 256
    small = Engine(target, "ar", max_context=job.prompt_tokens + 5)
    assert small.prepare(c).max_new_tokens == 5  # max_tokens is clipped to what the context has left
    with pytest.raises(ApiError) as e:
        Engine(target, "ar", max_context=job.prompt_tokens).prepare(c)
    assert e.value.code == "context_length_exceeded"


def test_chat_template_kwargs_reach_the_prompt(tiny):
    """The recipe's template variables (`Target.chat_template_kwargs`) and a body's `chat_template_kwargs` over them
    render the prompt the engine measures and the loop prefills."""
    import copy

    from pipeline.serve.engine import Prompted

    target = tiny.target()
    target.tokenizer = copy.deepcopy(target.tokenizer)
    target.tokenizer.chat_template = ("{% if brief %}Answer briefly.\n{% endif %}{% for m in messages %}"
                                      "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
    engine = Engine(target, "ar", max_context=4096)
    plain, brief = chat(), chat(chat_template_kwargs={"brief": True})
    assert brief.chat_template_kwargs == {"brief": True} and plain.chat_template_kwargs is None
    text = target.tokenizer.decode(Prompted(target, "", brief.chat_template_kwargs).prompt_ids(brief.request))
    assert text.startswith("Answer briefly.") and "Answer" not in target.tokenizer.decode(
        Prompted(target, "").prompt_ids(plain.request))
    assert engine.prepare(brief).prompt_tokens > engine.prepare(plain).prompt_tokens
    target.chat_template_kwargs = {"brief": True}   # the recipe's default; a body's False wins for its request
    assert engine.prepare(plain).prompt_tokens == engine.prepare(brief).prompt_tokens
    assert engine.prepare(chat(chat_template_kwargs={"brief": False})).prompt_tokens < engine.prepare(plain).prompt_tokens
    with pytest.raises(InputError, match="serve.chat_template_kwargs"):
        ServeConfig.from_recipe(load_recipe("recipes/serve/tiny.yaml", ["serve.chat_template_kwargs={tokenize: true}"]))


def test_recipes_load_and_reject_unknown_keys():
    for path in ("recipes/serve/tiny.yaml", "recipes/serve/qwen2.5-coder-1.5b-cpu.yaml"):
        cfg = ServeConfig.from_recipe(load_recipe(path), path)
        assert cfg.method == "ooo" and cfg.sidecar["model"] and cfg.queue_size >= 1
    with pytest.raises(InputError, match="unknown key"):
        ServeConfig.from_recipe(load_recipe("recipes/serve/tiny.yaml", ["serve.batch=4"]))
    with pytest.raises(InputError, match="method"):
        ServeConfig.from_recipe(load_recipe("recipes/serve/tiny.yaml", ["serve.method=fast"]))
    assert ServeConfig.from_recipe(load_recipe("recipes/serve/tiny.yaml", ["serve.max_body_bytes=1024"])).max_body_bytes \
        == 1024
    for bad_size in ("0", "-5", "big", "true"):
        with pytest.raises(InputError, match="serve.max_body_bytes"):
            ServeConfig.from_recipe(load_recipe("recipes/serve/tiny.yaml", [f"serve.max_body_bytes={bad_size}"]))


def test_build_engine_stops_on_a_missing_sidecar_and_runs_without_an_adapter(tmp_path, monkeypatch):
    from pipeline.testing import make_tiny_model_dir

    import torch

    from pipeline.hardware import available_cores

    monkeypatch.setenv("OOO_COST_DIR", str(tmp_path / "cost"))
    threads = torch.get_num_threads()
    model = make_tiny_model_dir(tmp_path / "tiny")
    base = [f"serve.target={model}", "serve.warmup=false", "serve.schedule=colocated",
            "serve.chat_template_kwargs={brief: true}"]
    # a missing sidecar model or adapter stops start-up, naming the folder and the command that builds it
    with pytest.raises(InputError, match=r"sidecar model folder .*missing not found: build it with `make models`"):
        build_engine(ServeConfig.from_recipe(load_recipe("recipes/serve/tiny.yaml", base + [
            f"serve.sidecar.model={tmp_path / 'missing'}"])))
    with pytest.raises(InputError, match=r"no-adapter/adapter_config.json not found: .*`make train`"):
        build_engine(ServeConfig.from_recipe(load_recipe("recipes/serve/tiny.yaml", base + [
            f"serve.sidecar.model={model}", f"serve.sidecar.adapter={tmp_path / 'no-adapter'}"])))
    cfg = ServeConfig.from_recipe(load_recipe("recipes/serve/tiny.yaml", base + [
        f"serve.sidecar.model={model}", "serve.sidecar.adapter=null"]))
    engine = build_engine(cfg)
    assert engine.method == "ooo" and engine.sidecar.factory_kwargs["adapter"] is None
    assert engine.model_name == "tiny" and engine.max_context == 1024
    assert engine.target.chat_template_kwargs == {"brief": True}  # the recipe's template variables
    assert engine.sidecar.factory_kwargs["cores"] == available_cores()  # colocated: the same cores
    assert engine.schedule.name == "colocated" and engine.target.curve is not None  # tree budget calibrated
    engine.close()
    torch.set_num_threads(threads)
    with pytest.raises(InputError, match="not found"):
        build_engine(ServeConfig.from_recipe(load_recipe("recipes/serve/tiny.yaml", [
            f"serve.target={tmp_path / 'nothing'}"])))


def test_one_tenants_calls_never_draft_for_another(tiny):
    """Histories are per tenant (API key digest, else `user`): tenant A's call is in A's history drafter and not in
    B's; with shared_history both see it; the LRU keeps at most history_tenants."""
    from pipeline.serve import Engine
    from pipeline.serve.protocol import parse_chat

    body = {"model": "scripted", "messages": [{"role": "user", "content": "weather in Paris?"}],
            "tools": tiny.requests[0]["tools"]}
    for shared in (False, True):
        engine = Engine(tiny.scripted(), "toolspec", model_name="scripted", max_context=4096,
                        shared_history=shared, history_tenants=2)
        a = engine.prepare(parse_chat(body, "scripted", api_key="key-A"))
        out = engine.execute(a)
        assert '"get_weather"' in out.text
        written = engine.target.tokenizer.encode(out.text, add_special_tokens=False)
        probe = written[:6]
        drafts = {t: engine.history_for(t).index.lookup(probe, 8, 1)
                  for t in (a.chat.tenant, parse_chat(dict(body, user="bob"), "scripted").tenant)}
        assert drafts[a.chat.tenant], "A's own call drafts for A"
        assert bool(drafts["user:bob"]) is shared, "B sees A's call only when histories are shared"
        assert a.chat.tenant.startswith("key:") and "key-A" not in a.chat.tenant  # only a digest of the key
        for t in ("user:c", "user:d", "user:e"):
            engine.history_for(t)
        assert len(engine.histories) <= 2


def test_one_tenants_prompt_cache_never_serves_another(tiny):
    """The prefix cache is partitioned by tenant (and by a body's `cache_salt`, vLLM's field): B's identical prompt
    is prefilled cold after A's, A's second request reuses A's KV; with shared_prefix_cache B reuses it too."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": "weather in Paris?"}],
            "tools": tiny.requests[0]["tools"], "max_tokens": 4}
    for shared in (False, True):
        engine = Engine(tiny.target(), "ar", model_name="tiny", max_context=4096, shared_prefix_cache=shared)

        def cached(engine=engine, **extra):
            job = engine.prepare(parse_chat(body | extra, "tiny"))
            return engine.execute(job).stats.cached_tokens

        assert cached(user="alice") == 0
        assert cached(user="alice") > 0, "a tenant reuses its own prompt's KV"
        assert (cached(user="bob") > 0) is shared, "another tenant's KV only when the cache is shared"
        assert cached(user="alice", cache_salt="s1") == 0  # a salt of its own: a partition of its own
        assert engine.cache_salt(chat(user="x", cache_salt="s1")) == ("s1" if shared else "user:x|s1")
    with pytest.raises(ApiError, match="cache_salt"):
        chat(cache_salt=7)
